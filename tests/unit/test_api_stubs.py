"""The committed stubs match the protos, and the protos pass Buf STANDARD lint."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from services.protogen import DEFAULT_OUT, PACKAGE_DIR, REPO_ROOT, generate


def test_committed_stubs_are_current(tmp_path):
    fresh = generate(tmp_path)
    assert fresh, "no stubs generated"
    committed = DEFAULT_OUT / PACKAGE_DIR
    stale = [
        p.name
        for p in fresh
        if p.parent.name == committed.name
        if not (committed / p.name).exists() or (committed / p.name).read_text() != p.read_text()
    ]
    extra = sorted(
        {p.name for p in committed.glob("*.py*")}
        - {p.name for p in fresh if p.parent.name == committed.name}
    )
    assert not stale and not extra, (
        f"stubs are stale (changed: {stale}, no longer generated: {extra}); "
        "run `python -m services.protogen` and commit the result"
    )


@pytest.mark.skipif(shutil.which("npx") is None, reason="npx (Node.js) is not installed")
def test_protos_pass_buf_standard_lint():
    result = subprocess.run(
        ["npx", "--yes", "@bufbuild/buf", "lint"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if (
        result.returncode != 0
        and "buf" not in result.stdout + result.stderr
        and "proto" not in result.stdout
    ):
        pytest.skip(f"could not run buf through npx: {result.stderr.strip()[-300:]}")
    assert result.returncode == 0, result.stdout + result.stderr
