"""Device load: busy seconds over the last 120 one-second samples, divided by 120."""

from __future__ import annotations

from collections import deque

LOAD_WINDOW_SAMPLES = 120
# A one-second sample counts as busy when the device was utilised above this fraction.
BUSY_THRESHOLD = 0.01


class LoadRing:
    """A ring of the last ``window`` busy/idle samples.

    Samples not yet taken count as idle, so an agent that just started reports a load that
    grows towards the true value over the first ``window`` seconds instead of jumping.
    """

    def __init__(self, window: int = LOAD_WINDOW_SAMPLES, busy_threshold: float = BUSY_THRESHOLD):
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        self.busy_threshold = busy_threshold
        self._samples: deque[bool] = deque(maxlen=window)
        self._busy = 0

    def add(self, utilisation: float) -> None:
        """Record one sample; ``utilisation`` is the fraction (0..1) of the second spent busy."""
        busy = utilisation > self.busy_threshold
        if len(self._samples) == self.window and self._samples[0]:
            self._busy -= 1
        self._samples.append(busy)
        self._busy += busy

    @property
    def busy_samples(self) -> int:
        return self._busy

    @property
    def load(self) -> float:
        """Busy samples in the window divided by the window size (0..1)."""
        return self._busy / self.window
