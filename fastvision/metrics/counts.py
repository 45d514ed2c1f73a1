"""Pooled tp / fp / fn per class or region, top-k: sums, reducible by one all-reduce."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from fastvision.metrics.cases import case_counts


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` with NaN where ``den == 0`` (class absent from prediction and target)."""
    return torch.where(den > 0, num / den.clamp(min=1), torch.full_like(num, math.nan))


class RegionCounts:
    """Per-channel tp / fp / fn of boolean masks (multi-label regions, e.g. BraTS WT/TC/ET).

    Args:
        num_channels: number of regions ``C``.
        device: where the sums live.
    """

    def __init__(self, num_channels: int, device: torch.device | str = "cpu"):
        self.sums = torch.zeros(3, num_channels, dtype=torch.int64, device=device)

    def update(self, pred: Tensor, target: Tensor) -> None:
        """Args: pred, target: ``(B, C, *S)`` boolean (or 0/1) masks, e.g. ``sigmoid(logits) > 0.5``."""
        tp, fp, fn = case_counts(pred, target)
        self.add(tp.sum(0), fp.sum(0), fn.sum(0))

    def add(self, tp: Tensor, fp: Tensor, fn: Tensor) -> None:
        """Add counts already taken: each ``(C,)`` (e.g. per-case counts summed over the cases)."""
        self.sums += torch.stack([tp, fp, fn]).to(self.sums.device)

    def reset(self) -> None:
        self.sums.zero_()

    def state(self) -> Tensor:
        """tp, fp, fn rows flattened to 1-D float64 for a SUM all-reduce."""
        return self.sums.double().reshape(-1)

    def load_state(self, state: Tensor) -> None:
        self.sums = state.round().to(torch.int64).view(3, -1).to(self.sums.device)

    def dice(self) -> Tensor:
        """``(C,)`` float64 Dice per region; NaN where the region is empty in prediction and target."""
        tp, fp, fn = self.sums.double()
        return _ratio(2 * tp, 2 * tp + fp + fn)

    def iou(self) -> Tensor:
        """``(C,)`` float64 IoU per region; NaN as :meth:`dice`."""
        tp, fp, fn = self.sums.double()
        return _ratio(tp, tp + fp + fn)


def topk_correct(logits: Tensor, target: Tensor, ks: Sequence[int] = (1, 5)) -> Tensor:
    """Number of samples whose target is among the ``k`` highest scores, for each ``k``.

    Args:
        logits: ``(B, C)`` scores.
        target: ``(B,)`` int64 class indices.
        ks: values of ``k``; a ``k`` >= C counts every sample.

    Returns:
        ``(len(ks),)`` int64 counts on ``logits``' device (sum across ranks, divide by the total).
    """
    maxk = min(max(ks), logits.shape[1])
    top = logits.topk(maxk, dim=1).indices  # (B, maxk), best first
    hits = (top == target.view(-1, 1)).long()
    return torch.stack([hits[:, : min(k, maxk)].sum() for k in ks])
