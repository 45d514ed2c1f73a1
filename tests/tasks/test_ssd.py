"""SSD320 model, loss and post-processing: hand-computed losses, shapes, gradients, edge cases."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from fastvision.models.ssd import (
    FrozenBatchNorm2d,
    freeze_batchnorm,
    postprocess,
    ssd_loss,
)
from fastvision.ops import BoxCoder
from fastvision.registry import MODELS


def focal_by_hand(x: float, t: float, alpha=0.25, gamma=2.0) -> float:
    p = 1 / (1 + math.exp(-x))
    ce = -math.log(p) if t == 1 else -math.log(1 - p)
    p_t = p if t == 1 else 1 - p
    a_t = alpha if t == 1 else 1 - alpha
    return a_t * (1 - p_t) ** gamma * ce


def crafted_outputs():
    anchors = torch.tensor([[0, 0, 10, 10], [50, 50, 60, 60], [100, 100, 104, 104]], dtype=torch.float32)
    logits = torch.tensor([[[2.0, -1.0], [0.5, -3.0], [4.0, 4.0]]])
    codes = torch.tensor([[[0.5, -2.0, 0.1, 0.0], [9.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]]])
    return {"cls_logits": logits, "box_codes": codes, "anchors": anchors}


def test_loss_equals_hand_formula():
    out = crafted_outputs()
    # gt0 coincides with anchor 0 (class 1); a crowd box swallows anchor 2; last row is padding.
    boxes = torch.tensor([[[0, 0, 10, 10], [90, 90, 130, 130], [0, 0, 0, 0]]], dtype=torch.float32)
    labels = torch.tensor([[1, 0, -1]])
    crowd = torch.tensor([[False, True, False]])
    got = ssd_loss(out, boxes, labels, crowd)
    cls = (focal_by_hand(2.0, 0) + focal_by_hand(-1.0, 1)  # anchor 0: class 1 positive
           + focal_by_hand(0.5, 0) + focal_by_hand(-3.0, 0))  # anchor 1: background; anchor 2 ignored
    box = 0.5 * 0.5**2 + (2.0 - 0.5) + 0.5 * 0.1**2 + 0.0  # smooth-L1 against zero targets
    box /= 1 * 4  # seed 002: normalize_loc_loss_by_codesize -> matches (1) x code size (4)
    assert got["num_matches"].item() == 1
    assert got["cls_loss"].item() == pytest.approx(cls, rel=1e-5)
    assert got["box_loss"].item() == pytest.approx(box, rel=1e-5)
    assert got["loss"].item() == pytest.approx(cls + box, rel=1e-5)


def test_loc_loss_normalised_by_matches_times_code_size():
    """Two matched anchors: box term = sum of smooth-L1 over both anchors' 4 codes / (2 x 4)."""
    out = crafted_outputs()
    boxes = torch.tensor([[[0, 0, 10, 10], [50, 50, 60, 60]]], dtype=torch.float32)  # on anchors 0 and 1
    labels = torch.tensor([[1, 0]])
    got = ssd_loss(out, boxes, labels)
    sl1 = lambda v: 0.5 * v * v if abs(v) < 1 else abs(v) - 0.5  # noqa: E731  (beta 1, zero targets)
    total = sum(sl1(v) for v in (0.5, -2.0, 0.1, 0.0)) + 4 * sl1(9.0)
    assert got["num_matches"].item() == 2
    assert got["box_loss"].item() == pytest.approx(total / (2 * 4), rel=1e-6)


@pytest.mark.parametrize("case", ["empty", "crowd_only"])
def test_loss_without_positives_is_finite(case):
    out = crafted_outputs()
    out = {k: v.expand(2, *v.shape[1:]).clone() if k != "anchors" else v for k, v in out.items()}
    out["cls_logits"].requires_grad_(True)
    if case == "empty":
        boxes = torch.zeros(2, 0, 4)
        labels, crowd = torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.bool)
    else:
        boxes = torch.tensor([[[0.0, 0, 200, 200]]] * 2)
        labels, crowd = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool)
    got = ssd_loss(out, boxes, labels, crowd)
    assert torch.isfinite(got["loss"]) and got["box_loss"].item() == 0.0
    if case == "crowd_only":  # every anchor is inside the crowd box: nothing to learn
        assert got["cls_loss"].item() == 0.0
    else:
        expected = sum(focal_by_hand(x, 0) for x in out["cls_logits"][0].flatten().tolist()) * 2
        assert got["cls_loss"].item() == pytest.approx(expected, rel=1e-5)
    got["loss"].backward()


def test_postprocess_decodes_thresholds_and_suppresses():
    anchors = torch.tensor([[0, 0, 10, 10], [1, 0, 11, 10], [40, 40, 60, 60], [0, 0, 10, 10]], dtype=torch.float32)
    target = torch.tensor([[2, 2, 12, 12], [2, 2, 12, 12], [40, 40, 60, 60], [0, 0, 10, 10]], dtype=torch.float32)
    codes = BoxCoder().encode(target, anchors)[None]
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    cls = torch.full((1, 4, 3), -20.0)
    cls[0, 0, 1], cls[0, 1, 1] = logit(0.9), logit(0.8)  # same box, same class: the 0.8 one goes
    cls[0, 2, 0] = logit(0.7)
    cls[0, 3, 2] = logit(0.6)  # overlaps anchor 0's box but another class: kept
    det = postprocess({"cls_logits": cls, "box_codes": codes, "anchors": anchors}, (64, 64),
                      score_threshold=0.5, max_detections=5)
    assert det["boxes"].shape == (1, 5, 4) and det["labels"].shape == (1, 5)
    torch.testing.assert_close(det["scores"][0, :3], torch.tensor([0.9, 0.7, 0.6]))
    assert det["labels"][0].tolist() == [1, 0, 2, -1, -1]
    torch.testing.assert_close(det["boxes"][0, :3], target[[0, 2, 3]], atol=1e-4, rtol=0)
    assert det["scores"][0, 3:].eq(0).all()


def tf_multiclass_nms(outputs, image_size, score_threshold, iou_threshold, max_detections, per_class=None):
    """The seed's post-processing written plainly, as TF's ``multiclass_non_max_suppression``: per class,
    greedy NMS over every anchor above the threshold (clipped to the image, empty boxes dropped), at
    most ``per_class`` kept, then the best ``max_detections`` over all classes. One image."""
    per_class = per_class or max_detections
    H, W = image_size
    boxes = BoxCoder().decode(outputs["box_codes"][0], outputs["anchors"]).numpy().astype(np.float64)
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, W)
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, H)
    scores = torch.sigmoid(outputs["cls_logits"][0]).numpy()
    found = []
    for c in range(scores.shape[1]):
        kept = []
        for i in sorted(range(len(boxes)), key=lambda i: -scores[i, c]):
            b = boxes[i]
            if scores[i, c] <= score_threshold or b[2] <= b[0] or b[3] <= b[1]:
                continue
            def iou(j, b=b):
                o = boxes[j]
                iw, ih = min(b[2], o[2]) - max(b[0], o[0]), min(b[3], o[3]) - max(b[1], o[1])
                inter = max(iw, 0) * max(ih, 0)
                return inter / ((b[2] - b[0]) * (b[3] - b[1]) + (o[2] - o[0]) * (o[3] - o[1]) - inter)
            if all(iou(j) <= iou_threshold for j in kept):
                kept.append(i)
            if len(kept) == per_class:
                break
        found += [(float(scores[i, c]), c, i) for i in kept]
    return sorted(found, reverse=True)[:max_detections]


def test_postprocess_equals_the_seeds_per_class_nms_when_top_candidates_are_suppressed():
    # 1,200 near-copies of one box lead class 0; 150 separate boxes of class 1 score lower. The 1,000
    # best candidates hold one survivor, the seed's NMS (no candidate limit) gives 1 + 99.
    g = torch.Generator().manual_seed(0)
    dup = torch.tensor([[100.0, 100, 140, 140]]) + torch.rand(1200, 1, generator=g)
    xy = torch.stack(torch.meshgrid(torch.arange(15), torch.arange(10), indexing="ij"), -1).reshape(-1, 2) * 20.0
    grid = torch.cat([xy, xy + 12], 1)
    anchors = torch.cat([dup, grid])
    logits = torch.full((1, len(anchors), 2), -30.0)
    logits[0, :1200, 0] = torch.linspace(6, 4, 1200)
    logits[0, 1200:, 1] = torch.linspace(3, 1, 150)
    out = {"cls_logits": logits, "box_codes": torch.zeros(1, len(anchors), 4), "anchors": anchors}
    det = postprocess(out, (320, 320), score_threshold=0.5, iou_threshold=0.6, max_detections=100)
    ref = tf_multiclass_nms(out, (320, 320), 0.5, 0.6, 100)
    assert len(ref) == 100 and int((det["labels"][0] >= 0).sum()) == 100
    assert det["labels"][0].tolist() == [c for _, c, _ in ref]
    torch.testing.assert_close(det["scores"][0], torch.tensor([s for s, _, _ in ref]))


@pytest.mark.parametrize("seed", range(4))
def test_postprocess_equals_the_seeds_per_class_nms_on_random_outputs(seed):
    # Few candidates to start from (pre_nms_top_k 8) so that most images take the doubling path.
    g = torch.Generator().manual_seed(seed)
    A, K = 300, 3
    ctr = torch.rand(A, 2, generator=g) * 64
    wh = 4 + torch.rand(A, 2, generator=g) * 20
    anchors = torch.cat([ctr - wh / 2, ctr + wh / 2], 1)
    out = {"cls_logits": torch.randn(2, A, K, generator=g) * 3, "box_codes": torch.randn(2, A, 4, generator=g) * 0.5,
           "anchors": anchors}
    det = postprocess(out, (64, 64), score_threshold=0.3, iou_threshold=0.5, max_detections=30, pre_nms_top_k=8)
    for b in range(2):
        one = {"cls_logits": out["cls_logits"][b:b + 1], "box_codes": out["box_codes"][b:b + 1], "anchors": anchors}
        ref = tf_multiclass_nms(one, (64, 64), 0.3, 0.5, 30)
        n = int((det["labels"][b] >= 0).sum())
        assert n == len(ref)
        assert det["labels"][b, :n].tolist() == [c for _, c, _ in ref]
        torch.testing.assert_close(det["scores"][b, :n], torch.tensor([s for s, _, _ in ref]))


def test_frozen_batchnorm_matches_eval_bn_and_has_no_parameters():
    bn = torch.nn.BatchNorm2d(4, eps=1e-3)
    bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2)
    torch.nn.init.uniform_(bn.weight), torch.nn.init.uniform_(bn.bias)
    model = torch.nn.Sequential(bn)
    x = torch.randn(2, 4, 5, 5)
    ref = bn.eval()(x)
    freeze_batchnorm(model)
    assert isinstance(model[0], FrozenBatchNorm2d) and not list(model.parameters())
    torch.testing.assert_close(model.train()(x), ref)


@pytest.mark.parametrize("name,size,batch,classes", [("ssd320-small", 128, 2, 3), ("ssd320", 320, 1, 90)])
def test_forward_backward(name, size, batch, classes):
    torch.manual_seed(0)
    model = MODELS.build(name, {"num_classes": classes, "frozen_bn": name == "ssd320"})
    x = torch.randn(batch, 3, size, size)
    out = model(x)
    A = 6 * sum(math.ceil(size / 2**level) ** 2 for level in range(3, 8))
    assert out["cls_logits"].shape == (batch, A, classes) and out["box_codes"].shape == (batch, A, 4)
    assert out["anchors"].shape == (A, 4)
    if size == 320:
        assert A == 12804
    # Class bias -4.6: every initial score is near the 0.01 prior.
    assert out["cls_logits"].sigmoid().mean().item() == pytest.approx(0.01, abs=0.005)
    boxes = torch.tensor([[[10.0, 20, 60, 90], [0, 0, 0, 0]]] * batch)
    labels = torch.tensor([[classes - 1, -1]] * batch)
    loss = ssd_loss(out, boxes, labels, torch.zeros_like(labels, dtype=torch.bool))["loss"]
    loss.backward()
    assert torch.isfinite(loss)
    head_grad = model.head.cls_pred.weight.grad
    assert head_grad is not None and head_grad.abs().sum() > 0
    assert model.backbone.conv1.weight.grad.abs().sum() > 0
    det = postprocess({k: v.detach() for k, v in out.items()}, (size, size))
    assert det["boxes"].shape == (batch, 100, 4)


@pytest.mark.parametrize("anchor_scale,side", [(4.0, 32.0), (2.0, 16.0)])
def test_small_model_anchor_scale(anchor_scale, side):
    model = MODELS.build("ssd320-small", {"num_classes": 2, "anchor_scale": anchor_scale})
    out = model.eval()(torch.zeros(1, 3, 128, 128))
    # 128 px: grids 16, 8, 4, 2, 1 with 6 anchors each; the first P3 anchor is centred at (4, 4).
    assert out["anchors"].shape == (6 * (256 + 64 + 16 + 4 + 1), 4)
    half = side / 2
    torch.testing.assert_close(out["anchors"][0], torch.tensor([4 - half, 4 - half, 4 + half, 4 + half]))


@pytest.mark.parametrize("args,momentum", [({}, 0.1), ({"bn_momentum": 0.003}, 0.003)])
def test_small_model_bn_momentum(args, momentum):
    model = MODELS.build("ssd320-small", {"num_classes": 2, **args})
    head_bns = [m for m in [*model.fpn.modules(), *model.head.modules()] if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(head_bns) == 4 + 2 * 5 * 2 and all(m.momentum == momentum for m in head_bns)  # FPN 4 + towers 2x5x2
    assert model.backbone.bn1.momentum == 0.1  # the backbone keeps its own


# -- the detection task (fastvision/tasks/detect.py) ------------------------------------------
def test_detection_task_end_to_end(tmp_path):
    import json

    from PIL import Image

    from fastvision.data.formats.coco import build
    from fastvision.data.synth.coco import synth
    from fastvision.tasks.detect import DetectionTask

    root = synth(tmp_path / "shapes", seed=1, train=4, val=6)
    splits = build(path=str(root), image_size=96)
    task = DetectionTask(image_size=96, num_classes=4, info=splits.info, results_path=str(tmp_path / "res.json"))
    torch.manual_seed(0)
    model = MODELS.build("ssd320-small", {"num_classes": 4})
    batch = task.collate([splits.train[i] for i in range(4)])
    loss = task.loss(task.forward(model, batch), batch)
    loss.backward()
    assert torch.isfinite(loss)
    model.eval()
    ev = task.evaluator()
    val = task.collate([splits.val[i] for i in range(6)])
    det = task.eval_forward(model, val)
    assert det["boxes"].shape == (6, 100, 4)
    ev.update(det, val)
    ev.load_state(ev.state())
    m = ev.compute()
    assert set(m) >= {"map", "ap50", "ap75"} and m["images"] == 6
    ids = {r["category_id"] for r in json.loads((tmp_path / "res.json").read_text())}
    assert ids <= {1, 3, 5, 8}
    pngs = task.save_examples(det, val, tmp_path / "ex", 2, min_score=0.0)
    assert len(pngs) == 2 and Image.open(pngs[0]).size == (96, 96)
    files = sorted((root / "val2017").iterdir())[:2]
    out = task.predict_files(model, files, tmp_path / "pred", None, torch.device("cpu"))
    assert [p.name for p in out[:2]] == ["detections.json", "images.json"] and all(p.is_file() for p in out)
    w, h = Image.open(files[0]).size
    index = json.loads(out[1].read_text())
    coco_id = {im["file_name"]: im["id"] for im in json.loads(
        (root / "annotations" / "instances_val2017.json").read_text())["images"]}[files[0].name]
    assert index[0] == {"id": coco_id, "file_name": files[0].name, "width": w, "height": h,  # the COCO layout's id
                        "path": str(files[0].resolve())}
    assert Image.open(out[2]).size == (w, h)  # drawn on the original image
    syn = task.synthetic_batch(2, torch.device("cpu"))
    assert torch.isfinite(task.loss(task.forward(model.train(), syn), syn))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["ssd320-small-shapes", "ssd320-coco"])
def test_recipe_two_step_smoke(recipe, tmp_path, monkeypatch):
    engine = pytest.importorskip("fastvision.engine")
    from fastvision.config import from_dict, merge, read_yaml, recipe_path
    from fastvision.data.synth.coco import synth
    from fastvision.models.resnet import IMAGENET_URLS, resnet50

    # ssd320-coco starts from ImageNet weights (pretrained: imagenet): a torchvision-layout file in a
    # private torch.hub cache stands in for torchvision's; nothing is downloaded
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("FASTVISION_OFFLINE", "1")
    hub = tmp_path / "torch" / "hub" / "checkpoints"
    hub.mkdir(parents=True)
    torch.save(resnet50().state_dict(), hub / IMAGENET_URLS[50].rsplit("/", 1)[1])

    root = synth(tmp_path / "shapes", seed=0, train=4, val=4)
    ann = str(root / "annotations/instances_val2017.json")
    over = {"data": {"args": {"path": str(root), "image_size": 96}, "num_workers": 0, "loader": "threads",
                     "val_batch_size": 4},
            "task": {"args": {"image_size": 96, "num_classes": 4, "ann_file": ann, "cat_ids": [1, 3, 5, 8]}},
            "model": {"args": {"num_classes": 4}},
            "train": {"epochs": 1, "steps_per_epoch": 2, "batch_size": 2, "val_every": 1, "amp": "off", "target": None},
            "examples": 0}
    summary = engine.fit(from_dict(merge(read_yaml(recipe_path(recipe)), over)), tmp_path / "run", progress=False)
    assert 0.0 <= summary["map"] <= 1.0


@pytest.mark.parametrize("task_args,loss_args,expected", [
    ({}, None, (0.25, 2.0)),                               # the seed's values
    ({"alpha": 0.5, "gamma": 1.0}, None, (0.5, 1.0)),      # task.args alone
    ({}, {"alpha": 0.3, "gamma": 3.0}, (0.3, 3.0)),        # loss: focal alone
    ({"alpha": 0.3, "gamma": 3.0}, {"alpha": 0.3, "gamma": 3.0}, (0.3, 3.0)),  # both, agreeing
    ({"gamma": 1.0}, {"alpha": 0.25, "gamma": 2.0}, "gamma"),  # both, differing: an error, not a silent winner
    ({"alpha": 0.5}, {"alpha": 0.25}, "alpha"),
])
def test_detection_focal_parameters_set_in_one_place(task_args, loss_args, expected):
    from fastvision.errors import ConfigError
    from fastvision.losses import FocalLoss
    from fastvision.tasks.detect import DetectionTask

    loss = None if loss_args is None else FocalLoss(**loss_args)
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=f"task.args.{expected}"):
            DetectionTask(image_size=96, num_classes=4, loss=loss, **task_args)
        return
    task = DetectionTask(image_size=96, num_classes=4, loss=loss, **task_args)
    assert (task.alpha, task.gamma) == pytest.approx(expected)


def test_predict_checks_every_input_before_writing(tmp_path):
    """A truncated JPEG (its header reads) or a text file among predict's inputs: one line naming it, and
    no picture of the inputs before it written (they were, with the error coming part-way)."""
    import numpy as np
    from PIL import Image

    from fastvision.errors import DataError
    from fastvision.tasks.detect import DetectionTask

    rng = np.random.default_rng(0)
    files = []
    for name in ("a.jpg", "b.png", "c.jpg"):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(tmp_path / name)
        files.append(tmp_path / name)
    cut = files[2].read_bytes()
    files[2].write_bytes(cut[: len(cut) * 3 // 4])
    assert Image.open(files[2]).size == (48, 40)  # the header still reads
    task = DetectionTask(image_size=64, num_classes=4)
    torch.manual_seed(0)
    model = MODELS.build("ssd320-small", {"num_classes": 4}).eval()
    out = tmp_path / "pred"
    with pytest.raises(DataError, match=r"cannot read image .*c\.jpg: .*truncated.*nothing was written"):
        task.predict_files(model, files, out, None, torch.device("cpu"))
    assert not out.exists() or not any(out.iterdir())
    (tmp_path / "notes.txt").write_text("not an image")
    with pytest.raises(DataError, match=r"c\.jpg: .*truncated.*2 inputs do not decode: .*c\.jpg, .*notes\.txt"):
        task.predict_files(model, [*files, tmp_path / "notes.txt"], out, None, torch.device("cpu"))
    written = task.predict_files(model, files[:2], out, None, torch.device("cpu"))  # the good ones still predict
    assert sorted(p.name for p in written) == ["a_boxes.png", "b_boxes.png", "detections.json", "images.json"]


@pytest.fixture(scope="module")
def tiny_shapes(tmp_path_factory):
    from fastvision.data.synth.coco import synth

    # 5 training images: the first with a box of each of the 4 categories (with 2, 'cross' had none: one
    # warning line before the one-line errors these tests count)
    return synth(tmp_path_factory.mktemp("shapes") / "shapes", seed=0, train=5, val=1)


@pytest.mark.parametrize("loss_args", [{"use_softmax": True}, {"weight": [1.0, 2.0, 1.0, 1.0]},
                                       {"reduction": "sum"}, {"include_background": False},
                                       {"alpha": [0.25, 0.5, 0.25, 0.25]}],
                         ids=["use_softmax", "weight", "reduction", "include_background", "alpha"])
def test_focal_settings_the_detection_loss_ignores_are_refused(loss_args, tiny_shapes, tmp_path, capsys):
    """The recipe's loss: focal section supplies alpha and gamma; its other settings were accepted and silently
    unused (a per-class alpha kept its first value only)."""
    from fastvision.cli import main

    key, value = next(iter(loss_args.items()))
    rc = main(["train", "ssd320-small-shapes", "--data", str(tiny_shapes), "--out", str(tmp_path / "run"),
               "--device", "cpu", "--epochs", "1", "--batch-size", "1", "--set", "train.steps_per_epoch=1",
               "--set", "examples=0", "--set", f"loss.args.{key}={value}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"loss.args.{key}: the detection loss" in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


@pytest.mark.parametrize("sets, needle", [
    (["model.args.num_classes=5", "task.args.num_classes=5"],
     "model.args.num_classes=5 but the dataset has 4 categories (disk, square, triangle, cross)"),
    (["model.args.num_classes=5"], "model.args.num_classes=5 but the dataset has 4 categories"),
    (["task.args.num_classes=3"], "model.args.num_classes=4 but task.args.num_classes=3"),
], ids=["model-and-task-5", "model-5", "task-3"])
def test_class_count_that_differs_from_the_dataset_is_one_line(sets, needle, tiny_shapes, tmp_path, capsys):
    """A COCO set with more categories than model.args.num_classes trained without a word: the extra
    categories' boxes were taught as background and never predicted (fewer: heads for absent classes)."""
    from fastvision.cli import main

    rc = main(["train", "ssd320-small-shapes", "--data", str(tiny_shapes), "--out", str(tmp_path / "run"),
               "--device", "cpu", "--epochs", "1", "--batch-size", "1", "--set", "train.steps_per_epoch=1",
               "--set", "examples=0", *[a for kv in sets for a in ("--set", kv)]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists()


def test_max_boxes_that_drops_targets_says_so_once(caplog, fresh_logging):
    """task.args.max_boxes (fixed target shapes for --compile) left the boxes beyond it out without a word."""
    import logging

    from fastvision.tasks.detect import DetectionTask

    def item(image_id, n):
        return {"image": torch.zeros(3, 32, 32, dtype=torch.uint8), "boxes": torch.tensor([[1.0, 1, 9, 9]] * n),
                "labels": torch.zeros(n, dtype=torch.int64), "iscrowd": torch.zeros(n, dtype=torch.bool),
                "image_id": image_id, "orig_size": (32, 32)}

    task = DetectionTask(image_size=32, num_classes=2, max_boxes=2)
    with caplog.at_level(logging.WARNING):
        assert task.collate([item(1, 2), item(2, 1)])["labels"].shape == (2, 2)  # within: no word
        assert not caplog.records
        batch = task.collate([item(3, 1), item(4, 3)])
        task.collate([item(5, 4)])
    assert batch["labels"].shape == (2, 2) and int((batch["labels"][1] >= 0).sum()) == 2
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "max_boxes=2: image 4 has 3 boxes" in msgs[0]


@pytest.mark.parametrize("key, value, rule", [
    ("nms_iou", 1.5, "in (0, 1]"), ("nms_iou", 0.0, "in (0, 1]"), ("match_iou", 0.0, "in (0, 1]"),
    ("score_threshold", 1.0, "in [0, 1)"), ("score_threshold", -0.1, "in [0, 1)"),
    ("max_detections", 0, ">= 1"), ("max_boxes", 0, ">= 1"), ("image_size", 0, ">= 1"),
])
def test_detection_settings_out_of_range_are_one_line(key, value, rule):
    """nms_iou 1.5 (NMS off), score_threshold 1 or max_detections 0 (no detections: mAP 0) were accepted."""
    from fastvision.errors import ConfigError
    from fastvision.tasks.detect import DetectionTask

    with pytest.raises(ConfigError, match="^" + re.escape(f"task.args.{key}={value}: must be {rule}") + "$"):
        DetectionTask(num_classes=4, **{"image_size": 96, key: value})
    DetectionTask(num_classes=4, image_size=96, nms_iou=1.0, match_iou=0.5, score_threshold=0.0)  # the edges


def test_coco_jitter_and_size_out_of_range_are_one_line(tiny_shapes, tmp_path, capsys):
    from fastvision.cli import main

    for kv, line in (("data.args.color_jitter=-1", "data.args.color_jitter=-1: must be in [0, 1)"),
                     ("data.args.image_size=0", "data.args.image_size=0: must be >= 1")):
        rc = main(["train", "ssd320-small-shapes", "--data", str(tiny_shapes), "--out", str(tmp_path / "run"),
                   "--device", "cpu", "--epochs", "1", "--batch-size", "1", "--set", "train.steps_per_epoch=1",
                   "--set", "examples=0", "--set", kv])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and err == [f"fastvision: error: {line}"], err
    assert not (tmp_path / "run").exists()


def test_images_json_names_a_sub_folder_input_by_its_path_under_the_image_root(tmp_path):
    # images.json's file_name was the bare name ("x.jpg") of root/a/x.jpg: COCO's form is the path under the
    # image root ("a/x.jpg"), and a COCO file that lists sub-folders (Objects365's patch0/...) keeps its own
    import json

    from PIL import Image

    from fastvision.tasks.detect import DetectionTask

    rng = np.random.default_rng(1)
    files = []
    for rel in ("a/x.jpg", "b/c/y.png"):
        (tmp_path / "root" / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(tmp_path / "root" / rel)
        files.append(tmp_path / "root" / rel)
    task = DetectionTask(image_size=64, num_classes=4)
    torch.manual_seed(0)
    model = MODELS.build("ssd320-small", {"num_classes": 4}).eval()
    task.predict_files(model, files, tmp_path / "pred", None, torch.device("cpu"))
    index = json.loads((tmp_path / "pred" / "images.json").read_text())
    assert [(im["id"], im["file_name"]) for im in index] == [(0, "a/x.jpg"), (1, "b/c/y.png")]
    assert [im["path"] for im in index] == [str(f.resolve()) for f in files]
    info = tmp_path / "info.json"
    info.write_text(json.dumps({"images": [{"id": 5, "file_name": "patch1/y.png", "width": 48, "height": 40},
                                           {"id": 8, "file_name": "patch0/x.jpg", "width": 48, "height": 40}]}))
    task.predict_files(model, files, tmp_path / "pred2", None, torch.device("cpu"), coco_ids=str(info))
    index = json.loads((tmp_path / "pred2" / "images.json").read_text())
    assert [(im["id"], im["file_name"]) for im in index] == [(8, "patch0/x.jpg"), (5, "patch1/y.png")]
    one = task.predict_files(model, files[:1], tmp_path / "pred3", None, torch.device("cpu"))  # one folder: the name
    assert json.loads(one[1].read_text())[0]["file_name"] == "x.jpg"
