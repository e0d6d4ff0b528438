"""Deployment lifecycle under pressure on the real stack: concurrent deploys on a box
with room for fewer, a failed launch rolled back, a deployment removed while it starts,
and a deployer killed and restarted."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import model_service_pb2 as model_pb
from services.cli import deploying as deploying_cli
from services.cli import stack as launcher
from services.reservation import memory_blocks
from services.state.store import StateStore
from tests.integration.helpers import (
    TINY,
    deploy,
    generate,
    live_devices,
    make_checkpoint,
    register,
    remove_deployments_of,
    reserved_by_device,
    rid,
    settled_devices,
    wait_for,
    with_store,
)

pytestmark = pytest.mark.integration

MAX_INPUT, MAX_OUTPUT = 32, 16
TP1 = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1)
STARTING = deploy_pb.DEPLOYMENT_STATE_STARTING


@pytest.fixture(scope="module")
def small_model(stack) -> model_pb.Model:
    model = register(stack, "life-llama", make_checkpoint(stack, "life-llama"))
    yield model
    stack.models.DeleteModel(model_pb.DeleteModelRequest(request_id=rid(), model_id="life-llama"))


def need_of(model) -> int:
    config = common.DeploymentConfig(
        tensor_parallel=1, pipeline_parallel=1, dtype=model.shape.dtype, batch_size=1
    )
    fixed, block = memory_blocks(model.shape, config, MAX_INPUT + MAX_OUTPUT)
    return fixed + block * model.shape.num_layers


def test_concurrent_deploys_never_oversubscribe(stack, small_model):
    need = need_of(small_model)
    # Leave room for three deployments across the devices, whatever the session's other
    # deployments already hold.
    filler, wanted = {}, 3
    for dev in sorted(settled_devices(stack), key=lambda d: -d.free_bytes):
        take = min(dev.free_bytes // need, wanted)
        wanted -= take
        keep = take * need + need // 2
        filler[(dev.ref.node_id, dev.ref.device_id)] = max(0, dev.free_bytes - keep)
    assert wanted == 0, "the stack has room for fewer than three deployments"
    owner = f"filler-{rid()}"
    with_store(stack, lambda s: s.reserve(owner, filler))
    before = reserved_by_device(stack)
    # The most that can ever fit by reservations alone (measured use that was above the
    # reservations when the filler was sized may fall while the deploys run).
    room = sum((d.total_bytes - d.reserved_bytes) // need for d in live_devices(stack))
    assert room < 8, room

    def one(_):
        try:
            return deploy(
                stack,
                "life-llama",
                config=TP1,
                max_input_tokens=MAX_INPUT,
                max_output_tokens=MAX_OUTPUT,
            ).deployment
        except grpc.RpcError as exc:
            return exc

    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
        ok = [r for r in results if isinstance(r, deploy_pb.Deployment)]
        failed = [r for r in results if isinstance(r, grpc.RpcError)]
        assert len(ok) + len(failed) == 8
        assert {f.code() for f in failed} == {grpc.StatusCode.RESOURCE_EXHAUSTED}, [
            (f.code(), f.details()) for f in failed
        ]
        assert failed and 1 <= len(ok) <= room, (len(ok), room)
        for dev in live_devices(stack):
            assert dev.reserved_bytes <= dev.total_bytes, dev
        after = reserved_by_device(stack)
        per_device = {}
        for dep in ok:
            for stage in dep.placement.stages:
                for ref, amount in zip(stage.devices, stage.reserved_bytes, strict=True):
                    key = f"{ref.node_id}/{ref.device_id}"
                    per_device[key] = per_device.get(key, 0) + amount
        for key, amount in per_device.items():
            assert after[key] - before[key] == amount
        for dep in ok:
            _, final = generate(stack, deployment_id=dep.deployment_id, prompt="hi", max_tokens=2)
            assert final.usage.completion_tokens >= 1
    finally:
        remove_deployments_of(stack, "life-llama")
        with_store(stack, lambda s: s.release(owner))
    assert reserved_by_device(stack) == {k: v - filler_of(filler, k) for k, v in before.items()}


def filler_of(filler: dict, key: str) -> int:
    node_id, device_id = key.split("/")
    return filler.get((node_id, device_id), 0)


def test_a_launch_that_fails_is_rolled_back_leaving_nothing(stack, small_model):
    before = reserved_by_device(stack)
    with pytest.raises(grpc.RpcError) as err:
        deploy(stack, "life-llama", config=TP1, ready_timeout_ms=1)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    assert reserved_by_device(stack) == before
    listed = stack.deployments.ListDeployments(
        deploy_pb.ListDeploymentsRequest(model_id="life-llama")
    ).deployments
    assert not listed
    workers = stack.agent.ListWorkers(agent_pb.ListWorkersRequest()).workers
    assert not [
        w
        for w in workers
        if w.deployment_id.startswith("life-llama")
        and w.state in (agent_pb.WORKER_STATE_STARTING, agent_pb.WORKER_STATE_READY)
    ]


def test_a_remove_while_the_deploy_starts_aborts_it_leaving_nothing(stack, small_model):
    before = reserved_by_device(stack)
    known = {
        w.deployment_id for w in stack.agent.ListWorkers(agent_pb.ListWorkersRequest()).workers
    }
    request_id = rid()
    deploying = stack.deployments.Deploy.future(
        deploy_pb.DeployRequest(
            model_id="life-llama",
            config=TP1,
            request_id=request_id,
            max_input_tokens=MAX_INPUT,
            max_output_tokens=MAX_OUTPUT,
        ),
        timeout=180,
    )
    held = None
    try:
        # Its worker is held (SIGSTOP) while the Remove lands: from the warm pool a small
        # model can be ready within a fraction of a second, before any Remove could come.
        worker = starting_worker_of(stack, deploying, known, request_id)
        os.kill(worker.pid, signal.SIGSTOP)
        held = worker.pid
        ready_file = (
            stack.settings.state_dir / "run" / f"worker-{worker.deployment_id}-r0.ready.json"
        )
        assert not ready_file.exists(), "the worker was ready before it could be held"
        starting = stack.deployments.GetDeployment(
            deploy_pb.GetDeploymentRequest(deployment_id=worker.deployment_id)
        ).deployment
        assert starting.state == STARTING
        # What `iserve deploy` shows on a terminal meanwhile: the deployment its request
        # made, read from the deployer's listing, and what it starts.
        # (A listing slower than the CLI's 2 s read as "planning": a loaded run's margin.)
        progress = deploying_cli.deploy_progress(
            stack.deployments, "life-llama", request_id, rpc_timeout_s=30
        )
        shown = progress(3.2)
        assert shown.startswith(
            f"deploying {starting.deployment_id}: starting tp=1 pp=1 batch=1 on "
            f"{starting.placement.stages[0].devices[0].node_id}/"
        ), shown
        assert shown.endswith("(3 s; Ctrl-C cancels and rolls back)"), shown
        other = deploying_cli.deploy_progress(
            stack.deployments, "life-llama", rid(), rpc_timeout_s=30
        )(3.2)
        assert other.startswith("deploying life-llama: planning (3 s;"), other
        removing = stack.deployments.RemoveDeployment.future(
            deploy_pb.RemoveDeploymentRequest(deployment_id=starting.deployment_id), timeout=120
        )
        # The Remove has the deployment (REMOVING, or gone already) before its worker may
        # go on.
        assert wait_for(lambda: state_of(stack, starting.deployment_id) != STARTING, timeout=60)
        # What the test is about is the Deploy's answer and what is left, below. A CI run
        # found the held worker gone by now: the Remove's stop SIGTERMs it, which a stopped
        # process leaves pending, and SIGKILLs it drain + margin (35 s) later, which kills
        # it stopped or not; a loaded run can come here after that. Not asserted.
        with contextlib.suppress(ProcessLookupError):
            os.kill(held, signal.SIGCONT)
        held = None
        removing.result()
        with pytest.raises(grpc.RpcError) as aborted:
            deploying.result(timeout=180)
    finally:
        if held is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(held, signal.SIGCONT)
        for dep in life_llama_deployments(stack):
            stack.deployments.RemoveDeployment(
                deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id), timeout=120
            )
    # Neither READY nor the workers' "killed by SIGTERM before it was ready" of a crash.
    assert aborted.value.code() == grpc.StatusCode.ABORTED, aborted.value.details()
    assert aborted.value.details() == (
        f"deployment {starting.deployment_id} was removed while it was starting"
    )
    assert not life_llama_deployments(stack)
    assert reserved_by_device(stack) == before

    async def leftovers(store: StateStore):
        keys = [k async for k in store.redis.scan_iter(match=f"*{starting.deployment_id}*")]
        return keys, await store.reservation_owners(), await store.deploy_request(request_id)

    keys, owners, bound = with_store(stack, leftovers)
    assert keys == [] and bound is None
    assert not [o for o in owners if o.startswith(starting.deployment_id)]
    workers = stack.agent.ListWorkers(agent_pb.ListWorkersRequest()).workers
    assert not [
        w
        for w in workers
        if w.deployment_id == starting.deployment_id
        and w.state in (agent_pb.WORKER_STATE_STARTING, agent_pb.WORKER_STATE_READY)
    ]


def life_llama_deployments(stack) -> list[deploy_pb.Deployment]:
    return list(
        stack.deployments.ListDeployments(
            deploy_pb.ListDeploymentsRequest(model_id="life-llama")
        ).deployments
    )


def state_of(stack, deployment_id: str) -> int | None:
    """The deployment's state; None once it is gone."""
    try:
        return stack.deployments.GetDeployment(
            deploy_pb.GetDeploymentRequest(deployment_id=deployment_id), timeout=10
        ).deployment.state
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise


def starting_worker_of(
    stack, deploying: grpc.Future, known: set[str], request_id: str
) -> agent_pb.WorkerInfo:
    """The worker the Deploy in flight with ``request_id`` starts (of a deployment not in
    ``known``), as soon as its agent has started it (the deployment's record, which
    names the request, is written before)."""
    while not deploying.done():
        for worker in stack.agent.ListWorkers(agent_pb.ListWorkersRequest(), timeout=10).workers:
            if (
                worker.deployment_id.startswith("life-llama")
                and worker.state == agent_pb.WORKER_STATE_STARTING
                and worker.pid
                and worker.deployment_id not in known
                and _request_of(stack, worker.deployment_id) == request_id
            ):
                return worker
    raise AssertionError(f"the Deploy ended before its worker was seen: {deploying.exception()}")


def _request_of(stack, deployment_id: str) -> str | None:
    try:
        return stack.deployments.GetDeployment(
            deploy_pb.GetDeploymentRequest(deployment_id=deployment_id), timeout=10
        ).deployment.request_id
    except grpc.RpcError:
        return None


def test_killing_and_restarting_the_deployer_loses_no_deployment(stack, small_model):
    dep = deploy(
        stack, "life-llama", config=TP1, max_input_tokens=MAX_INPUT, max_output_tokens=MAX_OUTPUT
    ).deployment
    reserved = reserved_by_device(stack)
    device = live_devices(stack)[0].ref
    # What a deployer killed mid-deploy leaves behind: a STARTING record holding memory,
    # and a reservation whose deployment record was never written.
    starting = deploy_pb.Deployment(
        deployment_id="life-llama-cutoff",
        model_id="life-llama",
        state=deploy_pb.DEPLOYMENT_STATE_STARTING,
        placement=common.Placement(
            stages=[common.StagePlacement(stage=0, layer_count=2, devices=[device])]
        ),
    )

    async def leave_debris(store: StateStore) -> None:
        await store.put_deployment(starting)
        await store.reserve("life-llama-cutoff", {(device.node_id, device.device_id): 1 << 20})
        await store.reserve("life-llama-orphan", {(device.node_id, device.device_id): 1 << 20})

    with_store(stack, leave_debris)
    launcher.restart_service(stack.settings, "deploy", kill=True)

    got = stack.deployments.GetDeployment(
        deploy_pb.GetDeploymentRequest(deployment_id=dep.deployment_id)
    ).deployment
    assert got.state == deploy_pb.DEPLOYMENT_STATE_READY
    assert got.worker_address == dep.worker_address
    assert wait_for(lambda: reserved_by_device(stack) == reserved, timeout=20), (
        reserved_by_device(stack),
        reserved,
    )
    cutoff = stack.deployments.GetDeployment(
        deploy_pb.GetDeploymentRequest(deployment_id="life-llama-cutoff")
    ).deployment
    assert cutoff.state == deploy_pb.DEPLOYMENT_STATE_FAILED
    assert "restarted" in cutoff.state_reason
    owners = with_store(stack, lambda s: s.reservation_owners())
    assert "life-llama-orphan" not in owners and "life-llama-cutoff" not in owners
    _, final = generate(stack, deployment_id=dep.deployment_id, prompt="still here", max_tokens=3)
    assert final.usage.completion_tokens >= 1
    # The restarted deployer still deploys and removes.
    second = deploy(stack, "life-llama", config=TP1, max_input_tokens=MAX_INPUT).deployment
    for deployment_id in (dep.deployment_id, second.deployment_id):
        stack.deployments.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(deployment_id=deployment_id)
        )
    with_store(stack, lambda s: s.delete_deployment(cutoff))


@pytest.mark.parametrize("stored", ["float16", "bfloat16"])
def test_a_16_bit_checkpoint_is_served_on_cpus_in_float32_without_a_dtype(stack, stored):
    """transformers often saves float16 or bfloat16; without a dtype the CPU engine
    computes in float32, as profiling jobs do (float16 was UNIMPLEMENTED before, bfloat16
    served as bfloat16 against float32 profiles); asked for by name, bfloat16 is served
    and the decision says the profiles do not describe it."""
    name = f"{stored}-llama"
    register(stack, name, make_checkpoint(stack, name, dtype=stored))
    dep = deploy(stack, name).deployment
    try:
        assert dep.config.dtype == common.PRECISION_FLOAT32
        _, final = generate(stack, deployment_id=dep.deployment_id, prompt="hi", max_tokens=3)
        assert final.usage.completion_tokens >= 1
        plan = stack.deployments.PlanDeployment(
            deploy_pb.PlanDeploymentRequest(
                model_id=name, config=common.DeploymentConfig(dtype=common.PRECISION_BFLOAT16)
            ),
            timeout=60,
        )
        assert plan.decision.config.dtype == common.PRECISION_BFLOAT16
        # Registered without profiling: it has no profile to speak of (a probe read
        # "was profiled in float32" here); profiled, the note says in what.
        assert f"no estimate: {name} has no profile" in plan.decision.note
    finally:
        stack.deployments.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id), timeout=120
        )
        stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id=name))


def test_a_deploy_of_a_model_being_deleted_fails_and_a_deployed_model_is_kept(stack):
    """DeleteModel marks its model before it looks for deployments, and Deploy looks for
    the mark after recording its deployment (the two services are separate processes):
    here the mark of a delete that is between the two steps, or crashed there."""
    register(stack, "doomed-llama", make_checkpoint(stack, "doomed-llama"))
    before = reserved_by_device(stack)
    request_id = rid()
    with_store(stack, lambda s: s.mark_model_deleting("doomed-llama", 60))
    with pytest.raises(grpc.RpcError) as refused:
        deploy(stack, "doomed-llama", request_id=request_id)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details() == "model 'doomed-llama' is being deleted"
    assert reserved_by_device(stack) == before

    async def leftovers(store: StateStore):
        deployments = await store.list_deployments("doomed-llama")
        owners = [o for o in await store.reservation_owners() if o.startswith("doomed-llama")]
        return deployments, owners, await store.deploy_request(request_id)

    assert with_store(stack, leftovers) == ([], [], None)
    # Once the mark is gone the model deploys, and a delete is refused while it is.
    with_store(stack, lambda s: s.clear_model_deleting("doomed-llama"))
    dep = deploy(stack, "doomed-llama").deployment
    try:
        with pytest.raises(grpc.RpcError) as kept:
            stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id="doomed-llama"))
        assert kept.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "has deployments" in kept.value.details()
    finally:
        stack.deployments.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id), timeout=120
        )
    stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id="doomed-llama"))

    async def keys_left(store: StateStore):
        return [k async for k in store.redis.scan_iter(match="*doomed-llama*")]

    assert with_store(stack, keys_left) == []


REWRITTEN = {
    # Overwritten with a wider model: the deployer reserved memory for the registered
    # shape, so the agent refuses to load the other model.
    "config": (
        "its checkpoint has hidden_size {wide}, the model has {tiny}".format(
            wide=2 * TINY["hidden_size"], tiny=TINY["hidden_size"]
        )
    ),
    # config.json kept, the weights of a model with a wider MLP copied over it: every
    # start would fail loading them, so the agent refuses from the headers, naming the
    # tensor, before any worker starts (a tester saw 11 starts of such a checkpoint). An
    # intent deploy then tries no other configuration: tests/unit/test_deploy_replicas.py.
    "weights": "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [256, 64]",
}


@pytest.mark.parametrize("what", sorted(REWRITTEN))
def test_a_checkpoint_rewritten_as_another_model_is_refused_leaving_nothing(stack, what):
    """The deploy leaves no record, worker or reservation behind."""
    model_id = f"rewritten-{what}"
    register(stack, model_id, make_checkpoint(stack, model_id))
    before = reserved_by_device(stack)
    if what == "config":
        make_checkpoint(stack, model_id, hidden_size=2 * TINY["hidden_size"])
    else:
        wider = make_checkpoint(stack, f"{model_id}-wider", intermediate_size=256)
        for weights in (stack.models_root / wider).glob("*.safetensors*"):
            shutil.copyfile(weights, stack.models_root / model_id / weights.name)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            deploy(stack, model_id)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (
            f"checkpoint {model_id!r} is no longer the model registered from it: {REWRITTEN[what]}"
        ) in refused.value.details()
        deployments = stack.deployments.ListDeployments(
            deploy_pb.ListDeploymentsRequest()
        ).deployments
        assert [d for d in deployments if d.model_id == model_id] == []
        assert reserved_by_device(stack) == before
        workers = stack.agent.ListWorkers(agent_pb.ListWorkersRequest()).workers
        assert not [w for w in workers if w.deployment_id.startswith(model_id)]
    finally:
        stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id=model_id))


def test_listing_by_an_id_no_model_can_have_is_refused(stack):
    """`iserve deployments --model ☃` listed nothing and exited 0, where every other
    call refuses the id (a tester)."""
    with pytest.raises(grpc.RpcError) as err:
        stack.deployments.ListDeployments(deploy_pb.ListDeploymentsRequest(model_id="☃"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("invalid model_id '☃': ")
