"""The TensorRT-LLM engine against a stand-in ``tensorrt_llm`` module (no GPU, no
TensorRT-LLM here): every configuration mapping, the pp_partition fallback, sampling,
streaming deltas through the engine and the worker's runner, cancellation, memory, engine
selection and the errors for configurations that do not map."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import subprocess
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from monitor_agent.engine.batching import GenerationRequest
from monitor_agent.engine.detokenizer import IncrementalDetokenizer
from monitor_agent.engine.sampling import SamplingConfig
from monitor_agent.engine.trtllm import mapping
from monitor_agent.engine.trtllm.engine import TrtLlmEngine, narrow_visible_devices
from monitor_agent.engine.trtllm.mapping import CannotMap, TrtLlmConfig, plan_llm
from monitor_agent.engine.trtllm.selection import EngineUnavailable, choose_engine
from monitor_agent.worker import process
from monitor_agent.worker.runner import EngineRunner, RequestClock
from services.models.checkpoint import TOKENIZER_FILE, InvalidCheckpoint, create_checkpoint

GIB = 1 << 30
NUM_LAYERS = 4


# --- the stand-in tensorrt_llm ------------------------------------------------------


def _llmapi_stand_in():
    """The stand-in ``tensorrt_llm.llmapi`` the supervisor's worker tests import
    (tests/unit/trtllm_stand_in), loaded by path under a name of its own: its classes
    (QuantAlgo, QuantConfig, KvCacheConfig) serve this module's in-process stand-in too."""
    path = Path(__file__).parent / "trtllm_stand_in" / "tensorrt_llm" / "llmapi.py"
    spec = importlib.util.spec_from_file_location("trtllm_stand_in_llmapi", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while built
    spec.loader.exec_module(module)
    return module


_llmapi = _llmapi_stand_in()
QuantAlgo, QuantConfig, KvCacheConfig = (
    _llmapi.QuantAlgo,
    _llmapi.QuantConfig,
    _llmapi.KvCacheConfig,
)


class SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: Any = None


@dataclass
class Snapshot:
    """One streamed state of a request: its cumulative tokens and text so far."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: Any = None


class RequestOutput:
    """Async-iterable like TensorRT-LLM's streaming result: the same object, updated,
    after each scripted snapshot; ``hold`` blocks before the next one until set."""

    def __init__(self, script: list[Snapshot | Exception], hold: threading.Event | None) -> None:
        self.script = script
        self.hold = hold
        self.outputs = [Completion([], "")]
        self.finished = False
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    async def _snapshots(self):
        for item in self.script:
            while self.hold is not None and not self.hold.is_set():
                await asyncio.sleep(0.005)
            if isinstance(item, Exception):
                raise item
            self.outputs[0] = Completion(
                list(item.token_ids), item.text, item.finish_reason, item.stop_reason
            )
            self.finished = item.finished
            yield self

    def __aiter__(self):
        return self._snapshots()


@dataclass
class Device:
    """The stand-in GPUs: free bytes per visible device, spent by an LLM's build."""

    free: dict[int, int] = field(default_factory=lambda: dict.fromkeys(range(8), 80 * GIB))

    def free_bytes(self, device: int) -> int:
        return self.free[device]


class Recorder:
    """What the stand-in LLMs saw: constructor arguments and generate_async calls."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.built: list[tuple[str, dict[str, Any]]] = []
        self.calls: list[tuple[list[int], SamplingParams, bool]] = []
        self.results: list[RequestOutput] = []
        self.scripts: list[list[Snapshot | Exception]] = []
        self.hold: threading.Event | None = None
        self.shutdowns = 0


def make_llm_class(recorder: Recorder, backend: str) -> type:
    class LLM:
        def __init__(self, **kwargs: Any) -> None:
            recorder.built.append((backend, kwargs))
            world = kwargs["tensor_parallel_size"] * kwargs["pipeline_parallel_size"]
            for rank in range(world):
                recorder.device.free[rank] -= (rank + 1) * GIB

        def generate_async(
            self, prompt: list[int], sampling_params: SamplingParams, streaming: bool = False
        ) -> RequestOutput:
            recorder.calls.append((prompt, sampling_params, streaming))
            result = RequestOutput(recorder.scripts.pop(0), recorder.hold)
            recorder.results.append(result)
            return result

        def shutdown(self) -> None:
            recorder.shutdowns += 1

    return LLM


def args_class(with_pp_partition: bool) -> type:
    fields = {"model": None, "tensor_parallel_size": None, "pipeline_parallel_size": None}
    if with_pp_partition:
        fields["pp_partition"] = None
    return type("Args", (), {"model_fields": fields})


def install_stand_in(
    monkeypatch: pytest.MonkeyPatch,
    *,
    pp_partition: bool = True,
    tensorrt_engine: bool = True,
) -> Recorder:
    recorder = Recorder(Device())
    root = types.ModuleType("tensorrt_llm")
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    root.LLM = make_llm_class(recorder, "pytorch")
    root.SamplingParams = SamplingParams
    root.llmapi = llmapi
    llmapi.QuantConfig, llmapi.QuantAlgo, llmapi.KvCacheConfig = (
        QuantConfig,
        QuantAlgo,
        KvCacheConfig,
    )
    llmapi.SamplingParams = SamplingParams
    llmapi.TorchLlmArgs = args_class(pp_partition)
    llmapi.TrtLlmArgs = args_class(pp_partition)
    monkeypatch.setitem(sys.modules, "tensorrt_llm", root)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    if tensorrt_engine:
        engine = types.ModuleType("tensorrt_llm._tensorrt_engine")
        engine.LLM = make_llm_class(recorder, "tensorrt")
        monkeypatch.setitem(sys.modules, "tensorrt_llm._tensorrt_engine", engine)
    else:
        # None in sys.modules makes the import raise ImportError.
        monkeypatch.setitem(sys.modules, "tensorrt_llm._tensorrt_engine", None)
    return recorder


# --- fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_checkpoint(
        tmp_path_factory.mktemp("trtllm") / "model",
        hidden_size=64,
        num_layers=NUM_LAYERS,
        num_heads=4,
        num_kv_heads=2,
    )


@pytest.fixture(autouse=True)
def visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine narrows CUDA_VISIBLE_DEVICES; keep that inside each test. (delenv of an
    absent variable records nothing to undo, so setenv first: teardown then removes what
    the engine set, and later tests' worker processes do not inherit it.)"""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    return install_stand_in(monkeypatch)


def config(checkpoint: Path, **changes: Any) -> TrtLlmConfig:
    return TrtLlmConfig(checkpoint_dir=checkpoint, **changes)


def plan(checkpoint: Path, **changes: Any) -> mapping.LlmPlan:
    return plan_llm(config(checkpoint, **changes), NUM_LAYERS, sys.modules["tensorrt_llm"])


def build(checkpoint: Path, recorder: Recorder, **changes: Any) -> TrtLlmEngine:
    return TrtLlmEngine(
        config(checkpoint, **changes), free_bytes=recorder.device.free_bytes, step_wait_s=0.01
    )


# --- configuration mapping ----------------------------------------------------------


def test_plain_configuration_runs_on_the_pytorch_backend(checkpoint, stand_in):
    result = plan(checkpoint, dtype="bfloat16", max_batch=4, max_seq_len=512)
    assert result.backend == "pytorch"
    assert result.kwargs == {
        "model": str(checkpoint),
        "skip_tokenizer_init": True,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "dtype": "bfloat16",
        "max_batch_size": 4,
        "max_seq_len": 512,
        # iserve reserved KV for max_batch sequences of max_seq_len tokens, no more.
        "kv_cache_config": KvCacheConfig(max_tokens=4 * 512),
    }


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_tensor_and_pipeline_parallel_sizes(checkpoint, stand_in, tp, pp):
    result = plan(
        checkpoint, tensor_parallel=tp, pipeline_parallel=pp, devices=tuple(range(tp * pp))
    )
    assert result.kwargs["tensor_parallel_size"] == tp
    assert result.kwargs["pipeline_parallel_size"] == pp
    assert "pp_partition" not in result.kwargs  # no layer map: TensorRT-LLM's even split


def test_uneven_layer_map_is_pp_partition(checkpoint, stand_in, caplog):
    with caplog.at_level(logging.WARNING):
        result = plan(checkpoint, pipeline_parallel=2, devices=(0, 1), stage_layers=(1, 3))
    assert result.kwargs["pp_partition"] == [1, 3]
    assert caplog.records == []


@pytest.mark.parametrize("backend_option", [{}, {"weight_quant": "int8"}])
def test_without_pp_partition_an_uneven_map_falls_back_with_a_warning(
    checkpoint, monkeypatch, caplog, backend_option
):
    install_stand_in(monkeypatch, pp_partition=False)
    with caplog.at_level(logging.WARNING, logger="iserve.engine.trtllm"):
        result = plan(
            checkpoint, pipeline_parallel=2, devices=(0, 1), stage_layers=(1, 3), **backend_option
        )
    assert "pp_partition" not in result.kwargs
    (record,) = caplog.records
    assert "no pp_partition" in record.message
    assert "[1, 3]" in record.message
    assert "even split" in record.message


def test_without_pp_partition_an_even_map_needs_no_warning(checkpoint, monkeypatch, caplog):
    install_stand_in(monkeypatch, pp_partition=False)
    with caplog.at_level(logging.WARNING):
        result = plan(checkpoint, pipeline_parallel=2, devices=(0, 1), stage_layers=(2, 2))
    assert "pp_partition" not in result.kwargs
    assert caplog.records == []


def test_pp_partition_is_read_from_the_backends_own_arguments(checkpoint, monkeypatch, caplog):
    install_stand_in(monkeypatch)
    # The TensorRT-engine LLM's arguments lack the field, the PyTorch backend's have it.
    sys.modules["tensorrt_llm.llmapi"].TrtLlmArgs = args_class(False)
    layer_map = {"pipeline_parallel": 2, "devices": (0, 1), "stage_layers": (3, 1)}
    assert plan(checkpoint, **layer_map).kwargs["pp_partition"] == [3, 1]
    with caplog.at_level(logging.WARNING):
        assert "pp_partition" not in plan(checkpoint, weight_quant="int4", **layer_map).kwargs
    assert len(caplog.records) == 1


@pytest.mark.parametrize(
    ("weight_quant", "algo"),
    [
        ("int8", QuantAlgo.W8A16),
        ("int4", QuantAlgo.W4A16),
        ("gptq-int4", QuantAlgo.W4A16_GPTQ),
        ("awq-int4", QuantAlgo.W4A16_AWQ),
    ],
)
def test_weight_quantization_is_a_quant_config_on_the_tensorrt_engine_llm(
    checkpoint, stand_in, weight_quant, algo
):
    result = plan(checkpoint, weight_quant=weight_quant)
    assert result.backend == "tensorrt"
    assert result.kwargs["quant_config"] == QuantConfig(quant_algo=algo)
    assert result.kwargs["kv_cache_config"] == KvCacheConfig(max_tokens=2048)


def test_int8_kv_cache_is_a_kv_quant_algo_on_the_tensorrt_engine_llm(checkpoint, stand_in):
    result = plan(checkpoint, kv_cache_dtype="int8")
    assert result.backend == "tensorrt"
    assert result.kwargs["quant_config"] == QuantConfig(kv_cache_quant_algo=QuantAlgo.INT8)
    assert result.kwargs["kv_cache_config"].dtype == "auto"


def test_fp8_kv_cache_is_kv_cache_config_dtype_on_the_pytorch_backend(checkpoint, stand_in):
    result = plan(checkpoint, kv_cache_dtype="fp8", max_batch=2, max_seq_len=128)
    assert result.backend == "pytorch"
    assert "quant_config" not in result.kwargs
    assert result.kwargs["kv_cache_config"] == KvCacheConfig(max_tokens=256, dtype="fp8")


@pytest.mark.parametrize(("kv", "kv_algo"), [("int8", QuantAlgo.INT8), ("fp8", QuantAlgo.FP8)])
def test_weight_and_kv_quantization_share_one_quant_config(checkpoint, stand_in, kv, kv_algo):
    result = plan(checkpoint, weight_quant="awq-int4", kv_cache_dtype=kv)
    assert result.backend == "tensorrt"
    assert result.kwargs["quant_config"] == QuantConfig(
        quant_algo=QuantAlgo.W4A16_AWQ, kv_cache_quant_algo=kv_algo
    )
    # KvCacheConfig.dtype is read by the PyTorch backend only; it stays unset here.
    assert result.kwargs["kv_cache_config"].dtype == "auto"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"pruning": "2:4"}, "pruning '2:4' does not map"),
        ({"pruning": "2:4-compact"}, "pruning '2:4-compact' does not map"),
        ({"pruning": "structured"}, "pruning 'structured' does not map"),
        ({"weight_quant": "int3"}, "weight quantization 'int3' does not map"),
        ({"kv_cache_dtype": "int4"}, "KV-cache dtype 'int4' does not map"),
        ({"dtype": "float64"}, "dtype 'float64' does not map"),
        ({"tensor_parallel": 2}, r"one CUDA device per rank \(tp·pp = 2\)"),
        (
            {"pipeline_parallel": 2, "devices": (0, 1), "stage_layers": (1, 2)},
            r"layer map \[1, 2\] must give each of the 2 pipeline stages at least one layer "
            "and 4 layers in all",
        ),
        (
            {"pipeline_parallel": 2, "devices": (0, 1), "stage_layers": (0, 4)},
            "at least one layer",
        ),
        ({"pipeline_parallel": 2, "devices": (0, 1), "stage_layers": (4,)}, "2 pipeline stages"),
    ],
)
def test_configurations_that_cannot_map_name_the_option(checkpoint, stand_in, changes, message):
    with pytest.raises(CannotMap, match=message):
        plan(checkpoint, **changes)


def test_a_tensorrt_llm_without_the_tensorrt_engine_llm_cannot_quantize(checkpoint, monkeypatch):
    recorder = install_stand_in(monkeypatch, tensorrt_engine=False)
    with pytest.raises(CannotMap, match=r"tensorrt backend \(tensorrt_llm._tensorrt_engine.LLM\)"):
        build(checkpoint, recorder, weight_quant="int8")
    assert recorder.built == []


# --- sampling -----------------------------------------------------------------------


def sampled(sampling: SamplingConfig, max_tokens: int = 7, eos=frozenset({2})) -> dict:
    request = GenerationRequest((1, 2, 3), max_tokens, sampling)
    return mapping.sampling_params(sys.modules["tensorrt_llm"], request, eos).kwargs


def test_greedy_requests_decode_with_top_k_one(stand_in):
    assert sampled(SamplingConfig()) == {
        "end_id": 2,
        "detokenize": False,
        "max_tokens": 7,
        "ignore_eos": False,
        "stop_token_ids": [2],
        "seed": None,
        "top_k": 1,
    }
    assert sampled(SamplingConfig(temperature=1e-6))["top_k"] == 1


def test_sampled_requests_carry_temperature_top_k_top_p_and_seed(stand_in):
    kwargs = sampled(SamplingConfig(temperature=0.7, top_k=40, top_p=0.9, seed=11), max_tokens=3)
    assert kwargs == {
        "end_id": 2,
        "detokenize": False,
        "max_tokens": 3,
        "ignore_eos": False,
        "stop_token_ids": [2],
        "seed": 11,
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.9,
    }
    # top_k 0 (off) is unset in TensorRT-LLM: all tokens.
    assert sampled(SamplingConfig(temperature=1.0))["top_k"] is None


def test_end_id_is_the_checkpoints_first_eos_id(stand_in):
    request = GenerationRequest((1,), 1, SamplingConfig())
    api = sys.modules["tensorrt_llm"]
    assert mapping.sampling_params(api, request, frozenset({7, 3}), (7,)).kwargs["end_id"] == 7
    assert mapping.sampling_params(api, request, frozenset({7, 3})).kwargs["end_id"] == 3
    assert mapping.sampling_params(api, request, frozenset()).kwargs["end_id"] is None
    # generation_config.json names other EOS ids than config.json's, or none: config.json's
    # first is no end then (it used to stop TensorRT-LLM where the PyTorch engine goes on).
    assert mapping.sampling_params(api, request, frozenset({9}), (7,)).kwargs["end_id"] == 9
    assert mapping.sampling_params(api, request, frozenset(), (7,)).kwargs["end_id"] is None


def test_stop_tokens_and_ignore_eos(stand_in):
    config = SamplingConfig(stop_token_ids=(9, 5))
    assert sampled(config, eos=frozenset({2, 3}))["stop_token_ids"] == [2, 3, 5, 9]
    ignoring = sampled(SamplingConfig(stop_token_ids=(9,), ignore_eos=True), eos=frozenset({2}))
    assert ignoring["ignore_eos"] is True
    assert ignoring["stop_token_ids"] == [9]
    assert sampled(SamplingConfig(ignore_eos=True))["stop_token_ids"] is None


# --- the engine: build, memory, streaming -------------------------------------------


def test_engine_builds_the_planned_llm_and_reports_its_device_memory(checkpoint, stand_in):
    engine = build(
        checkpoint,
        stand_in,
        tensor_parallel=2,
        pipeline_parallel=2,
        devices=(4, 5, 6, 7),
        stage_layers=(1, 3),
        weight_quant="int4",
    )
    ((backend, kwargs),) = stand_in.built
    assert backend == engine.backend == "tensorrt"
    assert kwargs["pp_partition"] == [1, 3]
    # The stand-in's build spent rank+1 GiB on each visible device 0..3 (the group's).
    assert engine.memory.device_bytes == (GIB, 2 * GIB, 3 * GIB, 4 * GIB)
    assert engine.memory.resident_bytes == 10 * GIB
    probe = process.peak_memory_probe(engine, "cuda:4", process.TENSORRT_LLM_ENGINE)
    assert probe() == 10 * GIB
    assert engine.layer_clock is None
    engine.close()
    assert stand_in.shutdowns == 1


def test_the_group_devices_become_the_visible_devices(monkeypatch):
    narrow_visible_devices((2, 3))
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    # Indices are read through what this process already sees.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    narrow_visible_devices((1, 3))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"
    with pytest.raises(ValueError, match="CUDA device 9 is not visible"):
        narrow_visible_devices((9,))


def test_engine_refuses_what_the_checkpoint_cannot_hold(checkpoint, stand_in, tmp_path):
    with pytest.raises(ValueError, match="max_seq_len must be in"):
        build(checkpoint, stand_in, max_seq_len=10**6)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        build(checkpoint, stand_in, max_batch=0)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(InvalidCheckpoint, match=TOKENIZER_FILE):
        build(bare, stand_in)
    assert stand_in.built == []


# Token ids of " the quick brown fox" in the test tokenizer, streamed 1, 2, then 1 at a time.
STREAM_TEXT = " the quick brown fox"


def stream_script(engine: TrtLlmEngine, finish_reason: str = "length") -> list[Snapshot]:
    ids = engine.tokenizer.encode(STREAM_TEXT, add_special_tokens=False).ids
    cuts = [1, 3, *range(4, len(ids) + 1)]
    return [
        Snapshot(ids[:cut], "", cut == len(ids), finish_reason if cut == len(ids) else None)
        for cut in cuts
    ]


def test_generate_streams_each_new_token_once_with_the_pytorch_engines_text(checkpoint, stand_in):
    engine = build(checkpoint, stand_in, max_seq_len=64)
    script = stream_script(engine)
    ids = script[-1].token_ids
    stand_in.scripts.append(script)
    outputs = list(engine.generate([1, 2, 3], len(ids), SamplingConfig(temperature=0.5, seed=3)))
    assert [o.token_id for o in outputs] == ids
    assert [(o.finished, o.finish_reason) for o in outputs] == [(False, None)] * (len(ids) - 1) + [
        (True, "length")
    ]
    # Text per token as the PyTorch engine emits it: iserve's incremental detokenizer.
    reference = IncrementalDetokenizer(engine.tokenizer, [1, 2, 3])
    expected = [reference.add(t) for t in ids]
    expected[-1] += reference.flush()
    assert [o.text for o in outputs] == expected
    assert "".join(expected) == STREAM_TEXT
    ((prompt, params, streaming),) = stand_in.calls
    assert prompt == [1, 2, 3]
    assert streaming is True
    assert params.kwargs["seed"] == 3
    assert params.kwargs["detokenize"] is False
    engine.close()


def test_a_stop_token_ends_the_stream_without_text(checkpoint, stand_in):
    engine = build(checkpoint, stand_in, max_seq_len=64)
    eos = engine.spec.eos_token_ids[0]
    stand_in.scripts.append([Snapshot([5], ""), Snapshot([5, eos], "", True, "stop")])
    outputs = list(engine.generate([1], 4, SamplingConfig()))
    assert [(o.token_id, o.finished, o.finish_reason) for o in outputs] == [
        (5, False, None),
        (eos, True, "stop"),
    ]
    assert outputs[-1].text == ""
    engine.close()


def test_a_stop_token_left_out_of_the_output_still_ends_the_stream(checkpoint, stand_in):
    engine = build(checkpoint, stand_in, max_seq_len=64)
    stand_in.scripts.append([Snapshot([5], ""), Snapshot([5], "", True, "stop", stop_reason=9)])
    outputs = list(engine.generate([1], 4, SamplingConfig()))
    assert [(o.token_id, o.finished, o.finish_reason) for o in outputs] == [
        (5, False, None),
        (9, True, "stop"),
    ]
    engine.close()


def test_validation_matches_the_pytorch_engine(checkpoint, stand_in):
    engine = build(checkpoint, stand_in, max_seq_len=8)
    vocab = engine.spec.vocab_size
    for prompt, max_tokens, message in [
        ([], 1, "prompt is empty"),
        ([1], 0, "max_tokens must be at least 1"),
        ([1] * 6, 3, r"prompt \(6 tokens\) \+ max_tokens \(3\) exceeds max_seq_len \(8\)"),
        ([vocab], 1, "prompt_token_ids outside"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.generate(prompt, max_tokens, SamplingConfig())
    assert stand_in.calls == []
    engine.close()


def test_the_worker_runner_streams_cancels_and_fails_through_the_core(checkpoint, stand_in):
    engine = build(checkpoint, stand_in, max_seq_len=64, max_batch=2)
    runner = EngineRunner(engine)

    async def collect(request: GenerationRequest, stop: threading.Event) -> list:
        return [o async for o in runner.generate(request, stop, RequestClock())]

    async def scenario() -> None:
        script = stream_script(engine)
        ids = script[-1].token_ids
        stand_in.scripts.append(script)
        request = runner.parse([1, 2], len(ids), SamplingConfig())
        tokens = await collect(request, threading.Event())
        assert [o.token_id for o in tokens] == ids
        assert "".join(o.text for o in tokens) == STREAM_TEXT
        assert tokens[-1].finished

        # A cancelled request is aborted in TensorRT-LLM.
        stand_in.hold = threading.Event()
        stand_in.scripts.append(stream_script(engine))
        stop = threading.Event()
        task = asyncio.ensure_future(collect(runner.parse([1], 4, SamplingConfig()), stop))
        for _ in range(200):
            if stand_in.results[1:]:
                break
            await asyncio.sleep(0.01)
        stop.set()
        assert await asyncio.wait_for(task, 5) == []
        for _ in range(200):
            if stand_in.results[1].aborted:
                break
            await asyncio.sleep(0.01)
        assert stand_in.results[1].aborted
        stand_in.hold.set()

        # A request failing inside TensorRT-LLM fails with its error.
        stand_in.scripts.append([Snapshot([5], ""), RuntimeError("executor died")])
        with pytest.raises(RuntimeError, match="executor died"):
            await collect(runner.parse([1], 4, SamplingConfig()), threading.Event())

    try:
        asyncio.run(scenario())
        assert runner.requests_served == 3
    finally:
        runner.close()
        engine.close()


# --- choosing the engine ------------------------------------------------------------


def cfg(**changes: Any) -> TrtLlmConfig:
    return TrtLlmConfig(checkpoint_dir=Path("/m"), **changes)


def test_pytorch_is_always_pytorch():
    assert (
        choose_engine("pytorch", cfg(pruning="2:4"), device="cuda:0", installed=True) == "pytorch"
    )


def test_tensorrt_llm_when_installed_on_a_gpu():
    assert choose_engine("tensorrt_llm", cfg(), device="cuda:1", installed=True) == "tensorrt_llm"


@pytest.mark.parametrize(
    ("device", "installed", "message"),
    [
        ("cuda:0", False, "tensorrt_llm is not installed"),
        ("cpu", True, "runs on NVIDIA GPUs only, not on 'cpu'"),
    ],
)
def test_tensorrt_llm_that_cannot_run_says_why(device, installed, message):
    with pytest.raises(EngineUnavailable, match=f"ISERVE_ENGINE=tensorrt_llm: .*{message}"):
        choose_engine("tensorrt_llm", cfg(), device=device, installed=installed)


def test_tensorrt_llm_with_a_configuration_that_does_not_map_names_the_option():
    with pytest.raises(CannotMap, match="pruning 'structured'"):
        choose_engine("tensorrt_llm", cfg(pruning="structured"), device="cuda:0", installed=True)


def test_auto_takes_tensorrt_llm_where_it_runs():
    assert choose_engine("auto", cfg(), device="cuda:0", installed=True) == "tensorrt_llm"


@pytest.mark.parametrize(
    ("changes", "device", "installed", "ranks", "why"),
    [
        ({}, "cuda:0", False, 1, "not installed"),
        ({}, "cpu", True, 1, "NVIDIA GPUs only"),
        ({"pruning": "2:4"}, "cuda:0", True, 1, "pruning '2:4'"),
        ({"tensor_parallel": 2, "devices": (0, 1)}, "cuda:0", True, 2, "one of 2 rank processes"),
    ],
)
def test_auto_falls_back_to_pytorch_and_logs_why(caplog, changes, device, installed, ranks, why):
    with caplog.at_level(logging.INFO, logger="iserve.engine.trtllm"):
        chosen = choose_engine(
            "auto", cfg(**changes), device=device, worker_ranks=ranks, installed=installed
        )
    assert chosen == "pytorch"
    assert why in caplog.text


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="ISERVE_ENGINE must be one of"):
        choose_engine("vllm", cfg(), device="cuda:0", installed=True)


# --- the worker's command line ------------------------------------------------------


def worker_args(checkpoint: Path, *extra: str) -> list[str]:
    return [
        "--deployment-id", "d", "--checkpoint", str(checkpoint), "--ready-file", "/tmp/r",
        *extra,
    ]  # fmt: skip


def test_worker_engine_comes_from_iserve_engine(checkpoint, monkeypatch):
    monkeypatch.setenv("ISERVE_ENGINE", "pytorch")
    args = process.parse_args(worker_args(checkpoint))
    process.check_args(args)
    assert args.engine == "pytorch"
    monkeypatch.setenv("ISERVE_ENGINE", "tensorrt_llm")
    args = process.parse_args(worker_args(checkpoint, "--device", "cuda:0"))
    if not process_has_tensorrt_llm():
        with pytest.raises(EngineUnavailable, match="tensorrt_llm is not installed"):
            process.check_args(args)


def test_worker_on_cpu_refuses_tensorrt_llm(checkpoint):
    args = process.parse_args(worker_args(checkpoint, "--engine", "tensorrt_llm"))
    with pytest.raises(ValueError, match="ISERVE_ENGINE=tensorrt_llm"):
        process.check_args(args)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--weight-quant", "gptq-int4"], "--weight-quant gptq-int4 needs the TensorRT-LLM"),
        (["--kv-quant", "fp8"], "--kv-quant fp8 needs the TensorRT-LLM"),
        (["--stage-layers", "1,3"], "--stage-layers is for the TensorRT-LLM engine"),
        (["--group-devices", "0"], "--group-devices is for the TensorRT-LLM engine"),
    ],
)
def test_worker_refuses_tensorrt_llm_only_options_on_pytorch(checkpoint, extra, message):
    args = process.parse_args(worker_args(checkpoint, "--engine", "pytorch", *extra))
    with pytest.raises(ValueError, match=message):
        process.check_args(args)


def test_profiling_workers_run_the_pytorch_engine(checkpoint, monkeypatch):
    """A profiling job times layers, which only the PyTorch engine's layer clock does."""
    monkeypatch.setattr(
        "monitor_agent.engine.trtllm.selection.tensorrt_llm_installed", lambda: True
    )
    gpu = worker_args(checkpoint, "--device", "cuda:0", "--time-layers")
    args = process.parse_args([*gpu, "--engine", "auto"])
    process.check_args(args)
    assert args.engine == "pytorch"
    with pytest.raises(ValueError, match="--time-layers needs the PyTorch engine"):
        process.check_args(process.parse_args([*gpu, "--engine", "tensorrt_llm"]))


def test_worker_builds_the_tensorrt_llm_configuration(checkpoint, monkeypatch):
    monkeypatch.setattr(
        "monitor_agent.engine.trtllm.selection.tensorrt_llm_installed", lambda: True
    )
    argv = worker_args(
        checkpoint,
        "--engine", "tensorrt_llm", "--device", "cuda:2", "--dtype", "bfloat16",
        "--tensor-parallel", "2", "--pipeline-parallel", "2", "--world-size", "4",
        "--group-devices", "2,3,4,5", "--stage-layers", "1,3", "--weight-quant", "awq-int4",
        "--kv-quant", "fp8", "--max-batch", "3", "--max-seq-len", "256",
    )  # fmt: skip
    args = process.parse_args(argv)
    process.check_args(args)  # no --rendezvous: TensorRT-LLM forms the group itself
    assert args.engine == "tensorrt_llm"
    assert process.join_group(args) is None
    assert process.trtllm_config(args) == TrtLlmConfig(
        checkpoint_dir=checkpoint,
        devices=(2, 3, 4, 5),
        dtype="bfloat16",
        max_seq_len=256,
        max_batch=3,
        tensor_parallel=2,
        pipeline_parallel=2,
        stage_layers=(1, 3),
        weight_quant="awq-int4",
        kv_cache_dtype="fp8",
    )
    rank_one = process.parse_args([*argv, "--rank", "1"])
    with pytest.raises(ValueError, match="start rank 0 only"):
        process.check_args(rank_one)
    bad = process.parse_args([*argv[:-2], "--stage-layers", "1,x"])
    with pytest.raises(ValueError, match="--stage-layers: give comma-separated"):
        process.check_args(bad)


def test_worker_loads_the_tensorrt_llm_engine(checkpoint, stand_in, monkeypatch):
    monkeypatch.setattr(
        "monitor_agent.engine.trtllm.selection.tensorrt_llm_installed", lambda: True
    )
    monkeypatch.setattr(
        "monitor_agent.engine.trtllm.engine._cuda_free_bytes", stand_in.device.free_bytes
    )
    args = process.parse_args(
        worker_args(checkpoint, "--engine", "tensorrt_llm", "--device", "cuda:0")
    )
    process.check_args(args)
    engine = process.load_engine(args, [])
    try:
        assert isinstance(engine, TrtLlmEngine)
        assert engine.memory.resident_bytes == GIB
    finally:
        engine.close()


def process_has_tensorrt_llm() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorrt_llm") is not None


# --- the optional dependency ---------------------------------------------------------


def test_importing_the_engine_does_not_import_tensorrt_llm():
    code = (
        "import sys\n"
        "import monitor_agent.engine.trtllm.engine, monitor_agent.engine.trtllm.selection\n"
        "import monitor_agent.worker.process\n"
        "assert 'tensorrt_llm' not in sys.modules, 'tensorrt_llm imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
