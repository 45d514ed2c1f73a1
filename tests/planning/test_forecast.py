"""``plan --epochs-from``: the time to a target as a distribution, each converged seed's epochs times the
plan's epoch time; its checks and notes, hand-computed against the plan's own epoch time."""
from __future__ import annotations

import json

import pytest

from fastvision import config
from fastvision.planning.plan import Cluster, Workload, make_plan
from tests.cli.input_checks import one_line_error, run_cli

RECIPE = "unet2d-microscopy"


def _report(path, epochs, *, items=1000, batch=32, recipe=RECIPE, missed=1):
    rows = [{"seed": i, "reached": True, "epochs": e} for i, e in enumerate(epochs)]
    rows += [{"seed": len(epochs) + i, "reached": False, "epochs": None} for i in range(missed)]
    path.write_text(json.dumps({"recipe": recipe, "target": "iou=0.9", "rows": rows, "global_batch": batch,
                                "items_per_epoch": items}))
    return path


def test_forecast_is_the_seeds_epochs_times_the_plans_epoch_time(tmp_path, trace_memo):
    trace_memo({})
    src = _report(tmp_path / "t.json", [2, 3, 2, 5, 2])
    cfg = config.load(RECIPE)  # batch 16 a GPU: 2 GPUs are the runs' global batch of 32
    plan = make_plan(cfg, Cluster(gpu="H100-80GB", gpus=2, price=2.0), Workload(epochs_from=str(src)),
                     switches=False)
    assert plan["dataset_items"] == 1000 and "--epochs-from" in plan["dataset_source"]  # the runs' epoch
    fast, slow = plan["estimate"]["epoch_s"]
    f = plan["forecast"]
    assert (f["reached"], f["seeds"], f["epochs"], f["epochs_median"]) == (5, 6, [2, 2, 2, 3, 5], 2)
    assert f["train_s"]["median"] == pytest.approx([2 * fast, 2 * slow])
    assert f["train_s"]["olympic_mean"] == pytest.approx([7 / 3 * fast, 7 / 3 * slow])  # 2, 2, 3 kept
    assert f["train_s"]["range"] == pytest.approx([2 * fast, 5 * slow])
    assert f["cost"]["range"] == pytest.approx([2 * fast / 3600 * 2 * 2.0, 5 * slow / 3600 * 2 * 2.0])
    notes = " | ".join(plan["notes"])
    assert "1 of 6 seeds did not reach iou=0.9" in notes and "global batch" not in notes
    # the PNG's curve: the time to the target at the fewest, median and most epochs, in that order
    at = next(r for r in plan["curve"] if r["gpus"] == 2)
    assert at["target_h"][0] == pytest.approx(at["target_h"][1]) and at["target_h"][2] == pytest.approx(
        at["target_h"][1] * 5 / 2)


def test_forecast_names_what_differs_from_the_measured_runs(tmp_path, trace_memo):
    trace_memo({})
    src = _report(tmp_path / "t.json", [4], items=500, batch=64, recipe="resnet50-imagenet", missed=0)
    plan = make_plan(config.load(RECIPE), Cluster(gpus=1), Workload(epochs_from=str(src), dataset_size=2000),
                     switches=False)
    assert plan["dataset_items"] == 2000  # --dataset-size wins over the runs' epoch
    assert plan["forecast"]["train_s"]["median"] == pytest.approx([4 * e for e in plan["estimate"]["epoch_s"]])
    notes = " | ".join(plan["notes"])
    for needle in ("measured on recipe resnet50-imagenet", "global batch of 64, this plan's is 16",
                   "500 items an epoch, this plan 2,000", "1 converged seed(s)"):
        assert needle in notes, notes


@pytest.mark.parametrize("content,needle", [
    (None, "no such file"),
    ("{not json", "not JSON"),
    (json.dumps({"rows": []}), "not a `benchmark --mode target` report"),
    (json.dumps({"target": "iou=0.9", "rows": [{"reached": True, "epochs": 0}]}), "a seed row without"),
    (json.dumps({"target": "iou=0.9", "rows": [{"reached": False, "epochs": None}]}), "no seed reached iou=0.9"),
])
def test_a_bad_epochs_from_file_is_one_line_before_any_trace(content, needle, tmp_path, capsys, monkeypatch):
    from fastvision.planning import estimate

    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr(estimate, "trace", lambda *a, **k: pytest.fail("traced before --epochs-from was read"))
    code, out, err = run_cli(capsys, "plan", RECIPE, "--no-switches", "--epochs-from", path)
    one_line_error(code, err, "--epochs-from", str(path), needle)
    assert out == ""


def test_plan_cli_prints_the_forecast(tmp_path, capsys, trace_memo):
    trace_memo({})
    src = _report(tmp_path / "t.json", [3, 3, 4], missed=0)
    code, out, err = run_cli(capsys, "plan", RECIPE, "--gpus", "2", "--no-switches", "--epochs-from", src,
                             "--price-per-gpu-hour", "1", "--png", tmp_path / "p.png")
    assert code == 0, err
    assert "time to iou=0.9 (forecast)" in out and "3 of 3 seeds reached it, epochs 3, 3, 4" in out
    assert "cost to the target" in out and (tmp_path / "p.png").stat().st_size > 0


def test_a_report_without_its_epoch_size_needs_the_dataset(tmp_path, trace_memo):
    """A report from before the runs recorded their epoch, on a recipe whose dataset size plan does not
    know: no forecast, and the note says what to pass."""
    trace_memo({})
    src = tmp_path / "old.json"
    src.write_text(json.dumps({"recipe": "resnet18-imagefolder", "target": "top1=0.9",
                               "rows": [{"seed": 0, "reached": True, "epochs": 2}]}))
    plan = make_plan(config.load("resnet18-imagefolder"), Cluster(gpus=1), Workload(epochs_from=str(src)),
                     switches=False)
    assert plan["forecast"] is None and any("pass --data DIR or --dataset-size N" in n for n in plan["notes"])
    plan = make_plan(config.load("resnet18-imagefolder"), Cluster(gpus=1),
                     Workload(epochs_from=str(src), dataset_size=640), switches=False)
    assert plan["forecast"]["train_s"]["median"] == pytest.approx([2 * e for e in plan["estimate"]["epoch_s"]])
    assert any("did not record their global batch" in n for n in plan["notes"])
