"""Segmentation task pieces on hand-computed cases."""
from __future__ import annotations

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
