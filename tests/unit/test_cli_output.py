"""services.cli.output: rich on a terminal, plain aligned text otherwise."""

from __future__ import annotations

import concurrent.futures
import io
from pathlib import Path

import pytest
from rich.console import Console

from services.api import common_pb2 as common
from services.cli import main as cli_main
from services.cli.output import call_showing_status, plain_table, show_tables
from services.settings import TlsFiles

TABLES = [(None, ["NAME", "STATE", "FREE MiB"], [["dep-a", "READY", 512], ["dep-b", "FAILED", 7]])]


def test_plain_text_is_aligned_columns_without_colour_or_boxes(capsys):
    show_tables(TABLES, Console(file=io.StringIO(), force_terminal=False))
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "NAME   STATE   FREE MiB",
        "dep-a  READY   512",
        "dep-b  FAILED  7",
    ]
    assert "\x1b[" not in out
    assert plain_table(["A"], []) == "A"


def test_a_terminal_gets_a_rich_table_with_coloured_states():
    buffer = io.StringIO()
    terminal = Console(file=buffer, force_terminal=True, color_system="standard", width=60)
    show_tables(TABLES, terminal)
    out = buffer.getvalue()
    assert "\x1b[" in out and "─" in out  # colours and box lines
    assert "READY" in out and "FAILED" in out and "dep-b" in out


def test_the_is_the_stack_up_hint_follows_only_a_connection_that_failed():
    from services.cli.main import _unreached

    assert _unreached(
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50064: "
        "Failed to connect to remote host: Connection refused"
    )
    # A service that answered: the hint would send the user looking in the wrong place.
    assert not _unreached("deployment big-1 is STARTING: restart 1 in 1 s after: x")
    assert not _unreached("state store (Redis) unreachable at 127.0.0.1:6379")
    # A service that could not reach its own peer (an agent with a certificate of another
    # CA): the CLI's TLS settings are not the fault (found by a probe).
    assert not _unreached(
        "starting workers of m-1.r2 on node node2: failed to connect to all addresses; "
        "last error: UNKNOWN: ipv4:127.0.0.1:18751: Ssl handshake failed: SSL_ERROR_SSL: "
        "CERTIFICATE_VERIFY_FAILED"
    )


def test_a_call_its_service_ended_midway_is_told_apart_from_a_service_s_answer():
    """gRPC's own words for a server gone mid-call (a probe saw "error: UNAVAILABLE:
    Stream removed (Socket closed)" alone when the deploy service was killed as it
    deployed) get a line saying the service stopped; a service's own UNAVAILABLE
    answer does not."""
    from services.cli.main import _cut_off

    for details in ("Stream removed", "Socket closed", "Cancelling all calls"):
        assert _cut_off(details)
    assert not _cut_off("state store (Redis) unreachable at 127.0.0.1:6379")
    assert not _cut_off("failed to connect to all addresses; last error: UNKNOWN")


_DEVICE = {
    "ref": {"device_id": "cpu0"},
    "kind": "DEVICE_KIND_CPU",
    "total_bytes": "1048576",
    "used_bytes": "0",
    "reserved_bytes": "0",
    "free_bytes": "1048576",
    "load": 0.0,
}


def test_status_lists_a_dead_node_with_when_it_was_last_seen():
    from services.cli.status import status_tables

    device = _DEVICE
    status = {
        "services": {},
        "nodes": [
            {"node_id": "a", "alive": True, "heartbeat_at_unix_ms": "1", "devices": [device]},
            # 2026-11-26 05:00:00 UTC, as MessageToDict writes an int64.
            {"node_id": "b", "heartbeat_at_unix_ms": "1795669200000", "devices": [device]},
            {"node_id": "c", "devices": [device]},
            {
                "node_id": "d",
                "heartbeat_at_unix_ms": "1795669200000",
                "unreachable": "UNAVAILABLE: connection refused",
                "devices": [device],
            },
            {  # its agent stopped cleanly (SIGTERM)
                "node_id": "e",
                "heartbeat_at_unix_ms": "1795669200000",
                "stopped_at_unix_ms": "1795669260000",
                "devices": [device],
            },
        ],
        "models": [],
        "deployments": [],
    }
    [_services, (_title, _headers, rows), *_] = status_tables(status)
    assert [row[0] for row in rows] == [
        "a",
        "b (dead, last seen 2026-11-26 05:00:00 UTC)",
        "c (dead)",
        "d (unreachable: UNAVAILABLE: connection refused)",
        "e (stopped on purpose at 2026-11-26 05:01:00 UTC)",
    ]
    # What a node that no longer heartbeats last measured is not shown as now.
    used, load = _headers.index("USED MiB"), _headers.index("LOAD")
    assert [(row[used], row[load]) for row in rows] == [
        (f"{int(device['used_bytes']) / 2**20:.0f}", f"{float(device['load']):.2f}"),
        ("-", "-"),
        ("-", "-"),
        (f"{int(device['used_bytes']) / 2**20:.0f}", f"{float(device['load']):.2f}"),
        ("-", "-"),
    ]


def test_a_long_unreachable_reason_is_cut_in_the_table_and_whole_in_the_hints():
    """gRPC's whole error filled the NODE column (a probe)."""
    from services.cli.status import CELL_REASON_CHARS, _node_hints, short_reason, status_tables

    grpc_said = (
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.5:50065: "
        "Failed to connect to remote host: Connection refused"
    )
    assert short_reason(grpc_said) == "…Connection refused"
    assert short_reason("UNAVAILABLE: connection refused") == "UNAVAILABLE: connection refused"
    no_clause = "x" * 200
    assert short_reason(no_clause) == "x" * (CELL_REASON_CHARS - 1) + "…"
    node = {"node_id": "n2", "agent_address": "10.0.0.5:50065", "unreachable": grpc_said}
    [_services, (_title, _headers, [row])] = status_tables(
        {"services": {}, "nodes": [{**node, "devices": [_DEVICE]}], "models": [], "deployments": []}
    )
    assert row[0] == "n2 (unreachable: …Connection refused)"
    assert _node_hints([node]) == [
        f"node n2's agent at 10.0.0.5:50065 does not answer the deployer: {grpc_said}"
    ]
    assert _node_hints([{**node, "unreachable": "UNAVAILABLE: connection refused"}]) == []


def test_profile_show_marks_what_an_imported_row_does_not_carry(capsys):
    """MaverIQ's rows carry the latency and memory, not TTFT, TPOT, prompt length or a
    profiling cost: those show as "-" (they printed as 0.00 and "took 0.0 s")."""
    from services.api import model_service_pb2 as model_pb
    from services.cli.estimation import print_profile

    profile = model_pb.GetProfileResponse(model_id="m")
    profile.measurements.add(
        num_layers=1,
        config=common.DeploymentConfig(tensor_parallel=2, pipeline_parallel=1),
        output_tokens=10,
        latency_ms=812.5,
        peak_memory_bytes_per_rank=[3 << 30, 3 << 30],
        source_file="fingerprint_data_collection.csv",
    )
    print_profile(profile)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "m: 1 fingerprint and 0 full-model measurements; no profiling cost recorded; "
        "imported from fingerprint_data_collection.csv"
    )
    assert out[2].split() == ["base", "1", "2x1", "1", "-", "10", "-", "-", "812.5", "-", "-"] + [
        "3072.0",
        "3072.0",
    ]
    # A CPU profile's share of the cores other processes used (unread before: an
    # operator could not see which measurements were slowed).
    profile.measurements[0].other_cpu_share = 0.31
    print_profile(profile)
    assert capsys.readouterr().out.splitlines()[2].split()[10] == "31%"


CA_ONLY = TlsFiles(ca=Path("ca.pem"))
NOT_PRESENTED = TlsFiles(Path("cert.pem"), Path("key.pem"), Path("ca.pem"), client_auth=False)


@pytest.mark.parametrize(
    ("details", "tls", "says"),
    [
        # What gRPC says when nothing listens.
        (
            "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: "
            "Failed to connect to remote host: Connection refused",
            None,
            "is the stack up?",
        ),
        # A plaintext client against a stack serving TLS: the server closes at once.
        (
            "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: "
            "Socket closed",
            None,
            "set ISERVE_TLS_CA",
        ),
        (
            "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: "
            "Socket closed",
            CA_ONLY,
            "ISERVE_TLS_CERT and ISERVE_TLS_KEY too",
        ),
        (
            # Its certificate set, but not presented: ISERVE_TLS_CLIENT_AUTH is off.
            "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: "
            "Socket closed",
            NOT_PRESENTED,
            "ISERVE_TLS_CLIENT_AUTH=on too",
        ),
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Ssl "
            "handshake failed: SSL_ERROR_SSL: CERTIFICATE_VERIFY_FAILED",
            CA_ONLY,
            "TLS handshake",
        ),
        (
            # A TLS client meeting a plaintext server: the bytes back are not TLS.
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls "
            "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:0A00010B:SSL "
            "routines::WRONG_VERSION_NUMBER",
            CA_ONLY,
            "the server does not speak TLS",
        ),
    ],
)
def test_an_unreached_stack_says_what_to_check(details, tls, says):
    assert says in cli_main._unreached_hint(details, tls)


def test_a_rows_id_stays_whole_on_a_narrow_terminal():
    # At COLUMNS=40 an id folded over four lines could not be copied.
    from services.cli.output import rich_table

    out = Console(file=io.StringIO(), width=40, force_terminal=True, color_system=None)
    headers = ["ID", "MODEL", "STATE", "TP", "PP", "ADDRESS"]
    out.print(rich_table(None, headers, [["prof1-c10f7b44", "prof1", "READY", 1, 1, "h:1"]]))
    assert "prof1-c10f7b44" in out.file.getvalue()


def test_estimate_json_names_the_base_variant_as_the_table_and_plan_do():
    from services.api import estimator_service_pb2 as estimator_pb
    from services.cli.estimation import estimate_record

    base = estimator_pb.ConfigEstimate(config=common.DeploymentConfig(tensor_parallel=1))
    named = estimator_pb.ConfigEstimate(config=common.DeploymentConfig(variant_name="int8"))
    assert estimate_record(base)["variant"] == "base"
    assert estimate_record(named)["variant"] == "int8"


def test_estimate_rows_tell_small_costs_apart():
    """A 4-layer model's GB*s read 0.0, 0.1, 0.2 in `iserve estimate` (plan showed 0.0117)."""
    from services.api import estimator_service_pb2 as estimator_pb
    from services.cli.estimation import estimate_record, estimate_row

    rows = [
        estimate_row(estimate_record(estimator_pb.ConfigEstimate(cost_memory_latency=cost)))
        for cost in (0.0117, 0.0123, 1234.5)
    ]
    assert [r[9] for r in rows] == ["0.0117", "0.0123", "1.23e+03"]


def test_fits_is_unknown_where_the_devices_memory_is():
    """129 GiB a device read "FITS yes" on a hardware type of unknown memory (a tester):
    the reply's true says only that nothing was judged."""
    from services.api import estimator_service_pb2 as estimator_pb
    from services.cli.estimation import estimate_record, estimate_row

    big = estimator_pb.ConfigEstimate(memory_per_device_bytes=129 << 30, fits_device_memory=True)
    unknown = estimate_record(big, memory_known=False)
    assert unknown["fits_device_memory"] is None and estimate_row(unknown)[-1] == "?"
    assert estimate_row(estimate_record(big))[-1] == "yes"
    big.fits_device_memory = False
    assert estimate_row(estimate_record(big))[-1] == "no"


def test_plan_rows_show_the_winners_rank_and_what_was_passed_over(capsys):
    """`iserve plan` shows each intent's winner rank and the better-ranked configurations
    skipped, with why, as `iserve deploy` does (it showed neither)."""
    from services.cli.plan import print_rows

    row = {
        "intent": "min-latency", "config": "int4 8x1, batch 1", "devices": 8, "ttft_ms": 1.0,
        "tpot_ms": 2.0, "latency_ms": 300.0, "memory_gib": 40.0, "cost_gb_s": 12.0,
        "accuracy": None, "rank": 2, "note": "",
        "skipped": [{"rank": 1, "config": "int4 4x2, batch 1", "reason": "no room on node0"}],
    }  # fmt: skip
    refused = "RESOURCE_EXHAUSTED: nothing fits " + "x" * 500
    print_rows(
        [
            row,
            {"intent": "min-cost", "error": refused},
            {"intent": "min-memory", "error": refused},
        ]
    )
    out = capsys.readouterr().out
    assert "#2" in next(line for line in out.splitlines() if "min-latency" in line)
    assert "min-latency: skipped #1 int4 4x2, batch 1: no room on node0" in out
    # A long refusal is said once, below the table, for every intent it stopped.
    assert f"min-cost, min-memory: none: {refused}" in out and out.count(refused) == 1
    assert max(len(line) for line in out.splitlines() if refused not in line) < 200


def test_gib_figures_keep_small_models_apart():
    """A tiny model's estimates all read "MEMORY GiB 0.00" (a probe)."""
    from services.cli.output import gib

    assert [gib(x) for x in (50.7049, 1.0, 0.999, 0.02021, 0.00438, 0.0)] == [
        "50.70", "1.00", "0.999", "0.0202", "0.00438", "0.00",
    ]  # fmt: skip


def test_plan_notes_say_each_part_once():
    """Each intent's note repeated the ranking's shared parts ("ranked for rtx-a6000 (8
    devices); 8 configurations do not fit …") before its own (a probe)."""
    from services.cli.plan import note_lines

    shared = "ranked for h (8 devices); 8 configurations do not fit the device memory"
    rows = [
        {"intent": "min-cost", "note": f"{shared}; batch 64: bounded by the cap"},
        {"intent": "min-latency", "note": f"{shared}; batch 1: bounded by 1.5x TTFT"},
        {"intent": "min-device-hours", "note": f"{shared}; batch 39: KV cache"},
        {"intent": "max-throughput", "note": f"{shared}; batch 39: KV cache"},
        {"intent": "min-memory", "note": shared},
        {"intent": "slo", "error": "nothing"},
    ]
    assert note_lines(rows) == [
        shared,
        "min-cost: batch 64: bounded by the cap",
        "min-latency: batch 1: bounded by 1.5x TTFT",
        "min-device-hours, max-throughput: batch 39: KV cache",
    ]
    assert note_lines(rows[:1]) == [rows[0]["note"]]
    assert note_lines([{"intent": "a", "note": ""}]) == []
    # Nothing shared by all: each intent's note whole.
    assert note_lines(rows[:2] + [{"intent": "x", "note": "other"}]) == [
        f"min-cost: {rows[0]['note']}",
        f"min-latency: {rows[1]['note']}",
        "x: other",
    ]


def test_plan_rows_show_the_cost_a_budget_is_compared_with(capsys):
    """With --cost device-hours the table showed GB*s alone, and a small model's
    0.0069 GB*s read 0.0."""
    from services.cli.plan import print_rows

    row = {
        "intent": "cost-slo 0.001", "config": "base 1x1, batch 1", "devices": 1,
        "ttft_ms": 1.0, "tpot_ms": 2.0, "latency_ms": 300.0, "memory_gib": 0.02,
        "cost_gb_s": 0.0069, "cost_gb": 0.023, "cost_device_hours": 8.3e-05,
        "accuracy": None, "rank": 1, "note": "", "skipped": [],
    }  # fmt: skip
    for cost, header, shown in (
        (None, "GB*s", "0.0069"),
        ("memory", "GB", "0.023"),
        ("device-hours", "DEVICE-H", "8.3e-05"),
    ):
        print_rows([row], cost)
        head, line = capsys.readouterr().out.splitlines()[:2]
        assert header in head.split() and shown in line.split(), (head, line)


def test_generate_tells_a_deployment_from_a_model_while_redis_is_down(monkeypatch, tmp_path):
    """The deployer answers UNAVAILABLE while Redis is down, and `iserve generate
    DEPLOYMENT` failed though the scheduler still served it: the id's shape decides."""
    import grpc

    from services.cli import main as cli_main
    from services.settings import load_settings

    class Down(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "state store (Redis) unreachable at 127.0.0.1:6379: Connection refused"

    class Hung(Down):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

    timeouts = []

    class Stub:
        def __init__(self, error):
            self.error = error

        def ListDeployments(self, request, timeout=None):
            timeouts.append(timeout)
            raise self.error()

        def GetDeployment(self, request, timeout=None):
            timeouts.append(timeout)
            raise self.error()

    settings = load_settings({"ISERVE_STATE_DIR": str(tmp_path)})
    # Down, or hung (a frozen Redis held the deployer, and the generation, 31 s; a
    # tester): each call bounded, then the id's shape decides.
    for error in (Down, Hung):
        monkeypatch.setattr(cli_main, "_stub", lambda *_args, e=error: Stub(e))
        assert cli_main._is_deployment(settings, "demo-llama-1a2b3c4d")
        assert not cli_main._is_deployment(settings, "demo-llama")
    assert timeouts and all(0 < t <= cli_main.RESOLVE_TIMEOUT_S for t in timeouts)


def test_generate_by_model_asks_no_question_answered_not_found(monkeypatch, tmp_path):
    """Each `iserve generate MODEL` asked the deployer for a deployment of that id first:
    a NOT_FOUND in its log and call counts every time (a probe)."""
    from services.api import deployment_service_pb2 as deploy_pb
    from services.cli import main as cli_main
    from services.settings import load_settings

    asked = []

    class Stub:
        def ListDeployments(self, request, timeout=None):
            asked.append(("list", request.model_id))
            listed = [deploy_pb.Deployment(deployment_id="m-1a2b3c4d", model_id="m")]
            return deploy_pb.ListDeploymentsResponse(
                deployments=listed if request.model_id == "m" else []
            )

        def GetDeployment(self, request, timeout=None):
            asked.append(("get", request.deployment_id))
            return deploy_pb.GetDeploymentResponse()

    monkeypatch.setattr(cli_main, "_stub", lambda *_args: Stub())
    settings = load_settings({"ISERVE_STATE_DIR": str(tmp_path)})
    assert not cli_main._is_deployment(settings, "m")
    assert asked == [("list", "m")]
    assert cli_main._is_deployment(settings, "m-1a2b3c4d")
    assert asked[1:] == [("list", "m-1a2b3c4d"), ("get", "m-1a2b3c4d")]


@pytest.mark.parametrize("width", [60, 80, 100, 200])
def test_no_value_is_cut_on_a_narrow_terminal(width):
    """At 80 columns `iserve status` folded cells mid-value: a worker address over four
    lines (127./0.0./1:33/507), READY as READ/Y. Too wide for its box, a table drops the
    lines between columns, then falls back to the plain text the terminal wraps."""
    headers = ["DEPLOYMENT", "MODEL", "STATE", "TP", "PP", "BATCH", "WORKER", "TTFT P50/P95 ms"]
    headers += ["MODEL LOAD", "QUEUE"]
    row = ["demo-llama-393d7268", "demo-llama", "READY", 1, 1, 8, "127.0.0.1:33507"]
    row += ["12.5/40.1", "idle", 0]
    out = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
    show_tables([("Deployments", headers, [row, row]), ("Nodes", ["NODE"], [["node0"]])], out)
    text = out.file.getvalue()
    for value in [*headers, *map(str, row)]:
        assert value in text, (width, value, text)
    # No line wider than the terminal (wrapped, a table read as noise); a blank line
    # between tables.
    assert max(map(len, text.splitlines())) <= width, text
    lines = [line.strip() for line in text.splitlines()]
    assert lines[lines.index("Nodes") - 1] == "", text


def test_a_long_list_in_a_narrow_terminal_goes_on_after_a_comma():
    """At 80 columns one device's DEPLOYMENTS was a 111-character line the terminal
    wrapped mid-id; the list now goes on under the value, ids whole."""
    ids = [f"tiny-{i:08x}" for i in range(8)]
    headers = ["DEVICE", "MEMORY MiB", "FREE MiB", "LOAD", "DEPLOYMENTS"]
    row = ["node0/cpu0", "2048", "1024", "0.53", ",".join(ids)]
    out = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    show_tables([(None, headers, [row, row, row, row, row, row, row, row])], out)
    text = out.file.getvalue()
    assert max(map(len, text.splitlines())) <= 80, text
    for deployment in ids:
        assert deployment in text, text
    assert "".join(
        line.strip() for line in text.split("DEPLOYMENTS")[1].split("\n\n")[0].splitlines()
    ) == ",".join(ids)


def test_status_watch_puts_the_deployments_first():
    """On a 24-line terminal `status --watch` never showed the deployments table: the
    services, devices and models above it filled the screen (a probe)."""
    from services.cli.status import status_tables

    status = {
        "services": {"model": {"address": "a", "serving": True, "metrics": "m"}},
        "nodes": [],
        "models": [{"model_id": "m", "state": "MODEL_STATE_REGISTERED", "checkpoint_path": "m"}],
        "deployments": [
            {"deployment_id": "m-1", "model_id": "m", "state": "DEPLOYMENT_STATE_READY"}
        ],
    }
    firsts = [headers[0] for _title, headers, _rows in status_tables(status)]
    assert firsts == ["SERVICE", "MODEL", "DEPLOYMENT"]
    watched = [headers[0] for _title, headers, _rows in status_tables(status, watching=True)]
    assert watched == ["DEPLOYMENT", "SERVICE", "MODEL"]


def test_status_watch_leaves_out_steady_columns_rather_than_folding_rows():
    """On a 100-column terminal `status --watch` turned each deployment into a block of
    eleven lines, so a 24-line screen showed two of five deployments (a probe). It leaves
    out the columns that do not change (worker address, sizes, layout), says which, and
    keeps one line per deployment with the figures watched."""
    from services.cli.output import narrowed, renderable
    from services.cli.status import WATCH_OPTIONAL, status_tables

    serving = {"requests_waiting": 3, "requests_running": 8, "requests_completed": 10}
    serving |= {"ttft_p50_ms": 123.4, "ttft_p95_ms": 456.7, "slo_attained": 9, "slo_missed": 1}
    deployments = [
        {
            "deployment_id": f"demo-llama-{i:08x}",
            "model_id": "demo-llama",
            "state": "DEPLOYMENT_STATE_READY",
            "config": {"tensor_parallel": 2, "pipeline_parallel": 1, "batch_size": 8},
            "worker_address": f"127.0.0.1:{40000 + i}",
            "serving": serving,
        }
        for i in range(5)
    ]
    status = {
        "services": {"model": {"address": "127.0.0.1:50061", "serving": True, "metrics": "m"}},
        "nodes": [],
        "models": [],
        "deployments": deployments,
    }
    for width, kept in ((100, 10), (80, 6)):
        out = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
        out.print(renderable(status_tables(status, watching=True), out, WATCH_OPTIONAL))
        text = out.file.getvalue()
        assert max(map(len, text.splitlines())) <= width, text
        rows = [line for line in text.splitlines() if "demo-llama-0000000" in line]
        assert len(rows) == 5, text  # a line each, not a block each
        assert all("123.4/456.7" in row and "90.0% of 10" in row for row in rows), text
        assert f"left out at {width} columns: WORKER" in text, text
        # Said under the deployments, first on the screen, not after every table.
        assert text.index("left out at") < text.index("SERVICE"), text
        (table,) = [t for t in status_tables(status) if t[1][0] == "DEPLOYMENT"]
        assert len(narrowed(table, width, WATCH_OPTIONAL)[0][1]) == kept
    # Wide enough, nothing is left out (nor said to be).
    out = Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None)
    out.print(renderable(status_tables(status, watching=True), out, WATCH_OPTIONAL))
    assert "127.0.0.1:40004" in out.file.getvalue()
    assert "left out" not in out.file.getvalue()


@pytest.mark.parametrize("width", [60, 80, 120])
def test_the_profiling_bar_keeps_its_count_and_times_on_a_narrow_terminal(width):
    """At 80 columns a long job's text ("measuring again: other processes slowed its
    runs") squeezed the bar, the n/N count and the elapsed time out (a probe); the time
    left was never shown."""
    import io
    import re

    from rich.console import Console
    from rich.progress import Progress

    from services.cli.main import fitted, profiling_columns

    job = (
        "profiling base fingerprint(1 layer) tp=1 pp=2 batch=2 (measuring again: other "
        "processes slowed its runs)"
    )
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, color_system=None)
    with Progress(*profiling_columns(), console=console, auto_refresh=False) as bar:
        task = bar.add_task(fitted(job, width), total=15, state="profiling")
        bar.update(task, completed=12)
        bar.refresh()
    line = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.getvalue()).strip().split("\r")[-1]
    assert "12/15" in line and "0:00:0" in line and "--:--" in line, line
    assert line.startswith("profiling ━") and "profili" in line.split("--:--")[1], line
    assert len(line.rstrip()) <= width, line


def test_status_names_an_older_iserve_that_lacks_a_call(tmp_path):
    """The new CLI against a stack still running an older iserve said only
    "UNIMPLEMENTED: Method not found!" (a tester upgrading in place)."""
    import grpc

    from services.cli.status import _asked
    from services.settings import load_settings

    class Unimplemented(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNIMPLEMENTED

        def details(self):
            return "Method not found!"

    def call(channel):
        raise Unimplemented()

    settings = load_settings({"ISERVE_STATE_DIR": str(tmp_path)})
    status = {
        "services": {"scheduler": {"serving": True}},
        "errors": [],
        "hints": [],
        "not_shown": [],
        "healthy": True,
    }
    assert _asked(settings, status, "scheduler", "serving stats", call) is None
    assert status["errors"] == ["scheduler: serving stats: UNIMPLEMENTED: Method not found!"]
    assert status["hints"] == [
        f"scheduler at {settings.address('scheduler')} has no serving stats call: it is an "
        "older iserve than this one; `iserve down` (with this iserve), then `iserve up` runs "
        "this version on the same state"
    ]
    assert not status["healthy"]
    # The stack recorded the scheduler elsewhere: the address names another service.
    (tmp_path / "stack.json").write_text('{"addresses": {"scheduler": "127.0.0.1:1"}}')
    status["hints"] = []
    _asked(settings, status, "scheduler", "serving stats", call)
    assert status["hints"] == [
        f"scheduler at {settings.address('scheduler')} has no serving stats call, and the "
        f"stack in {tmp_path} recorded scheduler at 127.0.0.1:1: ISERVE_SCHEDULER_ADDR names "
        "another service"
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Call:
    """A unary method of a blocking stub, its answer set by the test (pure logic: how
    the CLI waits on a call, not the call)."""

    def __init__(self) -> None:
        self.future_ = concurrent.futures.Future()
        self.blocking = []

    def __call__(self, request):
        self.blocking.append(request)
        return "answered"

    def future(self, request):
        return self.future_


def test_a_call_waited_on_a_terminal_shows_its_status_until_it_ends() -> None:
    call, asked = _Call(), []

    def describe(elapsed: float) -> str:
        asked.append(elapsed)
        if len(asked) == 3:
            call.future_.set_result("done")
        return f"waiting {len(asked)}"

    buffer = _Terminal()
    err = Console(file=buffer, force_terminal=True, color_system=None, width=80)
    assert call_showing_status(call, "req", err, describe, poll_s=0.01) == "done"
    assert asked[0] == 0.0 and asked[1:] == sorted(asked[1:]) and len(asked) == 3
    assert "waiting " in buffer.getvalue() and call.blocking == []
    # Not a terminal: the plain blocking call, nothing drawn; nor where only FORCE_COLOR
    # (force_terminal) makes rich take a file for one.
    for out in (Console(file=io.StringIO()), Console(file=io.StringIO(), force_terminal=True)):
        call.blocking.clear()
        assert call_showing_status(call, "req", out, describe) == "answered"
        assert call.blocking == ["req"] and out.file.getvalue() == ""


def test_a_call_waited_on_a_terminal_raises_its_error_and_ctrl_c_cancels_it() -> None:
    failing = _Call()
    failing.future_.set_exception(RuntimeError("refused"))
    err = Console(file=_Terminal(), force_terminal=True, color_system=None)
    with pytest.raises(RuntimeError, match="refused"):
        call_showing_status(failing, "req", err, lambda _: "waiting", poll_s=0.01)
    interrupted = _Call()

    def ctrl_c(elapsed: float) -> str:
        if elapsed > 0:
            raise KeyboardInterrupt
        return "waiting"

    with pytest.raises(KeyboardInterrupt):
        call_showing_status(interrupted, "req", err, ctrl_c, poll_s=0.01)
    assert interrupted.future_.cancelled()


def test_the_deploy_status_line_names_the_replicas_and_their_devices() -> None:
    from services.api import deployment_service_pb2 as deploy_pb
    from services.cli.deploying import starting_text

    deployment = deploy_pb.Deployment(
        state=deploy_pb.DEPLOYMENT_STATE_STARTING,
        config=common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1, batch_size=1),
    )
    for device in ("cpu0", "cpu1"):
        replica = deployment.replicas.add()
        replica.placement.stages.add().devices.add(node_id="node0", device_id=device)
    assert starting_text(deployment) == (
        "starting tp=1 pp=1 batch=1, 2 replicas on node0/cpu0, node0/cpu1"
    )
    del deployment.replicas[1]
    assert starting_text(deployment) == "starting tp=1 pp=1 batch=1 on node0/cpu0"
