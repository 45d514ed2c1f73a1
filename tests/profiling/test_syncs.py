"""The CPU host-sync detector: the ops known to stall a GPU's queue are seen, the others are not."""
from __future__ import annotations

import pytest
import torch

from fastvision.profiling.syncs import HostSyncDetector

x = torch.tensor([0.5, -1.0, 2.0, -3.0])
mask = x > 0

SYNCING = {
    "item": lambda: x[0].item(),
    "bool": lambda: bool(x.sum() > 0),
    "float": lambda: float(x.max()),
    "mask index": lambda: x[mask],
    "nonzero": lambda: x.nonzero(),
    "where(mask)": lambda: torch.where(mask),
    "masked_select": lambda: x.masked_select(mask),
    "unique": lambda: torch.unique(x),
    "repeat_interleave": lambda: x.repeat_interleave(torch.tensor([1, 2, 1, 1])),
    "equal": lambda: torch.equal(x, x),
}
QUEUED = {
    "arithmetic": lambda: (x * 2 + 1).sum(),
    "where(mask, a, b)": lambda: torch.where(mask, x, torch.zeros_like(x)),
    "long index": lambda: x[torch.tensor([0, 2])],
    "masked_fill": lambda: x.masked_fill(~mask, 0.0),
    "isfinite all": lambda: torch.isfinite(x).all(),
    "clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(x.clone())], 1.0),
}


@pytest.mark.parametrize("name", SYNCING)
def test_syncing_ops_are_recorded_with_their_line(name):
    with HostSyncDetector() as d:
        SYNCING[name]()
    assert d.events, name
    assert all("test_syncs.py" in e.where for e in d.events)
    with pytest.raises(RuntimeError, match="host sync"), HostSyncDetector(error=True):
        SYNCING[name]()


@pytest.mark.parametrize("name", QUEUED)
def test_queued_ops_are_not(name):
    x.grad = torch.ones_like(x)
    with HostSyncDetector() as d:
        QUEUED[name]()
    assert d.events == [], d.report()


def test_allow_and_report():
    with HostSyncDetector(allow=frozenset({"aten.nonzero.default"})) as d:
        x.nonzero()
        for i in range(2):
            x[i].item()  # one line, twice
    assert [e.op for e in d.events] == ["aten._local_scalar_dense.default"] * 2
    assert d.report().startswith("2 x aten._local_scalar_dense.default at ")
