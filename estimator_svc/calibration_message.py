"""The stored form of a calibration (the ``Calibration`` message) and shipped defaults.

How the message carries it: ``alpha``, ``beta``, ``gamma``, ``delta`` are the TPOT
exponents of the primary fit (decode dominates end-to-end latency at the papers' output
lengths); ``extra_terms`` has every constant by name: ``ttft.alpha`` … ``tpot.delta``,
``scale.ttft.1x1`` … (reference scales; ``scale.ttft.1x1.int8`` … a weight format's own), ``tpot.tp_ratio.8`` … (the hardware's
measured ``O_TP(tp) / O_TP(2)`` per tensor degree above 2), ``tp_ladder`` (1 when the primary fit used
the ladder), the same under ``three_refs.`` for the second fit, ``memory.tp_peer_gib``,
``tpot.batch_growth.<weight>.tp<tp>`` (decode's growth per further sequence of a batch, a
share of the batch-1 TPOT), ``memory.residual_gib.TPxPP``, ``memory.fit_error_percent`` and ``device_memory_bytes``
(0 or absent: unknown). A message with no ``ttft.alpha`` (constants from elsewhere)
applies ``alpha`` … ``delta`` to both phases.

``GetCalibration`` falls back to the calibrations shipped in ``calibrations/<type>.json``
(the message as JSON) when Redis has none.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from estimator_svc.hardware_calibration import HardwareCalibration
from services.api import estimator_service_pb2 as estimator_pb
from services.estimation.latency import (
    REFERENCE_LAYOUTS,
    ParallelConstants,
    PhaseConstants,
    ReferenceScales,
)
from services.estimation.memory import MemoryConstants
from services.estimation.score import Calibration
from services.ids import is_valid_id
from services.state.records import decode

__all__ = ["SHIPPED_DIR", "from_proto", "load_shipped", "to_proto"]

Layout = tuple[int, int]
SHIPPED_DIR = Path(__file__).resolve().parent / "calibrations"
_CONSTANTS = ("alpha", "beta", "gamma", "delta")


def _layout_name(layout: Layout) -> str:
    return f"{layout[0]}x{layout[1]}"


def _latency_terms(calibration: Calibration, prefix: str) -> dict[str, float]:
    terms = {}
    for phase in ("ttft", "tpot"):
        constants = getattr(calibration.latency, phase)
        for name in _CONSTANTS:
            terms[f"{prefix}{phase}.{name}"] = getattr(constants, name)
        for degree, ratio in constants.tp_ratio:
            terms[f"{prefix}{phase}.tp_ratio.{degree}"] = ratio
        for layout, factor in zip(
            REFERENCE_LAYOUTS, getattr(calibration.reference_scales, phase), strict=True
        ):
            terms[f"{prefix}scale.{phase}.{_layout_name(layout)}"] = factor
    for weight, *per_phase in calibration.reference_scales.by_weight:
        for phase, factors in zip(("ttft", "tpot"), per_phase, strict=True):
            for layout, factor in zip(REFERENCE_LAYOUTS, factors, strict=True):
                terms[f"{prefix}scale.{phase}.{_layout_name(layout)}.{weight}"] = factor
    for weight, tp, rate in calibration.tpot_batch_growth:
        terms[f"{prefix}tpot.batch_growth.{weight}.tp{tp}"] = rate
    return terms


def to_proto(calibration: HardwareCalibration) -> estimator_pb.Calibration:
    """The stored form of a calibration (see the module docstring for the terms)."""
    c = calibration
    terms = _latency_terms(c.primary, "")
    terms["tp_ladder"] = 1.0 if c.tp_ladder else 0.0
    if c.three_refs is not None:
        terms.update(_latency_terms(c.three_refs, "three_refs."))
    terms["memory.tp_peer_gib"] = c.primary.memory.tp_peer_gib
    for layout, gib in c.primary.memory.layout_residual_gib:
        terms[f"memory.residual_gib.{_layout_name(layout)}"] = gib
    if np.isfinite(c.memory_fit_error_pct):
        terms["memory.fit_error_percent"] = c.memory_fit_error_pct
    if c.device_memory_bytes:
        terms["device_memory_bytes"] = float(c.device_memory_bytes)
    tpot = c.primary.latency.tpot
    return estimator_pb.Calibration(
        hardware_type=c.hardware_type,
        alpha=tpot.alpha,
        beta=tpot.beta,
        gamma=tpot.gamma,
        delta=tpot.delta,
        extra_terms={name: float(value) for name, value in terms.items()},
        provenance=c.provenance,
        fitted_at_unix_ms=c.fitted_at_unix_ms,
        fit_error_percent=c.fit_error_pct,
    )


def _latency_from_terms(
    message: estimator_pb.Calibration, terms: dict[str, float], prefix: str, memory: MemoryConstants
) -> Calibration:
    if f"{prefix}ttft.alpha" in terms:
        phases = {
            phase: ParallelConstants(
                *(terms[f"{prefix}{phase}.{n}"] for n in _CONSTANTS),
                tp_ratio=_tp_ratios(terms, f"{prefix}{phase}."),
            )
            for phase in ("ttft", "tpot")
        }
    else:
        both = ParallelConstants(message.alpha, message.beta, message.gamma, message.delta)
        phases = {"ttft": both, "tpot": both}
    scales = {
        phase: tuple(
            terms.get(f"{prefix}scale.{phase}.{_layout_name(layout)}", 1.0)
            for layout in REFERENCE_LAYOUTS
        )
        for phase in ("ttft", "tpot")
    }
    pattern = re.compile(re.escape(prefix) + r"scale\.(ttft|tpot)\.(\d+)x(\d+)\.(\w+)")
    found: dict[str, dict[tuple[str, Layout], float]] = {}
    for name, value in terms.items():
        match = pattern.fullmatch(name)
        if match:
            layout = (int(match[2]), int(match[3]))
            found.setdefault(match[4], {})[(match[1], layout)] = value
    by_weight = tuple(
        (
            weight,
            *(
                tuple(
                    factors.get((phase, layout), scales[phase][i])
                    for i, layout in enumerate(REFERENCE_LAYOUTS)
                )
                for phase in ("ttft", "tpot")
            ),
        )
        for weight, factors in sorted(found.items())
    )
    growth = re.compile(re.escape(prefix) + r"tpot\.batch_growth\.(\w+)\.tp(\d+)")
    return Calibration(
        latency=PhaseConstants(phases["ttft"], phases["tpot"]),
        memory=memory,
        reference_scales=ReferenceScales(
            ttft=scales["ttft"], tpot=scales["tpot"], by_weight=by_weight
        ),
        tpot_batch_growth=tuple(
            sorted(
                (match[1], int(match[2]), value)
                for name, value in terms.items()
                if (match := growth.fullmatch(name))
            )
        ),
    )


def _tp_ratios(terms: dict[str, float], prefix: str) -> tuple[tuple[int, float], ...]:
    pattern = re.compile(re.escape(prefix) + r"tp_ratio\.(\d+)")
    found = ((pattern.fullmatch(name), value) for name, value in terms.items())
    return tuple(sorted((int(match[1]), value) for match, value in found if match))


def from_proto(message: estimator_pb.Calibration) -> HardwareCalibration:
    """The calibration a stored ``Calibration`` message describes."""
    terms = dict(message.extra_terms)
    residuals = []
    for name, gib in sorted(terms.items()):
        match = re.fullmatch(r"memory\.residual_gib\.(\d+)x(\d+)", name)
        if match:
            residuals.append(((int(match[1]), int(match[2])), gib))
    memory = MemoryConstants(terms.get("memory.tp_peer_gib", 0.0), tuple(sorted(residuals)))
    has_three = "three_refs.ttft.alpha" in terms
    return HardwareCalibration(
        hardware_type=message.hardware_type,
        primary=_latency_from_terms(message, terms, "", memory),
        tp_ladder=terms.get("tp_ladder", 0.0) == 1.0,
        three_refs=_latency_from_terms(message, terms, "three_refs.", memory)
        if has_three
        else None,
        device_memory_bytes=int(terms.get("device_memory_bytes", 0)),
        fit_error_pct=message.fit_error_percent,
        memory_fit_error_pct=terms.get("memory.fit_error_percent", float("nan")),
        provenance=message.provenance,
        fitted_at_unix_ms=message.fitted_at_unix_ms,
    )


def load_shipped(
    hardware_type: str, directory: Path = SHIPPED_DIR
) -> estimator_pb.Calibration | None:
    """The calibration shipped with iserve for ``hardware_type`` (``<type>.json``), if any."""
    if not is_valid_id(hardware_type):
        return None
    path = directory / f"{hardware_type}.json"
    if not path.is_file():
        return None
    return decode(estimator_pb.Calibration, path.read_text())
