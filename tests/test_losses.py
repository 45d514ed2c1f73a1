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
    want = torch.tensor([[_focal_by_hand(a, b, alpha, gamma) for a, b in zip(ra, rb)] for ra, rb in zip(LOGITS, TARGETS)])
    got = sigmoid_focal_loss(x, t, alpha=alpha, gamma=gamma, reduction=reduction)
    want = {"sum": want.sum(), "mean": want.mean(), "none": want}[reduction]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)


def test_sigmoid_focal_half_input_is_finite_and_float32():
    x = torch.tensor(LOGITS, dtype=torch.float16, requires_grad=True)
    loss = sigmoid_focal_loss(x, torch.tensor(TARGETS))
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss) and torch.isfinite(x.grad).all()
    want = sum(_focal_by_hand(a, b, 0.25, 2.0) for ra, rb in zip(LOGITS, TARGETS) for a, b in zip(ra, rb))
    assert abs(loss.item() - want) < 1e-4 * want
