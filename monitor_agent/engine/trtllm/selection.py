"""Which engine a worker runs: ``ISERVE_ENGINE`` (or ``--engine``) read against the node.

* ``pytorch``: the PyTorch engine.
* ``tensorrt_llm``: TensorRT-LLM, or an error saying why not: ``tensorrt_llm`` is not
  installed, the device is not a CUDA GPU, or the configuration does not map (CannotMap).
* ``auto``: TensorRT-LLM when all of that holds and the worker is a whole group by itself
  (one rank); the PyTorch engine otherwise, logging why. One rank only because the agent
  starts one worker process per rank, a group only the PyTorch engine forms; TensorRT-LLM
  runs every rank of a group from one process (``tensorrt_llm`` starts them itself).

Nothing here imports ``tensorrt_llm``; ``find_spec`` only looks for it.
"""

from __future__ import annotations

import importlib.util
import logging

from monitor_agent.engine.trtllm.mapping import CannotMap, TrtLlmConfig, check_options
from services.settings import ENGINE_CHOICES, ENGINE_ENV

log = logging.getLogger("iserve.engine.trtllm")

PYTORCH = "pytorch"
TENSORRT_LLM = "tensorrt_llm"


class EngineUnavailable(ValueError):
    """The engine asked for cannot run on this node; the message says why."""


def tensorrt_llm_installed() -> bool:
    """Whether ``import tensorrt_llm`` would find the package (without importing it)."""
    return importlib.util.find_spec("tensorrt_llm") is not None


def choose_engine(
    choice: str,
    config: TrtLlmConfig,
    *,
    device: str,
    worker_ranks: int = 1,
    installed: bool | None = None,
) -> str:
    """ "pytorch" or "tensorrt_llm" for ``choice`` (one of ENGINE_CHOICES) on ``device``
    ("cpu", "cuda:N"), for a worker whose process is ``worker_ranks`` ranks of its group
    and the configuration ``config``; EngineUnavailable or CannotMap when ``choice`` is
    "tensorrt_llm" and it cannot run. ``installed`` defaults to looking for the package."""
    if choice not in ENGINE_CHOICES:
        raise ValueError(f"{ENGINE_ENV} must be one of {ENGINE_CHOICES}, not {choice!r}")
    if choice == PYTORCH:
        return PYTORCH
    installed = tensorrt_llm_installed() if installed is None else installed
    why_not = _why_not_tensorrt_llm(config, device, installed)
    if choice == TENSORRT_LLM:
        if isinstance(why_not, CannotMap):
            raise why_not
        if why_not is not None:
            raise EngineUnavailable(f"{ENGINE_ENV}={TENSORRT_LLM}: {why_not}")
        return TENSORRT_LLM
    if why_not is None and worker_ranks != 1:
        why_not = EngineUnavailable(
            f"this worker is one of {worker_ranks} rank processes, which only the PyTorch "
            "engine joins into a group"
        )
    if why_not is not None:
        log.info("%s=auto: the PyTorch engine, not TensorRT-LLM: %s", ENGINE_ENV, why_not)
        return PYTORCH
    return TENSORRT_LLM


def _why_not_tensorrt_llm(
    config: TrtLlmConfig, device: str, installed: bool
) -> EngineUnavailable | CannotMap | None:
    if not installed:
        return EngineUnavailable(
            "tensorrt_llm is not installed on this node (pip install 'iserve[tensorrt]' on "
            "a machine with NVIDIA GPUs)"
        )
    if not device.startswith("cuda"):
        return EngineUnavailable(f"TensorRT-LLM runs on NVIDIA GPUs only, not on {device!r}")
    try:
        check_options(config)
    except CannotMap as exc:
        return exc
    return None
