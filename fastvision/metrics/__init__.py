"""Validation metrics kept as sums, so one all-reduce (SUM) combines them across ranks.

* :class:`ConfusionMatrix` accumulates int64 ``(C, C)`` counts of (target, prediction) pairs;
  :func:`iou_per_class` and :func:`dice_per_class` turn them into exact whole-set scores (never an
  average of per-batch scores).
* :class:`RegionCounts` keeps per-channel tp/fp/fn of boolean masks, for multi-label sigmoid
  outputs such as BraTS WT/TC/ET regions.
* :class:`Evaluator` is the base of every task's validation accumulator.
* :func:`topk_correct` counts top-k hits for classification.
* :func:`hd95` is the 95th-percentile symmetric Hausdorff distance between mask surfaces, in pure
  torch (exact Euclidean distance transform, no scipy).

NaN convention: a class absent from both prediction and target has no defined IoU/Dice; it is NaN
and left out of means (``torch.nanmean``), so a validation set that never shows a class does not
score it as 0 or 1.
"""
from fastvision.metrics.base import Evaluator
from fastvision.metrics.counts import (
                                       ConfusionMatrix,
                                       RegionCounts,
                                       dice_per_class,
                                       iou_per_class,
                                       segmentation_scores,
                                       topk_correct,
)
from fastvision.metrics.distance import hd95

__all__ = ["ConfusionMatrix", "Evaluator", "RegionCounts", "dice_per_class", "hd95", "iou_per_class",
           "segmentation_scores", "topk_correct"]
