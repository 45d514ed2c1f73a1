"""benchmarks/train_vs_nnunet.py's statistics on hand-made curves (no training): issue 41's goal per
paired run and the permutation test, checked against values worked out by hand."""
from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tvn():
    spec = importlib.util.spec_from_file_location("train_vs_nnunet", ROOT / "benchmarks" / "train_vs_nnunet.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _curve(points):
    return [{"iterations": 8 * (i + 1), "train_s": s, "dice": d} for i, (s, d) in enumerate(points)]


def test_goal_pairs_runs_and_applies_the_tolerance_to_fastvision_only(tvn, tmp_path):
    nn = tmp_path / "nn"
    fv = tmp_path / "fv"
    nn.mkdir(), fv.mkdir()
    # nnU-Net run 0 ends at 0.90, first reached at 30 s; run 1 ends at 0.80, first reached at 10 s (0.81 at 10 s).
    json.dump({"curve": _curve([(10, 0.5), (20, 0.7), (30, 0.9), (40, 0.9)])}, open(nn / "nnunet_side-1.json", "w"))
    json.dump({"curve": _curve([(10, 0.81), (20, 0.6), (30, 0.8)])}, open(nn / "nnunet_side-2.json", "w"))
    # fastvision run 0 reaches 0.885 (>= 0.90 - 0.02) at 12 s, its best is 0.89; run 1 never reaches 0.78.
    report = {"hippocampus": {"fastvision-nnunet": {"curve": _curve([(6, 0.6), (12, 0.885), (18, 0.89)])}}}
    json.dump(report, open(fv / "a.json", "w"))
    json.dump({"hippocampus": {"fastvision-nnunet": {"curve": _curve([(5, 0.7), (9, 0.75)])}}},
              open(fv / "b.json", "w"))
    out = tvn.goal([f"nnU-Net={nn}/nnunet_side-*.json", f"fv={fv}/*.json"])["fv"]
    assert out[0]["target"] == 0.9 and out[0]["nnunet_s"] == 30 and out[0]["fastvision_s"] == 12
    assert out[0]["ratio"] == pytest.approx(12 / 30)
    # without the tolerance: the highest Dice both reach is fastvision's 0.89; nnU-Net first at 30 s, fastvision 18 s
    assert out[0]["common"] == 0.89 and out[0]["common_ratio"] == pytest.approx(18 / 30)
    assert out[1]["ratio"] is None and out[1]["fastvision_s"] is None
    assert out[1]["common"] == 0.75 and out[1]["common_ratio"] == pytest.approx(9 / 10)


def test_goal_refuses_unequal_run_counts(tvn, tmp_path):
    for i in range(2):
        json.dump({"curve": _curve([(10, 0.5)])}, open(tmp_path / f"nnunet_side-{i}.json", "w"))
    json.dump({"curve": _curve([(10, 0.5)])}, open(tmp_path / "fv.json", "w"))
    with pytest.raises(ValueError):
        tvn.goal([f"nn={tmp_path}/nnunet_side-*.json", f"fv={tmp_path}/fv.json"])


def test_permutation_p_matches_exact_enumeration(tvn):
    a, b = [0.9, 0.95, 0.97, 0.93], [0.8, 0.85, 0.9, 0.82]
    pooled = np.array(a + b)
    d = np.mean(a) - np.mean(b)
    splits = list(itertools.combinations(range(8), 4))
    exact = sum(abs(pooled[list(s)].mean() - np.delete(pooled, list(s)).mean()) >= abs(d) - 1e-12
                for s in splits) / len(splits)
    out = tvn.diff_stats(a, b)
    assert out["diff"] == pytest.approx(d)
    assert out["p"] == pytest.approx(exact, abs=0.01)
    assert out["ci95"][0] < d < out["ci95"][1]


def test_compare_and_goal_bad_groups_are_one_line_errors(tmp_path):
    """A group without NAME=, a glob matching nothing, a file that is not JSON, unequal run counts: one line
    naming the argument or file, exit 2, no traceback (the real script, as a user runs it)."""
    import subprocess
    import sys

    json.dump({"curve": _curve([(10, 0.5)])}, open(tmp_path / "nn-0.json", "w"))
    json.dump({"curve": _curve([(10, 0.5)])}, open(tmp_path / "nn-1.json", "w"))
    (tmp_path / "broken.json").write_text("{")
    script = str(ROOT / "benchmarks" / "train_vs_nnunet.py")
    cases = [(["--compare", str(tmp_path / "nn-*.json")], "expected NAME=GLOB"),
             (["--compare", f"nn={tmp_path}/nn-*.json", f"fv={tmp_path}/none-*.json"], "no saved curve matches"),
             (["--goal", f"nn={tmp_path}/nn-*.json", f"fv={tmp_path}/broken.json"], "broken.json: not JSON"),
             (["--goal", f"nn={tmp_path}/nn-*.json", f"fv={tmp_path}/nn-0.json"], "1 runs against nn's 2")]
    for argv, message in cases:
        r = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 2, (argv, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (argv, r.stderr)


def test_compare_counts_runs_by_band_at_the_first_and_last_validation(tvn, tmp_path, capsys):
    """Stalled runs show at the last validation: hand-made curves, counts and means worked out by hand."""
    for i, (a, b) in enumerate([(0.40, 0.46), (0.45, 0.95), (0.70, 0.96)]):
        json.dump({"curve": _curve([(10, a), (20, b)])}, open(tmp_path / f"nn-{i}.json", "w"))
    for i, (a, b) in enumerate([(0.60, 0.97), (0.85, 0.96), (0.30, 0.90)]):
        report = {"x": {"fastvision-nnunet": {"curve": _curve([(5, a), (10, b)])}}}
        json.dump(report, open(tmp_path / f"fv-{i}.json", "w"))
    out = tvn.compare([f"nn={tmp_path}/nn-*.json", f"fv={tmp_path}/fv-*.json"])
    assert out["nn"]["first"] == (2, 1, 0) and out["nn"]["last"] == (1, 0, 2)
    assert out["fv"]["first"] == (1, 1, 1) and out["fv"]["last"] == (0, 0, 3)
    assert out["fv"]["mean"] == pytest.approx([0.5833333, 0.9433333])
    assert out["fv"]["diff"][1]["diff"] == pytest.approx(0.9433333 - 0.79)
    assert "at 16: 1 < 0.5, 0 between, 2 >= 0.8" in capsys.readouterr().out


def test_compare_refuses_a_run_missing_a_validation(tvn, tmp_path):
    json.dump({"curve": _curve([(10, 0.5), (20, 0.6)])}, open(tmp_path / "nn-0.json", "w"))
    json.dump({"curve": _curve([(10, 0.5)])}, open(tmp_path / "fv-0.json", "w"))
    with pytest.raises(ValueError, match="no validation at one of"):
        tvn.compare([f"nn={tmp_path}/nn-*.json", f"fv={tmp_path}/fv-*.json"])
