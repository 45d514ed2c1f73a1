"""The CPU allocator's measured peak (what ``plan``'s estimate is checked against): the running
maximum of allocations and frees in the window, on hand-counted byte sequences. ``measured_peak``
of a real recipe is exercised by tests/planning/test_plan_switches.py (slow)."""
from __future__ import annotations

import pytest
import torch

from fastvision.planning.peak import cpu_allocator_peak

MIB = 2**20


def _sequence(steps):
    """A window that allocates (``("+", name, bytes)``) and frees (``("-", name)``) uint8 tensors."""
    def run():
        live = {}
        for op, name, *size in steps:
            if op == "+":
                live[name] = torch.empty(size[0], dtype=torch.uint8)
            else:
                del live[name]
    return run


@pytest.mark.parametrize("steps,peak", [
    # 1 + 0.5 live together; freeing the first leaves room for the 0.25 MiB: 1.5 MiB
    ([("+", "a", MIB), ("+", "b", MIB // 2), ("-", "a"), ("+", "c", MIB // 4)], 1.5 * MIB),
    # the same size twice, one after the other: the peak is one of them, not their sum
    ([("+", "a", MIB), ("-", "a"), ("+", "b", MIB), ("-", "b")], MIB),
    # three at once
    ([("+", "a", MIB // 4), ("+", "b", MIB // 4), ("+", "c", MIB // 2)], MIB),
])
def test_cpu_allocator_peak_is_the_running_maximum(steps, peak):
    assert cpu_allocator_peak(_sequence(steps)) == peak


def test_tensors_alive_before_the_window_do_not_count():
    before = torch.empty(4 * MIB, dtype=torch.uint8)
    assert cpu_allocator_peak(_sequence([("+", "a", MIB // 4)])) == MIB // 4
    del before
