"""How long one placement decision takes on a 1,024-device cluster.

Method: 128 simulated nodes x 8 devices of 48 GiB. Each decision sees its own cluster
state, drawn from a seeded generator, with load uniform in [0, 1] per device (about 70%
below the hybrid threshold θ = 0.7) and free memory per device drawn by regime:

* ``mixed``: 48 GiB x u² (u uniform in [0, 1]): fragments of every size, more small
  than large;
* ``crowded``: a nearly full cluster: one device in 200 is roomy (24–48 GiB free), the
  rest hold fragments of 0–12 GiB, so large configurations need an uneven layer map
  or do not fit at all.

For every regime, configuration below and policy, ``deploy_svc.placement.place`` (the
function the deployment controller calls, through ``deploy_svc.planning.decide``)
decides on each state; the timer covers that call only. The memory model is the
controller's: a device of a stage holding k layers needs ``fixed + k * block`` with
``block = total / (tp * layers)``. The figures are the median and 90th percentile in ms
over the decisions, how many placed, how many of those needed an uneven layer map, and
PASS or MISS against the target of a median <= 50 ms.

The configurations are shaped like Llama-2 7B/13B/70B and Falcon-40B in fp16. Rows where
"placed" is below the number of decisions are states where no placement exists at all
(``place`` returns None, which the timer covers too: that is its slowest path, every
try made). The generated states are frozen out of the garbage collector (``gc.freeze``)
so that collections over the bench's own 400,000 device records do not land in a
decision's time.

A second table times the whole decision the controller makes for an intent,
``deploy_svc.planning.decide``: walk a ranked list of every Llama-2-70B configuration on
8 devices (tp in 1, 2, 4, 8 with tp·pp <= 8, variants fp16, int8 and int4: 45 options,
ordered fastest first by a simple latency proxy), skip what the engine cannot run or the
cluster cannot hold, place the first that fits. The timer covers the whole walk,
including the engine checks and building the protobuf decision.

Run: ``.venv/bin/python bench/placement_scale.py [--decisions N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy_svc.explicit import ExplicitPlan  # noqa: E402
from deploy_svc.placement import POLICIES, Candidate, place  # noqa: E402
from deploy_svc.planning import Option, decide  # noqa: E402
from fingerprint_svc.registry import model_shape  # noqa: E402
from services.api import common_pb2 as common  # noqa: E402
from services.api import estimator_service_pb2 as estimator_pb  # noqa: E402
from services.api import model_service_pb2 as model_pb  # noqa: E402
from services.errors import ResourceExhausted  # noqa: E402
from services.models.families import parse_config
from services.models.presets import preset_config  # noqa: E402

GIB = 1 << 30
NODES, DEVICES_PER_NODE, DEVICE_GIB = 128, 8, 48
TARGET_MEDIAN_MS = 50.0


@dataclass(frozen=True)
class Config:
    name: str
    num_layers: int
    total_gib: float  # weights + KV cache of the whole deployment
    tp: int
    pp: int
    fixed_gib: float = 1.0  # per device: runtime, embeddings, LM head

    @property
    def layer_bytes(self) -> int:
        return int(self.total_gib * GIB / (self.tp * self.num_layers))


CONFIGS = (
    Config("llama-2-7b", 32, 16, tp=1, pp=1),
    Config("llama-2-13b", 40, 30, tp=2, pp=2),
    Config("falcon-40b", 60, 90, tp=4, pp=2),
    Config("llama-2-70b", 80, 150, tp=8, pp=1),
    Config("llama-2-70b", 80, 150, tp=1, pp=8),
    Config("llama-2-70b", 80, 150, tp=8, pp=2),
    Config("llama-2-70b", 80, 160, tp=4, pp=4),
)


def _free_gib_mixed(rng: random.Random) -> float:
    return DEVICE_GIB * rng.random() ** 2


def _free_gib_crowded(rng: random.Random) -> float:
    if rng.random() < 1 / 200:
        return rng.uniform(DEVICE_GIB / 2, DEVICE_GIB)
    return rng.uniform(0, 12)


REGIMES = {"mixed": _free_gib_mixed, "crowded": _free_gib_crowded}


def cluster_state(
    rng: random.Random, free_gib: Callable[[random.Random], float]
) -> list[Candidate]:
    return [
        Candidate(f"node{n:03d}", str(d), int(free_gib(rng) * GIB), rng.random())
        for n in range(NODES)
        for d in range(DEVICES_PER_NODE)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=200, help="per configuration and policy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(
        f"{NODES} nodes x {DEVICES_PER_NODE} devices of {DEVICE_GIB} GiB, {args.decisions} "
        f"decisions per row (one random fragmented state each, seed {args.seed}); "
        f"target: median <= {TARGET_MEDIAN_MS:.0f} ms"
    )
    print(
        f"{'regime':<9}{'config':<13}{'tp':>3}{'pp':>3}{'policy':>14}{'median ms':>11}"
        f"{'p90 ms':>8}{'placed':>8}{'uneven':>8}  verdict"
    )
    all_ms: list[float] = []
    for regime, free_gib in REGIMES.items():
        rng = random.Random(args.seed)
        states = [cluster_state(rng, free_gib) for _ in range(args.decisions)]
        gc.freeze()
        for config in CONFIGS:
            for policy in POLICIES:
                times_ms, placed, uneven = _decide(states, config, policy)
                all_ms += times_ms
                median = statistics.median(times_ms)
                p90 = statistics.quantiles(times_ms, n=10)[-1]
                verdict = "PASS" if median <= TARGET_MEDIAN_MS else "MISS"
                print(
                    f"{regime:<9}{config.name:<13}{config.tp:>3}{config.pp:>3}{policy:>14}"
                    f"{median:>11.2f}{p90:>8.2f}{placed:>8}{uneven:>8}  {verdict}"
                )
    overall = statistics.median(all_ms)
    verdict = "PASS" if overall <= TARGET_MEDIAN_MS else "MISS"
    print(
        f"all {len(all_ms)} decisions: median {overall:.2f} ms, "
        f"p90 {statistics.quantiles(all_ms, n=10)[-1]:.2f} ms, max {max(all_ms):.2f} ms  {verdict}"
    )
    print()
    print("whole intent decision (planning.decide over 45 ranked Llama-2-70B options):")
    print(
        f"{'regime':<9}{'policy':>14}{'median ms':>11}{'p90 ms':>8}{'placed':>8}{'mean rank':>11}"
    )
    for regime, free_gib in REGIMES.items():
        rng = random.Random(args.seed + 1)
        states = [cluster_state(rng, free_gib) for _ in range(args.decisions)]
        gc.freeze()
        for policy in POLICIES:
            times_ms, ranks = _walk(states, policy)
            print(
                f"{regime:<9}{policy:>14}{statistics.median(times_ms):>11.2f}"
                f"{statistics.quantiles(times_ms, n=10)[-1]:>8.2f}{len(ranks):>8}"
                f"{(statistics.mean(ranks) if ranks else float('nan')):>11.1f}"
            )


def _decide(
    states: list[list[Candidate]], config: Config, policy: str
) -> tuple[list[float], int, int]:
    """Decision times in ms, how many placed, how many of those unevenly."""
    times_ms, placed, uneven = [], 0, 0
    for devices in states:
        start = time.perf_counter()
        choice = place(
            devices,
            tp=config.tp,
            pp=config.pp,
            num_layers=config.num_layers,
            fixed_bytes=int(config.fixed_gib * GIB),
            layer_bytes=config.layer_bytes,
            policy=policy,
        )
        times_ms.append((time.perf_counter() - start) * 1000)
        if choice is not None:
            placed += 1
            uneven += choice.uneven
    return times_ms, placed, uneven


_SPEC = parse_config(preset_config("llama-2-70b", dtype="float16"))
LLAMA_70B = model_pb.Model(
    model_id="llama-2-70b",
    checkpoint_path="llama-2-70b",
    shape=model_shape(_SPEC, _SPEC.weight_bytes()),
)
VARIANTS = {"fp16": (common.WEIGHT_QUANT_NONE, 1.0), "int8": (common.WEIGHT_QUANT_INT8, 0.5)}
VARIANTS["int4"] = (common.WEIGHT_QUANT_INT4, 0.3)
for _name, (_quant, _) in VARIANTS.items():
    LLAMA_70B.variants.add(name=_name, weight_quant=_quant)
LIMITS = ExplicitPlan(common.DeploymentConfig(batch_size=1), 512, 256)


def _ranked_options() -> list[Option]:
    """Every configuration on 8 devices, fastest first by a rough latency proxy."""
    rows = []
    for tp in (1, 2, 4, 8):
        for pp in range(1, 8 // tp + 1):
            for name, (quant, share) in VARIANTS.items():
                total = int((140 * share + 2) * GIB)
                latency = 20.0 * share / (tp * pp**0.1) + 0.5 * (tp - 1) + 0.3 * (pp - 1)
                config = common.DeploymentConfig(
                    tensor_parallel=tp,
                    pipeline_parallel=pp,
                    variant_name=name,
                    weight_quant=quant,
                    batch_size=1,
                )
                estimate = estimator_pb.ConfigEstimate(
                    config=config, memory_total_bytes=total, latency_ms=latency
                )
                rows.append((latency, config, estimate))
    rows.sort(key=lambda r: r[0])
    return [Option(rank, c, e) for rank, (_, c, e) in enumerate(rows, start=1)]


def _walk(states: list[list[Candidate]], policy: str) -> tuple[list[float], list[int]]:
    """Times in ms of planning.decide on each state, and the winners' ranks."""
    options = _ranked_options()
    times_ms, ranks = [], []
    for devices in states:
        start = time.perf_counter()
        try:
            decision = decide(LLAMA_70B, options, devices, LIMITS, policy=policy, cuda=True)
        except ResourceExhausted:
            decision = None
        times_ms.append((time.perf_counter() - start) * 1000)
        if decision is not None:
            ranks.append(decision.winner_rank)
    return times_ms, ranks


if __name__ == "__main__":
    main()
