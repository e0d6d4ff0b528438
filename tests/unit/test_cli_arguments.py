"""The CLI's numeric options refuse what their requests cannot carry, before sending."""

from __future__ import annotations

import argparse
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.cli.arguments import positive_number, whole_number
from services.cli.main import PRESET_NAMES, build_parser
from services.models.presets import PRESETS
from services.proto_limits import UINT32_MAX, UINT64_MAX


@given(st.integers(min_value=-(2**70), max_value=2**70))
def test_whole_numbers_in_range_pass_and_others_are_refused(value):
    parse = whole_number()
    if 1 <= value <= UINT32_MAX:
        assert parse(str(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="from 1 to 4294967295"):
            parse(str(value))


@pytest.mark.parametrize("text", ["", "1e3", "2.0", "0x10", "ten", "nan", " "])
def test_what_is_not_a_whole_number_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="must be a whole number"):
        whole_number(0)(text)


def test_the_bounds_are_the_fields_own():
    assert whole_number(0)("0") == 0
    assert whole_number(0, UINT64_MAX)(str(UINT64_MAX)) == UINT64_MAX
    with pytest.raises(argparse.ArgumentTypeError):
        whole_number(0, UINT64_MAX)(str(UINT64_MAX + 1))


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "-inf", "x", ""])
def test_a_positive_number_is_finite_and_above_zero(text):
    with pytest.raises(argparse.ArgumentTypeError, match="finite number above 0"):
        positive_number(text)
    assert positive_number("0.5") == 0.5


@pytest.mark.parametrize(
    "argv, option",
    [
        (["estimate", "m", "--hardware", "h", "--output-len", "-1"], "--output-len"),
        (
            ["estimate", "m", "--hardware", "h", "--output-len", "9", "--input-len", "0"],
            "--input-len",
        ),
        (["estimate", "m", "--hardware", "h", "--output-len", "9", "--batch", "1e3"], "--batch"),
        (["deploy", "m", "--tp", "-1"], "--tp"),
        (["deploy", "m", "--replicas", "0"], "--replicas"),
        (["deploy", "m", "--ttft-slo-ms", "0"], "--ttft-slo-ms"),
        (["deploy", "m", "--max-input", "99999999999"], "--max-input"),
        (["generate", "d", "hi", "--max-tokens", "-1"], "--max-tokens"),
        (["generate", "d", "hi", "--seed", "-3"], "--seed"),
        (["generate", "d", "hi", "--top-k", "-3"], "--top-k"),
        (["plan", "m", "--device-memory", "nan"], "--device-memory"),
        # Beyond what a request's uint64 of bytes carries, or rounding to nothing.
        (["plan", "m", "--device-memory", "1e300"], "--device-memory"),
        (["plan", "m", "--device-memory", "1.8e10"], "--device-memory"),
        (["plan", "m", "--device-memory", "1e-300"], "--device-memory"),
        (["up", "--device-memory", "1e300"], "--device-memory"),
        (["plan", "m", "--hardware", "h", "--devices", "4097"], "--devices"),
        (["up", "--devices", "0"], "--devices"),
        (["model", "create", "x", "--layers", "0", "--out", "d"], "--layers"),
        # A refresh period sleep can take: not negative, NaN, infinite (a traceback).
        (["status", "--watch", "-1"], "--watch"),
        (["status", "--watch", "nan"], "--watch"),
        (["status", "--watch", "inf"], "--watch"),
        # Each refresh asks every service: 1e-9 redrew thousands of times a minute.
        (["status", "--watch", "1e-9"], "--watch"),
        (["model", "create", "x", "--layers", "1", "--out", ""], "--out"),
    ],
)
def test_the_parser_names_the_option_and_exits_2(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert f"argument {option}: must be a" in capsys.readouterr().err


def test_replicas_are_refused_beyond_the_servers_limit_with_that_limit(capsys):
    """``--replicas 0`` said "from 1 to 4294967295" though 17 is refused by the server."""
    for count in ("0", "17"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["deploy", "m", "--replicas", count])
        assert "argument --replicas: must be a whole number from 1 to 16" in capsys.readouterr().err
    assert build_parser().parse_args(["deploy", "m", "--replicas", "16"]).replicas == 16


def test_defaults_still_mean_the_servers_default():
    args = build_parser().parse_args(["estimate", "m", "--hardware", "h", "--output-len", "9"])
    assert (args.input_len, args.batch, args.devices) == (0, 0, 0)
    args = build_parser().parse_args(["generate", "d", "hi", "--seed", str(UINT64_MAX)])
    assert args.seed == UINT64_MAX


def test_the_preset_help_lists_every_preset():
    assert tuple(PRESETS) == PRESET_NAMES


def test_an_argument_that_is_not_utf8_is_named(capsys):
    # A shell passes bytes; Python turns the ones that are not UTF-8 into lone surrogates,
    # which no request can carry. The CLI says so before connecting to anything.
    from services.cli.main import main

    assert main(["generate", "d", "a\udcff\udcfe"]) == 1
    assert "an argument is not UTF-8 text (bytes b'\\xff\\xfe')" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("dtype", "precision"),
    [
        ("float32", "PRECISION_FLOAT32"),
        ("bfloat16", "PRECISION_BFLOAT16"),
        ("float16", "PRECISION_FLOAT16"),  # a GPU's; the deployer refuses it on CPUs
    ],
)
def test_every_precision_the_engines_serve_can_be_asked_for(dtype, precision):
    from services.api import common_pb2 as common
    from services.cli.deploying import request_target

    args = build_parser().parse_args(["deploy", "m", "--dtype", dtype])
    assert request_target(args)["config"].dtype == getattr(common, precision)


def test_a_variant_named_alone_leaves_its_compression_to_it():
    """`--variant int4` without --weight-quant sent weight_quant NONE, which contradicted
    the variant's INT4: every compressed variant named alone was refused (a probe)."""
    from deploy_svc.explicit import apply_variant
    from services.api import common_pb2 as common
    from services.api import model_service_pb2 as model_pb
    from services.cli.deploying import request_target

    config = request_target(build_parser().parse_args(["deploy", "m", "--variant", "int4"]))[
        "config"
    ]
    assert (config.weight_quant, config.kv_quant, config.pruning) == (0, 0, 0)
    int4 = common.CompressionVariant(name="int4", weight_quant=common.WEIGHT_QUANT_INT4)
    model = model_pb.Model(model_id="m", variants=[int4])
    apply_variant(model, config)
    assert config.weight_quant == common.WEIGHT_QUANT_INT4
    given = request_target(
        build_parser().parse_args(["deploy", "m", "--variant", "int4", "--weight-quant", "int8"])
    )["config"]
    with pytest.raises(Exception, match="WEIGHT_QUANT_INT8 contradicts variant 'int4'"):
        apply_variant(model, given)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["deploy", "m", "--intent", "latency-slo"], "--intent latency-slo needs --slo-ms"),
        (["deploy", "m", "--intent", "cost-slo"], "--intent cost-slo needs --budget"),
        (["deploy", "m", "--tp", "1", "--intent", "min-cost"], "--tp and --intent do not mix"),
    ],
)
def test_options_that_do_not_go_together_are_usage_errors(argv, says, capsys):
    """Exit 2 with "error: …", as argparse's own refusals (exit 1 without the prefix
    before), and nothing sent."""
    from services.cli import deploying

    with pytest.raises(SystemExit) as exit_info:
        deploying.request_target(build_parser().parse_args(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: iserve deploy: ") and says in err


def test_a_profile_file_that_cannot_be_read_is_named_and_nothing_is_sent(tmp_path, capsys):
    """A directory or a missing path given as FILE: 'cannot read' with the path and the
    reason (a bare "[Errno 21]" before), exit 1, before any service is asked."""
    from services.cli.main import main

    for path, reason in ((tmp_path, "Is a directory"), (tmp_path / "no.csv", "No such file")):
        code = main(["profile", "import", "--format", "maveriq", "--hardware", "h", str(path)])
        assert code == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: cannot read '{path}': {reason}"), err


def test_a_file_that_never_ends_is_refused_before_it_is_read(tmp_path, capsys):
    """/dev/zero as a profile file grew the CLI to 9.8 GB in 7 s, and as a model config
    the kernel killed it (a tester): neither is a regular file. A config over its bound
    or not UTF-8 is named too."""
    import resource

    from services.cli.main import main

    csv = tmp_path / "full_model_data_collection.csv"
    csv.write_text("Model\n")
    big, binary = tmp_path / "big.json", tmp_path / "binary.json"
    with big.open("wb") as out:
        out.truncate(5 << 20)
    binary.write_bytes(b"{\xff}")
    cases = [
        ([os.devnull], f"error: the file '{os.devnull}' is not a regular file"),
        ([str(csv), "--model-config", "m=/dev/zero"], "error: --model-config '/dev/zero' is not"),
        ([str(csv), "--model-config", f"m={big}"], f"error: --model-config '{big}' is 5.0 MiB"),
        ([str(csv), "--model-config", f"m={binary}"], f"--model-config '{binary}' is not UTF-8"),
    ]
    if os.path.exists("/dev/zero"):
        cases.append((["/dev/zero"], "error: the file '/dev/zero' is not a regular file"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for argv, says in cases:
        code = main(["profile", "import", "--format", "maveriq", "--hardware", "h", *argv])
        assert code == 1
        err = capsys.readouterr().err
        assert err.startswith(says) or says in err, err
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB


def test_profile_files_beyond_one_message_are_refused_before_sending(tmp_path, capsys):
    """Files larger together than one gRPC message: a clear error saying what to do, not
    gRPC's "RESOURCE_EXHAUSTED: Sent message larger than max"."""
    from services.cli.main import main

    big = tmp_path / "fingerprint_data_collection.csv"
    with big.open("wb") as out:
        out.truncate(64 << 20)  # sparse: no 64 MiB written
    code = main(["profile", "import", "--format", "maveriq", "--hardware", "h", str(big)])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: '{big}' is 64.0 MiB, over the 63 MiB one import carries")
    halves = [tmp_path / "full_model_data_collection.csv", tmp_path / "BS_scaling_data.csv"]
    for half in halves:
        with half.open("wb") as out:
            out.truncate(32 << 20)
    code = main(["profile", "import", "--format", "maveriq", "--hardware", "h", *map(str, halves)])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "error: the files are 64.0 MiB together; one import carries at most 63 MiB"
    )
    assert "import them a file at a time" in err


def test_a_checkpoint_relative_to_the_current_directory_is_sent_absolute(tmp_path, monkeypatch):
    """`iserve model create --out DIR` writes DIR relative to the current directory, and
    `iserve register ID DIR` reads paths relative to the models root: a directory found
    only under the current one is sent absolute (the service takes it inside its root and
    refuses it naming the root outside)."""
    from services.cli.main import checkpoint_argument

    root, work = tmp_path / "models", tmp_path / "work"
    (root / "both").mkdir(parents=True)
    (work / "both").mkdir(parents=True)
    (work / "here").mkdir()
    monkeypatch.chdir(work)
    assert checkpoint_argument("here", root) == str(work / "here")
    assert checkpoint_argument("./here/", root) == str(work / "here")
    assert checkpoint_argument("both", root) == "both"  # under the root wins
    assert checkpoint_argument("missing", root) == "missing"  # the service says where
    assert checkpoint_argument(str(work / "here"), root) == str(work / "here")
    monkeypatch.chdir(root)
    assert checkpoint_argument("both", root) == "both"
    # A file given for a checkpoint is named as one before anything is sent.
    (work / "file.json").write_text("{}")
    monkeypatch.chdir(work)
    with pytest.raises(ValueError, match="'file.json' is a file: a checkpoint is the directory"):
        checkpoint_argument("file.json", root)


@pytest.mark.parametrize("text", ["", ",", ",,", "a,,b", "a,", " , "])
def test_an_id_list_with_an_empty_entry_is_refused(text):
    """`iserve calibrate --models ,,` named no model and refitted every model's data."""
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["calibrate", "--hardware", "h", "--models", text])
    assert exit_.value.code == 2
    assert parser.parse_args(["calibrate", "--hardware", "h", "--models", "a, b"]).models == [
        "a",
        "b",
    ]


def test_a_terminal_that_is_not_utf8_gets_question_marks_not_an_error(tmp_path):
    # The checkpoint's path (a model's output likewise) is text the terminal cannot show:
    # the command did its work and says so, instead of failing as if an argument were bad.
    import os
    import subprocess
    import sys

    out = tmp_path / "modèle"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "model",
            "create",
            "tiny",
            "--arch",
            "llama",
            "--hidden",
            "64",
            "--layers",
            "2",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--out",
            str(out),
        ],
        env={**os.environ, "PYTHONIOENCODING": "ascii"},
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert b"mod?le" in result.stdout
    assert (out / "config.json").is_file()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--best-available"], "--best-available goes with --min-accuracy"),
        (["--budget", "5"], "--budget goes with --intent cost-slo, not min-cost"),
        (["--intent", "min-latency", "--cost", "memory"], "--cost goes with --intent min-cost"),
        (["--intent", "min-cost", "--slo-ms", "100"], "--slo-ms goes with --intent latency-slo"),
    ],
)
def test_a_deploy_flag_its_intent_does_not_use_is_refused_not_ignored(flags, says, capsys):
    # They used to be dropped in silence, and --best-available alone launched a deployment.
    from services.cli.deploying import request_target

    with pytest.raises(SystemExit) as exited:
        request_target(build_parser().parse_args(["deploy", "m", *flags]))
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_the_flags_an_intent_uses_pass():
    from services.cli.deploying import request_target

    for flags in (
        ["--intent", "cost-slo", "--budget", "5", "--cost", "memory"],
        ["--intent", "latency-slo", "--slo-ms", "900", "--cost", "device-hours"],
        ["--min-accuracy", "95", "--best-available"],
    ):
        assert "intent" in request_target(build_parser().parse_args(["deploy", "m", *flags]))


def test_ctrl_c_while_register_watches_says_profiling_goes_on(monkeypatch, tmp_path, capsys):
    import types

    from services.api import model_service_pb2 as model_pb
    from services.cli import main as cli_main
    from services.settings import load_settings

    profiling = model_pb.Model(model_id="m", state=model_pb.MODEL_STATE_PROFILING)
    stub = types.SimpleNamespace(
        RegisterModel=lambda request: model_pb.RegisterModelResponse(model=profiling)
    )
    monkeypatch.setattr(cli_main, "_stub", lambda *_: stub)

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "_watch_profiling", interrupted)
    (tmp_path / "models" / "ckpt").mkdir(parents=True)
    settings = load_settings({"ISERVE_STATE_DIR": str(tmp_path)})
    args = build_parser().parse_args(["register", "m", str(tmp_path / "models" / "ckpt")])
    assert cli_main.cmd_register(settings, args) == 130
    err = capsys.readouterr().err
    assert "m is still being profiled on the stack (`iserve models` shows its state" in err


def test_register_whose_stack_stops_right_after_profiling_says_it_was_profiled(
    monkeypatch, tmp_path, capsys
):
    """The watch saw PROFILED, then the stack stopped before GetModel: the model is
    stored profiled, and register exited 1 with UNAVAILABLE (a tester)."""
    import types

    import grpc

    from services.api import model_service_pb2 as model_pb
    from services.cli import main as cli_main
    from services.settings import load_settings

    class Gone(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "failed to connect to all addresses"

    profiling = model_pb.Model(model_id="m", state=model_pb.MODEL_STATE_PROFILING)
    answer = [grpc.StatusCode.UNAVAILABLE]

    def get_model(request):
        raise Gone(answer[0])

    stub = types.SimpleNamespace(
        RegisterModel=lambda request: model_pb.RegisterModelResponse(model=profiling),
        GetModel=get_model,
    )
    monkeypatch.setattr(cli_main, "_stub", lambda *_: stub)
    last = [model_pb.WatchModelResponse(state=model_pb.MODEL_STATE_PROFILED)]
    monkeypatch.setattr(cli_main, "_watch_profiling", lambda *_: last[0])
    (tmp_path / "models" / "ckpt").mkdir(parents=True)
    settings = load_settings({"ISERVE_STATE_DIR": str(tmp_path)})
    args = build_parser().parse_args(["register", "m", str(tmp_path / "models" / "ckpt")])
    assert cli_main.cmd_register(settings, args) == 0
    captured = capsys.readouterr()
    assert "m: PROFILED" in captured.out
    assert "note: m was profiled, but its record could not be read since (UNAVAILABLE" in (
        captured.err
    )
    # A failure the watch did not see end well, or another status, is the error it was.
    for watched, code in (
        (model_pb.MODEL_STATE_FAILED, grpc.StatusCode.UNAVAILABLE),
        (model_pb.MODEL_STATE_PROFILED, grpc.StatusCode.PERMISSION_DENIED),
    ):
        last[0] = model_pb.WatchModelResponse(state=watched)
        answer[0] = code
        with pytest.raises(Gone):
            cli_main.cmd_register(settings, args)


def test_model_create_names_its_flags_not_config_fields(tmp_path, capsys):
    from services.cli.main import main

    shape = ["--arch", "llama", "--hidden", "64", "--layers", "2", "--heads", "4"]
    out = str(tmp_path / "ckpt")
    assert main(["model", "create", "x", *shape, "--kv-heads", "8", "--out", out]) == 1
    assert "--heads (4) is not divisible by --kv-heads (8)" in capsys.readouterr().err
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert main(["model", "create", "x", *shape, "--out", str(a_file / "ckpt")]) == 1
    assert "cannot write there (Not a directory)" in capsys.readouterr().err


def test_model_create_says_when_the_vocabulary_outgrows_its_tokenizer(tmp_path, capsys):
    """A --vocab 32000 model's generations printed no text at all (exit 0): random
    weights sample ids past the bundled tokenizer's, which decode to nothing."""
    from services.cli.main import main
    from services.models.checkpoint import tokenizer_size

    shape = ["--arch", "llama", "--hidden", "64", "--layers", "1", "--heads", "4"]
    assert main(["model", "create", "x", *shape, "--out", str(tmp_path / "a")]) == 0
    assert "note:" not in capsys.readouterr().err
    known = tokenizer_size(tmp_path / "a")
    argv = ["model", "create", "x", *shape, "--vocab", "32000", "--out", str(tmp_path / "b")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"the vocabulary has 32000 ids and the bundled tokenizer {known}" in err
    assert "decode to no text" in err


def test_generate_says_why_its_output_is_empty():
    from services.cli.main import generation_notes

    [note] = generation_notes(8, text_shown=False)
    assert note.startswith("the 8 token(s) generated decode to no text")
    assert generation_notes(8, text_shown=True) == []
    assert generation_notes(0, text_shown=False) == []  # nothing generated: nothing to say


def test_every_subcommands_help_says_what_it_does():
    # A subparser's help= shows only in its parent's list; its own --help had no line.
    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, subparser in action.choices.items():
                    yield (*path, name), subparser
                    yield from walk(subparser, (*path, name))

    undescribed = [" ".join(p) for p, sub in walk(build_parser(), ()) if not sub.description]
    assert undescribed == []
    assert "``" not in build_parser().format_help()


@pytest.mark.parametrize("command", [["deploy", "m"], ["plan", "m"]])
@pytest.mark.parametrize(
    "flags",
    [
        ["--intent", "cost-slo", "--budget", "0"],
        ["--intent", "cost-slo", "--budget", "-1"],
        ["--intent", "latency-slo", "--slo-ms", "-5"],
        ["--intent", "latency-slo", "--slo-ms", "nan"],
    ],
)
def test_a_target_that_is_no_positive_number_is_a_usage_error_naming_its_flag(
    command, flags, capsys
):
    """`--slo-ms -5` was sent, and refused by the deployer naming its proto field
    (latency_slo_ms, exit 1); `--budget 0` before that was called missing."""
    flags = flags if command[0] == "deploy" else flags[2:]
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args([*command, *flags])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flags[-2]}: must be a finite number above 0" in err


@pytest.mark.parametrize("timeout", ["1e308", "4294968", "0", "inf"])
def test_a_deploy_timeout_beyond_what_the_request_carries_is_a_usage_error(timeout, capsys):
    """1e308 printed a traceback (OverflowError) and 4294968 "Value out of range:
    4294968000" without the flag (a tester)."""
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["deploy", "m", "--timeout", timeout])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "argument --timeout: must be " in err, err
    assert build_parser().parse_args(["deploy", "m", "--timeout", "4294967"]).timeout == 4294967


def test_up_refuses_a_variable_iserve_reads_set_in_the_wrong_case(tmp_path, monkeypatch, capsys):
    """ISERVE_Auth=on brought the stack up open (a warning among the start-up lines): a
    known name in the wrong case stops `iserve up` before anything starts."""
    from services.cli.main import main

    monkeypatch.setenv("ISERVE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ISERVE_Auth", "on")
    assert main(["up", "--detach"]) == 1
    err = capsys.readouterr().err
    assert "ISERVE_Auth is set but no iserve process reads it; did you mean ISERVE_AUTH?" in err
    assert "error: a variable iserve reads is set in the wrong case" in err
    assert not (tmp_path / "state" / "stack.json").exists()


@pytest.mark.parametrize(
    ("argv", "usage", "unknown"),
    [
        (["generate", "d", "hi", "--tp", "1"], "usage: iserve generate", "--tp 1"),
        (["models", "--model", "m"], "usage: iserve models", "--model m"),
        (["token", "revoke", "abc", "--zz"], "usage: iserve token revoke", "--zz"),
    ],
)
def test_an_unknown_flag_is_refused_with_its_commands_usage(argv, usage, unknown, capsys):
    """The top-level usage (`iserve [-h] COMMAND ...`) said nothing of what the command
    takes."""
    from services.cli.main import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and f"unrecognized arguments: {unknown}\n" in err


def test_a_ctrl_c_during_deploy_says_what_became_of_it(tmp_path, monkeypatch, capsys):
    """It exited 130 in silence, the user left to guess whether something was deployed."""
    from services.cli import main as cli_main

    class Stub:
        def Deploy(self, request):
            raise KeyboardInterrupt

    monkeypatch.setenv("ISERVE_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(cli_main, "_stub", lambda *args: Stub())
    assert cli_main.main(["deploy", "m", "--tp", "1"]) == 130
    err = capsys.readouterr().err
    assert "deploy interrupted: the deployer rolls back a Deploy cancelled before it" in err
    assert "`iserve deployments` shows whether this one had finished" in err


def test_a_deploy_answered_with_a_failed_deployment_does_not_say_deployed(
    tmp_path, monkeypatch, capsys
):
    """A repeat of a request id is answered with its deployment as it stands: a FAILED
    one printed "deployed m tp=2 ...; worker " and exit 0 (a probe)."""
    from services.api import deployment_service_pb2 as deploy_pb
    from services.cli import main as cli_main

    failed = deploy_pb.Deployment(
        deployment_id="m-1",
        model_id="m",
        state=deploy_pb.DEPLOYMENT_STATE_FAILED,
        state_reason="the deployer restarted while the deployment was starting",
    )

    class Stub:
        def Deploy(self, request):
            return deploy_pb.DeployResponse(deployment=failed)

    monkeypatch.setenv("ISERVE_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(cli_main, "_stub", lambda *args: Stub())
    assert cli_main.main(["deploy", "m", "--tp", "1", "--request-id", "r-1"]) == 1
    out, err = capsys.readouterr()
    assert out == "m-1\n" and "deployed" not in err
    assert err == (
        "deployment m-1 of this request id is FAILED: the deployer restarted while the "
        "deployment was starting\n"
    )


def test_a_ctrl_c_while_the_parser_is_built_ends_with_130_and_no_traceback(monkeypatch):
    """The quiet Ctrl-C covered the imports and the command, not the parsing between."""
    from services.cli import main as cli_main

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "build_parser", interrupted)
    assert cli_main.main(["status"]) == 130


def test_a_ctrl_c_during_generate_ends_the_text_line(tmp_path, monkeypatch, capsys):
    """The shell's prompt came after the last words of the text."""
    from services.api import deployment_service_pb2 as deploy_pb
    from services.api import inference_service_pb2 as inference_pb
    from services.cli import main as cli_main

    def stream(request):
        yield inference_pb.GenerateResponse(delta=inference_pb.TokenDelta(text="Hello"))
        raise KeyboardInterrupt

    class Stub:
        Generate = staticmethod(stream)

        def ListDeployments(self, request, timeout=None):  # no model "d"
            return deploy_pb.ListDeploymentsResponse()

        def GetDeployment(self, request, timeout=None):  # "d" is a deployment's id
            return None

    monkeypatch.setenv("ISERVE_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(cli_main, "_stub", lambda *args: Stub())
    assert cli_main.main(["generate", "d", "hi"]) == 130
    out, err = capsys.readouterr()
    assert out == "Hello\n" and err == "generation interrupted\n"


def test_a_generation_past_its_deadline_says_so(tmp_path, monkeypatch, capsys):
    """An FCFS deployment served a 1 ms deadline in 1183 ms, and the CLI said nothing."""
    from services.api import deployment_service_pb2 as deploy_pb
    from services.api import inference_service_pb2 as inference_pb
    from services.cli import main as cli_main

    def stream(request):
        yield inference_pb.GenerateResponse(delta=inference_pb.TokenDelta(text="Hi"))
        final = inference_pb.GenerateFinal(deployment_id="d")
        final.timings.total_ms = 1183
        yield inference_pb.GenerateResponse(final=final)

    class Stub:
        Generate = staticmethod(stream)

        def ListDeployments(self, request, timeout=None):  # no model "d"
            return deploy_pb.ListDeploymentsResponse()

        def GetDeployment(self, request, timeout=None):
            return None

    monkeypatch.setenv("ISERVE_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(cli_main, "_stub", lambda *args: Stub())
    assert cli_main.main(["generate", "d", "hi", "--deadline-ms", "1"]) == 0
    out, err = capsys.readouterr()
    assert "total 1183 ms (past its 1 ms deadline);" in err
    # The text is a whole line on stdout; the summary starts its own line on stderr.
    assert out == "Hi\n" and err.startswith("[0 tokens, "), (out, err)
    assert cli_main.main(["generate", "d", "hi", "--deadline-ms", "2000"]) == 0
    assert "deadline" not in capsys.readouterr().err


def test_estimate_without_hardware_takes_the_only_profiled_type_or_says_which(capsys):
    from services.cli.estimation import only_hardware

    assert only_hardware("m", {"cpu-x86_64"}) == "cpu-x86_64"
    for kinds, says in (
        (set(), "model 'm' is not profiled yet"),
        ({"rtx-a6000", "cpu-x86_64"}, "profiled on cpu-x86_64, rtx-a6000: choose one"),
    ):
        with pytest.raises(SystemExit) as exited:
            only_hardware("m", kinds)
        assert exited.value.code == 2 and says in capsys.readouterr().err


def test_a_state_directory_that_cannot_be_made_says_how_to_move_it(tmp_path, monkeypatch, capsys):
    """With HOME under a regular file, `iserve status` failed with a bare errno naming
    ~/.iserve/stack.json; it now says to set ISERVE_STATE_DIR."""
    import os

    from services.cli import main as cli_main

    (tmp_path / "file").write_text("")
    for name in [n for n in os.environ if n.startswith("ISERVE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "file" / "home"))
    assert cli_main.main(["status"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: state directory ") and "(" in err, err
    assert "Not a directory): set ISERVE_STATE_DIR to a writable directory" in err


def test_register_takes_compression_variants():
    from services.api import common_pb2 as common

    args = build_parser().parse_args(
        [
            "register",
            "m",
            "ckpt",
            "--variant",
            "int8-kv8:weights=int8,kv=int8,accuracy=45.5",
            "--variant",
            "pruned:pruning=structured,fraction=0.25",
            "--variant",
            "sparse:pruning=2:4",
        ]
    )
    first, second, third = args.variant
    assert (first.name, first.weight_quant, first.kv_quant) == (
        "int8-kv8",
        common.WEIGHT_QUANT_INT8,
        common.KV_QUANT_INT8,
    )
    assert first.accuracy_score == 45.5 and first.HasField("accuracy_score")
    assert (second.pruning, second.structured_prune_fraction) == (common.PRUNING_STRUCTURED, 0.25)
    assert not second.HasField("accuracy_score")
    assert third.pruning == common.PRUNING_SEMI_STRUCTURED_2_4
    assert build_parser().parse_args(["register", "m", "ckpt"]).variant == []


@pytest.mark.parametrize(
    "text, says",
    [
        ("int8", "give NAME:KEY=VALUE"),
        (":weights=int8", "give NAME:KEY=VALUE"),
        ("v:weights=int3", "weights must be one of none, int8, int4, got 'int3'"),
        ("v:kv=int4", "kv must be one of none, int8"),
        ("v:bits=8", "'bits=8' is not KEY=VALUE"),
        ("v:weights", "'weights' is not KEY=VALUE"),
        ("v:fraction=half", "fraction must be a number, got 'half'"),
        ("v:accuracy=nan", "accuracy must be a number"),
        ("v:", "variant 'v' names no compression"),
        ("v:weights=int8,weights=int4", "variant 'v': weights is given twice"),
    ],
)
def test_a_malformed_variant_is_a_usage_error(text, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["register", "m", "ckpt", "--variant", text])
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def test_top_p_0_is_greedy_as_over_http():
    """`--top-p 0` sampled (the message's 0 reads "unset"), where HTTP's top_p 0 is greedy."""
    from services.cli.main import sampling_of

    def sampling(*options):
        return sampling_of(build_parser().parse_args(["generate", "d", "hi", *options]))

    hot = ("--temperature", "1", "--seed", "3")
    assert (sampling(*hot, "--top-p", "0").temperature, sampling(*hot, "--top-p", "0").top_p) == (
        0.0,
        1.0,
    )
    assert sampling(*hot, "--top-p", "1e-50").temperature == 0.0  # 0 as a float32
    kept = sampling(*hot, "--top-p", "0.5")
    assert (kept.temperature, kept.top_p, kept.seed) == (1.0, 0.5, 3)


@pytest.mark.parametrize("command", ["model", "profile", "token"])
def test_a_command_without_its_action_names_it_as_the_others_do(command, capsys):
    """`iserve model` alone said "required: model_command", an internal name (a probe)."""
    from services.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main([command])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "the following arguments are required: ACTION" in err and "_command" not in err


def test_an_option_before_any_command_is_named(capsys):
    """`iserve --bogus` said "required: COMMAND", not naming the flag (a probe)."""
    from services.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["--bogus", "status"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_an_abbreviated_option_is_not_taken(capsys):
    """``--max`` was taken for ``--max-tokens``: a script using it would break, or change
    meaning, once another option began so (a tester)."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "d", "hi", "--max", "3"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --max 3" in capsys.readouterr().err
    assert build_parser().parse_args(["generate", "d", "hi", "--max-tokens", "3"]).max_tokens == 3
    assert build_parser().parse_args(["status", "--watch", "0.1"]).watch == 0.1


def test_model_create_names_a_checkpoint_by_a_model_id_and_writes_it_under_the_models_root(
    tmp_path, monkeypatch, capsys
):
    """NAME was only printed, so "" and "Bad Name" were taken (a tester): it is the
    directory under the models root a checkpoint goes to without --out, which register
    then finds by that name."""
    from services.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["model", "create", "Bad Name", "--layers", "1"])
    assert exit_info.value.code == 2
    assert "argument name: 'Bad Name': use 1-64 lowercase" in capsys.readouterr().err
    monkeypatch.setenv("ISERVE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("ISERVE_MODELS_ROOT", raising=False)
    shape = ["--layers", "1", "--hidden", "32", "--heads", "4"]
    assert main(["model", "create", "tiny-one", *shape]) == 0
    assert (tmp_path / "state" / "models" / "tiny-one" / "config.json").is_file()
    assert f"to {tmp_path / 'state' / 'models' / 'tiny-one'}:" in capsys.readouterr().out
