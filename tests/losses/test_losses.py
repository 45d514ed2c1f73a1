"""Losses against independent references: hand-written formulas, torch.nn.functional, MONAI."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastvision.losses import sigmoid_focal_loss


def _softplus(x: float) -> float:
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def _focal_by_hand(x: float, t: float, alpha: float, gamma: float) -> float:
    # -log(p) = softplus(-x), -log(1 - p) = softplus(x), written out per element in float64
    p = 1.0 / (1.0 + math.exp(-x))
    if t == 1.0:
        w = alpha if alpha >= 0 else 1.0
        return w * (1 - p) ** gamma * _softplus(-x)
    w = (1 - alpha) if alpha >= 0 else 1.0
    return w * p**gamma * _softplus(x)


LOGITS = [[-2.0, 0.0, 3.0, 50.0], [1.0, -1.0, 0.5, -60.0]]
TARGETS = [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]]


@pytest.mark.parametrize("alpha,gamma", [(0.25, 2.0), (0.5, 0.0), (-1.0, 2.0), (0.75, 1.5)])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_sigmoid_focal_matches_hand_formula(alpha, gamma, reduction):
    x = torch.tensor(LOGITS)
    t = torch.tensor(TARGETS)
    want = torch.tensor([[_focal_by_hand(a, b, alpha, gamma) for a, b in zip(ra, rb, strict=True)]
                         for ra, rb in zip(LOGITS, TARGETS, strict=True)])
    got = sigmoid_focal_loss(x, t, alpha=alpha, gamma=gamma, reduction=reduction)
    want = {"sum": want.sum(), "mean": want.mean(), "none": want}[reduction]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)


def test_sigmoid_focal_half_input_is_finite_and_float32():
    x = torch.tensor(LOGITS, dtype=torch.float16, requires_grad=True)
    loss = sigmoid_focal_loss(x, torch.tensor(TARGETS))
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss) and torch.isfinite(x.grad).all()
    want = sum(_focal_by_hand(a, b, 0.25, 2.0)
               for ra, rb in zip(LOGITS, TARGETS, strict=True) for a, b in zip(ra, rb, strict=True))
    assert abs(loss.item() - want) < 1e-4 * want


# ----------------------------------------------------------------------------------------------
# Modules against MONAI (the independent reference implementation)

monai_losses = pytest.importorskip("monai.losses")

from fastvision.losses import (  # noqa: E402
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    DiceCELoss,
    DiceFocalLoss,
    DiceLoss,
    FocalLoss,
    label_smoothing_ce,
)
from fastvision.registry import LOSSES  # noqa: E402
from tests.conftest import monai_version  # noqa: E402


def _case(kind: str, shape: tuple[int, ...], seed: int = 0):
    """Logits (B, C, *S) plus our target and the equivalent MONAI target and to_onehot_y flag.

    kind: "index" -> int64 (B, *S) class indices (MONAI gets (B, 1, *S) + to_onehot_y=True);
          "float" -> 0/1 float target shaped like the logits (multi-label), passed to both as is.
    """
    g = torch.Generator().manual_seed(seed)
    b, c, *s = shape
    logits = 3 * torch.randn(shape, generator=g)
    if kind == "index":
        idx = torch.randint(0, c if c > 1 else 2, (b, *s), generator=g)
        idx[0, ...] = idx[0, ...].clamp(max=max(c - 2, 0))  # one item misses the last class entirely
        return logits, idx, idx.unsqueeze(1), c > 1
    t = torch.bernoulli(torch.full(shape, 0.3), generator=g)
    return logits, t, t.clone(), False


SHAPE2 = (3, 3, 6, 5)
SHAPE3 = (2, 3, 4, 5, 3)

DICE_CASES = [
    ("index", SHAPE2, dict(softmax=True)),
    ("index", SHAPE2, dict(softmax=True, include_background=False)),
    ("index", SHAPE2, dict(softmax=True, batch=True)),
    ("index", SHAPE2, dict(softmax=True, squared_pred=True)),
    ("index", SHAPE2, dict(softmax=True, jaccard=True)),
    ("index", SHAPE2, dict(softmax=True, jaccard=True, squared_pred=True, batch=True)),
    ("index", SHAPE2, dict(softmax=True, include_background=False, weight=[0.5, 2.0])),
    ("index", SHAPE2, dict(softmax=True, weight=[1.0, 0.2, 3.0], reduction="sum")),
    ("index", SHAPE2, dict(softmax=True, smooth_nr=0.0, smooth_dr=1e-6)),
    ("index", SHAPE2, dict(softmax=True, smooth_nr=0.5, smooth_dr=2.0, batch=True)),
    ("index", SHAPE2, dict(softmax=True, reduction="none")),
    ("index", (2, 1, 6, 5), dict(sigmoid=True)),
    ("float", SHAPE2, dict(sigmoid=True)),
    ("float", SHAPE2, dict(sigmoid=True, batch=True, squared_pred=True)),
    ("float", SHAPE3, dict(sigmoid=True, include_background=False, reduction="sum")),
    ("index", SHAPE3, dict(softmax=True)),
    ("index", SHAPE3, dict(softmax=True, include_background=False, batch=True, jaccard=True)),
]


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours.reshape(ref.shape).float(), ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,shape,opts", DICE_CASES)
def test_dice_matches_monai(kind, shape, opts):
    logits, target, ref_target, onehot = _case(kind, shape)
    ref = monai_losses.DiceLoss(to_onehot_y=onehot, **opts)(logits, ref_target)
    _close(DiceLoss(**opts)(logits, target), ref)


# reduction "none" is not defined for DiceCE; multi-channel sigmoid differs on purpose (test below)
DICE_CE_CASES = [(k, s, o) for k, s, o in DICE_CASES
                 if o.get("reduction") != "none" and not (k == "float" and s[1] > 1)]


@pytest.mark.parametrize("kind,shape,opts", DICE_CE_CASES)
def test_dice_ce_matches_monai(kind, shape, opts):
    c = shape[1]
    if "weight" in opts:  # DiceCE's weight covers all C classes (CE), Dice drops channel 0 itself
        opts = dict(opts, weight=[0.7, 1.5, 2.0][:c])
    opts = dict(opts, lambda_dice=0.7, lambda_ce=1.3)
    logits, target, ref_target, onehot = _case(kind, shape, seed=1)
    ref_opts = dict(opts, weight=torch.tensor(opts["weight"])) if "weight" in opts else opts
    ref = monai_losses.DiceCELoss(to_onehot_y=onehot, **ref_opts)(logits, ref_target)
    _close(DiceCELoss(**opts)(logits, target), ref)


def test_dice_ce_label_smoothing_matches_monai():
    logits, target, ref_target, _ = _case("index", SHAPE3, seed=2)
    opts = dict(softmax=True, include_background=False, label_smoothing=0.1, weight=[0.3, 1.0, 2.0])
    ref_opts = dict(opts, weight=torch.tensor(opts["weight"]))
    ref = monai_losses.DiceCELoss(to_onehot_y=True, **ref_opts)(logits, ref_target)
    _close(DiceCELoss(**opts)(logits, target), ref)


def test_dice_ce_multilabel_sigmoid_is_dice_plus_bce():
    logits, target, _, _ = _case("float", SHAPE3, seed=3)
    dice = monai_losses.DiceLoss(sigmoid=True, batch=True)(logits, target)
    bce = torch.nn.BCEWithLogitsLoss()(logits, target)
    _close(DiceCELoss(sigmoid=True, batch=True, lambda_ce=0.5)(logits, target), dice + 0.5 * bce)


FOCAL_CASES = [
    ("index", SHAPE2, dict()),
    ("index", SHAPE2, dict(gamma=0.0, alpha=0.25)),
    ("index", SHAPE2, dict(alpha=0.3, include_background=False, reduction="sum")),
    ("index", SHAPE2, dict(alpha=[0.2, 0.5, 0.8], weight=[1.0, 2.0, 0.5])),
    ("index", SHAPE2, dict(use_softmax=True, alpha=0.25)),
    ("index", SHAPE2, dict(use_softmax=True, alpha=[0.1, 0.6, 0.3], gamma=1.5, reduction="sum")),
    ("index", SHAPE2, dict(use_softmax=True, include_background=False, weight=[2.0, 0.5])),
    ("index", SHAPE2, dict(reduction="none", weight=0.5)),
    ("float", SHAPE3, dict(alpha=0.25, reduction="sum")),
    ("float", SHAPE3, dict(gamma=3.0, include_background=False)),
]


@pytest.mark.parametrize("kind,shape,opts", FOCAL_CASES)
def test_focal_matches_monai(kind, shape, opts):
    if isinstance(opts.get("alpha"), list) and monai_version() < (1, 5):
        pytest.skip("a per-class alpha: MONAI's FocalLoss takes a sequence from 1.5 on (1.4 raises inside it)")
    logits, target, ref_target, onehot = _case(kind, shape, seed=4)
    ref = monai_losses.FocalLoss(to_onehot_y=onehot, **opts)(logits, ref_target)
    _close(FocalLoss(**opts)(logits, target), ref)


DICE_FOCAL_CASES = [
    ("index", SHAPE2, dict(softmax=True)),
    ("index", SHAPE2, dict(softmax=True, include_background=False, gamma=1.0, alpha=0.25)),
    ("index", SHAPE2, dict(softmax=True, batch=True, weight=[1.0, 2.0, 0.5], lambda_focal=2.0)),
    ("float", SHAPE3, dict(sigmoid=True, squared_pred=True, batch=True)),
    ("float", SHAPE3, dict(sigmoid=True, reduction="sum", jaccard=True, lambda_dice=0.5)),
    ("index", (2, 1, 4, 4, 4), dict(sigmoid=True, alpha=0.75)),
]


@pytest.mark.parametrize("kind,shape,opts", DICE_FOCAL_CASES)
def test_dice_focal_matches_monai(kind, shape, opts):
    logits, target, ref_target, onehot = _case(kind, shape, seed=5)
    ref = monai_losses.DiceFocalLoss(to_onehot_y=onehot, **opts)(logits, ref_target)
    _close(DiceFocalLoss(**opts)(logits, target), ref)


def test_gradients_match_monai():
    logits, target, ref_target, _ = _case("index", SHAPE3, seed=6)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    DiceCELoss(softmax=True, include_background=False, squared_pred=True)(a, target).backward()
    monai_losses.DiceCELoss(to_onehot_y=True, softmax=True, include_background=False, squared_pred=True)(
        b, ref_target
    ).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7)


def test_target_with_channel_axis_equals_plain_indices():
    logits, target, _, _ = _case("index", SHAPE2, seed=7)
    loss = DiceCELoss(softmax=True)
    torch.testing.assert_close(loss(logits, target), loss(logits, target.unsqueeze(1)))


# ----------------------------------------------------------------------------------------------
# CE / BCE / label smoothing against torch.nn.functional


def test_label_smoothing_ce_equals_torch():
    g = torch.Generator().manual_seed(8)
    logits, target = 4 * torch.randn(6, 10, generator=g), torch.randint(0, 10, (6,), generator=g)
    want = F.cross_entropy(logits, target, label_smoothing=0.1)
    torch.testing.assert_close(label_smoothing_ce(logits, target, 0.1), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(label_smoothing_ce(logits.half(), target, 0.1), want, rtol=2e-3, atol=2e-3)


def test_ce_and_bce_wrappers_equal_torch():
    logits, target, _, _ = _case("index", SHAPE2, seed=9)
    w = torch.tensor([0.5, 1.0, 2.0])
    want = F.cross_entropy(logits, target, weight=w, label_smoothing=0.05)
    got = CrossEntropyLoss(weight=w.tolist(), label_smoothing=0.05)(logits, target.unsqueeze(1))
    torch.testing.assert_close(got, want)
    binary = logits[:, :1]
    mask = (target > 0).long()
    want = F.binary_cross_entropy_with_logits(binary, mask.unsqueeze(1).float(), pos_weight=torch.tensor([3.0]))
    torch.testing.assert_close(BCEWithLogitsLoss(pos_weight=3.0)(binary, mask), want)


# ----------------------------------------------------------------------------------------------
# float32 under autocast, registry


@pytest.mark.parametrize("name", ["dice", "dice_ce", "dice_focal", "focal", "ce", "bce"])
def test_registered_losses_run_in_float32_under_bf16_autocast(name):
    logits, target, _, _ = _case("index", SHAPE3, seed=10)
    opts = {"dice": {"softmax": True}, "dice_ce": {"softmax": True}, "dice_focal": {"softmax": True}}.get(name, {})
    loss = LOSSES.build(name, opts)
    x = logits.bfloat16().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss(x, target)
    out.backward()
    assert out.dtype == torch.float32 and out.dim() == 0 and torch.isfinite(out)
    torch.testing.assert_close(out, loss(x.detach().float(), target), rtol=1e-6, atol=1e-6)


def test_half_logits_on_large_volume_stay_finite():
    # 64**3 voxels: an fp16 sum over them overflows (max 65504); the loss must not
    g = torch.Generator().manual_seed(11)
    logits = (8 * torch.randn(1, 2, 64, 64, 64, generator=g)).half()
    target = torch.randint(0, 2, (1, 64, 64, 64), generator=g)
    got = DiceLoss(softmax=True, squared_pred=True)(logits, target)
    ref = monai_losses.DiceLoss(to_onehot_y=True, softmax=True, squared_pred=True)(logits.float(), target.unsqueeze(1))
    _close(got, ref)


def test_registry_rejects_unknown_and_mistyped_keys():
    from fastvision.errors import ConfigError

    with pytest.raises(ConfigError, match="lambda_dice"):
        LOSSES.build("dice_ce", {"lamda_dice": 1.0})
    with pytest.raises(ConfigError, match="gamma"):
        LOSSES.build("focal", {"gamma": "two"})
