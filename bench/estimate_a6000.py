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

from services.estimation.calibrate import (  # noqa: E402
    calibrate_latency,
    calibrate_memory_constants,
    calibrate_parallel_constants,
)
from services.estimation.extrapolate import LatencySample, fit_layer_latency  # noqa: E402
from services.estimation.latency import (  # noqa: E402
    O_PP_FROM_BASE,
    REFERENCE_LAYOUTS,
    parallel_latency,
    phase_latency,
)
from services.estimation.memory import solve_memory_components, total_memory_gib  # noqa: E402
from services.estimation.references import (  # noqa: E402
    ReferenceProfile,
    VariantProfile,
    extrapolate_references,
)
from services.estimation.score import Calibration, estimate_space  # noqa: E402
from services.estimation.space import ModelShape, Variant, enumerate_space  # noqa: E402
from services.importers.maveriq import MaverIQData, Measurement, load_directory  # noqa: E402

# Public configs of the six models (layers, attention heads, KV heads, head size).
SHAPES = {
    "falcon-7b": ModelShape("falcon-7b", 32, 71, 1, 64),
    "falcon-40b": ModelShape("falcon-40b", 60, 128, 8, 64),
    "gptj-6b": ModelShape("gptj-6b", 28, 16, 16, 256),
    "llama-2-7b": ModelShape("llama-2-7b", 32, 32, 32, 128),
    "llama-2-13b": ModelShape("llama-2-13b", 40, 40, 40, 128),
    "llama-2-70b": ModelShape("llama-2-70b", 80, 64, 8, 128),
}
MEASURED = ("falcon-7b", "gptj-6b", "llama-2-7b", "llama-2-13b")
UNMEASURED = ("llama-2-70b", "falcon-40b")
LONG = "923-token prompt"
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


def by_variant_layout(rows: Sequence[Measurement]) -> dict[tuple, list[Measurement]]:
    out: dict[tuple, list[Measurement]] = collections.defaultdict(list)
    for r in rows:
        out[(r.variant, (r.tp, r.pp))].append(r)
    return out


def model_profiles(
    data: MaverIQData, model: str, layouts: tuple[tuple[int, int], ...]
) -> dict[tuple, ReferenceProfile]:
    """iserve's references for every profiled variant of ``model``."""
    long_rows = by_variant_layout(data.fingerprints)
    short_rows = by_variant_layout(data.fingerprints_batch)
    latency, memory = {}, {}
    for (variant, layout), rows in long_rows.items():
        if variant[0] != model or layout not in layouts:
            continue
        samples = [LatencySample(r.layers, r.latency_s, r.output_tokens, prompt=LONG) for r in rows]
        samples += [
            LatencySample(r.layers, r.latency_s, r.output_tokens, prompt=("short", r.batch_size))
            for r in short_rows.get((variant, layout), [])
        ]
        latency[(variant, layout)] = samples
        memory[(variant, layout)] = ([r.layers for r in rows], [r.memory_gib for r in rows])
    return extrapolate_references(
        SHAPES[model].num_layers,
        latency,
        memory,
        prompt=LONG,
        layouts=layouts,
        tp_ladder_phases=("ttft",),
    )


@dataclass(frozen=True)
class Table:
    """The full-model rows as arrays."""

    rows: tuple[Measurement, ...]
    model: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    out: np.ndarray
    latency: np.ndarray
    memory: np.ndarray
    ttft: np.ndarray  # per (variant, layout) least-squares TTFT of the measured rows
    tpot: np.ndarray


def full_model_table(data: MaverIQData) -> Table:
    rows = data.full_models
    phases = {}
    for key, group in by_variant_layout(rows).items():
        design = np.array([[1.0, r.output_tokens] for r in group])
        phases[key] = np.linalg.lstsq(design, [r.latency_s for r in group], rcond=None)[0]
    key = [(r.variant, (r.tp, r.pp)) for r in rows]
    return Table(
        rows=rows,
        model=np.array([r.model for r in rows]),
        tp=np.array([r.tp for r in rows], dtype=float),
        pp=np.array([r.pp for r in rows], dtype=float),
        out=np.array([r.output_tokens for r in rows], dtype=float),
        latency=np.array([r.latency_s for r in rows]),
        memory=np.array([r.memory_gib for r in rows]),
        ttft=np.array([phases[k][0] for k in key]),
        tpot=np.array([phases[k][1] for k in key]),
    )


def evaluate_iserve(data: MaverIQData, table: Table, layouts, label: str):
    """Leave-one-model-out estimates of every full-model row; returns (latency, memory)."""
    profiles = {}
    for model in MEASURED:
        profiles.update(model_profiles(data, model, layouts))
    refs = {
        name: np.array([getattr(profiles[r.variant], name) for r in table.rows])
        for name in ("ttft_s", "tpot_s", "memory_gib")
    }
    est_latency = np.full(len(table.rows), np.nan)
    est_memory = np.full(len(table.rows), np.nan)
    for held in MEASURED:
        train, test = table.model != held, table.model == held
        # A training row is usable when its own layout's references are known.
        usable = train & np.isfinite(_ladder_value(refs["ttft_s"], table.tp, layouts))
        latency_constants, scales, latency_fit = calibrate_latency(
            refs["ttft_s"][usable],
            refs["tpot_s"][usable],
            table.tp[usable],
            table.pp[usable],
            table.out[usable],
            table.latency[usable],
            table.ttft[usable],
            table.tpot[usable],
            layouts=layouts,
        )
        ttft_refs, tpot_refs = scales.apply(refs["ttft_s"][test], refs["tpot_s"][test])
        est_latency[test] = phase_latency(
            ttft_refs,
            tpot_refs,
            table.tp[test],
            table.pp[test],
            table.out[test],
            latency_constants,
            layouts=layouts,
        )[2]
        memory_constants, memory_fit = calibrate_memory_constants(
            refs["memory_gib"][train], table.tp[train], table.pp[train], table.memory[train]
        )
        m = refs["memory_gib"][test]
        parts = solve_memory_components(m[:, 0], m[:, 1], m[:, 2], memory_constants)
        est_memory[test] = total_memory_gib(parts, table.tp[test], table.pp[test], memory_constants)
        c = latency_constants
        print(
            f"  {label:10s} w/o {held:11s} TTFT a,b,g,d {_fmt(c.ttft)} TPOT {_fmt(c.tpot)}"
            f" scales {_scales(scales)}"
            f" fit {latency_fit.mape_pct:3.1f}%; peer {memory_constants.tp_peer_gib:.2f} GiB"
            f" fit {memory_fit.mape_pct:3.1f}%"
        )
    return est_latency, est_memory


def _ladder_value(refs: np.ndarray, tp: np.ndarray, layouts) -> np.ndarray:
    """Each row's reference at its own (tp, 1) when that is a ladder layout, else 0."""
    value = np.zeros(len(tp))
    for i, (degree, _) in enumerate(layouts[3:], start=3):
        value = np.where(tp == degree, refs[:, i], value)
    return value


def _scales(scales) -> str:
    return "/".join(",".join(f"{x:.2f}" for x in phase) for phase in (scales.ttft, scales.tpot))


def _fmt(constants) -> str:
    return ",".join(f"{x:.2f}" for x in constants.as_array())


def maveriq_references(data: MaverIQData, variant: tuple) -> tuple[np.ndarray, ...]:
    """MaverIQ's code: per-layout 4-point solve, L(1,2) read as L(1,1); memory, o = 10 rows."""
    long_rows = by_variant_layout(data.fingerprints)
    short_rows = by_variant_layout(data.fingerprints_batch)
    layers = SHAPES[variant[0]].num_layers
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


def evaluate_maveriq(data: MaverIQData, table: Table):
    variants = sorted({r.variant for r in table.rows})
    refs = {v: maveriq_references(data, v) for v in variants}
    ttft = np.array([refs[r.variant][0] for r in table.rows])
    tpot = np.array([refs[r.variant][1] for r in table.rows])
    mem = np.array([refs[r.variant][2] for r in table.rows])
    latency_refs = ttft + table.out[:, None] * tpot
    # No tp = 2 reference: O_TP = 0 (MaverIQ's code sets it to 0 for falcon-7b).
    latency_refs[:, 1] = np.where(
        np.isnan(latency_refs[:, 1]), latency_refs[:, 0] / 2, latency_refs[:, 1]
    )
    mem[:, 1] = np.where(np.isnan(mem[:, 1]), mem[:, 0], mem[:, 1])
    quant = np.array([f"{r.weight_quant}/{r.int8_kv_cache}" for r in table.rows])
    est_latency = np.full(len(table.rows), np.nan)
    for held in MEASURED:
        train, test = table.model != held, table.model == held
        for q in np.unique(quant[test]):
            fit_rows, est_rows = train & (quant == q), test & (quant == q)
            constants, _ = calibrate_parallel_constants(
                latency_refs[fit_rows],
                table.tp[fit_rows],
                table.pp[fit_rows],
                table.latency[fit_rows],
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


def print_errors(table: Table, results: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    print("\nAbsolute percentage error, median and p90 (targets: latency 2.5 / 7, memory 1.5 / 4)")
    head = "".join(f" | {name:^23s}" for name in results)
    print(f"{'':16s}{head}")
    print(f"{'':16s}" + " | latency %   memory %  " * len(results))
    groups = [(m, table.model == m) for m in MEASURED]
    groups += [("all", np.ones(len(table.rows), bool))]
    groups += [("  tp <= 2", table.tp <= 2), ("  tp >= 4", table.tp >= 4)]
    for name, rows in groups:
        cells = "".join(
            f" | {error_stats(lat, table.latency, rows)} {error_stats(mem, table.memory, rows)}"
            for lat, mem in results.values()
        )
        print(f"{name:16s}{cells}  ({rows.sum()} rows)")


def calibration_on_all(data: MaverIQData, table: Table, layouts) -> Calibration:
    """Constants fitted on all four measured models, for the unmeasured ones."""
    profiles = {}
    for model in MEASURED:
        profiles.update(model_profiles(data, model, layouts))
    refs = {
        name: np.array([getattr(profiles[r.variant], name) for r in table.rows])
        for name in ("ttft_s", "tpot_s", "memory_gib")
    }
    usable = np.isfinite(_ladder_value(refs["ttft_s"], table.tp, layouts))
    latency, scales, _ = calibrate_latency(
        refs["ttft_s"][usable],
        refs["tpot_s"][usable],
        table.tp[usable],
        table.pp[usable],
        table.out[usable],
        table.latency[usable],
        table.ttft[usable],
        table.tpot[usable],
        layouts=layouts,
    )
    memory, _ = calibrate_memory_constants(refs["memory_gib"], table.tp, table.pp, table.memory)
    return Calibration(latency=latency, memory=memory, reference_scales=scales)


def print_unmeasured(data: MaverIQData, table: Table) -> None:
    print("\nSanity: models never measured in full, estimated from fingerprints (+TP ladder),")
    print("8 GPUs, batch 1, 100 output tokens, every profiled variant")
    calibration = calibration_on_all(data, table, TP_LADDER)
    c = calibration.latency
    print(
        f"  constants fitted on all four measured models: TTFT a,b,g,d {_fmt(c.ttft)},"
        f" TPOT {_fmt(c.tpot)}, scales {_scales(calibration.reference_scales)},"
        f" peer {calibration.memory.tp_peer_gib:.2f} GiB"
    )
    for model in UNMEASURED:
        profiles = model_profiles(data, model, TP_LADDER)
        variants = [
            Variant(f"{w}/kv-{'int8' if kv else 'fp16'}", w, "int8" if kv else "fp16")
            for _, w, kv in profiles
        ]
        space = enumerate_space(SHAPES[model], 8, variants, (1,))
        estimates = estimate_space(
            space,
            [VariantProfile(p) for p in profiles.values()],
            calibration,
            output_tokens=100,
            device_memory_gib=DEVICE_GIB,
        )
        fits = estimates.fits
        lat, mem = estimates.latency_s, estimates.memory_total_gib * 2**30 / 1e9
        print(
            f"  {model:12s} {space.size:3d} configs, {fits.sum():3d} fit 48 GB/GPU: latency "
            f"{lat[fits].min():5.1f}-{lat[fits].max():5.1f} s, memory {mem[fits].min():5.1f}-"
            f"{mem[fits].max():5.1f} GB (all configs: {lat.min():.1f}-{lat.max():.1f} s,"
            f" {mem.min():.1f}-{mem.max():.1f} GB)"
        )
    print("  papers, llama-2-70b on 8 GPUs at 100 tokens: 2.7-21.5 s, 33.7-153.9 GB")


def main() -> None:
    started = time.perf_counter()
    data = load_directory(data_dir())
    table = full_model_table(data)
    print(METHOD)
    print("\nCalibrated constants per fold:")
    results = {
        "iserve, 3 refs": evaluate_iserve(data, table, REFERENCE_LAYOUTS, "3 refs"),
        "iserve, +TP ladder": evaluate_iserve(data, table, TP_LADDER, "+TP ladder"),
        "MaverIQ as published": evaluate_maveriq(data, table),
    }
    print_errors(table, results)
    print_unmeasured(data, table)
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
