"""Checkpoints under a non-ASCII directory, read by a process whose locale does not
decode file names as UTF-8 (a user's shell with LC_ALL=C and Python's locale coercion
off, or a Latin-1 locale): Python then holds the name in another form than the bytes on
disk, which the tokenizers library, taking path strings as UTF-8, could not open."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from monitor_agent.engine.engine import Engine
    from services.models.checkpoint import create_checkpoint, validate_checkpoint

    assert sys.getfilesystemencoding() == "ascii", sys.getfilesystemencoding()
    (parent,) = [Path(sys.argv[1]) / name for name in os.listdir(sys.argv[1])]
    ckpt = create_checkpoint(
        parent / "ckpt", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64
    )
    assert validate_checkpoint(ckpt).has_tokenizer
    engine = Engine(ckpt, max_seq_len=32, max_batch=1, num_threads=1)
    print(len(engine.encode("hello")))
    """
)


def test_a_checkpoint_under_a_non_ascii_directory_in_an_ascii_locale(tmp_path):
    (tmp_path / "modèles ü").mkdir()
    env = {
        **os.environ,
        "LC_ALL": "C",
        "LANG": "C",
        "PYTHONCOERCECLOCALE": "0",
        "PYTHONUTF8": "0",
        "PYTHONIOENCODING": "utf-8",
    }
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert int(child.stdout.strip()) > 0


def test_the_stack_s_processes_read_file_names_as_utf8_whatever_the_locale(monkeypatch, tmp_path):
    """The agent got a checkpoint path under "demo llama é" over gRPC and could not stat
    it with LC_ALL=C and PYTHONUTF8=0 (UnicodeEncodeError, 5 restarts; a tester): the
    stack's processes run in Python's UTF-8 mode."""
    from services.cli.stack import UpOptions, _service_env
    from services.settings import load_settings

    monkeypatch.setenv("PYTHONUTF8", "0")
    monkeypatch.setenv("LC_ALL", "C")
    env = _service_env(
        load_settings({"ISERVE_STATE_DIR": str(tmp_path)}), "redis://x", UpOptions(), "s"
    )
    assert env["PYTHONUTF8"] == "1"
    child = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.getfilesystemencoding())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.stdout.strip() == "utf-8", child.stderr
