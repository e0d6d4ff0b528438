"""Hostile requests at the edges, without a server: ids with separators, paths escaping
the models root, absurd sampling, oversized prompts, unknown and unspecified enum
values. Each is an IServeError whose code is INVALID_ARGUMENT (UNIMPLEMENTED for what
is valid but not built), never another exception; hypothesis checks the parsers over
arbitrary values."""

from __future__ import annotations

import json
import math
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_svc.explicit import resolve_explicit
from deploy_svc.objectives import resolve_objectives
from fingerprint_svc.registry import build_model, check_variants
from scheduler_svc.validation import check_for_deployment, check_request, resolve_max_tokens
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as infer_pb
from services.api import model_service_pb2 as model_pb
from services.engine_rules import resolve_checkpoint
from services.errors import IServeError
from services.ids import (
    TOKEN_PATTERN,
    check_deployment_id,
    check_model_id,
    check_request_id,
    check_variant_name,
    is_valid_id,
)
from services.models.checkpoint import create_checkpoint

REFUSED = (grpc.StatusCode.INVALID_ARGUMENT,)
PROPERTY = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Status details travel in gRPC trailers (8 KiB by default); an echoed id must stay short.
MAX_MESSAGE_CHARS = 1000


def _refused(call, *args, codes=REFUSED, **kwargs) -> str:
    with pytest.raises(IServeError) as err:
        call(*args, **kwargs)
    assert err.value.code in codes, err.value
    message = str(err.value)
    assert len(message) < MAX_MESSAGE_CHARS
    return message


# ---- ids ------------------------------------------------------------------------------

HOSTILE_IDS = [
    "",
    "a:b",
    "a/b",
    "../etc",
    "..",
    ".",
    "a b",
    " a",
    "a\n",
    "a\t",
    "a\x00b",
    "a\\b",
    "a*",
    "ü",
    "x" * 129,
    "x" * 100_000,
]


@pytest.mark.parametrize("value", HOSTILE_IDS, ids=lambda v: repr(v[:12]))
def test_ids_with_separators_are_invalid_argument(value):
    assert "model_id" in _refused(check_model_id, value)
    assert "deployment_id" in _refused(check_deployment_id, value)
    assert "variant name" in _refused(check_variant_name, value)
    if value:  # an empty request id means "none given"
        assert "request_id" in _refused(check_request_id, value)


def test_a_trailing_newline_is_not_part_of_a_valid_id():
    """``re.match`` with ``$`` accepts "abc\\n"; ids are matched whole."""
    assert is_valid_id("abc") and not is_valid_id("abc\n")
    check_deployment_id("abc-0123abcd")
    check_request_id("Req_1.2-3")


def test_a_long_id_is_echoed_shortened():
    message = _refused(check_model_id, "x" * 100_000)
    assert "(100000 characters)" in message and len(message) < 300


_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


@PROPERTY
@given(st.text(max_size=140) | st.sampled_from(HOSTILE_IDS))
def test_any_text_is_a_safe_id_or_invalid_argument(value):
    for check, limit in (
        (check_model_id, 64),
        (check_variant_name, 64),
        (check_deployment_id, 128),
        (check_request_id, 128),
    ):
        try:
            check(value)
        except IServeError as exc:
            assert exc.code == grpc.StatusCode.INVALID_ARGUMENT
            assert len(str(exc)) < MAX_MESSAGE_CHARS
            continue
        if check is check_request_id and not value:
            continue
        # Accepted: safe as a Redis key part, a file name and a URL segment.
        assert 1 <= len(value) <= limit and set(value) <= _SAFE
        assert value.strip(".") and ":" not in value and "/" not in value


# ---- the models root ------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    create_checkpoint(
        root / "tiny", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64
    )
    return root


@pytest.fixture
def outside(tmp_path_factory):
    return create_checkpoint(
        tmp_path_factory.mktemp("outside") / "ckpt",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
    )


def test_a_named_chat_template_linked_outside_the_root_is_refused(root, tmp_path):
    """Registration compiles the named templates and the gateway reads them: one in
    additional_chat_templates/ linked outside the root passed the check of the
    directory's own entries."""
    import shutil

    named = root / "linked-named-template"
    shutil.copytree(root / "tiny", named)
    (named / "additional_chat_templates").mkdir()
    secret = tmp_path / "secret.jinja"
    secret.write_text("{{ 'not the model's' }}")
    (named / "additional_chat_templates" / "tool_use.jinja").symlink_to(secret)
    message = _refused(resolve_checkpoint, root, named.name)
    assert "additional_chat_templates/tool_use.jinja links outside the models root" in message


def test_a_linked_folder_the_checkpoint_does_not_read_is_not_what_refuses_it(
    root, outside, tmp_path
):
    """The models root given as the checkpoint ("."), beside a folder linked outside it:
    refused for that folder, not for holding no config.json (a probe)."""
    import shutil

    own = tmp_path / "models"
    shutil.copytree(root / "tiny", own / "tiny")
    (own / "linked-folder").symlink_to(outside, target_is_directory=True)
    request = model_pb.RegisterModelRequest(model_id="x", checkpoint_path=".")
    message = _refused(build_model, request, own)
    assert "links outside" not in message and "config.json" in message, message
    # A checkpoint with such a folder beside its files is read as any other.
    (own / "tiny" / "elsewhere").symlink_to(outside, target_is_directory=True)
    assert resolve_checkpoint(own, "tiny") == (own / "tiny").resolve()


def test_a_weight_file_linked_outside_the_root_is_refused(root, outside):
    """The directory is inside the root, one of its files is a link to a file outside."""
    linked = root / "linked-weights"
    linked.mkdir()
    for entry in outside.iterdir():
        target = linked / entry.name
        if entry.name.endswith(".safetensors"):
            target.symlink_to(entry)
        else:
            target.write_bytes(entry.read_bytes())
    message = _refused(resolve_checkpoint, root, "linked-weights")
    assert "model.safetensors links outside the models root" in message
    assert "links outside" in _refused(
        build_model,
        model_pb.RegisterModelRequest(model_id="linked", checkpoint_path="linked-weights"),
        root,
    )


def _weights_named_by(root, name: str, weights_at: str, *, index: bool) -> None:
    """A checkpoint ``name`` under ``root`` whose weights are named (by a shard index,
    or config.json's transformers_weights) at ``weights_at``; it holds none itself."""
    import json
    import shutil

    ckpt = root / name
    shutil.copytree(root / "tiny", ckpt)
    (ckpt / "model.safetensors").unlink()
    config = json.loads((ckpt / "config.json").read_text())
    if index:
        from services.models.checkpoint_files import read_safetensors_index

        tensors = read_safetensors_index(root / "tiny")
        weight_map = {tensor: weights_at for tensor in tensors}
        (ckpt / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    else:
        config["transformers_weights"] = weights_at
    (ckpt / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("index", [True, False], ids=["shard-index", "transformers_weights"])
@pytest.mark.parametrize("how", ["absolute", "dotdot", "linked-subdirectory-file"])
def test_weights_named_outside_the_checkpoint_are_refused_before_any_is_read(
    root, outside, tmp_path, index, how
):
    """A probe's index named a file elsewhere on the host: it was registered and
    served, and a text file named as a shard had its first bytes quoted back."""
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"SECRET=hunter2 " * 8)
    name = f"named-{how}-{index}"
    if how == "absolute":
        weights_at = str(secret)
    elif how == "dotdot":
        weights_at = os.path.relpath(secret, root / name)
    else:
        (root / name / "sub").mkdir(parents=True)
        (root / name / "sub" / "w.safetensors").symlink_to(secret)
        weights_at = "sub/w.safetensors"
    if how == "linked-subdirectory-file":
        import shutil

        sub = root / name / "sub"
        shutil.move(sub, tmp_path / "sub")
        shutil.rmtree(root / name)
        _weights_named_by(root, name, weights_at, index=index)
        shutil.move(tmp_path / "sub", root / name / "sub")
    else:
        _weights_named_by(root, name, weights_at, index=index)
    request = model_pb.RegisterModelRequest(model_id="x", checkpoint_path=name)
    message = _refused(build_model, request, root)
    assert "outside" in message and "SECRET" not in message and "header" not in message


def test_deeply_nested_json_files_are_invalid_argument(root):
    """Python's parser refuses them with RecursionError: registration ended INTERNAL."""
    import json
    import shutil

    deep = "[" * 100_000 + "]" * 100_000
    for file in ("config.json", "tokenizer_config.json", "generation_config.json"):
        ckpt = root / f"deep-{file}"
        shutil.copytree(root / "tiny", ckpt)
        (ckpt / file).write_text(deep)
        request = model_pb.RegisterModelRequest(model_id="x", checkpoint_path=ckpt.name)
        if file == "generation_config.json":
            # Not JSON to Python, as an unparsable one is: ignored, as transformers does.
            build_model(request, root)
        else:
            # tokenizer_config.json too: transformers refuses the tokenizer.
            assert file in _refused(build_model, request, root)
    ckpt = root / "deep-index"
    _weights_named_by(root, ckpt.name, "model.safetensors", index=True)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"a": 1})[:-1] + deep + "}")
    request = model_pb.RegisterModelRequest(model_id="x", checkpoint_path=ckpt.name)
    assert "index" in _refused(build_model, request, root)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_weights_that_are_no_regular_file_are_named_so(root, kind):
    import shutil

    ckpt = root / f"weights-{kind}"
    shutil.copytree(root / "tiny", ckpt)
    (ckpt / "model.safetensors").unlink()
    if kind == "fifo":
        os.mkfifo(ckpt / "model.safetensors")
    else:
        (ckpt / "model.safetensors").mkdir()
    request = model_pb.RegisterModelRequest(model_id="x", checkpoint_path=ckpt.name)
    message = _refused(build_model, request, root)
    assert "model.safetensors in" in message and "is not a regular file" in message


@pytest.mark.parametrize("name", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_named_pipe_among_the_template_files_is_refused_not_waited_on(root, name):
    """A probe's FIFO tokenizer_config.json held the model service (and, once deployed,
    the gateway's event loop) for ever, and the model was recorded after the client had
    given up."""
    import shutil
    import threading

    from services.models.chat_template import NoChatTemplate, read_chat_template

    ckpt = root / f"fifo-{name}"
    shutil.copytree(root / "tiny", ckpt)
    (ckpt / name).unlink(missing_ok=True)
    os.mkfifo(ckpt / name)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            read_chat_template(ckpt)
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock it: it waits on the pipe
        with open(ckpt / name, "w") as pipe:
            pipe.write("{}")
        reader.join(10)
        pytest.fail(f"reading {name} waited on the pipe")
    assert isinstance(outcome[0], NoChatTemplate), outcome
    assert f"{name} is not a regular file" in str(outcome[0])


@pytest.mark.parametrize("name", ["tokenizer_config.json", "chat_template.jinja"])
def test_registration_refuses_a_named_pipe_among_the_tokenizer_files_at_once(root, name):
    """A FIFO tokenizer_config.json held the model service's event loop, every model call
    with it, until something wrote into the pipe; once registered, each worker start
    waited 120 s on it (a tester). A FIFO chat_template.jinja registered (read as no
    template) and every chat was a 400."""
    import shutil
    import threading

    ckpt = root / f"pipe-{name}"
    shutil.copytree(root / "tiny", ckpt)
    (ckpt / name).unlink(missing_ok=True)
    os.mkfifo(ckpt / name)
    request = model_pb.RegisterModelRequest(model_id="x", checkpoint_path=ckpt.name)
    said: list[str] = []
    registering = threading.Thread(
        target=lambda: said.append(_refused(build_model, request, root)), daemon=True
    )
    registering.start()
    registering.join(20)
    if registering.is_alive():
        with open(ckpt / name, "w") as pipe:  # unblock it
            pipe.write("{}")
        registering.join(20)
        pytest.fail(f"registration waited on the pipe {name}")
    assert said and f"{name}" in said[0] and "is not a regular file" in said[0], said
    assert "not valid JSON" not in said[0]  # it said so of the pipe it did not read


def test_registration_refuses_template_files_the_gateway_cannot_read(root, tmp_path):
    """Each registered, and every chat was then a 400 blaming the request (a tester): a
    chat_template.jinja that is not UTF-8, a template folder linked outside the models
    root, a tokenizer_config.json over the gateway's bound (a 600 MB one took 1.3 GB)."""
    import shutil

    from services.models.chat_template import MAX_TEMPLATE_FILE_BYTES

    def variant(name: str):
        ckpt = root / f"unreadable-{name}"
        shutil.copytree(root / "tiny", ckpt)
        return ckpt

    binary = variant("binary")
    (binary / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    linked = variant("linked")
    elsewhere = tmp_path / "templates"
    elsewhere.mkdir()
    (elsewhere / "default.jinja").write_text("{{ messages }}")
    (linked / "additional_chat_templates").symlink_to(elsewhere)
    big = variant("big")
    with (big / "tokenizer_config.json").open("r+b") as config:
        config.truncate(MAX_TEMPLATE_FILE_BYTES + 1)  # sparse: no 16 MiB written
    for ckpt, says in (
        (binary, "chat_template.jinja: 'utf-8' codec can't decode"),
        (linked, "additional_chat_templates links outside the models root"),
        (big, f"more than {MAX_TEMPLATE_FILE_BYTES}"),
    ):
        request = model_pb.RegisterModelRequest(model_id="x", checkpoint_path=ckpt.name)
        message = _refused(build_model, request, root)
        assert says in message, message


@pytest.mark.parametrize(
    "name",
    ["chat_template.jinja", "tokenizer_config.json", "additional_chat_templates/default.jinja"],
)
def test_template_files_linked_outside_the_models_root_are_not_read(root, tmp_path, name):
    """Registration refuses such a link, but one made since was read by the gateway at
    every chat: linked to the stack's token file or /proc/self/environ, its text became
    the prompt (a probe)."""
    import shutil

    from services.models.chat_template import NoChatTemplate, read_chat_template

    ckpt = root / f"linked-{name.replace('/', '-')}"
    shutil.copytree(root / "tiny", ckpt)
    secret = tmp_path / "secret"
    secret.write_text("{{ 'the service token' }}")
    (ckpt / name).parent.mkdir(exist_ok=True)
    (ckpt / name).unlink(missing_ok=True)
    (ckpt / name).symlink_to(secret)
    with pytest.raises(NoChatTemplate, match="links outside the models root"):
        read_chat_template(ckpt, root)
    # A link that stays inside the root is read (a tokenizer shared by checkpoints).
    shared = root / f"shared-{name.replace('/', '-')}"
    shutil.copy(root / "tiny" / "tokenizer_config.json", shared)
    if name.endswith(".jinja"):
        shared.write_text("{{ messages[0]['content'] }}")
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(shared)
    assert read_chat_template(ckpt, root).text


def test_a_template_link_swapped_after_its_check_is_not_followed(root, tmp_path):
    """The check and the read were two steps: a tester swapping a chat_template.jinja
    link between a file inside the root and one outside got the outside one rendered
    in 4.5 % of 11,000 chats. The read now opens the file the check resolved, never
    through a link, and checks where the opened file is."""
    import shutil

    from services.models import chat_template
    from services.models.chat_template import NoChatTemplate

    ckpt = root / "swapped"
    shutil.copytree(root / "tiny", ckpt)
    inside, outside = root / "inside.jinja", tmp_path / "outside.jinja"
    inside.write_text("INSIDE {{ messages[0]['content'] }}")
    outside.write_text("SECRET")
    link = ckpt / "chat_template.jinja"
    link.unlink(missing_ok=True)
    link.symlink_to(inside)
    stamp = chat_template._stamp(link, root.resolve())
    link.unlink()
    link.symlink_to(outside)  # swapped after the check: the read does not follow it
    assert chat_template._read(stamp, link.name).startswith("INSIDE")
    inside.unlink()
    inside.symlink_to(outside)  # the checked file itself made a link: refused
    with pytest.raises(NoChatTemplate, match="cannot read"):
        chat_template._read(stamp, link.name)


def test_a_config_json_of_megabytes_is_refused_before_it_is_parsed(root):
    import shutil

    from services.models.checkpoint_files import MAX_CONFIG_BYTES

    ckpt = root / "huge-config"
    shutil.copytree(root / "tiny", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["padding"] = "x" * MAX_CONFIG_BYTES
    (ckpt / "config.json").write_text(json.dumps(config))
    request = model_pb.RegisterModelRequest(model_id="x", checkpoint_path=ckpt.name)
    message = _refused(build_model, request, root)
    assert "config.json in" in message and f"more than {MAX_CONFIG_BYTES}" in message


def test_a_generation_config_that_is_no_object_is_refused_at_registration(root):
    """The worker refuses it at load: it registered, and every deploy failed."""
    import shutil

    ckpt = root / "generation-list"
    shutil.copytree(root / "tiny", ckpt)
    (ckpt / "generation_config.json").write_text("[1]")
    request = model_pb.RegisterModelRequest(model_id="x", checkpoint_path=ckpt.name)
    assert "generation_config.json is malformed" in _refused(build_model, request, root)


def test_links_inside_the_root_are_followed(root):
    inner = root / "inner-links"
    inner.mkdir(exist_ok=True)
    for entry in (root / "tiny").iterdir():
        link = inner / entry.name
        if not link.exists():
            link.symlink_to(entry)
    assert resolve_checkpoint(root, "inner-links") == inner.resolve()
    build_model(
        model_pb.RegisterModelRequest(model_id="inner", checkpoint_path="inner-links"), root
    )


@pytest.mark.parametrize(
    "path,phrase",
    [
        ("tiny/../../etc", "outside the models root"),
        ("../" * 40 + "etc", "outside the models root"),
        ("/etc", "outside the models root"),
        ("tiny\x00/../..", "NUL byte"),
        ("x" * 5000, "cannot be read"),
        ("/".join(["y" * 250] * 20), "cannot be read"),
        ("loop", "cannot be read"),
    ],
    ids=["dotdot", "deep-dotdot", "absolute", "nul", "long-name", "long-path", "link-loop"],
)
def test_paths_escaping_or_breaking_the_root_are_invalid_argument(root, path, phrase):
    loop = root / "loop"
    if not loop.is_symlink():
        loop.symlink_to(loop)
    message = _refused(resolve_checkpoint, root, path)
    assert phrase in message


def test_a_directory_linked_outside_the_root_is_refused(root, outside):
    link = root / "dir-link"
    if not link.is_symlink():
        link.symlink_to(outside)
    assert "outside the models root" in _refused(resolve_checkpoint, root, "dir-link")
    assert "outside the models root" in _refused(resolve_checkpoint, root, str(link))


def test_a_variant_checkpoint_escaping_the_root_is_refused(root):
    variant = common.CompressionVariant(
        name="esc",
        weight_quant=common.WEIGHT_QUANT_INT8,
        kv_quant=common.KV_QUANT_NONE,
        pruning=common.PRUNING_NONE,
        checkpoint_path="../outside",
    )
    request = model_pb.RegisterModelRequest(
        model_id="tiny", checkpoint_path="tiny", variants=[variant]
    )
    assert "outside the models root" in _refused(build_model, request, root)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_an_unreadable_directory_is_invalid_argument(root):
    locked = root / "locked"
    locked.mkdir(exist_ok=True)
    locked.chmod(0)
    try:
        assert "cannot be read" in _refused(resolve_checkpoint, root, "locked")
    finally:
        locked.chmod(0o755)


# ---- RegisterModel --------------------------------------------------------------------


def _variant(**fields) -> common.CompressionVariant:
    base = dict(
        name="v",
        weight_quant=common.WEIGHT_QUANT_INT8,
        kv_quant=common.KV_QUANT_NONE,
        pruning=common.PRUNING_NONE,
    )
    return common.CompressionVariant(**{**base, **fields})


@pytest.mark.parametrize(
    "fields,phrase",
    [
        (dict(weight_quant=42), "weight_quant 42 is not a known value"),
        (dict(kv_quant=-1), "kv_quant -1 is not a known value"),
        (dict(pruning=7), "pruning 7 is not a known value"),
        (dict(weight_quant=0), "weight_quant must be set (not UNSPECIFIED)"),
        (dict(weight_quant=common.WEIGHT_QUANT_NONE), "names no compression"),
        (dict(name="a:b"), "variant name"),
        (dict(name="Int8"), "variant name"),
        (dict(name="x" * 1000), "1000 characters"),
        (dict(accuracy_score=math.nan), "accuracy_score must be a finite number"),
        (dict(accuracy_score=-math.inf), "accuracy_score must be a finite number"),
        (dict(accuracy_score=-1.0), "accuracy_score must be a finite number, 0 or more"),
        (dict(structured_prune_fraction=math.nan), "structured_prune_fraction"),
    ],
)
def test_register_refuses_hostile_variants(fields, phrase):
    assert phrase in _refused(check_variants, [_variant(**fields)])


def test_register_refuses_more_variants_than_make_sense():
    """100,000 variants were registered, and every ListModels then carried 1.6 MB."""
    from fingerprint_svc.registry import MAX_VARIANTS

    many = [_variant(name=f"v{i}") for i in range(MAX_VARIANTS + 1)]
    assert f"variants: at most {MAX_VARIANTS}, got {MAX_VARIANTS + 1}" in _refused(
        check_variants, many
    )
    check_variants(many[:MAX_VARIANTS])


@pytest.mark.parametrize(
    "fields,phrase",
    [
        (dict(accuracy_score=math.inf), "accuracy_score"),
        (dict(model_id="tiny\n"), "model_id"),
        (dict(checkpoint_path="tiny\x00"), "NUL"),
    ],
)
def test_register_refuses_hostile_fields(root, fields, phrase):
    request = model_pb.RegisterModelRequest(
        **{"model_id": "tiny", "checkpoint_path": "tiny", **fields}
    )
    assert phrase in _refused(build_model, request, root)


# ---- Generate -------------------------------------------------------------------------


def _generate(**fields) -> infer_pb.GenerateRequest:
    base = dict(deployment_id="m-0123abcd", prompt="hi", max_tokens=4)
    return infer_pb.GenerateRequest(**{**base, **fields})


@pytest.mark.parametrize(
    "sampling,phrase",
    [
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature=-math.inf), "temperature"),
        (dict(temperature=-1e-30), "temperature"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_p=-0.1), "top_p"),
        (dict(top_p=1.0001), "top_p"),
        (dict(top_p=math.inf), "top_p"),
        (dict(stop_token_ids=[7] * 1025), "at most 1024 stop token ids"),
    ],
)
def test_absurd_sampling_is_invalid_argument(sampling, phrase):
    request = _generate(sampling=common.SamplingParams(**sampling))
    assert phrase in _refused(check_request, request)


def test_extreme_but_meaningful_sampling_is_accepted():
    """A huge temperature is uniform sampling, a huge top_k no top-k, any uint64 a seed."""
    for sampling in [
        common.SamplingParams(temperature=1e9, top_k=2**32 - 1, top_p=1e-30, seed=2**64 - 1),
        common.SamplingParams(temperature=3.4e38, stop_token_ids=[2**32 - 1]),
        common.SamplingParams(temperature=1e-38),
    ]:
        check_request(_generate(sampling=sampling))


def test_a_tiny_temperature_samples_greedily_instead_of_failing_the_batch():
    torch = pytest.importorskip("torch")
    from monitor_agent.engine.sampling import SamplingConfig, make_generator, sample_token

    logits = torch.randn(64) * 30
    for temperature in (1e-45, 1e-38, 1e-6):
        config = SamplingConfig(temperature=temperature, top_p=0.5)
        assert config.greedy
        assert sample_token(logits, config, make_generator(0)) == int(torch.argmax(logits))


@pytest.mark.parametrize(
    "fields,phrase",
    [
        (dict(prompt="", prompt_token_ids=[]), "empty"),
    ],
)
def test_generate_refuses_hostile_fields(fields, phrase):
    assert phrase in _refused(check_request, _generate(**fields))


def test_no_target_is_invalid_argument():
    assert "model_id or deployment_id" in _refused(
        check_request, infer_pb.GenerateRequest(prompt="hi", max_tokens=1)
    )
    assert "model_id or deployment_id" in _refused(
        check_request, infer_pb.GenerateRequest(deployment_id="", prompt="hi", max_tokens=1)
    )


def test_oversized_requests_for_a_deployment_are_invalid_argument():
    deployment = deploy_pb.Deployment(
        deployment_id="m-0123abcd", max_input_tokens=16, max_output_tokens=8
    )
    # OpenAI's rule: prompt + max_tokens within the sequence (16 + 8): max_input_tokens
    # at the longest output, more where fewer tokens are asked for.
    longest = _generate(prompt_token_ids=[1] * 17, max_tokens=8)
    message = _refused(check_for_deployment, longest, deployment)
    assert "accepts at most 16 (max_input_tokens + max_output_tokens - max_tokens)" in message
    check_for_deployment(_generate(prompt_token_ids=[1] * 20, max_tokens=4), deployment)
    message = _refused(
        check_for_deployment, _generate(prompt_token_ids=[1] * 21, max_tokens=4), deployment
    )
    assert "accepts at most 20 (max_input_tokens + max_output_tokens - max_tokens)" in message
    message = _refused(check_for_deployment, _generate(max_tokens=2**32 - 1), deployment)
    assert "exceeds max_output_tokens 8" in message
    # With max_tokens unset, a prompt may fill the sequence but one token (the worker
    # generates what is left), as a text prompt may.
    unset = _generate(prompt_token_ids=[1] * 23, max_tokens=8)
    check_for_deployment(unset, deployment, max_tokens_is_bound=True)
    unset = _generate(prompt_token_ids=[1] * 24, max_tokens=8)
    message = _refused(check_for_deployment, unset, deployment, max_tokens_is_bound=True)
    assert "accepts at most 23 (max_input_tokens + max_output_tokens - 1" in message


_floats = st.floats(width=32) | st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1.0])


@PROPERTY
@given(
    request_id=st.text(max_size=20),
    target=st.sampled_from(["deployment_id", "model_id"]),
    target_id=st.text(max_size=20),
    prompt=st.text(max_size=20),
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    max_tokens=st.integers(0, 2**32 - 1),
    temperature=_floats,
    top_p=_floats,
    top_k=st.integers(0, 2**32 - 1),
    seed=st.none() | st.integers(0, 2**64 - 1),
    limits=st.tuples(st.integers(0, 32), st.integers(0, 32)),
)
def test_any_generate_request_is_checked_or_invalid_argument(
    request_id,
    target,
    target_id,
    prompt,
    token_ids,
    max_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    limits,
):
    sampling = common.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    if seed is not None:
        sampling.seed = seed
    request = infer_pb.GenerateRequest(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=token_ids,
        max_tokens=max_tokens,
        sampling=sampling,
        **{target: target_id},
    )
    deployment = deploy_pb.Deployment(
        deployment_id="m-0123abcd", max_input_tokens=limits[0], max_output_tokens=limits[1]
    )
    try:
        check_request_id(request.request_id)  # the server's, for every RPC
        check_request(request)
        resolve_max_tokens(request, deployment)
        check_for_deployment(request, deployment)
    except IServeError as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT
        return
    assert request.max_tokens >= 1 and (request.prompt or request.prompt_token_ids)
    assert math.isfinite(request.sampling.temperature) and request.sampling.temperature >= 0
    assert 0 <= request.sampling.top_p <= 1
    assert not request_id or TOKEN_PATTERN.fullmatch(request_id)


# ---- Deploy ---------------------------------------------------------------------------


def _model() -> model_pb.Model:
    return model_pb.Model(
        model_id="m",
        shape=model_pb.ModelShape(
            num_layers=4,
            num_attention_heads=8,
            num_kv_heads=4,
            head_dim=32,
            hidden_size=256,
            intermediate_size=512,
            max_position_embeddings=2048,
            weight_bytes=1 << 20,
            dtype=common.PRECISION_FLOAT32,
        ),
    )


def _explicit(**config):
    return resolve_explicit(
        _model(),
        common.DeploymentConfig(**config),
        batch_size=0,
        max_input_tokens=0,
        max_output_tokens=0,
    )


@pytest.mark.parametrize(
    "config,phrase",
    [
        (dict(dtype=42), "dtype 42 is not a known"),
        (dict(weight_quant=42), "weight_quant 42"),
        (dict(kv_quant=9), "kv_quant 9"),
        (dict(pruning=-3), "pruning -3"),
        (dict(tensor_parallel=2**32 - 1), "tensor_parallel"),
        (dict(pipeline_parallel=2**32 - 1), "pipeline_parallel"),
        (dict(batch_size=2**32 - 1), "batch_size"),
    ],
)
def test_unknown_enum_values_and_absurd_sizes_in_a_config_are_invalid_argument(config, phrase):
    assert phrase in _refused(_explicit, **config)


@pytest.mark.parametrize(
    "objectives,intent,phrase",
    [
        (dict(scheduling=42), dict(kind=common.INTENT_KIND_MIN_COST), "scheduling policy 42"),
        ({}, dict(kind=42), "intent kind"),
        ({}, dict(kind=common.INTENT_KIND_MIN_COST, cost_formula=-1), "cost formula"),
        ({}, dict(kind=common.INTENT_KIND_LATENCY_SLO), "positive latency_slo_ms"),
        ({}, dict(kind=common.INTENT_KIND_LATENCY_SLO, latency_slo_ms=math.inf), "at most"),
        ({}, dict(kind=common.INTENT_KIND_LATENCY_SLO, latency_slo_ms=math.nan), "latency"),
        ({}, dict(kind=common.INTENT_KIND_LATENCY_SLO, latency_slo_ms=1e300), "at most"),
        ({}, dict(kind=common.INTENT_KIND_COST_SLO, cost_budget=math.inf), "cost_budget"),
        ({}, dict(kind=common.INTENT_KIND_COST_SLO, cost_budget=-1), "cost_budget"),
        (
            {},
            dict(kind=common.INTENT_KIND_MIN_COST, min_accuracy=math.nan),
            "min_accuracy",
        ),
    ],
)
def test_hostile_intents_and_objectives_are_invalid_argument(objectives, intent, phrase):
    message = _refused(
        resolve_objectives, common.ServiceObjectives(**objectives), common.Intent(**intent)
    )
    assert phrase in message


@PROPERTY
@given(
    config=st.fixed_dictionaries(
        {
            "tensor_parallel": st.integers(0, 2**32 - 1),
            "pipeline_parallel": st.integers(0, 2**32 - 1),
            "weight_quant": st.integers(-(2**31), 2**31 - 1),
            "kv_quant": st.integers(-(2**31), 2**31 - 1),
            "pruning": st.integers(-(2**31), 2**31 - 1),
            "dtype": st.integers(-(2**31), 2**31 - 1),
            "batch_size": st.integers(0, 2**32 - 1),
        }
    ),
    intent=st.fixed_dictionaries(
        {
            "kind": st.integers(-3, 9),
            "cost_formula": st.integers(-3, 9),
            "latency_slo_ms": st.floats(),
            "cost_budget": st.floats(),
        }
    ),
    scheduling=st.integers(-(2**31), 2**31 - 1),
)
def test_any_deploy_config_and_intent_resolve_or_are_refused(config, intent, scheduling):
    try:
        _explicit(**config)
    except IServeError as exc:
        assert exc.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED)
    try:
        resolved = resolve_objectives(
            common.ServiceObjectives(scheduling=scheduling), common.Intent(**intent)
        )
    except IServeError as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT
    else:
        assert resolved.scheduling in common.SchedulingPolicy.values()
        assert resolved.scheduling != common.SCHEDULING_POLICY_UNSPECIFIED
