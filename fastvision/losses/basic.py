"""Elementwise losses: sigmoid / softmax focal (Lin et al. 2017), cross entropy, BCE and label
smoothing, in float32 whatever the autocast dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastvision.errors import ConfigError
from fastvision.losses._common import (
    Reduction,
    _fp32,
    _no_autocast,
    _per_class,
    _reduce,
    _weight_buffer,
    class_indices,
    dense_target,
)
from fastvision.registry import LOSSES


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
        self.register_buffer("alpha", None if alpha is None else torch.as_tensor(alpha, dtype=torch.float32),
                             persistent=False)

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
        if not 0 <= label_smoothing <= 1:  # refused at build, before a run folder, not at the first step
            raise ConfigError(f"loss.args.label_smoothing={label_smoothing}: the probability mass spread over "
                              "the classes, 0 to 1 (seed 004: 0.1)")
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
