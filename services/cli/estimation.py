"""CLI commands of estimation: ``profile import``, ``profile show``, ``estimate``,
``calibrate``.

``build_parser`` in ``services/cli/main.py`` adds them with :func:`add_commands`.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

from google.protobuf import json_format

from services import transport
from services.api import common_pb2 as common
from services.api import estimator_service_pb2 as estimator_pb
from services.api import estimator_service_pb2_grpc, model_service_pb2_grpc
from services.api import model_service_pb2 as model_pb
from services.cli.arguments import device_memory_gib, id_list, usage_error, whole_number
from services.cli.output import gib, show_tables
from services.contention import CONTENDED_SHARE
from services.files import FileTooLarge, NotRegularFile, read_regular_file
from services.importers import MAX_PROFILE_MEASUREMENTS
from services.models.checkpoint_files import MAX_CONFIG_BYTES
from services.settings import Settings

GIB = float(1 << 30)
PROFILE_FORMATS = {"maveriq": model_pb.PROFILE_FORMAT_MAVERIQ}


def _rid() -> str:
    return uuid.uuid4().hex[:16]


def _estimator(settings: Settings) -> estimator_service_pb2_grpc.EstimatorServiceStub:
    channel = transport.sync_channel(settings.address("estimator"))
    return estimator_service_pb2_grpc.EstimatorServiceStub(channel)


def _models(settings: Settings) -> model_service_pb2_grpc.ModelServiceStub:
    channel = transport.sync_channel(settings.address("model"))
    return model_service_pb2_grpc.ModelServiceStub(channel)


def _enum_name(enum, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix).lower()


def _model_configs(pairs: list[str]) -> dict[str, str]:
    """``NAME=PATH`` pairs of ``--model-config`` as {name: config.json text}."""
    configs: dict[str, str] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not (sep and name and path):
            raise ValueError(f"--model-config {pair!r}: use NAME=PATH (the model name of the rows)")
        if name in configs:
            raise ValueError(f"--model-config names {name!r} twice")
        try:
            content = _file_content(path, MAX_CONFIG_BYTES, "--model-config")
        except FileTooLarge as exc:
            raise ValueError(
                f"--model-config {path!r} is {exc.size / (1 << 20):.1f} MiB, over the "
                f"{MAX_CONFIG_BYTES / (1 << 20):.0f} MiB it may be"
            ) from None
        try:
            configs[name] = content.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"--model-config {path!r} is not UTF-8 text (byte {exc.start}): a config.json"
            ) from None
    return configs


def _file_content(path: str, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path`` (:func:`read_regular_file`): ValueError naming
    it when it is not one to read, FileTooLarge when it holds more than ``limit``. Read
    whole first, /dev/zero grew the CLI to 9.8 GB in 7 s, and a 2 GB file was refused
    after 13 s at 4.2 GB (a tester)."""
    try:
        return read_regular_file(path, limit)
    except NotRegularFile:
        raise ValueError(f"{what} {path!r} is not a regular file") from None
    except OSError as exc:
        raise ValueError(f"cannot read {path!r}: {exc.strerror or exc}") from None


# What one ImportProfiles request may carry besides its files (names, model configs).
_IMPORT_HEADROOM_BYTES = 1 << 20


def cmd_profile_import(settings: Settings, args) -> int:
    most = transport.MAX_MESSAGE_BYTES - _IMPORT_HEADROOM_BYTES
    files = []
    for path in args.files:
        try:
            content = _file_content(path, most, "the file")
        except FileTooLarge as exc:
            # Rows are kept by file name, so a file cannot go in parts under its name.
            raise ValueError(
                f"{path!r} is {exc.size / (1 << 20):.1f} MiB, over the "
                f"{most / (1 << 20):.0f} MiB one import carries; a "
                f"model's profile holds at most {MAX_PROFILE_MEASUREMENTS:,} rows (the "
                "published data set's files are under 1 MiB): keep the rows the estimates need"
            ) from None
        files.append(model_pb.ProfileFile(name=Path(path).name, content=content))
    total = sum(len(f.content) for f in files)
    if total > most:
        # gRPC's own refusal said only RESOURCE_EXHAUSTED and two byte counts.
        raise ValueError(
            f"the files are {total / (1 << 20):.1f} MiB together; one import carries at most "
            f"{most / (1 << 20):.0f} MiB: import them a file at a time (each file's rows "
            "replace only that file's rows), and keep to the rows the estimates need (a "
            f"model's profile holds at most {MAX_PROFILE_MEASUREMENTS:,})"
        )
    reply = _models(settings).ImportProfiles(
        model_pb.ImportProfilesRequest(
            request_id=_rid(),
            format=PROFILE_FORMATS[args.format],
            hardware_type=args.hardware,
            files=files,
            model_configs=_model_configs(args.model_config),
        )
    )
    if args.json:
        print(json.dumps(json_format.MessageToDict(reply, preserving_proto_field_name=True)))
        return 0
    print(
        f"imported {reply.measurements_imported} measurements on {args.hardware} into "
        f"{len(reply.model_ids)} models: {', '.join(reply.model_ids)}"
    )
    for reason in reply.skipped:
        print(f"skipped {reason}")
    for note in reply.notes:
        print(f"note: {note}")
    return 0


def estimate_record(estimate: estimator_pb.ConfigEstimate, memory_known: bool = True) -> dict:
    """One configuration's estimate as a flat JSON object (``iserve estimate --json``)."""
    config = estimate.config
    return {
        "tp": config.tensor_parallel,
        "pp": config.pipeline_parallel,
        "variant": config.variant_name or "base",  # as the table and `plan --json` say
        "weight_quant": _enum_name(common.WeightQuant, config.weight_quant, "WEIGHT_QUANT_"),
        "kv_quant": _enum_name(common.KvQuant, config.kv_quant, "KV_QUANT_"),
        "pruning": _enum_name(common.Pruning, config.pruning, "PRUNING_"),
        "batch_size": config.batch_size,
        "memory_total_bytes": estimate.memory_total_bytes,
        "memory_per_device_bytes": estimate.memory_per_device_bytes,
        "kv_cache_bytes": estimate.kv_cache_bytes,
        "ttft_ms": estimate.ttft_ms,
        "tpot_ms": estimate.tpot_ms,
        "latency_ms": estimate.latency_ms,
        "cost_memory_latency": estimate.cost_memory_latency,
        "cost_memory": estimate.cost_memory,
        "cost_device_hours": estimate.cost_device_hours,
        "throughput_tokens_per_second_per_device": (
            estimate.throughput_tokens_per_second_per_device
        ),
        "accuracy_score": estimate.accuracy_score if estimate.HasField("accuracy_score") else None,
        # None where the devices' memory is unknown (the reply's true says only that
        # nothing was judged): it read "FITS yes" for 129 GiB a device (a tester).
        "fits_device_memory": estimate.fits_device_memory if memory_known else None,
        "batch_measured": estimate.batch_measured,
        "communication_unprofiled": estimate.communication_unprofiled,
    }


def profiled_hardware(settings: Settings, model_id: str) -> str:
    """The hardware type an ``estimate`` that names none uses: see :func:`only_hardware`."""
    profile = _models(settings).GetProfile(
        model_pb.GetProfileRequest(request_id=_rid(), model_id=model_id)
    )
    return only_hardware(model_id, {m.hardware_type for m in profile.measurements})


def only_hardware(model_id: str, kinds: set[str]) -> str:
    """The one hardware type of ``kinds`` (those ``model_id`` is profiled on); a usage
    error listing them when there are several, or saying there are none."""
    if len(kinds) == 1:
        return next(iter(kinds))
    if not kinds:
        usage_error(
            f"model {model_id!r} is not profiled yet: profile it (`iserve register {model_id} "
            "CHECKPOINT` again, without --skip-profiling) or import measurements (iserve "
            "profile import), then estimate it"
        )
    usage_error(
        f"model {model_id!r} is profiled on {', '.join(sorted(kinds))}: choose one with --hardware"
    )


def estimate_row(r: dict) -> list:
    """One configuration's row of `iserve estimate`'s table, from its
    :func:`estimate_record`."""
    return [
        r["tp"],
        r["pp"],
        r["variant"],
        r["batch_size"],
        gib(r["memory_total_bytes"] / GIB),
        gib(r["memory_per_device_bytes"] / GIB),
        f"{r['ttft_ms']:.1f}",
        f"{r['tpot_ms']:.2f}",
        f"{r['latency_ms'] / 1e3:.3f}",
        f"{r['cost_memory_latency']:.3g}",  # a small model's 0.0117 GB*s read "0.0", as plan's did
        f"{r['throughput_tokens_per_second_per_device']:.2f}",
        "-" if r["accuracy_score"] is None else f"{r['accuracy_score']:.1f}",
        {True: "yes", False: "no", None: "?"}[r["fits_device_memory"]],
    ]


def cmd_estimate(settings: Settings, args) -> int:
    args.hardware = args.hardware or profiled_hardware(settings, args.model_id)
    reply = _estimator(settings).EstimateConfigs(
        estimator_pb.EstimateConfigsRequest(
            request_id=_rid(),
            model_id=args.model_id,
            hardware_type=args.hardware,
            workload=estimator_pb.Workload(
                input_tokens=args.input_len, output_tokens=args.output_len, batch_size=args.batch
            ),
            device_count=args.devices,
            device_memory_bytes=round((args.device_memory or 0) * GIB),
        )
    )
    records = [estimate_record(e, bool(reply.device_memory_bytes)) for e in reply.estimates]
    if args.json:
        for record in records:
            print(json.dumps(record))
        for note in reply.notes:
            print(f"note: {note}", file=sys.stderr)
        return 0
    prompt = (
        f"{args.input_len}-token prompt" if args.input_len else "the default prompt (see the note)"
    )
    memory = (
        f" of {reply.device_memory_bytes / GIB:.3g} GiB"
        if reply.device_memory_bytes
        else " (device memory unknown: give --device-memory)"
    )
    print(
        f"{args.model_id} on {args.hardware}: {len(records)} configurations, {prompt}, "
        f"{args.output_len} output tokens, batch {args.batch or 1}; FITS: what the "
        f"deployer reserves on each device (an even split's largest stage: at least PER DEV) "
        f"within a device{memory}; GB*s per request"
    )
    headers = ["TP", "PP", "VARIANT", "BATCH", "MEMORY GiB", "PER DEV GiB", "TTFT ms"]
    headers += ["TPOT ms", "LATENCY s", "GB*s", "TOK/S/DEV", "ACC %", "FITS"]
    rows = [estimate_row(r) for r in records]
    show_tables([(None, headers, rows)])
    for note in reply.notes:
        print(f"note: {note}")
    return 0


def print_calibration(calibration: estimator_pb.Calibration) -> None:
    terms = dict(calibration.extra_terms)
    print(
        f"{calibration.hardware_type}: fit error {calibration.fit_error_percent:.2f} % "
        "(end-to-end latency MAPE on the fitting data)"
    )
    for prefix, label in (("", ""), ("three_refs.", " (three references only)")):
        for phase in ("ttft", "tpot"):
            if f"{prefix}{phase}.alpha" in terms:
                values = " ".join(
                    f"{name} {terms[f'{prefix}{phase}.{name}']:.3f}"
                    for name in ("alpha", "beta", "gamma", "delta")
                )
                print(f"  {phase.upper()}{label}: {values}")
    if "ttft.alpha" not in terms:
        print(
            f"  alpha {calibration.alpha:.3f} beta {calibration.beta:.3f} "
            f"gamma {calibration.gamma:.3f} delta {calibration.delta:.3f}"
        )
    growth = sorted(
        (name.removeprefix("tpot.batch_growth."), value)
        for name, value in terms.items()
        if name.startswith("tpot.batch_growth.")
    )
    if growth:
        print(
            "  decode's growth per further sequence of a batch (share of the batch-1 TPOT): "
            + ", ".join(f"{key} {value:.4f}" for key, value in growth)
        )
    if "memory.tp_peer_gib" in terms:
        residuals = sum(1 for name in terms if name.startswith("memory.residual_gib."))
        print(
            f"  memory: {terms['memory.tp_peer_gib']:.3f} GiB per TP peer, "
            f"{residuals} layout residuals"
        )
    print(f"  provenance: {calibration.provenance}")


def cmd_calibrate(settings: Settings, args) -> int:
    stub = _estimator(settings)
    if args.show:
        calibration = stub.GetCalibration(
            estimator_pb.GetCalibrationRequest(request_id=_rid(), hardware_type=args.hardware)
        ).calibration
    else:
        models = args.models or []
        calibration = stub.Calibrate(
            estimator_pb.CalibrateRequest(
                request_id=_rid(), hardware_type=args.hardware, model_ids=models
            )
        ).calibration
    if args.json:
        print(json.dumps(json_format.MessageToDict(calibration, preserving_proto_field_name=True)))
    else:
        print_calibration(calibration)
    return 0


def _layout(config: common.DeploymentConfig) -> str:
    return f"{max(1, config.tensor_parallel)}x{max(1, config.pipeline_parallel)}"


def print_profile(profile: model_pb.GetProfileResponse) -> None:
    """A model's stored profile: what it cost, what was skipped, every measurement. A
    figure an imported row does not carry (MaverIQ's rows have no TTFT, TPOT or prompt
    length, and no profiling cost) shows as "-", not as 0."""
    cost = profile.cost
    full = sum(m.full_model for m in profile.measurements)
    imported = sorted({m.source_file for m in profile.measurements if m.source_file})
    took = (
        f"profiling took {cost.wall_time_ms / 1e3:.1f} s wall, {cost.device_seconds:.1f} "
        f"device-s, peak {cost.peak_device_memory_bytes / 2**20:.1f} MiB per device"
        if cost.wall_time_ms > 0
        else "no profiling cost recorded"
    )
    source = f"; imported from {', '.join(imported)}" if imported else ""
    print(
        f"{profile.model_id}: {len(profile.measurements) - full} fingerprint and {full} "
        f"full-model measurements; {took}{source}"
    )
    for reason in profile.skipped:
        print(f"  skipped: {reason}")
    print(
        f"{'variant':<10}{'layers':>7} {'tp x pp':>7}{'batch':>6}{'in':>6}{'out':>5}"
        f"{'TTFT ms':>10}{'TPOT ms':>9}{'total ms':>10}{'layer ms':>16}{'others':>7}"
        "  memory MiB per rank"
    )
    for m in profile.measurements:
        layer = f"{m.ttft_layer_ms:.2f}/{m.tpot_layer_ms:.3f}" if m.tpot_layer_ms > 0 else "-"
        layers = f"{m.num_layers}{'*' if m.full_model else ''}"
        memory = " ".join(f"{b / 2**20:.1f}" for b in m.peak_memory_bytes_per_rank if b)
        others = f"{m.other_cpu_share:.0%}" if m.HasField("other_cpu_share") else "-"
        print(
            f"{m.variant_name or 'base':<10}{layers:>7} {_layout(m.config):>7}"
            f"{max(1, m.config.batch_size):>6}{_known(m.input_tokens, 'd'):>6}"
            f"{m.output_tokens:>5}{_known(m.ttft_ms, '.2f'):>10}{_known(m.tpot_ms, '.3f'):>9}"
            f"{_known(m.latency_ms, '.1f'):>10}{layer:>16}{others:>7}  {memory or '-'}"
        )
    print(
        "layers* = full model; layer ms = one decoder layer in prefill / decode (layer "
        "clock); others = the share of the devices' CPU cores other processes used (CPU "
        f"devices; past {CONTENDED_SHARE:.0%} the runs were slowed); - = not in the row"
    )


def _known(value: float, spec: str) -> str:
    """``value`` formatted, or "-" for 0 (a figure the row does not carry)."""
    return format(value, spec) if value > 0 else "-"


def cmd_profile_show(settings: Settings, args) -> int:
    profile = _models(settings).GetProfile(
        model_pb.GetProfileRequest(request_id=_rid(), model_id=args.model_id)
    )
    if args.json:
        print(json.dumps(json_format.MessageToDict(profile, preserving_proto_field_name=True)))
    else:
        print_profile(profile)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``profile import``/``show``, ``estimate`` and ``calibrate`` to the CLI's
    subcommands."""
    profile = sub.add_parser("profile", help="model profiles").add_subparsers(
        dest="profile_command", required=True, metavar="ACTION"
    )
    p = profile.add_parser(
        "import", help="load measurements taken elsewhere (e.g. MaverIQ's A6000 data) as profiles"
    )
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument(
        "--format", choices=sorted(PROFILE_FORMATS), required=True, help="the files' layout"
    )
    p.add_argument("--hardware", required=True, help="hardware type measured, e.g. rtx-a6000")
    p.add_argument(
        "--model-config",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="the config.json of the model the rows name NAME: its shape, for a model with "
        "no architecture preset (or in place of the preset's); repeatable",
    )
    p.add_argument("--json", action="store_true", help="what was imported, as JSON")
    p.set_defaults(func=cmd_profile_import)
    p = profile.add_parser(
        "show", help="a model's profile: its cost, skipped references and every measurement"
    )
    p.add_argument("model_id")
    p.add_argument("--json", action="store_true", help="the GetProfile reply as JSON")
    p.set_defaults(func=cmd_profile_show)

    p = sub.add_parser("estimate", help="estimate every configuration of a profiled model")
    p.add_argument("model_id")
    p.add_argument(
        "--hardware",
        help="hardware type, e.g. cpu-x86_64 (default: the one the model is profiled on)",
    )
    p.add_argument(
        "--output-len", type=whole_number(), required=True, help="output tokens per request"
    )
    p.add_argument(
        "--input-len",
        type=whole_number(),
        default=0,
        help="prompt tokens (default: the longest prompt profiled that leaves the context "
        "room for the output; a note says which)",
    )
    p.add_argument("--batch", type=whole_number(), default=0, help="batch size (default 1)")
    p.add_argument(
        "--devices",
        type=whole_number(),
        default=0,
        help="devices available (default: the cluster's of that type, or 8)",
    )
    p.add_argument(
        "--device-memory",
        type=device_memory_gib,
        metavar="GIB",
        help="memory of each device, which FITS is judged against (default: the largest "
        "live device of that type, else the hardware calibration's)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per configuration")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser(
        "calibrate", help="fit a hardware type's latency and memory constants on full-model runs"
    )
    p.add_argument("--hardware", required=True, help="hardware type, e.g. rtx-a6000")
    p.add_argument(
        "--models",
        type=id_list,
        help="comma-separated model ids (default: every model with data)",
    )
    p.add_argument("--show", action="store_true", help="show the current calibration, fit nothing")
    p.add_argument("--json", action="store_true", help="the calibration as JSON")
    p.set_defaults(func=cmd_calibrate)
