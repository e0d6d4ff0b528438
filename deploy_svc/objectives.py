"""What a deployment promises its requests, and the batch size that keeps the promise.

- :func:`resolve_objectives`: the scheduling policy and latency objectives a deployment
  records (EDF for a LATENCY_SLO intent unless a policy is named; that intent's latency
  target becomes the default deadline of requests that carry none).
- :func:`latency_model`: the scheduler's starting prediction of prefill and decode times,
  from the deployment's estimates at batch 1 and batch 2 (MaverIQ Eq. 6:
  ``TPOT(B) = TPOT(1) + (B - 1) * O_BS``). The scheduler corrects it online.
- :func:`batch_bound` and :func:`largest_fitting`: the batch size chosen when a Deploy
  leaves it 0: the largest batch whose estimated TPOT meets the TPOT SLO (or stays within
  ``UNBOUNDED_TPOT_FACTOR`` x the batch-1 TPOT when there is none), whose estimated TTFT
  and end-to-end latency meet the TTFT SLO and the default deadline (a LATENCY_SLO
  intent's target) when set, and whose KV cache still fits the devices. Every figure at
  batch B is Eq. 6's line through the estimates at batch 1 and 2.

Pure: no gRPC, no Redis.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from services.api import common_pb2 as common
from services.api import estimator_service_pb2 as estimator_pb
from services.errors import InvalidArgument
from services.intents import check_intent

# Without a TPOT SLO, a batch may slow each sequence's decode by at most this factor.
UNBOUNDED_TPOT_FACTOR = 1.5
# The largest batch the deployer chooses by itself (an explicit batch_size may go up to
# services.token_limits.MAX_BATCH_SIZE).
MAX_AUTO_BATCH = 64
# A LATENCY_SLO intent's fallback: its requests' default deadline, over its estimated
# latency (fallback_objectives).
FALLBACK_DEADLINE_FACTOR = 1.5


def resolve_objectives(
    requested: common.ServiceObjectives, intent: common.Intent | None
) -> common.ServiceObjectives:
    """``requested`` with the policy resolved (never UNSPECIFIED). ``intent`` is None for
    an explicit configuration. InvalidArgument for an unknown policy value or an intent
    ``check_intent`` refuses (checked here, where its latency first becomes a deadline)."""
    if intent is not None:
        check_intent(intent)
    if requested.scheduling not in common.SchedulingPolicy.values():
        raise InvalidArgument(f"unknown scheduling policy {requested.scheduling}")
    resolved = common.ServiceObjectives()
    resolved.CopyFrom(requested)
    latency_slo = intent is not None and intent.kind == common.INTENT_KIND_LATENCY_SLO
    if resolved.scheduling == common.SCHEDULING_POLICY_UNSPECIFIED:
        resolved.scheduling = (
            common.SCHEDULING_POLICY_EDF if latency_slo else common.SCHEDULING_POLICY_FCFS
        )
    if latency_slo and not resolved.default_deadline_ms:
        resolved.default_deadline_ms = math.ceil(intent.latency_slo_ms)
    return resolved


def fallback_objectives(
    objectives: common.ServiceObjectives,
    intent: common.Intent | None,
    requested_deadline_ms: int,
    meets_intent: bool,
    latency_ms: float,
) -> tuple[common.ServiceObjectives, str]:
    """``objectives`` for the configuration chosen, and a note when they change: a
    LATENCY_SLO intent that no configuration meets deploys the fastest as a fallback, and
    the target it misses as the default deadline refused every request that carried
    none as late. Such a deployment's requests default to FALLBACK_DEADLINE_FACTOR x
    the fallback's estimated latency (``latency_ms``; at 1x, the scheduler's prediction,
    which starts from the same estimate, refused about half as late); a deadline the
    request set itself stays."""
    latency_slo = intent is not None and intent.kind == common.INTENT_KIND_LATENCY_SLO
    if meets_intent or not latency_slo or requested_deadline_ms or latency_ms <= 0:
        return objectives, ""
    deadline = math.ceil(FALLBACK_DEADLINE_FACTOR * latency_ms)
    if deadline <= objectives.default_deadline_ms:
        return objectives, ""
    changed = common.ServiceObjectives()
    changed.CopyFrom(objectives)
    changed.default_deadline_ms = deadline
    return changed, (
        f"requests without a deadline of their own default to {deadline} ms, "
        f"{FALLBACK_DEADLINE_FACTOR:g}x the fallback's estimated latency (no configuration meets the "
        f"{intent.latency_slo_ms:g} ms target, which would refuse them all as late)"
    )


def per_sequence_ms(
    batch1: estimator_pb.ConfigEstimate, batch2: estimator_pb.ConfigEstimate | None
) -> float:
    """O_BS of Eq. 6 in milliseconds: what each extra running sequence adds to a decode
    step; 0 when there is no batch-2 estimate (or it is not slower)."""
    if batch2 is None:
        return 0.0
    return max(0.0, batch2.tpot_ms - batch1.tpot_ms)


def latency_model(
    batch1: estimator_pb.ConfigEstimate | None,
    batch2: estimator_pb.ConfigEstimate | None,
    input_tokens: int,
) -> common.LatencyModel:
    """The scheduler's prior from the estimate at ``input_tokens`` prompt tokens. The
    estimate gives TTFT at one prompt length only, so prefill starts proportional to
    prompt tokens (no fixed part); the scheduler learns the fixed part from traffic.
    All zero without an estimate."""
    if batch1 is None or not batch1.ttft_ms or input_tokens < 1:
        return common.LatencyModel()
    return common.LatencyModel(
        prefill_fixed_ms=0.0,
        prefill_ms_per_token=batch1.ttft_ms / input_tokens,
        decode_step_ms=batch1.tpot_ms,
        decode_ms_per_extra_sequence=per_sequence_ms(batch1, batch2),
    )


@dataclass(frozen=True)
class BatchBound:
    """The largest batch an objective allows, and why."""

    batch: int
    reason: str


def _slo_batch_bound(
    what: str, at_1: float, per_sequence: float, limit: float, figure: str = ""
) -> BatchBound:
    """Largest B <= MAX_AUTO_BATCH with ``at_1 + (B - 1) * per_sequence`` within
    ``limit`` (ms): ``what``'s objective on the estimated ``figure`` ("TPOT", or the
    objective's own)."""
    if at_1 > limit:
        return BatchBound(1, f"{what}, missed even at batch 1 (estimated {at_1:.1f} ms)")
    if per_sequence <= 0:
        return BatchBound(
            MAX_AUTO_BATCH, f"the cap of {MAX_AUTO_BATCH} ({figure or what} does not grow)"
        )
    batch = min(MAX_AUTO_BATCH, 1 + math.floor((limit - at_1) / per_sequence + 1e-9))
    if batch == MAX_AUTO_BATCH:
        return BatchBound(batch, f"the cap of {MAX_AUTO_BATCH}")
    estimated = at_1 + (batch - 1) * per_sequence
    label = f"{figure} " if figure else ""
    return BatchBound(batch, f"{what} (estimated {label}{estimated:.1f} ms at batch {batch})")


def batch_bound(
    batch1: estimator_pb.ConfigEstimate,
    batch2: estimator_pb.ConfigEstimate,
    objectives: common.ServiceObjectives,
    *,
    throughput_first: bool = False,
) -> BatchBound:
    """The tightest of the TPOT bound (:func:`tpot_batch_bound`) and, when set, the
    TTFT SLO's and the default deadline's on the estimated end-to-end latency: each
    figure at batch B on Eq. 6's line through ``batch1`` and ``batch2``. Without them a
    batch chosen for TPOT alone could break a LATENCY_SLO intent's target, which the
    decision was ranked to meet at batch 1.

    ``throughput_first`` (an intent ranked by throughput or device-hours): without a
    TPOT objective there is no TPOT bound but MAX_AUTO_BATCH. On Eq. 6's line each more
    sequence raises throughput and lowers a request's device-hours, and where decode's
    extra sequence costs 66 % of a step (a CPU) the 1.5x-TPOT default held these intents
    at batch 1, 18 % below batch 2's throughput (a probe)."""
    if throughput_first and not objectives.tpot_slo_ms:
        bounds = [
            BatchBound(
                MAX_AUTO_BATCH,
                f"the cap of {MAX_AUTO_BATCH} (an intent ranked by throughput; no TPOT "
                "objective to keep)",
            )
        ]
    else:
        bounds = [
            tpot_batch_bound(
                batch1.tpot_ms, per_sequence_ms(batch1, batch2), objectives.tpot_slo_ms
            )
        ]
    for limit, what, figure in (
        (objectives.ttft_slo_ms, f"TTFT SLO {objectives.ttft_slo_ms} ms", "ttft_ms"),
        (
            objectives.default_deadline_ms,
            f"latency {objectives.default_deadline_ms} ms (the default deadline)",
            "latency_ms",
        ),
    ):
        if limit:
            one, two = getattr(batch1, figure), getattr(batch2, figure)
            bounds.append(_slo_batch_bound(what, one, two - one, limit))
    return min(bounds, key=lambda b: b.batch)  # the first of equals: TPOT's


def ttft_batch_bound(ttft1_ms: float, ttft2_ms: float) -> BatchBound:
    """Largest B <= MAX_AUTO_BATCH whose TTFT stays within UNBOUNDED_TPOT_FACTOR x the
    batch-1 TTFT: a MIN_LATENCY intent without a TTFT objective. Its batch was sized
    by TPOT alone, and where decode's extra sequence costs nothing measurable (the A6000
    data) that was 64 sequences whose prefills took a full batch 20 s where one took 0.4 s."""
    limit = UNBOUNDED_TPOT_FACTOR * ttft1_ms
    what = (
        f"{UNBOUNDED_TPOT_FACTOR}x the batch-1 TTFT ({limit:.1f} ms, an intent ranked by latency)"
    )
    return _slo_batch_bound(what, ttft1_ms, ttft2_ms - ttft1_ms, limit, "TTFT")


def tpot_batch_bound(tpot1_ms: float, per_sequence: float, tpot_slo_ms: int) -> BatchBound:
    """Largest B <= MAX_AUTO_BATCH with ``tpot1_ms + (B - 1) * per_sequence`` within the
    TPOT SLO, or within UNBOUNDED_TPOT_FACTOR x ``tpot1_ms`` when the SLO is 0."""
    if tpot_slo_ms:
        limit, what = float(tpot_slo_ms), f"TPOT SLO {tpot_slo_ms} ms"
    else:
        limit = UNBOUNDED_TPOT_FACTOR * tpot1_ms
        what = f"{UNBOUNDED_TPOT_FACTOR}x the batch-1 TPOT ({limit:.1f} ms)"
    return _slo_batch_bound(what, tpot1_ms, per_sequence, limit, "TPOT")


def largest_fitting(upper: int, fits: Callable[[int], bool]) -> int:
    """The largest batch in 1..``upper`` for which ``fits`` holds, given that it holds
    at 1 and that a batch that does not fit has no larger one that does (KV memory
    grows with the batch)."""
    low, high = 1, upper
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low
