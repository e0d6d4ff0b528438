"""Estimation accuracy on real GPU measurements: the MaverIQ A6000 data, leave one model out.

For each model with full-model measurements (falcon-7b, gptj-6b, llama-2-7b,
llama-2-13b) every full-model row (batch 1, 923-token prompt, outputs 10-200, every
(tp, pp) on 8 GPUs) is estimated from that model's *fingerprint* rows only, with the
hardware constants calibrated on the other three models' full-model rows. Printed: the
median and p90 absolute percentage error of latency and memory per model and overall,
for iserve's estimator (with the design's three references, and with a TP ladder) and
for MaverIQ's method as published. Then a sanity line for llama-2-70b and falcon-40b,
whose full models were never measured.

Run: ``python bench/estimate_a6000.py`` (data from ``$ISERVE_SHARED_DATA`` or
``../shared/data`` beside the repository). Takes about a minute on two cores.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimator_svc.hardware_calibration import (  # noqa: E402
    CalibrationTable,
    calibration_table,
    fit_calibration,
    predict_rows,
)
from estimator_svc.model_references import (  # noqa: E402
    ModelReferences,
    Workload,
    estimate,
    model_references,
)
from estimator_svc.profiles import (  # noqa: E402
    Sample,
    estimation_shape,
    estimation_variants,
    sample_from_measurement,
)
from fingerprint_svc.importing import plan_maveriq_import  # noqa: E402
from services.api import model_service_pb2 as model_pb  # noqa: E402
from services.estimation.calibrate import calibrate_parallel_constants  # noqa: E402
from services.estimation.extrapolate import LatencySample, fit_layer_latency  # noqa: E402
from services.estimation.latency import (  # noqa: E402
    O_PP_FROM_BASE,
    REFERENCE_LAYOUTS,
    parallel_latency,
)
from services.importers.maveriq import MaverIQData, Measurement, load_directory  # noqa: E402

MEASURED = ("falcon-7b", "gptj-6b", "llama-2-7b", "llama-2-13b")
UNMEASURED = ("llama-2-70b", "falcon-40b")
TP_LADDER = REFERENCE_LAYOUTS + ((4, 1), (8, 1))
DEVICE_GIB = 48.0 * 1e9 / 2**30  # RTX A6000: 48 GB

METHOD = """\
Method (leave one model out; nothing of the held-out model's full-model rows is used)
  iserve   references from the held-out model's fingerprints (1-3 hidden layers):
           one least-squares fit per model over all its variants; per-layer TTFT/TPOT per
           variant from the pp=1 fingerprints, TP communication per layer and 'other'
           terms shared by the variants, pp>1 fingerprints fit only their 'other' terms;
           samples = the 923-token-prompt rows (o = 10, 20) plus the short-prompt rows at
           batch 1 and 2 (shared TPOT, own TTFT). Memory: one per-layer slope per
           variant over its layouts, an intercept per layout (923-token rows only).
           Latency: Eq. 2 applied to TTFT and to TPOT with their own alpha..delta,
           O_PP from the (1,2) reference, L = TTFT + o * TPOT. Memory: M2 plus a
           per-TP-peer device overhead and a per-layout residual table.
           Calibration on the other three models: alpha..delta by gradient descent on
           MAPE (per phase, then jointly on end-to-end latency); memory terms likewise.
    3 refs       the design's references (1,1), (2,1), (1,2)
    +TP ladder   the fingerprints also profiled at (4,1) and (8,1): their measured
                 O_TP(tp) replaces (tp-1)^beta * O_TP
  MaverIQ  as published (its code): per layout a 4-point solve of its two fingerprints
           (923-token rows), O_PP from (1,1) (its code reads L(1,2) as L(1,1)), negative
           terms clipped, Eq. 2 on end-to-end latency with alpha..delta per (dtype, int8 KV)
           fitted by gradient descent on MAPE over the other models; memory: two-point
           extrapolation per layout (short-prompt rows, o = 10), M = M11 + (tp-1) A +
           tp (pp-1) A_p, no overhead term.
  Errors: |estimate / measured - 1| over every full-model row; memory = Memory-After-Run."""


def data_dir() -> Path:
    env = os.environ.get("ISERVE_SHARED_DATA")
    base = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
    return base / "maveriq-a6000"


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


def import_models(directory: Path) -> dict[str, ImportedModel]:
    """Every model of the data set, through the same import the service runs."""
    files = [(p.name, p.read_bytes()) for p in sorted(directory.iterdir()) if p.is_file()]
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


def evaluate_iserve(table: CalibrationTable, label: str):
    """Leave-one-model-out estimates of every full-model row; returns (latency, memory)."""
    est_latency = np.full(table.size, np.nan)
    est_memory = np.full(table.size, np.nan)
    for held in MEASURED:
        train, test = table.models != held, table.models == held
        fitted = fit_calibration(table, rows=train)
        est_latency[test], est_memory[test] = predict_rows(table, fitted.calibration, test)
        c = fitted.calibration
        print(
            f"  {label:10s} w/o {held:11s} TTFT a,b,g,d {_fmt(c.latency.ttft)}"
            f" TPOT {_fmt(c.latency.tpot)} scales {_scales(c.reference_scales)}"
            f" fit {fitted.latency_fit_pct:3.1f}%; peer {c.memory.tp_peer_gib:.2f} GiB"
            f" fit {fitted.memory_fit_pct:3.1f}%"
        )
    return est_latency, est_memory


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


def evaluate_maveriq(data: MaverIQData, table: CalibrationTable, num_layers: dict[str, int]):
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
    for held in MEASURED:
        train, test = table.models != held, table.models == held
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
    return est_latency, est_memory


def error_stats(estimate: np.ndarray, measured: np.ndarray, rows: np.ndarray) -> str:
    err = 100.0 * np.abs(estimate[rows] / measured[rows] - 1.0)
    return f"{np.median(err):5.1f} {np.percentile(err, 90):5.1f}"


def print_errors(
    table: CalibrationTable, results: dict[str, tuple[np.ndarray, np.ndarray]]
) -> None:
    print("\nAbsolute percentage error, median and p90 (targets: latency 2.5 / 7, memory 1.5 / 4)")
    head = "".join(f" | {name:^23s}" for name in results)
    print(f"{'':16s}{head}")
    print(f"{'':16s}" + " | latency %   memory %  " * len(results))
    groups = [(m, table.models == m) for m in MEASURED]
    groups += [("all", np.ones(table.size, bool))]
    groups += [("  tp <= 2", table.tp <= 2), ("  tp >= 4", table.tp >= 4)]
    for name, rows in groups:
        cells = "".join(
            f" | {error_stats(lat, table.latency_s, rows)}"
            f" {error_stats(mem, table.memory_gib, rows)}"
            for lat, mem in results.values()
        )
        print(f"{name:16s}{cells}  ({rows.sum()} rows)")


def print_unmeasured(models: dict[str, ImportedModel], table: CalibrationTable) -> None:
    print("\nSanity: models never measured in full, estimated from fingerprints (+TP ladder),")
    print("8 GPUs, batch 1, 923-token prompt, 100 output tokens, every profiled variant")
    calibration = fit_calibration(table).calibration
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
            f"  {model:12s} {estimates.space.size:3d} configs, {fits.sum():3d} fit 48 GB/GPU: "
            f"latency {lat[fits].min():5.1f}-{lat[fits].max():5.1f} s, memory "
            f"{mem[fits].min():5.1f}-{mem[fits].max():5.1f} GB (all configs: "
            f"{lat.min():.1f}-{lat.max():.1f} s, {mem.min():.1f}-{mem.max():.1f} GB)"
        )
    print("  papers, llama-2-70b on 8 GPUs at 100 tokens: 2.7-21.5 s, 33.7-153.9 GB")


def main() -> None:
    started = time.perf_counter()
    directory = data_dir()
    data = load_directory(directory)
    models = import_models(directory)
    num_layers = {name: m.model.shape.num_layers for name, m in models.items()}
    three = full_model_table(models, REFERENCE_LAYOUTS)
    ladder = full_model_table(models, TP_LADDER)
    # The same rows in the same order: the error table compares them row by row.
    assert np.array_equal(three.latency_s, ladder.latency_s)
    print(METHOD)
    print("\nCalibrated constants per fold:")
    results = {
        "iserve, 3 refs": evaluate_iserve(three, "3 refs"),
        "iserve, +TP ladder": evaluate_iserve(ladder, "+TP ladder"),
        "MaverIQ as published": evaluate_maveriq(data, ladder, num_layers),
    }
    print_errors(ladder, results)
    print_unmeasured(models, ladder)
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
