"""Stand-in ``tensorrt_llm`` for worker processes started by the tests (no GPU here).

``LLM(**kwargs)`` appends its backend and arguments as one JSON line to the file named by
``TRTLLM_STAND_IN_RECORD`` (when set) and takes 1 GiB of each rank's stand-in device;
``generate_async`` streams ``REPLY`` (as many tokens as ``max_tokens`` asks), one token
per snapshot. ``torch.cuda.mem_get_info`` is replaced by the stand-in devices' table,
which the TensorRT-LLM engine reads before and after the build.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from . import llmapi

GIB = 1 << 30
REPLY = (21, 22, 23, 24, 25, 26, 27, 28)
RECORD_ENV = "TRTLLM_STAND_IN_RECORD"
_FREE = dict.fromkeys(range(8), 80 * GIB)


def _mem_get_info(device: int = 0) -> tuple[int, int]:
    return _FREE[int(device)], 80 * GIB


torch.cuda.mem_get_info = _mem_get_info


class SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: Any = None


class RequestOutput:
    def __init__(self, count: int) -> None:
        self.count = count
        self.outputs = [Completion([])]
        self.finished = False

    def abort(self) -> None:
        self.count = 0

    async def _snapshots(self):
        for n in range(1, self.count + 1):
            await asyncio.sleep(0.001)
            done = n == self.count
            self.outputs[0] = Completion(list(REPLY[:n]), "length" if done else None)
            self.finished = done
            yield self

    def __aiter__(self):
        return self._snapshots()


def _llm_class(backend: str) -> type:
    class LLM:
        def __init__(self, **kwargs: Any) -> None:
            world = kwargs["tensor_parallel_size"] * kwargs["pipeline_parallel_size"]
            for rank in range(world):
                _FREE[rank] -= GIB
            record = os.environ.get(RECORD_ENV)
            if record:
                with open(record, "a") as fh:
                    fh.write(json.dumps({"backend": backend, "kwargs": kwargs}, default=repr))
                    fh.write("\n")

        def generate_async(
            self, prompt: list[int], sampling_params: SamplingParams, streaming: bool = False
        ) -> RequestOutput:
            return RequestOutput(min(len(REPLY), sampling_params.kwargs["max_tokens"]))

        def shutdown(self) -> None:
            pass

    return LLM


LLM = _llm_class("pytorch")
__all__ = ["LLM", "SamplingParams", "llmapi"]
