"""Shared-memory collectives: real processes exchanging through /dev/shm (tests.unit.shm_harness)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from monitor_agent.engine import shm_collectives
from monitor_agent.engine.shm_collectives import channel_pairs, shared_memory_wanted
from services.ports import free_port
from tests.unit.shm_harness import inputs

PROJECT_ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 90

pytestmark = pytest.mark.skipif(
    not shared_memory_wanted(), reason="shared-memory collectives need x86-64 Linux"
)


def run_ranks(
    scenario: str, world: int, out: Path, *, timeout_s: float = 30.0, env: dict | None = None
) -> list[subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    rendezvous = f"127.0.0.1:{free_port()}"
    procs = []
    for rank in range(world):
        argv = [
            sys.executable, "-m", "tests.unit.shm_harness", "--rank", str(rank),
            "--world", str(world), "--rendezvous", rendezvous, "--out", str(out),
            "--scenario", scenario, "--timeout-s", str(timeout_s),
        ]  # fmt: skip
        log = open(out / f"rank-{rank}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                argv,
                cwd=PROJECT_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        )
    try:
        for rank, proc in enumerate(procs):
            code = proc.wait(RUN_TIMEOUT_S)
            assert code == 0, (out / f"rank-{rank}.log").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return procs


def leftover_files(procs) -> list[str]:
    return [f for p in procs for f in glob.glob(f"/dev/shm/iserve-{p.pid}-*")]


def test_channels_cover_every_message_a_step_sends() -> None:
    assert channel_pairs(2, 1) == [(0, 1), (1, 0)]
    assert channel_pairs(1, 2) == [(0, 1), (1, 0)]
    # tp 2 × pp 2: header/batch from 0, all-reduce within stages, hidden states forward,
    # logits from the last stage's tensor rank 0.
    assert channel_pairs(2, 2) == [(0, 1), (0, 2), (0, 3), (1, 0), (1, 3), (2, 0), (2, 3), (3, 2)]
    assert channel_pairs(1, 4) == [(0, 1), (0, 2), (0, 3), (1, 2), (2, 3), (3, 0)]


def test_transport_choice_is_checked(monkeypatch) -> None:
    monkeypatch.setenv(shm_collectives.ENV, "gloo")
    assert not shared_memory_wanted()
    monkeypatch.setenv(shm_collectives.ENV, "tcp")
    with pytest.raises(ValueError, match="must be 'shm' or 'gloo'"):
        shared_memory_wanted()


def test_three_ranks_exchange_exact_results_and_leave_no_file(tmp_path) -> None:
    world = 3
    procs = run_ranks("exchange", world, tmp_path)
    parts = [inputs(r) for r in range(world)]
    big = parts[0]["big"].clone()
    bf16 = parts[0]["bf16"].clone()
    for p in parts[1:]:  # rank order, as every rank adds
        big.add_(p["big"])
        bf16.add_(p["bf16"])
    for rank in range(world):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(got["big"], big), f"rank {rank}"
        assert torch.equal(got["bf16"], bf16), f"rank {rank}"
        assert torch.equal(got["broadcast"], parts[0]["broadcast"]), f"rank {rank}"
        assert torch.equal(got["chain"], parts[(rank - 1) % world]["chain"]), f"rank {rank}"
    assert leftover_files(procs) == []


def test_opting_out_keeps_gloo_on_every_rank(tmp_path) -> None:
    run_ranks("optout", 2, tmp_path, env={shm_collectives.ENV: "gloo"})
    for rank in range(2):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == {"opened": False}


def test_a_message_of_the_wrong_size_is_an_error(tmp_path) -> None:
    run_ranks("mismatch", 2, tmp_path)
    error = json.loads((tmp_path / "1.json").read_text())["error"]
    assert "out of step" in error and "rank 0" in error


def test_a_peer_that_exits_is_noticed_at_once(tmp_path) -> None:
    started = time.monotonic()
    run_ranks("die", 2, tmp_path, timeout_s=60)
    report = json.loads((tmp_path / "0.json").read_text())
    assert "exited" in report["error"] and "rank 1" in report["error"]
    assert report["waited_s"] < 10 and time.monotonic() - started < RUN_TIMEOUT_S


def test_a_peer_gone_while_the_group_sets_up_leaves_no_file(tmp_path) -> None:
    """Rank 0 unlinked its file only after every rank had mapped it: a setup that
    raised left 2 MiB of /dev/shm behind for good."""
    procs = run_ranks("die_in_setup", 2, tmp_path)
    assert json.loads((tmp_path / "0.json").read_text())["error"]
    assert leftover_files(procs) == []


def test_the_agent_removes_the_file_of_a_rank_killed_while_setting_up(tmp_path) -> None:
    """SIGKILL leaves no time for an unlink: the agent, which reaps the process, removes
    what its pid named (monitor_agent.shm_files)."""
    from monitor_agent.supervisor import WorkerProcess

    made = tmp_path / "made"
    code = (
        "import sys, time; from monitor_agent.shm_files import new_shared_file_name; "
        "name = new_shared_file_name(); open(name, 'w').close(); "
        "open(sys.argv[1], 'w').write(name); time.sleep(60)"
    )
    popen = subprocess.Popen([sys.executable, "-c", code, str(made)], cwd=PROJECT_ROOT)
    try:
        deadline = time.monotonic() + 30
        while not made.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        name = made.read_text()
        assert os.path.exists(name)
        worker = WorkerProcess("d", None, popen, tmp_path / "log", tmp_path / "ready", None)
        assert worker.alive
        popen.kill()
        popen.wait()
        assert not worker.alive
        assert not os.path.exists(name)
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()


def test_a_silent_peer_times_out(tmp_path) -> None:
    run_ranks("silent", 2, tmp_path, timeout_s=0.5)
    report = json.loads((tmp_path / "0.json").read_text())
    assert "timed out" in report["error"]
    assert 0.5 <= report["waited_s"] < 5


def test_a_full_shm_filesystem_means_gloo_and_no_file_left(monkeypatch) -> None:
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm_collectives.os, "posix_fallocate", full)
    before = set(glob.glob(f"/dev/shm/iserve-{os.getpid()}-*"))
    assert shm_collectives._create(1 << 20, b"token") is None
    assert set(glob.glob(f"/dev/shm/iserve-{os.getpid()}-*")) == before


def test_files_of_processes_that_are_gone_are_removed_and_live_ones_kept(tmp_path) -> None:
    """What the agent sweeps at start: files an agent killed with its workers left."""
    from monitor_agent.shm_files import remove_orphaned_shared_files

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = tmp_path / f"iserve-{gone.pid}-0123456789ab"
    live = tmp_path / f"iserve-{os.getpid()}-0123456789ab"
    other = tmp_path / "iserve-notapid-x"
    for path in (left, live, other):
        path.write_bytes(b"x")
    assert remove_orphaned_shared_files(str(tmp_path)) == [str(left)]
    assert live.exists() and other.exists() and not left.exists()
