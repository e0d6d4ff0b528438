"""Fit the calibrations shipped with iserve (``estimator_svc/calibrations/*.json``).

``rtx-a6000.json``: fitted on MaverIQ's published RTX A6000 measurements, exactly as
``iserve profile import`` followed by ``iserve calibrate --hardware rtx-a6000`` would on
a stack holding only that data: the files go through the service's import
(``fingerprint_svc.importing``), every model's fingerprint runs are extrapolated by
``services.estimation.profiles`` and the constants fitted on the full-model runs by
``estimator_svc.hardware_calibration``.

``cpu-x86_64.json`` is not written here: ``bench/estimate_cpu.py --write-calibration``
fits it on full-model runs measured on this machine's CPU.

Run: ``python bench/fit_default_calibration.py`` (data from ``$ISERVE_SHARED_DATA`` or
``../shared/data`` beside the repository; about 15 s on two cores). Prints the file's
constants; ``--check`` fits and compares with the committed files instead of writing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from google.protobuf import json_format  # noqa: E402

from bench.estimate_a6000 import data_dir  # noqa: E402
from estimator_svc.calibration_message import SHIPPED_DIR, to_proto  # noqa: E402
from estimator_svc.hardware_calibration import (  # noqa: E402
    HardwareCalibration,
    fit_hardware_calibration,
)
from fingerprint_svc.importing import plan_maveriq_import  # noqa: E402
from services.api import model_service_pb2 as model_pb  # noqa: E402
from services.estimation.model_references import model_references  # noqa: E402
from services.estimation.profiles import (  # noqa: E402
    estimation_shape,
    estimation_variants,
    sample_from_measurement,
)
from services.importers.maveriq import RTX_A6000_DEVICE_BYTES  # noqa: E402

HARDWARE = "rtx-a6000"
# RTX A6000, as NVML gives it (as bench/estimate_a6000.py counts it).
DEVICE_MEMORY_BYTES = RTX_A6000_DEVICE_BYTES


def fit_a6000(directory: Path, now_ms: int) -> HardwareCalibration:
    files = [(p.name, p.read_bytes()) for p in sorted(directory.iterdir()) if p.is_file()]
    plan = plan_maveriq_import(files, HARDWARE)
    entries = []
    for imported in plan.models:
        model = model_pb.Model(
            model_id=imported.model_id, shape=imported.shape, variants=imported.variants
        )
        samples = [sample_from_measurement(m) for m in imported.measurements]
        refs = model_references(
            estimation_shape(model), estimation_variants(model, imported.measurements), samples
        )
        entries.append((imported.model_id, refs, samples))
    calibration, table = fit_hardware_calibration(
        HARDWARE, entries, "", now_ms, device_memory_bytes=DEVICE_MEMORY_BYTES
    )
    models = [m for m in dict.fromkeys(table.models.tolist())]
    counts = ", ".join(f"{m} ({int((table.models == m).sum())})" for m in models)
    provenance = (
        f"fitted by bench/fit_default_calibration.py on MaverIQ's published RTX A6000 "
        f"measurements (shared/data/maveriq-a6000; 8 x 48 GB, TensorRT-LLM 0.9), imported as "
        f"`iserve profile import --format maveriq` does: {table.size} full-model runs of "
        f"full_model_data_collection.csv (batch 1, 923-token prompt, outputs 10-200, every "
        f"layout on 8 GPUs) of {counts}, against references extrapolated from the same models' "
        f"fingerprints (fingerprint_data_collection.csv, fingerprint_data_collection_BS.csv); "
        f"latency constants with the TP ladder (4,1), (8,1) and with the three references "
        f"only; device memory {DEVICE_MEMORY_BYTES / 2**20:.0f} MiB (NVML's total); "
        f"{_date(calibration)}"
    )
    return replace(calibration, provenance=provenance)


def _date(calibration: HardwareCalibration) -> str:
    return datetime.fromtimestamp(calibration.fitted_at_unix_ms / 1e3, UTC).strftime("%Y-%m-%d")


def render(calibration: HardwareCalibration) -> str:
    message = json_format.MessageToDict(to_proto(calibration), preserving_proto_field_name=True)
    return json.dumps(message, indent=2, sort_keys=True) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    started = time.perf_counter()
    a6000 = fit_a6000(data_dir(), int(time.time() * 1000))
    outputs = {HARDWARE: a6000}
    status = 0
    for name, calibration in outputs.items():
        path = SHIPPED_DIR / f"{name}.json"
        text = render(calibration)
        if args.check:
            committed = json.loads(path.read_text())["extra_terms"]
            fresh = json.loads(text)["extra_terms"]
            same = committed.keys() == fresh.keys() and all(
                math.isclose(committed[k], fresh[k], rel_tol=1e-6, abs_tol=1e-9) for k in fresh
            )
            print(f"{path}: {'matches' if same else 'DIFFERS from'} a fresh fit")
            status |= not same
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
        print(f"  fit error {calibration.fit_error_pct:.2f} %; {calibration.provenance}")
    print(f"({time.perf_counter() - started:.0f} s)")
    sys.exit(status)


if __name__ == "__main__":
    main()
