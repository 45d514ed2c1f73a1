"""The benchmark report's figures: percentiles against numpy, step statistics and speed-ups by hand."""
from __future__ import annotations

import numpy as np
import pytest

from fastvision.benchmark import report


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0],
                                    list(np.random.default_rng(0).random(37))])
@pytest.mark.parametrize("q", [0, 10, 50, 90, 95, 99, 100])
def test_percentile_matches_numpy(values, q):
    assert report.percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError):
        report.percentile([], 50)
    with pytest.raises(ValueError):
        report.percentile([1.0], 101)


def test_step_stats_by_hand():
    s = report.step_stats([0.1, 0.2, 0.4], batch_size=4)
    assert s["items_per_s"] == pytest.approx(20.0)  # median of 40, 20, 10 items/s
    assert s["items_per_s_overall"] == pytest.approx(12 / 0.7)
    assert s["latency_mean_ms"] == pytest.approx(700 / 3)
    assert s["latency_p50_ms"] == pytest.approx(200.0)
    assert s["latency_p90_ms"] == pytest.approx(200 + 0.8 * 200)  # position 1.8 between 200 and 400


def test_speedups_same_batch_only():
    rows = [{"batch_size": 8, "precision": "fp32", "items_per_s": 100.0},
            {"batch_size": 8, "precision": "tf32", "items_per_s": 200.0},
            {"batch_size": 8, "precision": "bf16", "items_per_s": 500.0},
            {"batch_size": 16, "precision": "bf16", "items_per_s": 900.0},
            {"batch_size": 16, "precision": "fp16", "error": "out of memory"}]
    report.add_speedups(rows)
    assert rows[1]["speedup_vs_fp32"] == pytest.approx(2.0)
    assert rows[2]["speedup_vs_fp32"] == pytest.approx(5.0) and rows[2]["speedup_vs_tf32"] == pytest.approx(2.5)
    assert "speedup_vs_fp32" not in rows[0] and "speedup_vs_fp32" not in rows[3] and "speedup_vs_fp32" not in rows[4]


def test_the_table_pairs_items_per_s_with_the_median_step_not_the_mean():
    # one slow step (0.4 s of 0.1, 0.2, 0.4): the median step is 200 ms = 4 items / 20 items/s; the table printed
    # 20.0 items/s beside a mean 233.33 ms, two statistics in one row
    row = {"batch_size": 4, "precision": "fp32", **report.step_stats([0.1, 0.2, 0.4], batch_size=4)}
    rep = {"recipe": "r", "mode": "train", "gpu": None, "device": "cpu", "cpu_threads": 2, "compile": False,
           "channels_last": False, "augment": False, "steps": 3, "warmup": 1, "torch": "x", "date": "d",
           "notes": [], "results": [row]}
    md = report.markdown(rep)
    head = next(line for line in md.splitlines() if line.startswith("| batch"))
    cells = next(line for line in md.splitlines() if line.startswith("| 4 "))
    table = dict(zip(head.strip("| ").split(" | "), cells.strip("| ").split(" | "), strict=True))
    assert table["items/s"] == "20.0" and table["median ms"] == "200.00" and "mean ms" not in table
    assert float(table["items/s"]) * float(table["median ms"]) / 1000 == pytest.approx(4)
    assert "median step" in md  # the table says which statistic
