"""When a CPU profiling run counts as slowed by other processes, and what a profile taken
so says: the one rule of the agent (which runs such a run again), the model service (the
model's state reason) and the estimator (a note on its estimates).

A run's other-process share is the time the devices' cores were busy during the run
(``/proc/stat``) less the CPU time of the job's workers and the agent that times them
(their threads' ``schedstat``), over the cores' time. Profiling a 256-wide, 8-layer
model on a quiet 2-core machine with two virtual devices, its 72 measurements read
0.00-0.16 (median 0.01 or less, two runs); with two other processes busy on those
cores, 0.00-0.46 (median 0.29), and its estimates came out 23-202 % above the quiet
profile's even though the runs kept were the least slowed. The stack's other services count as other processes,
but sit idle while a model profiles. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.message import Message

__all__ = ["CONTENDED_SHARE", "MEASURE_AGAIN_SHARE", "contention_note", "share_of", "slowed"]

# Past this share of the devices' cores taken by other processes, a run was slowed.
CONTENDED_SHARE = 0.25
# Past this share, a profiling job is run once more after the model's other jobs, and
# the measurement slowed less is kept (fingerprint_svc.profiler). Below CONTENDED_SHARE:
# a probe's 2-layer fingerprint at 0.24 read its decode layer 3.7 times the same job's
# other measurement, and the fit made a pipeline stage speed a request up. The bench's
# profiles on a quiet machine read at most 0.16-0.21, 0-2 of 144 measurements past it.
MEASURE_AGAIN_SHARE = 0.15


def slowed(share: float | None) -> bool:
    """Whether a run (or a measurement) with this other-process share was slowed; one
    whose share was not measured was not, as far as is known."""
    return share is not None and share > CONTENDED_SHARE


def share_of(message: Message) -> float | None:
    """The ``other_cpu_share`` of a ProfiledRun or ProfileMeasurement; None where it was
    not measured."""
    return message.other_cpu_share if message.HasField("other_cpu_share") else None


# What contention_note's text starts with, as a pattern (to tell it apart in a model's
# reason, where the profiler writes it after what the profile lacks).
NOTE_START = r"\d+ of \d+ profiled measurements were taken while other "


def contention_note(shares: Iterable[float | None]) -> str:
    """What a profile whose measurements have these other-process shares (None: not
    measured) says of itself: empty when no measurement was slowed."""
    known = [r for r in shares if r is not None]
    contended = [r for r in known if slowed(r)]
    if not contended:
        return ""
    return (
        f"{len(contended)} of {len(known)} profiled measurements were taken while other "
        f"processes used up to {max(contended):.0%} of the devices' CPU cores (past "
        f"{CONTENDED_SHARE:.0%}), even when measured again after the other jobs: estimates "
        "from them run high, and one layout against another can come out the wrong way "
        "round; on a quiet machine, "
        "delete the model (`iserve model delete`, once no deployment serves it) and register "
        "it again"
    )
