"""Which engine a StartWorkersRequest's group runs on this node (for
:func:`monitor_agent.launch.build_plan`): the request's engine, or this node's
``ISERVE_ENGINE`` for ENGINE_KIND_UNSPECIFIED, read against the node through
:func:`monitor_agent.engine.trtllm.selection.choose_group_engine`, its refusals as gRPC
errors."""

from __future__ import annotations

from monitor_agent.devices import DeviceSpec
from monitor_agent.engine.trtllm.mapping import CannotMap, TrtLlmConfig
from monitor_agent.engine.trtllm.selection import (
    PYTORCH,
    TENSORRT_LLM,
    EngineUnavailable,
    choose_group_engine,
)
from services.api import agent_service_pb2 as agent_pb
from services.errors import FailedPrecondition, InvalidArgument, require
from services.settings import ENGINE_ENV, engine_choice

# StartWorkersRequest.engine -> the engine choice it asks for (UNSPECIFIED: ISERVE_ENGINE).
_ENGINE_CHOICES = {
    agent_pb.ENGINE_KIND_PYTORCH: PYTORCH,
    agent_pb.ENGINE_KIND_TENSORRT_LLM: TENSORRT_LLM,
}


def resolve_engine(
    engine: int,
    config: TrtLlmConfig,
    *,
    devices: list[DeviceSpec],
    node_ranks: int,
    num_layers: int | None,
    node_choice: str | None = None,
    installed: bool | None = None,
) -> str:
    """The engine ("pytorch" or "tensorrt_llm") a StartWorkersRequest's ``engine`` gets
    for the group ``config`` describes, of which this node runs ``node_ranks`` ranks on
    ``devices``.

    ENGINE_KIND_PYTORCH is the PyTorch engine. ENGINE_KIND_TENSORRT_LLM is TensorRT-LLM
    or FailedPrecondition (not installed, a device that is not a CUDA GPU, ranks on
    several nodes) or InvalidArgument (a configuration that does not map, the mapping's
    message). ENGINE_KIND_UNSPECIFIED is this node's choice, ``node_choice`` (default
    ``ISERVE_ENGINE``): with ``auto`` TensorRT-LLM where all of that holds, else the
    PyTorch engine (logged); ``tensorrt_llm`` and ``pytorch`` as the kinds above.
    ``installed`` defaults to looking for the package.
    """
    if engine == agent_pb.ENGINE_KIND_UNSPECIFIED:
        try:
            choice = engine_choice() if node_choice is None else node_choice
        except ValueError as exc:
            raise FailedPrecondition(f"this node's {exc}") from exc
        asked_by = f"{ENGINE_ENV}={choice} on this node"
    else:
        require(
            engine in _ENGINE_CHOICES,
            f"engine {engine} is not an EngineKind: give ENGINE_KIND_UNSPECIFIED (the "
            "node's choice), ENGINE_KIND_PYTORCH or ENGINE_KIND_TENSORRT_LLM",
        )
        choice = _ENGINE_CHOICES[engine]
        asked_by = f"engine {agent_pb.EngineKind.Name(engine)}"
    try:
        return choose_group_engine(
            choice,
            config,
            devices=[d.torch_device for d in devices],
            node_ranks=node_ranks,
            num_layers=num_layers,
            asked_by=asked_by,
            installed=installed,
        )
    except CannotMap as exc:
        raise InvalidArgument(f"{asked_by}: {exc}") from exc
    except EngineUnavailable as exc:
        raise FailedPrecondition(str(exc)) from exc
