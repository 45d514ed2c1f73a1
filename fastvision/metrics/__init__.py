"""Validation metrics kept as sums, so one all-reduce (SUM) combines them across ranks.

* :class:`RegionCounts` keeps per-channel tp/fp/fn of boolean masks (one channel per class, or
  per region such as BraTS WT/TC/ET) and turns them into exact whole-set Dice / IoU (never an
  average of per-batch scores); :mod:`fastvision.metrics.cases` has the per-case scores.
* :class:`Evaluator` is the base of every task's validation accumulator.
* :func:`topk_correct` counts top-k hits for classification.
* :func:`hd95` is the 95th-percentile symmetric Hausdorff distance between mask surfaces, in pure
  torch (exact Euclidean distance transform, no scipy).

NaN convention: a class absent from both prediction and target has no defined IoU/Dice; it is NaN
and left out of means (``torch.nanmean``), so a validation set that never shows a class does not
score it as 0 or 1.
"""
from fastvision.metrics.base import Evaluator
from fastvision.metrics.counts import RegionCounts, topk_correct
from fastvision.metrics.distance import hd95

__all__ = ["Evaluator", "RegionCounts", "hd95", "topk_correct"]
