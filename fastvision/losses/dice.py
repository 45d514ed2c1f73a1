"""Region losses with MONAI's option names: Dice (and soft Jaccard), masked Dice, generalized
Dice (Sudre et al. 2017) and Tversky (Salehi et al. 2017).

``reduction="none"`` returns what MONAI returns: Dice, masked Dice and generalized Dice keep the
broadcastable shape ``(B, C, 1, ...)`` (``(C, 1, ...)`` / ``(1, ...)`` with ``batch``), Tversky
returns ``(B, C)``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from fastvision.losses._common import (
    Reduction,
    _activate,
    _activation,
    _check_acts,
    _fp32,
    _no_autocast,
    _per_class,
    _reduce,
    _reduce_region,
    _weight_buffer,
    dense_target,
)
from fastvision.registry import LOSSES


def _probs_and_target(loss: nn.Module, logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 probabilities and dense target of a region loss, channel 0 dropped without background."""
    p = _activate(_fp32(logits), loss.sigmoid, loss.softmax, loss.other_act)
    t = dense_target(logits, target)
    if not loss.include_background and p.shape[1] > 1:
        p, t = p[:, 1:], t[:, 1:]
    return p, t


def _sum_dims(x: Tensor, batch: bool) -> list[int]:
    dims = list(range(2, x.dim()))
    return [0] + dims if batch else dims


@LOSSES.register("dice")
class DiceLoss(nn.Module):
    """Soft Dice (or soft Jaccard) loss, ``1 - (2 I + smooth_nr) / (P + G + smooth_dr)`` per channel.

    ``I = sum(p * g)``, ``P = sum(p ** k)``, ``G = sum(g ** k)`` over space (and batch when
    ``batch``), ``k = 2`` with ``squared_pred`` else 1. Jaccard uses ``2 (P + G - I)`` as the
    denominator. Matches ``monai.losses.DiceLoss`` with ``to_onehot_y`` implied by integer targets.

    Args:
        include_background: keep channel 0; ignored when there is a single channel.
        sigmoid: apply a sigmoid to the logits (multi-label); exclusive with ``softmax``.
        softmax: apply a softmax over channels (ignored for a single channel).
        other_act: another activation instead: a callable, or in a recipe one of
            ``tanh, sigmoid, relu, exp, softplus, identity`` (MONAI's ``other_act``).
        squared_pred: square predictions and targets in the denominator.
        jaccard: soft IoU instead of Dice.
        reduction: ``"mean"`` or ``"sum"`` over batch and channels, or ``"none"``: per item and
            channel, shaped ``(B, C', 1, ...)`` as MONAI (``(C', 1, ...)`` with ``batch``).
        smooth_nr: added to the numerator (an empty channel predicted empty scores 0 loss).
        smooth_dr: added to the denominator (avoids 0 / 0).
        batch: sum over the batch before dividing (one Dice per channel for the whole batch).
        weight: per-channel multiplier of the loss, scalar or one value per channel that is
            kept (without channel 0 when ``include_background`` is false).
    """

    def __init__(
        self,
        *,
        include_background: bool = True, sigmoid: bool = False, softmax: bool = False,
        other_act: str | None = None,
        squared_pred: bool = False, jaccard: bool = False,
        reduction: Reduction = "mean",
        smooth_nr: float = 1e-5, smooth_dr: float = 1e-5, batch: bool = False,
        weight: list[float] | float | None = None,
    ):
        super().__init__()
        _check_acts(sigmoid, softmax, other_act)
        _reduce(torch.zeros(()), reduction)  # validates the name
        self.include_background, self.sigmoid, self.softmax = include_background, sigmoid, softmax
        self.other_act: Callable | None = _activation(other_act)
        self.squared_pred, self.jaccard, self.batch = squared_pred, jaccard, batch
        self.reduction, self.smooth_nr, self.smooth_dr = reduction, float(smooth_nr), float(smooth_dr)
        _weight_buffer(self, "weight", weight)

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """Args: logits ``(B, C, *S)``; target int ``(B, *S)``/``(B, 1, *S)`` or float ``(B, C, *S)``."""
        with _no_autocast(logits):
            return self.from_dense(_fp32(logits), dense_target(logits, target))

    def from_dense(self, logits: Tensor, target: Tensor, mask: Tensor | None = None) -> Tensor:
        """Loss from float32 ``logits`` and a float32 ``target`` of the same ``(B, C, *S)`` shape;
        ``mask`` ``(B or 1, 1, *S)`` multiplies both after the activation (masked Dice)."""
        p = _activate(logits, self.sigmoid, self.softmax, self.other_act)
        if mask is not None:
            p, target = p * mask, target * mask
        if not self.include_background and p.shape[1] > 1:
            p, target = p[:, 1:], target[:, 1:]
        dims = _sum_dims(p, self.batch)
        inter = (p * target).sum(dims)
        if self.squared_pred:
            pred_sum, true_sum = (p * p).sum(dims), (target * target).sum(dims)
        else:
            pred_sum, true_sum = p.sum(dims), target.sum(dims)
        denom = pred_sum + true_sum
        if self.jaccard:
            denom = 2 * (denom - inter)
        loss = 1 - (2 * inter + self.smooth_nr) / (denom + self.smooth_dr)
        if self.weight is not None and p.shape[1] != 1:  # MONAI ignores weights for one channel
            loss = loss * _per_class(self.weight, p.shape[1], "dice weight")
        return _reduce_region(loss, self.reduction, p.dim())


@LOSSES.register("masked_dice")
class MaskedDiceLoss(DiceLoss):
    """Dice restricted to a spatial mask (``monai.losses.MaskedDiceLoss``): after the activation,
    prediction and target are multiplied by ``mask`` so only the masked region has gradients.

    Options as :class:`DiceLoss`. ``forward(logits, target, mask=None)`` with ``mask``
    ``(B, 1, *S)`` or ``(1, 1, *S)``; no mask gives plain Dice.
    """

    def forward(self, logits: Tensor, target: Tensor, mask: Tensor | None = None) -> Tensor:
        """Args: logits ``(B, C, *S)``; target as :class:`DiceLoss`; mask ``(B|1, 1, *S)`` 0/1."""
        if mask is not None:
            if mask.dim() != logits.dim() or mask.shape[1] != 1 or mask.shape[0] not in (1, logits.shape[0]):
                raise ValueError(f"mask must be (B or 1, 1, *S), got {tuple(mask.shape)} "
                                 f"for logits {tuple(logits.shape)}")
            mask = mask.float()
        with _no_autocast(logits):
            return self.from_dense(_fp32(logits), dense_target(logits, target), mask)


@LOSSES.register("generalized_dice")
class GeneralizedDiceLoss(nn.Module):
    """Generalized Dice loss (Sudre et al. 2017; ``monai.losses.GeneralizedDiceLoss``).

    ``1 - (2 sum_c w_c I_c + smooth_nr) / (sum_c w_c (P_c + G_c) + smooth_dr)`` with
    ``w_c = 1 / G_c ** 2`` (``square``), ``1 / G_c`` (``simple``) or 1 (``uniform``); a class
    absent from the target gets the largest finite weight of its item (of the batch with
    ``batch``), as MONAI.

    Args:
        include_background, sigmoid, softmax, other_act, smooth_nr, smooth_dr, batch: as
            :class:`DiceLoss`.
        w_type: ``square``, ``simple`` or ``uniform``.
        reduction: ``"mean"``, ``"sum"``, or ``"none"``: ``(B, 1, 1, ...)`` (``(1, ...)`` with
            ``batch``) as MONAI.
    """

    def __init__(self, *, include_background: bool = True, sigmoid: bool = False, softmax: bool = False,
                 other_act: str | None = None, w_type: Literal["square", "simple", "uniform"] = "square",
                 reduction: Reduction = "mean", smooth_nr: float = 1e-5, smooth_dr: float = 1e-5,
                 batch: bool = False):
        super().__init__()
        _check_acts(sigmoid, softmax, other_act)
        _reduce(torch.zeros(()), reduction)
        if w_type not in ("square", "simple", "uniform"):
            raise ValueError(f"w_type must be square, simple or uniform, got {w_type!r}")
        self.include_background, self.sigmoid, self.softmax = include_background, sigmoid, softmax
        self.other_act, self.w_type, self.reduction = _activation(other_act), w_type, reduction
        self.smooth_nr, self.smooth_dr, self.batch = float(smooth_nr), float(smooth_dr), batch

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """Args: logits ``(B, C, *S)``; target int ``(B, *S)``/``(B, 1, *S)`` or float ``(B, C, *S)``."""
        with _no_autocast(logits):
            p, t = _probs_and_target(self, logits, target)
            dims = _sum_dims(p, self.batch)
            inter, g = (p * t).sum(dims), t.sum(dims)
            denom = p.sum(dims) + g
            w = {"square": lambda v: 1 / (v * v), "simple": lambda v: 1 / v, "uniform": torch.ones_like}[self.w_type](g)
            infs = torch.isinf(w)
            w = torch.where(infs, 0.0, w)
            fill = w.max() if self.batch else w.max(dim=1, keepdim=True).values
            w = w + infs * fill
            red = 0 if self.batch else 1
            num = 2 * (inter * w).sum(red, keepdim=True) + self.smooth_nr
            den = (denom * w).sum(red, keepdim=True) + self.smooth_dr
            return _reduce_region(1 - num / den, self.reduction, p.dim())


@LOSSES.register("tversky")
class TverskyLoss(nn.Module):
    """Tversky loss ``1 - (TP + smooth_nr) / (TP + alpha FP + beta FN + smooth_dr)`` per channel
    (Salehi et al. 2017; ``monai.losses.TverskyLoss``). ``alpha = beta = 0.5`` is Dice.

    ``TP = sum(p g)``, ``FP = sum(p (1 - g))``, ``FN = sum((1 - p) g)`` over space (and batch with
    ``batch``).

    Args:
        include_background, sigmoid, softmax, other_act, smooth_nr, smooth_dr, batch: as
            :class:`DiceLoss`.
        alpha: weight of false positives.
        beta: weight of false negatives.
        reduction: ``"mean"``, ``"sum"``, or ``"none"``: ``(B, C')`` (``(C',)`` with ``batch``)
            as MONAI, which keeps no trailing singleton axes here.
    """

    def __init__(self, *, include_background: bool = True, sigmoid: bool = False, softmax: bool = False,
                 other_act: str | None = None, alpha: float = 0.5, beta: float = 0.5,
                 reduction: Reduction = "mean", smooth_nr: float = 1e-5, smooth_dr: float = 1e-5,
                 batch: bool = False):
        super().__init__()
        _check_acts(sigmoid, softmax, other_act)
        _reduce(torch.zeros(()), reduction)
        self.include_background, self.sigmoid, self.softmax = include_background, sigmoid, softmax
        self.other_act, self.alpha, self.beta = _activation(other_act), float(alpha), float(beta)
        self.reduction, self.batch = reduction, batch
        self.smooth_nr, self.smooth_dr = float(smooth_nr), float(smooth_dr)

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """Args: logits ``(B, C, *S)``; target int ``(B, *S)``/``(B, 1, *S)`` or float ``(B, C, *S)``."""
        with _no_autocast(logits):
            p, t = _probs_and_target(self, logits, target)
            dims = _sum_dims(p, self.batch)
            tp = (p * t).sum(dims)
            fp, fn = (p * (1 - t)).sum(dims), ((1 - p) * t).sum(dims)
            score = 1 - (tp + self.smooth_nr) / (tp + self.alpha * fp + self.beta * fn + self.smooth_dr)
            return _reduce(score, self.reduction)
