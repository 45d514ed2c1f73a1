"""Anisotropic networks: per-stage, per-axis kernels and strides (3x3x1 kernels, 2x2x1 pooling).

Reference: MONAI's ``UNet`` takes per-axis strides and a per-axis kernel; with the residual layout
our U-Net must have its parameter count and, with MONAI's weights copied in, its outputs.
"""
from __future__ import annotations

import pytest
import torch
from monai.networks.nets import UNet as MonaiUNet
from test_models_seg import _copy_unet_from_monai, n_params
from torch import nn

from fastvision.errors import ConfigError
from fastvision.inference.window import sliding_window
from fastvision.models import create_model


def test_residual_anisotropic_unet_matches_monai():
    strides = ((2, 2, 1), (2, 2, 1), (2, 2, 2))
    theirs = MonaiUNet(3, 1, 2, (4, 8, 16, 32), strides, kernel_size=(3, 3, 1), up_kernel_size=3,
                       num_res_units=2, act="PRELU", norm="BATCH")
    ours = create_model("unet", spatial_dims=3, filters=(4, 8, 16, 32), strides=[*strides, 1], kernel_size=(3, 3, 1),
                        residual=True, down="stride", up_kernel=3, bias=True, norm="batch", act="prelu")
    assert n_params(ours) == n_params(theirs)
    _copy_unet_from_monai(ours, theirs)
    ours.eval(), theirs.eval()
    x = torch.randn(1, 1, 16, 16, 6)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    assert ours.divisor == (8, 8, 2)


def test_classic_unet_per_stage_kernels_and_pooling():
    """nnU-Net's prostate-like plan: 3x3x1 kernels until the z-axis is pooled, 2x2x1 pooling first."""
    kernels = [[3, 3, 1], [3, 3, 1], [3, 3, 3], [3, 3, 3]]
    strides = [1, [2, 2, 1], [2, 2, 2], [2, 2, 2]]
    m = create_model("unet3d", in_channels=2, out_channels=3, filters=(4, 8, 16, 32), strides=strides,
                     kernel_size=kernels, norm="instance", act="leakyrelu")
    convs = [c for c in m.encoders.modules() if isinstance(c, nn.Conv3d)]
    assert [c.kernel_size for c in convs] == [(3, 3, 1)] * 4 + [(3, 3, 3)] * 4
    assert [c.padding for c in convs][:2] == [(1, 1, 0)] * 2
    pools = [p for p in m.encoders.modules() if isinstance(p, nn.MaxPool3d)]
    assert [tuple(p.kernel_size) for p in pools] == [(2, 2, 1), (2, 2, 2), (2, 2, 2)]
    ups = [u for u in m.ups.modules() if isinstance(u, nn.ConvTranspose3d)]
    assert [u.kernel_size for u in ups] == [(2, 2, 1), (2, 2, 2), (2, 2, 2)]  # kernel = stride, as nnU-Net
    assert m.divisor == (8, 8, 4)
    x = torch.randn(2, 2, 16, 16, 8)
    y = m(x)
    assert y.shape == (2, 3, 16, 16, 8)
    y.mean().backward()
    with pytest.raises(ValueError, match=r"divisible by \(8, 8, 4\)"):
        m(torch.randn(1, 2, 16, 16, 6))
    # the sliding window runs an anisotropic ROI over a volume of another shape
    m.eval()
    with torch.no_grad():
        out = sliding_window(m, torch.randn(1, 2, 20, 24, 10), (16, 16, 8), overlap=0.5)
    assert out.shape == (1, 3, 20, 24, 10)


@pytest.mark.parametrize("upsample", ["nontrainable", "deconv"])
def test_segresnet_anisotropic(upsample):
    m = create_model("segresnet", in_channels=2, out_channels=2, init_filters=8, blocks_down=(1, 1, 1),
                     blocks_up=(1, 1), strides=[[2, 2, 1], [2, 2, 2]], kernel_size=[[3, 3, 1], [3, 3, 3], [3, 3, 3]],
                     upsample=upsample, dropout_prob=0.0)
    assert m.divisor == (4, 4, 2)
    assert m.stem.kernel_size == (3, 3, 1) and m.down[1][0].stride == (2, 2, 1)
    y = m(torch.randn(1, 2, 8, 8, 4))
    assert y.shape == (1, 2, 8, 8, 4)
    y.mean().backward()
    with pytest.raises(ValueError, match="divisible"):
        m(torch.randn(1, 2, 8, 8, 3))


def test_bad_geometry_is_a_clear_error():
    with pytest.raises(ConfigError, match="model unet3d: .*one entry per spatial axis"):
        create_model("unet3d", filters=(4, 8), strides=[1, [2, 2]])
    with pytest.raises(ConfigError, match="one kernel or one per filter"):
        create_model("unet3d", filters=(4, 8, 16), kernel_size=[[3, 3, 1], [3, 3, 3]])
