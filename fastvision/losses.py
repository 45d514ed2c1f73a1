"""Training losses for segmentation, detection and classification.

Dice, DiceCE, DiceFocal, Focal, CE and BCE modules follow MONAI's option names and semantics so a
MONAI recipe translates key for key; they are registered in ``LOSSES`` as ``dice``, ``dice_ce``,
``dice_focal``, ``focal``, ``ce`` and ``bce``. Functional ``sigmoid_focal_loss`` (detection) and
``label_smoothing_ce`` (classification) sit beside them.

Target convention for the modules (``forward(logits, target)``, logits ``(B, C, *S)``):

* integer class indices ``(B, *S)`` or ``(B, 1, *S)`` are one-hot encoded to ``C`` channels
  (MONAI's ``to_onehot_y=True``); with ``C == 1`` they are used as a 0/1 float map instead;
* a float target shaped like the logits is used as is (sigmoid / multi-label, e.g. BraTS regions).

Every loss is computed in float32 with autocast disabled: under fp16 the Dice sums over a whole
volume overflow and tiny denominators underflow, the usual source of "NaN with AMP" reports.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .registry import LOSSES

Reduction = Literal["mean", "sum", "none"]


def _fp32(x: Tensor) -> Tensor:
    return x.float() if x.dtype != torch.float32 and x.is_floating_point() else x


def _no_autocast(x: Tensor) -> torch.autocast:
    """A context that disables autocast on ``x``'s device so the loss runs in float32."""
    return torch.autocast(device_type=x.device.type, enabled=False)


def _reduce(x: Tensor, reduction: str) -> Tensor:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return x.mean() if reduction == "mean" else x.sum() if reduction == "sum" else x


def sigmoid_focal_loss(
    logits: Tensor, targets: Tensor, alpha: float = 0.25, gamma: float = 2.0, reduction: str = "sum"
) -> Tensor:
    """Focal loss on independent sigmoid outputs (Lin et al. 2017, RetinaNet / SSD heads).

    ``FL = alpha_t * (1 - p_t) ** gamma * BCE(logits, targets)`` with ``p = sigmoid(logits)``,
    ``p_t = p * t + (1 - p) * (1 - t)`` and ``alpha_t = alpha * t + (1 - alpha) * (1 - t)``.

    Args:
        logits: any shape, e.g. ``(N, K)`` anchors x classes; any float dtype (computed in float32).
        targets: same shape as ``logits``, values in [0, 1] (usually one-hot 0/1).
        alpha: weight of positives in (0, 1); a negative value disables the alpha weighting.
        gamma: focusing exponent; 0 gives plain (alpha-weighted) BCE.
        reduction: ``"sum"`` (detection normalises by the number of positives itself), ``"mean"``
            or ``"none"`` (elementwise, shaped like ``logits``).

    Returns:
        Scalar float32 tensor, or a tensor shaped like ``logits`` for ``reduction="none"``.
    """
    with _no_autocast(logits):
        t = targets.to(torch.float32)
        loss = _sigmoid_focal_terms(_fp32(logits), t, gamma)
        if alpha >= 0:
            loss = (alpha * t + (1 - alpha) * (1 - t)) * loss
        return _reduce(loss, reduction)


def _sigmoid_focal_terms(x: Tensor, t: Tensor, gamma: float) -> Tensor:
    """Elementwise ``(1 - p_t) ** gamma * BCE`` for float32 logits ``x`` and targets ``t``.

    The modulating factor is ``exp(gamma * logsigmoid(-x * (2t - 1)))``, which equals
    ``(1 - p_t) ** gamma`` for 0/1 targets but stays finite and exact at |logits| of 50+ where
    ``1 - sigmoid(x)`` rounds to 0 (the form MONAI uses, so soft targets also agree with it).
    """
    bce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
    if gamma == 0:
        return bce
    return torch.exp(gamma * F.logsigmoid(-x * (2 * t - 1))) * bce


def label_smoothing_ce(logits: Tensor, target: Tensor, smoothing: float) -> Tensor:
    """Mean cross entropy against labels smoothed uniformly over all classes (Szegedy et al. 2016).

    The target distribution is ``(1 - smoothing) * one_hot + smoothing / C``, the definition of
    ``F.cross_entropy(..., label_smoothing=smoothing)``; written out so the float32 cast is explicit.

    Args:
        logits: ``(B, C)`` (or ``(B, C, *S)``) class scores, any float dtype.
        target: ``(B,)`` (or ``(B, *S)``) int64 class indices.
        smoothing: probability mass in [0, 1) spread uniformly over the C classes.

    Returns:
        Scalar float32 tensor.
    """
    with _no_autocast(logits):
        logp = F.log_softmax(_fp32(logits), dim=1)
        nll = -logp.gather(1, target.unsqueeze(1)).squeeze(1)
        uniform = -logp.mean(dim=1)
        return ((1 - smoothing) * nll + smoothing * uniform).mean()


# ----------------------------------------------------------------------------------------------
# Target handling shared by the modules


def class_indices(logits: Tensor, target: Tensor) -> Tensor:
    """Integer target ``(B, *S)`` or ``(B, 1, *S)`` as ``(B, *S)`` int64 class indices."""
    if target.dim() == logits.dim():
        target = target.squeeze(1)
    return target.long()


def dense_target(logits: Tensor, target: Tensor) -> Tensor:
    """The target as a float32 tensor shaped like ``logits`` ``(B, C, *S)``.

    Integer indices are one-hot encoded by comparison with ``arange(C)`` rather than
    ``F.one_hot``, which may validate the value range (a device sync on CUDA). An index
    outside ``[0, C)`` therefore gives an all-zero row. With ``C == 1`` indices are a 0/1 map.
    """
    if target.is_floating_point():
        if target.shape != logits.shape:
            raise ValueError(f"float target shape {tuple(target.shape)} differs from logits {tuple(logits.shape)}")
        return target.float()
    idx = class_indices(logits, target)
    c = logits.shape[1]
    if c == 1:
        return idx.unsqueeze(1).float()
    classes = torch.arange(c, device=idx.device).view(1, c, *([1] * (idx.dim() - 1)))
    return (idx.unsqueeze(1) == classes).float()


def _weight_buffer(module: nn.Module, name: str, weight: list[float] | float | None) -> None:
    value = None if weight is None else torch.as_tensor(weight, dtype=torch.float32)
    if value is not None and (value < 0).any():
        raise ValueError(f"{name} must be non-negative, got {weight}")
    # non-persistent: the weights come from the recipe, not from a checkpoint
    module.register_buffer(name, value, persistent=False)


def _per_class(weight: Tensor, channels: int, what: str) -> Tensor:
    """A scalar or length-``channels`` weight as a ``(channels,)`` tensor."""
    if weight.dim() == 0:
        return weight.expand(channels)
    if weight.numel() != channels:
        raise ValueError(f"{what} has {weight.numel()} values but the loss sees {channels} channels")
    return weight


# ----------------------------------------------------------------------------------------------
# Modules (MONAI option names)


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
        squared_pred: square predictions and targets in the denominator.
        jaccard: soft IoU instead of Dice.
        reduction: ``"mean"`` or ``"sum"`` over batch and channels, or ``"none"`` for the
            ``(B, C')`` per-item, per-channel losses (``(C',)`` with ``batch``).
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
        squared_pred: bool = False, jaccard: bool = False,
        reduction: Reduction = "mean",
        smooth_nr: float = 1e-5, smooth_dr: float = 1e-5, batch: bool = False,
        weight: list[float] | float | None = None,
    ):
        super().__init__()
        if sigmoid and softmax:
            raise ValueError("choose at most one of sigmoid and softmax")
        _reduce(torch.zeros(()), reduction)  # validates the name
        self.include_background, self.sigmoid, self.softmax = include_background, sigmoid, softmax
        self.squared_pred, self.jaccard, self.batch = squared_pred, jaccard, batch
        self.reduction, self.smooth_nr, self.smooth_dr = reduction, float(smooth_nr), float(smooth_dr)
        _weight_buffer(self, "weight", weight)

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """Args: logits ``(B, C, *S)``; target int ``(B, *S)``/``(B, 1, *S)`` or float ``(B, C, *S)``."""
        with _no_autocast(logits):
            return self.from_dense(_fp32(logits), dense_target(logits, target))

    def from_dense(self, logits: Tensor, target: Tensor) -> Tensor:
        """Loss from float32 ``logits`` and a float32 ``target`` of the same ``(B, C, *S)`` shape."""
        c = logits.shape[1]
        if self.sigmoid:
            p = torch.sigmoid(logits)
        elif self.softmax and c > 1:
            p = torch.softmax(logits, dim=1)
        else:
            p = logits
        if not self.include_background and c > 1:
            p, target = p[:, 1:], target[:, 1:]
        dims = list(range(2, p.dim()))
        if self.batch:
            dims = [0] + dims
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
        return _reduce(loss, self.reduction)


@LOSSES.register("focal")
class FocalLoss(nn.Module):
    """Focal loss over channels (``monai.losses.FocalLoss``), sigmoid per channel or softmax.

    Args:
        include_background: keep channel 0; ignored when there is a single channel.
        gamma: focusing exponent.
        alpha: sigmoid: scalar weight of positives (negatives get ``1 - alpha``) or one weight per
            channel applied to positives only; softmax: scalar gives ``[1 - alpha, alpha, ...]``
            per class (ignored without background, as in MONAI) or one weight per class.
        weight: per-channel (or scalar) multiplier of the elementwise loss.
        reduction: ``"mean"`` over all elements; ``"sum"`` of per-channel spatial means (MONAI
            1.6's definition, so the value does not grow with image size); ``"none"``.
        use_softmax: softmax focal loss over classes instead of independent sigmoids.
    """

    def __init__(self, *, include_background: bool = True, gamma: float = 2.0, alpha: float | list[float] | None = None,
                 weight: list[float] | float | None = None, reduction: Reduction = "mean", use_softmax: bool = False):
        super().__init__()
        _reduce(torch.zeros(()), reduction)
        self.include_background, self.gamma = include_background, float(gamma)
        self.reduction, self.use_softmax = reduction, use_softmax
        _weight_buffer(self, "weight", weight)
        self.register_buffer("alpha", None if alpha is None else torch.as_tensor(alpha, dtype=torch.float32), persistent=False)

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """Args: logits ``(B, C, *S)``; target int ``(B, *S)``/``(B, 1, *S)`` or float ``(B, C, *S)``."""
        with _no_autocast(logits):
            return self.from_dense(_fp32(logits), dense_target(logits, target))

    def from_dense(self, x: Tensor, t: Tensor) -> Tensor:
        """Loss from float32 logits and a float32 target, both ``(B, C, *S)``."""
        if not self.include_background and x.shape[1] > 1:
            x, t = x[:, 1:], t[:, 1:]
        c, bshape = x.shape[1], (1, x.shape[1]) + (1,) * (x.dim() - 2)
        a = self.alpha
        if self.use_softmax:
            logp = F.log_softmax(x, dim=1)
            loss = -(1 - logp.exp()).pow(self.gamma) * logp * t
            if a is not None and a.dim() == 0:
                # scalar alpha weighs classes [1 - alpha, alpha, ...]: meaningless without background
                a = None if not self.include_background else torch.cat([1 - a.view(1), a.view(1).expand(c - 1)])
            if a is not None:
                loss = loss * _per_class(a, c, "focal alpha").view(bshape)
        else:
            loss = _sigmoid_focal_terms(x, t, self.gamma)
            if a is not None and a.dim() == 0:
                loss = (t * a + (1 - t) * (1 - a)) * loss
            elif a is not None:
                loss = torch.where(t == 1, _per_class(a, c, "focal alpha").view(bshape), 1.0) * loss
        if self.weight is not None:
            w = self.weight if self.weight.dim() == 0 else _per_class(self.weight, c, "focal weight").view(bshape)
            loss = loss * w
        if self.reduction == "sum":
            return loss.mean(dim=list(range(2, loss.dim()))).sum()
        return _reduce(loss, self.reduction)


@LOSSES.register("dice_ce")
class DiceCELoss(nn.Module):
    """``lambda_dice * Dice + lambda_ce * CE`` (``monai.losses.DiceCELoss``).

    The CE term sees raw logits: cross entropy over classes, or ``BCEWithLogits`` when there is one
    channel (MONAI's rule) and also when ``sigmoid`` is set with several channels. The latter is a
    deliberate difference from MONAI, whose softmax CE is wrong for overlapping multi-label
    targets such as BraTS regions.

    Args:
        include_background, sigmoid, softmax, squared_pred, jaccard, smooth_nr, smooth_dr, batch:
            as :class:`DiceLoss` (Dice term only).
        reduction: ``"mean"`` or ``"sum"`` for both terms.
        weight: one weight per class over all ``C`` channels: CE class weight (BCE ``pos_weight``);
            the Dice term gets it without channel 0 when ``include_background`` is false.
        lambda_dice: weight of the Dice term (>= 0).
        lambda_ce: weight of the CE term (>= 0).
        label_smoothing: CE label smoothing in [0, 1) (not applied to BCE).
    """

    def __init__(
        self,
        *,
        include_background: bool = True, sigmoid: bool = False, softmax: bool = False,
        squared_pred: bool = False, jaccard: bool = False,
        reduction: Literal["mean", "sum"] = "mean",
        smooth_nr: float = 1e-5, smooth_dr: float = 1e-5, batch: bool = False,
        weight: list[float] | None = None,
        lambda_dice: float = 1.0,
        lambda_ce: float = 1.0,
        label_smoothing: float = 0.0,
    ):
        super().__init__()
        if reduction not in ("mean", "sum"):
            raise ValueError(f"dice_ce reduction must be 'mean' or 'sum', got {reduction!r}")
        if lambda_dice < 0 or lambda_ce < 0:
            raise ValueError("lambda_dice and lambda_ce must be >= 0")
        dice_weight = weight[1:] if weight is not None and not include_background else weight
        self.dice = DiceLoss(include_background=include_background, sigmoid=sigmoid, softmax=softmax,
                             squared_pred=squared_pred, jaccard=jaccard, reduction=reduction, smooth_nr=smooth_nr,
                             smooth_dr=smooth_dr, batch=batch, weight=dice_weight)
        _weight_buffer(self, "weight", weight)
        self.reduction, self.sigmoid = reduction, sigmoid
        self.lambda_dice, self.lambda_ce, self.label_smoothing = float(lambda_dice), float(lambda_ce), float(label_smoothing)

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """Args: logits ``(B, C, *S)``; target int ``(B, *S)``/``(B, 1, *S)`` or float ``(B, C, *S)``."""
        with _no_autocast(logits):
            x = _fp32(logits)
            dense = dense_target(logits, target)
            dice = self.dice.from_dense(x, dense)
            c = x.shape[1]
            if c == 1 or self.sigmoid:
                pos_weight = None if self.weight is None else self.weight.view(-1, *([1] * (x.dim() - 2)))
                ce = F.binary_cross_entropy_with_logits(x, dense, pos_weight=pos_weight, reduction=self.reduction)
            else:
                ce_target = dense if target.is_floating_point() else class_indices(logits, target)
                ce = F.cross_entropy(
                    x, ce_target, weight=self.weight, reduction=self.reduction, label_smoothing=self.label_smoothing
                )
            return self.lambda_dice * dice + self.lambda_ce * ce


@LOSSES.register("dice_focal")
class DiceFocalLoss(nn.Module):
    """``lambda_dice * Dice + lambda_focal * Focal`` (``monai.losses.DiceFocalLoss``).

    As in MONAI the focal term is the sigmoid (per-channel) focal loss on raw logits whatever
    activation the Dice term uses; ``include_background``, ``weight``, ``reduction`` and ``alpha``
    apply to both terms, so ``weight`` has one value per channel kept.

    Args:
        include_background, sigmoid, softmax, squared_pred, jaccard, reduction, smooth_nr,
            smooth_dr, batch, weight: as :class:`DiceLoss`.
        gamma, alpha: as :class:`FocalLoss`.
        lambda_dice: weight of the Dice term (>= 0).
        lambda_focal: weight of the focal term (>= 0).
    """

    def __init__(
        self,
        *,
        include_background: bool = True, sigmoid: bool = False, softmax: bool = False,
        squared_pred: bool = False, jaccard: bool = False,
        reduction: Reduction = "mean",
        smooth_nr: float = 1e-5, smooth_dr: float = 1e-5, batch: bool = False,
        gamma: float = 2.0,
        weight: list[float] | float | None = None,
        lambda_dice: float = 1.0,
        lambda_focal: float = 1.0,
        alpha: float | None = None,
    ):
        super().__init__()
        if lambda_dice < 0 or lambda_focal < 0:
            raise ValueError("lambda_dice and lambda_focal must be >= 0")
        self.dice = DiceLoss(include_background=include_background, sigmoid=sigmoid, softmax=softmax,
                             squared_pred=squared_pred, jaccard=jaccard, reduction=reduction, smooth_nr=smooth_nr,
                             smooth_dr=smooth_dr, batch=batch, weight=weight)
        self.focal = FocalLoss(include_background=include_background, gamma=gamma, alpha=alpha, weight=weight,
                               reduction=reduction)
        self.lambda_dice, self.lambda_focal = float(lambda_dice), float(lambda_focal)

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """Args: logits ``(B, C, *S)``; target int ``(B, *S)``/``(B, 1, *S)`` or float ``(B, C, *S)``."""
        with _no_autocast(logits):
            x, dense = _fp32(logits), dense_target(logits, target)
            return self.lambda_dice * self.dice.from_dense(x, dense) + self.lambda_focal * self.focal.from_dense(x, dense)


@LOSSES.register("ce")
class CrossEntropyLoss(nn.Module):
    """Cross entropy over channel 1 in float32.

    Args:
        weight: one weight per class.
        label_smoothing: mass in [0, 1) spread uniformly over the classes.
        ignore_index: class index whose pixels do not contribute (integer targets only).
        reduction: ``"mean"`` (weighted mean over counted elements), ``"sum"`` or ``"none"``.
    """

    def __init__(self, *, weight: list[float] | None = None, label_smoothing: float = 0.0, ignore_index: int = -100,
                 reduction: Reduction = "mean"):
        super().__init__()
        _weight_buffer(self, "weight", weight)
        self.label_smoothing, self.ignore_index, self.reduction = float(label_smoothing), ignore_index, reduction

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """Args: logits ``(B, C, *S)`` or ``(B, C)``; target int ``(B, *S)``/``(B, 1, *S)``, or
        float class probabilities shaped like ``logits``."""
        with _no_autocast(logits):
            if not target.is_floating_point():
                target = class_indices(logits, target)
            return F.cross_entropy(
                _fp32(logits), target, weight=self.weight, ignore_index=self.ignore_index,
                reduction=self.reduction, label_smoothing=self.label_smoothing,
            )


@LOSSES.register("bce")
class BCEWithLogitsLoss(nn.Module):
    """Binary cross entropy on logits, one independent sigmoid per channel, in float32.

    Args:
        pos_weight: weight of positives, scalar or one value per channel.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
    """

    def __init__(self, *, pos_weight: list[float] | float | None = None, reduction: Reduction = "mean"):
        super().__init__()
        _weight_buffer(self, "pos_weight", pos_weight)
        self.reduction = reduction

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """Args: logits ``(B, C, *S)``; target int ``(B, *S)`` (0/1 map when ``C == 1``, else
        one-hot) or float shaped like ``logits``."""
        with _no_autocast(logits):
            pw = self.pos_weight
            if pw is not None and pw.dim() == 1:
                pw = pw.view(-1, *([1] * (logits.dim() - 2)))
            return F.binary_cross_entropy_with_logits(
                _fp32(logits), dense_target(logits, target), pos_weight=pw, reduction=self.reduction
            )
