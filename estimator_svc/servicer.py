"""EstimatorService: protobuf in, estimator work (``service``), protobuf out."""

from __future__ import annotations

from estimator_svc.messages import estimate_messages, ranked_messages, workload_from_proto
from estimator_svc.ranking import rank_for_intent
from estimator_svc.service import Estimator
from services.api import estimator_service_pb2 as estimator_pb
from services.api import estimator_service_pb2_grpc
from services.estimation.memory import GIB
from services.ids import check_hardware_type
from services.intents import check_intent


class EstimatorServicer(estimator_service_pb2_grpc.EstimatorServiceServicer):
    def __init__(self, estimator: Estimator):
        self.estimator = estimator

    async def EstimateConfigs(self, request, context):
        workload = workload_from_proto(request.workload)
        result = await self.estimator.estimate(
            request.model_id,
            request.hardware_type,
            workload,
            request.device_count,
            request.device_memory_bytes,
        )
        return estimator_pb.EstimateConfigsResponse(
            request_id=request.request_id,
            estimates=estimate_messages(
                result.estimates,
                result.workload,
                result.usable,
                result.communication_unprofiled,
            ),
            notes=[*result.notes, *filter(None, [result.unfit_note])],
            device_memory_bytes=round((result.device_memory_gib or 0) * GIB),
        )

    async def RankConfigs(self, request, context):
        workload = workload_from_proto(request.workload)
        check_intent(request.intent)
        result = await self.estimator.estimate(
            request.model_id,
            request.hardware_type,
            workload,
            request.device_count,
            request.device_memory_bytes,
        )
        ranked = rank_for_intent(result.estimates, request.intent)
        return estimator_pb.RankConfigsResponse(
            request_id=request.request_id,
            ranked=ranked_messages(
                result.estimates, result.workload, ranked, result.communication_unprofiled
            ),
            # The ranking's fallbacks, then what the estimates stand on (a prompt length
            # or batch beyond those profiled, a layout never profiled), as
            # EstimateConfigs gives them: a plan or deploy shows them too.
            note="; ".join(n for n in (ranked.note, *result.notes) if n),
        )

    async def GetCalibration(self, request, context):
        calibration = await self.estimator.get_calibration(request.hardware_type)
        return estimator_pb.GetCalibrationResponse(
            request_id=request.request_id, calibration=calibration
        )

    async def Calibrate(self, request, context):
        check_hardware_type(request.hardware_type)
        calibration = await self.estimator.calibrate(request.hardware_type, request.model_ids)
        return estimator_pb.CalibrateResponse(
            request_id=request.request_id, calibration=calibration
        )
