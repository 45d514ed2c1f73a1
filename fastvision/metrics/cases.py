"""Per-case segmentation metrics (each case's Dice / IoU / HD95 per class or region, then a mean
over cases), with MONAI's ``DiceMetric`` conventions (``mean`` and ``mean_batch`` reductions,
``ignore_empty``) and an exact cross-rank reduction.

* :func:`case_counts` and :func:`case_scores` give ``(B, C)`` per-case scores from boolean masks,
  with the empty-truth convention ``empty``:

  - ``"ignore"``: MONAI's ``ignore_empty=True``; a case whose truth is empty for a class is NaN
    and left out of that class's mean;
  - ``"one"``: the BraTS convention (MONAI's ``ignore_empty=False``): truth and prediction both
    empty scores 1, a prediction on an empty truth scores 0;
  - ``"zero"``: seed 000's TF code, ``2 I / (P + G + 1e-5)``, which scores both-empty as 0.

* :class:`CaseSums` keeps what the validation loop needs as sums: per class the sum of the cases'
  scores and their count (MONAI ``mean_batch``), and the sum over cases of each case's mean over
  classes with the number of such cases (MONAI ``mean``). Scores are added in fixed point
  (``round(score * 2**32)`` as int64), so the sums are exact integers: one float64 SUM
  all-reduce gives bit-identical results whatever the number of ranks or the order of cases.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Empty = Literal["ignore", "one", "zero"]


def case_counts(pred: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-case, per-channel true positives, false positives and false negatives.

    Args:
        pred: ``(B, C, *S)`` boolean (or 0/1) predicted masks.
        target: same shape, the truth.

    Returns:
        tp, fp, fn: each ``(B, C)`` int64.
    """
    if pred.shape != target.shape:
        raise ValueError(f"prediction shape {tuple(pred.shape)} != target shape {tuple(target.shape)}")
    p, t = pred.bool().flatten(2), target.bool().flatten(2)
    tp = (p & t).sum(2)
    return tp, p.sum(2) - tp, t.sum(2) - tp


def case_scores(tp: Tensor, fp: Tensor, fn: Tensor, metric: Literal["dice", "iou"] = "dice",
                empty: Empty = "ignore") -> Tensor:
    """Dice ``2tp / (2tp + fp + fn)`` or IoU ``tp / (tp + fp + fn)`` per case and channel.

    Args:
        tp, fp, fn: ``(B, C)`` counts from :func:`case_counts`.
        metric: ``"dice"`` or ``"iou"``.
        empty: what a case with an empty truth scores (module docstring).

    Returns:
        ``(B, C)`` float64; NaN where ``empty="ignore"`` and the truth is empty.
    """
    tp, fp, fn = tp.double(), fp.double(), fn.double()
    num, den = (2 * tp, 2 * tp + fp + fn) if metric == "dice" else (tp, tp + fp + fn)
    score = num / den.clamp(min=1)
    truth_empty = (tp + fn) == 0
    if empty == "ignore":
        fill = torch.full_like(score, math.nan)
    elif empty == "one":
        fill = (fp == 0).double()
    elif empty == "zero":
        fill = torch.zeros_like(score)
    else:
        raise ValueError(f"empty must be ignore, one or zero, got {empty!r}")
    return torch.where(truth_empty, fill, score)


class CaseSums:
    """Sums of per-case scores for one metric over ``C`` channels, exact under any SUM all-reduce.

    Args:
        channels: number of classes or regions ``C``.
        device: where the sums live.
        scale: fixed-point unit (default ``2**32``: Dice/IoU to 2.3e-10; float64 stays exact up to
            2**21 case-channel scores in [0, 1]; use a smaller scale for distances).
    """

    def __init__(self, channels: int, device: torch.device | str = "cpu", scale: float = 2.0**32):
        self.channels, self.scale = channels, float(scale)
        # [sum per channel (C), count per channel (C), sum of per-case means, number of such cases]
        self.sums = torch.zeros(2 * channels + 2, dtype=torch.int64, device=device)

    def update(self, f: Tensor) -> None:
        """Add ``(B, C)`` per-case scores (NaN = not defined for that case and channel)."""
        valid = ~torch.isnan(f)
        fixed = torch.where(valid, f * self.scale, 0.0).round().to(torch.int64)
        n_c = valid.sum(1)
        case_mean = torch.where(n_c > 0, torch.where(valid, f, 0.0).sum(1) / n_c.clamp(min=1), 0.0)
        case_fixed = (case_mean * self.scale).round().to(torch.int64)
        add = torch.cat([fixed.sum(0), valid.sum(0), case_fixed.sum().view(1), (n_c > 0).sum().view(1)])
        self.sums += add.to(self.sums.device)

    def state(self) -> Tensor:
        """1-D float64 (exact integers) for a SUM all-reduce."""
        return self.sums.double()

    def load_state(self, state: Tensor) -> None:
        self.sums = state.round().to(torch.int64).to(self.sums.device)

    def mean_batch(self) -> Tensor:
        """``(C,)`` float64: per channel the mean over the cases where it is defined (NaN if none)."""
        c = self.channels
        total, n = self.sums[:c].double() / self.scale, self.sums[c:2 * c].double()
        return torch.where(n > 0, total / n.clamp(min=1), math.nan)

    def mean(self) -> float:
        """MONAI ``mean``: the mean over cases of each case's mean over its defined channels."""
        total, n = float(self.sums[-2]) / self.scale, int(self.sums[-1])
        return total / n if n else math.nan
