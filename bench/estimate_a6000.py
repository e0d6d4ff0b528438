"""Estimation accuracy on real GPU measurements: the MaverIQ A6000 data, held-out models.

Every full-model row (batch 1, 923-token prompt, outputs 10-200, every (tp, pp) on 8
GPUs) of a held-out model is estimated from that model's *fingerprint* rows only, with
the hardware constants calibrated on other models' full-model rows. Two splits
(``--split``, default both):

``loao``   leave one model out: each of falcon-7b, gptj-6b, llama-2-7b, llama-2-13b held
           out in turn, calibrated on the other three.
``scale``  scale transfer: calibrated on the smaller models (falcon-7b, gptj-6b,
           llama-2-7b) only, llama-2-13b (the largest measured) estimated. On these four
           models that is the same fold as LOAO's llama-2-13b one (computed once, so the
           figures agree by construction); it is reported on its own because it is the
           deployment case, a model larger than anything calibrated on, and it stays that
           if larger models are ever measured in full (LOAO would calibrate on them).

Printed per split, for iserve's estimator (with the design's three references, and with a
TP ladder) and for MaverIQ's method as published, on the same rows: the median and p90
absolute percentage error of latency and memory per held-out model and overall; then per
(tp, pp) layout and per variant (weight dtype, int8 KV cache) the median and p90 absolute
error and the signed median bias (estimate / measured - 1).

Decision regret (scale split): for each intent that these measurements can judge
(min_latency, min_memory, min_cost = memory x latency, min_device_hours; at batch 1
max_throughput ranks as min_device_hours does) and each output length of the held-out
model's full-model rows, the configuration ranked first among those measured in full,
then ``measured metric of it / best measured metric - 1``. iserve's choice is the
service's own: ``estimate`` over the model's configuration space (KV cache sized for
prompt + output), ``score.rank`` with the unmeasured configurations marked as not
fitting. MaverIQ's choice is the lowest estimate of the same metric (ties to fewer
devices), from its row estimates above. Goal: worst regret at most 5 %.

Then a sanity line for llama-2-70b and falcon-40b, whose full models were never measured.

``--leave-out FILE`` imports the data set without that file on iserve's side, e.g.
``fingerprint_data_collection_BS.csv`` (the short-prompt fingerprints at batch 1 and 2,
which sharpen the TPOT terms): what a profile of the 923-token fingerprints alone gives.

Run: ``python bench/estimate_a6000.py [--split loao,scale] [--leave-out FILE]`` (data from
``$ISERVE_SHARED_DATA`` or ``../shared/data`` beside the repository). Takes about a
minute on two cores.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimator_svc.hardware_calibration import (  # noqa: E402
    CalibrationTable,
    batch_points,
    calibration_table,
    fit_calibration,
    predict_rows,
)
from fingerprint_svc.importing import plan_maveriq_import, variant_name  # noqa: E402
from services.api import model_service_pb2 as model_pb  # noqa: E402
from services.estimation.calibrate import (  # noqa: E402
    calibrate_parallel_constants,
    fit_tpot_batch_growth,
)
from services.estimation.extrapolate import LatencySample, fit_layer_latency  # noqa: E402
from services.estimation.latency import (  # noqa: E402
    O_PP_FROM_BASE,
    REFERENCE_LAYOUTS,
    TENSOR,
    parallel_latency,
)
from services.estimation.model_references import (  # noqa: E402
    ModelReferences,
    Workload,
    estimate,
    model_references,
)
from services.estimation.profiles import (  # noqa: E402
    Sample,
    estimation_shape,
    estimation_variants,
    sample_from_measurement,
)
from services.estimation.score import Calibration, Intent, rank  # noqa: E402
from services.estimation.space import parallel_pairs  # noqa: E402
from services.importers.maveriq import (  # noqa: E402
    RTX_A6000_DEVICE_BYTES,
    MaverIQData,
    Measurement,
    load_directory,
)  # noqa: E402

MEASURED = ("falcon-7b", "gptj-6b", "llama-2-7b", "llama-2-13b")
SCALE_TRAIN = ("falcon-7b", "gptj-6b", "llama-2-7b")
SCALE_HELD = "llama-2-13b"
SPLITS = {
    "loao": "leave one model out",
    "scale": f"scale transfer: {', '.join(SCALE_TRAIN)} -> {SCALE_HELD}",
}
DEVICES = 8
PRIMARY = "iserve, +TP ladder"  # the service's path for models profiled with a TP ladder
UNMEASURED = ("llama-2-70b", "falcon-40b")
# Full-model latencies of the unmeasured models at 100 output tokens that an independent
# check quoted (issue 15), printed beside the estimates; nothing is fitted on them.
QUOTED = {"falcon-40b": {("int4", (8, 1)): 2.2, ("int4", (4, 2)): 1.6}}
TP_LADDER = REFERENCE_LAYOUTS + ((4, 1), (8, 1))
# Files the import can do without: the short-prompt fingerprints at batch 1 and 2, and
# the accuracy table (the regret's intents set no accuracy floor).
LEAVE_OUT = ("fingerprint_data_collection_BS.csv", "MS_model_acc_MMLU.json")
DEVICE_GIB = RTX_A6000_DEVICE_BYTES / 2**30  # NVML's total for an RTX A6000

METHOD = """\
Method (held-out models; nothing of a held-out model's full-model rows is used)
  splits   loao: each measured model held out, calibrated on the other three;
           scale: calibrated on falcon-7b, gptj-6b, llama-2-7b, llama-2-13b held out
           (on these four models the same fold as LOAO's llama-2-13b one)
  iserve   references from the held-out model's fingerprints (1-3 hidden layers):
           one least-squares fit per model over all its variants; per-layer TTFT/TPOT per
           variant from the pp=1 fingerprints, TP communication per layer and 'other'
           terms shared by the variants, pp>1 fingerprints fit only their 'other' terms;
           samples = the 923-token-prompt rows (o = 10, 20) plus the short-prompt rows at
           batch 1 and 2 (shared TPOT, own TTFT). Memory: each layer's weights and
           KV cache known from the architecture and TensorRT-LLM's formats (the
           import's layer_weight_bytes, layer_kv_bytes_per_token); the fingerprints
           fit an intercept per layout (923-token rows only).
           Latency: Eq. 2 applied to TTFT and to TPOT with their own alpha..delta,
           O_PP from the (1,2) reference, L = TTFT + o * TPOT; at tp = 4 and 8 the
           hardware's measured O_TP(tp)/O_TP(2) (median over the fold's models at
           pp = 1) replaces (tp-1)^beta. Memory: M2 plus a
           per-TP-peer device overhead and a per-layout residual table.
           Calibration on the fold's models: reference scales per layout and phase
           (and per weight format where it departs the same way on every fold model,
           beyond their spread); alpha..delta by gradient descent on MAPE (per phase,
           then jointly on end-to-end latency); memory terms likewise. At (4,1) and
           (8,1) the communication per layer is the median over variants, no lower
           than 2(tp-1)/tp x the tp = 2 one.
    3 refs       the design's references (1,1), (2,1), (1,2)
    +TP ladder   the fingerprints also profiled at (4,1) and (8,1): their measured
                 O_TP(tp) replaces (tp-1)^beta * O_TP
  MaverIQ  as published (its code): per layout a 4-point solve of its two fingerprints
           (923-token rows), O_PP from (1,1) (its code reads L(1,2) as L(1,1)), negative
           terms clipped, Eq. 2 on end-to-end latency with alpha..delta per (dtype, int8 KV)
           fitted by gradient descent on MAPE over the fold's models; memory: two-point
           extrapolation per layout (short-prompt rows, o = 10), M = M11 + (tp-1) A +
           tp (pp-1) A_p, no overhead term.
  Errors: |estimate / measured - 1| over every full-model row; memory = Memory-After-Run;
           bias: signed median of estimate / measured - 1.
  Regret   (scale split) per intent and output length: measured metric of the
           configuration ranked first among those measured in full / the best measured
           - 1; iserve ranks with the service's estimate() and score.rank()."""

# A fold: held-out model -> the models its constants are calibrated on.
Folds = dict[str, tuple[str, ...]]


def split_folds(split: str) -> Folds:
    if split == "loao":
        return {held: tuple(m for m in MEASURED if m != held) for held in MEASURED}
    return {SCALE_HELD: SCALE_TRAIN}


def union_folds(splits: Sequence[str]) -> Folds:
    """Every fold the splits need, each once (a model held out twice must be calibrated
    on the same models both times)."""
    folds: Folds = {}
    for split in splits:
        for held, train in split_folds(split).items():
            assert set(folds.setdefault(held, train)) == set(train), (held, train)
    return folds


def _fold_rows(table: CalibrationTable, held: str, train: Sequence[str]):
    return np.isin(table.models, train), table.models == held


def data_dir() -> Path:
    """The MaverIQ A6000 data: ``$ISERVE_SHARED_DATA/maveriq-a6000``, else
    ``../shared/data/maveriq-a6000`` beside the repository; exits saying so when it is
    not there (a checkout elsewhere)."""
    env = os.environ.get("ISERVE_SHARED_DATA")
    base = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
    directory = base / "maveriq-a6000"
    if not (directory / "fingerprint_data_collection.csv").is_file():
        where = "ISERVE_SHARED_DATA" if env else "../shared/data beside the repository"
        sys.exit(
            f"no MaverIQ data at {directory} ({where}): set ISERVE_SHARED_DATA to the "
            "directory that holds maveriq-a6000/"
        )
    return directory


@dataclass(frozen=True)
class ImportedModel:
    """One model as ``iserve profile import`` stores it: record and samples."""

    model: model_pb.Model
    measurements: tuple[model_pb.ProfileMeasurement, ...]
    samples: tuple[Sample, ...]

    def references(self, use_tp_ladder: bool) -> ModelReferences:
        """The service's extrapolation of this model's fingerprints."""
        return model_references(
            estimation_shape(self.model),
            estimation_variants(self.model, self.measurements),
            self.samples,
            use_tp_ladder=use_tp_ladder,
        )


def import_models(directory: Path, leave_out: Sequence[str] = ()) -> dict[str, ImportedModel]:
    """Every model of the data set, through the same import the service runs, without
    the files named in ``leave_out``."""
    paths = [p for p in sorted(directory.iterdir()) if p.is_file() and p.name not in leave_out]
    files = [(p.name, p.read_bytes()) for p in paths]
    plan = plan_maveriq_import(files, "rtx-a6000")
    return {
        m.model_id: ImportedModel(
            model_pb.Model(model_id=m.model_id, shape=m.shape, variants=m.variants),
            m.measurements,
            tuple(sample_from_measurement(x) for x in m.measurements),
        )
        for m in plan.models
    }


def full_model_table(models: dict[str, ImportedModel], layouts) -> CalibrationTable:
    """The measured models' full-model rows beside their extrapolated references."""
    use_ladder = len(layouts) > len(REFERENCE_LAYOUTS)
    entries = [
        (name, models[name].references(use_ladder), models[name].samples) for name in MEASURED
    ]
    return calibration_table(entries, layouts)


@dataclass(frozen=True)
class Result:
    """One method's estimates of the table's rows (NaN where not held out) and, for
    iserve, the constants each held-out model was estimated with."""

    latency: np.ndarray
    memory: np.ndarray
    calibrations: dict[str, Calibration] = dataclasses.field(default_factory=dict)
    tp_ladder: bool = False


def evaluate_iserve(table: CalibrationTable, label: str, folds: Folds) -> Result:
    """Estimates of every held-out model's full-model rows."""
    est_latency = np.full(table.size, np.nan)
    est_memory = np.full(table.size, np.nan)
    calibrations = {}
    for held, train_models in folds.items():
        train, test = _fold_rows(table, held, train_models)
        fitted = fit_calibration(table, rows=train)
        est_latency[test], est_memory[test] = predict_rows(table, fitted.calibration, test)
        c = calibrations[held] = fitted.calibration
        print(
            f"  {label:10s} w/o {held:11s} TTFT a,b,g,d {_fmt(c.latency.ttft)}"
            f" TPOT {_fmt(c.latency.tpot)} scales {_scales(c.reference_scales)}"
            f" fit {fitted.latency_fit_pct:3.1f}%; peer {c.memory.tp_peer_gib:.2f} GiB"
            f" fit {fitted.memory_fit_pct:3.1f}%"
        )
    return Result(est_latency, est_memory, calibrations, len(table.layouts) > 3)


def _scales(scales) -> str:
    return "/".join(",".join(f"{x:.2f}" for x in phase) for phase in (scales.ttft, scales.tpot))


def _fmt(constants) -> str:
    return ",".join(f"{x:.2f}" for x in constants.as_array())


def _variant(model: str, name: str) -> tuple[str, str, bool]:
    """(model, weight quantization, int8 KV cache) of an imported variant name."""
    return (model, name.removesuffix("-kv8"), name.endswith("-kv8"))


def by_variant_layout(rows: Sequence[Measurement]) -> dict[tuple, list[Measurement]]:
    out: dict[tuple, list[Measurement]] = collections.defaultdict(list)
    for r in rows:
        out[(r.variant, (r.tp, r.pp))].append(r)
    return out


def maveriq_references(
    data: MaverIQData, variant: tuple, num_layers: dict[str, int]
) -> tuple[np.ndarray, ...]:
    """MaverIQ's code: per-layout 4-point solve, L(1,2) read as L(1,1); memory, o = 10 rows."""
    long_rows = by_variant_layout(data.fingerprints)
    short_rows = by_variant_layout(data.fingerprints_batch)
    layers = num_layers[variant[0]]
    ttft, tpot, memory = [], [], []
    for layout in REFERENCE_LAYOUTS:
        rows = long_rows.get((variant, (1, 1) if layout == (1, 2) else layout))
        if rows is None:  # falcon-7b has no tp = 2
            ttft.append(np.nan)
            tpot.append(np.nan)
            memory.append(np.nan)
            continue
        fit = fit_layer_latency(
            [LatencySample(r.layers, r.latency_s, r.output_tokens) for r in rows]
        )
        terms = fit.for_prompt()
        ttft.append(terms.ttft(layers))
        tpot.append(terms.tpot(layers))
        points = sorted(
            (r.layers, r.memory_gib)
            for r in short_rows[(variant, layout)]
            if r.batch_size == 1 and r.output_tokens == 10
        )
        (n1, m1), (n2, m2) = points
        memory.append(m1 + (m2 - m1) / (n2 - n1) * (layers - n1))
    return np.array(ttft), np.array(tpot), np.array(memory)


def evaluate_maveriq(
    data: MaverIQData, table: CalibrationTable, num_layers: dict[str, int], folds: Folds
) -> Result:
    row_variants = [_variant(m, v) for m, v in zip(table.models, table.variants, strict=True)]
    refs = {v: maveriq_references(data, v, num_layers) for v in sorted(set(row_variants))}
    ttft = np.array([refs[v][0] for v in row_variants])
    tpot = np.array([refs[v][1] for v in row_variants])
    mem = np.array([refs[v][2] for v in row_variants])
    latency_refs = ttft + table.output_tokens[:, None] * tpot
    # No tp = 2 reference: O_TP = 0 (MaverIQ's code sets it to 0 for falcon-7b).
    latency_refs[:, 1] = np.where(
        np.isnan(latency_refs[:, 1]), latency_refs[:, 0] / 2, latency_refs[:, 1]
    )
    mem[:, 1] = np.where(np.isnan(mem[:, 1]), mem[:, 0], mem[:, 1])
    quant = np.array([f"{w}/{kv}" for _, w, kv in row_variants])
    est_latency = np.full(table.size, np.nan)
    for held, train_models in folds.items():
        train, test = _fold_rows(table, held, train_models)
        for q in np.unique(quant[test]):
            fit_rows, est_rows = train & (quant == q), test & (quant == q)
            constants, _ = calibrate_parallel_constants(
                latency_refs[fit_rows],
                table.tp[fit_rows],
                table.pp[fit_rows],
                table.latency_s[fit_rows],
                O_PP_FROM_BASE,
                clamp_overheads=True,
                steps=250,
            )
            est_latency[est_rows] = parallel_latency(
                *latency_refs[est_rows].T,
                table.tp[est_rows],
                table.pp[est_rows],
                constants,
                O_PP_FROM_BASE,
                clamp_overheads=True,
            )
    activations = np.maximum(mem[:, 1] - mem[:, 0], 0.0)
    pipeline = np.maximum(mem[:, 2] - mem[:, 0], 0.0)
    est_memory = mem[:, 0] + (table.tp - 1) * activations + table.tp * (table.pp - 1) * pipeline
    est_memory[np.isnan(est_latency)] = np.nan  # only the held-out rows
    return Result(est_latency, est_memory)


def pct_errors(estimate: np.ndarray, measured: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Signed percentage errors of the ``rows`` that have both figures."""
    err = 100.0 * (estimate[rows] / measured[rows] - 1.0)
    return err[np.isfinite(err)]


def error_stats(estimate: np.ndarray, measured: np.ndarray, rows: np.ndarray) -> str:
    err = np.abs(pct_errors(estimate, measured, rows))
    return f"{np.median(err):5.1f} {np.percentile(err, 90):5.1f}"


def bias_stats(estimate: np.ndarray, measured: np.ndarray, rows: np.ndarray) -> str:
    err = pct_errors(estimate, measured, rows)
    return f"{error_stats(estimate, measured, rows)} {np.median(err):+5.1f}"


def _print_groups(
    table: CalibrationTable,
    results: dict[str, Result],
    groups: Sequence[tuple[str, np.ndarray]],
    stats: Callable[[np.ndarray, np.ndarray, np.ndarray], str],
    width: int,
) -> None:
    head = "".join(f" | {name:^{width}s}" for name in results)
    half = (width - 1) // 2
    units = f"{'latency %':^{half}s} {'memory %':^{half}s}"
    print(f"{'':16s}{head}")
    print(f"{'':16s}" + f" | {units}" * len(results))
    for name, rows in groups:
        cells = "".join(
            f" | {stats(r.latency, table.latency_s, rows)} {stats(r.memory, table.memory_gib, rows)}"
            for r in results.values()
        )
        print(f"{name:16s}{cells}  ({rows.sum()} rows)")


def print_errors(table: CalibrationTable, results: dict[str, Result], tested: np.ndarray) -> None:
    print("\nAbsolute percentage error, median and p90 (targets: latency 2.5 / 7, memory 1.5 / 4)")
    groups = [(m, table.models == m) for m in MEASURED if (tested & (table.models == m)).any()]
    groups += [("all", tested)]
    groups += [
        ("  tp <= 2", tested & (table.tp <= 2)),
        ("  tp >= 4", tested & (table.tp >= 4)),
        ("  tp = 8", tested & (table.tp == 8)),
    ]
    _print_groups(table, results, groups, error_stats, 23)


def own_lines(table: CalibrationTable) -> np.ndarray:
    """Each row's latency on the least-squares line L = a + b * o through the rows of its
    own (model, variant, layout): what an estimator of Eq. 2's form would give if it
    knew the held-out rows themselves (NaN where a group has under three rows)."""
    fitted = np.full(table.size, np.nan)
    measured = table.latency_s > 0
    groups = set(zip(table.models, table.variants, table.tp, table.pp, strict=True))
    for model, variant, tp, pp in groups:
        rows = (
            measured
            & (table.models == model)
            & (table.variants == variant)
            & (table.tp == tp)
            & (table.pp == pp)
        )
        if rows.sum() < 3:
            continue
        design = np.c_[np.ones(rows.sum()), table.output_tokens[rows]]
        line = np.linalg.lstsq(design, table.latency_s[rows], rcond=None)[0]
        fitted[rows] = design @ line
    return fitted


def print_floor(table: CalibrationTable, tested: np.ndarray) -> None:
    """How far the measured rows themselves are from a line in the output length: the
    floor under any estimate of the form TTFT + o * TPOT."""
    lines = own_lines(table)
    print(
        "\nThe rows' own floor: each (model, variant, layout)'s least-squares line through"
        " its own rows, |line / measured - 1| %, median and p90"
    )
    for name, rows in (
        ("  tp <= 2", tested & (table.tp <= 2)),
        ("  tp = 4", tested & (table.tp == 4)),
        ("  tp = 8", tested & (table.tp == 8)),
    ):
        print(f"{name:16s} | {error_stats(lines, table.latency_s, rows)}  ({rows.sum()} rows)")


def print_breakdown(
    table: CalibrationTable, results: dict[str, Result], tested: np.ndarray
) -> None:
    print(
        "\nPer layout and variant: median, p90 absolute % error and signed median bias"
        " (estimate / measured - 1)"
    )
    layouts = sorted(
        {(int(tp), int(pp)) for tp, pp in zip(table.tp[tested], table.pp[tested], strict=True)}
    )
    groups = [
        (f"tp {tp} pp {pp}", tested & (table.tp == tp) & (table.pp == pp)) for tp, pp in layouts
    ]
    groups += [(v, tested & (table.variants == v)) for v in sorted(set(table.variants[tested]))]
    _print_groups(table, results, groups, bias_stats, 35)


# What each intent minimises, from (latency s, memory GiB, devices) as score.py's
# Estimates computes it (latency_s, cost_memory_gib, cost_memory_latency, cost_device_hours).
INTENT_METRICS: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]] = {
    "min_latency": lambda latency, memory, devices: latency,
    "min_memory": lambda latency, memory, devices: memory,
    "min_cost": lambda latency, memory, devices: memory * latency,
    "min_device_hours": lambda latency, memory, devices: devices * latency / 3600.0,
}


def service_choices(
    references: ModelReferences,
    calibration: Calibration,
    table: CalibrationTable,
    rows: np.ndarray,
    output_tokens: int,
) -> tuple[dict[str, int], np.ndarray, np.ndarray]:
    """The service's pick per intent among the measured ``rows`` (one output length).

    Returns the table row ranked first per intent, and the service's latency and memory
    estimates of ``rows`` (to compare with the table's path).
    """
    estimates = estimate(
        references,
        calibration,
        Workload(output_tokens=output_tokens),
        devices=DEVICES,
        device_memory_gib=DEVICE_GIB,
    )
    space = estimates.space
    config_of = {
        (space.variants[c["variant"]].name, int(c["tp"]), int(c["pp"])): i
        for i, c in enumerate(space.configs)
    }
    indices = np.flatnonzero(rows)
    configs = np.array(
        [config_of[(table.variants[r], int(table.tp[r]), int(table.pp[r]))] for r in indices]
    )
    row_of_config = np.full(space.size, -1)
    row_of_config[configs] = indices
    measured = dataclasses.replace(estimates, fits=estimates.fits & (row_of_config >= 0))
    choices = {}
    for kind in INTENT_METRICS:
        best = rank(measured, Intent(kind=kind)).best
        assert best is not None, f"no measured configuration fits for {kind}"
        choices[kind] = int(row_of_config[best])
    return choices, estimates.latency_s[configs], estimates.memory_total_gib[configs]


def lowest_choices(result: Result, table: CalibrationTable, rows: np.ndarray) -> dict[str, int]:
    """Per intent, the row whose estimated metric is lowest (ties to fewer devices)."""
    indices = np.flatnonzero(rows)
    devices = table.tp[indices] * table.pp[indices]
    choices = {}
    for kind, metric in INTENT_METRICS.items():
        key = metric(result.latency[indices], result.memory[indices], devices)
        choices[kind] = int(indices[np.lexsort((indices, devices, key))[0]])
    return choices


def _describe(table: CalibrationTable, row: int) -> str:
    return f"{table.variants[row]}@{int(table.tp[row])}x{int(table.pp[row])}"


def regret_choices(
    models: dict[str, ImportedModel],
    table: CalibrationTable,
    results: dict[str, Result],
    held: str,
    output_tokens: int,
) -> tuple[dict[str, dict[str, int]], np.ndarray]:
    """Per method and intent, the table row chosen among ``held``'s measured rows at
    ``output_tokens``; and the service's estimates / the table's - 1 (latency, memory)."""
    rows = (table.models == held) & (table.output_tokens == output_tokens)
    choices, gaps = {}, []
    for method, result in results.items():
        if not result.calibrations:
            choices[method] = lowest_choices(result, table, rows)
            continue
        refs = models[held].references(use_tp_ladder=result.tp_ladder)
        choices[method], latency, memory = service_choices(
            refs, result.calibrations[held], table, rows, output_tokens
        )
        gaps.append([latency / result.latency[rows] - 1.0, memory / result.memory[rows] - 1.0])
    return choices, np.concatenate(gaps, axis=1)


def print_regret(
    models: dict[str, ImportedModel],
    table: CalibrationTable,
    results: dict[str, Result],
    held: str,
) -> None:
    print(
        f"\nDecision regret, {held} (batch 1, 923-token prompt; candidates: the configurations"
        " measured in full):\nmeasured metric of the configuration ranked first / best"
        " measured - 1, % (goal: worst <= 5 %)"
    )
    methods = list(results)
    short = [m.removeprefix("iserve, ").removesuffix(" as published") for m in methods]
    print(
        f"{'intent':17s}{'out':>4s} |"
        + "".join(f" {name:>8s}" for name in short)
        + f" | {'chosen (' + PRIMARY.removeprefix('iserve, ') + ')':18s} measured best"
    )
    held_rows = table.models == held
    outputs = sorted({int(o) for o in table.output_tokens[held_rows]})
    picks = {o: regret_choices(models, table, results, held, o) for o in outputs}
    every: dict[str, list[float]] = {m: [] for m in methods}
    for kind, metric in INTENT_METRICS.items():
        truth = metric(table.latency_s, table.memory_gib, table.tp * table.pp)
        regrets = {m: [] for m in methods}
        for o in outputs:
            rows = np.flatnonzero(held_rows & (table.output_tokens == o))
            best = int(rows[np.argmin(truth[rows])])
            choices = picks[o][0]
            for m in methods:
                regrets[m].append(100.0 * (truth[choices[m][kind]] / truth[best] - 1.0))
            cells = "".join(f" {regrets[m][-1]:8.1f}" for m in methods)
            chosen = _describe(table, choices[PRIMARY][kind])
            print(f"{kind:17s}{o:4d} |{cells} | {chosen:18s} {_describe(table, best)}")
        for m in methods:
            every[m] += regrets[m]
        _print_reduced("  ", regrets, methods)
    _print_reduced("all: ", every, methods)
    gaps = np.abs(np.concatenate([gap for _, gap in picks.values()], axis=1))
    print(
        "service path (estimate(), KV cache sized for prompt + output) against the table's"
        f" row estimates: max |difference| latency {100 * gaps[0].max():.2f} %,"
        f" memory {100 * gaps[1].max():.2f} %"
    )


def _print_reduced(prefix: str, regrets: dict[str, list[float]], methods: list[str]) -> None:
    for label, reduce in (("median", np.median), ("worst", np.max)):
        cells = "".join(f" {reduce(regrets[m]):8.1f}" for m in methods)
        print(f"{prefix + label:21s} |{cells}")


def print_unmeasured(models: dict[str, ImportedModel], calibration: Calibration) -> None:
    print("\nSanity: models never measured in full, estimated from fingerprints (+TP ladder),")
    print("8 GPUs, batch 1, 923-token prompt, 100 output tokens, every profiled variant")
    c = calibration.latency
    print(
        f"  constants fitted on all four measured models: TTFT a,b,g,d {_fmt(c.ttft)},"
        f" TPOT {_fmt(c.tpot)}, scales {_scales(calibration.reference_scales)},"
        f" peer {calibration.memory.tp_peer_gib:.2f} GiB"
    )
    for model in UNMEASURED:
        estimates = estimate(
            models[model].references(use_tp_ladder=True),
            calibration,
            Workload(output_tokens=100),
            devices=8,
            device_memory_gib=DEVICE_GIB,
        )
        fits = estimates.fits
        lat, mem = estimates.latency_s, estimates.memory_total_gib * 2**30 / 1e9
        print(
            f"  {model:12s} {estimates.space.size:3d} configs, {fits.sum():3d} fit {DEVICE_GIB:.1f} GiB/GPU: "
            f"latency {lat[fits].min():5.1f}-{lat[fits].max():5.1f} s, memory "
            f"{mem[fits].min():5.1f}-{mem[fits].max():5.1f} GB (all configs: "
            f"{lat.min():.1f}-{lat.max():.1f} s, {mem.min():.1f}-{mem.max():.1f} GB)"
        )
        space = estimates.space
        names = [v.name for v in space.variants]
        for (variant, layout), seconds in QUOTED.get(model, {}).items():
            i = np.flatnonzero(
                (space.tp == layout[0])
                & (space.pp == layout[1])
                & (space.variant == names.index(variant))
            )[0]
            print(
                f"    {variant}@{layout[0]}x{layout[1]}: TTFT {estimates.ttft_s[i] * 1e3:.0f} ms,"
                f" TPOT {estimates.tpot_s[i] * 1e3:.1f} ms, latency {lat[i]:.2f} s; measured"
                f" {seconds} s (quoted in an issue; a check, never fitted): "
                f"{lat[i] / seconds - 1:+.0%}"
            )
    print("  papers, llama-2-70b on 8 GPUs at 100 tokens: 2.7-21.5 s, 33.7-153.9 GB")


def held_out_calibrations(
    table: CalibrationTable, result: Result, names: Sequence[str]
) -> dict[str, Calibration]:
    """The constants each of ``names`` is estimated with out of sample: a measured model's
    fold (the other three; reused from ``result`` when it ran), an unmeasured one's fit on
    all four."""
    by_train: dict[tuple[str, ...], Calibration] = {}
    out = {}
    for model in names:
        train = tuple(m for m in MEASURED if m != model)
        if model in result.calibrations:
            out[model] = result.calibrations[model]
            continue
        if train not in by_train:
            rows = np.isin(table.models, train)
            by_train[train] = fit_calibration(table, rows=rows).calibration
        out[model] = by_train[train]
    return out


def print_decode_comm(
    data: MaverIQData, models: dict[str, ImportedModel], calibration: Calibration
) -> None:
    """Why tp = 8 stays above the goal: the decode overhead of tensor parallelism per
    layer, measured in full against what a model's fingerprints give at tp = 2."""
    rows = collections.defaultdict(list)
    for m in data.full_models:
        if m.batch_size == 1 and m.pp == 1:
            rows[(m.model, m.variant, m.tp)].append((m.output_tokens, m.latency_s))
    tpot = {}  # (model, variant, tp): seconds per token, the slope over output lengths
    for key, points in rows.items():
        outputs, latency = np.array(points, dtype=float).T
        if np.unique(outputs).size > 1:
            tpot[key] = np.polyfit(outputs, latency, 1)[0]
    ratios = dict(calibration.latency.tpot.tp_ratio)
    print(
        "\nDecode overhead of tensor parallelism per layer, ms: O_TP(tp) / layers, O_TP(tp) ="
        " TPOT(tp,1) - TPOT(1,1)/tp.\nFull models: median over variants of the slopes over"
        " output lengths (batch 1). Fingerprints:\nthe pooled fit's O_TP(2), and Eq. 2's"
        f" tp = 4, 8 from it with the hardware ratios {ratios[4]:.2f}, {ratios[8]:.2f}"
        " (all four)."
    )
    columns = "  ".join(f"{f'tp {tp}':>5s}" for tp in (2, 4, 8))
    print(f"{'':12s} | {'full models':12s}{columns} | {'fingerprints':12s}{columns}")
    for name in (*MEASURED, *UNMEASURED):
        layers = models[name].model.shape.num_layers
        full = []
        for tp in (2, 4, 8):
            per_layer = [
                (t - tpot[(name, *variant, 1)] / tp) / layers * 1e3
                for (model, *variant, degree), t in tpot.items()
                if model == name and degree == tp and (name, *variant, 1) in tpot
            ]
            full.append(f"{np.median(per_layer):5.3f}" if per_layer else "    -")
        refs = models[name].references(use_tp_ladder=True)
        profile = refs.at_input(refs.default_input_tokens())[0].batch1
        if TENSOR not in parallel_pairs(refs.shape, 2):
            print(
                f"{name:12s} | {' ' * 12}{'  '.join(full)} |   (no tp = 2: {refs.shape.num_heads} heads)"
            )
            continue
        two = (profile.tpot_s[1] - profile.tpot_s[0] / 2) / layers * 1e3
        implied = [f"{two:5.3f}", *(f"{ratios[tp] * two:5.3f}" for tp in (4, 8))]
        print(f"{name:12s} | {' ' * 12}{'  '.join(full)} | {' ' * 12}{'  '.join(implied)}")


def print_larger_models(
    data: MaverIQData, models: dict[str, ImportedModel], calibrations: dict[str, Calibration]
) -> None:
    """Estimates against the full-model runs of unbalanced_PP_data_collection.csv, the
    one file with llama-2-70b and falcon-40b measured in full (layers split evenly)."""
    runs = [m for m in data.unbalanced_pp if m.pruning is None and len(set(m.pp_map)) == 1]
    print(
        "\nCheck on larger models (never fitted): unbalanced_PP_data_collection.csv runs"
        " llama-2-70b at (1,8)\nand falcon-40b at (1,4) in full, fp16, 100 tokens, batch"
        " 1-64 (the evenly split maps used here). Its\nprompt length is not given, and the"
        " smaller models run 6-7 % faster there than the same\nconfigurations in"
        " full_model_data_collection.csv: read the larger models beside the smaller\nones of"
        " the same file. Measured models: their held-out fold; larger ones: fit on all four."
    )
    print(
        "estimate / measured - 1, %: latency, memory per batch size (923-token prompt"
        " assumed; the\nfile's batch > 1 runs cannot have had one: llama-2-70b (1,8) grows"
        " 6.7 s from batch 1 to 64,\nwhat 64 such prefills take a stage at the A6000's fp16"
        " peak alone, so only batch 1 checks)"
    )
    names = [m for m in (*MEASURED, *UNMEASURED) if any(r.model == m for r in runs)]
    batches = sorted({r.batch_size for r in runs})
    print(f"{'':12s} layout | " + " ".join(f"{f'batch {b}':>13s}" for b in batches))
    first: dict[str, float] = {}
    for model in names:
        mine = {r.batch_size: r for r in runs if r.model == model}
        cells = []
        for b in batches:
            run = mine.get(b)
            if run is None:
                cells.append(f"{'-':>13s}")
                continue
            estimates = estimate(
                models[model].references(use_tp_ladder=True),
                calibrations[model],
                Workload(output_tokens=run.output_tokens, batch_size=b),
                devices=DEVICES,
                device_memory_gib=DEVICE_GIB,
            )
            space = estimates.space
            variant = [v.name for v in space.variants].index(
                variant_name(run.weight_quant, run.int8_kv_cache)
            )
            i = np.flatnonzero(
                (space.tp == run.tp) & (space.pp == run.pp) & (space.variant == variant)
            )[0]
            lat = estimates.latency_s[i] / run.latency_s - 1
            mem = estimates.memory_total_gib[i] / run.memory_gib - 1
            if b == 1:
                first[model] = lat
            cells.append(f"{lat * 100:+6.1f} {mem * 100:+6.1f}")
        run = next(iter(mine.values()))
        print(f"{model:12s} ({run.tp},{run.pp})  | " + " ".join(cells))
    small = [first[m] for m in MEASURED if m in first]
    if small:
        offset = float(np.median(small))
        print(
            f"batch 1 latency beside the file's measured models (median {offset * 100:+.1f} %): "
            + ", ".join(
                f"{m} {((1 + first[m]) / (1 + offset) - 1) * 100:+.1f} %"
                for m in UNMEASURED
                if m in first
            )
        )


def print_batch_growth(
    directory: Path, data: MaverIQData, models: dict[str, ImportedModel]
) -> None:
    """Decode's growth per further sequence as the calibration fits it on the data set's
    one full-model batch sweep (gptj-6b), against the batch sweeps of other models: the
    even maps of unbalanced_PP_data_collection.csv and BS_scaling_data.csv."""
    entries = [(name, m.references(use_tp_ladder=True), m.samples) for name, m in models.items()]
    growth = fit_tpot_batch_growth(batch_points(entries))
    rates = {(w, tp): r for w, tp, r in growth}
    print(
        "\nDecode's growth per further sequence of a batch, r (TPOT(B) = TPOT(1) (1 + r (B-1))),"
        "\nfitted as the calibration fits it: on the one full-model batch sweep"
        " (full_model_data_collection_BS.csv,\ngptj-6b, batch 1-64, outputs 50-200; median over"
        " its layouts of each tensor degree). The\nbatch-2 fingerprints time a second sequence"
        " within their noise (about nothing):"
    )
    tps = sorted({tp for _, tp in rates})
    print(f"{'weights':10s}| " + " ".join(f"{f'tp {tp}':>8s}" for tp in tps))
    for weight in sorted({w for w, _ in rates}):
        cells = [
            f"{rates[(weight, tp)]:8.4f}" if (weight, tp) in rates else f"{'-':>8s}" for tp in tps
        ]
        print(f"{weight:10s}| " + " ".join(cells))
    # (file, model, weight format, tp, label, latency by batch size)
    sweeps: list[tuple[str, str, str, int, str, dict[int, float]]] = []
    runs: dict[tuple, dict[int, float]] = collections.defaultdict(dict)
    for m in data.unbalanced_pp:
        if m.pruning is None and len(set(m.pp_map)) == 1:
            runs[(m.model, m.weight_quant, m.tp, m.pp)][m.batch_size] = m.latency_s
    for (model, weight, tp, pp), by_batch in sorted(runs.items()):
        sweeps.append(("unbalanced_PP", model, weight, tp, f"({tp},{pp})", by_batch))
    scaling = directory / "BS_scaling_data.csv"
    if scaling.is_file():
        rows = list(csv.DictReader(scaling.read_text().splitlines()))
        first = rows[0]
        weight = {"float16": "fp16"}.get(first["DTYPE"], first["DTYPE"])
        by_batch = {int(row["Batch_Size"]): float(row["Latency"]) for row in rows}
        layout = f"({first['TP']},{first['PP']})"
        sweeps.append(("BS_scaling", first["Model"], weight, int(first["TP"]), layout, by_batch))
    print(
        "Other models' sweeps (never fitted; short prompts, 100 output tokens: latency is"
        " decode's),\nmeasured latency(B) / latency(1) against 1 + r (B-1), and the error of"
        " each ratio, %:"
    )
    errors: dict[str, list[float]] = {"r": [], "flat": []}
    for source, model, weight, tp, layout, by_batch in sweeps:
        r = rates.get((weight, tp), 0.0)
        cells = []
        for b in sorted(by_batch):
            if b == 1:
                continue
            measured = by_batch[b] / by_batch[1]
            predicted = 1 + r * (b - 1)
            errors["r"].append(abs(predicted / measured - 1))
            errors["flat"].append(abs(1 / measured - 1))
            cells.append(
                f"B{b} {measured:.2f}/{predicted:.2f} {(predicted / measured - 1) * 100:+.0f}"
            )
        print(f"  {source:13s} {model:12s} {weight} {layout:6s} " + ", ".join(cells))
    print(
        "|error| of the ratio, median / p90: with r "
        + " / ".join(f"{np.percentile(errors['r'], q) * 100:.1f}" for q in (50, 90))
        + " %; flat (no growth beyond the batch-2 profiles', as before) "
        + " / ".join(f"{np.percentile(errors['flat'], q) * 100:.1f}" for q in (50, 90))
        + f" % ({len(errors['r'])} points)"
    )
    print(
        "(the two files disagree on the one model both ran: gptj-6b fp16 (1,4) at batch 64"
        " takes 1.41x\nits batch-1 decode in the batch sweep, 1.26x its latency in"
        " unbalanced_PP)"
    )


def parse_args(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """(splits, files iserve's import leaves out)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--split",
        default=",".join(SPLITS),
        help=f"comma-separated splits to evaluate, of {', '.join(SPLITS)} (default: both)",
    )
    parser.add_argument(
        "--leave-out",
        action="append",
        default=[],
        choices=LEAVE_OUT,
        help="a file of the data set iserve's import leaves out (MaverIQ's method reads "
        "the data set as published); repeatable",
    )
    args = parser.parse_args(argv)
    splits = [s.strip() for s in args.split.split(",") if s.strip()]
    unknown = sorted(set(splits) - set(SPLITS))
    if unknown or not splits:
        parser.error(f"unknown split {unknown}; known: {', '.join(SPLITS)}")
    return splits, args.leave_out


def main(argv: Sequence[str] | None = None) -> None:
    splits, leave_out = parse_args(argv)
    started = time.perf_counter()
    directory = data_dir()
    data = load_directory(directory)
    models = import_models(directory, leave_out)
    num_layers = {name: m.model.shape.num_layers for name, m in models.items()}
    three = full_model_table(models, REFERENCE_LAYOUTS)
    ladder = full_model_table(models, TP_LADDER)
    # The same rows in the same order: the error table compares them row by row.
    assert np.array_equal(three.latency_s, ladder.latency_s)
    print(METHOD)
    if leave_out:
        print(f"iserve's import leaves out: {', '.join(leave_out)}")
    folds = union_folds(splits)
    print("\nCalibrated constants per fold:")
    results = {
        "iserve, 3 refs": evaluate_iserve(three, "3 refs", folds),
        PRIMARY: evaluate_iserve(ladder, "+TP ladder", folds),
        "MaverIQ as published": evaluate_maveriq(data, ladder, num_layers, folds),
    }
    for split in splits:
        tested = np.isin(ladder.models, list(split_folds(split)))
        print(f"\n=== Split {split}: {SPLITS[split]} ===")
        print_errors(ladder, results, tested)
        print_floor(ladder, tested)
        print_breakdown(ladder, results, tested)
        if split == "scale":
            print_regret(models, ladder, results, SCALE_HELD)
    # Held out: a measured model's fold, an unmeasured one's fit on all four.
    calibrations = held_out_calibrations(ladder, results[PRIMARY], (*MEASURED, *UNMEASURED))
    print_unmeasured(models, calibrations[UNMEASURED[0]])
    print_larger_models(data, models, calibrations)
    print_decode_comm(data, models, calibrations[UNMEASURED[0]])
    print_batch_growth(directory, data, models)
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
