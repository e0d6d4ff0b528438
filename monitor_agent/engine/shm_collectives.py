"""The CPU ranks' messages over shared memory, when every rank of the group is on one host.

Why. gloo's TCP transport wakes a sleeping thread for every message. On a virtual machine
an idle vCPU halts, and waking it costs from a few hundred microseconds to several
milliseconds, at random: with tp = 2 a decode step makes two all-reduces per layer, and
on the 2-core CI box gloo's all-reduce of one hidden vector took 0.4-2.7 ms (median, p90
5-20 ms), which made tp = 2 three times slower than one core and its TPOT move by ±30 %
from run to run. Here a rank that waits spins on a counter in shared memory, yielding
the core to anything else runnable, so the core never halts: the same all-reduce takes
about 40 µs and varies by a few microseconds.

Layout. Rank 0 creates one file in ``/dev/shm`` holding a ring for every ordered pair of
ranks that exchange messages (:func:`channel_pairs`): rank 0 to every other rank (the
step header and batch), the ranks of each stage to each other (all-reduce), each rank to
the same tensor rank of the next stage (hidden states) and the last stage's tensor rank
0 to rank 0 (logits). A ring is single-producer, single-consumer: ``SLOTS`` slots of
``SLOT_BYTES`` each, a count of chunks written (the producer's) and read (the
consumer's), each on its own cache line. A message longer than a slot streams through
the ring in slot-sized chunks; every chunk carries its length, which the consumer checks
against the tensor it receives into. The counters are written after the data they
publish, and x86-64 keeps stores (and loads) in program order, so a consumer that sees a
count sees the chunk; elsewhere (or when ``ISERVE_CPU_COLLECTIVES=gloo``) the group keeps
gloo for everything (:func:`open_shared_group` returns None).

Setup is all or nothing: rank 0 names the file (with a random token in it) through the
gloo group, every rank maps it and checks the token, and only when all succeed do they
use it; rank 0 then unlinks the name, so nothing is left in ``/dev/shm`` whatever happens
to the processes later. Each rank touches the pages of its rings while setting up, so
they count in its resident set from the start (the profiler measures a follower's memory
growth from that point).

Waiting. A rank spins (``os.sched_yield`` between looks) for up to ``SPIN_S``, the
longest a message normally takes inside a step (a pipeline stage waiting for the
previous one), then polls every ``POLL_S`` (``IDLE_POLL_S`` after ``IDLE_AFTER_S``), so
an idle group costs almost nothing. While
waiting it checks every ``LIVENESS_S`` that the peer's process still runs (a zombie
counts as gone) and gives up after the group's timeout, both as RuntimeError, which
:mod:`monitor_agent.engine.distributed` turns into GroupLost.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import platform
import secrets
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from monitor_agent.shm_files import SHM_DIR, new_shared_file_name
from services.settings import CPU_COLLECTIVES_ENV, cpu_collectives

__all__ = ["SharedGroup", "channel_pairs", "open_shared_group", "shared_memory_wanted"]

log = logging.getLogger("iserve.engine.shm")

ENV = CPU_COLLECTIVES_ENV  # "shm" (default) or "gloo", read by services.settings
SLOTS = 4
SLOT_BYTES = 256 * 1024
LINE = 64  # one cache line per counter
MAGIC_BYTES = 64
SPIN_S = 0.05
POLL_S = 0.0005
IDLE_AFTER_S = 1.0  # then polls every IDLE_POLL_S
IDLE_POLL_S = 0.002
LIVENESS_S = 0.05


def shared_memory_wanted() -> bool:
    """Whether this process may use shared-memory collectives (x86-64 Linux, not opted out)."""
    return (
        cpu_collectives() == "shm"
        and platform.system() == "Linux"
        and platform.machine().lower() in ("x86_64", "amd64")
        and os.path.isdir(SHM_DIR)
    )


def channel_pairs(tensor_parallel: int, pipeline_parallel: int) -> list[tuple[int, int]]:
    """Every (source, destination) rank pair that sends messages in a tp × pp group."""
    world = tensor_parallel * pipeline_parallel
    pairs = {(0, r) for r in range(1, world)}
    for stage in range(pipeline_parallel):
        ranks = [stage * tensor_parallel + t for t in range(tensor_parallel)]
        pairs |= {(a, b) for a in ranks for b in ranks if a != b}
        if stage + 1 < pipeline_parallel:
            pairs |= {(r, r + tensor_parallel) for r in ranks}
    last_first = (pipeline_parallel - 1) * tensor_parallel
    if last_first != 0:
        pairs.add((last_first, 0))
    return sorted(pairs)


def ring_bytes() -> int:
    return 2 * LINE + SLOTS * (LINE + SLOT_BYTES)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x")


class _Ring:
    """One single-producer, single-consumer ring in the shared buffer (module docstring)."""

    def __init__(self, buffer: mmap.mmap, offset: int) -> None:
        self.written = np.frombuffer(buffer, dtype=np.int64, count=1, offset=offset)
        self.read = np.frombuffer(buffer, dtype=np.int64, count=1, offset=offset + LINE)
        base = offset + 2 * LINE
        stride = LINE + SLOT_BYTES
        self.lengths = [
            np.frombuffer(buffer, dtype=np.int64, count=1, offset=base + i * stride)
            for i in range(SLOTS)
        ]
        self.slots = [
            torch.frombuffer(
                buffer, dtype=torch.uint8, count=SLOT_BYTES, offset=base + i * stride + LINE
            )
            for i in range(SLOTS)
        ]

    def touch(self) -> None:
        for slot in self.slots:
            int(slot[::4096].sum())


class SharedGroup:
    """This rank's ends of the group's rings; the messages DistributedModel exchanges."""

    def __init__(
        self,
        buffer: mmap.mmap,
        rank: int,
        pairs: list[tuple[int, int]],
        pids: list[int],
        timeout_s: float,
    ) -> None:
        self._buffer = buffer  # keeps the mapping alive
        self.rank = rank
        self.pids = pids
        self.timeout_s = timeout_s
        self._rings = {
            pair: _Ring(buffer, MAGIC_BYTES + i * ring_bytes()) for i, pair in enumerate(pairs)
        }
        for (src, dst), ring in self._rings.items():
            if rank in (src, dst):
                ring.touch()

    # ---- messages ------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Stream ``tensor`` to rank ``dst`` (returns once the last chunk is in the ring)."""
        data = _bytes_of(tensor.contiguous())
        ring = self._ring(self.rank, dst)
        for start in range(0, max(1, data.numel()), SLOT_BYTES):
            self._put(ring, dst, data[start : start + SLOT_BYTES])

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Fill ``tensor`` with the message rank ``src`` sends (of exactly its size)."""
        target = tensor if tensor.is_contiguous() else torch.empty_like(tensor)
        data = _bytes_of(target)
        ring = self._ring(src, self.rank)
        for start in range(0, max(1, data.numel()), SLOT_BYTES):
            chunk = data[start : start + SLOT_BYTES]
            slot = self._take(ring, src, chunk.numel())
            chunk.copy_(slot[: chunk.numel()])
            self._release(ring)
        if target is not tensor:
            tensor.copy_(target)

    def broadcast(self, tensor: torch.Tensor, src: int, ranks: Iterable[int]) -> None:
        """``src`` sends ``tensor`` to every other rank of ``ranks``; they receive into it."""
        if self.rank == src:
            for r in ranks:
                if r != src:
                    self.send(tensor, r)
        else:
            self.recv(tensor, src)

    def all_reduce(self, tensor: torch.Tensor, ranks: list[int]) -> torch.Tensor:
        """Sum ``tensor`` over ``ranks`` (this rank among them), in place. Every rank adds
        the parts in rank order, so all hold the same bits."""
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        data = _bytes_of(work)
        peers = [r for r in ranks if r != self.rank]
        element = work.element_size()
        chunk_bytes = SLOT_BYTES - SLOT_BYTES % element
        for start in range(0, data.numel(), chunk_bytes):
            mine = data[start : start + chunk_bytes]
            for peer in peers:
                self._put(self._ring(self.rank, peer), peer, mine)
            parts = {self.rank: mine.view(work.dtype)}
            for peer in peers:
                ring = self._ring(peer, self.rank)
                parts[peer] = self._take(ring, peer, mine.numel())[: mine.numel()].view(work.dtype)
            if len(peers) == 1:
                # a + b == b + a exactly: adding into this rank's part is rank order.
                parts[self.rank].add_(parts[peers[0]])
            else:
                ordered = [parts[r] for r in sorted(parts)]
                total = ordered[0].clone()
                for part in ordered[1:]:
                    total.add_(part)
                parts[self.rank].copy_(total)
            for peer in peers:
                self._release(self._ring(peer, self.rank))
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    # ---- rings ---------------------------------------------------------------------------
    def _ring(self, src: int, dst: int) -> _Ring:
        try:
            return self._rings[(src, dst)]
        except KeyError:
            raise RuntimeError(f"no shared-memory channel from rank {src} to rank {dst}") from None

    def _put(self, ring: _Ring, peer: int, chunk: torch.Tensor) -> None:
        written = int(ring.written[0])
        self._wait(lambda: written - int(ring.read[0]) < SLOTS, peer, "room in its ring")
        index = written % SLOTS
        ring.slots[index][: chunk.numel()].copy_(chunk)
        ring.lengths[index][0] = chunk.numel()
        ring.written[0] = written + 1  # published after the data (module docstring)

    def _take(self, ring: _Ring, peer: int, expected: int) -> torch.Tensor:
        read = int(ring.read[0])
        self._wait(lambda: int(ring.written[0]) > read, peer, "a message")
        index = read % SLOTS
        length = int(ring.lengths[index][0])
        if length != expected:
            raise RuntimeError(
                f"rank {peer} sent a chunk of {length} bytes where rank {self.rank} "
                f"expected {expected}: the ranks are out of step"
            )
        return ring.slots[index]

    @staticmethod
    def _release(ring: _Ring) -> None:
        ring.read[0] = int(ring.read[0]) + 1

    def _wait(self, ready: Callable[[], bool], peer: int, what: str) -> None:
        if ready():
            return
        started = time.monotonic()
        spin_until = started + SPIN_S
        next_check = started + LIVENESS_S
        while not ready():
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
                continue
            if now >= next_check:
                if not _alive(self.pids[peer]):
                    raise RuntimeError(
                        f"rank {peer} (pid {self.pids[peer]}) exited; connection closed by peer"
                    )
                if now - started > self.timeout_s:
                    raise RuntimeError(
                        f"rank {self.rank} waited {self.timeout_s:.0f} s for {what} from "
                        f"rank {peer}: timed out"
                    )
                next_check = now + LIVENESS_S
            time.sleep(POLL_S if now - started < IDLE_AFTER_S else IDLE_POLL_S)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


def open_shared_group(
    rank: int, tensor_parallel: int, pipeline_parallel: int, timeout_s: float
) -> SharedGroup | None:
    """Set up the group's shared memory (a collective over the initialised gloo group:
    every rank calls it). None, on every rank, when any rank cannot use it."""
    world = tensor_parallel * pipeline_parallel
    pairs = channel_pairs(tensor_parallel, pipeline_parallel)
    size = MAGIC_BYTES + len(pairs) * ring_bytes()
    wanted = shared_memory_wanted()
    name = None
    token = secrets.token_bytes(32)
    if rank == 0 and wanted:
        name = _create(size, token)
    created = name
    try:
        announced = [name, token]
        dist.broadcast_object_list(announced, src=0)
        name, token = announced
        buffer, reason = None, None
        if not wanted:
            reason = f"{ENV}=gloo or not x86-64 Linux"
        elif name is None:
            reason = "rank 0 could not create the shared file"
        else:
            buffer, reason = _map(name, size, token)
        verdicts: list = [None] * world
        dist.all_gather_object(verdicts, (os.getpid(), reason))
    finally:
        # Every rank has mapped it, or a peer failed: the name goes either way (a rank 0
        # killed in between leaves it to the agent, monitor_agent.shm_files).
        if created is not None:
            with contextlib.suppress(OSError):
                os.unlink(created)
    failed = [(r, why) for r, (_, why) in enumerate(verdicts) if why is not None]
    if failed:
        if buffer is not None:
            buffer.close()
        if rank == 0:
            log.info("collectives over gloo: %s", "; ".join(f"rank {r}: {w}" for r, w in failed))
        return None
    assert buffer is not None
    pids = [pid for pid, _ in verdicts]
    log.info("collectives over shared memory (%d channels, %d KiB)", len(pairs), size // 1024)
    return SharedGroup(buffer, rank, pairs, pids, timeout_s)


def _create(size: int, token: bytes) -> str | None:
    name = new_shared_file_name()
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        log.info("cannot create %s: %s", name, exc)
        return None
    try:
        # Reserve the pages now: a full tmpfs (a container's 64 MiB /dev/shm) is then an
        # error here, not a SIGBUS when a rank first touches a ring.
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, token, 0)
    except OSError as exc:
        log.info("cannot size %s: %s", name, exc)
        os.close(fd)
        os.unlink(name)
        return None
    os.close(fd)
    return name


def _map(name: str, size: int, token: bytes) -> tuple[mmap.mmap | None, str | None]:
    try:
        fd = os.open(name, os.O_RDWR)
    except OSError as exc:
        return None, f"cannot open {name}: {exc}"
    try:
        buffer = mmap.mmap(fd, size)
    except (OSError, ValueError) as exc:
        return None, f"cannot map {name}: {exc}"
    finally:
        os.close(fd)
    if buffer[: len(token)] != token:
        buffer.close()
        return None, f"{name} is another host's or process's file"
    return buffer, None
