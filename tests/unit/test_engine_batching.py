"""Continuous batching: BatchEngine's admission, decode, prefill groups and cancellation."""

from __future__ import annotations

from pathlib import Path

import pytest

from monitor_agent.engine import batching
from monitor_agent.engine.batching import (
    BatchEngine,
    GenerationRequest,
    SequenceHandle,
    SequenceState,
    StepOutput,
    plan_prefill_groups,
)
from monitor_agent.engine.engine import Engine, SamplingConfig
from monitor_agent.engine.memory import measure_peak_allocation
from services.models.checkpoint import create_checkpoint

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
GREEDY = SamplingConfig(ignore_eos=True)
TEXTS = [
    "Once upon a time there was a small town by the sea",
    "The river runs past the old mill",
    "A quick brown fox",
    "The river runs past the new mill",
    "In the beginning the engineers wrote a scheduler, and it was slow; then they batched",
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    checkpoint = create_checkpoint(tmp_path_factory.mktemp("batching") / "ckpt", **SMALL, seed=11)
    return Engine(checkpoint, max_seq_len=128, max_batch=4, num_threads=1)


@pytest.fixture
def core(engine: Engine) -> BatchEngine:
    """The engine's batch core, checked empty after each test."""
    yield engine.batch
    for handle in (*engine.batch.running, *engine.batch._waiting):
        engine.batch.cancel(handle)
    assert engine.batch.free_slots == engine.max_batch


def request(engine: Engine, text: str, max_tokens: int, sampling=GREEDY) -> GenerationRequest:
    return GenerationRequest(tuple(engine.encode(text)), max_tokens, sampling)


def alone(engine: Engine, req: GenerationRequest) -> list[StepOutput]:
    return list(engine.generate(list(req.prompt_ids), req.max_tokens, req.sampling))


def drive(
    core: BatchEngine, arrivals: dict[int, list[GenerationRequest]]
) -> tuple[dict[SequenceHandle, list[StepOutput]], list[GenerationRequest]]:
    """Submit arrivals[k] before step k and step until everything finished; returns every
    handle's outputs and the handles in submission order."""
    outputs: dict[SequenceHandle, list[StepOutput]] = {}
    order = []
    step = 0
    while step <= max(arrivals) or core.has_work:
        for req in arrivals.get(step, []):
            handle = core.submit(req)
            outputs[handle] = []
            order.append(handle)
        for handle, output in core.step():
            assert not outputs[handle] or not outputs[handle][-1].finished
            outputs[handle].append(output)
        step += 1
    return outputs, order


def test_greedy_outputs_in_a_batch_equal_each_request_alone(engine: Engine, core) -> None:
    # Five requests, different prompt lengths and max_tokens, joining at steps 0, 0, 3,
    # 5 and 6 into four slots: the fifth waits for the first slot given back.
    reqs = [request(engine, text, n) for text, n in zip(TEXTS, [12, 20, 9, 15, 10], strict=True)]
    expected = [alone(engine, r) for r in reqs]
    outputs, order = drive(core, {0: reqs[:2], 3: [reqs[2]], 5: [reqs[3]], 6: [reqs[4]]})
    for handle, want in zip(order, expected, strict=True):
        assert outputs[handle] == want
        assert handle.state is SequenceState.FINISHED


def test_same_length_prompts_share_a_padded_prefill_and_still_match(engine: Engine, core) -> None:
    reqs = [request(engine, TEXTS[1], 8), request(engine, TEXTS[3], 8), request(engine, "A", 8)]
    lengths = [len(r.prompt_ids) for r in reqs]
    assert [0, 1] in plan_prefill_groups(lengths)
    expected = [alone(engine, r) for r in reqs]
    outputs, order = drive(core, {0: reqs})
    assert [outputs[h] for h in order] == expected


def test_seeded_sampling_does_not_depend_on_the_company(engine: Engine, core) -> None:
    seeded = request(engine, TEXTS[0], 16, SamplingConfig(temperature=1.0, top_p=0.9, seed=42))
    expected = alone(engine, seeded)
    company = [
        request(engine, TEXTS[1], 6, SamplingConfig(temperature=0.8, seed=1, ignore_eos=True)),
        request(engine, TEXTS[2], 20),
        request(engine, TEXTS[4], 3, SamplingConfig(temperature=1.2, top_k=5)),
    ]
    outputs, order = drive(core, {0: company[:2], 2: [seeded], 4: company[2:]})
    assert outputs[order[2]] == expected


def test_a_sequence_whose_logits_are_not_finite_ends_alone(
    engine: Engine, core, monkeypatch
) -> None:
    """NaN logits (a model overflowing on one request) failed the whole step in
    torch.multinomial: every request of the batch got INTERNAL."""
    sampled = SamplingConfig(temperature=0.8, seed=3, ignore_eos=True)
    expected = [
        alone(engine, request(engine, t, 6, s))
        for t, s in ((TEXTS[2], sampled), (TEXTS[1], GREEDY))
    ]
    poisoned = core.submit(request(engine, TEXTS[0], 6, sampled))
    healthy = core.submit(request(engine, TEXTS[2], 6, sampled))
    greedy = core.submit(request(engine, TEXTS[1], 6))
    outputs = {h: [] for h in (poisoned, healthy, greedy)}
    while poisoned.state is not SequenceState.RUNNING:
        for handle, output in core.step():
            outputs[handle].append(output)
    advance = core._advance

    def nan_in_its_row(batch, logits):
        if poisoned in batch:
            logits = logits.clone()
            logits[batch.index(poisoned), 7] = float("nan")
        return advance(batch, logits)

    monkeypatch.setattr(core, "_advance", nan_in_its_row)
    while poisoned.state is SequenceState.RUNNING:
        for handle, output in core.step():
            outputs[handle].append(output)
    monkeypatch.undo()
    *_, failed = outputs[poisoned]
    assert failed.finished and failed.finish_reason == "error" and failed.token_id == -1
    assert isinstance(failed.error, batching.NonFiniteLogits)
    assert f"NaN or an infinity at token {len(outputs[poisoned])}" in str(failed.error)
    assert poisoned.state is SequenceState.FINISHED and poisoned not in core.running
    while core.has_work:
        for handle, output in core.step():
            outputs[handle].append(output)
    assert [outputs[healthy], outputs[greedy]] == expected


def test_the_engine_raises_a_sequences_own_failure(engine: Engine, monkeypatch) -> None:
    def nan_logits(batch, logits):
        return engine.batch.__class__._advance(engine.batch, batch, logits * float("nan"))

    monkeypatch.setattr(engine.batch, "_advance", nan_logits)
    with pytest.raises(batching.NonFiniteLogits, match="at token 1"):
        alone(engine, request(engine, TEXTS[0], 3))
    assert engine.batch.free_slots == engine.max_batch


def test_a_finished_sequence_frees_its_slot_for_the_next_step(engine: Engine, core) -> None:
    short = core.submit(request(engine, TEXTS[2], 2))
    long = core.submit(request(engine, TEXTS[0], 6))
    assert core.free_slots == 4 and core.num_waiting == 2  # nothing joins until a step
    first = core.step()
    assert {h for h, _ in first} == {short, long}
    assert core.free_slots == 2
    second = dict(core.step())
    assert second[short].finished and second[short].finish_reason == "length"
    assert short.state is SequenceState.FINISHED and core.free_slots == 3
    assert core.running == (long,)
    late = core.submit(request(engine, TEXTS[1], 3))
    third = dict(core.step())
    assert set(third) == {long, late}  # long decodes while late is prefilled
    assert core.running == (long, late)


def test_full_slots_admit_waiting_requests_first_in_first_out(engine: Engine, core) -> None:
    holders = [core.submit(request(engine, TEXTS[i], 3 + i)) for i in range(4)]
    waiting = [core.submit(request(engine, TEXTS[4], 4)), core.submit(request(engine, "B", 4))]
    core.step()
    assert core.running == tuple(holders) and core.free_slots == 0
    assert [h.state for h in waiting] == [SequenceState.WAITING] * 2
    core.step()
    core.step()  # holders[0] finishes its 3 tokens here
    assert holders[0].state is SequenceState.FINISHED
    assert waiting[0].state is SequenceState.WAITING  # joins at the next boundary
    core.step()
    assert waiting[0].state is SequenceState.RUNNING
    assert waiting[0].slot == holders[0].slot
    assert waiting[1].state is SequenceState.WAITING
    core.step()  # holders[1] finishes (4 tokens)
    core.step()
    assert waiting[1].state is SequenceState.RUNNING


def test_cancelling_frees_the_slot_at_once_and_silences_the_sequence(engine: Engine, core) -> None:
    running = core.submit(request(engine, TEXTS[0], 50))
    other = core.submit(request(engine, TEXTS[1], 50))
    queued = [core.submit(request(engine, TEXTS[2], 5)) for _ in range(3)]
    core.step()
    assert core.free_slots == 0 and core.num_waiting == 1
    core.cancel(running)
    core.cancel(queued[2])
    assert running.state is SequenceState.CANCELLED and queued[2].state is SequenceState.CANCELLED
    assert core.free_slots == 1 and core.num_waiting == 0
    assert {h for h, _ in core.step()} == {other, *queued[:2]}
    core.cancel(running)  # a second cancel does nothing
    assert core.free_slots == 1
    core.cancel(other)
    assert core.free_slots == 2


def test_prefill_token_budget_limits_admissions_per_step(engine: Engine) -> None:
    core = BatchEngine(
        engine.model,
        engine.tokenizer,
        max_batch=4,
        max_seq_len=128,
        eos_token_ids=engine.eos_token_ids,
        prefill_token_budget=25,
    )
    reqs = [request(engine, text, 4) for text in (TEXTS[1], TEXTS[3], TEXTS[4])]
    assert [len(r.prompt_ids) for r in reqs] == [11, 11, 34]  # a budget of 25: 22, then 34
    handles = [core.submit(r) for r in reqs]
    core.step()
    assert [h.state for h in handles] == [SequenceState.RUNNING] * 2 + [SequenceState.WAITING]
    # Each first token waited for the step's every prefill: the scheduler learns from it.
    assert [h.prefilled_with for h in handles[:2]] == [22, 22]
    core.step()
    assert handles[2].state is SequenceState.RUNNING  # alone it may exceed the budget
    assert handles[2].prefilled_with == 34
    for handle in handles:
        core.cancel(handle)


def test_plan_prefill_groups_bounds_padding() -> None:
    assert plan_prefill_groups([]) == []
    assert plan_prefill_groups([7]) == [[0]]
    assert plan_prefill_groups([10, 10, 10]) == [[0, 1, 2]]
    # shortest first: 4 and 5 pad to 10 <= 1.25 * 9; adding 12 would make 36 > 26.25
    assert plan_prefill_groups([12, 4, 5, 40]) == [[1, 2], [0], [3]]
    assert plan_prefill_groups([4, 5], max_padding_fraction=0.0) == [[0], [1]]
    # Long prompts of different lengths would attend through a [2, 4001, 4001] mask (32M
    # elements, 160 MB): prefilled apart; of one length, together under a causal mask.
    assert plan_prefill_groups([4000, 4001]) == [[0], [1]]
    assert plan_prefill_groups([4000, 4000]) == [[0, 1]]
    assert plan_prefill_groups([1000, 1001]) == [[0, 1]]


def test_requests_are_validated_once_where_they_enter(engine: Engine, core) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        core.validate(GenerationRequest((), 4))
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        core.validate(GenerationRequest((1,) * 120, 9))
    # Engine.generate is such an entry: a bad request is refused before it is queued.
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        engine.generate([1, 2], 0, SamplingConfig())
    assert not core.has_work and not engine.batch.has_work


def test_memory_account_measures_the_passes_that_could_set_a_peak(
    tmp_path: Path, monkeypatch
) -> None:
    """Activations are measured on CPU: the prefill's at least what its MLP must hold at
    once (the activation, the up projection and their product, in float32), and only
    passes larger than any measured before run under the profiler (not every decode)."""
    checkpoint = create_checkpoint(tmp_path / "ckpt", **SMALL, seed=5)
    engine = Engine(checkpoint, max_seq_len=128, max_batch=4, num_threads=1)
    measured = []

    def counted(run):
        result, peak = measure_peak_allocation(run)
        measured.append(peak)
        return result, peak

    monkeypatch.setattr(batching, "measure_peak_allocation", counted)
    memory = engine.memory
    assert memory.weight_bytes + memory.kv_cache_bytes == engine.resident_bytes()
    assert memory.kv_cache_bytes == engine.spec.kv_cache_bytes(128, 4, 4)
    assert memory.peak_activation_bytes == 0
    core = engine.batch
    req = request(engine, TEXTS[4], 20)
    drive(core, {0: [req]})
    n = len(req.prompt_ids)
    mlp = 3 * n * engine.spec.intermediate_size * 4
    assert measured == [memory.peak_activation_bytes]  # the prefill; no decode step
    assert memory.peak_activation_bytes >= mlp
    assert memory.resident_bytes == engine.resident_bytes() + memory.peak_activation_bytes
    alone = memory.peak_activation_bytes

    drive(core, {0: [request(engine, TEXTS[4], 2) for _ in range(3)]})  # one 3-row prefill
    assert len(measured) == 2
    assert memory.peak_activation_bytes >= 3 * mlp > alone
    drive(core, {0: [req]})  # nothing larger: nothing measured
    assert len(measured) == 2
