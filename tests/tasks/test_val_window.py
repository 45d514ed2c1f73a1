"""``task.args.val_window``: validation in one window per volume (or two halves in one batch), the volume
padded up to the model's divisor, against the plain sliding window and against the model run by hand on
the padded volume;
``predict`` keeps the recipe's window; bad values are one line naming the key."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastvision.errors import ConfigError
from fastvision.losses import DiceCELoss
from fastvision.models.unet import UNet
from fastvision.tasks.segment import SegmentationTask

WINDOW = {"roi_size": [48, 48, 32], "overlap": 0.25, "mode": "gaussian", "sw_batch_size": 4}


class Counting(nn.Module):
    """The wrapped model (reached through ``.module``, as DDP / EMA wrap it) and the windows it saw."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.module, self.shapes = net, []

    def forward(self, x):
        self.shapes += [tuple(x.shape[2:])] * x.shape[0]
        return self.module(x)


def _task(val_window, window=WINDOW) -> SegmentationTask:
    return SegmentationTask(num_classes=2, sample_shape=[1, 32, 32, 16], sliding_window=window,
                            val_window=val_window, loss=DiceCELoss(softmax=True))


def _unet() -> nn.Module:
    torch.manual_seed(0)
    return UNet(3, 1, 2, (2, 4, 8, 8, 8), residual=True).eval()  # divisor 16 on every axis


@torch.no_grad()
def test_whole_is_one_forward_of_the_padded_volume():
    net, x = Counting(_unet()), torch.randn(1, 1, 50, 50, 36)
    roi = _task("roi").eval_forward(net, {"image": x})
    assert net.shapes == [(48, 48, 32)] * 8  # 2 windows per axis (step 36 / 24)
    net.shapes.clear()
    whole = _task("whole").eval_forward(net, {"image": x})
    assert net.shapes == [(64, 64, 48)]  # 50, 50, 36 rounded up to 16
    # by hand: zeros padded symmetrically (7 / 7, 7 / 7, 6 / 6), one forward, cropped back
    want = net.module(F.pad(x, [6, 6, 7, 7, 7, 7]))[:, :, 7:57, 7:57, 6:42]
    assert torch.equal(whole, want)
    # a real U-Net sees other context at the window edges: same shape, logits differ there
    assert whole.shape == roi.shape and not torch.allclose(whole, roi, atol=1e-3)


@torch.no_grad()
def test_halves_are_two_windows_of_the_longest_axis_in_one_batch():
    net, x = Counting(_unet()), torch.randn(1, 1, 50, 50, 36)
    got = _task("halves").eval_forward(net, {"image": x})
    # X (the first of the two longest axes): 25 rounded up to 16 = 32, windows at 0 and 18; Y, Z whole
    assert net.shapes == [(32, 64, 48)] * 2
    xp = F.pad(x, [6, 6, 7, 7])  # Y 50 -> 64, Z 36 -> 48; X is not padded
    a, b = net.module(xp[:, :, 0:32]), net.module(xp[:, :, 18:50])
    want = torch.cat([a[:, :, :18], (a[:, :, 18:] + b[:, :, :14]) / 2, b[:, :, 14:]], dim=2)[:, :, :, 7:57, 6:42]
    assert torch.allclose(got, want, atol=1e-5)  # batch 2 against batch 1: other conv kernels, rounding


@torch.no_grad()
def test_whole_equals_the_sliding_window_where_the_volume_fits_one_window():
    net, x = _unet(), torch.randn(2, 1, 40, 37, 30)  # rounds up to 48, 48, 32: the recipe's window
    constant = {**WINDOW, "mode": "constant"}
    assert torch.equal(_task("whole", constant).eval_forward(net, {"image": x}),
                       _task("roi", constant).eval_forward(net, {"image": x}))


@torch.no_grad()
def test_a_pointwise_model_gives_the_same_logits_either_way():
    """Without spatial context only the windows' layout, blending and crop could differ: they do not."""
    net = nn.Conv3d(1, 2, 1)
    net.divisor = (16, 16, 16)
    x = torch.randn(1, 1, 70, 50, 36)
    for val_window in ("whole", "halves"):
        assert torch.allclose(_task(val_window).eval_forward(net, {"image": x}),
                              _task("roi").eval_forward(net, {"image": x}), atol=1e-5)


@pytest.mark.parametrize("cap, windows", [(200_000, 1), (196_608, 1), (196_607, 8), (100_000, 8)])
def test_a_voxel_count_takes_the_whole_volume_only_where_it_fits(cap, windows):
    net = Counting(_unet())
    with torch.no_grad():
        _task(cap).eval_forward(net, {"image": torch.randn(1, 1, 50, 50, 36)})  # whole: 64 * 64 * 48 = 196608
    assert len(net.shapes) == windows


def test_predict_keeps_the_recipes_window():
    from fastvision.inference.volumes import Ensemble

    net = Counting(_unet())
    Ensemble(_task("whole"), net, [], "cpu").probabilities(torch.randn(1, 50, 50, 36))
    assert net.shapes == [(48, 48, 32)] * 8


@pytest.mark.parametrize("bad", ["all", "", 0, -5, 1.5, True, None])
def test_bad_value_is_one_line_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"^task\.args\.val_window: .*valid: roi") as e:
        _task(bad)
    assert "\n" not in str(e.value)


def test_a_model_without_a_divisor_is_one_line():
    with pytest.raises(ConfigError, match=r"^task\.args\.val_window: Conv3d states no size divisor") as e:
        _task("whole").eval_forward(nn.Conv3d(1, 2, 1), {"image": torch.randn(1, 1, 8, 8, 8)})
    assert "\n" not in str(e.value)
