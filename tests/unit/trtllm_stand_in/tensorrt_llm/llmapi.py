"""Stand-in ``tensorrt_llm.llmapi``: the classes the TensorRT-LLM engine's mapping uses."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class QuantAlgo(enum.Enum):
    W8A16 = "W8A16"
    W4A16 = "W4A16"
    W4A16_AWQ = "W4A16_AWQ"
    W4A16_GPTQ = "W4A16_GPTQ"
    INT8 = "INT8"
    FP8 = "FP8"


@dataclass
class QuantConfig:
    quant_algo: QuantAlgo | None = None
    kv_cache_quant_algo: QuantAlgo | None = None


@dataclass
class KvCacheConfig:
    max_tokens: int | None = None
    dtype: str = "auto"


_FIELDS = {
    "model": None,
    "tensor_parallel_size": None,
    "pipeline_parallel_size": None,
    "pp_partition": None,
}
TorchLlmArgs = type("TorchLlmArgs", (), {"model_fields": _FIELDS})
TrtLlmArgs = type("TrtLlmArgs", (), {"model_fields": _FIELDS})
