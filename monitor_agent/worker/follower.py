"""A worker rank other than 0: it serves nothing and runs the steps rank 0 broadcasts.

The steps run on a thread (``DistributedModel.follow``), because a collective blocks in
C++ and Python signal handlers run only on the main thread between bytecodes; the main
thread waits for that thread while it watches for SIGTERM and for the agent's death, and
leaves with ``os._exit`` when either comes, since a thread blocked in a collective cannot
be stopped any other way.

Memory. A follower serves no RPCs, so it reports its peak memory in its ready record
(``peak_memory_bytes``, :class:`FollowerPeak`), measured as rank 0 measures its own: on
CPU each step that could set a new activation peak runs under torch's profiler through
the batch core's ``forward_measured`` (monitor_agent.engine.memory), and the figure is
the engine's account of weights, KV cache and that peak; on CUDA the allocator's peak.
The record is rewritten when the figure grows, before the step's output is passed on,
so a step that rank 0 has finished has been counted by every rank of the stages it
waited for; a tensor-parallel peer of the last stage may write its record a moment after
rank 0 has the logits, which the profiler's warm-up runs (the same shapes, measured
then) make harmless.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

import torch

from monitor_agent.engine.batching import BatchEngine
from monitor_agent.engine.distributed import AroundStage, DistributedModel, GroupLost

log = logging.getLogger("iserve.worker")

POLL_S = 0.5


class FollowerPeak:
    """A follower's peak memory, measured around each step (module docstring):
    ``publish(bytes)`` is called whenever ``probe()`` (the figure rank 0 reports,
    monitor_agent.worker.process.peak_memory_probe) has grown after a step."""

    def __init__(
        self, batch: BatchEngine, probe: Callable[[], int], publish: Callable[[int], None]
    ) -> None:
        self.batch = batch
        self.probe = probe
        self.publish = publish
        self.published = 0

    def around_stage(
        self, compute: Callable[[], torch.Tensor], positions: torch.Tensor
    ) -> torch.Tensor:
        if self.batch.device.type == "cpu":
            rows, tokens = positions.shape
            # The step's shape as rank 0's batch core names it: its prompts' or decodes'
            # rows, and the longest sequence the step attends to.
            out = self.batch.forward_measured(
                compute, rows=rows, tokens_per_row=tokens, kv_len=int(positions.max()) + 1
            )
        else:
            out = compute()  # the CUDA allocator keeps its own peak
        peak = self.probe()
        if peak > self.published:
            self.published = peak
            self.publish(peak)
        return out


def run_follower(
    model: DistributedModel,
    *,
    parent_pid: int,
    announce: Callable[[], None],
    around_stage: AroundStage | None = None,
) -> bool:
    """Announce readiness, then follow rank 0 until it sends STOP (True) or the group is
    lost (False), each step's compute run through ``around_stage`` if given. On SIGTERM
    or SIGINT, or once ``parent_pid`` (if not 0) is no longer this process's parent, the
    process exits at once with code 0."""
    outcome: list[bool] = []

    def follow() -> None:
        try:
            model.follow(around_stage)
            outcome.append(True)
        except GroupLost as exc:
            log.error("%s", exc)
            outcome.append(False)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _sig, _frame: stop.set())
    thread = threading.Thread(target=follow, name="follower", daemon=True)
    thread.start()
    announce()
    while thread.is_alive():
        thread.join(POLL_S)
        if stop.is_set():
            _exit_now("stopping on a signal")
        if parent_pid and os.getppid() != parent_pid:
            _exit_now(f"parent process {parent_pid} exited; stopping")
    if outcome and outcome[0]:
        log.info("rank 0 sent stop")
    return bool(outcome and outcome[0])


def _exit_now(reason: str) -> None:
    log.info("%s", reason)
    logging.shutdown()
    os._exit(0)
