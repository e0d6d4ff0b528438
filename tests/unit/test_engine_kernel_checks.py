"""The start-up kernel checks: they pass on every CPU code path torch can dispatch to on
this machine, and a kernel that reads its weights wrongly refuses the engine and the
worker with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from monitor_agent.engine import kernel_checks, quantize
from monitor_agent.engine.engine import Engine
from monitor_agent.engine.kernel_checks import KernelCheckFailed, check_kernels
from monitor_agent.worker import process

# torch's x86 CPU code paths, lowest first (ATEN_CPU_CAPABILITY values).
X86_CAPABILITIES = ("default", "avx2", "avx512")

# Runs in a fresh process with ATEN_CPU_CAPABILITY set: the checks, then an int4 and an
# int8 Linear against the float one, then reports which path torch dispatched to.
PROBE = """
import json, torch
from torch import nn
from monitor_agent.engine.kernel_checks import check_kernels
from monitor_agent.engine.quantize import Int4Linear, Int8Linear
for quant in ("none", "int8", "int4"):
    check_kernels(weight_quant=quant, device="cpu", dtype=torch.float32)
torch.manual_seed(0)
linear = nn.Linear(512, 200)
x = torch.randn(3, 512)
expected = linear(x)
def error(module):
    return float((module(x) - expected).norm() / expected.norm())
print(json.dumps({
    "capability": torch.backends.cpu.get_cpu_capability(),
    "int4": error(Int4Linear.from_linear(linear, 128)),
    "int8": error(Int8Linear.from_linear(linear)),
}))
"""


def capabilities_here() -> list[str]:
    """Every CPU code path torch has up to the one it picks on this machine."""
    native = torch.backends.cpu.get_cpu_capability().lower()
    if native in X86_CAPABILITIES:
        return list(X86_CAPABILITIES[: X86_CAPABILITIES.index(native) + 1])
    return sorted({"default", native})


@pytest.mark.parametrize("capability", capabilities_here())
def test_quantized_linears_are_right_on_every_cpu_path(capability):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["capability"].lower() == capability
    assert report["int4"] < 0.12
    assert report["int8"] < 0.02


def test_every_check_passes_here():
    for quant in ("none", "int8", "int4"):
        for dtype in (torch.float32, torch.bfloat16):
            check_kernels(weight_quant=quant, device="cpu", dtype=dtype)


class _SwappedNibbles:
    """torch.ops.aten with an int4 packing whose two nibbles are swapped: a layout that
    no CPU's kernel reads, standing in for a hand-written one that is wrong here."""

    def __init__(self, aten) -> None:
        self._aten = aten

    def __getattr__(self, name: str):
        return getattr(self._aten, name)

    def _convert_weight_to_int4pack_for_cpu(self, weight, inner_k_tiles):
        packed = self._aten._convert_weight_to_int4pack_for_cpu(weight, inner_k_tiles)
        return (packed >> 4) | (packed << 4)


@pytest.fixture
def wrong_int4_layout(monkeypatch):
    monkeypatch.setattr(quantize, "_aten", _SwappedNibbles(quantize._aten))
    kernel_checks._check_int4.cache_clear()
    yield
    kernel_checks._check_int4.cache_clear()


def test_a_wrongly_packed_int4_kernel_fails_its_check(wrong_int4_layout):
    with pytest.raises(KernelCheckFailed, match=r"int4 weight kernel \(cpu-kernel layout"):
        check_kernels(weight_quant="int4", device="cpu", dtype=torch.float32)
    # Other quantizations do not use it.
    check_kernels(weight_quant="int8", device="cpu", dtype=torch.float32)


def test_the_engine_refuses_int4_when_its_kernel_check_fails(wrong_int4_layout, checkpoint):
    with pytest.raises(KernelCheckFailed, match="refusing to serve"):
        Engine(checkpoint, max_seq_len=32, weight_quant="int4")
    Engine(checkpoint, max_seq_len=32, weight_quant="int8")


def test_the_worker_exits_1_with_the_reason_when_a_kernel_check_fails(
    wrong_int4_layout, checkpoint, tmp_path, capsys, monkeypatch
):
    # In process, so the wrong layout reaches it; leave the test process's logging alone.
    monkeypatch.setattr(process, "configure_logging", lambda level, name: None)
    ready = tmp_path / "ready.json"
    argv = ["--deployment-id", "d", "--checkpoint", str(checkpoint), "--ready-file", str(ready)]
    assert process.main([*argv, "--weight-quant", "int4"]) == process.EXIT_ENGINE_FAILED
    message = capsys.readouterr().err
    assert "int4 weight kernel" in message and "self-check failed" in message
    assert not ready.exists()
