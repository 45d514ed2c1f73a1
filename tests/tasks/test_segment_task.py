"""Segmentation task pieces on hand-computed cases."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastvision.losses import DiceLoss
from fastvision.tasks.segment import SegmentationTask


def test_brats_region_masks_by_hand():
    task = SegmentationTask(mode="regions", regions=[[1, 2, 3], [1, 3], [3]], loss=DiceLoss(sigmoid=True))
    label = torch.tensor([[0, 1, 2, 3]])
    masks = task.region_masks(label)
    assert masks.shape == (1, 3, 4)
    assert masks[0].int().tolist() == [[0, 1, 1, 1],  # WT: 1, 2, 3
                                       [0, 1, 0, 1],  # TC: 1, 3
                                       [0, 0, 0, 1]]  # ET: 3


def test_regions_evaluator_counts_by_hand():
    task = SegmentationTask(mode="regions", regions=[[1, 2], [2]], loss=DiceLoss(sigmoid=True))
    label = torch.tensor([[0, 1, 2, 2]])
    logits = torch.tensor([[[-1.0, 1.0, 1.0, -1.0],    # region 0 predicted at 1, 2: tp 2, fn 1
                            [-1.0, -1.0, 1.0, 1.0]]])  # region 1 predicted at 2, 3: tp 2
    ev = task.evaluator()
    ev.update(logits, {"label": label})
    out = ev.compute()
    # one case: its Dice is the pooled Dice (per-case sums are fixed point to 2**-32)
    assert out["dice/0"] == pytest.approx(2 * 2 / (2 * 2 + 0 + 1), abs=1e-9) and out["dice/1"] == pytest.approx(1.0)
    assert out["iou/0"] == pytest.approx(2 / 3, abs=1e-9) and out["dice_pooled/0"] == 2 * 2 / (2 * 2 + 0 + 1)


def _task_3d(spacing):
    from fastvision.losses import DiceLoss
    from fastvision.tasks.segment import SegmentationTask

    info = {"preprocess": {"target_spacing": list(spacing)}} if spacing else {}
    return SegmentationTask(num_classes=2, sample_shape=[1, 20, 16, 6], loss=DiceLoss(softmax=True), info=info)


@pytest.mark.parametrize("spacing,blob,size", [
    # thick-slice MR: Z coarsest -> the axial (X, Y) plane: 16 rows (Y) x 20 columns (X), zoom 256 // 20 = 12
    ((0.6, 0.6, 3.6), (slice(5, 9), slice(4, 8), 4), (240, 192)),
    # isotropic CT: a tie keeps X, Y (axial)
    (None, (slice(5, 9), slice(4, 8), 4), (240, 192)),
    # in-plane 0.5 x 1.0 mm: pixels twice as tall as wide: 16 rows x 2 = 32 units x 20 columns, zoom 256 // 32 = 8
    ((0.5, 1.0, 3.0), (slice(5, 9), slice(4, 8), 4), (160, 256)),
    # X coarsest (a sagittal acquisition): the (Y, Z) plane: 6 rows (Z) x 16 columns (Y), zoom 16
    ((4.0, 1.0, 1.0), (12, slice(4, 8), slice(2, 4)), (256, 96)),
])
def test_3d_overlay_is_the_plane_of_the_two_finest_axes(tmp_path, spacing, blob, size):
    """RAS (X, Y, Z) cases: the overlay is cut across the coarsest axis (it used to cut along the
    first array axis, X: a sagittal strip, called axial), through the slice with the most truth,
    drawn at the voxel aspect. Sizes are worked out by hand from the shape and spacing."""
    from PIL import Image

    task = _task_3d(spacing)
    label = torch.zeros(1, 20, 16, 6, dtype=torch.long)
    label[(0, *blob)] = 1
    image = torch.rand(1, 1, 20, 16, 6)
    logits = torch.stack([1 - label.float(), label.float()], 1)  # a perfect prediction
    [path] = task.save_examples(logits, {"image": image, "label": label, "id": ["c0"]}, tmp_path, 1)
    png = np.asarray(Image.open(path))
    assert (png.shape[1], png.shape[0]) == size
    assert ((png[..., 1] == 255) & (png[..., 0] == 40)).any()  # the truth's green outline is in the slice


def test_finest_plane_picks_the_slice_with_most_foreground():
    from fastvision.tasks.segment import finest_plane

    label = torch.zeros(6, 5, 4, dtype=torch.long)
    label[1:3, 1:3, 1] = 1  # 4 voxels in z = 1
    label[0:5, 0:4, 3] = 1  # 20 voxels in z = 3
    image = torch.arange(6 * 5 * 4, dtype=torch.float32).reshape(1, 6, 5, 4)
    img, lab, _, pixel = finest_plane(image, label, label, (1.0, 1.0, 2.0))
    assert pixel == (1.0, 1.0) and lab.sum() == 20 and img.shape == (1, 5, 6)
    # rows: Y flipped (anterior up), columns: X
    assert img[0, 0, 0] == image[0, 0, 4, 3] and img[0, 4, 5] == image[0, 5, 0, 3]


@pytest.mark.parametrize("recipe,primary,higher", [
    ("unet3d-spleen-fast", "dice", True),  # target dice=0.94: best.pt by Dice (it was IoU)
    ("unet3d-spleen-baseline", "dice", True),
    ("unet3d-brats", "dice", True),  # no target: the task's own (regions: dice)
    ("unet2d-microscopy", "iou", True),  # no target: the task's own
])
def test_primary_metric_is_the_recipes_target(recipe, primary, higher):
    from fastvision.config import load
    from fastvision.engine.build import build_components

    task, _ = build_components(load(recipe), {}, "meta", weights=False)
    assert (task.primary_metric, task.higher_is_better) == (primary, higher)


@pytest.mark.parametrize("target,primary,higher", [("iou=0.8", "iou", True), ("val_loss=0.3", "val_loss", False),
                                                   ("hd95=4", "hd95", False)])
def test_a_target_override_sets_the_primary_metric(target, primary, higher):
    from fastvision.config import load
    from fastvision.engine.build import build_components

    task, _ = build_components(load("unet3d-spleen-fast", [{"train": {"target": target}}]), {}, "meta", weights=False)
    assert (task.primary_metric, task.higher_is_better) == (primary, higher)


@pytest.mark.parametrize("task_args, model, message", [
    ({"num_classes": 4}, ("unet3d-nonewnet", {"out_channels": 4}), None),
    ({"num_classes": 3}, ("unet3d-nonewnet", {"out_channels": 4}),
     "model.args.out_channels=4 but task.args.num_classes=3"),
    ({"num_classes": 4, "mode": "regions", "regions": [[1, 2, 3], [1, 3], [3]]}, ("segresnet", {"out_channels": 3}),
     None),
    ({"num_classes": 4, "mode": "regions", "regions": [[1, 2, 3], [1, 3], [3]]}, ("segresnet", {"out_channels": 4}),
     "model.args.out_channels=4 but task.args.regions (3 regions, mode regions) reads 3"),
    ({"mode": "sigmoid"}, ("unet2d-seed001", {}), None),
    ({"mode": "sigmoid"}, ("unet2d", {"out_channels": 2}), "task.args.mode=sigmoid (one logit) reads 1"),
])
def test_check_model_outputs_against_the_task(task_args, model, message):
    """The logits the model gives (counted here from the built model's last layer, by hand) against what the
    task reads: one per class, per region, or one."""
    from fastvision.errors import ConfigError
    from fastvision.models import create_model

    task = SegmentationTask(sample_shape=[1, 8, 8, 8], loss=DiceLoss(), **task_args)
    net = create_model(model[0], **model[1])
    last = [m for m in net.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))][-1]
    assert last.out_channels == model[1].get("out_channels", 1)  # the model's real outputs
    if message is None:
        task.check_model(net)
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        task.check_model(net)


@pytest.mark.parametrize("loss,args,task_args,message", [
    ("dice_ce", {"softmax": True, "weight": [1.0, 2.0, 3.0]}, {}, "dice_ce weight has 3 values but the logits have 2"),
    ("dice_ce", {"softmax": True, "weight": [1.0]}, {}, "dice_ce weight has 1 values"),
    ("dice_ce", {"softmax": True, "include_background": False, "weight": [1.0, 5.0]}, {}, None),
    ("dice_ce", {"softmax": True, "label_smoothing": 1.5}, {}, "label_smoothing"),
    ("dice_focal", {"softmax": True, "include_background": False, "weight": [1.0, 2.0]}, {}, "weight has 2 values"),
    ("dice_focal", {"softmax": True, "include_background": False, "weight": [2.0]}, {}, None),
    ("dice", {"softmax": True, "weight": [1.0]}, {}, "weight has 1 values"),
    ("dice_focal", {"sigmoid": True, "weight": [1.0, 1.0, 2.0]},
     {"num_classes": 4, "mode": "regions", "regions": [[1, 2, 3], [1, 3], [3]]}, None),
])
def test_a_loss_setting_refused_at_its_first_call_is_one_line_at_build(loss, args, task_args, message):
    """Before, a loss weight of another length than the model's channels (or CE label smoothing outside [0, 1])
    built, made the run folder and stopped the first step with torch's "weight tensor should be defined either
    for all or no classes"; now the model check names loss.args. A setting the loss takes passes."""
    from fastvision.errors import ConfigError
    from fastvision.models import create_model
    from fastvision.registry import LOSSES

    task_args = {"num_classes": 2, "mode": "softmax", **task_args}
    channels = len(task_args["regions"]) if task_args["mode"] == "regions" else task_args["num_classes"]
    task = SegmentationTask(sample_shape=[1, 8, 8], loss=LOSSES.build(loss, args), **task_args)
    net = create_model("unet2d", out_channels=channels)
    if message is None:
        task.check_model(net)
        return
    with pytest.raises(ConfigError, match=rf"^loss\.args: .*{message}"):
        task.check_model(net)


def test_a_bad_loss_weight_leaves_no_run_folder(tiny_microscopy, tmp_path, capsys):
    from tests.cli.input_checks import one_line_error, run_cli

    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", tiny_microscopy, "--device", "cpu",
                           "--set", "loss.args.weight=[1.0,2.0]", "--out", tmp_path / "r")
    one_line_error(code, err, "loss.args: dice_ce weight has 2 values but the logits have 1 channels")
    assert not (tmp_path / "r").exists()
