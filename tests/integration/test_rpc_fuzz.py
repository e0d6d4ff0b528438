"""Every public RPC of every service, sent messages drawn from its own descriptor (each
field left out or set to an ordinary, extreme or hostile value: NaN and infinities,
2^32-1 and 2^64-1, unknown enum numbers, long and path-like strings, the ids of a real
model and deployment): each call ends with a status a client can act on, never INTERNAL,
UNKNOWN or a hang, and every service still answers afterwards.

The field-specific hostile inputs have their own tests (tests/unit/test_hostile_*.py,
test_hostile_inputs.py); this one sweeps what nobody listed. The agent's worker and
profiling RPCs are left out (they start processes; their checks are tested directly).
"""

from __future__ import annotations

import math
import random
import zlib

import grpc
import pytest
from google.protobuf import symbol_database
from google.protobuf.descriptor import FieldDescriptor

from services.api import (
    deployment_service_pb2,
    deployment_service_pb2_grpc,
    estimator_service_pb2,
    estimator_service_pb2_grpc,
    inference_service_pb2,
    inference_service_pb2_grpc,
    model_service_pb2,
    model_service_pb2_grpc,
)
from services.health import check
from tests.conftest import running_stack
from tests.integration.helpers import deploy, make_checkpoint, register

pytestmark = pytest.mark.integration

MODEL = "fz-llama"
CASES_PER_RPC = 30
CALL_TIMEOUT_S = 30
SERVICES = {
    "model": (model_service_pb2_grpc.ModelServiceStub, model_service_pb2, "ModelService"),
    "deploy": (
        deployment_service_pb2_grpc.DeploymentServiceStub,
        deployment_service_pb2,
        "DeploymentService",
    ),
    "estimator": (
        estimator_service_pb2_grpc.EstimatorServiceStub,
        estimator_service_pb2,
        "EstimatorService",
    ),
    "scheduler": (
        inference_service_pb2_grpc.InferenceServiceStub,
        inference_service_pb2,
        "InferenceService",
    ),
}
# Statuses that say the server, not the request, went wrong (or never answered).
SERVER_FAULTS = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.DATA_LOSS,
}
STRINGS = ["", "x", "../../etc/passwd", "a" * 300, "ü\u202e", "nan", "-1", "0", "cpu", "node0"]
FLOATS = [0.0, 1.0, 0.5, -1.0, 1e9, 1e-40, math.nan, math.inf, -math.inf]
UNSIGNED = [0, 1, 2, 7, 8, 256, 1024, 2**31 - 1, 2**32 - 1]
SIGNED = [0, 1, -1, 5, 2**31 - 1, -(2**31)]


class Drawer:
    """Random messages from descriptors; ``ids`` are real ids the strings favour."""

    def __init__(self, seed: int, ids: list[str]):
        self.rng = random.Random(seed)
        self.ids = ids

    def message(self, cls, depth: int = 0):
        message = cls()
        for field in cls.DESCRIPTOR.fields:
            if self.rng.random() < 0.25 or (
                field.message_type is not None and field.message_type.GetOptions().map_entry
            ):
                continue
            count = self.rng.choice([0, 1, 1, 2, 3]) if field.is_repeated else 1
            for _ in range(count):
                value = self.value(field, depth)
                if value is None:
                    continue
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    target = getattr(message, field.name)
                    (target.add() if field.is_repeated else target).CopyFrom(value)
                elif field.is_repeated:
                    getattr(message, field.name).append(value)
                else:
                    setattr(message, field.name, value)
        if hasattr(message, "skip_profiling"):
            message.skip_profiling = True  # a profiling job is minutes of work, not a check
        return message

    def value(self, field, depth: int):
        rng, kind = self.rng, field.type
        if kind == FieldDescriptor.TYPE_MESSAGE:
            return (
                self.message(field.message_type._concrete_class, depth + 1) if depth < 4 else None
            )
        if kind == FieldDescriptor.TYPE_ENUM:
            numbers = [v.number for v in field.enum_type.values]
            return rng.choice([*numbers, max(numbers) + 1])
        if kind == FieldDescriptor.TYPE_STRING:
            if field.name == "request_id" and rng.random() < 0.85:
                return f"{rng.getrandbits(48):012x}"
            return rng.choice(STRINGS + self.ids * (6 if field.name.endswith("_id") else 1))
        if kind == FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return rng.choice(FLOATS)
        if kind in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
            return rng.choice(UNSIGNED)
        if kind in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
            return rng.choice([*UNSIGNED, 2**64 - 1])
        if kind in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64):
            return rng.choice([*SIGNED, 2**63 - 1, -(2**63)])
        if kind == FieldDescriptor.TYPE_BYTES:
            return rng.choice([b"", b"\x00\xff", b"x" * 100])
        return rng.choice(SIGNED)


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("iserve-fuzz")) as stack:
        register(stack, MODEL, make_checkpoint(stack, MODEL))
        deployment_id = deploy(stack, MODEL).deployment.deployment_id
        yield stack, [MODEL, deployment_id]


def _rpcs():
    for service, (_stub, module, name) in SERVICES.items():
        for method in module.DESCRIPTOR.services_by_name[name].methods:
            yield pytest.param(service, method.name, id=f"{name}.{method.name}")


@pytest.mark.parametrize(("service", "method"), list(_rpcs()))
def test_any_message_gets_a_status_the_client_can_act_on(fuzz_stack, service, method):
    stack, ids = fuzz_stack
    stub_cls, module, name = SERVICES[service]
    descriptor = module.DESCRIPTOR.services_by_name[name].methods_by_name[method]
    request_cls = symbol_database.Default().GetSymbol(descriptor.input_type.full_name)
    channel = grpc.insecure_channel(stack.settings.address(service))
    call = getattr(stub_cls(channel), method)
    drawer = Drawer(seed=zlib.crc32(f"{service}.{method}".encode()), ids=ids)
    faults = []
    for _ in range(CASES_PER_RPC):
        request = drawer.message(request_cls)
        try:
            reply = call(request, timeout=CALL_TIMEOUT_S)
            if descriptor.server_streaming:
                for _message in reply:
                    pass
        except grpc.RpcError as exc:
            if exc.code() in SERVER_FAULTS:
                faults.append(f"{exc.code().name}: {exc.details()}\n  for {request}")
    channel.close()
    assert not faults, "\n".join(faults)
    assert all(check(stack.settings.address(s)) for s in SERVICES)
