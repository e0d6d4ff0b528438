"""Parse the measurements published with MaverIQ (8 x RTX A6000, TensorRT-LLM 0.9).

Every CSV row becomes one :class:`Measurement`; the MMLU table becomes a dict keyed by
:class:`AccuracyKey`. Nothing here estimates anything: the records are plain values that
the benchmark and the tests feed to ``services.estimation``.

Which memory figure is the footprint: the data README defines both ``Memory-Pre-Run``
and ``Memory-After-Run`` as NVML used-memory *growth* summed over the GPUs of the
deployment, the first taken after the engine loaded and the second after the timed
runs. The footprint a deployment needs is the second one (weights, runtime buffers, KV
cache and the activation workspace touched by the run); their difference is only the
growth during the run (0.05 GiB on one GPU, gigabytes of communication buffers at
tp = 8). ``memory_gib`` is therefore ``Memory-After-Run``; ``memory_pre_run_gib`` keeps
the other figure.

Spelling quirks of the source are absorbed here: the column ``Output_Lenght`` and the
accuracy key ``gtpj-6b`` (for ``gptj-6b``).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from services.errors import shown
from services.models import json_text
from services.proto_limits import UINT32_MAX
from services.token_limits import MAX_BATCH_SIZE

__all__ = [
    "AccuracyKey",
    "MaverIQData",
    "Measurement",
    "load_accuracy",
    "load_directory",
    "load_measurements",
    "parse_accuracy",
    "parse_measurements",
]

# The CSV files of the published data set, by the role they play.
FINGERPRINTS = "fingerprint_data_collection.csv"
FINGERPRINTS_BATCH = "fingerprint_data_collection_BS.csv"
FULL_MODELS = "full_model_data_collection.csv"
FULL_MODELS_BATCH = "full_model_data_collection_BS.csv"
FULL_MODELS_PRUNED = "full_model_data_collection_pruning.csv"
UNBALANCED_PP = "unbalanced_PP_data_collection.csv"
ACCURACY = "MS_model_acc_MMLU.json"
# Scaling studies: latency and memory against layer count and against batch size.
FINGERPRINT_SCALING = "fingerprint_scaling_data.csv"
BATCH_SCALING = "BS_scaling_data.csv"
# Prompt length (tokens) of the files whose README states it; the others used short
# prompts of unrecorded length.
PROMPT_TOKENS = {FINGERPRINTS: 923, FULL_MODELS: 923}
# Memory of one RTX A6000 (the GPUs the data was measured on) as NVML gives it, which is
# what an agent on one reports: `nvidia-smi -q` says "Total : 49140 MiB" (ECC off; the
# card's 48 GiB less 12 MiB). Not the 48 * 10^9 bytes of "48 GB", 3.3 GiB less.
RTX_A6000_DEVICE_BYTES = 49140 * 2**20
# The same two files ran every row at batch 1; runs at other batch sizes are the _BS
# files' (whose prompts are short).
BATCH_FILES = {FINGERPRINTS: FINGERPRINTS_BATCH, FULL_MODELS: FULL_MODELS_BATCH}

# Bounds of a believable row: a timed run longer than a day, or more memory than a
# pebibyte over the deployment's GPUs, is a unit or typing error, and one such row would
# dominate the least-squares fits of every configuration of its model.
MAX_LATENCY_S = 86_400.0
MAX_MEMORY_GIB = float(2**20)

# The engine dtype column, as iserve's weight-quantization names.
_WEIGHT_QUANT = {"float16": "fp16", "int8": "int8", "int4": "int4", "int4_gptq": "int4_gptq"}
# A pruned variant's name is its model's name and the pruning method's
# (``llama-2-7b-wanda24``); any other name is a model's, whole (``llama-2-70b-hf``).
_PRUNED = re.compile(r"(?P<model>.+)-(?P<pruning>(?:sparsegpt|wanda)\d*)", re.IGNORECASE)
_MISSPELLED_MODELS = {"gtpj-6b": "gptj-6b"}
# The accuracy file's figures are % of the FP16 model's MMLU score: a compressed model
# may edge past it (noise), never by half again. Above that is a slip, and it made every
# intent with an accuracy floor pick the variant (a probe's 1e300 % was taken).
MAX_RELATIVE_ACCURACY_PCT = 150.0
# Architecture presets (services.models.presets) of the data set's models, where the
# names differ.
PRESET_NAMES = {"gptj-6b": "gpt-j-6b"}
# A model name goes whole into the import's skipped lists and notes: printable (no NUL
# or newline) and far longer than any model's name, not a 100 KB field.
MAX_MODEL_NAME_CHARS = 128
_REQUIRED_COLUMNS = (
    "Model",
    "TP",
    "PP",
    "PP_Map",
    "DTYPE",
    "INT8_KV_Cache",
    "Output_Lenght",
    "Batch_Size",
    "Latency",
    "Memory-Pre-Run",
    "Memory-After-Run",
)


@dataclass(frozen=True)
class Measurement:
    """One measured deployment: a configuration, a request shape and what it cost.

    ``layers`` is the number of hidden layers the engine held (the sum of ``pp_map``),
    so a fingerprint row has a small ``layers`` and a full-model row the model's count.
    ``line`` is the row's line in ``source`` (the header is line 1).
    """

    source: str
    model: str
    pruning: str | None
    tp: int
    pp: int
    pp_map: tuple[int, ...]
    weight_quant: str
    int8_kv_cache: bool
    output_tokens: int
    batch_size: int
    latency_s: float
    memory_gib: float
    memory_pre_run_gib: float
    line: int = 0

    @property
    def where(self) -> str:
        """``file:line`` of the row, as errors name it."""
        return f"{self.source}:{self.line}"

    @property
    def layers(self) -> int:
        """Hidden layers deployed (sum over pipeline stages)."""
        return sum(self.pp_map)

    @property
    def variant(self) -> tuple[str, str, bool]:
        """(model, weight quantization, int8 KV cache): one profiled compression variant."""
        return (self.model, self.weight_quant, self.int8_kv_cache)


@dataclass(frozen=True)
class AccuracyKey:
    """Which compression of which model an MMLU figure belongs to."""

    model: str
    weight_quant: str
    int8_kv_cache: bool


@dataclass(frozen=True)
class MaverIQData:
    """Every file of the data set, parsed; accuracy is % of the model's FP16 MMLU score."""

    fingerprints: tuple[Measurement, ...]
    fingerprints_batch: tuple[Measurement, ...]
    full_models: tuple[Measurement, ...]
    full_models_batch: tuple[Measurement, ...]
    full_models_pruned: tuple[Measurement, ...]
    unbalanced_pp: tuple[Measurement, ...]
    accuracy_pct: dict[AccuracyKey, float]


def _split_model(name: str) -> tuple[str, str | None]:
    name = _MISSPELLED_MODELS.get(name, name)
    pruned = _PRUNED.fullmatch(name)
    return (pruned["model"], pruned["pruning"]) if pruned else (name, None)


def _parse_bool(text: str, where: str) -> bool:
    if text not in ("True", "False"):
        raise ValueError(f"{where}: INT8_KV_Cache must be True or False, got {shown(text)}")
    return text == "True"


def _parse_row(columns: list[str], fields: list[str], source: str, line: int) -> Measurement:
    where = f"{source}:{line}"
    # Fields beyond the header's columns mean values may sit under the wrong columns (a
    # decimal comma, "1,38983", would store 1 GiB of memory): no measurement.
    if len(fields) > len(columns):
        surplus = ",".join(fields[len(columns) :])
        raise ValueError(
            f"{where}: {len(fields)} fields, the header has {len(columns)} columns (beyond "
            f"them: {shown(surplus)}); a decimal comma or an unquoted comma in a value "
            "shifts every field after it"
        )
    row = dict(zip(columns, fields, strict=False))
    empty = [c for c in _REQUIRED_COLUMNS if not row.get(c, "").strip()]
    if empty:
        raise ValueError(
            f"{where}: no value for {', '.join(empty)} ({len(fields)} fields, the header "
            f"has {len(columns)} columns)"
        )
    try:
        return _measurement(row, source, where, line)
    except ValueError as exc:
        if str(exc).startswith(where):
            raise
        raise ValueError(f"{where}: {exc}") from None


def _int(row: dict[str, str], column: str, where: str, text: str | None = None) -> int:
    """``row[column]`` (or ``text``, a part of it) as a whole number; ValueError naming
    the column (Python's "invalid literal for int() with base 10" named none)."""
    value = row[column] if text is None else text
    try:
        if "_" in value:  # Python reads "1_0" as 10; no CSV writer means that
            raise ValueError(value)
        return int(value)
    except ValueError:
        raise ValueError(f"{where}: {column} must be a whole number, got {shown(value)}") from None


def _float(row: dict[str, str], column: str, where: str) -> float:
    """``row[column]`` as a number; ValueError naming the column, and saying so where the
    value has a decimal comma."""
    value = row[column]
    try:
        if "_" in value:  # Python reads "0_01854" as 1854; no CSV writer means that
            raise ValueError(value)
        return float(value)
    except ValueError:
        hint = (
            f" (a decimal comma: write {value.strip().replace(',', '.')})"
            if value.count(",") == 1
            else ""
        )
        raise ValueError(f"{where}: {column} must be a number, got {shown(value)}{hint}") from None


def _measurement(row: dict[str, str], source: str, where: str, line: int) -> Measurement:
    dtype = row["DTYPE"]
    if dtype not in _WEIGHT_QUANT:
        raise ValueError(f"{where}: unknown DTYPE {shown(dtype)}; known: {sorted(_WEIGHT_QUANT)}")
    name = row["Model"]
    if not name.isprintable() or len(name) > MAX_MODEL_NAME_CHARS:
        raise ValueError(
            f"{where}: Model {shown(name)} must be printable and at most "
            f"{MAX_MODEL_NAME_CHARS} characters"
        )
    pp_map = tuple(_int(row, "PP_Map", where, part) for part in row["PP_Map"].split())
    tp, pp = _int(row, "TP", where), _int(row, "PP", where)
    if len(pp_map) != pp:
        raise ValueError(
            f"{where}: PP_Map {shown(row['PP_Map'])} has {len(pp_map)} stages, PP={pp}"
        )
    model, pruning = _split_model(name)
    measurement = Measurement(
        source=source,
        model=model,
        pruning=pruning,
        tp=tp,
        pp=pp,
        pp_map=pp_map,
        weight_quant=_WEIGHT_QUANT[dtype],
        int8_kv_cache=_parse_bool(row["INT8_KV_Cache"], where),
        output_tokens=_int(row, "Output_Lenght", where),
        batch_size=_int(row, "Batch_Size", where),
        latency_s=_float(row, "Latency", where),
        memory_gib=_float(row, "Memory-After-Run", where),
        memory_pre_run_gib=_float(row, "Memory-Pre-Run", where),
        line=line,
    )
    # Counts are stored in uint32 fields (ProfileMeasurement, DeploymentConfig).
    if not all(1 <= n <= UINT32_MAX for n in (tp, pp, *pp_map)):
        raise ValueError(f"{where}: TP, PP and every PP_Map stage must be from 1 to {UINT32_MAX}")
    counts = (measurement.output_tokens, measurement.batch_size)
    if not all(1 <= n <= UINT32_MAX for n in counts):
        raise ValueError(f"{where}: Output_Lenght and Batch_Size must be from 1 to {UINT32_MAX}")
    if measurement.batch_size > MAX_BATCH_SIZE:
        raise ValueError(
            f"{where}: Batch_Size must be at most {MAX_BATCH_SIZE}, the most sequences a "
            f"deployment holds and an estimate is made for, got {measurement.batch_size}"
        )
    if not 0 < measurement.latency_s <= MAX_LATENCY_S:
        raise ValueError(
            f"{where}: Latency must be a positive number of seconds up to {MAX_LATENCY_S:g} "
            f"(a day), got {shown(row['Latency'])}"
        )
    for column in ("Memory-After-Run", "Memory-Pre-Run"):
        if not 0 <= _float(row, column, where) <= MAX_MEMORY_GIB:
            raise ValueError(
                f"{where}: {column} must be from 0 to {MAX_MEMORY_GIB:.0f} GiB (a pebibyte), "
                f"got {shown(row[column])}"
            )
    return measurement


def parse_measurements(text: str, source: str, max_rows: int = 0) -> tuple[Measurement, ...]:
    """Parse the text of one MaverIQ CSV named ``source`` (a base name, e.g.
    ``full_model_data_collection.csv``); raises ValueError naming the file and line of a
    bad row, or as soon as it has more than ``max_rows`` rows (0: no bound)."""
    lines = csv.reader(io.StringIO(text, newline=""))
    measurements = []
    try:
        columns = next(lines, [])
        missing = [c for c in _REQUIRED_COLUMNS if c not in columns]
        if missing:
            separator = next((c for c in ";\t|" if len(columns) == 1 and c in columns[0]), None)
            hint = (
                f" (the header reads as one column: the file is separated by {separator!r}; "
                "MaverIQ's files are comma-separated)"
                if separator
                else ""
            )
            raise ValueError(f"{source}: missing columns {', '.join(missing)}{hint}")
        named = [c for c in columns if c.strip()]
        twice = sorted({c for c in named if named.count(c) > 1})
        if twice:
            # Which copy holds the measurement is unknown (the last one was read).
            at = {c: [i + 1 for i, n in enumerate(columns) if n == c] for c in twice}
            said = "; ".join(f"{c} (columns {', '.join(map(str, at[c]))})" for c in twice)
            raise ValueError(f"{source}:1: the header names a column more than once: {said}")
        # A row's line is the one it starts on (a quoted field may span lines), the
        # header being line 1 as an editor shows it; blank lines come as no fields.
        start = lines.line_num + 1
        for fields in lines:
            if fields:
                if max_rows and len(measurements) >= max_rows:
                    raise ValueError(
                        f"{source}:{start}: more than {max_rows:,} rows; one import reads at "
                        "most that many (the published data set's files hold under 3,000)"
                    )
                measurements.append(_parse_row(columns, fields, source, start))
            start = lines.line_num + 1
    except csv.Error as exc:
        # The line the reader was on when it failed.
        raise ValueError(f"{source}:{lines.line_num}: {exc}") from None
    return tuple(measurements)


def load_measurements(path: str | Path) -> tuple[Measurement, ...]:
    """Parse one MaverIQ CSV; raises ValueError naming the file and line of a bad row."""
    path = Path(path)
    return parse_measurements(path.read_text(), path.name)


class _Entries(list):
    """A JSON object's (key, value) pairs in order, told apart from a JSON array."""


def parse_accuracy(text: str, source: str = ACCURACY) -> dict[AccuracyKey, float]:
    """Relative MMLU accuracy (% of FP16) by model and compression, from the text of
    ``MS_model_acc_MMLU.json``; raises ValueError naming ``source`` when it is malformed.

    Source keys look like ``llama-2-7b_int4_gptq_False_None``: model, dtype, int8 KV
    cache, pruning (always ``None`` in the published file).
    """

    try:
        # Every entry, a key given twice included (a dict keeps the last).
        entries = json_text.loads(text, object_pairs_hook=_Entries)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}:{exc.lineno}: not JSON ({exc.msg})") from None
    if not isinstance(entries, _Entries):  # a JSON array is no object (a list of pairs)
        raise ValueError(f"{source}: expected an object of accuracy figures")
    table: dict[AccuracyKey, float] = {}
    given: dict[AccuracyKey, str] = {}
    for key, value in entries:
        parts = key.split("_", 1)
        fields = parts[1].rsplit("_", 2) if len(parts) == 2 else []
        if len(fields) != 3 or not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(
                f"{source}: entry {shown(key)}: expected MODEL_DTYPE_KV_PRUNING: number"
            )
        try:
            accuracy = float(value)
        except OverflowError:  # JSON's 10**400 is an int no float holds
            accuracy = math.inf
        if not 0 <= accuracy < math.inf:
            raise ValueError(f"{source}: entry {shown(key)}: accuracy must be a finite number >= 0")
        if accuracy > MAX_RELATIVE_ACCURACY_PCT:
            raise ValueError(
                f"{source}: entry {shown(key)}: {accuracy:g} % of the FP16 model's score; "
                f"the figures are relative accuracy, at most {MAX_RELATIVE_ACCURACY_PCT:g}"
            )
        dtype, kv, pruning = fields
        if dtype not in _WEIGHT_QUANT:
            raise ValueError(f"{source}: key {shown(key)} has unknown dtype {shown(dtype)}")
        base, pruned = _split_model(parts[0])
        if pruned or pruning != "None":
            # A pruned variant's figure (no fingerprints of those are imported) replaced
            # its dense variant's: a probe's "…_wanda": 50 made fp16's accuracy 50.
            continue
        variant = AccuracyKey(base, _WEIGHT_QUANT[dtype], _parse_bool(kv, source))
        if variant.weight_quant == "fp16" and not variant.int8_kv_cache and accuracy != 100:
            # The reference itself: 0 passed, and every hardware's estimates of the model
            # read fp16 as 0 % accurate (a tester).
            raise ValueError(
                f"{source}: entry {shown(key)}: {accuracy:g}; the figures are % of the FP16 "
                "model's score, so the FP16 model's own is 100"
            )
        if variant in table and table[variant] != accuracy:
            raise ValueError(
                f"{source}: entries {shown(given[variant])} and {shown(key)} give one variant "
                f"two accuracies ({table[variant]:g} and {accuracy:g}); keep one"
            )
        table[variant], given[variant] = accuracy, key
    return table


def load_accuracy(path: str | Path) -> dict[AccuracyKey, float]:
    """:func:`parse_accuracy` of a file."""
    path = Path(path)
    return parse_accuracy(path.read_text(), path.name)


def load_directory(directory: str | Path) -> MaverIQData:
    """Parse every file of the published data set found in ``directory``."""
    directory = Path(directory)
    return MaverIQData(
        fingerprints=load_measurements(directory / FINGERPRINTS),
        fingerprints_batch=load_measurements(directory / FINGERPRINTS_BATCH),
        full_models=load_measurements(directory / FULL_MODELS),
        full_models_batch=load_measurements(directory / FULL_MODELS_BATCH),
        full_models_pruned=load_measurements(directory / FULL_MODELS_PRUNED),
        unbalanced_pp=load_measurements(directory / UNBALANCED_PP),
        accuracy_pct=load_accuracy(directory / ACCURACY),
    )
