"""AgentService: protobuf in, supervisor call, protobuf out."""

from __future__ import annotations

import asyncio

import grpc

from monitor_agent.devices import DeviceSpec
from monitor_agent.launch import build_plan
from monitor_agent.profiling import ProfilingJobs
from monitor_agent.supervisor import WorkerSupervisor
from services.api import agent_service_pb2 as agent_pb
from services.api import agent_service_pb2_grpc
from services.ids import check_deployment_id
from services.settings import Settings


class AgentServicer(agent_service_pb2_grpc.AgentServiceServicer):
    def __init__(self, settings: Settings, devices: list[DeviceSpec], supervisor: WorkerSupervisor):
        self.settings = settings
        self.devices = {d.device_id: d for d in devices}
        self.supervisor = supervisor

    async def StartWorkers(
        self, request: agent_pb.StartWorkersRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb.StartWorkersResponse:
        # Beside the event loop: it reads the checkpoint's config and its weights' headers
        # (a slow or network disk held the agent's heartbeat and every other call).
        plan = await asyncio.to_thread(
            build_plan,
            request,
            devices=self.devices,
            models_root=self.settings.models_root,
            default_ready_timeout_s=self.settings.ready_timeout_s,
            node_id=self.settings.node_id,
        )
        workers = await self.supervisor.start_workers(plan)
        return agent_pb.StartWorkersResponse(request_id=request.request_id, workers=workers)

    async def StopWorkers(
        self, request: agent_pb.StopWorkersRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb.StopWorkersResponse:
        check_deployment_id(request.deployment_id)  # a malformed id names no workers
        # Shielded: a caller whose deadline passes while the workers drain must not leave
        # them half stopped (signalled, but never waited for or recorded STOPPED).
        workers = await asyncio.shield(
            self.supervisor.stop_workers(request.deployment_id, lost_rank=request.lost_rank)
        )
        return agent_pb.StopWorkersResponse(request_id=request.request_id, workers=workers)

    async def ListWorkers(
        self, request: agent_pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb.ListWorkersResponse:
        if request.deployment_id:  # empty: every deployment's
            check_deployment_id(request.deployment_id)
        workers = self.supervisor.list_workers(request.deployment_id)
        return agent_pb.ListWorkersResponse(request_id=request.request_id, workers=workers)

    async def RunProfilingJob(
        self, request: agent_pb.RunProfilingJobRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb.RunProfilingJobResponse:
        jobs = ProfilingJobs(
            self.supervisor,
            self.devices,
            models_root=self.settings.models_root,
            ready_timeout_s=self.settings.ready_timeout_s,
        )
        runs = await jobs.run(request)
        return agent_pb.RunProfilingJobResponse(request_id=request.request_id, runs=runs)
