"""``iserve``: run the stack, manage models and deployments, stream generations.

How the CLI finds the services: each address comes from its ``ISERVE_*_ADDR``
variable when set, else from ``$ISERVE_STATE_DIR/stack.json`` written by ``iserve up``,
else the default ports 50061-50065 on ``$ISERVE_HOST`` (127.0.0.1 unless set; see
``services/settings.py``).
Errors print as ``error: CODE: message`` on stderr with exit status 1 (2 for usage: a
numeric option outside what its request field carries, e.g. a count below 1, is one).
Output into a pipe whose reader has gone (``| head``) ends quietly with status 141.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
from google.protobuf import json_format
from rich.console import Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from services import transport
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import (
    deployment_service_pb2_grpc,
    inference_service_pb2_grpc,
    model_service_pb2_grpc,
)
from services.api import inference_service_pb2 as infer_pb
from services.api import model_service_pb2 as model_pb
from services.cli import deploying, estimation, output, plan, stack, tokens
from services.cli.arguments import (
    add_token_limits,
    device_memory_gib,
    milliseconds_field_seconds,
    model_id_argument,
    nonempty,
    usage_error,
    watch_seconds,
    whole_number,
)
from services.cli.status import (
    WATCH_OPTIONAL,
    collect_status,
    print_status,
    status_header,
    status_tables,
)
from services.errors import cut_off_midway as _cut_off
from services.errors import unreached as _unreached
from services.ids import looks_like_deployment_id
from services.proto_limits import UINT64_MAX
from services.settings import (
    MAX_VIRTUAL_DEVICES,
    SERVICE_ENV,
    Settings,
    TlsFiles,
    certificate_name_warnings,
    check_service_settings,
    check_tls_identity,
    load_settings,
    read_stack_file,
    tls_warnings,
    unknown_variables,
)


def _state_name(state: int) -> str:
    """A model state as the CLI prints it: ``PROFILED``, not ``MODEL_STATE_PROFILED``."""
    return model_pb.ModelState.Name(state).removeprefix("MODEL_STATE_")


def _layers(count: int) -> str:
    return f"{count} layer" if count == 1 else f"{count} layers"


def _unreached_hint(details: str, tls: TlsFiles | None) -> str:
    """What to check when the CLI reached no service (``tls``: this client's TLS files):
    a failed TLS handshake names the TLS files; a connection the server closed at once
    is what a stack serving TLS does to a plaintext client (or, with mutual TLS, to one
    that presents no certificate: without ISERVE_TLS_CLIENT_AUTH=on it presents none,
    whatever ISERVE_TLS_CERT says)."""
    lowered = details.lower()
    not_tls = ("wrong_version_number", "wrong version number", "packet_length_too_long")
    if any(word in lowered for word in not_tls):
        # What OpenSSL says when the bytes that came back are not TLS at all.
        return (
            "the server does not speak TLS: is the stack running without it? Unset "
            "ISERVE_TLS_CA (and ISERVE_TLS_CERT/_KEY) for a stack without TLS"
        )
    if any(word in lowered for word in ("handshake", "ssl", "certificate", "tls")):
        return (
            "the TLS handshake failed: check this client's ISERVE_TLS_CA, ISERVE_TLS_CERT "
            "and ISERVE_TLS_KEY against the stack's certificates"
        )
    if "socket closed" in lowered:
        if tls is None:
            needs = "set ISERVE_TLS_CA (and ISERVE_TLS_CERT/_KEY with mutual TLS)"
        elif tls.serves and not tls.client_auth:
            needs = (
                "with mutual TLS on, ISERVE_TLS_CLIENT_AUTH=on too (this client presents "
                "ISERVE_TLS_CERT only then)"
            )
        else:
            needs = "with mutual TLS on, ISERVE_TLS_CERT and ISERVE_TLS_KEY too"
        return (
            "is the stack up? `iserve status`; a stack serving TLS closes connections "
            f"that do not speak it: {needs}"
        )
    return "is the stack up? `iserve status`"


def _rid() -> str:
    return uuid.uuid4().hex[:16]


def _stub(settings: Settings, service: str, stub_cls: Callable):
    return stub_cls(transport.sync_channel(settings.address(service)))


def _to_json(message) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


# ---- commands ------------------------------------------------------------------------
def _up_options(args) -> stack.UpOptions:
    return stack.UpOptions(devices=args.devices, device_memory_gib=args.device_memory)


def cmd_up(settings: Settings, args) -> int:
    check_service_settings()  # read by the agent and the model service, not load_settings
    warnings = unknown_variables()
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    miscased = [w for w in warnings if w.endswith("(names are upper case)")]
    if miscased:
        # ISERVE_Auth=on brought a stack up open: a setting meant and not read is refused
        # here, where the stack would otherwise start without it.
        raise ValueError(
            "a variable iserve reads is set in the wrong case (see the warnings above): "
            "set it in upper case, or unset it"
        )
    dialed = {SERVICE_ENV[name]: settings.address(name) for name in SERVICE_ENV}
    for warning in [*tls_warnings(settings), *certificate_name_warnings(settings, dialed)]:
        print(f"warning: {warning}", file=sys.stderr)
    # In the foreground the stop signals stay blocked once it started, for sigtimedwait
    # below: a SIGTERM between the two ended it by default, its stack left running, and
    # SIGHUP (the terminal's close) was not waited for at all.
    info = stack.up(settings, _up_options(args), hold_stop_signals=not args.detach)
    print(f"iserve is up (state in {settings.state_dir}); `iserve status` shows it")
    if args.detach:
        return 0
    print("press Ctrl-C to stop")
    started = info.get("started_at_unix_ms")
    heeded = stack.heeded_stop_signals()
    try:
        while signal.sigtimedwait(heeded, 1.0) is None:
            _warn_of_deaths(info)
            # `iserve down` from elsewhere stopped this stack (its record is gone or is
            # another up's): nothing is left to stop, and a stack started since is not ours.
            if read_stack_file(settings.state_dir).get("started_at_unix_ms") != started:
                print("the stack was stopped (iserve down)")
                return 0
        _warn_of_deaths(info)  # one that died since the last look is told before the stop
    except BaseException:
        stack.down(settings)
        raise
    stack.down(settings)
    return 0 if info else 1


def _warn_of_deaths(info: dict) -> None:
    """A warning for each of the foreground stack's processes that exited unasked."""
    for pid, code in stack.reap_children():
        warning = stack.exit_warning(info, pid, code)
        if warning:
            print(warning, file=sys.stderr, flush=True)


def cmd_down(settings: Settings, args) -> int:
    if not stack.down(settings):
        print(f"no stack recorded in {settings.state_dir}")
    return 0


def cmd_gateway(settings: Settings, args) -> int:
    """Run the OpenAI-compatible gateway in the foreground (``iserve up`` starts one)."""
    from gateway_svc.__main__ import main as gateway_main

    return gateway_main([])  # its options are iserve's, already parsed


def cmd_status(settings: Settings, args) -> int:
    if args.watch:
        return _watch_status(settings, args)
    status = collect_status(settings)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print_status(status)
    return 0 if status["healthy"] else 1


def _watch_status(settings: Settings, args) -> int:
    """Redraw the status every ``args.watch`` seconds until Ctrl-C: in place on a terminal
    (rich's Live), as successive blocks (JSON lines with --json) otherwise."""
    out = output.console()
    try:
        if out.is_terminal and not args.json:
            with Live(console=out, auto_refresh=False, transient=False) as live:
                while True:
                    status = collect_status(settings)
                    stamp = time.strftime("%H:%M:%S")
                    live.update(
                        Group(
                            f"{status_header(status)}   [dim]{stamp}, every {args.watch:g} s; "
                            "Ctrl-C stops[/]",
                            output.renderable(
                                status_tables(status, watching=True), out, WATCH_OPTIONAL
                            ),
                        ),
                        refresh=True,
                    )
                    time.sleep(args.watch)
        while True:
            status = collect_status(settings)
            if args.json:
                print(json.dumps(status), flush=True)
            else:
                print(f"--- {time.strftime('%H:%M:%S')}")
                print_status(status)
                sys.stdout.flush()
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def cmd_model_create(settings: Settings, args) -> int:
    from services.models.checkpoint import (
        CheckpointDirectoryNotEmpty,
        InvalidConfig,
        tokenizer_size,
        validate_checkpoint,
    )

    if args.out is None:
        args.out = str(settings.models_root / args.name)
    try:
        with _writing_progress() as progress:
            out = _create_checkpoint(args, progress)
    except CheckpointDirectoryNotEmpty as exc:
        raise FileExistsError(
            f"{str(exc.directory)!r} is not empty; give --force to replace it"
        ) from None
    except InvalidConfig as exc:  # the shape the flags gave: say it in flags
        raise ValueError(_in_flags(str(exc))) from None
    except (FileExistsError, NotADirectoryError, PermissionError) as exc:
        raise ValueError(f"--out {args.out}: cannot write there ({exc.strerror})") from None
    checked = validate_checkpoint(out)
    spec = checked.spec
    print(
        f"wrote {args.name} checkpoint to {out}: {spec.family}, {_layers(spec.num_layers)}, "
        f"{spec.parameter_count():,} parameters, {checked.weight_bytes / 2**30:.2f} GiB "
        f"{spec.torch_dtype}"
    )
    known = tokenizer_size(out)
    if spec.vocab_size > known:
        # Random weights sample every id alike, and ids past the tokenizer's decode to
        # nothing: a generation of a 32000-id model printed no text at all.
        print(
            f"note: the vocabulary has {spec.vocab_size} ids and the bundled tokenizer "
            f"{known}: generations of these random weights are mostly ids past it, which "
            f"decode to no text (--vocab {known}, or leave --vocab out, for visible text)",
            file=sys.stderr,
        )
    return 0


# The config fields `iserve model create`'s flags set, for its errors.
_FLAG_OF_FIELD = {
    "num_attention_heads": "--heads",
    "num_key_value_heads": "--kv-heads",
    "num_kv_heads": "--kv-heads",
    "hidden_size": "--hidden",
    "num_hidden_layers": "--layers",
    "intermediate_size": "--intermediate",
    "vocab_size": "--vocab",
    "max_position_embeddings": "--max-positions",
}


def _in_flags(message: str) -> str:
    """A config error about the shape, naming the flags that set each field."""
    return re.sub(
        r"\b(" + "|".join(_FLAG_OF_FIELD) + r")\b",
        lambda m: _FLAG_OF_FIELD[m.group(1)],
        message,
    )


@contextlib.contextmanager
def _writing_progress():
    """A ``progress(done, total)`` callback drawing a byte bar on stderr when it is a
    terminal (a full-size preset takes minutes to write); None otherwise."""
    err = output.console(stderr=True)
    if not err.is_terminal:
        yield None
        return
    columns = (
        TextColumn("writing weights"),
        BarColumn(),
        DownloadColumn(),  # decimal, as TransferSpeedColumn is (MB beside MB/s)
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _create_checkpoint(args, progress):
    """The checkpoint ``iserve model create`` asks for, written; its directory."""
    from services.models.checkpoint import create_checkpoint
    from services.models.presets import create_preset_checkpoint, get_preset

    if args.preset is not None:
        shape_flags = {
            "--arch": args.arch,
            "--hidden": args.hidden,
            "--heads": args.heads,
            "--kv-heads": args.kv_heads,
            "--intermediate": args.intermediate,
            "--vocab": args.vocab,
            "--max-positions": args.max_positions,
            "--tie-embeddings": args.tie_embeddings or None,
        }
        given = [flag for flag, value in shape_flags.items() if value is not None]
        if given:
            usage_error(f"--preset fixes the model's shape; drop {', '.join(given)}")
        try:
            get_preset(args.preset)
        except KeyError as exc:
            usage_error(exc.args[0])
        out = create_preset_checkpoint(
            args.out,
            args.preset,
            num_layers=args.layers,
            dtype=args.dtype,
            seed=args.seed,
            overwrite=args.force,
            progress=progress,
        )
    else:
        required = {"--hidden": args.hidden, "--layers": args.layers, "--heads": args.heads}
        missing = [flag for flag, value in required.items() if value is None]
        if missing:
            usage_error(f"give --preset, or the model's shape: {', '.join(missing)} missing")
        out = create_checkpoint(
            args.out,
            arch=args.arch or "llama",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            intermediate_size=args.intermediate,
            vocab_size=args.vocab,
            max_position_embeddings=args.max_positions or 2048,
            tie_word_embeddings=args.tie_embeddings,
            dtype=args.dtype or "float32",
            seed=args.seed,
            overwrite=args.force,
            progress=progress,
        )
    return out


PROGRESS_BAR_WIDTH = 30


def render_progress(event: model_pb.WatchModelResponse, width: int = PROGRESS_BAR_WIDTH) -> str:
    """One line of profiling progress: a bar of runs done, the count and what runs now."""
    total = event.runs_total
    filled = width * event.runs_done // total if total else 0
    bar = "#" * filled + "." * (width - filled)
    state = _state_name(event.state).lower()
    what = _progress_text(event, state)
    return f"[{bar}] {event.runs_done}/{total} {state}" + (f": {what}" if what else "")


def _progress_text(event: model_pb.WatchModelResponse, state: str) -> str:
    """What runs now, with what the profiler says of it beyond "running" ("measuring
    again: …", "waiting for another model's job"), or the profiler's message without the
    state it starts with ("profiled: 60 measurements, …"), which the line already names."""
    if event.current:
        said = event.message
        return event.current if said in ("", "running") else f"{event.current} ({said})"
    what = event.message
    return "" if what.lower() == state else what.removeprefix(f"{state}: ")


# What the profiling bar's columns other than the job's text take (state, a 24-wide bar,
# runs done, elapsed and remaining time, their gaps): the text gets the rest.
_PROFILING_BAR_FIXED = 58


def profiling_columns() -> tuple:
    """The profiling bar's columns: state, bar, runs done, elapsed, time left, the job now
    running (cut to the terminal by :func:`fitted`)."""
    return (
        TextColumn("[bold]{task.fields[state]}"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(compact=True),
        TextColumn("{task.description}"),
    )


def fitted(text: str, width: int) -> str:
    """``text`` cut with an ellipsis to what a ``width``-column terminal leaves it beside
    the profiling bar: a long job's text squeezed the bar, the count and the time out of
    an 80-column line (a probe)."""
    room = max(8, width - _PROFILING_BAR_FIXED)
    return text if len(text) <= room else text[: room - 1] + "…"


def _watch_profiling(stub, model_id: str) -> model_pb.WatchModelResponse | None:
    """Follow WatchModel until profiling ends, drawing its progress on stderr: a rich
    progress bar (runs done, elapsed time, the job now running) on a terminal, a line
    per change otherwise. Returns the last event (None when there was none)."""
    events = stub.WatchModel(model_pb.WatchModelRequest(request_id=_rid(), model_id=model_id))
    err = output.console(stderr=True)
    last = None
    if not err.is_terminal:
        shown = ""
        for last in events:
            line = render_progress(last)
            if line != shown:
                print(line, file=sys.stderr, flush=True)
                shown = line
        return last
    with Progress(*profiling_columns(), console=err, transient=False) as progress:
        task = progress.add_task("", total=None, state="profiling")
        for last in events:
            state = _state_name(last.state).lower()
            progress.update(
                task,
                total=last.runs_total or None,
                completed=last.runs_done,
                description=fitted(_progress_text(last, state), err.width),
                state=state,
            )
    return last


def checkpoint_argument(checkpoint: str, models_root: Path) -> str:
    """The checkpoint_path to send for ``iserve register``'s CHECKPOINT: as given when it
    is absolute or a directory under the models root, else, when it names a directory
    relative to the current one (where `iserve model create --out` writes), that
    directory's absolute path, which the service takes when it is inside its models root
    and otherwise refuses naming the root."""
    given = Path(checkpoint)
    if given.is_file() and not (models_root / given).exists():
        # A file here, nothing of that name under the root: the service would say only
        # that no such directory is under its root.
        raise ValueError(
            f"{checkpoint!r} is a file: a checkpoint is the directory that holds config.json "
            "and the weights (`iserve model create --out DIR` writes one)"
        )
    if given.is_absolute() or (models_root / given).is_dir() or not given.is_dir():
        return checkpoint
    return str(given.resolve())


def cmd_register(settings: Settings, args) -> int:
    stub = _stub(settings, "model", model_service_pb2_grpc.ModelServiceStub)
    reply = stub.RegisterModel(
        model_pb.RegisterModelRequest(
            request_id=_rid(),
            model_id=args.model_id,
            checkpoint_path=checkpoint_argument(args.checkpoint, settings.models_root),
            skip_profiling=args.skip_profiling,
            variants=args.variant,
            **({"accuracy_score": args.accuracy} if args.accuracy is not None else {}),
        )
    )
    model = reply.model
    if not args.json:
        shape = model.shape
        print(
            f"registered {model.model_id}: {_layers(shape.num_layers)}, hidden {shape.hidden_size}, "
            f"{shape.parameter_count / 1e6:.1f}M parameters, {shape.weight_bytes / 2**20:.1f} MiB "
            f"({_state_name(model.state)})"
        )
        if model.variants:
            print(f"variants: {', '.join(v.name for v in model.variants)}")
    if model.state == model_pb.MODEL_STATE_PROFILING and not args.no_wait:
        try:
            last = _watch_profiling(stub, model.model_id)
        except KeyboardInterrupt:
            # Only the watching stops: the model service profiles on.
            print(
                f"\nstopped watching; {model.model_id} is still being profiled on the "
                f"stack (`iserve models` shows its state; `iserve model delete "
                f"{model.model_id}` stops it)",
                file=sys.stderr,
            )
            return 130
        try:
            model = stub.GetModel(
                model_pb.GetModelRequest(request_id=_rid(), model_id=model.model_id)
            ).model
        except grpc.RpcError as exc:
            profiled = last is not None and last.state == model_pb.MODEL_STATE_PROFILED
            if not profiled or exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            # The watch saw it profiled (and stored); the stack stopped before its record
            # could be read: that is no failed registration (it exited 1; a tester).
            model.state = last.state
            print(
                f"note: {model.model_id} was profiled, but its record could not be read "
                f"since (UNAVAILABLE: {exc.details()}; was the stack stopped? `iserve "
                "models` shows it once the stack is up)",
                file=sys.stderr,
            )
        if not args.json:
            print(f"{model.model_id}: {_state_name(model.state)}")
    if args.json:
        print(json.dumps(_to_json(model)))
    if model.state == model_pb.MODEL_STATE_FAILED:
        print(f"error: profiling {model.model_id} failed: {model.state_reason}", file=sys.stderr)
        return 1
    if model.state_reason:  # profiled, but not all of it (an agent stopped answering)
        print(f"note: {model.model_id}: {model.state_reason}", file=sys.stderr)
    return 0


def cmd_model_delete(settings: Settings, args) -> int:
    stub = _stub(settings, "model", model_service_pb2_grpc.ModelServiceStub)
    stub.DeleteModel(model_pb.DeleteModelRequest(request_id=_rid(), model_id=args.model_id))
    # An imported model has no checkpoint: "checkpoint files are kept" read as if it had.
    print(
        f"deleted {args.model_id} (its record, profiles and the fingerprints no other model "
        "uses; a checkpoint it was registered from stays on disk)"
    )
    return 0


def cmd_models(settings: Settings, args) -> int:
    reply = _stub(settings, "model", model_service_pb2_grpc.ModelServiceStub).ListModels(
        model_pb.ListModelsRequest(request_id=_rid())
    )
    if output.stdout_is_terminal() and not args.json:
        rows = [
            [
                m.model_id,
                _state_name(m.state),
                m.shape.num_layers,
                m.shape.hidden_size,
                m.checkpoint_path,
                m.state_reason or "-",
            ]
            for m in reply.models
        ]
        headers = ["MODEL", "STATE", "LAYERS", "HIDDEN", "CHECKPOINT", "REASON"]
        output.show_tables([(None, headers, rows)])
        return 0
    for model in reply.models:  # not a terminal: tab-separated lines, for scripts
        # The state after the earlier columns, so they stay where scripts read them (a
        # script waiting for PROFILED had nothing to poll); why it FAILED after it.
        state = _state_name(model.state)
        reason = " ".join(model.state_reason.split())
        print(
            json.dumps(_to_json(model))
            if args.json
            else f"{model.model_id}\t{model.checkpoint_path}\t{state}"
            + (f"\t{reason}" if reason else "")
        )
    return 0


def cmd_deploy(settings: Settings, args) -> int:
    stub = _stub(settings, "deploy", deployment_service_pb2_grpc.DeploymentServiceStub)
    fields = dict(
        request_id=args.request_id or _rid(),
        model_id=args.model_id,
        batch_size=args.batch,
        max_input_tokens=args.max_input,
        max_output_tokens=args.max_output,
        placement_policy=deploying.POLICIES[args.policy] if args.policy else 0,
        objectives=deploying.objectives(args),
        replicas=deploying.replica_count(args),
        **deploying.request_target(args),
    )
    if args.plan:
        reply = stub.PlanDeployment(deploy_pb.PlanDeploymentRequest(**fields))
        if args.json:
            print(json.dumps(_to_json(reply.decision)))
        else:
            deploying.print_decision(reply.decision)
        return 0
    request = deploy_pb.DeployRequest(**fields, ready_timeout_ms=round(args.timeout * 1000))
    progress = deploying.deploy_progress(stub, args.model_id, request.request_id)
    try:
        reply = output.call_showing_status(
            stub.Deploy, request, output.console(stderr=True), progress
        )
    except KeyboardInterrupt:
        # The call is cancelled with the process, and the deployer rolls back a Deploy
        # cancelled before it answered; it may also have just finished.
        print(
            "deploy interrupted: the deployer rolls back a Deploy cancelled before it "
            "answers; `iserve deployments` shows whether this one had finished",
            file=sys.stderr,
        )
        return 130
    dep = reply.deployment
    if args.json:
        print(json.dumps({"deployment": _to_json(dep), "decision": _to_json(reply.decision)}))
        return 0
    if reply.HasField("decision"):
        deploying.print_decision(reply.decision)
    if dep.state != deploy_pb.DEPLOYMENT_STATE_READY:
        # A repeat of a request id answers the deployment as it stands now.
        state = deploy_pb.DeploymentState.Name(dep.state).removeprefix("DEPLOYMENT_STATE_")
        reason = f": {dep.state_reason}" if dep.state_reason else ""
        print(
            f"deployment {dep.deployment_id} of this request id is {state}{reason}",
            file=sys.stderr,
        )
        print(dep.deployment_id)
        return 0 if dep.state == deploy_pb.DEPLOYMENT_STATE_STARTING else 1
    print(
        f"deployed {dep.model_id} {deploying.describe_config(dep.config)} "
        f"({deploying.describe_objectives(dep.objectives)}); "
        + (
            f"worker {dep.worker_address}"
            if len(dep.replicas) <= 1
            else f"workers {', '.join(r.worker_address for r in dep.replicas)}"
        ),
        file=sys.stderr,
    )
    print(dep.deployment_id)
    return 0


def cmd_deployments(settings: Settings, args) -> int:
    reply = _stub(
        settings, "deploy", deployment_service_pb2_grpc.DeploymentServiceStub
    ).ListDeployments(
        deploy_pb.ListDeploymentsRequest(request_id=_rid(), model_id=args.model or "")
    )
    if output.stdout_is_terminal() and not args.json:
        rows = [
            [
                dep.deployment_id,
                dep.model_id,
                deploying.state_name(dep.state),
                deploying.describe_config(dep.config),
                deploying.describe_objectives(dep.objectives),
                deploying.describe_replicas(dep),
            ]
            for dep in reply.deployments
        ]
        headers = ["DEPLOYMENT", "MODEL", "STATE", "CONFIG", "OBJECTIVES", "REPLICAS"]
        output.show_tables([(None, headers, rows)])
        return 0
    # Not a terminal: one tab-separated line per deployment, for scripts.
    for dep in reply.deployments:
        state = deploying.state_name(dep.state)
        print(
            json.dumps(_to_json(dep))
            if args.json
            else "\t".join(
                (
                    dep.deployment_id,
                    dep.model_id,
                    state,
                    deploying.describe_config(dep.config),
                    deploying.describe_objectives(dep.objectives),
                    deploying.describe_replicas(dep),
                )
            )
        )
    return 0


# Seconds `iserve generate` waits for the deployer to say what its target names.
RESOLVE_TIMEOUT_S = 5.0


def _is_deployment(settings: Settings, target: str) -> bool:
    """Whether ``target`` names a deployment (else a model), as the deployer knows it;
    while the deployer cannot answer (it is down, or Redis is: the scheduler still
    serves what it knows), by the shape of a deployment's id. A scheduler down too then
    fails the generation itself, with the "is the stack up?" hint.

    A model with deployments is found by listing them, which answers OK: asked first
    whether it was a deployment, each generation by model id left a NOT_FOUND in the
    deployer's log and call counts (a probe)."""
    stub = _stub(settings, "deploy", deployment_service_pb2_grpc.DeploymentServiceStub)
    # A hung Redis held the deployer's answer, and the generation the scheduler served in
    # 10 ms, 31 s (a tester): past this, the id's shape decides.
    deadline = time.monotonic() + RESOLVE_TIMEOUT_S
    try:
        if _has_deployments(stub, target, RESOLVE_TIMEOUT_S):
            return False
        stub.GetDeployment(
            deploy_pb.GetDeploymentRequest(request_id=_rid(), deployment_id=target),
            timeout=max(deadline - time.monotonic(), 0.5),
        )
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
            return False
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return looks_like_deployment_id(target)
        raise
    return True


def sampling_of(args) -> common.SamplingParams:
    """The request's sampling from `iserve generate`'s options. ``--top-p 0`` keeps only
    the likeliest token, greedy, as the gateway reads OpenAI's ``top_p: 0``: the message's
    0 means "unset" (the whole distribution), so `--top-p 0` sampled where HTTP's was
    greedy (a probe)."""
    sampling = common.SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        ignore_eos=args.ignore_eos,
        stop=args.stop or [],
    )
    if args.seed is not None:
        sampling.seed = args.seed
    if sampling.top_p == 0:  # as the float32 field holds it (a tiny P is 0 there too)
        sampling.temperature, sampling.top_p = 0.0, 1.0
    return sampling


def _has_deployments(stub, model_id: str, timeout_s: float | None = None) -> bool:
    """Whether ``model_id`` names a model with deployments the caller may see; False for
    a name no model can have (INVALID_ARGUMENT: a deployment's id may be longer)."""
    try:
        listed = stub.ListDeployments(
            deploy_pb.ListDeploymentsRequest(request_id=_rid(), model_id=model_id),
            timeout=timeout_s,
        )
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return False
        raise
    return bool(listed.deployments)


def cmd_generate(settings: Settings, args) -> int:
    target = (
        {"deployment_id": args.target}
        if _is_deployment(settings, args.target)
        else {"model_id": args.target}
    )
    sampling = sampling_of(args)
    request = infer_pb.GenerateRequest(
        request_id=args.request_id or _rid(),
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        sampling=sampling,
        priority=args.priority,
        deadline_ms=args.deadline_ms,
        **target,
    )
    stub = _stub(settings, "scheduler", inference_service_pb2_grpc.InferenceServiceStub)
    final = None
    text_shown = False  # text on the line, without its newline yet
    try:
        for message in stub.Generate(request):
            if message.HasField("delta"):
                if args.json:
                    print(json.dumps({"delta": _to_json(message.delta)}), flush=True)
                else:
                    sys.stdout.write(message.delta.text)
                    sys.stdout.flush()
                    text_shown = text_shown or bool(message.delta.text)
            elif message.HasField("final"):
                final = message.final
    except KeyboardInterrupt:
        # The call is cancelled with the process (the scheduler frees its slot); the
        # shell's prompt on a line of its own, not after the last words of the text.
        if text_shown:
            sys.stdout.write("\n")
            sys.stdout.flush()
        print("generation interrupted", file=sys.stderr)
        return 130
    except grpc.RpcError as exc:
        if text_shown:
            # The error on a line of its own, not after the last words of the text.
            sys.stdout.write("\n")
            sys.stdout.flush()
        if "model_id" in target and exc.code() == grpc.StatusCode.NOT_FOUND:
            # Not a deployment id, and no model of that name is deployed: a mistyped
            # deployment id reads as a model id, so the error names both readings.
            print(
                f"error: NOT_FOUND: no deployment is named {args.target} and no model of "
                "that name has a deployment (`iserve deployments` lists them)",
                file=sys.stderr,
            )
            return 1
        raise
    if final is None:
        print("error: stream ended without a final message", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"final": _to_json(final)}), flush=True)
    else:
        if text_shown:
            # The text ends its line on stdout itself: captured alone (`> out.txt`), it
            # is a whole line, and the summary on stderr starts a line of its own.
            sys.stdout.write("\n")
            sys.stdout.flush()
        t = final.timings
        reason = (
            common.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
        )
        # An FCFS deployment serves a request past its deadline (only EDF refuses one it
        # would miss): say so, as `iserve status` counts it.
        missed = (
            f" (past its {args.deadline_ms} ms deadline)"
            if args.deadline_ms and t.total_ms > args.deadline_ms
            else ""
        )
        print(
            f"[{final.usage.completion_tokens} tokens, {reason}; queue {t.queue_ms:.1f} ms, "
            f"TTFT {t.ttft_ms:.1f} ms, TPOT {t.tpot_ms:.2f} ms, total {t.total_ms:.0f} ms"
            f"{missed}; deployment {final.deployment_id}]",
            file=sys.stderr,
        )
        for note in generation_notes(final.usage.completion_tokens, text_shown):
            print(f"note: {note}", file=sys.stderr)
    return 0


def generation_notes(completion_tokens: int, text_shown: bool) -> list[str]:
    """What `iserve generate` says after its summary line: why stdout is empty when
    tokens were generated (an empty stdout with exit 0 read as a failure)."""
    if completion_tokens and not text_shown:
        return [
            f"the {completion_tokens} token(s) generated decode to no text (ids the "
            "tokenizer has no text for, or an incomplete character; `--json` shows their ids)"
        ]
    return []


def cmd_remove(settings: Settings, args) -> int:
    stub = _stub(settings, "deploy", deployment_service_pb2_grpc.DeploymentServiceStub)
    request = deploy_pb.RemoveDeploymentRequest(request_id=_rid(), deployment_id=args.deployment_id)
    try:
        output.call_showing_status(
            stub.RemoveDeployment,
            request,
            output.console(stderr=True),
            lambda elapsed: (
                f"removing {args.deployment_id}: stopping its workers ({elapsed:.0f} s)"
            ),
        )
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            # A model's id given where a deployment's goes (`generate` takes either).
            listed = []
            with contextlib.suppress(grpc.RpcError):  # no model id either: the error stands
                listed = stub.ListDeployments(
                    deploy_pb.ListDeploymentsRequest(request_id=_rid(), model_id=args.deployment_id)
                ).deployments
            if listed:
                ids = ", ".join(d.deployment_id for d in listed)
                print(
                    f"error: NOT_FOUND: {exc.details()}: {args.deployment_id} is a model; "
                    f"remove one of its deployments: {ids}",
                    file=sys.stderr,
                )
                return 1
        raise
    print(f"removed {args.deployment_id}")
    return 0


# ---- parser --------------------------------------------------------------------------
# `iserve model create --preset`'s names, listed without importing services.models (a
# tenth of a second on every CLI call); a unit test holds them to presets.PRESETS.
PRESET_NAMES = (
    "llama-2-7b",
    "llama-2-13b",
    "llama-2-70b",
    "codellama-34b",
    "llama-3-8b",
    "llama-3-70b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "mistral-7b",
    "qwen2-7b",
    "qwen2-72b",
    "qwen2.5-7b",
    "qwen2.5-14b",
    "qwen2.5-32b",
    "qwen2.5-72b",
    "falcon-7b",
    "falcon-40b",
    "gpt-j-6b",
)


class _Parser(argparse.ArgumentParser):
    """No abbreviated options (``--max`` for ``--max-tokens``): a script that used one
    would break, or change meaning, when an option sharing its prefix is added. Every
    subcommand's parser is one too (``add_subparsers`` makes its own class's)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="iserve",
        description=_plain(__doc__.splitlines()[0]),
        epilog=_plain(__doc__.split("\n\n", 1)[1]),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "up",
        help="start Redis (embedded unless REDIS_URL), every service, a node agent and the "
        "OpenAI-compatible gateway",
    )
    p.add_argument("--detach", action="store_true", help="return once everything is ready")
    p.add_argument(
        "--devices",
        type=whole_number(1, MAX_VIRTUAL_DEVICES),
        help=f"virtual CPU devices when no GPU (default: ISERVE_DEVICES, else 2; at most "
        f"{MAX_VIRTUAL_DEVICES})",
    )
    p.add_argument(
        "--device-memory",
        type=device_memory_gib,
        metavar="GIB",
        help="memory per virtual device (default: ISERVE_DEVICE_MEMORY_GIB, else 4)",
    )
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("down", help="stop the stack started by `iserve up`")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser(
        "gateway",
        help="run the OpenAI-compatible HTTP gateway in the foreground on ISERVE_GATEWAY_ADDR "
        "(`iserve up` starts one)",
    )
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser(
        "status", help="services, devices, models and deployments; exit 0 only if all answer"
    )
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument(
        "--watch",
        type=watch_seconds,
        nargs="?",
        const=2.0,
        default=0.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C, in place on a terminal",
    )
    p.set_defaults(func=cmd_status)

    model = sub.add_parser("model", help="model checkpoints").add_subparsers(
        dest="model_command", required=True, metavar="ACTION"
    )
    p = model.add_parser(
        "create", help="write a checkpoint with random weights (config, safetensors, tokenizer)"
    )
    p.add_argument(
        "name",
        type=model_id_argument,
        help="the checkpoint's name, a model id's characters: the directory it goes to "
        "under the models root unless --out, and the id to register it as",
    )
    p.add_argument(
        "--preset",
        help="exact shapes of a known model: " + ", ".join(PRESET_NAMES),
    )
    p.add_argument(
        "--layers",
        type=whole_number(),
        help="decoder layers (required without --preset; default: all)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="default: float32, or the preset's published dtype",
    )
    p.add_argument(
        "--arch",
        choices=["llama", "mistral", "qwen2", "falcon", "gptj"],
        help="family of a custom shape (default: llama)",
    )
    p.add_argument("--hidden", type=whole_number(), help="hidden size (required without --preset)")
    p.add_argument(
        "--heads", type=whole_number(), help="attention heads (required without --preset)"
    )
    p.add_argument("--kv-heads", type=whole_number(), help="default: --heads")
    p.add_argument(
        "--intermediate", type=whole_number(), help="MLP width (default: the family's usual)"
    )
    p.add_argument("--vocab", type=whole_number(), help="default: the tokenizer's size")
    p.add_argument("--max-positions", type=whole_number(), help="default: 2048")
    p.add_argument(
        "--tie-embeddings", action="store_true", help="the LM head shares the embedding's weights"
    )
    p.add_argument(
        "--seed", type=whole_number(0, UINT64_MAX), default=0, help="of the random weights"
    )
    p.add_argument(
        "--out",
        type=nonempty,
        help="directory to write (default: NAME under the models root, ISERVE_MODELS_ROOT, "
        "where register finds it as NAME)",
    )
    p.add_argument("--force", action="store_true", help="overwrite a non-empty directory")
    p.set_defaults(func=cmd_model_create)
    p = model.add_parser(
        "delete",
        help="forget a registered or imported model: its record, profiles, configuration "
        "maps and profiling jobs (its checkpoint files stay on disk); refused while it is "
        "deployed",
    )
    p.add_argument("model_id")
    p.set_defaults(func=cmd_model_delete)

    p = sub.add_parser("register", help="validate a checkpoint under the models root and record it")
    p.add_argument("model_id")
    p.add_argument(
        "checkpoint",
        help="directory, relative to ISERVE_MODELS_ROOT (or else to the current directory) "
        "or absolute, inside the models root",
    )
    p.add_argument("--accuracy", type=float, help="accuracy score of the model (e.g. MMLU)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        type=deploying.variant_argument,
        metavar="NAME:KEY=VALUE,...",
        help="a compression variant the model admits, profiled beside the base (repeat for "
        "more): keys weights=int8|int4, kv=int8, pruning=2:4|structured, fraction=0.25 (of "
        "heads and MLP channels, structured: the one share served), accuracy=A; e.g. "
        "int8-kv8:weights=int8,kv=int8",
    )
    p.add_argument(
        "--skip-profiling",
        action="store_true",
        help="record it without profiling (explicit deploys only; intents need a profile)",
    )
    p.add_argument(
        "--no-wait",
        action="store_true",
        help="return once registered instead of showing profiling progress until it ends",
    )
    p.add_argument("--json", action="store_true", help="the model record as JSON")
    p.set_defaults(func=cmd_register)

    p = sub.add_parser("models", help="list registered models")
    p.add_argument(
        "--json", action="store_true", help="one JSON object per model, one per line (JSON Lines)"
    )
    p.set_defaults(func=cmd_models)

    p = sub.add_parser(
        "deploy",
        help="deploy a model by intent (default min-cost) or explicit configuration; "
        "prints the deployment id last",
        description="With --intent (or no configuration flag) the deployer ranks the "
        "model's estimated configurations for the intent, places the best one that fits "
        "and launches it; with --tp/--pp/--weight-quant/... it deploys that configuration. "
        "The decision (winner, layer map, skipped configurations) goes to stderr.",
    )
    p.add_argument("model_id")
    deploying.add_arguments(p)
    p.add_argument(
        "--batch",
        type=whole_number(),
        default=0,
        help="concurrent sequences (default: the largest whose estimated TPOT meets "
        "--tpot-slo-ms, or 1.5x batch 1's without it, and whose KV cache fits; 1 when the "
        "configuration has no estimate)",
    )
    add_token_limits(
        p,
        "longest prompt in tokens (default 512, or 2/3 of a shorter context)",
        "longest generation in tokens (default 256, or 1/3 of a shorter context)",
    )
    p.add_argument(
        "--timeout",
        type=milliseconds_field_seconds,
        default=0,
        help="seconds to wait for the workers (default: the deployer's "
        "ISERVE_READY_TIMEOUT_S, 120 unless set)",
    )
    p.add_argument("--request-id", help="idempotency key")
    p.add_argument("--json", action="store_true", help="the decision and deployment as JSON")
    p.set_defaults(func=cmd_deploy)

    p = sub.add_parser("deployments", help="list deployments")
    p.add_argument("--model", help="only this model's deployments")
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per deployment, one per line (JSON Lines; none: no line)",
    )
    p.set_defaults(func=cmd_deployments)

    p = sub.add_parser("generate", help="stream a generation from a model or deployment")
    p.add_argument("target", metavar="MODEL_ID|DEPLOYMENT_ID")
    p.add_argument("prompt")
    p.add_argument(
        "--max-tokens", type=whole_number(), default=64, help="tokens to generate (default 64)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)"
    )
    p.add_argument(
        "--top-k", type=whole_number(0), default=0, help="sample among the K likeliest (0: all)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample within probability mass P (default 1; 0: the likeliest token, greedy)",
    )
    p.add_argument("--seed", type=whole_number(0, UINT64_MAX), help="makes sampling repeatable")
    p.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")
    p.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="end the text before TEXT (repeat for up to 4)",
    )
    p.add_argument("--priority", action="store_true", help="go to the front of the queue")
    p.add_argument(
        "--deadline-ms",
        type=whole_number(),
        default=0,
        help="arrival to last token (ms); an EDF deployment refuses a request that cannot make it",
    )
    p.add_argument("--request-id", help="the request's id (default: a new one)")
    p.add_argument(
        "--json", action="store_true", help="one JSON object per delta, then the final message"
    )
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("remove", help="stop a deployment's workers and release its memory")
    p.add_argument("deployment_id")
    p.set_defaults(func=cmd_remove)

    estimation.add_commands(sub)
    tokens.add_commands(sub)
    plan.add_command(sub)
    _describe_subcommands(parser)
    return parser


def _plain(text: str) -> str:
    """Docstring text for a terminal: ``code`` without its reStructuredText quotes."""
    return text.replace("``", "`")


def _describe_subcommands(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand's own --help the line its parent's list shows for it (a
    subparser's ``help`` appears only in the parent's list), recursively."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, subparser in action.choices.items():
            if subparser.description is None and helps.get(name):
                subparser.description = helps[name]
            _describe_subcommands(subparser)


def _replace_what_the_terminal_cannot_show() -> None:
    """A terminal whose encoding is not UTF-8 (``LANG=C``, ``PYTHONIOENCODING=ascii``)
    gets ``?`` for what it cannot show: model output and paths are anyone's text, and
    printing them must not fail the command after it did its work."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", "") or "").lower().replace("-", "")
        if encoding != "utf8" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")


def main(argv: list[str] | None = None) -> int:
    _replace_what_the_terminal_cannot_show()
    try:
        return _run(argv)
    except KeyboardInterrupt:
        # Anywhere (building the parser, parsing, a command): quietly, as a shell expects.
        return 130
    except BrokenPipeError:
        # The reader went away (`iserve estimate ... | head`): stop quietly, as a program
        # killed by SIGPIPE would, and keep Python from reporting the unflushed stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


# Commands that start servers, which bind a "host:0" address as given.
SERVER_COMMANDS = ("up", "gateway")


def _not_utf8(exc: UnicodeEncodeError) -> int:
    # Bytes that are not UTF-8 reach argv as lone surrogates (Python's surrogateescape).
    bad = exc.object[exc.start : exc.end].encode("utf-8", "surrogateescape")
    print(f"error: an argument is not UTF-8 text (bytes {bad!r})", file=sys.stderr)
    return 1


def _command_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` ran: ``token revoke``'s, ``deploy``'s."""
    while True:
        chosen = None
        for action in parser._actions:  # noqa: SLF001 - argparse keeps subparsers only here
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                name = getattr(args, action.dest, None)
                chosen = action.choices.get(name) if name else None
        if chosen is None:
            return parser
        parser = chosen


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    given = sys.argv[1:] if argv is None else argv
    if given and given[0].startswith("-") and given[0] not in ("-h", "--help"):
        # argparse said "required: COMMAND" of `iserve --bogus`, not naming the flag.
        parser.error(f"unrecognized arguments: {given[0]} (a command's options follow it)")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Said by the command's own parser, with its usage (the top-level usage said
        # nothing of what `iserve generate` takes).
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    # Before connecting to anything: no request can carry such an argument.
    for arg in sys.argv[1:] if argv is None else argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as exc:
            return _not_utf8(exc)
    if args.command == "up":
        # A flag given overrides its variable before the settings read it (a bad variable
        # refused the flag meant to replace it); the stack's processes inherit it.
        os.environ.update(stack.flag_variables(_up_options(args)))
    try:
        # `iserve up` starts the processes that serve with these files; any other command
        # is a client, which may present a certificate made for clients alone.
        settings = check_tls_identity(load_settings(), serving=args.command == "up")
        if args.command not in SERVER_COMMANDS:  # a client: "host:0" means the port up chose
            settings = settings.as_recorded()
        transport.configure(transport.Transport.for_client(settings))
        return args.func(settings, args)
    except BrokenPipeError:
        raise
    except UnicodeEncodeError as exc:  # text from elsewhere (a file, the environment)
        return _not_utf8(exc)
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE and _unreached(exc.details()):
            hint = _unreached_hint(exc.details(), settings.tls)
            print(f"error: UNAVAILABLE: {exc.details()} ({hint})", file=sys.stderr)
        elif code == grpc.StatusCode.UNAVAILABLE and _cut_off(exc.details()):
            print(
                "error: UNAVAILABLE: the service stopped while it answered (was the stack "
                f"stopped, or the service killed? `iserve status`): {exc.details()}",
                file=sys.stderr,
            )
        elif code == grpc.StatusCode.UNAUTHENTICATED:
            print(
                f"error: UNAUTHENTICATED: {exc.details()} (export ISERVE_TOKEN; an "
                "administrator issues tokens with `iserve token create`)",
                file=sys.stderr,
            )
        else:
            print(f"error: {code.name}: {exc.details()}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError, FileExistsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
