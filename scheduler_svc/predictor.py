"""What one deployment's requests will take: prefill and decode times, learned online.

The deployer records a starting :class:`LatencyModel` on each deployment (from its
estimate; all zero when it has none). The scheduler predicts

    prefill(batch)   = fixed + per_token * (prompt tokens in the batch)
    decode_step(B)   = step + per_sequence * (B - 1)            (MaverIQ Eq. 6)

and corrects both lines from every request it serves by recursive least squares with
exponential forgetting (:class:`OnlineLine`): each finished request adds one sample, its
measured time from admission to first token against the prompt tokens its worker
prefilled with it, its own included (requests admitted together wait for each other's
prefills: fitted against their own prompts alone, a burst of short prompts read as a
slow fixed cost, and EDF then refused single requests it had time for), and one sample
of its mean time per output token against the sequences running beside it. Old samples
weigh ``FORGETTING ** age``, so the model follows a machine whose speed drifts (other
load, thermal limits) with a memory of about ``1 / (1 - FORGETTING)`` requests. The
estimate is the prior: it is what the model predicts before any traffic, and it pulls
the coefficients as ``ESTIMATE_SAMPLES`` requests would, until the samples outweigh it.
Without an estimate the first samples set the line.

Pure: no asyncio, gRPC or Redis. Times are seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.api import common_pb2 as common

# Weight of a sample `age` requests old: FORGETTING ** age (memory ~ 50 requests).
FORGETTING = 0.98
# How many requests' worth of evidence the deployment's estimate counts for: a few, so
# that the first measurements already move the model but one outlier does not.
ESTIMATE_SAMPLES = 2.0
# Weight of the newest request in the mean service time (admission to last token).
SERVICE_SMOOTHING = 0.1
# The mean service time before any request has finished: small, so that until then
# requests ahead count by number (a busy replica never looks as free as an idle one).
UNMEASURED_SERVICE_S = 1e-3
# Characters per prompt token before any request of the deployment has reported its
# prompt's token count (English text under a BPE vocabulary).
DEFAULT_CHARS_PER_TOKEN = 4.0
# Characters per token are learned as the ratio of decayed sums of the prompts'
# characters and tokens, so a prompt weighs by its length: learned as a mean of each
# prompt's ratio, eight 1-character prompts (2 tokens with the BOS: 0.5) pulled it to
# about 1, a 1,079-character prompt of 422 tokens was then guessed past the 512 the
# deployment accepts, and such a guess is never refused as late (EDF turned FCFS: a
# probe). The default counts as this many tokens of prompt, always (decayed with the
# rest, forty 1-character prompts outweighed it again: a probe), and the prompts' sums
# are kept at this share before the next is added.
CHARS_PRIOR_TOKENS = 64.0
CHARS_DECAY = 0.95


class OnlineLine:
    """``y = a + b * x`` fitted by recursive least squares with forgetting.

    ``prior`` is (a, b) before any sample and ``prior_samples`` how many samples' worth
    of evidence it counts for (0: none, the first samples set the line). ``x_scale``
    normalises x (e.g. the deployment's longest prompt) so that the samples' x lie
    around [0, 1] and the prior weighs the same on both coefficients.
    """

    def __init__(
        self,
        prior: tuple[float, float],
        prior_samples: float,
        x_scale: float = 1.0,
        forgetting: float = FORGETTING,
        timed_at_zero: bool = False,
    ):
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if prior_samples < 0 or x_scale <= 0:
            raise ValueError("prior_samples must be >= 0 and x_scale positive")
        self._x_scale = x_scale
        self._forgetting = forgetting
        self._timed_at_zero = timed_at_zero
        self._theta = [prior[0], prior[1] * x_scale]
        variance = 1.0 / prior_samples if prior_samples > 0 else 1e6
        self._p = [[variance, 0.0], [0.0, variance]]
        self._max_variance = variance
        self.samples = 0
        # The samples' weights and weighted x, forgotten as the fit forgets them.
        self._weight = 0.0
        self._weighted_x = 0.0

    @property
    def coefficients(self) -> tuple[float, float]:
        """(a, b) in the unit of y and y per unit of x, as :meth:`predict` reads them."""
        a, b = self._read()
        return a, b / self._x_scale

    def predict(self, x: float) -> float:
        """The line at ``x``, never below 0. A time never falls as x grows (more
        tokens, more sequences): a line fitted falling, as noise makes one of samples
        that all have about the same x, is read flat at the samples' mean x. Read as a
        line, samples of 511- and 512-token prompts (TTFT 17-44 ms) gave a 3-token
        prompt 3 s, and an EDF deployment refused everything from then on (a tester).
        With ``timed_at_zero`` (x = 0 is a time of its own: a lone sequence's decode
        step), a line fitted with a negative intercept is read flat so too: samples near
        a full batch put a lone sequence's step at 0 s, and EDF admitted any deadline
        (a tester)."""
        a, b = self._read()
        return max(0.0, a + b * (x / self._x_scale))

    def _read(self) -> tuple[float, float]:
        """(a, b) of the line :meth:`predict` reads, in the scaled x."""
        a, b = self._theta
        unreliable = b < 0 or (self._timed_at_zero and a < 0)
        if unreliable and self._weight > 0:
            return a + b * self._weighted_x / self._weight, 0.0
        return a, b

    def update(self, x: float, y: float) -> None:
        """Take one sample (``x``, ``y``) into the fit."""
        u = (1.0, x / self._x_scale)
        p = self._p
        pu = (p[0][0] * u[0] + p[0][1] * u[1], p[1][0] * u[0] + p[1][1] * u[1])
        denominator = self._forgetting + u[0] * pu[0] + u[1] * pu[1]
        gain = (pu[0] / denominator, pu[1] / denominator)
        error = y - (self._theta[0] * u[0] + self._theta[1] * u[1])
        self._theta = [self._theta[0] + gain[0] * error, self._theta[1] + gain[1] * error]
        # P = (P - gain * pu^T) / forgetting
        for i in range(2):
            for j in range(2):
                p[i][j] = (p[i][j] - gain[i] * pu[j]) / self._forgetting
        self._p = _clip_eigenvalues(p, self._max_variance)
        self.samples += 1
        self._weight = self._weight * self._forgetting + 1.0
        self._weighted_x = self._weighted_x * self._forgetting + u[1]


def _clip_eigenvalues(p: list[list[float]], cap: float) -> list[list[float]]:
    """The symmetric 2x2 ``p`` with its eigenvalues above ``cap`` lowered to ``cap``.

    Forgetting divides P by the forgetting factor at every sample, so the variance along
    a direction no sample excites (every prompt the same length, every decode at one
    batch size) grows without bound. Lowering only that direction's eigenvalue keeps it
    finite and leaves the excited direction's gain, and so its memory of about
    ``1 / (1 - forgetting)`` samples, as it is; scaling the whole matrix would shrink
    that gain too and the line would follow a drift several times more slowly.
    """
    a, b, c = p[0][0], (p[0][1] + p[1][0]) / 2, p[1][1]
    if b == 0:  # the axes are the eigenvectors
        return [[min(a, cap), 0.0], [0.0, min(c, cap)]]
    half_gap = math.hypot((a - c) / 2, b)
    clipped = [[a, b], [b, c]]
    for eigenvalue in ((a + c) / 2 + half_gap, (a + c) / 2 - half_gap):
        excess = eigenvalue - cap
        if excess > 0:
            # (b, eigenvalue - a) is its eigenvector; subtract excess * v v^T, v normalised.
            vx, vy = b, eigenvalue - a
            scale = excess / (vx * vx + vy * vy)
            clipped[0][0] -= scale * vx * vx
            clipped[0][1] -= scale * vx * vy
            clipped[1][0] -= scale * vx * vy
            clipped[1][1] -= scale * vy * vy
    return clipped


class LatencyPredictor:
    """Prefill and decode-step times of one deployment (seconds), corrected online."""

    def __init__(self, model: common.LatencyModel, max_input_tokens: int, batch_size: int):
        prefill_known = model.prefill_ms_per_token > 0 or model.prefill_fixed_ms > 0
        self.prefill = OnlineLine(
            (model.prefill_fixed_ms / 1e3, model.prefill_ms_per_token / 1e3),
            ESTIMATE_SAMPLES if prefill_known else 0.0,
            x_scale=max(1, max_input_tokens),
        )
        self.decode = OnlineLine(
            (model.decode_step_ms / 1e3, model.decode_ms_per_extra_sequence / 1e3),
            ESTIMATE_SAMPLES if model.decode_step_ms > 0 else 0.0,
            x_scale=max(1, batch_size - 1),
            timed_at_zero=True,  # x = running - 1: at 0, a lone sequence's step
        )
        self._prompt_chars = 0.0  # decayed sums over the requests seen
        self._prompt_tokens = 0.0
        # Mean share of its max_tokens a request generates before it stops (EOS, a stop
        # sequence); 1 until requests have finished.
        self._output_share = 1.0
        # Mean time a request holds a slot (admission to last token), seconds; None
        # until a request has finished.
        self._mean_service_s: float | None = None
        self._decode_estimated = model.decode_step_ms > 0

    @property
    def evidence(self) -> float:
        """How much this predictor knows of a request's service time: the requests it
        has measured, or ESTIMATE_SAMPLES for the deployment's estimate before any (0:
        neither, and ``service_s`` predicts nothing but zeros)."""
        return max(self.decode.samples, ESTIMATE_SAMPLES if self._decode_estimated else 0.0)

    @property
    def service_measured(self) -> bool:
        """Whether a request has finished here (``mean_service_s`` is a measurement)."""
        return self._mean_service_s is not None

    @property
    def mean_service_s(self) -> float:
        """Mean time a request holds a slot, seconds (UNMEASURED_SERVICE_S before any
        has finished: see ``service_measured``)."""
        return UNMEASURED_SERVICE_S if self._mean_service_s is None else self._mean_service_s

    @mean_service_s.setter
    def mean_service_s(self, seconds: float) -> None:
        self._mean_service_s = seconds

    def prefill_s(self, prompt_tokens: Sequence[int]) -> float:
        """Predicted prefill of prompts admitted together."""
        return self.prefill.predict(sum(prompt_tokens))

    def decode_step_s(self, running: float) -> float:
        """Predicted time of one decode step with ``running`` sequences (at least 1)."""
        return self.decode.predict(max(1, running) - 1)

    def service_s(self, prompt_tokens: int, max_tokens: int, running: int) -> float:
        """Predicted time a request holds its slot: its prefill, then a decode step with
        ``running`` sequences for each output token after the first it is expected to
        generate (its max_tokens times the share of their max_tokens this deployment's
        requests have generated). Without max_tokens, the mean service time."""
        if max_tokens <= 0:
            return self.mean_service_s
        tokens = max(1.0, max_tokens * self._output_share)
        return self.prefill_s([prompt_tokens]) + (tokens - 1) * self.decode_step_s(running)

    def prompt_tokens(self, prompt_chars: int) -> int:
        """Tokens a text prompt of ``prompt_chars`` characters will have (from what this
        deployment's earlier requests reported)."""
        chars = DEFAULT_CHARS_PER_TOKEN * CHARS_PRIOR_TOKENS + self._prompt_chars
        tokens = CHARS_PRIOR_TOKENS + self._prompt_tokens
        return max(1, round(prompt_chars * tokens / chars))

    def observe(
        self,
        *,
        prompt_tokens: int,
        prompt_chars: int,
        first_token_s: float,
        tpot_s: float | None,
        running: float,
        service_s: float = 0.0,
        output_share: float | None = None,
        prefilled_tokens: int = 0,
    ) -> None:
        """One finished request: ``first_token_s`` from admission to its first token,
        which waited for the prefill of ``prefilled_tokens`` prompt tokens (its own and
        those the worker prefilled with it; 0: unknown, its own taken),
        ``tpot_s`` its mean time per output token after the first (None with one
        token), ``running`` the sequences running beside it (itself included; its
        time-weighted mean over the request's decode), ``service_s`` from admission to its last token,
        ``output_share`` its output tokens over its max_tokens."""
        self.prefill.update(max(prompt_tokens, prefilled_tokens), first_token_s)
        if tpot_s is not None:
            self.decode.update(max(1, running) - 1, tpot_s)
        if service_s > 0:
            if self._mean_service_s is None:
                self._mean_service_s = service_s
            self._mean_service_s += SERVICE_SMOOTHING * (service_s - self._mean_service_s)
        if output_share is not None:
            self._output_share += SERVICE_SMOOTHING * (output_share - self._output_share)
        if prompt_chars and prompt_tokens:
            self._prompt_chars = CHARS_DECAY * self._prompt_chars + prompt_chars
            self._prompt_tokens = CHARS_DECAY * self._prompt_tokens + prompt_tokens
