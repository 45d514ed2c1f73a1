"""Training losses for segmentation, detection and classification.

The modules follow MONAI's option names and semantics so a MONAI recipe translates key for key,
``reduction="none"`` shapes included; they are registered in ``LOSSES`` as ``dice``,
``masked_dice``, ``generalized_dice``, ``tversky``, ``dice_ce``, ``dice_focal``, ``focal``, ``ce``,
``bce``, plus seed 000's ``dice_bce``. Functional ``sigmoid_focal_loss`` (detection) and
``label_smoothing_ce`` (classification) sit beside them.

Target convention for the modules (``forward(logits, target)``, logits ``(B, C, *S)``):

* integer class indices ``(B, *S)`` or ``(B, 1, *S)`` are one-hot encoded to ``C`` channels
  (MONAI's ``to_onehot_y=True``); with ``C == 1`` they are used as a 0/1 float map instead;
* a float target shaped like the logits is used as is (sigmoid / multi-label, e.g. BraTS regions).

Every loss is computed in float32 with autocast disabled: under fp16 the Dice sums over a whole
volume overflow and tiny denominators underflow, the usual source of "NaN with AMP" reports.

Layout: ``_common`` (helpers), ``dice`` (region losses), ``basic`` (elementwise losses),
``compound`` (sums of the two).
"""
from __future__ import annotations

from fastvision.losses._common import ACTIVATIONS, class_indices, dense_target
from fastvision.losses.basic import (
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    FocalLoss,
    label_smoothing_ce,
    sigmoid_focal_loss,
)
from fastvision.losses.compound import (
    DeepSupervisionLoss,
    DiceBCELoss,
    DiceCELoss,
    DiceFocalLoss,
    deep_supervision_weights,
)
from fastvision.losses.dice import (
    DiceLoss,
    GeneralizedDiceLoss,
    MaskedDiceLoss,
    TverskyLoss,
)

__all__ = [
    "ACTIVATIONS", "BCEWithLogitsLoss", "CrossEntropyLoss", "DeepSupervisionLoss", "DiceBCELoss", "DiceCELoss",
    "DiceFocalLoss",
    "DiceLoss", "FocalLoss", "GeneralizedDiceLoss", "MaskedDiceLoss", "TverskyLoss", "class_indices",
    "deep_supervision_weights", "dense_target", "label_smoothing_ce", "sigmoid_focal_loss",
]
