"""``fastvision plan``'s report: ranges and durations as the table prints them, on hand-worked
cases (the whole table, JSON and PNG run through the CLI in tests/planning/test_plan.py)."""
from __future__ import annotations

import pytest

from fastvision.planning.plan_report import _duration, _range


@pytest.mark.parametrize("pair,scale,spec,want", [
    ((0.0123, 0.0456), 1e3, "{:.3g}", "12.3-45.6"),  # seconds -> ms
    ((0.5, 0.5), 100, "{:.0f}", "50"),  # both ends print alike: one figure
    ((0.501, 0.504), 100, "{:.0f}", "50"),  # equal once rounded as printed
    ((1234.0, 5678.0), 1, "{:,.0f}", "1,234-5,678"),
])
def test_range_prints_one_figure_when_the_ends_agree(pair, scale, spec, want):
    assert _range(pair, scale, spec) == want


@pytest.mark.parametrize("pair,want", [
    ((30, 45), "30-45 s"),
    ((90, 150), "1.5-2.5 min"),  # the unit follows the slow end
    ((1800, 7200), "0.5-2 h"),
    ((59, 60), "0.983-1 min"),
])
def test_duration_picks_the_unit_of_the_slow_end(pair, want):
    assert _duration(pair) == want
