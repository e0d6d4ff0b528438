"""register -> deploy -> stream -> remove through the real stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest
import torch

from monitor_agent.engine.engine import Engine, SamplingConfig
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import model_service_pb2 as model_pb
from services.ports import free_port
from tests.integration.helpers import (
    cli_on_terminal,
    deploy,
    generate,
    make_checkpoint,
    register,
    remove_deployments_of,
    reserved_by_device,
    rid,
    run_cli,
    wait_for,
)

pytestmark = pytest.mark.integration


def test_register_deploy_stream_remove(stack):
    path = make_checkpoint(stack, "e2e-llama", num_layers=3)
    model = register(stack, "e2e-llama", path)
    assert model.state == model_pb.MODEL_STATE_REGISTERED
    assert model.shape.num_layers == 3 and model.shape.weight_bytes > 0
    before = reserved_by_device(stack)

    reply = deploy(stack, "e2e-llama", max_output_tokens=64)
    dep = reply.deployment
    assert dep.state == deploy_pb.DEPLOYMENT_STATE_READY
    [stage] = dep.placement.stages
    assert (stage.first_layer, stage.layer_count) == (0, 3)
    device = f"{stage.devices[0].node_id}/{stage.devices[0].device_id}"
    assert reserved_by_device(stack)[device] == before[device] + stage.reserved_bytes[0]
    assert stage.reserved_bytes[0] > 0
    state = stack.deployments.GetClusterState(deploy_pb.GetClusterStateRequest())
    [dev] = [
        d for n in state.nodes for d in n.devices if d.ref.device_id == stage.devices[0].device_id
    ]
    assert dep.deployment_id in dev.deployment_ids
    workers = stack.agent.ListWorkers(
        agent_pb.ListWorkersRequest(deployment_id=dep.deployment_id)
    ).workers
    assert [w.state for w in workers] == [agent_pb.WORKER_STATE_READY]

    deltas, final = generate(
        stack,
        deployment_id=dep.deployment_id,
        prompt="The quick brown fox",
        max_tokens=12,
        sampling=common.SamplingParams(ignore_eos=True),
    )
    engine = Engine(stack.models_root / path, max_seq_len=128)
    prompt_ids = engine.encode("The quick brown fox")
    expected = [
        s.token_id for s in engine.generate(prompt_ids, 12, SamplingConfig(ignore_eos=True))
    ]
    assert [t for d in deltas for t in d.token_ids] == expected
    assert "".join(d.text for d in deltas) == engine.tokenizer.decode(expected)
    assert final.finish_reason == common.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == 12
    assert final.usage.prompt_tokens == len(prompt_ids)
    assert final.deployment_id == dep.deployment_id
    t = final.timings
    assert 0 <= t.queue_ms < t.ttft_ms < t.total_ms and t.tpot_ms > 0

    # The model id routes to the same deployment.
    deltas2, _ = generate(
        stack,
        model_id="e2e-llama",
        prompt_token_ids=prompt_ids,
        max_tokens=12,
        sampling=common.SamplingParams(ignore_eos=True),
    )
    assert [t for d in deltas2 for t in d.token_ids] == expected

    # Deleting a deployed model is refused and changes nothing.
    with pytest.raises(grpc.RpcError) as err:
        stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id="e2e-llama"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stack.models.GetModel(model_pb.GetModelRequest(model_id="e2e-llama")).model.model_id

    stack.deployments.RemoveDeployment(
        deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id)
    )
    assert reserved_by_device(stack) == before
    with pytest.raises(grpc.RpcError) as err:
        stack.deployments.GetDeployment(
            deploy_pb.GetDeploymentRequest(deployment_id=dep.deployment_id)
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    pid = workers[0].pid
    assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=10)
    stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id="e2e-llama"))


def test_cli_deploy_and_remove_show_a_status_line_on_a_terminal(stack):
    """On a terminal `iserve deploy` and `iserve remove` say what they wait for (a large
    model's Deploy takes minutes); their output on stdout is unchanged."""
    register(stack, "tty-llama", make_checkpoint(stack, "tty-llama"))
    try:
        code, out, screen = cli_on_terminal(
            stack, "deploy", "tty-llama", "--tp", "1", "--pp", "1", "--max-output", "16"
        )
        assert code == 0, screen
        deployment_id = out.strip()
        assert deployment_id.startswith("tty-llama"), out
        assert "deploying tty-llama: planning (0 s; Ctrl-C cancels and rolls back)" in screen
        assert "deployed tty-llama tp=1 pp=1" in screen
        code, out, screen = cli_on_terminal(stack, "remove", deployment_id)
        assert code == 0, screen
        assert out == f"removed {deployment_id}\n"
        assert f"removing {deployment_id}: stopping its workers (0 s)" in screen
    finally:
        remove_deployments_of(stack, "tty-llama")
        stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id="tty-llama"))


def test_deploy_is_idempotent_on_request_id(stack, served):
    again = deploy(
        stack,
        served.model_id,
        request_id=served.request_id,
        max_output_tokens=served.max_output_tokens,
    )
    assert again.deployment.deployment_id == served.deployment_id
    # The same id asking for something else is no repeat.
    with pytest.raises(grpc.RpcError) as other:
        deploy(stack, served.model_id, request_id=served.request_id)
    assert other.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "asked for other max_output_tokens" in other.value.details()


def test_cli_status_and_generate_json(stack, served):
    env = {**os.environ, **stack.env}
    status = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    body = json.loads(status.stdout)
    assert body["healthy"] and body["addresses"]["scheduler"] == stack.settings.address("scheduler")
    assert served.deployment_id in [d["deployment_id"] for d in body["deployments"]]

    # A control-plane host runs no agent: the cluster's live nodes answer for agents.
    nowhere = {**env, "ISERVE_AGENT_ADDR": f"127.0.0.1:{free_port()}"}
    elsewhere = run_cli(nowhere, "status", "--json")
    assert elsewhere.returncode == 0, elsewhere.stderr
    agent = json.loads(elsewhere.stdout)["services"]["agent"]
    assert not agent["serving"] and agent["live_nodes"] == [n["node_id"] for n in body["nodes"]]
    table = run_cli(nowhere, "status")
    assert table.returncode == 0 and "none here; live on " in table.stdout
    # With no live node, a missing agent is a missing agent.
    no_deployer = {**env, "ISERVE_DEPLOY_ADDR": f"127.0.0.1:{free_port()}"}
    alone = run_cli({**no_deployer, "ISERVE_AGENT_ADDR": nowhere["ISERVE_AGENT_ADDR"]}, "status")
    assert alone.returncode == 1 and "DOWN" in alone.stdout
    # What the deployer would have shown is said to be missing, not silently left out.
    assert "error: deploy: not answering at 127.0.0.1:" in alone.stderr
    assert "nodes, devices and deployments are not shown" in alone.stderr
    # And that the stack recorded in this state directory serves it elsewhere.
    assert (
        f"hint: deploy: the stack recorded in {stack.settings.state_dir} serves it at "
        f"{stack.settings.address('deploy')}, not at {no_deployer['ISERVE_DEPLOY_ADDR']} "
        "(set ISERVE_DEPLOY_ADDR as `iserve up` had it, or unset it)"
    ) in alone.stderr, alone.stderr
    assert "error:" not in alone.stdout  # errors on stderr, the tables on stdout
    # Serving needs no deployer: generate by deployment id and by model id still works.
    for target in (served.deployment_id, served.model_id):
        out = run_cli(no_deployer, "generate", target, "Hi", "--max-tokens", "2", "--json")
        assert out.returncode == 0, out.stderr

    # Piped, `models` gives scripts each model's state (only id and checkpoint before).
    models = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "models"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert models.returncode == 0, models.stderr
    fields = {line.split("\t")[0]: line.split("\t") for line in models.stdout.splitlines()}
    assert fields[served.model_id][2] in ("REGISTERED", "PROFILED")

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "generate",
            served.deployment_id,
            "Hello",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [len(line["delta"]["token_ids"]) for line in lines[:-1]] == [1] * 5
    assert lines[-1]["final"]["usage"]["completion_tokens"] == 5


def test_cli_reports_errors_clearly(stack):
    env = {**os.environ, **stack.env}
    out = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "remove", "no-such-deployment"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.startswith("error: NOT_FOUND:")


def test_cli_generate_names_both_readings_of_an_unknown_target(stack, served):
    """`iserve generate TARGET` takes a deployment id or a model id: a mistyped deployment
    id is no model either, and the error says both (it said "model ... has no
    deployment")."""
    env = {**os.environ, **stack.env}
    typo = served.deployment_id[:-1] + ("0" if served.deployment_id[-1] != "0" else "1")
    out = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "generate", typo, "hi", "--max-tokens", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr == (
        f"error: NOT_FOUND: no deployment is named {typo} and no model of that name has a "
        "deployment (`iserve deployments` lists them)\n"
    )


def test_unknown_ids_are_not_found(stack):
    calls = [
        lambda: stack.models.GetModel(model_pb.GetModelRequest(model_id="nope")),
        lambda: stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id="nope")),
        lambda: stack.deployments.GetDeployment(
            deploy_pb.GetDeploymentRequest(deployment_id="nope")
        ),
        lambda: stack.deployments.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(deployment_id="nope")
        ),
        lambda: deploy(stack, "nope"),
        lambda: generate(stack, deployment_id="nope", prompt="hi", max_tokens=1),
        lambda: generate(stack, model_id="nope", prompt="hi", max_tokens=1),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
        assert "nope" in err.value.details()


def test_a_compressed_deployment_serves_what_the_engine_computes(stack):
    """int4 weights, an int8 KV cache and structured pruning, from the deployment config
    through the agent's worker flags to the tokens; the reservation counts the savings."""
    path = make_checkpoint(stack, "e2e-int4", hidden_size=128, num_heads=4, num_kv_heads=4)
    register(stack, "e2e-int4", path)
    plain = stack.deployments.PlanDeployment(
        deploy_pb.PlanDeploymentRequest(
            request_id=rid(),
            model_id="e2e-int4",
            max_output_tokens=16,
            config=common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1),
        )
    ).decision
    config = common.DeploymentConfig(
        weight_quant=common.WEIGHT_QUANT_INT4,
        kv_quant=common.KV_QUANT_INT8,
        pruning=common.PRUNING_STRUCTURED,
    )
    dep = deploy(stack, "e2e-int4", max_output_tokens=16, config=config).deployment
    assert dep.state == deploy_pb.DEPLOYMENT_STATE_READY
    [stage] = dep.placement.stages
    assert stage.reserved_bytes[0] < plain.placement.stages[0].reserved_bytes[0]
    deltas, _ = generate(
        stack,
        deployment_id=dep.deployment_id,
        prompt="The quick brown fox",
        max_tokens=8,
        sampling=common.SamplingParams(ignore_eos=True),
    )
    threads = torch.get_num_threads()
    engine = Engine(
        stack.models_root / path,
        max_seq_len=128,
        num_threads=1,  # as the worker on its one core
        kv_cache_dtype="int8",
        weight_quant="int4",
        pruning="structured",
    )
    torch.set_num_threads(threads)
    prompt_ids = engine.encode("The quick brown fox")
    expected = [s.token_id for s in engine.generate(prompt_ids, 8, SamplingConfig(ignore_eos=True))]
    assert [t for d in deltas for t in d.token_ids] == expected
    stack.deployments.RemoveDeployment(
        deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id)
    )
    stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id="e2e-int4"))


def test_a_worker_log_holds_iserve_lines_not_the_profiler_library_s(stack, served):
    """torch's profiler library (Kineto), which measures a pass's peak memory on CPU,
    printed "ERROR: External init callback must run in same thread as registerClient"
    into every worker's log at its first generation, and a "USDT: ... profiler_start /
    profiler_stop" pair at every measured pass: lines that read as failures and are none."""
    # Prompts of lengths not measured before: each first prefill is measured.
    for words in (3, 40, 90):
        _, final = generate(
            stack, deployment_id=served.deployment_id, prompt="tick " * words, max_tokens=4
        )
        assert final.usage.completion_tokens == 4
    log = stack.settings.state_dir / "logs" / f"worker-{served.deployment_id}-r0.log"
    lines = log.read_text().splitlines()
    assert lines, log
    noise = [line for line in lines if "External init callback" in line or "USDT:" in line]
    assert not noise, noise
