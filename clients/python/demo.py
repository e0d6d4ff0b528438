"""Register a checkpoint, deploy it, stream one generation and print its timings, then
remove the deployment: iserve from Python, on grpcio and the committed stubs alone.

    python clients/python/demo.py MODEL_ID CHECKPOINT_PATH [PROMPT] [--max-tokens N] [--keep]

(the options before or after the prompt).
It needs grpcio and protobuf, and the stubs in this repository's ``services/api`` (found
beside this file: any Python with those two runs it from a checkout). Ctrl-C or SIGTERM
still removes the deployment (exit 130).
CHECKPOINT_PATH is relative to the stack's models root. Addresses come from the
``ISERVE_*_ADDR`` variables, else the ones ``iserve up`` recorded in
``$ISERVE_STATE_DIR/stack.json`` (``~/.iserve`` by default), else ``127.0.0.1:50061``
(models), ``50063`` (deployments) and ``50064`` (inference), as the CLI finds them;
``ISERVE_TOKEN`` is sent as a bearer token, else the administrator token ``iserve up``
wrote with authentication on (``$ISERVE_STATE_DIR/tokens/admin``), as the CLI and the
Node client take it. Plaintext only: with TLS on, use the CLI (``iserve``), which reads the stack's
certificates.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
from pathlib import Path

import grpc

# The stubs are the checkout's (services/api), whatever the directory it is run from.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import deployment_service_pb2_grpc as deploy_grpc
from services.api import inference_service_pb2 as infer_pb
from services.api import inference_service_pb2_grpc as infer_grpc
from services.api import model_service_pb2 as model_pb
from services.api import model_service_pb2_grpc as model_grpc

ADDRESSES = {
    "model": ("ISERVE_MODEL_ADDR", "127.0.0.1:50061"),
    "deploy": ("ISERVE_DEPLOY_ADDR", "127.0.0.1:50063"),
    "scheduler": ("ISERVE_SCHEDULER_ADDR", "127.0.0.1:50064"),
}
UINT32_MAX = 2**32 - 1


def state_dir() -> Path:
    return Path(os.environ.get("ISERVE_STATE_DIR") or Path.home() / ".iserve").expanduser()


def recorded_addresses() -> dict[str, str]:
    """The addresses `iserve up` wrote to its stack.json, by service; none without one."""
    try:
        return json.loads((state_dir() / "stack.json").read_text()).get("addresses", {})
    except (OSError, ValueError):
        return {}


def channel(service: str) -> grpc.Channel:
    variable, default = ADDRESSES[service]
    address = os.environ.get(variable) or recorded_addresses().get(service) or default
    return grpc.insecure_channel(address)


def metadata() -> tuple[tuple[str, str], ...]:
    token = os.environ.get("ISERVE_TOKEN", "").strip()
    if not token:
        try:
            token = (state_dir() / "tokens" / "admin").read_text().strip()
        except (OSError, UnicodeDecodeError):
            token = ""
    return (("authorization", f"Bearer {token}"),) if token else ()


def request_id() -> str:
    return secrets.token_hex(6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("model_id")
    parser.add_argument("checkpoint")
    parser.add_argument("prompt", nargs="?", default="Once upon a time")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--keep", action="store_true", help="leave the deployment running")
    # Options before or after the prompt, as the Node demo takes them.
    args = parser.parse_intermixed_args(argv)
    if tls := sorted(v for v in os.environ if v.startswith("ISERVE_TLS_") and os.environ[v]):
        parser.error(
            f"{', '.join(tls)} set: this demo speaks plaintext only; with TLS on, use the "
            "CLI (iserve), which reads the stack's certificates"
        )
    if not 1 <= args.max_tokens <= UINT32_MAX:
        parser.error(f"--max-tokens must be a whole number from 1 to {UINT32_MAX}")
    models = model_grpc.ModelServiceStub(channel("model"))
    deployments = deploy_grpc.DeploymentServiceStub(channel("deploy"))
    inference = infer_grpc.InferenceServiceStub(channel("scheduler"))
    try:
        models.RegisterModel(
            model_pb.RegisterModelRequest(
                request_id=request_id(),
                model_id=args.model_id,
                checkpoint_path=args.checkpoint,
                skip_profiling=True,
            ),
            metadata=metadata(),
        )
        print(f"registered {args.model_id}")
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise
        # Registered already: from this checkpoint, or the demo would serve another one.
        registered = models.GetModel(
            model_pb.GetModelRequest(request_id=request_id(), model_id=args.model_id),
            metadata=metadata(),
        ).model.checkpoint_path
        if os.path.normpath(registered) != os.path.normpath(args.checkpoint):
            print(
                f"error: model {args.model_id} is registered from checkpoint {registered!r}, "
                f"not {args.checkpoint!r}: give another model id",
                file=sys.stderr,
            )
            return 1
        print(f"{args.model_id} was registered already")
    deployed = deployments.Deploy(
        deploy_pb.DeployRequest(
            request_id=request_id(),
            model_id=args.model_id,
            config=common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1),
        ),
        metadata=metadata(),
    ).deployment
    stream = None
    try:  # from here on, the deployment is removed however this ends
        print(f"deployed {deployed.deployment_id} on {deployed.worker_address}")
        final = None
        stream = inference.Generate(
            infer_pb.GenerateRequest(
                request_id=request_id(),
                deployment_id=deployed.deployment_id,
                prompt=args.prompt,
                max_tokens=args.max_tokens,
            ),
            metadata=metadata(),
        )
        for message in stream:
            if message.HasField("delta"):
                print(message.delta.text, end="", flush=True)
            elif message.HasField("final"):
                final = message.final
        print()
        if final is not None:
            t = final.timings
            print(
                f"{final.usage.prompt_tokens} prompt + {final.usage.completion_tokens} "
                f"tokens: queue {t.queue_ms:.1f} ms, TTFT {t.ttft_ms:.1f} ms, "
                f"total {t.total_ms:.1f} ms"
            )
    finally:
        if stream is not None:
            # Interrupted, the generation would run on unread, and the removal drain it.
            stream.cancel()
        if not args.keep:
            deployments.RemoveDeployment(
                deploy_pb.RemoveDeploymentRequest(
                    request_id=request_id(), deployment_id=deployed.deployment_id
                ),
                metadata=metadata(),
            )
            print(f"removed {deployed.deployment_id}")
    return 0


if __name__ == "__main__":
    # SIGTERM as Ctrl-C: the deployment is removed on the way out (it was left running).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        sys.exit(main())
    except grpc.RpcError as error:
        print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            print(
                "(is the stack up, and without TLS? this demo speaks plaintext only)",
                file=sys.stderr,
            )
        sys.exit(1)
    except KeyboardInterrupt:
        # Quietly, as a shell expects (a traceback before); the deployment was removed
        # on the way out.
        print("stopped", file=sys.stderr)
        sys.exit(130)
