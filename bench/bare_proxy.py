"""A do-nothing InferenceService that forwards each Generate to one worker as a new
Generate call: what a plain Python gRPC hop costs (the scheduler instead sends each
request as one message on an open session). ``bench/serving_overhead.py`` measures it
beside the scheduler.

Usage: python bench/bare_proxy.py WORKER_ADDRESS  (prints its port, then serves)
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services import transport  # noqa: E402
from services.api import inference_service_pb2 as infer_pb  # noqa: E402
from services.api import (
    inference_service_pb2_grpc,  # noqa: E402
    worker_service_pb2_grpc,  # noqa: E402
)
from services.api import worker_service_pb2 as worker_pb  # noqa: E402


class BareProxy(inference_service_pb2_grpc.InferenceServiceServicer):
    def __init__(self, worker_address: str):
        # With authentication on, ISERVE_TOKEN holds the service token (workers accept no other).
        self.worker = worker_service_pb2_grpc.WorkerServiceStub(
            transport.current().aio_channel(worker_address)
        )

    async def Generate(self, request, context):
        call = self.worker.Generate(
            worker_pb.WorkerServiceGenerateRequest(
                request_id=request.request_id,
                prompt=request.prompt,
                prompt_token_ids=request.prompt_token_ids,
                max_tokens=request.max_tokens,
                sampling=request.sampling,
            )
        )
        async for message in call:
            yield infer_pb.GenerateResponse(
                request_id=request.request_id,
                delta=infer_pb.TokenDelta(token_ids=message.token_ids, text=message.text),
            )


async def main(worker_address: str) -> None:
    server = grpc.aio.server()
    inference_service_pb2_grpc.add_InferenceServiceServicer_to_server(
        BareProxy(worker_address), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
