"""services.replicas and the replica ids of services.ids (pure logic)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler_svc.routing import describe_state
from services import replicas
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.errors import InvalidArgument
from services.ids import TOKEN_PATTERN, replica_group_id, split_group_id

READY = deploy_pb.DEPLOYMENT_STATE_READY
FAILED = deploy_pb.DEPLOYMENT_STATE_FAILED
STARTING = deploy_pb.DEPLOYMENT_STATE_STARTING


def _placement(device_id: str) -> common.Placement:
    return common.Placement(
        stages=[
            common.StagePlacement(
                stage=0,
                layer_count=2,
                devices=[common.DeviceRef(node_id="node0", device_id=device_id)],
                reserved_bytes=[1 << 20],
            )
        ]
    )


def _deployment(count: int, state: int = READY) -> deploy_pb.Deployment:
    dep = deploy_pb.Deployment(
        deployment_id="m-0a1b2c3d",
        state=state,
        placement=_placement("cpu0"),
        worker_address="127.0.0.1:5000",
    )
    for i in range(count):
        dep.replicas.add(
            index=i, placement=_placement(f"cpu{i}"), worker_address=f"127.0.0.1:{5000 + i}",
            state=state,
        )  # fmt: skip
    return dep


def test_every_replica_of_a_ready_deployment_serves():
    dep = _deployment(3)
    assert [r.index for r in replicas.serving(dep)] == [0, 1, 2]
    assert replicas.serving(_deployment(3, STARTING)) == []


def test_a_record_from_before_replicas_is_one_replica():
    dep = _deployment(0)
    [only] = replicas.replicas_of(dep)
    assert (only.index, only.worker_address, only.state) == (0, "127.0.0.1:5000", READY)
    assert only.placement == dep.placement
    assert [r.index for r in replicas.serving(dep)] == [0]
    # Taking out its only replica is failing the deployment: the record is not touched.
    assert not replicas.take_out(dep, 0, "gone")
    assert dep == _deployment(0)


def test_take_out_keeps_the_others_and_repoints_the_record():
    dep = _deployment(3)
    assert replicas.take_out(dep, 0, "worker rank 0 exited (-9)")
    assert [r.index for r in replicas.serving(dep)] == [1, 2]
    out = dep.replicas[0]
    assert (out.state, out.state_reason) == (FAILED, "worker rank 0 exited (-9)")
    assert out.worker_address == ""  # no worker of it answers there any more
    # The record's own placement and address are the first replica still serving.
    assert dep.worker_address == "127.0.0.1:5001"
    assert dep.placement == _placement("cpu1")
    assert dep.state == READY
    assert replicas.take_out(dep, 2, "gone")
    assert [r.index for r in replicas.serving(dep)] == [1]
    assert dep.worker_address == "127.0.0.1:5001"


def test_the_last_replica_is_not_taken_out():
    dep = _deployment(2)
    assert replicas.take_out(dep, 1, "gone")
    before = deploy_pb.Deployment()
    before.CopyFrom(dep)
    assert not replicas.take_out(dep, 0, "gone too")
    assert dep == before  # unchanged: the caller fails the whole deployment


def test_fail_all_marks_what_still_serves():
    dep = _deployment(2)
    replicas.take_out(dep, 0, "first")
    replicas.fail_all(dep, "second")
    assert [(r.state, r.state_reason, r.worker_address) for r in dep.replicas] == [
        (FAILED, "first", ""),
        (FAILED, "second", ""),
    ]
    assert dep.worker_address == ""  # it named the dead worker of the last replica


def test_nodes_of_a_placement_are_sorted_and_unique():
    placement = common.Placement(
        stages=[
            common.StagePlacement(
                devices=[
                    common.DeviceRef(node_id="b", device_id="cpu0"),
                    common.DeviceRef(node_id="a", device_id="cpu0"),
                ]
            ),
            common.StagePlacement(devices=[common.DeviceRef(node_id="b", device_id="cpu1")]),
        ]
    )
    assert replicas.nodes_of(placement) == ["a", "b"]


@pytest.mark.parametrize(("requested", "count"), [(0, 1), (1, 1), (2, 2), (16, 16)])
def test_replica_counts(requested, count):
    replicas.check_count(requested)
    assert replicas.count_of(requested) == count


def test_more_than_sixteen_replicas_is_invalid():
    with pytest.raises(InvalidArgument, match="^replicas must be at most 16, got 17$"):
        replicas.check_count(17)


def test_group_ids():
    assert replica_group_id("m-0a1b2c3d", 0) == "m-0a1b2c3d"
    assert replica_group_id("m-0a1b2c3d", 3) == "m-0a1b2c3d.r3"
    assert split_group_id("m-0a1b2c3d.r3") == ("m-0a1b2c3d", 3)
    assert split_group_id("m-0a1b2c3d") == ("m-0a1b2c3d", 0)
    # Not replica suffixes: index 0 is never written, and leading zeros are not an index.
    assert split_group_id("m-0a1b2c3d.r0") == ("m-0a1b2c3d.r0", 0)
    assert split_group_id("m-0a1b2c3d.r01") == ("m-0a1b2c3d.r01", 0)
    assert split_group_id("profile-m-1") == ("profile-m-1", 0)
    with pytest.raises(ValueError, match="never negative"):
        replica_group_id("m-0a1b2c3d", -1)


# Deployment ids as the deployer makes them: "<model id>-<8 hex digits>".
_model_ids = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,40}", fullmatch=True)
_deployment_ids = st.builds(
    lambda model, suffix: f"{model}-{suffix}",
    _model_ids,
    st.from_regex(r"[0-9a-f]{8}", fullmatch=True),
)


@given(deployment_id=_deployment_ids, index=st.integers(0, 10_000))
def test_group_ids_round_trip(deployment_id, index):
    group = replica_group_id(deployment_id, index)
    assert split_group_id(group) == (deployment_id, index)
    assert TOKEN_PATTERN.fullmatch(group)  # still a valid key part


@given(
    deployment_id=_deployment_ids,
    first=st.integers(0, 16),
    second=st.integers(0, 16),
)
def test_group_ids_of_different_replicas_differ(deployment_id, first, second):
    same = replica_group_id(deployment_id, first) == replica_group_id(deployment_id, second)
    assert same == (first == second)


def test_avoiding_leaves_out_replicas_at_gone_addresses_in_a_copy():
    dep = _deployment(3)
    gone = {dep.replicas[0].worker_address}
    routed = replicas.avoiding(dep, gone)
    assert [r.index for r in replicas.serving(routed)] == [1, 2]
    assert routed.worker_address == dep.replicas[1].worker_address
    assert [r.index for r in replicas.serving(dep)] == [0, 1, 2]  # the record is untouched


def test_avoiding_keeps_the_deployment_when_nothing_else_serves():
    dep = _deployment(2)
    every = {r.worker_address for r in dep.replicas}
    assert replicas.avoiding(dep, every) is dep
    assert replicas.avoiding(dep, set()) is dep


def test_a_reason_shown_to_clients_and_listings_is_its_first_line():
    failed = deploy_pb.Deployment(
        deployment_id="d1",
        state=deploy_pb.DEPLOYMENT_STATE_FAILED,
        state_reason="worker rank 0 exited with code 1:\nTraceback (most recent call last):\n  x",
    )
    said = describe_state(failed)
    assert (
        said
        == "deployment d1 is FAILED: worker rank 0 exited with code 1 (log lines in the full reason)"
    )
    assert "Traceback" not in said
    assert replicas.reason_summary("restarted 1 time(s); last error: x") == (
        "restarted 1 time(s); last error: x"
    )


def test_the_clis_listing_quotes_a_failures_last_log_line():
    """`iserve deployments` said "exited with code 1 before it was ready (log lines in the
    full reason)": the cause (a tensor of the wrong shape) was in --json only (a tester).
    The listing quotes the last log line, cut; clients keep the first line alone."""
    from services.cli.deploying import LISTED_LOG_LINE_CHARS, describe_replicas, listed_reason

    reason = (
        "worker rank 0 exited with code 1 before it was ready:\nTraceback (most recent call "
        "last):\n  File x\nInvalidCheckpoint: tensor 'model.embed_tokens.weight' has shape "
        "[640, 128], config.json says [640, 64]\n\n"
    )
    assert listed_reason(reason) == (
        "worker rank 0 exited with code 1 before it was ready; its last log line: "
        "InvalidCheckpoint: tensor 'model.embed_tokens.weight' has shape [640, 128], "
        "config.json says [640, 64] (all of them in --json)"
    )
    assert listed_reason("restarted 1 time(s)") == "restarted 1 time(s)"
    long = listed_reason("x:\n" + "y" * 500)
    assert long.endswith("y…" + " (all of them in --json)")
    assert len(long) < LISTED_LOG_LINE_CHARS + 60
    dep = _deployment(1)
    dep.replicas[0].state_reason = reason
    assert "its last log line: InvalidCheckpoint: tensor" in describe_replicas(dep)
    assert "Traceback" not in replicas.reason_summary(reason)
