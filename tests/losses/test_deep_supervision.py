"""Deep supervision: nnU-Net's scale weights (hand-computed from ``nnUNetTrainer._build_loss``), the
targets at each scale (nnU-Net's ``DownsampleSegForDSTransform``: nearest-exact, by hand), and the
U-Net's outputs per decoder scale in training, the full-resolution one alone in eval."""
from __future__ import annotations

import pytest
import torch

from fastvision.errors import ConfigError
from fastvision.losses import DeepSupervisionLoss, DiceCELoss, deep_supervision_weights
from fastvision.losses.compound import downsample_target
from fastvision.models.unet import UNet


@pytest.mark.parametrize("n, expected", [
    (2, [1.0, 0.0]),
    (4, [8 / 14, 4 / 14, 2 / 14, 0.0]),  # 1, 1/2, 1/4, (1/8 -> 0); sum 1.75
    (5, [16 / 30, 8 / 30, 4 / 30, 2 / 30, 0.0]),
])
def test_weights_are_nnunets(n, expected):
    assert deep_supervision_weights(n) == pytest.approx(expected)


def test_target_downsampling_is_nearest_exact():
    label = torch.arange(2 * 8 * 6 * 4).reshape(2, 8, 6, 4) % 5
    # nearest-exact at half size reads voxel floor((k + 0.5) * 2) = 2k + 1
    assert torch.equal(downsample_target(label, (4, 3, 2)), label[:, 1::2, 1::2, 1::2])
    assert torch.equal(downsample_target(label, (2, 3, 2)), label[:, 2::4, 1::2, 1::2])  # quarter: 4k + 2
    masks = (label[:, None] == torch.arange(3).view(1, 3, 1, 1, 1)).float()  # float region masks (B, C, *S)
    assert torch.equal(downsample_target(masks, (4, 3, 2)), masks[..., 1::2, 1::2, 1::2])


def test_loss_is_the_weighted_sum_over_scales():
    base = DiceCELoss(softmax=True, include_background=False)
    g = torch.Generator().manual_seed(0)
    outs = [torch.randn(2, 3, 8, 8, 8, generator=g), torch.randn(2, 3, 4, 4, 4, generator=g),
            torch.randn(2, 3, 2, 2, 2, generator=g)]
    label = torch.randint(0, 3, (2, 8, 8, 8), generator=g)
    want = (4 / 6) * base(outs[0], label) + (2 / 6) * base(outs[1], label[:, 1::2, 1::2, 1::2])
    assert torch.allclose(DeepSupervisionLoss(base)(outs, label), want)
    assert torch.allclose(DeepSupervisionLoss(base)(outs[0], label), base(outs[0], label))  # one tensor: plain


def test_unet_outputs_every_decoder_scale_in_training_only():
    net = UNet(3, 1, 2, (4, 8, 16, 32), strides=(1, (2, 2, 1), 2, 2), norm="instance", deep_supervision=True)
    x = torch.randn(2, 1, 16, 16, 8)
    outs = net(x)
    assert [tuple(o.shape[2:]) for o in outs] == [(16, 16, 8), (8, 8, 8), (4, 4, 4)]
    DeepSupervisionLoss(DiceCELoss(softmax=True))(outs, torch.randint(0, 2, (2, 16, 16, 8))).backward()
    assert all(p.grad is not None for p in net.parameters())  # the zero-weight head too (DDP needs it)
    net.eval()
    assert net(x).shape == (2, 2, 16, 16, 8)


@pytest.mark.parametrize("kw, match", [
    ({"filters": (4, 8), "strides": (1, 2)}, "two decoder scales"),
    ({"filters": (4, 8), "residual": True, "strides": (2, 1)}, "two decoder scales"),  # residual: heads since #41
])
def test_deep_supervision_needs_decoder_scales(kw, match):
    with pytest.raises(ConfigError, match=rf"model\.args\.deep_supervision.*{match}"):
        UNet(3, 1, 2, deep_supervision=True, **kw)


def test_deep_supervision_on_a_model_without_it_names_the_key():
    from fastvision.models import create_model

    with pytest.raises(ConfigError, match=r"deep_supervision"):
        create_model("segresnet", deep_supervision=True)
