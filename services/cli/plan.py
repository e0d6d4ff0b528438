"""``iserve plan``: what each intent would deploy, and the latency–memory Pareto front.

Against the live cluster, or, with ``--hardware HW --devices N [--device-memory GIB]``,
against N idle simulated devices of a hardware type the model is profiled on (the
deployer's PlanDeployment takes simulated devices; nothing is launched). One
PlanDeployment per intent gives the table; the estimator's EstimateConfigs gives every
configuration for the plot (``--png``, drawn with matplotlib's non-interactive Agg
backend): latency against memory, the Pareto front (no configuration both faster and
smaller) and each intent's choice marked and labelled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from pathlib import Path

import grpc

from services import transport
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import (
    deployment_service_pb2_grpc,
    estimator_service_pb2_grpc,
    model_service_pb2_grpc,
)
from services.api import estimator_service_pb2 as estimator_pb
from services.api import model_service_pb2 as model_pb
from services.cli import deploying
from services.cli.arguments import (
    add_token_limits,
    device_memory_gib,
    positive_number,
    usage_error,
    whole_number,
)
from services.cli.output import gib, show_tables
from services.settings import Settings
from services.simulation import MAX_SIMULATED_DEVICES, simulated_devices
from services.token_limits import token_limits

GIB = float(1 << 30)
# Every intent of `iserve deploy --intent` that needs no target; the SLO ones are planned
# when their target is given (--slo-ms, --budget).
INTENTS = {name: kind for name, kind in deploying.INTENTS.items() if not name.endswith("-slo")}


def intents_of(args) -> list[tuple[str, common.Intent]]:
    """(row name, Intent) per intent to plan: every intent without a target, then
    latency-slo and cost-slo when their targets are given; each with the accuracy floor
    and, where the intent ranks by cost, the cost formula."""
    kinds = list(INTENTS.items())
    if args.slo_ms is not None:
        kinds.append((f"latency-slo {args.slo_ms:g} ms", common.INTENT_KIND_LATENCY_SLO))
    if args.budget is not None:
        kinds.append((f"cost-slo {args.budget:g}", common.INTENT_KIND_COST_SLO))
    return [(name, deploying.intent_for(kind, args, "iserve plan")) for name, kind in kinds]


def short_config(config: common.DeploymentConfig) -> str:
    """``variant tp x pp, batch b`` (the variant names its quantization and pruning)."""
    return (
        f"{config.variant_name or 'base'} {config.tensor_parallel}x{config.pipeline_parallel}"
        f", batch {config.batch_size or 1}"
    )


def _rid() -> str:
    return uuid.uuid4().hex[:16]


def plan_intents(settings: Settings, args) -> list[dict]:
    """One row per intent: its decision, or why there is none."""
    stub = deployment_service_pb2_grpc.DeploymentServiceStub(
        transport.sync_channel(settings.address("deploy"))
    )
    devices = (
        simulated_devices(args.hardware, args.devices, args.device_memory) if args.hardware else []
    )
    rows = []
    for name, intent in intents_of(args):
        request = deploy_pb.PlanDeploymentRequest(
            request_id=_rid(),
            model_id=args.model_id,
            max_input_tokens=args.max_input,
            max_output_tokens=args.max_output,
            intent=intent,
            batch_size=args.batch,
            devices=devices,
        )
        try:
            decision = stub.PlanDeployment(request, timeout=120).decision
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise  # the same for every intent: the model or the request is wrong
            rows.append({"intent": name, "error": f"{exc.code().name}: {exc.details()}"})
            continue
        e = decision.estimate
        rows.append(
            {
                "intent": name,
                "config": short_config(decision.config),
                "tp": decision.config.tensor_parallel,
                "pp": decision.config.pipeline_parallel,
                "variant": decision.config.variant_name or "base",
                "batch": decision.config.batch_size,
                "devices": sum(len(s.devices) for s in decision.placement.stages),
                "ttft_ms": e.ttft_ms,
                "tpot_ms": e.tpot_ms,
                "latency_ms": e.latency_ms,
                "memory_gib": e.memory_total_bytes / GIB,
                "cost_gb_s": e.cost_memory_latency,
                "cost_gb": e.cost_memory,
                "cost_device_hours": e.cost_device_hours,
                "accuracy": e.accuracy_score if e.HasField("accuracy_score") else None,
                # Where the winner stood in the intent's ranking, and the better-ranked
                # configurations passed over, with why (as `iserve deploy` prints them).
                "rank": decision.winner_rank,
                "skipped": [
                    {"rank": k.rank, "config": short_config(k.config), "reason": k.reason}
                    for k in decision.skipped
                ],
                "note": decision.note,
            }
        )
    return rows


# --cost -> (the rows' key, the column's header): the cost a budget is compared with.
COST_COLUMNS = {
    "memory-latency": ("cost_gb_s", "GB*s"),
    "memory": ("cost_gb", "GB"),
    "device-hours": ("cost_device_hours", "DEVICE-H"),
}


def print_rows(rows: list[dict], cost: str | None = None) -> None:
    """The table of ``rows``; its cost column is ``cost``'s formula (--cost)."""
    key, header = COST_COLUMNS[cost or "memory-latency"]
    headers = ["INTENT", "RANK", "CONFIG (variant tp x pp)", "DEV", "TTFT ms", "TPOT ms"]
    headers += ["LATENCY s", "MEMORY GiB", header, "ACC %"]
    table = []
    for r in rows:
        if "error" in r:
            # The reason below the table: one of hundreds of characters padded the header.
            table.append([r["intent"], "", "none (see below)", "", "", "", "", "", "", ""])
            continue
        table.append(
            [
                r["intent"],
                f"#{r['rank']}" if r["rank"] else "",
                r["config"],
                r["devices"],
                f"{r['ttft_ms']:.1f}",
                f"{r['tpot_ms']:.2f}",
                f"{r['latency_ms'] / 1e3:.3f}",
                gib(r["memory_gib"]),
                f"{r[key]:.3g}",  # a small model's 0.0069 GB*s read "0.0"
                "-" if r["accuracy"] is None else f"{r['accuracy']:.1f}",
            ]
        )
    show_tables([(None, headers, table)])
    failed: dict[str, list[str]] = {}
    for r in rows:
        if "error" in r:
            failed.setdefault(r["error"], []).append(r["intent"])
    for error, intents in failed.items():
        print(f"{', '.join(intents)}: none: {error}")
    for r in rows:
        for k in r.get("skipped", ()):
            print(f"{r['intent']}: skipped #{k['rank']} {k['config']}: {k['reason']}")
    for note in note_lines(rows):
        print(f"note: {note}")


def note_lines(rows: list[dict]) -> list[str]:
    """The deployer's notes of ``rows``, each part (they are "; "-joined) said once: the
    parts every intent's note has on one line, the rest after the intents they are of.
    Each intent's note repeated the shared parts, a paragraph on CPU models (a probe)."""
    parts = {r["intent"]: [p for p in r["note"].split("; ") if p] for r in rows if r.get("note")}
    shared = [
        p
        for p in dict.fromkeys(p for ps in parts.values() for p in ps)
        if all(p in ps for ps in parts.values())
    ]
    lines = ["; ".join(shared)] if shared else []
    rests: dict[str, list[str]] = {}
    for intent, ps in parts.items():
        rest = "; ".join(p for p in ps if p not in shared)
        if rest:
            rests.setdefault(rest, []).append(intent)
    return lines + [f"{', '.join(intents)}: {rest}" for rest, intents in rests.items()]


def token_limits_of(settings: Settings, args) -> tuple[int, int]:
    """(input, output) tokens the deployer takes for this request: the user's limits, or
    its defaults for the model's context (``services.token_limits``)."""
    stub = model_service_pb2_grpc.ModelServiceStub(
        transport.sync_channel(settings.address("model"))
    )
    model = stub.GetModel(model_pb.GetModelRequest(model_id=args.model_id), timeout=30).model
    return token_limits(args.max_input, args.max_output, model.shape.max_position_embeddings)


def all_estimates(
    settings: Settings, args, hardware: str, limits: tuple[int, int]
) -> list[estimator_pb.ConfigEstimate]:
    stub = estimator_service_pb2_grpc.EstimatorServiceStub(
        transport.sync_channel(settings.address("estimator"))
    )
    reply = stub.EstimateConfigs(
        estimator_pb.EstimateConfigsRequest(
            request_id=_rid(),
            model_id=args.model_id,
            hardware_type=hardware,
            workload=estimator_pb.Workload(
                input_tokens=limits[0],
                output_tokens=limits[1],
                batch_size=args.batch or 1,
            ),
            device_count=args.devices or 0,
            device_memory_bytes=int(args.device_memory * GIB) if args.hardware else 0,
        ),
        timeout=120,
    )
    return list(reply.estimates)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (smaller is better),
    sorted by the first coordinate."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def write_png(path: Path, title: str, estimates, rows: list[dict], fits) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --png needs matplotlib (pip install 'iserve[plot]')") from None
    points = [(e.memory_total_bytes / GIB, e.latency_ms / 1e3) for e in estimates]
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    fit = [p for p, ok in zip(points, fits, strict=True) if ok]
    unfit = [p for p, ok in zip(points, fits, strict=True) if not ok]
    if unfit:
        ax.scatter(*zip(*unfit, strict=True), s=12, c="lightgray", label="does not fit the devices")
    if fit:
        ax.scatter(*zip(*fit, strict=True), s=14, c="tab:blue", alpha=0.6, label="configuration")
        front = pareto_front(fit)
        ax.plot(
            [fit[i][0] for i in front],
            [fit[i][1] for i in front],
            c="tab:orange",
            lw=1.5,
            marker="o",
            ms=4,
            label="Pareto front (latency, memory)",
        )
    chosen: dict[str, list[dict]] = {}
    for r in rows:
        if "error" not in r:
            chosen.setdefault(r["config"], []).append(r)
    for n, (config, same) in enumerate(chosen.items()):
        x, y = same[0]["memory_gib"], same[0]["latency_ms"] / 1e3
        ax.scatter([x], [y], s=110, marker="*", c="tab:red", zorder=3)
        ax.annotate(
            f"{', '.join(r['intent'] for r in same)}: {config}",
            (x, y),
            textcoords="offset points",
            xytext=(12, 16 + 16 * (n % 3)),
            fontsize=8,
            arrowprops={"arrowstyle": "-", "color": "tab:red", "lw": 0.6},
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85},
        )
    ax.set_xlabel("memory, all devices (GiB)")
    ax.set_ylabel("latency per request (s)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center")
    fig.tight_layout()
    # "tight": the figure grows to hold a label that reaches past the axes (a long list
    # of intents was cut at the right edge).
    fig.savefig(path, format="png", bbox_inches="tight")  # at the name given, as given
    plt.close(fig)


def cmd_plan(settings: Settings, args) -> int:
    if args.hardware and not args.devices:
        usage_error("--hardware needs --devices N (how many simulated devices)")
    if args.devices and not args.hardware:
        usage_error("--devices N counts simulated devices: give --hardware too")
    if args.device_memory is not None and not args.hardware:
        usage_error("--device-memory describes simulated devices: give --hardware too")
    if args.hardware and args.device_memory is None:
        usage_error("--hardware needs --device-memory GIB (each simulated device's memory)")
    if args.png:
        # matplotlib took the name's suffix for the format, added ".png" to a name with
        # none, and wrote "/tmp.png" for the directory /tmp, each reported as the name
        # given (a tester).
        png = Path(args.png)
        if png.is_dir() or args.png.endswith(os.sep):
            usage_error(f"--png {args.png} is a directory: name the file, e.g. {png / 'plan.png'}")
        if png.suffix and png.suffix.lower() != ".png":
            usage_error(f"--png writes a PNG image: name a .png file, not {png.name}")
        if not png.parent.is_dir():  # said "[Errno 2] No such file or directory" at the end
            usage_error(f"--png {args.png}: there is no directory {png.parent}")
        if not os.access(png.parent, os.W_OK):  # before the plan, not after it
            usage_error(f"--png {args.png}: the directory {png.parent} is not writable")
    rows = plan_intents(settings, args)
    limits = token_limits_of(settings, args)
    where = (
        f"{args.devices} simulated {args.hardware} ({args.device_memory:g} GiB each)"
        if args.hardware
        else "the live cluster"
    )
    if args.json:
        print(json.dumps({"model_id": args.model_id, "devices": where, "intents": rows}))
    else:
        print(f"{args.model_id} on {where}: input {limits[0]}, output {limits[1]} tokens")
        print_rows(rows, args.cost)
    if args.png:
        hardware = args.hardware or _live_hardware(settings)
        estimates = all_estimates(settings, args, hardware, limits)
        fits = [e.fits_device_memory for e in estimates]  # as the deployer reserves
        write_png(
            Path(args.png),
            f"{args.model_id} on {where}: {len(estimates)} configurations at batch "
            f"{args.batch or 1}, output {limits[1]} tokens"
            + ("" if args.batch else "\n(each intent's choice at the batch a deploy sizes it to)"),
            estimates,
            rows,
            fits,
        )
        print(f"wrote {args.png}", file=sys.stderr)
    return 0 if any("error" not in r for r in rows) else 1


def _live_hardware(settings: Settings) -> str:
    stub = deployment_service_pb2_grpc.DeploymentServiceStub(
        transport.sync_channel(settings.address("deploy"))
    )
    state = stub.GetClusterState(deploy_pb.GetClusterStateRequest(), timeout=30)
    kinds = sorted({d.hardware_type for n in state.nodes for d in n.devices})
    if not kinds:
        raise SystemExit(
            "error: the cluster has no devices; plan against --hardware HW --devices N"
        )
    return kinds[0]


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="what each intent would deploy (live cluster or simulated devices), "
        "and a PNG of the latency-memory Pareto front",
    )
    p.add_argument("model_id")
    p.add_argument("--hardware", help="plan on simulated idle devices of this hardware type")
    p.add_argument(
        "--devices",
        type=whole_number(1, MAX_SIMULATED_DEVICES),
        default=0,
        help=f"how many simulated devices (at most {MAX_SIMULATED_DEVICES})",
    )
    p.add_argument(
        "--device-memory",
        type=device_memory_gib,
        metavar="GIB",
        help="memory of each simulated device, GiB (1 MiB to 1 PiB)",
    )
    add_token_limits(
        p,
        "longest prompt (default: Deploy's, 512, or 2/3 of a shorter context)",
        "longest generation (default: Deploy's, 256, or 1/3 of a shorter context)",
    )
    p.add_argument(
        "--batch",
        type=whole_number(),
        default=0,
        help="batch size to plan at (default: as `iserve deploy` without --batch sizes it, "
        "the largest whose TPOT stays within the objective or 1.5x batch 1's)",
    )
    p.add_argument(
        "--slo-ms",
        type=positive_number,
        help="also plan latency-slo: this latency target at --max-output",
    )
    p.add_argument(
        "--budget",
        type=positive_number,
        help="also plan cost-slo: this cost budget in the --cost unit",
    )
    p.add_argument(
        "--cost",
        choices=sorted(deploying.COST_FORMULAS),
        help="cost formula for min-cost, cost-slo and latency-slo (default memory-latency)",
    )
    p.add_argument(
        "--min-accuracy", type=float, help="accuracy floor over the variants' scores, every intent"
    )
    p.add_argument(
        "--best-available",
        action="store_true",
        help="when no variant meets --min-accuracy, take the most accurate instead of failing",
    )
    p.add_argument("--png", help="write the latency-memory plot here")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=cmd_plan)
