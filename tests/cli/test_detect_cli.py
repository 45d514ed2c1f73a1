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
    # COCO's file_name (the name in the image folder) and the file itself, absolute
    assert [e["file_name"] for e in index] == [f.name for f in files]
    assert [e["path"] for e in index] == [str(f.resolve()) for f in files]
    # val2017/ of a COCO root: the ids are the annotation file's, so pycocotools scores predict's JSON against it
    # (before, the positions 0..2: "Results do not correspond to current coco set"), and predict is evaluate
    by_name = {im["file_name"]: im["id"] for im in json.loads(ann.read_text())["images"]}
    assert [e["id"] for e in index] == [by_name[f.name] for f in files]
    assert pycocotools_map(ann, tmp_path / "pred" / "detections.json") == pytest.approx(metrics["map"], abs=1e-9)
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


def _ids(files, coco_ids):
    """The image ids of predict_images' (ids, COCO file names)."""
    from fastvision.tasks.detect import predict_images

    return predict_images(files, coco_ids)[0]


def test_predict_image_ids_from_a_coco_file_by_name(tmp_path):
    from fastvision.errors import DataError

    root = tmp_path / "coco"
    (root / "annotations").mkdir(parents=True)
    files = [root / "val2017" / n for n in ("b.jpg", "a.jpg")]
    assert _ids(files, "auto") == [0, 1]  # no annotations there: positions
    info = root / "annotations" / "image_info_test-dev2017.json"  # test-dev's: images, no annotations
    info.write_text(json.dumps({"images": [{"id": 7, "file_name": "a.jpg"}, {"id": 9, "file_name": "x/b.jpg"}]}))
    assert _ids(files, str(info)) == [9, 7]
    (root / "annotations" / "instances_val2017.json").write_text(json.dumps(
        {"images": [{"id": 3, "file_name": "a.jpg"}], "annotations": [], "categories": []}))
    assert _ids(files, "auto") == [0, 1]  # b.jpg is not listed: positions (with a warning)
    assert _ids(files[1:], "auto") == [3]
    assert _ids(files[1:], "none") == [0]
    with pytest.raises(DataError, match=r"--coco-ids .*instances_val2017.json: .*b.jpg is not in its images list"):
        _ids(files, str(root / "annotations" / "instances_val2017.json"))
    for text, why in (("[]", "no 'images' list"), ('{"images": [{"id": "1", "file_name": "a.jpg"}]}', "integer id"),
                      ('{"images": [{"id": 1, "file_name": "a.jpg"}, {"id": 2, "file_name": "y/a.jpg"}]}',
                       "a.jpg listed twice")):
        info.write_text(text)
        with pytest.raises(DataError, match=why):
            _ids(files, str(info))
    with pytest.raises(DataError, match=r"nothere.json: cannot read it"):
        _ids(files, str(tmp_path / "nothere.json"))


def test_predict_ids_of_inputs_stored_at_another_size_than_listed_are_one_line(tmp_path):
    """Inputs resized since they were annotated: detections.json took the COCO file's ids, and pycocotools
    scored its boxes (in the resized pixels) against boxes of the file's grid without a word."""
    from fastvision.errors import DataError

    folder = tmp_path / "coco" / "val2017"
    folder.mkdir(parents=True)
    (tmp_path / "coco" / "annotations").mkdir()
    for name, size in (("a.jpg", (40, 30)), ("b.jpg", (20, 15))):
        Image.new("RGB", size, (90, 90, 90)).save(folder / name)
    ann = tmp_path / "coco" / "annotations" / "instances_val2017.json"
    ann.write_text(json.dumps({"images": [{"id": 3, "file_name": "a.jpg", "width": 40, "height": 30},
                                          {"id": 4, "file_name": "b.jpg", "width": 40, "height": 30}],
                               "annotations": [], "categories": []}))
    files = [folder / "a.jpg", folder / "b.jpg"]
    assert _ids(files[:1], "auto") == [3] and _ids(files[:1], str(ann)) == [3]
    for how in ("auto", str(ann)):
        with pytest.raises(DataError, match=r"b.jpg: stored 20x15, but .*instances_val2017.json lists it as 40x30"):
            _ids(files, how)
    assert _ids(files, "none") == [0, 1]
