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
from __future__ import annotations

import math
from typing import Any, Sequence

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


# ----------------------------------------------------------------------------------------------
# Surface distances


def _edges(mask: Tensor) -> Tensor:
    """Boundary voxels: the mask minus its erosion by the face-connected cross, outside = 0.

    The same boundary as ``mask ^ scipy.ndimage.binary_erosion(mask)`` used by MONAI.
    """
    padded = torch.zeros([n + 2 for n in mask.shape], dtype=torch.bool, device=mask.device)
    padded[tuple(slice(1, -1) for _ in mask.shape)] = mask
    eroded = mask.clone()
    for d in range(mask.dim()):
        eroded &= _shift(padded, d, 0, mask)
        eroded &= _shift(padded, d, 2, mask)
    return mask & ~eroded


def _shift(padded: Tensor, dim: int, start: int, like: Tensor) -> Tensor:
    """The padded mask seen one voxel back (start 0) or forward (start 2) along ``dim``."""
    index = [slice(1, 1 + s) for s in like.shape]
    index[dim] = slice(start, start + like.shape[dim])
    return padded[tuple(index)]


def _squared_distance_to(features: Tensor, spacing: Sequence[float]) -> Tensor:
    """Exact squared Euclidean distance from every voxel to the nearest ``True`` voxel.

    Squared distance is separable: one brute-force 1-D lower envelope per axis,
    ``f(x) = min_y f(y) + ((x - y) * spacing) ** 2``, gives the exact N-d transform in
    ``O(voxels * side)`` per axis. Rows are processed in chunks to bound memory. Inf where there
    are no features.
    """
    f = torch.where(features, 0.0, math.inf).double()
    for d, s in enumerate(spacing):
        n = f.shape[d]
        pos = torch.arange(n, dtype=torch.float64, device=f.device) * float(s)
        cost = (pos[:, None] - pos[None, :]) ** 2  # (x, y)
        moved = f.movedim(d, -1)
        rows = moved.reshape(-1, n)
        out = torch.empty_like(rows)
        step = max(1, (1 << 22) // (n * n))
        for i in range(0, rows.shape[0], step):
            out[i : i + step] = (rows[i : i + step, None, :] + cost).amin(-1)
        f = out.view(moved.shape).movedim(-1, d)
    return f


def hd95(pred_mask: Tensor, gt_mask: Tensor, spacing: Sequence[float] | float | None = None, percentile: float = 95.0) -> Tensor:
    """Percentile symmetric Hausdorff distance between the surfaces of two binary masks.

    Surfaces are the boundary voxels (mask minus its cross-shaped erosion). The result is the
    larger of the two directed ``percentile``-th percentiles (linear interpolation) of
    surface-to-nearest-surface Euclidean distances, as MONAI's
    ``compute_hausdorff_distance(percentile=95)``. Runs on the masks' device; reads the
    bounding box back to the host once (evaluation only, not a training hot path).

    Edge cases (as MONAI): both masks empty -> NaN; exactly one empty -> inf.

    Args:
        pred_mask: ``(*S)`` boolean (or 0/1) mask, 2-D ``(H, W)`` or 3-D ``(D, H, W)``.
        gt_mask: same shape.
        spacing: voxel size per spatial axis (or one number for all), in output units; default 1.
        percentile: in [0, 100]; 100 gives the classic Hausdorff distance.

    Returns:
        0-d float64 tensor.
    """
    if pred_mask.shape != gt_mask.shape:
        raise ValueError(f"mask shapes differ: {tuple(pred_mask.shape)} vs {tuple(gt_mask.shape)}")
    if not 0 <= percentile <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {percentile}")
    nd = pred_mask.dim()
    if spacing is None:
        spacing = [1.0] * nd
    elif isinstance(spacing, (int, float)):
        spacing = [float(spacing)] * nd
    elif len(spacing) != nd:
        raise ValueError(f"spacing has {len(spacing)} values for a {nd}-D mask")
    p, g = pred_mask.bool(), gt_mask.bool()
    union = p | g
    device = p.device
    if not union.any():  # deliberate sync: evaluation only
        return torch.tensor(math.nan, dtype=torch.float64, device=device)
    # crop to the union's bounding box: surfaces and all distances between them lie inside it
    nz = union.nonzero()
    box = tuple(slice(int(lo), int(hi) + 1) for lo, hi in zip(nz.min(0).values, nz.max(0).values))
    ep, eg = _edges(p[box]), _edges(g[box])
    if not ep.any() or not eg.any():
        return torch.tensor(math.inf, dtype=torch.float64, device=device)
    q = percentile / 100
    d_pg = _squared_distance_to(eg, spacing)[ep].sqrt()
    d_gp = _squared_distance_to(ep, spacing)[eg].sqrt()
    return torch.maximum(torch.quantile(d_pg, q), torch.quantile(d_gp, q))


class Evaluator:
    """Accumulates validation statistics as sums, so ranks can be combined by one all-reduce.

    Subclasses keep their running sums in ``self.sums`` (a 1-D float64 tensor on the device) or
    override :meth:`state` / :meth:`load_state` for non-tensor state (e.g. COCO detections).
    """

    def update(self, outputs: Any, batch: dict[str, Any]) -> None:
        raise NotImplementedError

    def state(self) -> Tensor:
        """1-D float64 tensor that is summed across ranks."""
        return self.sums

    def load_state(self, state: Tensor) -> None:
        self.sums = state

    def compute(self) -> dict[str, float]:
        raise NotImplementedError
