"""Every loss's ``reduction="none"`` (values and shape), Tversky, generalized and masked Dice and
``other_act`` against MONAI; seed 000's Dice + BCE by hand."""
from __future__ import annotations

import pytest
import torch

from fastvision.losses import (
    DiceBCELoss,
    DiceFocalLoss,
    DiceLoss,
    FocalLoss,
    GeneralizedDiceLoss,
    MaskedDiceLoss,
    TverskyLoss,
)
from fastvision.registry import LOSSES
from tests.conftest import monai_version

monai_losses = pytest.importorskip("monai.losses")


def _data(shape, kind="index", seed=0):
    g = torch.Generator().manual_seed(seed)
    b, c, *s = shape
    logits = 3 * torch.randn(shape, generator=g)
    if kind == "index":
        idx = torch.randint(0, c, (b, *s), generator=g)
        idx[0] = idx[0].clamp(max=c - 2)  # item 0 has no voxel of the last class: an empty class
        return logits, idx, idx.unsqueeze(1), True
    t = torch.bernoulli(torch.full(shape, 0.3), generator=g)
    t[0, -1] = 0  # an empty channel
    return logits, t, t.clone(), False


def _same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert tuple(ours.shape) == tuple(ref.shape)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=1e-5, atol=1e-6)


S2, S3 = (3, 3, 6, 5), (2, 3, 4, 5, 3)
REGION = [  # (ours, monai, options)
    (DiceLoss, "DiceLoss", dict(softmax=True)),
    (DiceLoss, "DiceLoss", dict(softmax=True, include_background=False, batch=True)),
    (DiceLoss, "DiceLoss", dict(sigmoid=True, squared_pred=True, jaccard=True)),
    (GeneralizedDiceLoss, "GeneralizedDiceLoss", dict(softmax=True)),
    (GeneralizedDiceLoss, "GeneralizedDiceLoss", dict(softmax=True, w_type="simple", include_background=False)),
    (GeneralizedDiceLoss, "GeneralizedDiceLoss", dict(sigmoid=True, w_type="uniform", batch=True)),
    (GeneralizedDiceLoss, "GeneralizedDiceLoss", dict(softmax=True, batch=True)),
    (TverskyLoss, "TverskyLoss", dict(softmax=True, alpha=0.3, beta=0.7)),
    (TverskyLoss, "TverskyLoss", dict(sigmoid=True, include_background=False, batch=True, alpha=0.7, beta=0.3)),
    (FocalLoss, "FocalLoss", dict(gamma=2.0, alpha=0.25)),
    (FocalLoss, "FocalLoss", dict(use_softmax=True, include_background=False, weight=[1.0, 2.0])),
    (DiceFocalLoss, "DiceFocalLoss", dict(softmax=True, gamma=1.5)),
    (DiceFocalLoss, "DiceFocalLoss", dict(sigmoid=True, squared_pred=True, include_background=False, alpha=0.25)),
    (DiceFocalLoss, "DiceFocalLoss", dict(softmax=True, batch=True, weight=[1.0, 2.0, 0.5])),
]


@pytest.mark.parametrize("shape", [S2, S3])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("ours,ref_name,opts", REGION)
def test_losses_equal_monai_including_reduction_none(ours, ref_name, opts, reduction, shape):
    kind = "float" if opts.get("sigmoid") else "index"
    logits, target, ref_target, onehot = _data(shape, kind, seed=len(str(opts)))
    ref = getattr(monai_losses, ref_name)(to_onehot_y=onehot, reduction=reduction, **opts)(logits, ref_target)
    _same(ours(reduction=reduction, **opts)(logits, target), ref)


def test_dice_focal_none_when_channels_equal_last_axis():
    """The old bug: a (B, C) Dice added to (B, C, *S) focal lined up with the last image axis."""
    logits, target, ref_target, _ = _data((2, 4, 3, 4), seed=3)  # C == W == 4: no shape error to catch it
    ref = monai_losses.DiceFocalLoss(to_onehot_y=True, softmax=True, reduction="none")(logits, ref_target)
    _same(DiceFocalLoss(softmax=True, reduction="none")(logits, target), ref)


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("mask_batch", [1, 3])
def test_masked_dice_equals_monai(reduction, mask_batch):
    """MaskedDiceLoss with the activation before the mask (MONAI PR #8704, in 1.6.1; earlier releases softmax
    the zeroed logits, so masked voxels still count)."""
    if monai_version() < (1, 6):
        pytest.skip("MONAI before 1.6 masks before its softmax (MONAI PR #8704)")
    logits, target, ref_target, _ = _data(S2, seed=4)
    g = torch.Generator().manual_seed(5)
    mask = torch.bernoulli(torch.full((mask_batch, 1, *S2[2:]), 0.6), generator=g)
    opts = dict(softmax=True, include_background=False, reduction=reduction)
    ref = monai_losses.MaskedDiceLoss(to_onehot_y=True, **opts)(logits, ref_target, mask=mask)
    _same(MaskedDiceLoss(**opts)(logits, target, mask=mask), ref)
    _same(MaskedDiceLoss(**opts)(logits, target), DiceLoss(**opts)(logits, target))  # no mask: plain Dice


@pytest.mark.parametrize("name,act", [("tanh", torch.tanh), ("softplus", torch.nn.functional.softplus)])
@pytest.mark.parametrize("ours,ref_name", [(DiceLoss, "DiceLoss"), (GeneralizedDiceLoss, "GeneralizedDiceLoss"),
                                           (TverskyLoss, "TverskyLoss"), (DiceFocalLoss, "DiceFocalLoss")])
def test_other_act_by_name_equals_monai_callable(ours, ref_name, name, act):
    logits, target, ref_target, _ = _data(S2, kind="float", seed=6)
    ref = getattr(monai_losses, ref_name)(other_act=act, reduction="none")(logits, ref_target)
    _same(ours(other_act=name, reduction="none")(logits, target), ref)
    _same(ours(other_act=act, reduction="none")(logits, target), ref)


def test_other_act_in_dice_ce_and_recipe_errors():
    logits, target, ref_target, _ = _data(S2, seed=7)
    ref = monai_losses.DiceCELoss(to_onehot_y=True, other_act=torch.tanh)(logits, ref_target)
    _same(LOSSES.build("dice_ce", {"other_act": "tanh"})(logits, target), ref)
    with pytest.raises(ValueError, match="other_act"):
        DiceLoss(other_act="swish")
    with pytest.raises(ValueError, match="at most one"):
        DiceLoss(softmax=True, other_act="tanh")


def test_seed000_dice_bce_by_hand():
    """Seed 000 (TF): per foreground channel, mean BCE of the softmax over batch and voxels plus
    mean over the batch of 1 - 2I / (P + G + 1e-5); summed over the channels."""
    logits, target, _, _ = _data((2, 4, 3, 3, 2), seed=8)
    p = torch.softmax(logits.double(), 1)[:, 1:]
    g = torch.nn.functional.one_hot(target, 4).movedim(-1, 1).double()[:, 1:]
    total = 0.0
    for c in range(3):
        pc, gc = p[:, c].clamp(1e-7, 1 - 1e-7), g[:, c]
        total += float(-(gc * pc.log() + (1 - gc) * (1 - pc).log()).mean())
        for b in range(2):
            i = float((p[b, c] * g[b, c]).sum())
            total += (1 - 2 * i / (float(p[b, c].sum() + g[b, c].sum()) + 1e-5)) / 2
    got = DiceBCELoss()(logits, target)
    assert abs(float(got) - total) < 1e-5
    half = DiceBCELoss(lambda_dice=0.0)(logits, target)
    assert 0 < float(half) < float(got)


@pytest.mark.parametrize("name", ["masked_dice", "generalized_dice", "tversky", "dice_bce"])
def test_new_losses_registered_float32_under_bf16(name):
    logits, target, _, _ = _data(S3, seed=9)
    loss = LOSSES.build(name, {} if name == "dice_bce" else {"softmax": True})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss(logits.bfloat16(), target)
    assert out.dtype == torch.float32 and out.dim() == 0 and torch.isfinite(out)


def test_dice_ce_rejects_reduction_none_like_monai():
    """MONAI's DiceCELoss has no "none" (its CE and Dice shapes differ); neither has ours."""
    from fastvision.losses import DiceCELoss

    with pytest.raises(ValueError):
        monai_losses.DiceCELoss(reduction="none")
    with pytest.raises(ValueError, match="reduction"):
        DiceCELoss(reduction="none")
