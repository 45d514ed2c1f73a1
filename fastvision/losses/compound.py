"""Compound losses: DiceCE and DiceFocal (MONAI), and seed 000's Dice + BCE on activated outputs."""
from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn

from fastvision.losses._common import (
    Reduction,
    _fp32,
    _no_autocast,
    _weight_buffer,
    class_indices,
    dense_target,
)
from fastvision.losses.basic import FocalLoss
from fastvision.losses.dice import DiceLoss, _probs_and_target
from fastvision.registry import LOSSES


@LOSSES.register("dice_ce")
class DiceCELoss(nn.Module):
    """``lambda_dice * Dice + lambda_ce * CE`` (``monai.losses.DiceCELoss``).

    The CE term sees raw logits: cross entropy over classes, or ``BCEWithLogits`` when there is one
    channel (MONAI's rule) and also when ``sigmoid`` is set with several channels. The latter is a
    deliberate difference from MONAI, whose softmax CE is wrong for overlapping multi-label
    targets such as BraTS regions.

    Args:
        include_background, sigmoid, softmax, other_act, squared_pred, jaccard, smooth_nr,
            smooth_dr, batch: as :class:`DiceLoss` (Dice term only).
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
        other_act: str | None = None,
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
                             other_act=other_act, squared_pred=squared_pred, jaccard=jaccard, reduction=reduction,
                             smooth_nr=smooth_nr, smooth_dr=smooth_dr, batch=batch, weight=dice_weight)
        _weight_buffer(self, "weight", weight)
        self.reduction, self.sigmoid = reduction, sigmoid
        self.lambda_dice, self.lambda_ce = float(lambda_dice), float(lambda_ce)
        self.label_smoothing = float(label_smoothing)

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """Args: logits ``(B, C, *S)``; target int ``(B, *S)``/``(B, 1, *S)`` or float ``(B, C, *S)``."""
        c = logits.shape[1]
        if self.weight is not None and self.weight.numel() != c:  # before torch's "defined for all or no classes"
            raise ValueError(f"dice_ce weight has {self.weight.numel()} values but the logits have {c} channels: "
                             "one per class, background included")
        with _no_autocast(logits):
            x = _fp32(logits)
            dense = dense_target(logits, target)
            dice = self.dice.from_dense(x, dense)
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
        include_background, sigmoid, softmax, other_act, squared_pred, jaccard, smooth_nr,
            smooth_dr, batch, weight: as :class:`DiceLoss` (``other_act`` for the Dice term only).
        reduction: ``"mean"``, ``"sum"``, or ``"none"``: the Dice term ``(B, C', 1, ...)``
            broadcast onto the focal term ``(B, C', *S)``, as MONAI.
        gamma, alpha: as :class:`FocalLoss`.
        lambda_dice: weight of the Dice term (>= 0).
        lambda_focal: weight of the focal term (>= 0).
    """

    def __init__(
        self,
        *,
        include_background: bool = True, sigmoid: bool = False, softmax: bool = False,
        other_act: str | None = None,
        squared_pred: bool = False, jaccard: bool = False,
        reduction: Reduction = "mean",
        smooth_nr: float = 1e-5, smooth_dr: float = 1e-5, batch: bool = False,
        gamma: float = 2.0,
        weight: list[float] | float | None = None,
        lambda_dice: float = 1.0,
        lambda_focal: float = 1.0,
        alpha: float | list[float] | None = None,
    ):
        super().__init__()
        if lambda_dice < 0 or lambda_focal < 0:
            raise ValueError("lambda_dice and lambda_focal must be >= 0")
        self.dice = DiceLoss(include_background=include_background, sigmoid=sigmoid, softmax=softmax,
                             other_act=other_act, squared_pred=squared_pred, jaccard=jaccard, reduction=reduction,
                             smooth_nr=smooth_nr, smooth_dr=smooth_dr, batch=batch, weight=weight)
        self.focal = FocalLoss(include_background=include_background, gamma=gamma, alpha=alpha, weight=weight,
                               reduction=reduction)
        self.lambda_dice, self.lambda_focal = float(lambda_dice), float(lambda_focal)

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """Args: logits ``(B, C, *S)``; target int ``(B, *S)``/``(B, 1, *S)`` or float ``(B, C, *S)``."""
        with _no_autocast(logits):
            x, dense = _fp32(logits), dense_target(logits, target)
            return (self.lambda_dice * self.dice.from_dense(x, dense)
                    + self.lambda_focal * self.focal.from_dense(x, dense))


@LOSSES.register("dice_bce")
class DiceBCELoss(nn.Module):
    """Seed 000's ``dice+ce`` loss (NVIDIA 3D U-Net, ``model/losses.py``): binary cross entropy on
    the *activated* outputs plus soft Dice, each averaged over the batch and summed over channels.

    ``BCE_c = mean_{b, voxels} -[g log p + (1 - g) log(1 - p)]`` with ``p`` clipped to
    ``[1e-7, 1 - 1e-7]`` (Keras' ``binary_crossentropy``), ``Dice_c = mean_b 1 - (2 I + smooth_nr)
    / (P + G + smooth_dr)``; loss ``= lambda_bce * sum_c BCE_c + lambda_dice * sum_c Dice_c``. With
    ``softmax`` and ``include_background=False`` (the seed's default) both terms see only the
    foreground channels of the softmax, unlike :class:`DiceCELoss`, whose CE covers background.

    Args:
        include_background: keep channel 0.
        softmax: softmax over channels (the seed); ``sigmoid``: independent sigmoids.
        sigmoid: see ``softmax``; exactly one of them.
        smooth_nr: Dice numerator smoothing (the seed: 0).
        smooth_dr: Dice denominator smoothing (the seed: 1e-5).
        lambda_dice: weight of the Dice term.
        lambda_bce: weight of the BCE term.
    """

    def __init__(self, *, include_background: bool = False, softmax: bool = True, sigmoid: bool = False,
                 smooth_nr: float = 0.0, smooth_dr: float = 1e-5, lambda_dice: float = 1.0, lambda_bce: float = 1.0):
        super().__init__()
        if softmax == sigmoid:
            raise ValueError("dice_bce: set exactly one of softmax and sigmoid")
        if lambda_dice < 0 or lambda_bce < 0:
            raise ValueError("lambda_dice and lambda_bce must be >= 0")
        self.include_background, self.softmax, self.sigmoid = include_background, softmax, sigmoid
        self.other_act = None
        self.smooth_nr, self.smooth_dr = float(smooth_nr), float(smooth_dr)
        self.lambda_dice, self.lambda_bce = float(lambda_dice), float(lambda_bce)

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """Args: logits ``(B, C, *S)``; target int ``(B, *S)``/``(B, 1, *S)`` or float ``(B, C, *S)``."""
        with _no_autocast(logits):
            p, g = _probs_and_target(self, logits, target)
            pc = p.clamp(1e-7, 1 - 1e-7)
            bce = -(g * pc.log() + (1 - g) * (1 - pc).log())
            dims = list(range(2, p.dim()))
            bce = bce.mean([0, *dims]).sum()  # per channel over batch and space, summed
            inter, denom = (p * g).sum(dims), p.sum(dims) + g.sum(dims)
            dice = (1 - (2 * inter + self.smooth_nr) / (denom + self.smooth_dr)).mean(0).sum()
            return self.lambda_bce * bce + self.lambda_dice * dice


def deep_supervision_weights(n: int) -> list[float]:
    """nnU-Net's weights of ``n`` outputs, full resolution first: ``1 / 2**i``, the lowest output's
    set to 0, normalised to sum 1 (``nnUNetTrainer._build_loss``). ``n = 4`` -> 8/14, 4/14, 2/14, 0."""
    if n < 2:
        raise ValueError(f"deep supervision needs at least 2 outputs, got {n}")
    w = [1 / 2**i for i in range(n)]
    w[-1] = 0.0
    total = sum(w)
    return [v / total for v in w]


def downsample_target(target: Tensor, spatial: tuple[int, ...]) -> Tensor:
    """A label map at a lower decoder scale as nnU-Net's ``DownsampleSegForDSTransform``: nearest-exact
    interpolation of class indices ``(B, *S)`` / ``(B, 1, *S)`` or float region masks ``(B, C, *S)``."""
    if tuple(target.shape[-len(spatial):]) == tuple(spatial):
        return target
    squeeze = target.dim() == len(spatial) + 1
    x = target[:, None] if squeeze else target
    out = F.interpolate(x.float(), size=list(spatial), mode="nearest-exact").to(target.dtype)
    return out[:, 0] if squeeze else out


class DeepSupervisionLoss(nn.Module):
    """``sum_i w_i * loss(outputs[i], target at outputs[i]'s scale)`` (nnU-Net's ``DeepSupervisionWrapper``).

    Args:
        loss: the per-scale loss, ``loss(logits, target)``.
        weights: one per output, full resolution first; None: :func:`deep_supervision_weights`.
    """

    def __init__(self, loss: nn.Module, weights: list[float] | None = None):
        super().__init__()
        self.loss, self.weights = loss, None if weights is None else [float(w) for w in weights]

    def forward(self, outputs: list[Tensor] | Tensor, target: Tensor) -> Tensor:
        """Args: outputs ``[(B, C, *S_i)]`` (or one tensor: the plain loss); target at full resolution."""
        if isinstance(outputs, Tensor):
            return self.loss(outputs, target)
        weights = self.weights if self.weights is not None else deep_supervision_weights(len(outputs))
        if len(weights) != len(outputs):
            raise ValueError(f"{len(weights)} deep supervision weights for {len(outputs)} outputs")
        total = 0.0
        for w, out in zip(weights, outputs, strict=True):
            if w:
                total = total + w * self.loss(out, downsample_target(target, tuple(out.shape[2:])))
            else:  # nnU-Net's zero weight (lowest scale); a zero term keeps its head in the graph for DDP
                total = total + out.float().sum() * 0.0
        return total
