"""iserve's deployment configuration as arguments of TensorRT-LLM's LLM API.

Pure functions: the ``api`` argument is the imported ``tensorrt_llm`` module (a stand-in
in tests); nothing here imports it. What maps to what, and which of TensorRT-LLM's two
``LLM`` classes takes it, is :func:`plan_llm`'s table (also in docs/engine.md):

* the PyTorch-backend ``tensorrt_llm.LLM`` (the default ``LLM`` since TensorRT-LLM 1.0)
  serves 16-bit checkpoints and an fp8 KV cache (``KvCacheConfig(dtype="fp8")``, a field
  only that backend reads);
* the TensorRT-engine ``tensorrt_llm._tensorrt_engine.LLM`` builds an engine from the
  checkpoint and takes ``QuantConfig``: weight-only int8/int4 quantized at build
  (``W8A16``/``W4A16``), GPTQ/AWQ int4 (``W4A16_GPTQ``/``W4A16_AWQ``), and an int8 or fp8
  KV cache (``kv_cache_quant_algo``). The PyTorch backend does not quantize at load: it
  serves only checkpoints quantized beforehand (their quantization read from the
  checkpoint), so every weight quantization goes to the TensorRT-engine LLM.

A configuration TensorRT-LLM cannot run as asked raises :class:`CannotMap` naming the
option; nothing is silently dropped except an uneven layer map on a TensorRT-LLM whose
arguments lack ``pp_partition`` (a prototype field), which falls back to TensorRT-LLM's
even split with a warning.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from services.engine_rules import even_stage_layers

if TYPE_CHECKING:
    # Not at run time: the worker reads this module before it pins its cores, and the
    # batching module imports torch, whose thread pools must start after the pinning.
    from monitor_agent.engine.batching import GenerationRequest

log = logging.getLogger("iserve.engine.trtllm")

# iserve's weight quantization -> the QuantAlgo member TensorRT-LLM builds it with.
WEIGHT_QUANT_ALGOS = {
    "int8": "W8A16",
    "int4": "W4A16",
    "gptq-int4": "W4A16_GPTQ",
    "awq-int4": "W4A16_AWQ",
}
WEIGHT_QUANTIZATIONS = ("none", *WEIGHT_QUANT_ALGOS)
# KV-cache storage besides the model dtype -> the QuantAlgo of the TensorRT-engine LLM.
KV_QUANT_ALGOS = {"int8": "INT8", "fp8": "FP8"}
KV_CACHE_DTYPES = tuple(KV_QUANT_ALGOS)
DTYPES = ("float16", "bfloat16", "float32")

PYTORCH_BACKEND = "pytorch"
TENSORRT_BACKEND = "tensorrt"
# Where each backend's LLM class lives.
LLM_MODULES = {PYTORCH_BACKEND: "tensorrt_llm", TENSORRT_BACKEND: "tensorrt_llm._tensorrt_engine"}
# The pydantic argument classes (in tensorrt_llm.llmapi) whose fields each backend accepts.
ARGS_CLASSES = {PYTORCH_BACKEND: ("TorchLlmArgs", "LlmArgs"), TENSORRT_BACKEND: ("TrtLlmArgs",)}


class CannotMap(ValueError):
    """An iserve configuration TensorRT-LLM cannot run as asked; the message names the
    option and what would run instead."""


@dataclass(frozen=True)
class TrtLlmConfig:
    """What a worker asks of the TensorRT-LLM engine.

    ``stage_layers`` is each pipeline stage's layer count (the deployer's layer map);
    empty means an even split. ``devices`` are the CUDA device indices of every rank of
    the tp·pp group, in rank order (rank = stage·tp + tensor rank).
    """

    checkpoint_dir: Path
    devices: tuple[int, ...] = (0,)
    dtype: str = "float16"
    max_seq_len: int = 2048
    max_batch: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    stage_layers: tuple[int, ...] = ()
    weight_quant: str = "none"
    kv_cache_dtype: str | None = None
    pruning: str = "none"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


@dataclass(frozen=True)
class LlmPlan:
    """Which LLM class to build (``backend``) and its keyword arguments."""

    backend: str
    kwargs: dict[str, Any]


def check_options(config: TrtLlmConfig) -> None:
    """CannotMap for an option TensorRT-LLM cannot run, whatever the checkpoint."""
    if config.pruning != "none":
        raise CannotMap(
            f"pruning {config.pruning!r} does not map to TensorRT-LLM (it loads no 2:4 or "
            "structured-pruned weights from iserve); use the PyTorch engine"
        )
    if config.weight_quant not in WEIGHT_QUANTIZATIONS:
        raise CannotMap(
            f"weight quantization {config.weight_quant!r} does not map to TensorRT-LLM; "
            f"it runs one of {WEIGHT_QUANTIZATIONS}"
        )
    if config.kv_cache_dtype is not None and config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise CannotMap(
            f"KV-cache dtype {config.kv_cache_dtype!r} does not map to TensorRT-LLM; "
            f"it stores the KV cache in the model dtype or one of {KV_CACHE_DTYPES}"
        )
    if config.dtype not in DTYPES:
        raise CannotMap(f"dtype {config.dtype!r} does not map to TensorRT-LLM; use one of {DTYPES}")
    if len(config.devices) != config.world_size:
        raise CannotMap(
            f"devices {list(config.devices)} must name one CUDA device per rank "
            f"(tp·pp = {config.world_size})"
        )


def check_layer_map(config: TrtLlmConfig, num_layers: int) -> None:
    """CannotMap unless ``stage_layers`` is empty or a layer count (>= 1) per stage that
    adds up to the model's ``num_layers``."""
    stages = config.stage_layers
    if not stages:
        return
    if len(stages) != config.pipeline_parallel or min(stages) < 1 or sum(stages) != num_layers:
        raise CannotMap(
            f"layer map {list(stages)} must give each of the {config.pipeline_parallel} "
            f"pipeline stages at least one layer and {num_layers} layers in all"
        )


def backend_for(config: TrtLlmConfig) -> str:
    """The LLM class a configuration needs (see the module docstring)."""
    if config.weight_quant != "none" or config.kv_cache_dtype == "int8":
        return TENSORRT_BACKEND
    return PYTORCH_BACKEND


def accepts_argument(api: ModuleType, backend: str, name: str) -> bool:
    """Whether ``backend``'s LLM arguments have a field ``name``, read from the pydantic
    argument class's fields (or its signature); False when no class says so."""
    llmapi = getattr(api, "llmapi", None)
    for class_name in ARGS_CLASSES[backend]:
        args_class = getattr(llmapi, class_name, None)
        if args_class is None:
            continue
        fields = getattr(args_class, "model_fields", None)
        if isinstance(fields, dict):
            return name in fields
        try:
            return name in inspect.signature(args_class).parameters
        except (TypeError, ValueError):
            continue
    return False


def plan_llm(config: TrtLlmConfig, num_layers: int, api: ModuleType) -> LlmPlan:
    """The LLM class and arguments that run ``config`` on a model of ``num_layers``
    layers; CannotMap for a configuration that does not map.

    ========================  ================================================  ========
    iserve                    LLM argument                                      backend
    ========================  ================================================  ========
    (always)                  skip_tokenizer_init=True (token ids in and out)   both
    tp, pp                    tensor_parallel_size, pipeline_parallel_size      both
    uneven layer map          pp_partition=[layers of each stage] (prototype;   both
                              when absent: even split and a warning)
    dtype                     dtype                                             both
    max_batch, max_seq_len    max_batch_size, max_seq_len; KvCacheConfig(       both
                              max_tokens=max_batch·max_seq_len)
    weight int8 / int4        QuantConfig(quant_algo=W8A16 / W4A16)             TensorRT
    GPTQ / AWQ int4           QuantConfig(quant_algo=W4A16_GPTQ / W4A16_AWQ)    TensorRT
    KV int8                   QuantConfig(kv_cache_quant_algo=INT8)             TensorRT
    KV fp8                    KvCacheConfig(dtype="fp8") on PyTorch; with a     both
                              weight quantization QuantConfig(
                              kv_cache_quant_algo=FP8)
    ========================  ================================================  ========
    """
    check_options(config)
    check_layer_map(config, num_layers)
    backend = backend_for(config)
    llmapi = api.llmapi
    # iserve reserved KV memory for max_batch sequences of max_seq_len tokens; without a
    # bound TensorRT-LLM would take most of the free device memory for its KV cache.
    kv_cache = {"max_tokens": config.max_batch * config.max_seq_len}
    kwargs: dict[str, Any] = {
        "model": str(config.checkpoint_dir),
        # iserve tokenizes prompts and detokenizes outputs itself, as for the PyTorch engine.
        "skip_tokenizer_init": True,
        "tensor_parallel_size": config.tensor_parallel,
        "pipeline_parallel_size": config.pipeline_parallel,
        "dtype": config.dtype,
        "max_batch_size": config.max_batch,
        "max_seq_len": config.max_seq_len,
    }
    partition = _pp_partition(config, num_layers, api, backend)
    if partition is not None:
        kwargs["pp_partition"] = partition
    quant: dict[str, Any] = {}
    if config.weight_quant != "none":
        quant["quant_algo"] = getattr(llmapi.QuantAlgo, WEIGHT_QUANT_ALGOS[config.weight_quant])
    if config.kv_cache_dtype is not None:
        if backend == TENSORRT_BACKEND:
            algo = KV_QUANT_ALGOS[config.kv_cache_dtype]
            quant["kv_cache_quant_algo"] = getattr(llmapi.QuantAlgo, algo)
        else:
            kv_cache["dtype"] = config.kv_cache_dtype
    if quant:
        kwargs["quant_config"] = llmapi.QuantConfig(**quant)
    kwargs["kv_cache_config"] = llmapi.KvCacheConfig(**kv_cache)
    return LlmPlan(backend, kwargs)


def _pp_partition(
    config: TrtLlmConfig, num_layers: int, api: ModuleType, backend: str
) -> list[int] | None:
    """The pp_partition argument for ``config``'s layer map; None for an even split or
    when this TensorRT-LLM lacks the field (then a warning if the map was uneven)."""
    stages = list(config.stage_layers)
    if config.pipeline_parallel == 1 or not stages:
        return None
    if accepts_argument(api, backend, "pp_partition"):
        return stages
    even = list(even_stage_layers(num_layers, config.pipeline_parallel))
    if stages != even:
        log.warning(
            "this tensorrt_llm has no pp_partition argument: layer map %s falls back to "
            "TensorRT-LLM's even split of %d layers over %d stages, so a stage may not fit "
            "the memory the deployer placed it on",
            stages,
            num_layers,
            config.pipeline_parallel,
        )
    return None


def llm_class(api: ModuleType, backend: str) -> type:
    """The LLM class of ``backend``; CannotMap when this tensorrt_llm lacks it."""
    module_name = LLM_MODULES[backend]
    try:
        module = api if module_name == api.__name__ else importlib.import_module(module_name)
    except ImportError as exc:
        raise CannotMap(
            f"this configuration needs TensorRT-LLM's {backend} backend ({module_name}.LLM), "
            f"which the installed tensorrt_llm lacks: {exc}"
        ) from exc
    return module.LLM


def sampling_params(
    api: ModuleType,
    request: GenerationRequest,
    eos_token_ids: frozenset[int],
    config_eos_ids: tuple[int, ...] = (),
) -> Any:
    """``tensorrt_llm.SamplingParams`` for one request.

    TensorRT-LLM runs without its tokenizer (``skip_tokenizer_init``), so ``end_id`` is
    the checkpoint's first EOS id among those that stop it (``config_eos_ids`` that are
    in ``eos_token_ids``, the stop set of ``services.models.special_tokens``, else the
    smallest of that set; unset when it is empty, as when ``generation_config.json``
    names no EOS) and no text is asked for. Greedy requests
    (temperature below the engine's greedy threshold) get ``top_k=1``, which TensorRT-LLM
    decodes greedily; others their temperature, top_k (0: unset, all tokens) and top_p.
    Unless ``ignore_eos``, every EOS id of the checkpoint stops the request as it stops
    the PyTorch engine's, besides the request's own stop tokens.
    """
    sampling = request.sampling
    stop_ids = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        stop_ids |= eos_token_ids
    # config.json's first EOS where it stops generation (generation_config.json may name
    # others, or none: then nothing is an end).
    end_id = next(
        (i for i in config_eos_ids if i in eos_token_ids), min(eos_token_ids, default=None)
    )
    kwargs: dict[str, Any] = {
        "end_id": end_id,
        "detokenize": False,
        "max_tokens": request.max_tokens,
        "ignore_eos": sampling.ignore_eos,
        "stop_token_ids": sorted(stop_ids) or None,
        "seed": sampling.seed,
    }
    if sampling.greedy:
        kwargs["top_k"] = 1
    else:
        kwargs["temperature"] = sampling.temperature
        kwargs["top_k"] = sampling.top_k or None
        kwargs["top_p"] = sampling.top_p
    return api.SamplingParams(**kwargs)
