"""Which engine runs a group: ``ISERVE_ENGINE`` (or a request's engine, or ``--engine``)
read against the node.

* ``pytorch``: the PyTorch engine.
* ``tensorrt_llm``: TensorRT-LLM, or an error saying why not: ``tensorrt_llm`` is not
  installed, a device is not a CUDA GPU, the group's ranks are not all on this node, or
  the configuration does not map (CannotMap).
* ``auto``: TensorRT-LLM when all of that holds; the PyTorch engine otherwise, logging why.

TensorRT-LLM runs every rank of a tp·pp group from one process (``tensorrt_llm`` starts
the ranks itself), so it needs the whole group on one node. The agent decides for a group
(:func:`choose_group_engine`, from :func:`monitor_agent.launch.build_plan`) and tells each
worker its engine; :func:`choose_engine` is the worker's own decision when it is started
without ``--engine``, where ``auto`` takes TensorRT-LLM only for a one-rank worker.

Nothing here imports ``tensorrt_llm``; ``find_spec`` only looks for it.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence

from monitor_agent.engine.trtllm.mapping import (
    CannotMap,
    TrtLlmConfig,
    check_layer_map,
    check_options,
)
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
    why_not = _why_not_tensorrt_llm(config, [device], installed)
    if why_not is None and choice != TENSORRT_LLM and worker_ranks != 1:
        why_not = EngineUnavailable(
            f"this worker is one of {worker_ranks} rank processes, which only the PyTorch "
            "engine joins into a group"
        )
    return _decide(choice, why_not, f"{ENGINE_ENV}={choice}")


def choose_group_engine(
    choice: str,
    config: TrtLlmConfig,
    *,
    devices: Sequence[str],
    node_ranks: int,
    num_layers: int | None = None,
    asked_by: str = "",
    installed: bool | None = None,
) -> str:
    """ "pytorch" or "tensorrt_llm" for ``choice`` (one of ENGINE_CHOICES) for the tp·pp
    group of ``config``, of which this node runs ``node_ranks`` ranks on ``devices``
    ("cpu", "cuda:N"). With ``num_layers`` (the model's), ``config.stage_layers`` must
    add up to it. EngineUnavailable (prefixed ``asked_by``, default ``ISERVE_ENGINE=…``)
    or the mapping's CannotMap when ``choice`` is "tensorrt_llm" and it cannot run; auto
    logs why it takes the PyTorch engine. ``installed`` defaults to looking for the
    package."""
    if choice not in ENGINE_CHOICES:
        raise ValueError(f"{ENGINE_ENV} must be one of {ENGINE_CHOICES}, not {choice!r}")
    if choice == PYTORCH:
        return PYTORCH
    installed = tensorrt_llm_installed() if installed is None else installed
    why_not = _why_not_tensorrt_llm(config, devices, installed, node_ranks)
    if why_not is None and num_layers is not None:
        try:
            check_layer_map(config, num_layers)
        except CannotMap as exc:
            why_not = exc
    return _decide(choice, why_not, asked_by or f"{ENGINE_ENV}={choice}")


def _decide(choice: str, why_not: EngineUnavailable | CannotMap | None, asked_by: str) -> str:
    """TensorRT-LLM unless ``why_not``: then the error for "tensorrt_llm" (CannotMap as
    the mapping raised it) or the PyTorch engine, logged, for "auto"."""
    if choice == TENSORRT_LLM:
        if isinstance(why_not, CannotMap):
            raise why_not
        if why_not is not None:
            raise EngineUnavailable(f"{asked_by}: {why_not}")
        return TENSORRT_LLM
    if why_not is not None:
        log.info("%s: the PyTorch engine, not TensorRT-LLM: %s", asked_by, why_not)
        return PYTORCH
    return TENSORRT_LLM


def _why_not_tensorrt_llm(
    config: TrtLlmConfig, devices: Sequence[str], installed: bool, node_ranks: int | None = None
) -> EngineUnavailable | CannotMap | None:
    """Why TensorRT-LLM cannot run ``config`` on ``devices``, this node running
    ``node_ranks`` of its ranks (None: not asked); None when it can."""
    if not installed:
        return EngineUnavailable(
            "tensorrt_llm is not installed on this node (pip install 'iserve[tensorrt]' on "
            "a machine with NVIDIA GPUs)"
        )
    not_cuda = sorted({d for d in devices if not d.startswith("cuda")})
    if not_cuda:
        shown = ", ".join(repr(d) for d in not_cuda)
        return EngineUnavailable(f"TensorRT-LLM runs on NVIDIA GPUs only, not on {shown}")
    if node_ranks is not None and node_ranks != config.world_size:
        return EngineUnavailable(
            f"this node runs {node_ranks} of the group's {config.world_size} ranks; "
            "TensorRT-LLM runs a group from one process, so every rank on one node"
        )
    try:
        check_options(config)
    except CannotMap as exc:
        return exc
    return None
