"""Hardware calibrations, fitted on a hardware type's stored full-model measurements.

A calibration holds what ``services.estimation.score`` needs per hardware type: Eq. 2's
exponents per phase (TTFT, TPOT), the reference scales and the memory terms (per-TP-peer
overhead, per-layout residuals); see ``docs/estimation.md``. :func:`calibration_table`
lines up a hardware type's full-model runs with their models' extrapolated references;
:func:`fit_calibration` fits the constants on it (``estimation.calibrate``);
:func:`fit_hardware_calibration` does both for every model and returns a
:class:`HardwareCalibration` (``calibration_message`` gives its stored form).

When the models were profiled along a TP ladder ((4,1), (8,1) beside the three
references) two latency fits are kept: one with the ladder (used for models profiled
that way) and one with the three references only (for models that were not); the
memory terms are shared.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from services.estimation.calibrate import (
    BatchPoint,
    calibrate_latency,
    calibrate_memory_constants,
    fit_tpot_batch_growth,
)
from services.estimation.latency import REFERENCE_LAYOUTS, decode_steps, phase_latency
from services.estimation.memory import MemoryConstants, solve_memory_components, total_memory_gib
from services.estimation.model_references import ModelReferences
from services.estimation.profiles import Sample
from services.estimation.score import Calibration

__all__ = [
    "CalibrationTable",
    "FittedCalibration",
    "HardwareCalibration",
    "calibration_table",
    "fit_calibration",
    "fit_hardware_calibration",
    "predict_rows",
]

Layout = tuple[int, int]


@dataclass(frozen=True)
class CalibrationTable:
    """Full-model runs, one row each, beside their variant's extrapolated references.

    Times in seconds, memory in GiB summed over devices (NaN: not measured). The
    measured TTFT and TPOT of a row are those of its (variant, layout, prompt): a
    least-squares line through the end-to-end latencies at several output lengths, or
    the means of the token-timestamp figures. ``*_refs`` are (rows, len(layouts)), NaN
    for a TP-ladder layout the variant was not profiled at.
    """

    models: np.ndarray
    variants: np.ndarray
    weights: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    output_tokens: np.ndarray
    # TPOTs after the TTFT (decode_steps of output_tokens, by the references' phases).
    tpot_counts: np.ndarray
    latency_s: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    memory_gib: np.ndarray
    ttft_refs: np.ndarray
    tpot_refs: np.ndarray
    memory_refs: np.ndarray
    layouts: tuple[Layout, ...]

    @property
    def size(self) -> int:
        return int(self.tp.size)

    def latency_usable(self) -> np.ndarray:
        """Rows whose own layout's references are all known (a tp of the TP ladder needs
        its ladder figure) and whose measured figures are positive."""
        ok = (self.latency_s > 0) & (self.ttft_s > 0) & (self.tpot_s > 0)
        for i, (degree, _) in enumerate(self.layouts[3:], start=3):
            ok &= (self.tp != degree) | np.isfinite(self.ttft_refs[:, i])
        return ok

    def memory_usable(self) -> np.ndarray:
        return np.isfinite(self.memory_gib) & np.all(np.isfinite(self.memory_refs[:, :3]), axis=1)


def _measured_phases(group: Sequence[Sample], split: bool) -> tuple[float, float] | None:
    """(TTFT, TPOT) seconds of one (variant, layout, prompt) measured in full, as the
    references they are compared with count them (``split``: split out of end-to-end
    latencies, whose TTFT leaves the first token's step to the TPOTs; decode_steps)."""
    if all(s.direct_phases for s in group):
        ttft = float(np.mean([s.ttft_s for s in group]))
        tpot = float(np.mean([s.tpot_s for s in group]))
        return (ttft - tpot if split else ttft), tpot
    points = [(s.output_tokens, s.latency_s) for s in group if s.latency_s > 0]
    if len({o for o, _ in points}) < 2:
        return None
    design = np.array([[1.0, float(decode_steps(o, split))] for o, _ in points])
    ttft, tpot = np.linalg.lstsq(design, np.array([lat for _, lat in points]), rcond=None)[0]
    return float(ttft), float(tpot)


def _padded(values: Sequence[float], have: Sequence[Layout], layouts: Sequence[Layout]) -> list:
    index = {layout: i for i, layout in enumerate(have)}
    return [values[index[layout]] if layout in index else np.nan for layout in layouts]


def calibration_table(
    entries: Sequence[tuple[str, ModelReferences, Sequence[Sample]]],
    layouts: Sequence[Layout] = REFERENCE_LAYOUTS,
) -> CalibrationTable:
    """The full-model rows of every (model id, references, samples) entry that can be
    calibrated on: batch 1, layers split as evenly as they divide, a variant the references cover and a
    prompt length they were extrapolated for, TTFT and TPOT known (token timestamps, or
    end-to-end latencies at two or more output lengths)."""
    layouts = tuple(layouts)
    rows: dict[str, list] = defaultdict(list)
    for model_id, refs, samples in entries:
        prompts = {p.input_tokens: p for p in refs.prompts}
        groups: dict[tuple, list[Sample]] = defaultdict(list)
        for s in samples:
            if (
                s.full_model
                and s.batch == 1
                and s.balanced_stages
                and s.variant in refs.variant_keys
                and s.input_tokens in prompts
            ):
                groups[(s.variant, s.layout, s.input_tokens)].append(s)
        for (variant, _layout, input_tokens), group in groups.items():
            index = refs.variant_keys.index(variant)
            split = prompts[input_tokens].profiles[index].end_to_end_split
            phases = _measured_phases(group, split)
            if phases is None:
                continue
            profile = prompts[input_tokens].profiles[index].batch1
            weight = refs.variants[index].weight_quant
            references = {
                name: _padded(getattr(profile, name), profile.layouts, layouts)
                for name in ("ttft_s", "tpot_s", "memory_gib")
            }
            for s in group:
                rows["models"].append(model_id)
                rows["variants"].append(variant)
                rows["weights"].append(weight)
                rows["tp"].append(s.tp)
                rows["pp"].append(s.pp)
                rows["output_tokens"].append(s.output_tokens)
                rows["tpot_counts"].append(float(decode_steps(s.output_tokens, split)))
                rows["latency_s"].append(s.end_to_end_s())
                rows["ttft_s"].append(phases[0])
                rows["tpot_s"].append(phases[1])
                rows["memory_gib"].append(s.memory_gib if s.memory_gib > 0 else np.nan)
                rows["ttft_refs"].append(references["ttft_s"])
                rows["tpot_refs"].append(references["tpot_s"])
                rows["memory_refs"].append(references["memory_gib"])
    width = len(layouts)
    return CalibrationTable(
        models=np.array(rows["models"], dtype=object),
        variants=np.array(rows["variants"], dtype=object),
        weights=np.array(rows["weights"], dtype=object),
        **{
            name: np.array(rows[name], dtype=float)
            for name in (
                "tp",
                "pp",
                "output_tokens",
                "tpot_counts",
                "latency_s",
                "ttft_s",
                "tpot_s",
                "memory_gib",
            )
        },
        **{
            name: np.array(rows[name], dtype=float).reshape(-1, width)
            for name in ("ttft_refs", "tpot_refs", "memory_refs")
        },
        layouts=layouts,
    )


@dataclass(frozen=True)
class FittedCalibration:
    """Constants fitted on a calibration table and their MAPE (%) on it."""

    calibration: Calibration
    latency_fit_pct: float
    memory_fit_pct: float
    latency_rows: int
    memory_rows: int


def fit_calibration(
    table: CalibrationTable,
    rows: np.ndarray | None = None,
    steps: int = 250,
    memory: MemoryConstants | None = None,
) -> FittedCalibration:
    """Fit latency constants and reference scales (and, unless ``memory`` is given, the
    memory terms) on ``table`` (or the ``rows`` mask of it).

    Raises ValueError when no row can be fitted.
    """
    chosen = np.ones(table.size, dtype=bool) if rows is None else np.asarray(rows, dtype=bool)
    usable = chosen & table.latency_usable()
    if not usable.any():
        raise ValueError("no full-model run with known TTFT and TPOT to fit the latency model on")
    constants, scales, fit = calibrate_latency(
        table.ttft_refs[usable],
        table.tpot_refs[usable],
        table.tp[usable],
        table.pp[usable],
        table.tpot_counts[usable],
        table.latency_s[usable],
        table.ttft_s[usable],
        table.tpot_s[usable],
        layouts=table.layouts,
        steps=steps,
        weights=table.weights[usable],
        models=table.models[usable],
    )
    memory_rows = chosen & table.memory_usable()
    memory_fit = float("nan")
    if memory is None:
        memory = MemoryConstants()
        if memory_rows.any():
            memory, mfit = calibrate_memory_constants(
                table.memory_refs[memory_rows],
                table.tp[memory_rows],
                table.pp[memory_rows],
                table.memory_gib[memory_rows],
            )
            memory_fit = mfit.mape_pct
    return FittedCalibration(
        Calibration(latency=constants, memory=memory, reference_scales=scales),
        latency_fit_pct=fit.mape_pct,
        memory_fit_pct=memory_fit,
        latency_rows=int(usable.sum()),
        memory_rows=int(memory_rows.sum()),
    )


def predict_rows(
    table: CalibrationTable, calibration: Calibration, rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Estimated end-to-end latency (s) and memory (GiB) of the table's ``rows``."""
    chosen = np.ones(table.size, dtype=bool) if rows is None else np.asarray(rows, dtype=bool)
    ttft_refs, tpot_refs = calibration.reference_scales.apply(
        table.ttft_refs[chosen], table.tpot_refs[chosen], table.weights[chosen]
    )
    tp, pp = table.tp[chosen], table.pp[chosen]
    latency = phase_latency(
        ttft_refs,
        tpot_refs,
        tp,
        pp,
        table.tpot_counts[chosen],
        calibration.latency,
        calibration.o_pp_from,
        table.layouts,
    )[2]
    m = table.memory_refs[chosen]
    parts = solve_memory_components(m[:, 0], m[:, 1], m[:, 2], calibration.memory)
    return latency, total_memory_gib(parts, tp, pp, calibration.memory)


@dataclass(frozen=True)
class HardwareCalibration:
    """Everything scoring needs of one hardware type, plus where it came from.

    ``primary`` was fitted with TP-ladder references when ``tp_ladder``; then
    ``three_refs`` holds the fit for models profiled at the three references only.
    ``device_memory_bytes`` is 0 when unknown; ``fit_error_pct`` is the end-to-end
    latency MAPE of the primary fit.
    """

    hardware_type: str
    primary: Calibration
    tp_ladder: bool = False
    three_refs: Calibration | None = None
    device_memory_bytes: int = 0
    fit_error_pct: float = 0.0
    memory_fit_error_pct: float = float("nan")
    provenance: str = ""
    fitted_at_unix_ms: int = 0

    def with_batch_growth(self, growth: tuple[tuple[str, int, float], ...]) -> HardwareCalibration:
        """These constants with ``growth`` as decode's batch growth, both fits."""
        three = self.three_refs
        return replace(
            self,
            primary=replace(self.primary, tpot_batch_growth=growth),
            three_refs=None if three is None else replace(three, tpot_batch_growth=growth),
        )

    def for_references(self, refs: ModelReferences) -> tuple[Calibration, ModelReferences]:
        """The constants for a model's references, and the references to use them with
        (TP-ladder layouts dropped when these constants were not fitted with them)."""
        if refs.has_tp_ladder and self.tp_ladder:
            return self.primary, refs
        return self.three_refs or self.primary, refs.without_tp_ladder()


def batch_points(
    entries: Sequence[tuple[str, ModelReferences, Sequence[Sample]]],
) -> list[BatchPoint]:
    """The full-model runs of every entry that ``fit_tpot_batch_growth`` reads, at every
    batch size: layers split as evenly as they divide, a variant the references cover."""
    points = []
    for model_id, refs, samples in entries:
        for s in samples:
            if not (s.full_model and s.balanced_stages and s.variant in refs.variant_keys):
                continue
            latency = s.end_to_end_s()
            if latency <= 0:
                continue
            weight = refs.variants[refs.variant_keys.index(s.variant)].weight_quant
            run = (model_id, s.variant, s.layout, s.input_tokens)
            points.append(BatchPoint(weight, s.tp, run, s.batch, s.output_tokens, latency))
    return points


def fit_hardware_calibration(
    hardware_type: str,
    entries: Sequence[tuple[str, ModelReferences, Sequence[Sample]]],
    provenance: str,
    fitted_at_unix_ms: int,
    device_memory_bytes: int = 0,
    steps: int = 250,
) -> tuple[HardwareCalibration, CalibrationTable]:
    """Fit a hardware type's calibration on its models' full-model runs.

    ``entries`` are (model id, references, samples) per model. When any model's
    references include TP-ladder layouts, the primary fit uses them and the
    three-reference fit is kept beside it (the memory terms are fitted once). Returns
    the calibration and the table the primary fit used. Raises ValueError when no run
    can be fitted.
    """
    ladder = sorted({layout for _, refs, _ in entries for layout in refs.layouts[3:]})
    growth = fit_tpot_batch_growth(batch_points(entries))
    three = calibration_table(entries, REFERENCE_LAYOUTS)
    fitted_three = fit_calibration(three, steps=steps)
    calibration = HardwareCalibration(
        hardware_type=hardware_type,
        primary=fitted_three.calibration,
        device_memory_bytes=device_memory_bytes,
        fit_error_pct=fitted_three.latency_fit_pct,
        memory_fit_error_pct=fitted_three.memory_fit_pct,
        provenance=provenance,
        fitted_at_unix_ms=fitted_at_unix_ms,
    )
    if not ladder:
        return calibration.with_batch_growth(growth), three
    table = calibration_table(entries, REFERENCE_LAYOUTS + tuple(ladder))
    fitted = fit_calibration(table, steps=steps, memory=fitted_three.calibration.memory)
    return (
        HardwareCalibration(
            hardware_type=hardware_type,
            primary=fitted.calibration,
            tp_ladder=True,
            three_refs=fitted_three.calibration,
            device_memory_bytes=device_memory_bytes,
            fit_error_pct=fitted.latency_fit_pct,
            memory_fit_error_pct=fitted_three.memory_fit_pct,
            provenance=provenance,
            fitted_at_unix_ms=fitted_at_unix_ms,
        ).with_batch_growth(growth),
        table,
    )
