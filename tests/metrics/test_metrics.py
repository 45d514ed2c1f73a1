"""Metrics against hand-counted cases and MONAI (independent reference)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastvision.losses import DiceLoss
from fastvision.metrics import RegionCounts, hd95, topk_correct
from fastvision.metrics.cases import case_counts, case_scores
from fastvision.tasks.segment import SegmentationTask

# ----------------------------------------------------------------------------------------------
# Hand-counted cases, through the segmentation evaluator's pooled counts

TARGET = [[0, 0, 1, 1], [0, 2, 2, 1], [0, 0, 2, 2]]
PRED = [[0, 1, 1, 1], [0, 2, 1, 1], [2, 0, 2, 0]]
# (target, pred) pairs counted by hand, rows = target:
#   t=0: p0 x3, p1 x1, p2 x1;  t=1: p1 x3;  t=2: p0 x1, p1 x1, p2 x2
COUNTS = [[3, 1, 1], [0, 3, 0], [1, 1, 2]]
# class 0: tp 3 fp 1 fn 2 -> IoU 3/6, Dice 6/9; class 1: tp 3 fp 2 fn 0 -> 3/5, 6/8;
# class 2: tp 2 fp 1 fn 2 -> 2/5, 4/7
IOU = [0.5, 0.6, 0.4]
DICE = [2 / 3, 0.75, 4 / 7]


def _pooled_eval(pred, target, c: int, batches: int = 1):
    """The softmax segmentation evaluator (pooled average) fed one-hot logits of ``pred``."""
    task = SegmentationTask(num_classes=c, average="pooled", loss=DiceLoss(softmax=True))
    ev = task.evaluator()
    logits = F.one_hot(pred, c).movedim(-1, 1).float()
    for lg, lb in zip(logits.chunk(batches), target.chunk(batches), strict=True):
        ev.update(lg, {"label": lb})
    return ev


def _one_hot_counts(pred, target, c: int) -> RegionCounts:
    """Pooled counts of every class, background included."""
    rc = RegionCounts(c)
    rc.update(F.one_hot(pred, c).movedim(-1, 1), F.one_hot(target, c).movedim(-1, 1))
    return rc


def test_pooled_counts_and_scores_by_hand():
    pred, target = torch.tensor(PRED), torch.tensor(TARGET)
    rc = _one_hot_counts(pred, target, 3)
    m = torch.tensor(COUNTS)
    assert rc.sums.tolist() == [m.diagonal().tolist(), (m.sum(0) - m.diagonal()).tolist(),
                                (m.sum(1) - m.diagonal()).tolist()] and rc.sums.dtype == torch.int64
    torch.testing.assert_close(rc.iou(), torch.tensor(IOU, dtype=torch.float64))
    torch.testing.assert_close(rc.dice(), torch.tensor(DICE, dtype=torch.float64))
    s = _pooled_eval(pred, target, 3).compute()  # foreground classes, as training reports them
    assert s["iou"] == pytest.approx(0.5) and s["dice"] == pytest.approx((0.75 + 4 / 7) / 2)
    assert s["iou/1"] == pytest.approx(0.6) and s["dice/2"] == pytest.approx(4 / 7)
    assert float(torch.nanmean(rc.iou())) == pytest.approx(0.5)  # background included


def test_absent_class_is_nan_and_left_out_of_means():
    # class 3 appears nowhere; class 2 only in the prediction (IoU 0, not NaN)
    target = torch.tensor([[0, 0, 1], [1, 1, 0]])
    pred = torch.tensor([[0, 2, 1], [1, 0, 0]])
    # class 0: tp 2 fp 1 fn 1 -> 2/4; class 1: tp 2 fp 0 fn 1 -> 2/3; class 2: tp 0 fp 1 -> 0
    iou = _one_hot_counts(pred, target, 4).iou()
    torch.testing.assert_close(iou[:3], torch.tensor([0.5, 2 / 3, 0.0], dtype=torch.float64))
    assert math.isnan(iou[3])
    assert float(torch.nanmean(iou)) == pytest.approx((0.5 + 2 / 3 + 0.0) / 3)
    s = _pooled_eval(pred, target, 4).compute()
    assert math.isnan(s["iou/3"]) and s["iou"] == pytest.approx((2 / 3 + 0.0) / 2)


def test_batches_accumulate_to_one_update_and_state_sums_like_ranks():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randint(0, 5, (8, 7, 6), generator=g), torch.randint(0, 5, (8, 7, 6), generator=g)
    whole, batched = _pooled_eval(pred, target, 5), _pooled_eval(pred, target, 5, batches=4)
    for key in ("classes.pooled", "classes.dice", "classes.iou"):
        assert torch.equal(batched.parts[key].sums, whole.parts[key].sums)
    # two "ranks" with half the cases each, combined by summing their states
    ranks = [_pooled_eval(pred[i::2], target[i::2], 5, batches=2) for i in range(2)]
    merged = SegmentationTask(num_classes=5, average="pooled", loss=DiceLoss(softmax=True)).evaluator()
    merged.load_state(ranks[0].state() + ranks[1].state())
    assert ranks[0].state().dtype == torch.float64
    for key in ("classes.pooled", "classes.dice", "classes.iou"):
        assert torch.equal(merged.parts[key].sums, whole.parts[key].sums)


def test_region_counts_by_hand():
    # channel 0: pred {a,b,c}, target {b,c,d} -> tp 2 fp 1 fn 1; channel 1: both empty -> NaN
    pred = torch.tensor([[[1, 1, 1, 0]], [[0, 0, 0, 0]]], dtype=torch.bool).view(1, 2, 4)
    target = torch.tensor([[[0, 1, 1, 1]], [[0, 0, 0, 0]]], dtype=torch.bool).view(1, 2, 4)
    rc = RegionCounts(2)
    rc.update(pred, target)
    assert rc.sums[:, 0].tolist() == [2, 1, 1]
    assert rc.dice()[0].item() == pytest.approx(4 / 6) and rc.iou()[0].item() == pytest.approx(0.5)
    assert math.isnan(rc.dice()[1]) and math.isnan(rc.iou()[1])
    other = RegionCounts(2)
    other.load_state(rc.state() * 2)
    assert other.sums[:, 0].tolist() == [4, 2, 2]


# ----------------------------------------------------------------------------------------------
# Against MONAI on random masks

monai_metrics = pytest.importorskip("monai.metrics")


def _onehot(idx: torch.Tensor, c: int) -> torch.Tensor:
    return F.one_hot(idx, c).movedim(-1, 1).float()


@pytest.mark.parametrize("shape,c", [((3, 9, 11), 3), ((2, 5, 6, 4), 4), ((4, 8, 8), 2)])
def test_iou_and_dice_match_monai(shape, c):
    g = torch.Generator().manual_seed(c)
    target = torch.randint(0, c, shape, generator=g)
    pred = torch.where(torch.rand(shape, generator=g) < 0.7, target, torch.randint(0, c, shape, generator=g))
    pred[0][pred[0] == c - 1] = 0  # one image never predicts the last class
    target[0][target[0] == c - 1] = 0  # ... nor contains it: NaN there for MONAI and for us
    # per image: each image's per-case scores (MONAI's ignore_empty=True: NaN on an empty truth)
    ref_iou = monai_metrics.compute_iou(_onehot(pred, c), _onehot(target, c), include_background=True)
    ref_dice = monai_metrics.DiceMetric(include_background=True, reduction="none")(_onehot(pred, c), _onehot(target, c))
    tp, fp, fn = case_counts(_onehot(pred, c), _onehot(target, c))
    torch.testing.assert_close(case_scores(tp, fp, fn, "iou"), ref_iou.double(), equal_nan=True, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(case_scores(tp, fp, fn, "dice"), ref_dice.double(), equal_nan=True, rtol=1e-6,
                               atol=1e-6)
    # whole set: MONAI sees the batch laid side by side as one image
    rc = RegionCounts(c)
    for b in range(shape[0]):
        rc.update(_onehot(pred[b : b + 1], c), _onehot(target[b : b + 1], c))
    side_p, side_t = torch.cat(list(pred), dim=0)[None], torch.cat(list(target), dim=0)[None]
    ref = monai_metrics.compute_iou(_onehot(side_p, c), _onehot(side_t, c))[0]
    torch.testing.assert_close(rc.iou(), ref.double(), rtol=1e-6, atol=1e-6)


def test_region_dice_matches_monai_on_multilabel_masks():
    g = torch.Generator().manual_seed(5)
    target = torch.rand(3, 3, 6, 7, 5, generator=g) < 0.3
    pred = target ^ (torch.rand(target.shape, generator=g) < 0.2)
    rc = RegionCounts(3)
    for b in range(3):
        rc.update(pred[b : b + 1], target[b : b + 1])
    side_p, side_t = torch.cat(list(pred), dim=1)[None], torch.cat(list(target), dim=1)[None]
    ref = monai_metrics.DiceMetric(include_background=True, reduction="none")(side_p.float(), side_t.float())[0]
    torch.testing.assert_close(rc.dice(), ref.double(), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# top-k


def test_topk_correct_on_crafted_scores():
    logits = torch.tensor(
        [
            [0.1, 0.5, 0.4, 0.0],  # target 1: top-1 hit
            [0.9, 0.05, 0.03, 0.02],  # target 2: 3rd best -> hit for k >= 3
            [0.2, 0.3, 0.4, 0.1],  # target 3: last -> hit only for k >= 4
            [0.0, 1.0, 3.0, 2.0],  # target 3: 2nd best -> hit for k >= 2
        ]
    )
    target = torch.tensor([1, 2, 3, 3])
    assert topk_correct(logits, target, ks=(1, 2, 3, 4, 5)).tolist() == [1, 2, 3, 4, 4]
    assert topk_correct(logits, target).dtype == torch.int64


# ----------------------------------------------------------------------------------------------
# hd95: hand-computed cases, and MONAI where scipy is installed


def _mask(shape, points):
    m = torch.zeros(shape, dtype=torch.bool)
    for p in points:
        m[p] = True
    return m


def test_hd95_single_points_with_spacing():
    p, g = _mask((5, 6), [(0, 0)]), _mask((5, 6), [(3, 4)])
    assert hd95(p, g).item() == pytest.approx(5.0)  # 3-4-5 triangle
    assert hd95(p, g, spacing=(2.0, 0.5)).item() == pytest.approx(math.sqrt(6.0**2 + 2.0**2))
    p3, g3 = _mask((3, 4, 4), [(0, 0, 0)]), _mask((3, 4, 4), [(1, 2, 2)])
    assert hd95(p3, g3).item() == pytest.approx(3.0)
    assert hd95(p3, g3, spacing=2.0).item() == pytest.approx(6.0)


def test_hd95_percentile_interpolates_linearly():
    # a one-pixel-thick line is all surface: distances to the point at its end are 0, 1, 2, 3, 4
    line = _mask((3, 7), [(1, j) for j in range(5)])
    point = _mask((3, 7), [(1, 0)])
    assert hd95(line, point).item() == pytest.approx(0.95 * 4)  # between 3 and 4 at 0.8
    assert hd95(point, line, percentile=100).item() == pytest.approx(4.0)
    assert hd95(line, point, percentile=50).item() == pytest.approx(2.0)


def test_hd95_filled_square_uses_its_boundary_only():
    # 5x5 square vs its centre pixel: square surface is the 16-pixel ring; ring -> centre distances
    # are 2 (x4 edge midpoints), sqrt(5) (x8), sqrt(8) (x4 corners); centre -> ring is 2
    sq = _mask((7, 7), [(i, j) for i in range(1, 6) for j in range(1, 6)])
    centre = _mask((7, 7), [(3, 3)])
    want = torch.quantile(torch.tensor([2.0] * 4 + [math.sqrt(5)] * 8 + [math.sqrt(8)] * 4, dtype=torch.float64), 0.95)
    assert hd95(sq, centre).item() == pytest.approx(want.item())
    assert hd95(sq, sq).item() == 0.0


def test_hd95_empty_masks():
    empty, one = torch.zeros(4, 4, dtype=torch.bool), _mask((4, 4), [(1, 1)])
    assert math.isnan(hd95(empty, empty))
    assert hd95(empty, one).item() == math.inf and hd95(one, empty).item() == math.inf


def _blobs(shape, seed, fraction):
    """Smoothed noise thresholded to cover ``fraction`` of the image: several irregular blobs."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand((1, 1, *shape), generator=g)
    pool = F.avg_pool2d if len(shape) == 2 else F.avg_pool3d
    smooth = pool(noise, 5, stride=1, padding=2)[0, 0]
    return smooth > smooth.quantile(1 - fraction)


@pytest.mark.parametrize(
    "shape,spacing", [((24, 20), None), ((24, 20), (0.7, 1.9)), ((10, 12, 9), (2.0, 1.0, 1.0)), ((10, 12, 9), None)]
)
def test_hd95_matches_monai(shape, spacing):
    pytest.importorskip("scipy", reason="MONAI's surface distances need scipy; hand-computed cases above")
    p, g = _blobs(shape, 1, 0.2), _blobs(shape, 2, 0.25)
    ref = monai_metrics.compute_hausdorff_distance(
        p[None, None].float(), g[None, None].float(), include_background=True, percentile=95, spacing=spacing
    )[0, 0]
    assert hd95(p, g, spacing=spacing).item() == pytest.approx(ref.item(), rel=1e-5)
