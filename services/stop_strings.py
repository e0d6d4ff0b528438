"""Stop strings: a generation's text cut at the first of them.

The worker applies them (``monitor_agent.worker.runner.EngineRunner``, for either
engine), so that a generation a stop string ends is a finished one (FINISH_REASON_STOP,
its slot freed at once), counted as such by the scheduler, and not a cancelled call; the
scheduler refuses stop strings beyond the limits before queueing the request.
"""

from __future__ import annotations

from collections.abc import Sized

# OpenAI's limit on stop strings, and a bound on each (the text held back while it could
# still begin one is at most this long).
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1000
# A bound on the extra stop token ids of one request: far more than any model's special
# tokens. Unbounded, one 11 MiB completions body of 32 prompts, each copying 4 million
# ids, held the gateway's event loop for 17 s and took gigabytes in two processes.
MAX_STOP_TOKEN_IDS = 1024


def check_stop_token_ids(ids: Sized) -> None:
    """ValueError unless there are at most MAX_STOP_TOKEN_IDS ``ids``."""
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(ids)}")


def check_stop_strings(stops: tuple[str, ...]) -> None:
    """ValueError, saying what to fix, unless ``stops`` are at most MAX_STOP_STRINGS
    strings of 1 to MAX_STOP_CHARS characters."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for stop in stops:
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise ValueError(f"a stop string has 1 to {MAX_STOP_CHARS} characters, got {len(stop)}")


class StopScanner:
    """Cuts a stream of text at the first stop string; text that could still begin one
    is held back until the next piece shows whether it does."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(stops)
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text of this piece that is final: all of it before a stop string (the
        scanner is then ``stopped``), or what can no longer begin one."""
        if not self.stops:
            return text
        self.held += text
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.held, self.stopped = self.held[:cut], "", True
            return out
        keep = max(len(s) for s in self.stops) - 1
        out = self.held[: max(0, len(self.held) - keep)]
        self.held = self.held[len(out) :]
        return out

    def flush(self) -> str:
        """What was held back, at the end of the text."""
        out, self.held = self.held, ""
        return out
