"""A request's deadline and whether it got what its deployment promised.

Deadlines are for the first token: EDF orders and refuses by when a request must start
streaming. A deployment's TTFT SLO gives ``arrival + SLO`` directly. A deadline to the
last token (the request's ``deadline_ms``, else the deployment's default deadline from a
LATENCY_SLO intent) becomes a first-token deadline by leaving room for the request's
decode: ``(max_tokens - 1)`` predicted decode steps. The earlier of the two counts.

Pure: times in seconds on the scheduler's clock, objectives in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.api import common_pb2 as common


@dataclass(frozen=True)
class Deadline:
    """When the first token is due (None: no deadline) and the objective it comes from."""

    first_token_s: float | None
    objective: str = ""


def first_token_deadline(
    arrival_s: float,
    objectives: common.ServiceObjectives,
    deadline_ms: int,
    max_tokens: int,
    decode_step_s: float,
) -> Deadline:
    """The request's first-token deadline; ``deadline_ms`` is its own (0: none, then the
    deployment's default deadline applies) and ``decode_step_s`` the predicted time of
    one of its decode steps."""
    candidates: list[tuple[float, str]] = []
    if objectives.ttft_slo_ms:
        candidates.append(
            (arrival_s + objectives.ttft_slo_ms / 1e3, f"TTFT SLO {objectives.ttft_slo_ms} ms")
        )
    last_token_ms = deadline_ms or objectives.default_deadline_ms
    if last_token_ms:
        decode_s = max(0, max_tokens - 1) * decode_step_s
        label = "deadline_ms" if deadline_ms else "the deployment's default deadline"
        candidates.append(
            (
                arrival_s + last_token_ms / 1e3 - decode_s,
                f"{label} {last_token_ms} ms less {decode_s * 1e3:.0f} ms of predicted decode",
            )
        )
    if not candidates:
        return Deadline(None)
    due, objective = min(candidates)
    return Deadline(due, objective)


def decode_alone_passes(
    arrival_s: float,
    objectives: common.ServiceObjectives,
    deadline_ms: int,
    max_tokens: int,
    decode_step_s: float,
) -> bool:
    """Whether the request's first token would be due before it arrived even decoded
    alone, one step of ``decode_step_s`` per token (the fastest its deployment decodes):
    no queue could meet it (``deadline_unreachable``)."""
    alone = first_token_deadline(arrival_s, objectives, deadline_ms, max_tokens, decode_step_s)
    return alone.first_token_s is not None and alone.first_token_s <= arrival_s


def has_objective(objectives: common.ServiceObjectives, deadline_ms: int) -> bool:
    """Whether a request to this deployment has anything to attain."""
    return bool(
        objectives.ttft_slo_ms
        or objectives.tpot_slo_ms
        or objectives.default_deadline_ms
        or deadline_ms
    )


def slo_attained(
    objectives: common.ServiceObjectives,
    deadline_ms: int,
    *,
    ttft_ms: float,
    tpot_ms: float,
    total_ms: float,
    tokens: int,
) -> bool | None:
    """Whether a served request met every objective it had (None: it had none). TPOT is
    judged only on requests with two tokens or more."""
    if not has_objective(objectives, deadline_ms):
        return None
    if objectives.ttft_slo_ms and ttft_ms > objectives.ttft_slo_ms:
        return False
    if objectives.tpot_slo_ms and tokens > 1 and tpot_ms > objectives.tpot_slo_ms:
        return False
    last_token_ms = deadline_ms or objectives.default_deadline_ms
    return not (last_token_ms and total_ms > last_token_ms)
