"""Cheaper segmentation validation: the two-class argmax as one compare, the validation loss optional;
the reported metrics stay bit-identical."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fastvision.engine.loop import check_target_metric
from fastvision.errors import ConfigError
from fastvision.losses import DiceCELoss
from fastvision.tasks.seg_eval import foreground_of_two
from fastvision.tasks.segment import SegmentationTask

NAN = math.nan


def test_foreground_of_two_is_the_argmax_ties_and_nan_included():
    # (background, foreground) logits: argmax takes the first of ties and a NaN as the largest
    pairs = [(1.0, 2.0), (2.0, 1.0), (1.0, 1.0), (NAN, 1.0), (1.0, NAN), (NAN, NAN), (-0.0, 0.0)]
    logits = torch.tensor(pairs).T.reshape(1, 2, len(pairs))
    assert foreground_of_two(logits)[0].tolist() == [True, False, False, False, True, False, False]
    assert torch.equal(foreground_of_two(logits), logits.argmax(1) == 1)
    x = torch.randn(3, 2, 6, 5, 4).half()
    x[0, :, 0] = x[0, 1, 0]  # ties
    assert torch.equal(foreground_of_two(x), x.argmax(1) == 1)


def _case(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 2, 8, 8, 6, generator=g)
    label = (torch.rand(2, 8, 8, 6, generator=g) > 0.6).long()
    return logits, {"label": label}


class _Never(nn.Module):
    def forward(self, *a):
        raise AssertionError("the validation loss was computed")


def test_metrics_bit_identical_to_the_argmax_path_and_without_the_loss():
    """Two classes scored by the compare equal the argmax path's scores (the same logits with a third,
    never-winning class take the general path: class 1's scores are the same cases and voxels)."""
    batches = [_case(s) for s in range(3)]
    two = SegmentationTask(num_classes=2, loss=DiceCELoss(softmax=True, include_background=False))
    three = SegmentationTask(num_classes=3, loss=DiceCELoss(softmax=True, include_background=False))
    cheap = SegmentationTask(num_classes=2, val_loss=False, loss=_Never())
    evs = [t.evaluator() for t in (two, three, cheap)]
    for logits, batch in batches:
        evs[0].update(logits, batch)
        evs[1].update(torch.cat([logits, torch.full_like(logits[:, :1], -1e9)], 1), batch)
        evs[2].update(logits, batch)
    a, b, c = (ev.compute() for ev in evs)
    for key in ("dice", "iou"):
        assert a[key] == b[f"{key}/1"] and a[f"{key}_pooled"] == b[f"{key}_pooled/1"]
    assert "val_loss" not in c and c == {k: v for k, v in a.items() if k != "val_loss"}
    assert math.isfinite(a["val_loss"])
    # by hand, one case: truth 3 voxels, predicted 2 of them plus 1 more -> Dice 2*2 / (2*2 + 1 + 1)
    ev = cheap.evaluator()
    label = torch.tensor([[1, 1, 1, 0, 0]])
    logits = torch.tensor([[[0.0, 0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0, 1.0]]])  # the tie -> background
    ev.update(logits, {"label": label})
    assert ev.compute()["dice"] == pytest.approx(4 / 6, abs=1e-9)


def test_val_loss_off_refuses_a_val_loss_target_and_bad_values():
    cheap = SegmentationTask(num_classes=2, val_loss=False, loss=_Never())
    check_target_metric(cheap, "dice=0.9")
    with pytest.raises(ConfigError, match="val_loss"):
        check_target_metric(cheap, "val_loss=0.3")
    with pytest.raises(ConfigError, match=r"task\.args\.val_loss"):
        SegmentationTask(num_classes=2, val_loss="no", loss=_Never())
