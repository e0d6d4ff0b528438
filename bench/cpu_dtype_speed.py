"""float32 against bfloat16 on this CPU: why an unset dtype computes in float32 on CPUs.

Method: one Llama-2-7B projection (4096 x 4096, random weights) as the engine holds it
(a float32 weight input-major, ``monitor_agent.engine.loader.store_input_major``; a
bfloat16 weight as stored), multiplied by 1 row (a decode step) and by 128 rows (a
prefill chunk) with ``F.linear`` on the torch threads the process has; three untimed
calls, then ``--repeats`` timed ones; prints the median of each and the bfloat16 /
float32 ratio. A CPU with bfloat16 dot-product instructions (AVX-512 BF16, AMX) runs
bfloat16 faster; one without runs the 128-row product slower than float32. To see the
AVX2 path on an AVX-512 machine: ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``.

Run: ``python bench/cpu_dtype_speed.py [--repeats 21]`` (a few seconds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from monitor_agent.engine.loader import store_input_major  # noqa: E402

WIDTH = 4096
ROWS = (1, 128)


def median_ms(weight: torch.Tensor, rows: int, repeats: int) -> float:
    x = torch.randn(rows, WIDTH).to(weight.dtype)
    for _ in range(3):
        F.linear(x, weight)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        F.linear(x, weight)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    torch.manual_seed(0)
    fp32 = nn.Linear(WIDTH, WIDTH, bias=False)
    store_input_major(fp32)
    bf16 = fp32.weight.detach().contiguous().bfloat16()
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "all")
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"oneDNN ISA limit {isa}, {torch.get_num_threads()} threads"
    )
    print(f"{'rows':>5} {'float32 ms':>11} {'bfloat16 ms':>12} {'bf16/fp32':>10}")
    for rows in ROWS:
        a = median_ms(fp32.weight.detach(), rows, args.repeats)
        b = median_ms(bf16, rows, args.repeats)
        print(f"{rows:>5} {a:>11.2f} {b:>12.2f} {b / a:>10.2f}")


if __name__ == "__main__":
    main()
