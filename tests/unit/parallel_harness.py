"""Runs the engine as one rank of a tensor/pipeline-parallel group, for tests.

``python -m tests.unit.parallel_harness --rank R --tp T --pp P --layers F:C,F:C,...
--rendezvous HOST:PORT --out DIR [--timeout-s S] [--idle-s S] CHECKPOINT...`` joins the
group (one thread; gloo, or NCCL with ``--device cuda``, rank R then using ``cuda:R``) and
for each checkpoint in turn builds the Engine for its stage (``--layers`` gives each
stage's first layer and count) and touches ``DIR/ready-<rank>-<index>``. Rank 0 idles
``--idle-s`` seconds, runs :func:`scenario` on it, writes the tokens as JSON to
``DIR/<index>.json`` and stops the followers; the other ranks follow until stopped. The
pytest process runs the same :func:`scenario` on an unsharded Engine for the expected
tokens. ``--scenario text`` runs :func:`text_scenario` instead (the prompt text encoded
by the engine, then greedy tokens up to EOS), for comparisons with transformers.

Tests start the ranks of a configuration with :func:`launch` and wait with
:func:`wait_all`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

from services.ports import free_port

PROMPTS = ([1, 17, 230, 5, 99], [1, 412, 8], [1, 77, 300, 2, 150, 61, 33])
MAX_SEQ_LEN = 64
PROJECT_ROOT = Path(__file__).resolve().parents[2]
TEXT_PROMPT = "The model reads the prompt, predicts the next token, and repeats."
TEXT_TOKENS = 12


def scenario(engine) -> dict[str, list]:
    """Greedy tokens of one request alone, then of three requests batched continuously:
    two admitted together (prefilled as one left-padded group), a third joining while they
    decode, each finishing at its own length."""
    from monitor_agent.engine.batching import GenerationRequest
    from monitor_agent.engine.engine import SamplingConfig

    greedy = SamplingConfig(ignore_eos=True)
    alone = [out.token_id for out in engine.generate(list(PROMPTS[0]), 12, greedy)]
    batch = engine.batch
    handles = [
        batch.submit(GenerationRequest(PROMPTS[0], 10, greedy)),
        batch.submit(GenerationRequest(PROMPTS[1], 6, greedy)),
    ]
    tokens: dict[object, list[int]] = {handle: [] for handle in handles}
    steps = 0
    while batch.has_work:
        for handle, out in batch.step():
            tokens[handle].append(out.token_id)
        steps += 1
        if steps == 3:
            late = batch.submit(GenerationRequest(PROMPTS[2], 8, greedy))
            handles.append(late)
            tokens[late] = []
    return {"alone": alone, "batched": [tokens[handle] for handle in handles]}


def text_scenario(engine) -> dict[str, list]:
    """The ids the engine encodes TEXT_PROMPT to and up to TEXT_TOKENS greedy tokens after
    them, stopping at EOS as transformers' generate does."""
    from monitor_agent.engine.engine import SamplingConfig

    ids = engine.encode(TEXT_PROMPT)
    tokens = [out.token_id for out in engine.generate(ids, TEXT_TOKENS, SamplingConfig())]
    return {"ids": ids, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--layers", required=True, help="first:count of every stage")
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for cuda:<rank>")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="collective timeout")
    parser.add_argument("--idle-s", type=float, default=0.0, help="rank 0 waits before running")
    parser.add_argument("--scenario", choices=("batching", "text"), default="batching")
    parser.add_argument("checkpoints", nargs="+", type=Path)
    args = parser.parse_args(argv)

    import torch

    from monitor_agent.engine.distributed import ParallelLayout, check_layer_map, init_parallel
    from monitor_agent.engine.engine import Engine

    torch.set_num_threads(1)
    layout = ParallelLayout(args.tp, args.pp, args.rank)
    first, count = (int(n) for n in args.layers.split(",")[layout.stage].split(":"))
    device = f"cuda:{args.rank}" if args.device == "cuda" else "cpu"
    context = init_parallel(
        layout,
        rendezvous=args.rendezvous,
        device=device,
        first_layer=first,
        layer_count=count,
        timeout_s=args.timeout_s,
    )
    for index, checkpoint in enumerate(args.checkpoints):
        engine = Engine(
            checkpoint, max_seq_len=MAX_SEQ_LEN, max_batch=3, device=device, parallel=context
        )
        check_layer_map(engine.model.stage, layout)
        (args.out / f"ready-{args.rank}-{index}").touch()
        if layout.is_driver:
            engine.model.start_keepalive()
            time.sleep(args.idle_s)
            result = (text_scenario if args.scenario == "text" else scenario)(engine)
            (args.out / f"{index}.json").write_text(json.dumps(result))
            engine.model.close()
        else:
            engine.model.follow()
    return 0


def launch(
    name: str,
    tp: int,
    pp: int,
    layers,
    checkpoints: list[Path],
    out: Path,
    device: str = "cpu",
    *options: str,
) -> list[subprocess.Popen]:
    """Start every rank of one configuration (with the harness ``options``); rank i logs
    to out/rank-i.log."""
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
    rendezvous = f"127.0.0.1:{free_port()}"
    spec = ",".join(f"{first}:{count}" for first, count in layers)
    procs = []
    for rank in range(tp * pp):
        argv = [
            sys.executable, "-m", "tests.unit.parallel_harness",
            "--rank", str(rank), "--tp", str(tp), "--pp", str(pp), "--layers", spec,
            "--rendezvous", rendezvous, "--device", device, "--out", str(out), *options,
            *map(str, checkpoints),
        ]  # fmt: skip
        with (out / f"rank-{rank}.log").open("wb") as log:
            procs.append(
                subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=PROJECT_ROOT
                )
            )
    return procs


def wait_all(runs: dict[str, tuple[list[subprocess.Popen], Path]], timeout_s: float) -> None:
    """Wait for every process; on a failure or the timeout kill all and show the logs."""
    deadline = time.monotonic() + timeout_s
    try:
        for name, (procs, out) in runs.items():
            for rank, proc in enumerate(procs):
                code = proc.wait(max(0.1, deadline - time.monotonic()))
                if code != 0:
                    log = (out / f"rank-{rank}.log").read_text()
                    raise AssertionError(f"{name} rank {rank} exited {code}:\n{log[-3000:]}")
    except subprocess.TimeoutExpired:
        raise AssertionError(f"parallel runs did not finish within {timeout_s} s") from None
    finally:
        for procs, _ in runs.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def leave(code: int) -> NoReturn:
    """Exit as the worker does (monitor_agent/worker/__main__.py): without the
    interpreter's teardown, where destroying torch.distributed's gloo threads can abort
    the process ("terminate called without an active exception") after every result is
    written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
