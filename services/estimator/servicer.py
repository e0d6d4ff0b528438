"""EstimatorService. Estimation needs fingerprint profiles, which arrive with issue 4;
until then every RPC answers UNIMPLEMENTED and says so."""

from __future__ import annotations

from services.api import estimator_service_pb2_grpc
from services.errors import Unimplemented

_LATER = "{} arrives with fingerprint profiling and estimation (issue 4)"


class EstimatorServicer(estimator_service_pb2_grpc.EstimatorServiceServicer):
    async def EstimateConfigs(self, request, context):
        raise Unimplemented(_LATER.format("EstimateConfigs"))

    async def RankConfigs(self, request, context):
        raise Unimplemented(_LATER.format("RankConfigs"))

    async def GetCalibration(self, request, context):
        raise Unimplemented(_LATER.format("GetCalibration"))

    async def Calibrate(self, request, context):
        raise Unimplemented(_LATER.format("Calibrate"))
