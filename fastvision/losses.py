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
    if reduction == "mean":
        return x.mean()
    if reduction == "sum":
        return x.sum()
    if reduction == "none":
        return x
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


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
        x = _fp32(logits)
        t = targets.to(torch.float32)
        bce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
        p = torch.sigmoid(x)
        p_t = p * t + (1 - p) * (1 - t)
        loss = bce * (1 - p_t).pow(gamma) if gamma != 0 else bce
        if alpha >= 0:
            loss = (alpha * t + (1 - alpha) * (1 - t)) * loss
        return _reduce(loss, reduction)
