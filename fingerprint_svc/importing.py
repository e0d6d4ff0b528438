"""ImportProfiles: measurements taken elsewhere become models' profiles.

The MaverIQ format (``PROFILE_FORMAT_MAVERIQ``) is the data set published with MaverIQ
(8 x RTX A6000, TensorRT-LLM): CSV files of fingerprint and full-model runs and a JSON
table of relative MMLU accuracy. :func:`plan_maveriq_import` parses every file first and
decides everything (pure: a malformed file raises InvalidArgument naming file and line
before anything is written); :func:`import_profiles` then writes:

* a shape-only model record per model of the CSVs (``llama-2-7b``, ``gptj-6b``, …), its
  shape from the model's config.json when the request gives one (``model_configs``),
  else from the architecture preset its name denotes (``Llama-2-70B`` and
  ``meta-llama/Llama-2-70b-hf`` denote ``llama-2-70b``; the model id is the name in lower
  case, or the preset's name where that is no valid id, and a note says so); state
  PROFILED, no checkpoint, with one compression
  variant per (weight quantization, int8 KV cache) measured and its accuracy when the
  JSON is included; an existing record keeps its state and gains missing variants;
* the rows into the model's profile: fingerprint rows, and full-model rows with
  ``full_model = true``, each naming its file (``source_file``). Of the profile's rows of
  this hardware type, those of the files imported are replaced and those of other files
  kept, so the data set imported a file at a time is the data set imported at once (rows
  that name no file, iserve's own profiling on this hardware type, are replaced: the two
  engines' rows are not mixed); rows of other hardware types are kept;
* where the rows came from (format, files, date) per hardware type, for provenance.

Rows are checked against the model they are for, naming file and line: a tensor
parallelism its heads cannot split (or outside TENSOR_PARALLEL_DEGREES), a prompt plus
output beyond its context and a batch size the estimator cannot extrapolate (a
fingerprint beyond batch 2, a batch above 1 in a file of batch-1 runs) are refused, as
are two rows of one run at the same output length or whose latencies no run gives
(``SERIES_SLACK``), an import that takes every estimate away from a model that had them
(a note says when a model has none yet), and, in any model, a row with more fields
than the header, a latency over a day, memory
over a pebibyte and a batch above MAX_BATCH_SIZE (``services.importers.maveriq``), and an
import that would leave a model with more than ``services.importers.MAX_PROFILE_MEASUREMENTS``
rows. A
shape-only record whose imported shape changes (a corrected ``--model-config``) takes
the new shape when the import replaces every row it has; a registered checkpoint's shape
never changes.

How a CSV row maps to a :class:`ProfileMeasurement`: latency is end to end
(``latency_ms``; TTFT and TPOT stay 0, MaverIQ did not time tokens); the memory figure
(``Memory-After-Run``, summed over the GPUs) is split evenly over the tp * pp ranks;
``input_tokens`` is 923 for the two files whose prompt the data set documents and 0
(not recorded) for the short-prompt files; repetitions 3 (mean of 3 runs).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fingerprint_svc.registry import model_shape
from services import importers
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.auth import access
from services.engine_rules import resolve_checkpoint, tensor_parallel_problem
from services.errors import FailedPrecondition, InvalidArgument, shown
from services.estimation import model_references, profiles
from services.estimation.latency import REFERENCE_BATCHES
from services.estimation.memory import GIB
from services.ids import ID_RULE, check_hardware_type, check_model_id, is_valid_id
from services.importers import maveriq
from services.models import json_text
from services.models.arch import ArchSpec
from services.models.errors import shape_only
from services.models.families import parse_config
from services.models.presets import find_preset, preset_config
from services.reservation import embedding_rank_bytes, params_per_layer
from services.state.store import StateStore

__all__ = [
    "ImportPlan",
    "ImportedModel",
    "import_profiles",
    "merge_model",
    "merge_profile",
    "plan_maveriq_import",
    "to_measurement",
    "variant_name",
]

# What the data set's files hold, by name.
_MEASUREMENT_FILES = (
    maveriq.FINGERPRINTS,
    maveriq.FINGERPRINTS_BATCH,
    maveriq.FULL_MODELS,
    maveriq.FULL_MODELS_BATCH,
    maveriq.UNBALANCED_PP,
)
_NOT_PROFILES = {
    maveriq.FULL_MODELS_PRUNED: "pruned llama-2-7b variants measured in full only (no "
    "fingerprints to estimate them from, and unstructured / 4:8 pruning iserve does not model)",
    maveriq.FINGERPRINT_SCALING: "a scaling study (latency and memory against layer count), "
    "not a profile",
    maveriq.BATCH_SCALING: "a scaling study (latency and memory against batch size), not a profile",
}
_WEIGHT_QUANTS = {
    "fp16": common.WEIGHT_QUANT_NONE,
    "int8": common.WEIGHT_QUANT_INT8,
    "int4": common.WEIGHT_QUANT_INT4,
    "int4_gptq": common.WEIGHT_QUANT_GPTQ_INT4,
}
# MaverIQ ran every model in float16.
_MAVERIQ_DTYPE = "float16"


def variant_name(weight_quant: str, int8_kv_cache: bool) -> str:
    """Name of an imported variant: the weight quantization, ``-kv8`` with an int8 KV cache."""
    return f"{weight_quant}-kv8" if int8_kv_cache else weight_quant


# Bytes per decoder-layer weight in TensorRT-LLM 0.9's formats, which MaverIQ's engines
# used: weight-only int8 and int4 keep one float16 scale per output channel (2 bytes over
# a row of hidden-size inputs), GPTQ int4 a float16 scale and zero per group of 128.
_GPTQ_GROUP = 128


def trtllm_weight_bytes(weight_quant: str, hidden_size: int) -> float:
    """Bytes one decoder-layer weight takes in the engines MaverIQ measured."""
    per_channel = 2.0 / max(1, hidden_size)
    return {
        "fp16": 2.0,
        "int8": 1.0 + per_channel,
        "int4": 0.5 + per_channel,
        "int4_gptq": 0.5 + 4.0 / _GPTQ_GROUP,
    }[weight_quant]


def to_measurement(
    row: maveriq.Measurement,
    hardware_type: str,
    num_layers: int,
    input_tokens: int,
    shape: model_pb.ModelShape | None = None,
) -> model_pb.ProfileMeasurement:
    """One MaverIQ row as a stored measurement (full model when it held every layer);
    with the model's ``shape``, the layer weight bytes its format implies."""
    layer_bytes = kv_bytes = 0.0
    if shape is not None and shape.parameter_count:
        layer_bytes = params_per_layer(shape) * trtllm_weight_bytes(
            row.weight_quant, shape.hidden_size
        )
        # K and V per token and layer: float16, or int8 with one scale per tensor.
        kv_bytes = 2.0 * shape.num_kv_heads * shape.head_dim * (1 if row.int8_kv_cache else 2)
    ranks = row.tp * row.pp
    per_rank = round(row.memory_gib * GIB / ranks)
    return model_pb.ProfileMeasurement(
        variant_name=variant_name(row.weight_quant, row.int8_kv_cache),
        num_layers=row.layers,
        full_model=row.layers == num_layers,
        config=common.DeploymentConfig(
            tensor_parallel=row.tp,
            pipeline_parallel=row.pp,
            variant_name=variant_name(row.weight_quant, row.int8_kv_cache),
            weight_quant=_WEIGHT_QUANTS[row.weight_quant],
            kv_quant=common.KV_QUANT_INT8 if row.int8_kv_cache else common.KV_QUANT_NONE,
            pruning=common.PRUNING_NONE,
            batch_size=row.batch_size,
        ),
        stage_layers=row.pp_map,
        input_tokens=input_tokens,
        output_tokens=row.output_tokens,
        latency_ms=row.latency_s * 1e3,
        peak_memory_bytes_per_rank=[per_rank] * ranks,
        repetitions=3,
        hardware_type=hardware_type,
        layer_weight_bytes=layer_bytes,
        layer_kv_bytes_per_token=kv_bytes,
        source_file=row.source,
    )


@dataclass(frozen=True)
class ImportedModel:
    """What an import brings for one model: its shape, where that came from (a preset or
    a given config.json), variants and rows."""

    model_id: str
    shape_source: str
    shape: model_pb.ModelShape
    variants: tuple[common.CompressionVariant, ...]
    measurements: tuple[model_pb.ProfileMeasurement, ...]


@dataclass(frozen=True)
class ImportPlan:
    hardware_type: str
    models: tuple[ImportedModel, ...]
    files: tuple[str, ...]
    skipped: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def measurement_count(self) -> int:
        return sum(len(m.measurements) for m in self.models)


def _decode(name: str, content: bytes) -> str:
    try:
        return content.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        # The line as an editor numbers it (\n, \r\n or \r ends one), then the byte.
        before = content[: exc.start]
        line = before.replace(b"\r\n", b"\n").replace(b"\r", b"\n").count(b"\n") + 1
        raise InvalidArgument(
            f"{name}:{line}: not UTF-8 text (byte {exc.start} of the file: "
            f"{content[exc.start : exc.start + 1]!r})"
        ) from None


# Files one ImportProfiles request may carry (MaverIQ's data set has 9): each is parsed
# on the model service's event loop, and a fuzzing tester's 100,000 held it for minutes.
MAX_IMPORT_FILES = 1000
# Measurement rows one import reads, over all its files: five models' full profiles
# (MAX_PROFILE_MEASUREMENTS each). A 600,000-row file inside the message size held the
# model service for 15 s before its refusal (a tester); parsing stops at the bound.
MAX_IMPORT_ROWS = 5 * importers.MAX_PROFILE_MEASUREMENTS


def plan_maveriq_import(
    files: Sequence[tuple[str, bytes]],
    hardware_type: str,
    model_configs: Mapping[str, str] | None = None,
    registered: Mapping[str, str] | None = None,
    models_root: Path | None = None,
) -> ImportPlan:
    """Parse MaverIQ files (base name, content) and decide what to store.

    A model's shape comes from the config.json text ``model_configs`` gives for its name
    (any case), else from the architecture preset its name denotes (a preset's name or
    Hugging Face repository, any case), else from the checkpoint of the registered model
    of that id (``registered``: model id -> checkpoint path under ``models_root``).
    Raises InvalidArgument for a malformed file (naming file and line), a file listed twice, no measurement file, or a config that
    is not JSON, names no model of the rows or describes a model iserve cannot read;
    files and rows iserve does not import are listed in ``skipped`` with the reason.
    """
    check_hardware_type(hardware_type)
    if not files:
        raise InvalidArgument("no files to import")
    if len(files) > MAX_IMPORT_FILES:
        raise InvalidArgument(
            f"{len(files)} files to import; at most {MAX_IMPORT_FILES} in one request"
        )
    counts = Counter(name for name, _ in files)
    twice = sorted(name for name, count in counts.items() if count > 1)
    if twice:
        raise InvalidArgument(
            f"files listed twice: {', '.join(map(shown, twice))} (a file is known by its "
            "name, even from another folder: give each name once)"
        )
    skipped: list[str] = []
    notes: list[str] = []
    rows: list[tuple[maveriq.Measurement, int]] = []
    accuracy: dict[maveriq.AccuracyKey, float] = {}
    imported_files: list[str] = []
    for name, content in files:
        if "/" in name or not name:
            raise InvalidArgument(f"file name {shown(name)} must be a base name")
        try:
            if name == maveriq.ACCURACY:
                accuracy = maveriq.parse_accuracy(_decode(name, content), name)
            elif name in _MEASUREMENT_FILES:
                prompt = maveriq.PROMPT_TOKENS.get(name, 0)
                parsed = maveriq.parse_measurements(
                    _decode(name, content), name, max_rows=MAX_IMPORT_ROWS - len(rows)
                )
                rows.extend((row, prompt) for row in parsed)
            elif name in _NOT_PROFILES:
                skipped.append(f"{name}: {_NOT_PROFILES[name]}")
                continue
            else:
                known = sorted([*_MEASUREMENT_FILES, maveriq.ACCURACY, *_NOT_PROFILES])
                skipped.append(f"{name}: not a file of MaverIQ's data set (known: {known})")
                continue
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        imported_files.append(name)
    if not rows:
        given = [name for name in imported_files if name in _MEASUREMENT_FILES]
        if given:
            raise InvalidArgument(f"no measurement rows in {', '.join(given)} (a header alone)")
        raise InvalidArgument(
            "no measurement file among the files; MaverIQ's are " + ", ".join(_MEASUREMENT_FILES)
        )

    by_name: dict[str, list[tuple[maveriq.Measurement, int]]] = defaultdict(list)
    pruned: dict[str, int] = defaultdict(int)
    for row, prompt in rows:
        if row.pruning is not None:
            pruned[f"{row.model}-{row.pruning}"] += 1
        else:
            by_name[row.model].append((row, prompt))
    for name, count in sorted(pruned.items()):
        skipped.append(f"{name}: {count} rows of a pruned variant (no fingerprints); not imported")

    configs = _given_configs(model_configs or {}, by_name)
    registered = registered if models_root is not None else None
    checkpoints = {
        name.lower(): _registered_config(name.lower(), models_root, registered[name.lower()])
        for name in by_name
        if name.lower() not in configs
        and name.lower() in (registered or {})
        and not (maveriq.PRESET_NAMES.get(name) or find_preset(name))
    }
    by_model: dict[str, list[tuple[maveriq.Measurement, int]]] = defaultdict(list)
    sources: dict[str, tuple[str, dict]] = {}
    for name in sorted(by_name):
        found = _model_of(name, configs, checkpoints)
        if found is None:
            remedy = (
                f"give its config.json: --model-config {name}=PATH"
                if is_valid_id(name.lower())
                else f"the name cannot be a model id ({ID_RULE}): rename it in the file"
            )
            skipped.append(
                f"{name}: {len(by_name[name])} rows; no architecture preset of that name, so "
                f"no shape to estimate with; not imported ({remedy})"
            )
            continue
        model_id, source, config = found
        if model_id != name:
            notes.append(f"{name}: rows stored under model id {model_id!r}")
        if sources.setdefault(model_id, (source, config))[1] != config:
            raise InvalidArgument(
                f"{name}: rows of model id {model_id!r} come under two names with different "
                "shapes; name each model once"
            )
        by_model[model_id].extend(by_name[name])

    models = []
    for model_id in sorted(by_model):
        source, config = sources[model_id]
        shape, spec, unrunnable = _shape_of(model_id, config)
        if unrunnable:
            notes.append(
                f"{model_id}: its {source} has what iserve's engine does not run "
                f"({'; '.join(unrunnable)}); only its shape is read, which is all the "
                "estimates need"
            )
        for row, prompt in by_model[model_id]:
            _check_row(row, prompt, model_id, spec)
        _check_series([row for row, _ in by_model[model_id]], model_id)
        _check_memory_units([row for row, _ in by_model[model_id]], model_id)
        _check_files_agree([row for row, _ in by_model[model_id]], model_id)
        measurements = tuple(
            to_measurement(row, hardware_type, spec.num_layers, prompt, shape)
            for row, prompt in by_model[model_id]
        )
        for (row, _), measurement in zip(by_model[model_id], measurements, strict=True):
            _check_memory(row, measurement, model_id, shape)
        rows_of = [row for row, _ in by_model[model_id]]
        models.append(
            ImportedModel(
                model_id=model_id,
                shape_source=source,
                shape=shape,
                variants=_variants(rows_of, accuracy),
                measurements=measurements,
            )
        )
    if not models:
        raise InvalidArgument("nothing to import: " + "; ".join(skipped))
    return ImportPlan(
        hardware_type, tuple(models), tuple(imported_files), tuple(skipped), tuple(notes)
    )


# The files whose every run holds the whole model.
FULL_MODEL_FILES = frozenset({maveriq.FULL_MODELS, maveriq.FULL_MODELS_BATCH})


def _check_row(row: maveriq.Measurement, prompt: int, model_id: str, spec: ArchSpec) -> None:
    """InvalidArgument naming the row's file and line when it cannot be a run of the model
    ``spec`` describes (more layers than it has, a tensor parallelism its heads cannot
    split, or a prompt plus output beyond its context) or has a batch size the estimator
    cannot use: a fingerprint beyond batch 2, or a batch above 1 in a file of batch-1
    runs (``maveriq.BATCH_FILES``)."""
    where = f"{row.where}: {model_id}"
    if row.layers > spec.num_layers:
        raise InvalidArgument(
            f"{where}: the row holds {row.layers} layers, the model has {spec.num_layers}"
        )
    if row.source in FULL_MODEL_FILES and row.layers != spec.num_layers:
        # Taken as a fingerprint of that many layers, a PP_Map slip (40 written 4) turned
        # 25 GiB runs into 4-layer samples: the calibration's fit error read 154 % and the
        # model's estimates 12x (a tester).
        raise InvalidArgument(
            f"{where}: a run in {row.source} holds the whole model, {spec.num_layers} "
            f"layers, and this row's PP_Map {':'.join(map(str, row.pp_map))} gives "
            f"{row.layers}; correct the row (fingerprints belong in {maveriq.FINGERPRINTS})"
        )
    # The estimator extrapolates fingerprints at REFERENCE_BATCHES alone. An imported row
    # is timed end to end, so a fingerprint at another batch size shares the TPOT terms
    # of batch 1 and adds a prompt label of its own, whose terms a few such rows leave
    # undetermined: every estimate of the model then fails. Full-model rows may hold any.
    if row.layers < spec.num_layers and row.batch_size not in REFERENCE_BATCHES:
        raise InvalidArgument(
            f"{where}: a fingerprint ({row.layers} of {spec.num_layers} layers) at batch "
            f"{row.batch_size}; the estimator extrapolates fingerprints run at batch "
            f"{' and '.join(map(str, REFERENCE_BATCHES))} only (larger batches are "
            "estimated from those)"
        )
    if row.batch_size != 1 and row.source in maveriq.BATCH_FILES:
        # A prompt label of its own, (923, batch), whose few rows determine nothing.
        raise InvalidArgument(
            f"{where}: batch {row.batch_size} in a file of batch-1 runs with a {prompt}-token "
            f"prompt; runs at other batch sizes belong in {maveriq.BATCH_FILES[row.source]}"
        )
    problem = tensor_parallel_problem(
        row.tp,
        heads=spec.num_heads,
        kv_heads=spec.num_kv_heads,
        mlp_width=spec.intermediate_size,
    )
    if problem:
        raise InvalidArgument(f"{where}: TP={row.tp} cannot be a run of this model: {problem}")
    if prompt + row.output_tokens > spec.max_position_embeddings:
        tokens = f"a {prompt}-token prompt and " if prompt else ""
        raise InvalidArgument(
            f"{where}: {tokens}{row.output_tokens} output tokens pass the model's context "
            f"of {spec.max_position_embeddings} positions"
        )


def _run(row: maveriq.Measurement) -> tuple:
    """What makes rows of one model runs of one configuration: layout, layer map, variant."""
    return (row.tp, row.pp, row.pp_map, row.weight_quant, row.int8_kv_cache)


# How far one run's latency may move between two output lengths before a row is taken for
# a slip rather than a measurement. End to end, L(o) = TTFT + o * TPOT: more tokens never
# take less time, nor more than o2/o1 times as long, up to timing noise and a TPOT that
# grows with the sequence (the A6000 data: 0.97 and 1.15). A factor of two either way
# leaves room for other machines' noise and still catches a row off by a unit or an
# exponent (a latency of 1e-300, 80,000 s beside 0.04 s).
SERIES_SLACK = 2.0


# How far one run's memory may move between two output lengths: the weights, buffers and
# KV cache a run holds hardly change with a few more tokens (the A6000 data: at most
# 1.26x, batch 64 from 100 to 200 tokens). A memory in MiB among GiB is 1024x off, and
# the estimate of a variant took it (13.6 GiB became 364).
MEMORY_SERIES_SLACK = 4.0
# How far apart two runs of one variant (file, model, format, batch) may hold memory per
# device: the layouts and layer counts of the A6000 data spread it up to 10.2x (the
# scaling file's 1 to 32 layers). A run in MiB among runs in GiB is 1024x apart.
MEMORY_RUNS_SLACK = 100.0


def _check_memory_units(rows: Sequence[maveriq.Measurement], model_id: str) -> None:
    """InvalidArgument naming both rows when two runs of one variant in one file hold
    memory per device further apart than :data:`MEMORY_RUNS_SLACK` allows: one of them is
    in other units (MiB, MB). The output lengths of one run are held to
    :data:`MEMORY_SERIES_SLACK` by :func:`_check_series`."""
    variants: dict[tuple, list[maveriq.Measurement]] = defaultdict(list)
    for row in rows:
        if row.memory_gib > 0:
            key = (row.source, row.pruning, row.weight_quant, row.int8_kv_cache, row.batch_size)
            variants[key].append(row)
    for runs in variants.values():
        per_device = sorted(runs, key=lambda r: r.memory_gib / (r.tp * r.pp))
        low, high = per_device[0], per_device[-1]
        low_gib, high_gib = (r.memory_gib / (r.tp * r.pp) for r in (low, high))
        if high_gib > MEMORY_RUNS_SLACK * low_gib:
            raise InvalidArgument(
                f"{high.where} and line {low.line}: {model_id}: {high_gib:.6g} GiB per device "
                f"(TP={high.tp}, PP_Map={list(high.pp_map)}) beside {low_gib:.6g} GiB "
                f"(TP={low.tp}, PP_Map={list(low.pp_map)}) for one variant "
                f"({high_gib / low_gib:.3g}x; the published data's runs are within 10.2x): is "
                "one of them in MiB or MB rather than GiB?"
            )


def _check_series(rows: Sequence[maveriq.Measurement], model_id: str) -> None:
    """InvalidArgument naming the rows when two rows of one run (same file, layout, layer
    map, variant and batch) have the same output length, or when latency moves between
    two output lengths of a run in a way no measurement does (:data:`SERIES_SLACK`).
    One such row changed every estimate of its variant, or left most configurations out."""
    runs: dict[tuple, list[maveriq.Measurement]] = defaultdict(list)
    for row in rows:
        runs[(row.source, *_run(row), row.batch_size)].append(row)
    for series in runs.values():
        series = sorted(series, key=lambda r: (r.output_tokens, r.line))
        for a, b in zip(series, series[1:], strict=False):
            where = f"{a.where} and line {b.line}: {model_id}"
            if a.output_tokens == b.output_tokens:
                raise InvalidArgument(
                    f"{where}: the same run (TP={a.tp}, PP_Map={list(a.pp_map)}, batch "
                    f"{a.batch_size}, {a.output_tokens} output tokens) twice; keep one row "
                    "of each run"
                )
            longest = SERIES_SLACK * b.output_tokens / a.output_tokens * a.latency_s
            if not a.latency_s / SERIES_SLACK <= b.latency_s <= longest:
                raise InvalidArgument(
                    f"{where}: {a.latency_s:.6g} s for {a.output_tokens} output tokens and "
                    f"{b.latency_s:.6g} s for {b.output_tokens} (TP={a.tp}, "
                    f"PP_Map={list(a.pp_map)}, batch {a.batch_size}): no run's latency moves "
                    "that way with its output length; is one of them mistyped, or in other units?"
                )
            held = sorted(r.memory_gib for r in (a, b))
            if held[0] > 0 and held[1] > MEMORY_SERIES_SLACK * held[0]:
                raise InvalidArgument(
                    f"{where}: Memory-After-Run {a.memory_gib:.6g} GiB for "
                    f"{a.output_tokens} output tokens and {b.memory_gib:.6g} GiB for "
                    f"{b.output_tokens} (TP={a.tp}, PP_Map={list(a.pp_map)}, batch "
                    f"{a.batch_size}): a run's memory hardly moves with its output length; "
                    "is one of them in MiB or MB rather than GiB?"
                )


# How far a run with the 923-token prompt may stand from the same run (model, layout,
# layer map, variant, output length, batch 1) in its file's _BS twin, whose prompts are
# short: the long prompt adds its prefill, so it is not faster (beyond noise), nor
# slower by more than its prefill can make it. The published data stays within
# 1.05-2.7x; a file in milliseconds beside one in seconds is 1000x off, and passes
# every check within one file.
FILES_SLACK = (0.5, 100.0)


def _check_files_agree(rows: Sequence[maveriq.Measurement], model_id: str) -> None:
    """InvalidArgument naming both rows when a run of a 923-token-prompt file and the
    same run in its _BS file (``maveriq.BATCH_FILES``) are further apart than
    :data:`FILES_SLACK` allows: one of the files is in other units."""

    def key(row: maveriq.Measurement) -> tuple:
        return (*_run(row), row.output_tokens)

    for row, twin, ratio in _twins_apart(
        rows, rows, key, lambda r: r.source, lambda r: r.latency_s, lambda r: r.batch_size
    ):
        raise InvalidArgument(
            f"{row.where} and {twin.where}: {model_id}: "
            f"{_same_run(row.tp, row.pp_map, row.output_tokens)} takes "
            f"{row.latency_s:.6g} s with the {maveriq.PROMPT_TOKENS[row.source]}-token "
            f"prompt and {twin.latency_s:.6g} s with a short one {_apart(ratio)}"
        )


def _twins_apart(news, olds, key, source, latency, batch):
    """(row, twin, ratio) for each row of ``news`` from a 923-token-prompt file whose
    run in its _BS file, among ``olds`` at batch 1, is further apart than FILES_SLACK."""
    for long_file, short_file in maveriq.BATCH_FILES.items():
        short = {
            key(r): r for r in olds if source(r) == short_file and batch(r) == 1 and latency(r) > 0
        }
        for row in news:
            twin = short.get(key(row)) if source(row) == long_file else None
            if twin is not None:
                ratio = latency(row) / latency(twin)
                if not FILES_SLACK[0] <= ratio <= FILES_SLACK[1]:
                    yield row, twin, ratio


def _same_run(tp: int, pp_map: Sequence[int], output_tokens: int) -> str:
    return f"the same run (TP={tp}, PP_Map={list(pp_map)}, {output_tokens} output tokens)"


def _apart(ratio: float) -> str:
    """How far apart two files' runs are, against the published data's spread."""
    return (
        f"({ratio:.3g}x; runs of the published data are 1.05-2.7x apart): is one of the "
        "files in other units than seconds?"
    )


def _check_files_agree_with_kept(
    imported: Sequence[model_pb.ProfileMeasurement],
    kept: Sequence[model_pb.ProfileMeasurement],
    model_id: str,
) -> None:
    """:func:`_check_files_agree` across imports: a run of a 923-token-prompt file
    imported now against the same run in its _BS file imported before (or the other
    way round). A file in milliseconds imported on its own beside rows in seconds was
    taken, and put TTFTs at 50 minutes."""

    def key(m: model_pb.ProfileMeasurement) -> tuple:
        c = m.config
        return (
            m.hardware_type, m.variant_name, c.tensor_parallel, c.pipeline_parallel,
            tuple(m.stage_layers), m.output_tokens,
        )  # fmt: skip

    for news, olds in ((imported, kept), (kept, imported)):
        for row, twin, ratio in _twins_apart(
            news,
            olds,
            key,
            lambda m: m.source_file,
            lambda m: m.latency_ms,
            lambda m: m.config.batch_size,
        ):
            run = _same_run(row.config.tensor_parallel, row.stage_layers, row.output_tokens)
            raise InvalidArgument(
                f"{model_id}: {run} takes {row.latency_ms / 1e3:.6g} s in {row.source_file} "
                f"and {twin.latency_ms / 1e3:.6g} s in {twin.source_file}, one of them "
                f"imported before {_apart(ratio)} Nothing was imported"
            )


def _check_memory(
    row: maveriq.Measurement,
    measurement: model_pb.ProfileMeasurement,
    model_id: str,
    shape: model_pb.ModelShape,
) -> None:
    """InvalidArgument naming the row's file and line when its memory is below what its
    weights alone take (known from the shape): its decoder layers' in its format, and
    the embedding and LM head in float16. No run holds its weights in less; MaverIQ's
    own rows hold at least 1.07 times that. A model's rows relabelled under a shape
    with a far larger vocabulary were taken, and estimated the embedding that shape
    needs as the rows' (32 GiB of a 2^20-token vocabulary as none)."""
    layers = measurement.layer_weight_bytes * measurement.num_layers
    if not layers:
        return  # no shape to judge by
    # TensorRT-LLM's weight-only quantization leaves the token embedding and the LM head
    # in float16, the format every MaverIQ engine was built in.
    outer = embedding_rank_bytes(shape, common.DeploymentConfig(dtype=common.PRECISION_FLOAT16))
    weights = layers + outer
    held = sum(measurement.peak_memory_bytes_per_rank)
    if held < weights:
        raise InvalidArgument(
            f"{row.where}: {model_id}: {row.memory_gib:g} GiB of memory is less than the "
            f"{weights / GIB:.2f} GiB its weights take ({layers / GIB:.2f} GiB of its "
            f"{row.layers} decoder layers in {row.weight_quant}, {outer / GIB:.2f} GiB "
            "of embedding and LM head in float16); a run cannot hold them in less"
        )


def _given_configs(
    model_configs: Mapping[str, str], by_name: Mapping[str, object]
) -> dict[str, dict]:
    """The given config.json texts, parsed, by lower-case model name; raises
    InvalidArgument for one that is not a JSON object, names no model of the rows, or
    names the same model as another in another case."""
    names = {name.lower() for name in by_name}
    configs: dict[str, dict] = {}
    for name, text in sorted(model_configs.items()):
        if name.lower() not in names:
            raise InvalidArgument(
                f"a config.json is given for {shown(name)}, which no row names; the rows name: "
                + ", ".join(sorted(by_name))
            )
        try:
            config = json_text.loads(text)
        except ValueError as exc:  # a JSONDecodeError, nesting too deep among them
            raise InvalidArgument(f"{name}: its config.json is not JSON ({exc})") from None
        if not isinstance(config, dict):
            raise InvalidArgument(f"{name}: its config.json must be a JSON object")
        if name.lower() in configs:
            # Names are read in any case: two would be one model, and one config dropped.
            same = [n for n in model_configs if n.lower() == name.lower()]
            raise InvalidArgument(
                f"config.json texts are given for {', '.join(map(shown, sorted(same)))}, "
                "one model (names are read in any case); give one"
            )
        configs[name.lower()] = config
    return configs


def _registered_config(model_id: str, models_root: Path, checkpoint_path: str) -> dict:
    """The config.json of ``model_id``'s registered checkpoint; InvalidArgument naming
    the model when it can no longer be read (the rows would otherwise be skipped for
    want of a shape the model has)."""
    try:
        checkpoint = resolve_checkpoint(models_root, checkpoint_path)
        config = json_text.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, InvalidArgument) as exc:
        raise InvalidArgument(
            f"{model_id}: the config.json of its registered checkpoint cannot be read ({exc}); "
            f"give one: --model-config {model_id}=PATH"
        ) from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"{model_id}: its registered checkpoint's config.json is no object")
    return config


def _model_of(
    name: str, configs: Mapping[str, dict], checkpoints: Mapping[str, dict]
) -> tuple[str, str, dict] | None:
    """(model id, where its shape comes from, its config) of the rows of model ``name``:
    the config.json given for it, else the architecture preset the name denotes, else
    the config.json of the registered checkpoint of that id (``checkpoints``); None when
    there is none. The preset comes before a checkpoint: the rows of a preset's name are
    that model's, and a checkpoint of that id but another shape is refused, not given
    them. The model id is the name in lower case, or the preset's name where that is no
    valid id (``meta-llama/Llama-2-70b-hf``)."""
    model_id = name.lower()
    if model_id in configs:
        check_model_id(model_id)
        return model_id, "config.json given with the import", configs[model_id]
    preset = maveriq.PRESET_NAMES.get(name) or find_preset(name)
    if preset is None:
        if model_id in checkpoints:
            return model_id, "registered checkpoint's config.json", checkpoints[model_id]
        return None
    if not is_valid_id(model_id):
        model_id = preset
    return model_id, f"preset {preset}", preset_config(preset)


def _shape_of(model_id: str, config: dict) -> tuple[model_pb.ModelShape, ArchSpec, list[str]]:
    """The shape of ``config`` with MaverIQ's float16 weights, and what in it iserve's
    engine could not run (an imported model is estimated, never deployed, so that is a
    note, not a refusal); InvalidArgument naming the model when iserve cannot read the
    shape itself (an unknown family, a missing or contradictory field)."""
    try:
        with shape_only() as unrunnable:
            spec = parse_config({**config, "torch_dtype": _MAVERIQ_DTYPE})
    except ValueError as exc:
        raise InvalidArgument(f"{model_id}: its config.json: {exc}") from None
    return model_shape(spec, spec.weight_bytes()), spec, unrunnable


def _variants(
    rows: Sequence[maveriq.Measurement], accuracy: dict[maveriq.AccuracyKey, float]
) -> tuple[common.CompressionVariant, ...]:
    """One variant per (weight format, int8 KV cache) the rows measured, with its accuracy
    under any name the rows give the model."""
    measured = {(r.weight_quant, r.int8_kv_cache) for r in rows}
    names = sorted({spelling for r in rows for spelling in (r.model, r.model.lower())})
    variants = []
    for weight in _WEIGHT_QUANTS:
        for int8_kv in (False, True):
            if (weight, int8_kv) not in measured:
                continue
            variant = common.CompressionVariant(
                name=variant_name(weight, int8_kv),
                weight_quant=_WEIGHT_QUANTS[weight],
                kv_quant=common.KV_QUANT_INT8 if int8_kv else common.KV_QUANT_NONE,
                pruning=common.PRUNING_NONE,
            )
            scores = [accuracy.get(maveriq.AccuracyKey(n, weight, int8_kv)) for n in names]
            score = next((score for score in scores if score is not None), None)
            if score is not None:
                variant.accuracy_score = score
            variants.append(variant)
    return tuple(variants)


# The fields of a shape that decide what a layer computes and holds.
_ARCHITECTURE_FIELDS = (
    "family",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)


def shape_changes(old: model_pb.ModelShape, new: model_pb.ModelShape) -> list[str]:
    """``field old -> new`` for each architecture field in which ``new`` departs."""
    return [
        f"{name} {getattr(old, name)} -> {getattr(new, name)}"
        for name in _ARCHITECTURE_FIELDS
        if getattr(old, name) != getattr(new, name)
    ]


def merge_model(
    existing: model_pb.Model | None,
    imported: ImportedModel,
    now_ms: int,
    *,
    kept_rows: int = 0,
    owner: str = "",
) -> model_pb.Model:
    """The model record after an import: a new shape-only record owned by ``owner``, or
    ``existing`` (its owner unchanged) with the variants it lacks (and accuracy scores
    the import brings).

    A shape-only record whose shape the import changes takes the new shape when no row
    of the old one stays (``kept_rows``: the rows the import leaves in the profile).
    Raises InvalidArgument, naming the fields, when the shapes differ otherwise: a
    registered checkpoint's shape is its own, and kept rows were measured on the old one.
    """
    if existing is None:
        return model_pb.Model(
            model_id=imported.model_id,
            shape=imported.shape,
            variants=imported.variants,
            state=model_pb.MODEL_STATE_PROFILED,
            state_reason=f"shape-only record ({imported.shape_source}) with imported profiles",
            created_at_unix_ms=now_ms,
            owner=owner,
        )
    model = model_pb.Model()
    model.CopyFrom(existing)
    changes = shape_changes(existing.shape, imported.shape) if existing.shape.num_layers else []
    if changes and existing.checkpoint_path:
        raise InvalidArgument(
            f"model {imported.model_id!r} is a registered checkpoint of another shape than "
            f"the imported rows' model ({'; '.join(changes)}); import them under another "
            "name"
        )
    if changes and kept_rows:
        raise InvalidArgument(
            f"model {imported.model_id!r} was imported with another shape "
            f"({'; '.join(changes)}), and {kept_rows} of its rows come from files or "
            "hardware types this import does not bring; import every file of the model "
            "again with the new shape, or delete the model first (iserve model delete)"
        )
    if changes or not model.shape.num_layers:
        model.shape.CopyFrom(imported.shape)
        model.state_reason = f"shape-only record ({imported.shape_source}) with imported profiles"
    present = {v.name: v for v in model.variants}
    for variant in imported.variants:
        if variant.name not in present:
            model.variants.append(variant)
        elif variant.HasField("accuracy_score"):
            present[variant.name].accuracy_score = variant.accuracy_score
    return model


def kept_measurements(
    existing: model_pb.GetProfileResponse | None, hardware_type: str, files: Sequence[str]
) -> list[model_pb.ProfileMeasurement]:
    """The rows of ``existing`` an import of ``files`` on ``hardware_type`` keeps: those of
    other hardware types, and of this one those of other files (not those naming no file,
    iserve's own profiling, which an import of another engine's runs replaces)."""
    if existing is None:
        return []
    return [
        m
        for m in existing.measurements
        if m.hardware_type != hardware_type or (m.source_file and m.source_file not in files)
    ]


def merge_profile(
    existing: model_pb.GetProfileResponse | None,
    model_id: str,
    hardware_type: str,
    measurements: Sequence[model_pb.ProfileMeasurement],
    files: Sequence[str] = (),
) -> model_pb.GetProfileResponse:
    """The profile after importing ``files`` on ``hardware_type``: the rows
    :func:`kept_measurements` keeps, then ``measurements``."""
    profile = model_pb.GetProfileResponse(model_id=model_id)
    if existing is not None:
        profile.CopyFrom(existing)
        profile.request_id = ""
        del profile.measurements[:]
        profile.measurements.extend(kept_measurements(existing, hardware_type, files))
    profile.measurements.extend(measurements)
    return profile


def _merged_source(files: Sequence[str], kept_files: set[str], now_ms: int) -> str:
    """The provenance of a hardware type's rows after an import: the files of rows kept
    from earlier imports, and the imported ones."""
    return json.dumps(
        {
            "format": "maveriq",
            "files": sorted(kept_files | set(files)),
            "imported_at_unix_ms": now_ms,
        }
    )


def _estimable(model: model_pb.Model, rows: Sequence[model_pb.ProfileMeasurement]) -> str:
    """Why the estimator's own extrapolation cannot estimate ``model`` from ``rows``
    (one hardware type's); "" when it can."""
    try:
        model_references.model_references(
            profiles.estimation_shape(model),
            profiles.estimation_variants(model, rows),
            [profiles.sample_from_measurement(m) for m in rows],
        )
    except (ValueError, KeyError) as exc:
        return str(exc).strip("'\"")
    return ""


def _check_estimable(
    existing: model_pb.Model | None,
    before: model_pb.GetProfileResponse | None,
    model: model_pb.Model,
    after: model_pb.GetProfileResponse,
    hardware_type: str,
) -> str:
    """A note when ``model``'s rows on ``hardware_type`` after an import give no
    estimate ("" when they do): fingerprint rows may come a file at a time. An import
    that takes estimates away from a model that had them is refused (InvalidArgument):
    it replaced good rows with rows that determine nothing (one output length per run),
    and every estimate then failed."""

    def rows(profile):
        return [m for m in profile.measurements if m.hardware_type == hardware_type]

    why = _estimable(model, rows(after))
    if not why:
        return ""
    had = rows(before) if existing is not None and before is not None else []
    if had and not _estimable(existing, had):
        raise InvalidArgument(
            f"model {model.model_id!r}: its rows on {hardware_type} give estimates now and "
            f"would give none after this import ({why}); nothing was imported"
        )
    return f"{model.model_id}: no estimates on {hardware_type} yet: {why}"


async def import_profiles(
    store: StateStore, request: model_pb.ImportProfilesRequest, models_root: Path | None = None
) -> model_pb.ImportProfilesResponse:
    """Carry out an ImportProfiles request for the caller (services.auth.access), who
    must own every model it changes (an administrator any) and owns those it creates.
    Nothing is written unless every file parses and every model may be changed
    (InvalidArgument, PermissionDenied)."""
    if request.format == model_pb.PROFILE_FORMAT_UNSPECIFIED:
        raise InvalidArgument("format is unspecified; use PROFILE_FORMAT_MAVERIQ")
    if request.format != model_pb.PROFILE_FORMAT_MAVERIQ:
        raise InvalidArgument(f"unknown profile format {request.format}")
    # Off the event loop: parsing tens of thousands of rows takes seconds, during which
    # the model service would answer nobody.
    plan = await asyncio.to_thread(
        plan_maveriq_import,
        [(f.name, f.content) for f in request.files],
        request.hardware_type,
        dict(request.model_configs),
        # Registered checkpoints (not shape-only records): their rows take their shape
        # (they were skipped for want of a preset of the name).
        {m.model_id: m.checkpoint_path for m in await store.list_models() if m.checkpoint_path},
        models_root,
    )
    now_ms = int(time.time() * 1000)
    records = []
    notes = list(plan.notes)
    for imported in plan.models:
        existing = await store.get_model(imported.model_id)
        if existing is None:
            await store.refuse_a_deployments_id(imported.model_id)
        if existing is not None:
            access.check_owner(f"model {imported.model_id!r}", existing.owner)
            if existing.state == model_pb.MODEL_STATE_PROFILING:
                # The job writes the whole profile when it ends: rows imported meanwhile
                # were reported imported, then gone.
                raise FailedPrecondition(
                    f"model {imported.model_id!r} is being profiled, and its profiling job "
                    "replaces the profile when it ends: import once `iserve models` shows it "
                    "PROFILED or FAILED, or into another model id"
                )
        before = await store.get_profile(imported.model_id)
        profile = merge_profile(
            before,
            imported.model_id,
            plan.hardware_type,
            imported.measurements,
            plan.files,
        )
        if len(profile.measurements) > importers.MAX_PROFILE_MEASUREMENTS:
            raise InvalidArgument(
                f"model {imported.model_id!r} would hold {len(profile.measurements):,} "
                f"measurements after this import ({len(imported.measurements):,} of them "
                f"imported now); a profile holds at most {importers.MAX_PROFILE_MEASUREMENTS:,} (the "
                "whole MaverIQ data set is under 5,000 rows, five models together): import "
                "the rows the estimates need, or import again into a new model id"
            )
        # The rows kept come first, the imported ones after them.
        kept = profile.measurements[: len(profile.measurements) - len(imported.measurements)]
        _check_files_agree_with_kept(imported.measurements, kept, imported.model_id)
        replaced = len(before.measurements) - len(kept) if before is not None else 0
        if replaced > len(imported.measurements):
            # A copy cut short replaced the whole file's rows without a word (a tester).
            notes.append(
                f"{imported.model_id}: this import's {len(imported.measurements)} row(s) "
                f"replace the {replaced} it had on {plan.hardware_type} from the same "
                "file(s): fewer than before; if a file was cut short, import the whole "
                "file again"
            )
        model = merge_model(existing, imported, now_ms, kept_rows=len(kept), owner=access.owner())
        note = _check_estimable(existing, before, model, profile, plan.hardware_type)
        if note:
            notes.append(note)
        kept_files = {m.source_file for m in kept if m.hardware_type == plan.hardware_type}
        source = _merged_source(plan.files, kept_files, now_ms)
        records.append((existing is None, model, profile, source))
        if existing is not None and existing.shape.num_layers:
            changes = shape_changes(existing.shape, model.shape)
            if changes:
                notes.append(
                    f"{model.model_id}: its shape changed ({'; '.join(changes)}); every "
                    "row it had is replaced by this import's"
                )
    for new, model, profile, source in records:
        if not (new and await store.create_model(model)):
            await store.put_model(model)
        await store.put_profile(profile)
        await store.put_profile_source(model.model_id, plan.hardware_type, source)
    return model_pb.ImportProfilesResponse(
        request_id=request.request_id,
        model_ids=[imported.model_id for imported in plan.models],
        measurements_imported=plan.measurement_count,
        skipped=plan.skipped,
        notes=notes,
    )
