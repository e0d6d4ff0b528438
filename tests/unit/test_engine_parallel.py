"""Tensor and pipeline parallelism with real processes on gloo: greedy tokens, alone and
under continuous batching, are identical for every (tp, pp) and layer map.

Each configuration runs its ranks as ``python -m tests.unit.parallel_harness``
processes (one thread each); all configurations start at once and the test waits for
them together, which keeps the whole module well under a minute and a half on 2 cores.
A tp of 4 and the other families are covered in one process by
test_engine_tensor_parallel.py. The last test checks the group's failure handling: idle
followers survive the collective timeout (keepalives) and leave when rank 0 dies.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from monitor_agent.engine.engine import Engine
from services.models.checkpoint import create_checkpoint
from tests.parity.harness import randomize_weights
from tests.unit.parallel_harness import MAX_SEQ_LEN, launch, scenario, wait_all

SHAPE = {"hidden_size": 64, "num_layers": 4, "num_heads": 4}
CHECKPOINTS = {
    "llama-gqa": {"arch": "llama", "num_kv_heads": 2},
    # Multi-query: one KV head, replicated on every tensor rank.
    "falcon-mqa": {"arch": "falcon", "num_kv_heads": 1, "tie_word_embeddings": True},
}
# name: (tp, pp, (first_layer, layer_count) of each stage)
CONFIGS = {
    "tp2": (2, 1, ((0, 4),)),
    "pp2": (1, 2, ((0, 2), (2, 2))),
    "tp2-pp2": (2, 2, ((0, 2), (2, 2))),
    "pp2-uneven-3+1": (1, 2, ((0, 3), (3, 1))),
}
# Ten rank processes importing torch at once on 2 busy cores: a limit for a hang, not a
# measure of speed.
RUN_TIMEOUT_S = 240
# Long enough for two ranks to load a tiny model before their first collective.
IDLE_TIMEOUT_S = 6.0
# A follower whose rank 0 died finds it gone within a second (a liveness check while it
# waits), well before the collective timeout; that it did not wait for the timeout is
# told by its log. This bound, with the process's teardown on a busy machine, is for a
# follower that never leaves.
FOLLOWER_EXIT_S = IDLE_TIMEOUT_S + 10.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[Path]:
    out = []
    for name, shape in CHECKPOINTS.items():
        directory = tmp_path_factory.mktemp(name) / "ckpt"
        create_checkpoint(directory, seed=11, **SHAPE, **shape)
        randomize_weights(directory, seed=12)
        out.append(directory)
    return out


def test_every_layout_generates_the_same_tokens(checkpoints, tmp_path) -> None:
    runs = {
        name: (launch(name, tp, pp, layers, checkpoints, tmp_path / name), tmp_path / name)
        for name, (tp, pp, layers) in CONFIGS.items()
    }
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = [scenario(Engine(c, max_seq_len=MAX_SEQ_LEN, max_batch=3)) for c in checkpoints]
    finally:
        torch.set_num_threads(previous)
    wait_all(runs, RUN_TIMEOUT_S)
    for index, name in enumerate(CHECKPOINTS):
        want = expected[index]
        assert len(want["alone"]) == 12 and [len(t) for t in want["batched"]] == [10, 6, 8]
        for config, (_, out) in runs.items():
            got = json.loads((out / f"{index}.json").read_text())
            assert got == want, f"{name} under {config}"
    # Random weights, but the tokens are not all one (a tied head favours repeating one).
    assert all(len({t for tokens in e["batched"] for t in tokens}) > 5 for e in expected)


def test_idle_followers_stay_and_leave_when_rank_0_dies(checkpoints, tmp_path) -> None:
    """While rank 0 idles it sends keepalives, so followers waiting for the next step
    outlive the collective timeout; once rank 0 is killed, they give the group up at once."""
    out = tmp_path / "idle"
    options = ("--timeout-s", str(IDLE_TIMEOUT_S), "--idle-s", "60")
    procs = launch("idle", 1, 2, ((0, 2), (2, 2)), checkpoints[:1], out, "cpu", *options)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not all((out / f"ready-{rank}-0").exists() for rank in range(2)):
            assert time.monotonic() < deadline and procs[0].poll() is None, "ranks did not start"
            time.sleep(0.1)
        time.sleep(IDLE_TIMEOUT_S * 1.5)
        assert [proc.poll() for proc in procs] == [None, None], (out / "rank-1.log").read_text()
        procs[0].kill()
        started = time.monotonic()
        code = procs[1].wait(FOLLOWER_EXIT_S)
        assert code != 0 and time.monotonic() - started < FOLLOWER_EXIT_S
        log = (out / "rank-1.log").read_text()
        assert "lost its parallel group" in log, log
        # At once: it saw rank 0 gone, rather than a collective timing out.
        assert "timed out" not in log.lower(), log
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
