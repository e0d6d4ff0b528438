"""How ``iserve register`` draws profiling progress."""

from __future__ import annotations

from services.api import model_service_pb2 as model_pb
from services.cli.main import build_parser, render_progress


def test_progress_bar_counts_runs_and_names_the_current_one():
    event = model_pb.WatchModelResponse(
        state=model_pb.MODEL_STATE_PROFILING,
        runs_done=3,
        runs_total=12,
        current="base fingerprint(2 layers) tp=1 pp=1 batch=2",
    )
    assert render_progress(event, width=12) == (
        "[###.........] 3/12 profiling: base fingerprint(2 layers) tp=1 pp=1 batch=2"
    )
    done = model_pb.WatchModelResponse(
        state=model_pb.MODEL_STATE_PROFILED, runs_done=12, runs_total=12, message="profiled"
    )
    assert render_progress(done, width=4) == "[####] 12/12 profiled"
    done.message = "profiled: 60 measurements, 0 skipped, 41.2 device-seconds"
    assert render_progress(done, width=4) == (
        "[####] 12/12 profiled: 60 measurements, 0 skipped, 41.2 device-seconds"
    )
    assert render_progress(model_pb.WatchModelResponse(), width=2) == "[..] 0/0 unspecified"
    # A job run again says so (it read as a first run, the total grown for no reason).
    again = model_pb.WatchModelResponse(
        state=model_pb.MODEL_STATE_PROFILING,
        runs_done=12,
        runs_total=17,
        current="base fingerprint(1 layer) tp=1 pp=1 batch=2",
        message="measuring again: other processes slowed its runs",
    )
    assert render_progress(again, width=4) == (
        "[##..] 12/17 profiling: base fingerprint(1 layer) tp=1 pp=1 batch=2 "
        "(measuring again: other processes slowed its runs)"
    )
    again.message = "running"
    assert render_progress(again, width=4).endswith("tp=1 pp=1 batch=2")


def test_register_waits_unless_told_not_to():
    parser = build_parser()
    assert not parser.parse_args(["register", "m", "ckpt"]).no_wait
    args = parser.parse_args(["register", "m", "ckpt", "--no-wait", "--skip-profiling"])
    assert args.no_wait and args.skip_profiling
