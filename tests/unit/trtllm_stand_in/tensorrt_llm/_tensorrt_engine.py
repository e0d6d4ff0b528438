"""Stand-in ``tensorrt_llm._tensorrt_engine``: the TensorRT-engine LLM."""

from __future__ import annotations

from . import _llm_class

LLM = _llm_class("tensorrt")
