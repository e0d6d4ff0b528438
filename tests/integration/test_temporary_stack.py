"""A benchmark's stack (``temporary_stack``) stops with the process that started it,
also when that process is sent SIGTERM (``timeout``, a closed terminal): a probe found
its Redis, services and workers running on after ``timeout 60 bench/trace_replay.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import wait_for

pytestmark = pytest.mark.integration

HOLDER = """
import sys, time
from pathlib import Path
from services.cli.stack import temporary_stack
with temporary_stack(state_dir=Path(sys.argv[1])) as settings:
    print("up", flush=True)
    time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose; read its state.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_sigterm_stops_the_temporary_stack(tmp_path):
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    with (tmp_path / "stderr").open("w+") as stderr:
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(state)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
        try:
            assert holder.stdout.readline().strip() == "up", stderr.read()
            pids = json.loads((state / "stack.json").read_text())["pids"]
            assert pids and all(_alive(p) for p in pids.values())
            holder.send_signal(signal.SIGTERM)
            try:
                holder.wait(timeout=120)
            except subprocess.TimeoutExpired:
                stderr.seek(0)
                pytest.fail(f"SIGTERM did not end it; it printed: {stderr.read()}")
            assert wait_for(lambda: not any(_alive(p) for p in pids.values()), timeout=30), pids
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()
                # What it left running fails this test alone, not the whole session.
                subprocess.run(
                    [sys.executable, "-m", "services.cli.main", "down"],
                    env={**env, "ISERVE_STATE_DIR": str(state)},
                    capture_output=True,
                    timeout=120,
                )
