"""Detection end to end through the command line: synth -> train -> evaluate -> predict.

Tiny settings (64 px, two steps): the checks are on the plumbing, not on accuracy: ``evaluate``
reproduces the metrics the training run logged from the same checkpoint, and ``predict`` writes
a COCO results list whose image ids and category ids resolve through ``images.json`` and the
dataset's categories, in original image pixels.
"""
from __future__ import annotations

import json

import pytest
from PIL import Image

from fastvision.cli import main

TINY = ["--set", "data.args.image_size=64", "--set", "task.args.image_size=64", "--set", "data.num_workers=0",
        "--set", "train.steps_per_epoch=2", "--set", "train.val_every=1", "--set", "examples=0",
        "--epochs", "1", "--batch-size", "2", "--device", "cpu"]


def pycocotools_map(ann_file, results) -> float:
    """mAP of a results file by pycocotools alone, nothing of fastvision in between."""
    import contextlib
    import io

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(ann_file))
        ev = COCOeval(gt, gt.loadRes(str(results)), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return float(ev.stats[0])


@pytest.mark.slow
def test_train_evaluate_predict_from_the_cli(tmp_path, monkeypatch):
    data, run = tmp_path / "shapes", tmp_path / "run"
    assert main(["data", "synth", "coco", str(data), "--train", "4", "--val", "3"]) == 0
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")  # a relative results_path is the run's file, not one in the current folder
    assert main(["train", "ssd320-small-shapes", "--data", str(data), "--out", str(run), *TINY,
                 "--set", "task.args.results_path=val_results.json"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert not (tmp_path / "a" / "val_results.json").exists()
    # the mAP the run logged is pycocotools' own on the detections it wrote
    ann = data / "annotations" / "instances_val2017.json"
    assert summary["map"] == pytest.approx(pycocotools_map(ann, run / "val_results.json"), abs=1e-12)

    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    assert main(["evaluate", str(run), "--device", "cpu", "--json", str(tmp_path / "m.json")]) == 0
    assert not (tmp_path / "b" / "val_results.json").exists()
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["images"] == 3 and metrics["checkpoint"].endswith("best.pt")
    for key in ("map", "ap50", "ap75"):
        assert metrics[key] == pytest.approx(summary[key], abs=1e-12), key

    files = sorted((data / "val2017").iterdir())
    assert main(["predict", str(run), str(data / "val2017"), "--out", str(tmp_path / "pred"), "--device", "cpu"]) == 0
    index = json.loads((tmp_path / "pred" / "images.json").read_text())
    assert [e["file_name"] for e in index] == [str(f) for f in files]
    dets = json.loads((tmp_path / "pred" / "detections.json").read_text())
    assert dets, "an untrained model with score threshold 1e-8 still returns boxes"
    size = {e["id"]: (e["width"], e["height"]) for e in index}
    for d in dets:
        w, h = size[d["image_id"]]
        x, y, bw, bh = d["bbox"]
        assert d["category_id"] in (1, 3, 5, 8) and 0 <= d["score"] <= 1
        assert -1e-3 <= x and -1e-3 <= y and x + bw <= w + 1e-3 and y + bh <= h + 1e-3
    for f, e in zip(files, index, strict=True):
        assert Image.open(tmp_path / "pred" / f"{f.stem}_boxes.png").size == (e["width"], e["height"])
