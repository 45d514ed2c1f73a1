"""Confusion counts, IoU / Dice per class, region counts, top-k: sums, reducible by one all-reduce."""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor


class ConfusionMatrix:
    """Whole-set confusion counts for semantic segmentation (or classification).

    ``counts[t, p]`` is the number of pixels of target class ``t`` predicted as ``p``.

    Args:
        num_classes: number of classes ``C``.
        device: where the counts live (the device of the predictions, so updates never copy).
    """

    def __init__(self, num_classes: int, device: torch.device | str = "cpu"):
        self.num_classes = int(num_classes)
        # one extra bin at the end collects ignored and out-of-range pixels without a host sync
        self._flat = torch.zeros(self.num_classes**2 + 1, dtype=torch.int64, device=device)

    @property
    def counts(self) -> Tensor:
        """``(C, C)`` int64 counts, rows = target class, columns = predicted class."""
        c = self.num_classes
        return self._flat[: c * c].view(c, c)

    @property
    def dropped(self) -> Tensor:
        """0-d int64: pixels skipped as ``ignore_index`` or with a label outside ``[0, C)``."""
        return self._flat[-1]

    def update(self, pred_idx: Tensor, target_idx: Tensor, ignore_index: int | None = None) -> None:
        """Add one batch.

        Args:
            pred_idx: int predicted classes, any shape, e.g. ``(B, *S)`` (argmax of the logits).
            target_idx: int target classes, same shape.
            ignore_index: target value to skip (e.g. 255 for void pixels).
        """
        if pred_idx.shape != target_idx.shape:
            raise ValueError(f"prediction shape {tuple(pred_idx.shape)} != target shape {tuple(target_idx.shape)}")
        c = self.num_classes
        p, t = pred_idx.reshape(-1).long(), target_idx.reshape(-1).long()
        valid = (t >= 0) & (t < c) & (p >= 0) & (p < c)
        if ignore_index is not None:
            valid &= t != ignore_index
        idx = torch.where(valid, t * c + p, c * c).to(self._flat.device)
        if idx.device.type == "cpu":
            self._flat += torch.bincount(idx, minlength=c * c + 1)
        else:
            # CUDA bincount reads the maximum back to size its output: a host sync per batch
            self._flat.index_add_(0, idx, torch.ones_like(idx))

    def reset(self) -> None:
        self._flat.zero_()

    def state(self) -> Tensor:
        """Counts as a 1-D float64 tensor (exact below 2**53) for a SUM all-reduce."""
        return self._flat.double()

    def load_state(self, state: Tensor) -> None:
        self._flat = state.round().to(torch.int64).to(self._flat.device)


def _counts(cm: ConfusionMatrix | Tensor) -> Tensor:
    return (cm.counts if isinstance(cm, ConfusionMatrix) else cm).double()


def _tp_fp_fn(cm: ConfusionMatrix | Tensor) -> tuple[Tensor, Tensor, Tensor]:
    m = _counts(cm)
    tp = m.diagonal()
    return tp, m.sum(0) - tp, m.sum(1) - tp


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` with NaN where ``den == 0`` (class absent from prediction and target)."""
    return torch.where(den > 0, num / den.clamp(min=1), torch.full_like(num, math.nan))


def iou_per_class(cm: ConfusionMatrix | Tensor) -> Tensor:
    """Jaccard index ``tp / (tp + fp + fn)`` per class.

    Args:
        cm: a :class:`ConfusionMatrix` or its ``(C, C)`` counts (rows target, columns prediction).

    Returns:
        ``(C,)`` float64; NaN for a class absent from both prediction and target.
    """
    tp, fp, fn = _tp_fp_fn(cm)
    return _ratio(tp, tp + fp + fn)


def dice_per_class(cm: ConfusionMatrix | Tensor) -> Tensor:
    """Dice ``2 tp / (2 tp + fp + fn)`` per class; ``(C,)`` float64, NaN as :func:`iou_per_class`."""
    tp, fp, fn = _tp_fp_fn(cm)
    return _ratio(2 * tp, 2 * tp + fp + fn)


def segmentation_scores(cm: ConfusionMatrix | Tensor, include_background: bool = True) -> dict[str, float]:
    """Mean and per-class IoU / Dice plus pixel accuracy, as plain floats for logging.

    Args:
        cm: confusion counts.
        include_background: whether class 0 enters the means ``iou`` and ``dice``.

    Returns:
        ``{"iou", "dice", "accuracy", "iou_<c>", "dice_<c>" for each class c}``; means skip NaN.
    """
    iou, dice = iou_per_class(cm), dice_per_class(cm)
    first = 0 if include_background or iou.numel() == 1 else 1
    m = _counts(cm)
    out = {
        "iou": torch.nanmean(iou[first:]).item(),
        "dice": torch.nanmean(dice[first:]).item(),
        "accuracy": (m.diagonal().sum() / m.sum().clamp(min=1)).item(),
    }
    for c in range(iou.numel()):
        out[f"iou_{c}"], out[f"dice_{c}"] = iou[c].item(), dice[c].item()
    return out


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
        if pred.shape != target.shape:
            raise ValueError(f"prediction shape {tuple(pred.shape)} != target shape {tuple(target.shape)}")
        p, t = pred.bool(), target.bool()
        dims = [0] + list(range(2, p.dim()))
        tp = (p & t).sum(dims)
        self.add(tp, p.sum(dims) - tp, t.sum(dims) - tp)

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
