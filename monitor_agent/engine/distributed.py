"""One model over tp·pp processes with torch.distributed (gloo on CPU, NCCL on CUDA).

Ranks. The world has tp·pp ranks; rank = stage·tp + tensor_rank. The tp ranks of a stage
hold the same layers, each a tensor-parallel shard (:mod:`tensor_parallel`), and form a
group whose all-reduce runs in the layers' ``reduce`` hooks. Rank 0 (stage 0, tensor rank
0) is the driver: it serves requests and runs the batch core (:mod:`batching`), whose
model is a :class:`DistributedModel` with the ordinary ``forward`` contract. Every other
rank runs :meth:`DistributedModel.follow` until the driver says stop.

One step (``DistributedModel.forward`` on rank 0, the same step in every follower):

1. rank 0 broadcasts a header, int64 ``[op, rows, tokens, last_token_only]`` with op
   STEP, KEEPALIVE or STOP, then for a STEP the batch as one int64 tensor: the token ids
   and positions [rows, tokens] and the cache slots [rows], flattened and concatenated;
2. every rank runs its stage. Stage 0 embeds the ids; a later stage first receives the
   hidden states [rows, tokens, hidden] from the same tensor rank of the previous stage,
   and every stage but the last sends its output to the same tensor rank of the next one
   (point-to-point send/recv: the tp ranks of a stage hold identical hidden states after
   their all-reduce, so each pair hands its own copy over);
3. the last stage's tensor rank 0 sends the logits [rows, tokens or 1, vocab] to rank 0,
   which returns them to the batch core for sampling. With one stage, rank 0 computed
   them itself (the LM head is replicated).

Transport. On CUDA these messages go through NCCL. CPU ranks of one host send them
through shared memory (:mod:`monitor_agent.engine.shm_collectives`: gloo's wake-ups made
tp = 2 slower than one core on a virtual machine); the gloo group still forms the group,
checks the layer map and carries them where shared memory cannot be used.

Failures. Any error inside a step leaves the ranks out of step, so the group is lost for
good: a peer that dies is reported at once ("connection closed by peer" from gloo, "exited"
from the shared-memory transport, which watches its peers' processes), one that hangs when
a collective passes ``timeout_s``. Rank 0 then raises :class:`GroupLost` for
that step and every later one and calls ``on_lost`` (the worker exits), a follower's loop
raises it. While idle, rank 0 broadcasts a KEEPALIVE header every ``keepalive_s`` (10 s, or a third
of the timeout if that is shorter), so that followers waiting for the next step can keep
the same timeout and still notice a driver that hangs.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from monitor_agent.engine.model import Transformer
from monitor_agent.engine.shm_collectives import SharedGroup, open_shared_group
from monitor_agent.engine.tensor_parallel import TensorShard
from services.ports import listening_socket
from services.settings import WILDCARD_HOSTS, is_loopback_host

__all__ = [
    "DistributedModel",
    "GroupLost",
    "ParallelContext",
    "ParallelLayout",
    "check_layer_map",
    "init_parallel",
]

log = logging.getLogger("iserve.engine.distributed")

STOP, STEP, KEEPALIVE = 0, 1, 2
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_KEEPALIVE_S = 10.0
# How long close() waits for a running step before it gives up sending STOP.
CLOSE_WAIT_S = 5.0


class GroupLost(RuntimeError):
    """A rank of the tensor/pipeline-parallel group failed; no step can run any more."""


@dataclass(frozen=True)
class ParallelLayout:
    """Where ``rank`` sits in a world of tensor_parallel × pipeline_parallel ranks."""

    tensor_parallel: int
    pipeline_parallel: int
    rank: int

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise ValueError(
                f"tensor_parallel ({self.tensor_parallel}) and pipeline_parallel "
                f"({self.pipeline_parallel}) must be at least 1"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is outside the world of tp·pp = {self.world_size} ranks"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def stage(self) -> int:
        return self.rank // self.tensor_parallel

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor_parallel

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipeline_parallel - 1

    def rank_of(self, stage: int, tensor_rank: int) -> int:
        return stage * self.tensor_parallel + tensor_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank_of(stage, t) for t in range(self.tensor_parallel)]


@dataclass(frozen=True)
class ParallelContext:
    """This process's rank in an initialised process group, and the layers it holds."""

    layout: ParallelLayout
    device: torch.device
    first_layer: int = 0
    layer_count: int | None = None  # None: to the last layer
    # The tensor-parallel group of this rank's stage; None with tp = 1.
    tensor_group: dist.ProcessGroup | None = None
    # How long a collective waits for its peers before the group is given up.
    timeout_s: float = DEFAULT_TIMEOUT_S
    # The messages of a step over shared memory (CPU ranks of one host); None: over the
    # process group (gloo or NCCL).
    shared: SharedGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over this stage's tensor-parallel ranks, in place."""
        if self.shared is not None:
            return self.shared.all_reduce(x, self.layout.stage_ranks(self.layout.stage))
        dist.all_reduce(x, group=self.tensor_group)
        return x

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's ``x`` to every rank (in place on the others)."""
        if self.shared is not None:
            self.shared.broadcast(x, 0, range(self.layout.world_size))
        else:
            dist.broadcast(x, src=0)

    def send(self, x: torch.Tensor, dst: int) -> None:
        if self.shared is not None:
            self.shared.send(x, dst)
        else:
            dist.send(x, dst=dst)

    def recv(self, x: torch.Tensor, src: int) -> None:
        if self.shared is not None:
            self.shared.recv(x, src)
        else:
            dist.recv(x, src=src)

    def load_kwargs(self) -> dict:
        """The ``load_model`` arguments that build this rank's stage and shard."""
        layout = self.layout
        shard = (
            TensorShard(layout.tensor_parallel, layout.tensor_rank, self.all_reduce)
            if layout.tensor_parallel > 1
            else None
        )
        return {
            "first_layer": self.first_layer,
            "layer_count": self.layer_count,
            "tensor_parallel": shard,
        }


# The ioctl that reads an interface's IPv4 address (linux/sockios.h).
_SIOCGIFADDR = 0x8915


def interface_with_address(address: str) -> str | None:
    """The name of this host's network interface whose IPv4 address is ``address`` (the
    kernel's answer, SIOCGIFADDR), None when none has it or ``address`` is no IPv4."""
    try:
        wanted = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _index, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on it
            if answer[20:24] == wanted:
                return name
    return None


def bind_collectives(bind_host: str, cuda: bool, local: bool = False) -> str | None:
    """Make the collectives' own sockets use the interface of ``bind_host`` (the address
    this worker serves on), unless the operator named one: gloo and NCCL pick theirs by
    resolving the host name, which on most hosts maps to a loopback address, and a rank
    on another node then dialled 127.0.0.1. gloo's (CPU ranks) take the loopback
    interface when every rank of the group runs on this host (``local``): by the host
    name's address they listened on the network where that resolves to one (a cloud
    VM's), on a stack meant for loopback only. Returns the interface set, if any."""
    variable = "NCCL_SOCKET_IFNAME" if cuda else "GLOO_SOCKET_IFNAME"
    if os.environ.get(variable):
        return None  # the operator's choice
    if local and not cuda:
        address = "127.0.0.1"
    elif bind_host in WILDCARD_HOSTS or is_loopback_host(bind_host):
        return None  # every interface; NCCL on one host: the default works
    else:
        address = bind_host
    name = interface_with_address(address)
    if name is not None:
        os.environ[variable] = name
    return name


def store_listen_host(rendezvous_host: str, bind_host: str) -> str:
    """Where rank 0's store listens: the rendezvous's own address when it is a loopback
    one (every rank on this host); every interface where that is the operator's choice
    (``bind_host`` a wildcard: ``::`` takes IPv6 and IPv4 alike); else the rendezvous's
    address when it is one of this host's (what the other ranks dial, whatever this
    worker serves on), else the address this worker serves on. torch's store listened on
    every interface whatever the rendezvous named: an unauthenticated key-value server
    reachable from the network on a stack configured for loopback only (a tester)."""
    if is_loopback_host(rendezvous_host):
        return rendezvous_host
    if bind_host.strip("[]") == "::":
        return "::"
    if bind_host in WILDCARD_HOSTS:
        return "::" if ":" in rendezvous_host.strip("[]") else "0.0.0.0"
    if interface_with_address(rendezvous_host) is not None:
        return rendezvous_host
    return bind_host


def split_rendezvous(rendezvous: str) -> tuple[str, int]:
    """``"host:port"`` (``[v6]:port`` too) as (host without brackets, port); ValueError
    when it is not that."""
    host, _, port_text = rendezvous.rpartition(":")
    if not host or not port_text.isdigit():
        raise ValueError(f"rendezvous {rendezvous!r} is not HOST:PORT")
    return host.strip("[]"), int(port_text)


def rendezvous_store(
    rendezvous: str, layout: ParallelLayout, timeout_s: float, bind_host: str = ""
) -> dist.TCPStore:
    """The group's TCP store at ``rendezvous`` ("host:port"): rank 0 serves it on a socket
    of its own (:func:`store_listen_host`), the others connect to it."""
    host, port = split_rendezvous(rendezvous)
    timeout = timedelta(seconds=timeout_s)
    if layout.rank != 0:
        return dist.TCPStore(host, port, layout.world_size, False, timeout)
    listen_host = store_listen_host(host, bind_host)
    try:
        listener = listening_socket(listen_host, port)
    except OSError as exc:
        raise RuntimeError(
            f"rank 0 cannot listen for its group on {listen_host}:{port}: {exc.strerror or exc}"
        ) from exc
    # The store's from now on: it serves on this descriptor and closes it, on a failure
    # too (closed again here, the failure read "Bad file descriptor": a tester).
    fd = listener.detach()
    return dist.TCPStore(host, port, layout.world_size, True, timeout, master_listen_fd=fd)


def init_parallel(
    layout: ParallelLayout,
    *,
    rendezvous: str,
    device: str | torch.device = "cpu",
    first_layer: int = 0,
    layer_count: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    bind_host: str = "",
) -> ParallelContext:
    """Join the process group at ``rendezvous`` ("host:port", where rank 0 listens) and
    create the tensor-parallel groups. Blocks until every rank has joined (at most
    ``timeout_s``). NCCL when ``device`` is CUDA (which becomes this process's current
    device), gloo otherwise; their sockets on the interface of ``bind_host``
    (:func:`bind_collectives`)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    local = is_loopback_host(split_rendezvous(rendezvous)[0])
    interface = bind_collectives(bind_host, cuda, local)
    if interface is not None:
        log.info("collectives bound to %s (the interface of %s)", interface, bind_host)
    if cuda:
        torch.cuda.set_device(device)
    store = rendezvous_store(rendezvous, layout, timeout_s, bind_host)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=layout.rank,
        world_size=layout.world_size,
        timeout=timedelta(seconds=timeout_s),
        # Binds the NCCL communicators to this rank's GPU, whichever thread calls them.
        **({"device_id": device} if cuda else {}),
    )
    tensor_group = None
    if layout.tensor_parallel > 1:
        # Every rank must create every group, in the same order.
        groups = [
            dist.new_group(layout.stage_ranks(stage)) for stage in range(layout.pipeline_parallel)
        ]
        tensor_group = groups[layout.stage]
    shared = (
        None
        if cuda or layout.world_size == 1
        else open_shared_group(
            layout.rank, layout.tensor_parallel, layout.pipeline_parallel, timeout_s
        )
    )
    return ParallelContext(
        layout, device, first_layer, layer_count, tensor_group, timeout_s, shared
    )


def check_layer_map(stage: Transformer, layout: ParallelLayout) -> None:
    """Exchange every rank's layer range (a collective: all ranks call it once loaded)
    and raise ValueError on every rank unless the stages tile the model's layers in
    order, the tensor ranks of each stage agreeing."""
    ranges: list[tuple[int, int] | None] = [None] * layout.world_size
    dist.all_gather_object(ranges, (stage.first_layer, stage.layer_count))
    expected_first = 0
    for s in range(layout.pipeline_parallel):
        members = {ranges[r] for r in layout.stage_ranks(s)}
        if len(members) != 1:
            raise ValueError(f"the ranks of stage {s} hold different layers: {sorted(members)}")
        first, count = members.pop()
        if first != expected_first:
            raise ValueError(
                f"stage {s} starts at layer {first}, expected {expected_first} "
                f"(layer ranges by rank: {ranges})"
            )
        expected_first = first + count
    if expected_first != stage.spec.num_layers:
        raise ValueError(
            f"the stages end at layer {expected_first} of {stage.spec.num_layers} "
            f"(layer ranges by rank: {ranges})"
        )


# A follower's wrapper of each step's compute (DistributedModel.follow):
# around_stage(compute, positions) -> compute()'s output.
AroundStage = Callable[[Callable[[], torch.Tensor], torch.Tensor], torch.Tensor]


class DistributedModel(nn.Module):
    """This rank's stage, stepped in lock-step with the other ranks (module docstring).

    On rank 0 it is the batch core's model: ``forward(input_ids, positions, slots, *,
    last_token_only)`` returns the whole model's logits. Other ranks call :meth:`follow`.
    """

    def __init__(self, stage: Transformer, context: ParallelContext) -> None:
        super().__init__()
        layout = context.layout
        if stage.has_embedding != (layout.stage == 0) or stage.has_head != layout.is_last_stage:
            raise ValueError(
                f"rank {layout.rank} (stage {layout.stage} of {layout.pipeline_parallel}) "
                f"cannot hold layers [{stage.first_layer}, "
                f"{stage.first_layer + stage.layer_count}) of {stage.spec.num_layers}: the "
                "first stage must start at layer 0 and only the last may end at the last layer"
            )
        self.stage = stage
        self.spec = stage.spec
        self.context = context
        # Often enough that an idle follower never waits a whole timeout for a header.
        self.keepalive_s = min(DEFAULT_KEEPALIVE_S, context.timeout_s / 3)
        # Called once, from the thread that noticed, with the reason the group was lost.
        self.on_lost: Callable[[str], None] | None = None
        self.lost: str | None = None
        self._lock = threading.Lock()  # one message sequence at a time
        self._closed = threading.Event()
        self._last_sent = time.monotonic()

    @property
    def layout(self) -> ParallelLayout:
        return self.context.layout

    def setup_caches(self, max_batch: int, max_seq_len: int) -> None:
        self.stage.setup_caches(max_batch, max_seq_len)

    # ---- rank 0 ------------------------------------------------------------------------
    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        *,
        last_token_only: bool = False,
    ) -> torch.Tensor:
        """Run one step on every rank; the logits, as Transformer.forward returns them.
        GroupLost when a rank failed (now or before)."""
        if not self.layout.is_driver:
            raise RuntimeError("only rank 0 drives steps; other ranks call follow()")
        with self._lock:
            if self.lost is not None:
                raise GroupLost(self.lost)
            if self._closed.is_set():
                raise GroupLost("the parallel group was closed")
            rows, tokens = positions.shape
            try:
                self._send_header(STEP, rows, tokens, last_token_only)
                batch = torch.cat((inputs.reshape(-1), positions.reshape(-1), slots.reshape(-1)))
                self.context.broadcast(batch.to(self.context.device))
                logits = self._run(inputs, positions, slots, last_token_only)
            except Exception as exc:
                raise self._lose(exc) from exc
        assert logits is not None
        return logits

    def start_keepalive(self) -> None:
        """Rank 0: broadcast KEEPALIVE whenever nothing was sent for ``keepalive_s``."""
        if self.layout.world_size > 1:
            threading.Thread(target=self._keep_alive, name="keepalive", daemon=True).start()

    def close(self) -> None:
        """Rank 0: tell the followers to stop (best effort); later steps raise GroupLost."""
        self._closed.set()
        if not self._lock.acquire(timeout=CLOSE_WAIT_S):
            log.warning("a step is still running; followers are not told to stop")
            return
        try:
            if self.lost is None and self.layout.world_size > 1:
                self._send_header(STOP, 0, 0, False)
        except Exception as exc:  # noqa: BLE001 - stopping anyway; the peers may be gone
            log.info("could not send STOP to the followers: %s", exc)
        finally:
            self._lock.release()

    def _keep_alive(self) -> None:
        while not self._closed.wait(self.keepalive_s / 4):
            if time.monotonic() - self._last_sent < self.keepalive_s:
                continue
            with self._lock:
                if self._closed.is_set() or self.lost is not None:
                    return
                try:
                    self._send_header(KEEPALIVE, 0, 0, False)
                except Exception as exc:  # noqa: BLE001 - reported through _lose
                    self._lose(exc)
                    return

    def _send_header(self, op: int, rows: int, tokens: int, last_token_only: bool) -> None:
        header = torch.tensor(
            [op, rows, tokens, int(last_token_only)], dtype=torch.long, device=self.context.device
        )
        self.context.broadcast(header)
        self._last_sent = time.monotonic()

    def _lose(self, exc: BaseException) -> GroupLost:
        if self.lost is None:
            self.lost = f"rank {self.layout.rank} lost its parallel group: {exc}"
            log.error("%s", self.lost)
            if self.on_lost is not None:
                self.on_lost(self.lost)
        return GroupLost(self.lost)

    # ---- other ranks -------------------------------------------------------------------
    def follow(self, around_stage: AroundStage | None = None) -> None:
        """Run every step rank 0 broadcasts until it sends STOP. Raises GroupLost when a
        collective fails (a rank died, or nothing arrived within the group's timeout).
        ``around_stage(compute, positions)``, if given, runs each step's ``compute()``
        (the receipt of the previous stage's output and this rank's stage) and returns
        its output, before this rank passes the output on: how a follower measures its
        memory as rank 0's batch core does (monitor_agent.worker.follower)."""
        device = self.context.device
        header = torch.empty(4, dtype=torch.long, device=device)
        with torch.inference_mode():
            while True:
                try:
                    self.context.broadcast(header)
                    op, rows, tokens, last_token_only = header.tolist()
                    if op == STOP:
                        return
                    if op == KEEPALIVE:
                        continue
                    cells = rows * tokens
                    batch = torch.empty(2 * cells + rows, dtype=torch.long, device=device)
                    self.context.broadcast(batch)
                    self._run(
                        batch[:cells].view(rows, tokens),
                        batch[cells : 2 * cells].view(rows, tokens),
                        batch[2 * cells :],
                        bool(last_token_only),
                        around_stage,
                    )
                except Exception as exc:
                    raise GroupLost(
                        f"rank {self.layout.rank} lost its parallel group: {exc}"
                    ) from exc

    # ---- every rank --------------------------------------------------------------------
    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        last_token_only: bool,
        around_stage: AroundStage | None = None,
    ) -> torch.Tensor | None:
        """This rank's part of one step; the logits on rank 0, None elsewhere."""
        layout, stage, device = self.layout, self.stage, self.context.device
        dtype = stage.layers[0].attn_norm.weight.dtype  # the activation dtype
        rows, tokens = positions.shape

        def compute() -> torch.Tensor:
            if stage.has_embedding:
                x = input_ids
            else:
                x = torch.empty(rows, tokens, self.spec.hidden_size, dtype=dtype, device=device)
                self.context.recv(x, layout.rank_of(layout.stage - 1, layout.tensor_rank))
            return stage(x, positions, slots, last_token_only=last_token_only)

        out = compute() if around_stage is None else around_stage(compute, positions)
        if not stage.has_head:
            self.context.send(
                out.to(dtype).contiguous(), layout.rank_of(layout.stage + 1, layout.tensor_rank)
            )
            if not layout.is_driver:
                return None
            logits = torch.empty(
                rows,
                1 if last_token_only else tokens,
                self.spec.vocab_size,
                dtype=dtype,
                device=device,
            )
            self.context.recv(logits, layout.rank_of(layout.pipeline_parallel - 1, 0))
            return logits
        if layout.tensor_rank == 0 and not layout.is_driver:
            self.context.send(out.to(dtype).contiguous(), 0)
        return out if layout.is_driver else None
