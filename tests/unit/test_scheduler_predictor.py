"""The scheduler's online latency model recovers known constants from synthetic data,
starts from the deployment's estimate, and follows a machine whose speed changes."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.predictor import DEFAULT_CHARS_PER_TOKEN, LatencyPredictor, OnlineLine
from services.api import common_pb2 as common


def test_a_line_recovers_its_constants_from_noisy_samples():
    rng = random.Random(1)
    line = OnlineLine(prior=(0.0, 0.002), prior_samples=2, x_scale=512)
    for _ in range(300):
        x = rng.uniform(10, 500)
        line.update(x, 0.05 + 0.001 * x + rng.gauss(0, 0.001))
    fixed, slope = line.coefficients
    assert fixed == pytest.approx(0.05, abs=0.003)
    assert slope == pytest.approx(0.001, rel=0.03)


def test_without_samples_the_prior_predicts():
    line = OnlineLine(prior=(0.01, 0.002), prior_samples=2, x_scale=100)
    assert line.predict(50) == pytest.approx(0.11)
    assert line.coefficients == pytest.approx((0.01, 0.002))


def test_a_wrong_prior_gives_way_to_the_measurements():
    line = OnlineLine(prior=(0.0, 0.004), prior_samples=2, x_scale=256)  # 2x too slow
    rng = random.Random(2)
    for _ in range(60):
        x = rng.uniform(16, 256)
        line.update(x, 0.002 * x)
    assert line.predict(128) == pytest.approx(0.256, rel=0.05)


def test_forgetting_follows_a_machine_that_slows_down():
    line = OnlineLine(prior=(0.0, 0.0), prior_samples=0, x_scale=100)
    rng = random.Random(3)
    for _ in range(200):
        line.update(rng.uniform(10, 100), 0.010)
    for _ in range(200):  # twice as slow now
        line.update(rng.uniform(10, 100), 0.020)
    assert line.predict(50) == pytest.approx(0.020, rel=0.05)


def test_the_same_x_over_and_over_neither_diverges_nor_moves_elsewhere_wildly():
    line = OnlineLine(prior=(0.0, 0.001), prior_samples=2, x_scale=512)
    for _ in range(5000):
        line.update(256, 0.3)
    assert line.predict(256) == pytest.approx(0.3, rel=1e-3)
    assert 0.0 < line.predict(512) < 1.0
    assert all(abs(v) < 1.0 for row in line._p for v in row)


@pytest.mark.parametrize("x", [0, 256])
def test_a_drift_at_one_x_is_followed_with_the_memory_forgetting_gives(x):
    """Every sample at one x (a batch-1 deployment's decode, prompts of one length): the
    unexcited direction's variance is held back without slowing the excited one, so a
    step from 2.0 to 3.65 ms is 80 % followed after 80 samples (0.98 ** 80 = 0.2)."""
    line = OnlineLine(prior=(0.002, 0.0001), prior_samples=2, x_scale=512)
    for _ in range(300):
        line.update(x, 0.0020)
    for _ in range(80):
        line.update(x, 0.00365)
    assert line.predict(x) == pytest.approx(0.0020 + 0.8 * 0.00165, rel=0.02)


def test_samples_at_one_length_without_a_prior_never_price_a_short_prompt_above_them():
    """A deployment without an estimate whose requests all had 511-512-token prompts
    (TTFT 17-44 ms): noise made the line fall steeply (3.1 s fixed, -6 ms a token), and
    a 3-token prompt was predicted at 3 s; its EDF queue refused everything from then
    on (a tester). A time never falls as the prompt grows: such a line reads flat."""
    for seed in range(20):
        rng = random.Random(seed)
        line = OnlineLine(prior=(0.0, 0.0), prior_samples=0, x_scale=512)
        for _ in range(12):
            line.update(rng.choice((511, 512)), rng.uniform(0.017, 0.044))
        for x in (3, 100, 511, 512):
            assert 0.0 <= line.predict(x) <= 0.044, (seed, x, line.coefficients)
    rising = OnlineLine(prior=(0.0, 0.0), prior_samples=0, x_scale=512)
    for x in (16, 256, 512) * 10:
        rising.update(x, 0.01 + 0.0001 * x)
    assert rising.predict(16) == pytest.approx(0.0116, rel=0.01)  # a rising line as it is


def test_a_lone_sequences_decode_step_is_never_read_as_no_time():
    """Samples near a full batch fitted a negative intercept (-14 ms, +25 ms a sequence):
    a lone sequence's step, the line at x = 0, read 0 s, and an EDF deployment admitted
    any deadline; the metrics showed each coefficient clamped alone (a tester). A line
    whose intercept is a time of its own reads flat at the samples' mean then, as a
    falling line does; the metrics show what the predictions read."""

    def samples(line: OnlineLine) -> OnlineLine:
        rng = random.Random(0)
        for _ in range(28):
            x = rng.choice([rng.uniform(0.9, 1.0)] * 5 + [rng.uniform(0.3, 1.0)])
            line.update(x, 0.005 * (1 + 0.3 * x) * rng.choice([1, 1, 1, 1, 1.5, 3]))
        return line

    loose = samples(OnlineLine((0, 0), 0.0, x_scale=1))
    assert loose.predict(0) == 0.0  # a line like any: its intercept as fitted (clamped)
    decode = samples(OnlineLine((0, 0), 0.0, x_scale=1, timed_at_zero=True))
    step = decode.predict(0)
    assert 0.005 < step < 0.015 and decode.predict(1) == step
    assert decode.coefficients == (step, 0.0)
    # A deployment's decode line is read so (batch 2: x = running - 1 in [0, 1]).
    predictor = LatencyPredictor(common.LatencyModel(), max_input_tokens=512, batch_size=2)
    samples(predictor.decode)
    assert predictor.decode_step_s(1) == pytest.approx(step)


def test_predictions_never_go_below_zero():
    line = OnlineLine(prior=(-1.0, 0.0), prior_samples=2)
    assert line.predict(1) == 0.0


@pytest.mark.parametrize(
    "bad", [{"forgetting": 0.0}, {"forgetting": 1.5}, {"prior_samples": -1}, {"x_scale": 0}]
)
def test_bad_settings_are_refused(bad):
    kwargs = {"prior": (0.0, 0.0), "prior_samples": 1.0, **bad}
    with pytest.raises(ValueError):
        OnlineLine(**kwargs)


def test_the_predictor_starts_from_the_deployments_latency_model():
    model = common.LatencyModel(
        prefill_fixed_ms=10.0,
        prefill_ms_per_token=0.5,
        decode_step_ms=20.0,
        decode_ms_per_extra_sequence=2.0,
    )
    predictor = LatencyPredictor(model, max_input_tokens=512, batch_size=8)
    assert predictor.prefill_s([100, 100]) == pytest.approx(0.010 + 0.5e-3 * 200)
    assert predictor.decode_step_s(1) == pytest.approx(0.020)
    assert predictor.decode_step_s(5) == pytest.approx(0.028)


def test_the_predictor_learns_from_finished_requests():
    predictor = LatencyPredictor(common.LatencyModel(), max_input_tokens=512, batch_size=4)
    rng = random.Random(4)
    for _ in range(100):
        tokens, running = rng.randint(8, 512), rng.randint(1, 4)
        predictor.observe(
            prompt_tokens=tokens,
            prompt_chars=3 * tokens,
            first_token_s=0.02 + 0.0004 * tokens,
            tpot_s=0.015 + 0.003 * (running - 1),
            running=running,
        )
    assert predictor.prefill_s([300]) == pytest.approx(0.02 + 0.12, rel=0.02)
    assert predictor.decode_step_s(3) == pytest.approx(0.021, rel=0.02)
    assert predictor.prompt_tokens(300) == pytest.approx(100, abs=2)


def test_the_prefill_line_is_learned_against_the_prompts_prefilled_together():
    """Bursts of short prompts admitted together each wait for the whole burst's
    prefill. Fitted against each one's own prompt, the fixed cost came out at the
    burst's (a probe: 1.21 s against 0.24 s), and EDF refused single long prompts it
    had time for. Against the tokens prefilled together the constants come back."""
    fixed, per_token = 0.05, 0.001
    rng = random.Random(7)
    told, untold = (
        LatencyPredictor(common.LatencyModel(), max_input_tokens=2048, batch_size=8)
        for _ in range(2)
    )
    for _ in range(60):
        burst = [rng.randint(200, 400) for _ in range(rng.choice((1, 8)))]
        for tokens in burst:
            observed = {
                "prompt_tokens": tokens,
                "prompt_chars": 0,
                "first_token_s": fixed + per_token * sum(burst),
                "tpot_s": None,
                "running": 1,
            }
            told.observe(**observed, prefilled_tokens=sum(burst))
            untold.observe(**observed)
    assert told.prefill.coefficients == pytest.approx((fixed, per_token), rel=0.02)
    assert told.prefill_s([1900]) == pytest.approx(fixed + per_token * 1900, rel=0.02)
    # What it read before: a lone long prompt predicted far above what it takes.
    assert untold.prefill_s([1900]) > 1.5 * told.prefill_s([1900])


def test_text_prompts_are_counted_at_four_characters_a_token_until_told_otherwise():
    predictor = LatencyPredictor(common.LatencyModel(), max_input_tokens=64, batch_size=1)
    assert predictor.prompt_tokens(400) == round(400 / DEFAULT_CHARS_PER_TOKEN)
    assert predictor.prompt_tokens(0) == 1


def test_service_time_counts_a_requests_own_max_tokens_times_the_share_generated():
    """Requests that stop (EOS) at a quarter of their max_tokens: a request of 100 tokens
    is predicted to hold its slot for its prefill and 24 decode steps."""
    predictor = LatencyPredictor(
        common.LatencyModel(prefill_ms_per_token=1.0, decode_step_ms=10.0),
        max_input_tokens=512,
        batch_size=1,
    )
    assert predictor.service_s(50, 100, 1) == pytest.approx(0.05 + 99 * 0.01)
    for _ in range(100):
        predictor.observe(
            prompt_tokens=50,
            prompt_chars=0,
            first_token_s=0.05,
            tpot_s=0.01,
            running=1,
            service_s=0.29,
            output_share=0.25,
        )
    assert predictor.service_s(50, 100, 1) == pytest.approx(0.05 + 24 * 0.01, rel=0.01)
    # Without max_tokens: the measured mean service time.
    assert predictor.service_s(50, 0, 1) == pytest.approx(0.29)


def test_short_prompts_weigh_by_their_length_in_the_characters_per_token():
    """Eight 1-character prompts (2 tokens each, the BOS counted) made the learned ratio
    about 1 character a token: a 1,079-character prompt of 422 tokens was guessed past
    the 512 the deployment takes, and EDF never refused it as late (a probe)."""
    predictor = LatencyPredictor(common.LatencyModel(), max_input_tokens=512, batch_size=4)
    for count in (8, 200):  # a few, then a long run (which outweighed a decayed prior)
        for _ in range(count):
            predictor.observe(
                prompt_tokens=2, prompt_chars=1, first_token_s=0.01, tpot_s=0.01, running=1
            )
        assert predictor.prompt_tokens(1079) < 512
        assert predictor.prompt_tokens(1250) < 766
    # Long prompts still teach it their own ratio (2.5 characters a token, say code).
    for _ in range(40):
        predictor.observe(
            prompt_tokens=400, prompt_chars=1000, first_token_s=0.1, tpot_s=0.01, running=1
        )
    assert predictor.prompt_tokens(1000) == pytest.approx(400, rel=0.05)
