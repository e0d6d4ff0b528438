"""The CPU engine's activation peak is measured (torch's profiler records each tensor
allocation and free), not computed: known allocation sequences give their exact peak."""

from __future__ import annotations

import torch
from torch.autograd import profiler

from monitor_agent.engine.memory import (
    REMEASURE_GROWTH,
    MemoryAccount,
    measure_peak_allocation,
)

MIB = 1 << 20


def _tensor(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def test_the_peak_of_a_known_sequence_of_allocations_and_frees():
    def run() -> torch.Tensor:
        a = _tensor(1 * MIB)
        b = _tensor(2 * MIB)
        del a  # 3 MiB were live together
        c = _tensor(MIB // 2)
        del b
        return c

    result, peak = measure_peak_allocation(run)
    assert peak == 3 * MIB
    assert result.numel() == MIB // 2


def test_a_tensor_freed_from_before_the_call_does_not_hide_what_it_allocated():
    older = [_tensor(8 * MIB)]

    def run() -> torch.Tensor:
        older.clear()  # frees 8 MiB the call never allocated
        return _tensor(2 * MIB)

    _, peak = measure_peak_allocation(run)
    assert peak == 2 * MIB


def test_a_block_an_earlier_measured_call_allocated_does_not_lower_a_later_peak():
    """The profiler keeps the sizes of blocks allocated under an earlier session and
    reports their free: a result of one measured pass freed during the next took its
    size off that one's peak (a test here read 1.5 MiB for 2 in CI)."""
    held = [measure_peak_allocation(lambda: _tensor(MIB // 2))[0]]

    def run() -> torch.Tensor:
        held.clear()  # frees the 0.5 MiB the earlier call allocated
        return _tensor(2 * MIB)

    _, peak = measure_peak_allocation(run)
    assert peak == 2 * MIB


def test_a_profiler_already_on_is_left_alone():
    with profiler.profile(profile_memory=True):
        result, peak = measure_peak_allocation(lambda: _tensor(MIB))
    assert peak is None
    assert result.numel() == MIB


def test_a_pass_is_measured_again_only_once_its_shape_has_grown_enough():
    account = MemoryAccount(weight_bytes=100, kv_cache_bytes=10)
    assert account.should_measure(1)  # the first pass
    account.observe_measured(1000, peak_bytes=600)
    assert account.peak_activation_bytes == 600
    assert not account.should_measure(1000)
    assert not account.should_measure(int(1000 * REMEASURE_GROWTH))
    assert account.should_measure(int(1000 * REMEASURE_GROWTH) + 1)
    # A larger shape that happens to allocate less keeps the peak, raises the bar.
    account.observe_measured(2000, peak_bytes=500)
    assert account.peak_activation_bytes == 600
    assert not account.should_measure(2000)
    assert account.resident_bytes == 100 + 10 + 600
