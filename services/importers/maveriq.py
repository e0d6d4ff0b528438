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
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "AccuracyKey",
    "MaverIQData",
    "Measurement",
    "load_accuracy",
    "load_directory",
    "load_measurements",
]

# The CSV files of the published data set, by the role they play.
FINGERPRINTS = "fingerprint_data_collection.csv"
FINGERPRINTS_BATCH = "fingerprint_data_collection_BS.csv"
FULL_MODELS = "full_model_data_collection.csv"
FULL_MODELS_BATCH = "full_model_data_collection_BS.csv"
FULL_MODELS_PRUNED = "full_model_data_collection_pruning.csv"
UNBALANCED_PP = "unbalanced_PP_data_collection.csv"
ACCURACY = "MS_model_acc_MMLU.json"

# The engine dtype column, as iserve's weight-quantization names.
_WEIGHT_QUANT = {"float16": "fp16", "int8": "int8", "int4": "int4", "int4_gptq": "int4_gptq"}
# Models of the data set; a longer model name is a pruned variant of one of them.
BASE_MODELS = ("falcon-7b", "falcon-40b", "gptj-6b", "llama-2-7b", "llama-2-13b", "llama-2-70b")
_MISSPELLED_MODELS = {"gtpj-6b": "gptj-6b"}
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
    for base in sorted(BASE_MODELS, key=len, reverse=True):
        if name == base:
            return base, None
        if name.startswith(base + "-"):
            return base, name[len(base) + 1 :]
    return name, None


def _parse_bool(text: str, where: str) -> bool:
    if text not in ("True", "False"):
        raise ValueError(f"{where}: INT8_KV_Cache must be True or False, got {text!r}")
    return text == "True"


def _parse_row(row: dict[str, str], source: str, line: int) -> Measurement:
    where = f"{source}:{line}"
    dtype = row["DTYPE"]
    if dtype not in _WEIGHT_QUANT:
        raise ValueError(f"{where}: unknown DTYPE {dtype!r}; known: {sorted(_WEIGHT_QUANT)}")
    pp_map = tuple(int(part) for part in row["PP_Map"].split())
    tp, pp = int(row["TP"]), int(row["PP"])
    if len(pp_map) != pp:
        raise ValueError(f"{where}: PP_Map {row['PP_Map']!r} has {len(pp_map)} stages, PP={pp}")
    model, pruning = _split_model(row["Model"])
    return Measurement(
        source=source,
        model=model,
        pruning=pruning,
        tp=tp,
        pp=pp,
        pp_map=pp_map,
        weight_quant=_WEIGHT_QUANT[dtype],
        int8_kv_cache=_parse_bool(row["INT8_KV_Cache"], where),
        output_tokens=int(row["Output_Lenght"]),
        batch_size=int(row["Batch_Size"]),
        latency_s=float(row["Latency"]),
        memory_gib=float(row["Memory-After-Run"]),
        memory_pre_run_gib=float(row["Memory-Pre-Run"]),
    )


def load_measurements(path: str | Path) -> tuple[Measurement, ...]:
    """Parse one MaverIQ CSV; raises ValueError naming the file and line of a bad row."""
    path = Path(path)
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in _REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path.name}: missing columns {missing}")
        # Line numbers count the header as line 1, as an editor shows them.
        return tuple(_parse_row(row, path.name, n) for n, row in enumerate(reader, start=2))


def load_accuracy(path: str | Path) -> dict[AccuracyKey, float]:
    """Relative MMLU accuracy (% of FP16) by model and compression.

    Source keys look like ``llama-2-7b_int4_gptq_False_None``: model, dtype, int8 KV
    cache, pruning (always ``None`` in the published file).
    """
    path = Path(path)
    table: dict[AccuracyKey, float] = {}
    for key, value in json.loads(path.read_text()).items():
        model, rest = key.split("_", 1)
        dtype, kv, _pruning = rest.rsplit("_", 2)
        if dtype not in _WEIGHT_QUANT:
            raise ValueError(f"{path.name}: key {key!r} has unknown dtype {dtype!r}")
        base, _ = _split_model(model)
        table[AccuracyKey(base, _WEIGHT_QUANT[dtype], _parse_bool(kv, path.name))] = float(value)
    return table


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
