"""Parity tests run their tiny models on one torch thread.

The models are so small that thread synchronisation dominates: on a loaded 2-core machine
two threads made a 16-token generation 40 times slower than one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
