"""An epoch's counters: applied / skipped steps and their streak by hand, a NaN loss of a skipped
step left out, the counters carried through a mid-epoch checkpoint's Position; the data-wait clock."""
from __future__ import annotations

import math

import pytest
import torch

from fastvision.engine.meter import DataWait, EpochMeter
from fastvision.engine.state import Position


def test_counts_applied_skipped_and_the_streak():
    meter = EpochMeter(torch.device("cpu"))
    for loss, skipped in [(1.0, 0), (math.nan, 1), (math.nan, 1), (3.0, 0), (math.inf, 1)]:
        meter.add(torch.tensor(loss), torch.tensor(float(skipped)), images=4)
    state = meter.state()
    assert (state["loss_sum"], state["applied"], state["skipped"], state["streak"]) == (4.0, 2.0, 3.0, 1.0)
    assert state["images"] == 20 and meter.samples == 20  # one process: world size 1


def test_a_checkpoints_position_carries_the_counters():
    meter = EpochMeter(torch.device("cpu"))
    for loss in (2.0, 5.0):
        meter.add(torch.tensor(loss), torch.tensor(0.0), images=3)
    saved = Position.from_dict(Position(0, 2, meter.samples, meter.state()).to_dict(), global_batch=3)
    resumed = EpochMeter(torch.device("cpu"))
    resumed.load(saved)
    assert torch.equal(resumed.counts, meter.counts)
    assert (resumed.images, resumed.samples) == (6, 6)
    assert resumed.elapsed() >= saved.meter["time_s"]  # the seconds before the resume count on


def test_data_wait_sums_data_to_h2d_only(monkeypatch):
    now = iter([10.0, 10.5, 20.0, 20.25])
    monkeypatch.setattr("fastvision.engine.meter.time.perf_counter", lambda: next(now))
    wait = DataWait()
    for phase in ("data", "h2d", "forward", "backward", "data", "h2d", "optimizer", "end"):
        wait(phase)
    assert wait.seconds == pytest.approx(0.75)
