"""COCO data and evaluation against pycocotools run directly, on the generated shapes set."""
from __future__ import annotations

import json

import pytest
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.utils.data import DataLoader

from fastvision.data.cache.select import wrap_train_set
from fastvision.data.formats.coco import (
    CocoDetection,
    build,
    collate_detection,
    crop_boxes,
    sample_crop,
)
from fastvision.data.synth.coco import synth
from fastvision.errors import ConfigError, DataError
from fastvision.metrics.coco import (
    COCOEvaluator,
    coco_metrics,
    ground_truth_as_detections,
    to_coco_results,
    write_results,
)
from fastvision.models.ssd import ssd_loss
from fastvision.registry import MODELS

S = 128  # network input side in these tests


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("shapes"), seed=0, train=16, val=16)


@pytest.fixture(scope="module")
def gt_json(root):
    return json.loads((root / "annotations" / "instances_val2017.json").read_text())


def test_synth_is_deterministic_real_coco_with_crowd_and_empty(root, gt_json, tmp_path):
    again = synth(tmp_path, seed=0, train=16, val=16)
    assert (again / "annotations/instances_val2017.json").read_text() == json.dumps(gt_json)
    coco = COCO(str(root / "annotations" / "instances_val2017.json"))
    assert sorted(coco.getCatIds()) == [1, 3, 5, 8]
    anns = coco.loadAnns(coco.getAnnIds())
    assert any(a["iscrowd"] for a in anns)
    assert any(not coco.getAnnIds(imgIds=i) for i in coco.getImgIds())  # an empty image
    areas = [a["area"] for a in anns if not a["iscrowd"]]
    assert min(areas) < 32**2 < max(areas)  # both COCO small and medium/large objects
    for img in coco.loadImgs(coco.getImgIds()):
        assert (root / "val2017" / img["file_name"]).is_file()


def test_synth_object_size_and_count_options(tmp_path):
    root = synth(tmp_path / "big", seed=3, train=1, val=20, min_size=30, max_size=40, max_objects=2)
    coco = COCO(str(root / "annotations" / "instances_val2017.json"))
    for image_id in coco.getImgIds():
        anns = [a for a in coco.loadAnns(coco.getAnnIds(imgIds=image_id)) if not a["iscrowd"]]
        assert len(anns) <= 2
        for a in anns:  # every shape spans 1.6 (square) to 2 (disk, cross) half-sizes, a little more rotated
            assert 1.6 * 30 - 1 <= max(a["bbox"][2:]) <= 2.3 * 40
    for bad in ({"min_size": 0}, {"min_size": 50, "max_size": 40}, {"max_objects": 0}):
        with pytest.raises(ConfigError, match="--min-size|--max-size|--max-objects"):
            synth(tmp_path / "bad", **bad)


def test_val_items_are_resized_ground_truth(root, gt_json):
    ds = CocoDetection(root / "annotations/instances_val2017.json", root / "val2017", image_size=S)
    coco = ds.coco
    for i in range(len(ds)):
        item = ds[i]
        info = coco.imgs[item["image_id"]]
        assert item["image"].shape == (3, S, S) and item["image"].dtype == torch.uint8
        assert item["orig_size"] == (info["height"], info["width"])
        anns = coco.loadAnns(coco.getAnnIds(imgIds=item["image_id"]))
        assert len(item["labels"]) == len(anns)
        for box, label, crowd, a in zip(item["boxes"], item["labels"], item["iscrowd"], anns, strict=True):
            x, y, w, h = a["bbox"]
            sx, sy = S / info["width"], S / info["height"]
            torch.testing.assert_close(box, torch.tensor([x * sx, y * sy, (x + w) * sx, (y + h) * sy]))
            assert [1, 3, 5, 8][int(label)] == a["category_id"] and bool(crowd) == bool(a["iscrowd"])


def test_sample_crop_respects_area_and_aspect():
    torch.manual_seed(0)
    for _ in range(200):
        x0, y0, x1, y1 = sample_crop(400, 300)
        w, h = x1 - x0, y1 - y0
        assert 0 <= x0 < x1 <= 400 and 0 <= y0 < y1 <= 300
        assert 0.74 <= w * h / (400 * 300) <= 1.0
        assert 0.74 <= w / h <= 3.02


def test_crop_boxes_clips_and_drops_degenerate():
    boxes = torch.tensor([[10.0, 10, 50, 50], [0, 0, 15, 100], [90, 90, 120, 120], [5, 5, 8, 8]])
    out, keep = crop_boxes(boxes, (20, 0, 100, 100))
    assert keep.tolist() == [True, False, True, False]
    torch.testing.assert_close(out, torch.tensor([[0.0, 10, 30, 50], [70, 90, 80, 100]]))


def test_train_flip_mirrors_image_and_boxes(root):
    ann, img = root / "annotations/instances_val2017.json", root / "val2017"
    plain = CocoDetection(ann, img, image_size=S)
    aug = wrap_train_set(CocoDetection(ann, img, image_size=S, train=True, crop=False, flip=True), cache="none", seed=1)
    flips = 0
    for i in range(len(plain)):
        a, b = plain[i], aug[i]
        a["boxes"] = a["boxes"].clamp(0, S)  # training clips the boxes to the image (the synth's reach past it)
        if torch.equal(a["image"], b["image"]):
            torch.testing.assert_close(a["boxes"], b["boxes"])
        else:
            flips += 1
            assert torch.equal(a["image"].flip(-1), b["image"])
            mirrored = torch.stack([S - a["boxes"][:, 2], a["boxes"][:, 1], S - a["boxes"][:, 0], a["boxes"][:, 3]], 1)
            torch.testing.assert_close(mirrored, b["boxes"])
    assert 0 < flips < len(plain)
    again = wrap_train_set(CocoDetection(ann, img, image_size=S, train=True, crop=False, flip=True), cache="ram",
                           seed=1)
    assert all(torch.equal(aug[i]["image"], again[i]["image"]) for i in range(len(plain)))  # draws of (seed, epoch, i)


def test_train_crop_items_stay_valid(root):
    splits = build(path=str(root), image_size=S, color_jitter=0.2)
    assert splits.info["num_classes"] == 4 and splits.info["cat_ids"] == [1, 3, 5, 8]
    train = wrap_train_set(splits.train, cache="none", seed=0)  # what training reads: SSDAugment per item
    for i in range(len(train)):
        it = train[i]
        b = it["boxes"]
        assert it["image"].shape == (3, S, S)
        assert (b >= 0).all() and (b <= S).all() and (b[:, 2] > b[:, 0]).all() and (b[:, 3] > b[:, 1]).all()


def test_collate_pads_and_loss_handles_crowd_and_empty(root):
    splits = build(path=str(root), image_size=S)
    ds = splits.val
    coco = ds.coco
    empty = next(i for i, k in enumerate(ds.ids) if not coco.getAnnIds(imgIds=k))
    crowd = next(i for i, k in enumerate(ds.ids) if any(a["iscrowd"] for a in coco.loadAnns(coco.getAnnIds(imgIds=k))))
    batch = collate_detection([ds[empty], ds[crowd]])
    n = len(ds[crowd]["labels"])
    assert batch["boxes"].shape == (2, n, 4) and batch["labels"][0].eq(-1).all()
    assert batch["iscrowd"][1].any() and batch["orig_size"].shape == (2, 2)
    only_empty = collate_detection([ds[empty], ds[empty]])
    assert only_empty["labels"].shape == (2, 1) and only_empty["labels"].eq(-1).all()
    model = MODELS.build("ssd320-small", {"num_classes": 4})
    for b in (batch, only_empty):
        out = model(b["image"].float() / 255)
        loss = ssd_loss(out, b["boxes"], b["labels"], b["iscrowd"])["loss"]
        assert torch.isfinite(loss)
        loss.backward()


def test_to_coco_results_maps_back_to_original_pixels_and_ids():
    res = to_coco_results(
        boxes=torch.tensor([[[32.0, 16, 64, 48], [0, 0, 0, 0]]]), scores=torch.tensor([[0.9, 0.0]]),
        labels=torch.tensor([[2, -1]]), image_ids=torch.tensor([7]), orig_sizes=torch.tensor([[256, 512]]),
        input_size=(128, 128), cat_ids=[1, 3, 5, 8],
    )
    assert res == [{"image_id": 7, "category_id": 5, "bbox": [128.0, 32.0, 128.0, 64.0], "score": pytest.approx(0.9)}]


def _run_evaluator(splits, make_dets, tmp_path):
    ev = COCOEvaluator(splits.info["val_ann_file"], splits.info["cat_ids"], (S, S), results_path=tmp_path / "res.json")
    for batch in DataLoader(splits.val, batch_size=5, collate_fn=collate_detection):
        ev.update(make_dets(batch), batch)
    ev.load_state(ev.state())
    return ev.compute()


def test_ground_truth_as_detections_gives_map_one(root, tmp_path):
    m = _run_evaluator(build(path=str(root), image_size=S), ground_truth_as_detections, tmp_path)
    assert m["map"] == pytest.approx(1.0) and m["ap50"] == pytest.approx(1.0) and m["ap75"] == pytest.approx(1.0)
    assert m["images"] == 16


def test_map_equals_pycocotools_on_the_same_files(root, tmp_path):
    g = torch.Generator().manual_seed(0)

    def noisy(batch):  # jittered true boxes, some wrong classes, random scores, plus false positives
        d = ground_truth_as_detections(batch)
        boxes = d["boxes"] + torch.randn(d["boxes"].shape, generator=g) * 3
        labels = torch.where(torch.rand(d["labels"].shape, generator=g) < 0.15, (d["labels"] + 1) % 4, d["labels"])
        labels = labels.masked_fill(d["labels"] < 0, -1)
        fp_xy = torch.rand(boxes.shape[0], 3, 2, generator=g) * S * 0.7
        fp = torch.cat([fp_xy, fp_xy + 20], -1)
        return {"boxes": torch.cat([boxes, fp], 1),
                "scores": torch.rand(labels.shape[0], labels.shape[1] + 3, generator=g),
                "labels": torch.cat([labels, torch.randint(0, 4, (labels.shape[0], 3), generator=g)], 1)}

    splits = build(path=str(root), image_size=S)
    ours = _run_evaluator(splits, noisy, tmp_path)
    assert 0.05 < ours["map"] < 0.95
    # pycocotools on the written files, with nothing of ours in between
    gt = COCO(splits.info["val_ann_file"])
    ev = COCOeval(gt, gt.loadRes(str(tmp_path / "res.json")), "bbox")
    ev.evaluate(), ev.accumulate(), ev.summarize()
    for key, ref in zip(("map", "ap50", "ap75", "ap_small", "ap_medium", "ap_large"), ev.stats[:6], strict=True):
        assert ours[key] == pytest.approx(float(ref), abs=1e-12), key
    assert coco_metrics(splits.info["val_ann_file"], tmp_path / "res.json")["map"] == pytest.approx(ours["map"])


def test_empty_results_and_missing_files(root, tmp_path):
    assert coco_metrics(str(root / "annotations/instances_val2017.json"), [])["map"] == 0.0
    write_results([], tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == []
    with pytest.raises(DataError, match="not found"):
        build(path=str(tmp_path / "nope"))
