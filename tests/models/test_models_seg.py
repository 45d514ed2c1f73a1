"""Segmentation models: layer factories, the one N-d U-Net and its variants, SegResNet.

References: hand-computed parameter counts from the seed layer plans (seeds 000 and 001), and
MONAI's ``UNet`` / ``SegResNet`` (equal parameter counts, and equal outputs once MONAI's weights
are copied into ours).
"""
from __future__ import annotations

import itertools
import re

import pytest
import torch
from monai.networks.nets import SegResNet as MonaiSegResNet
from monai.networks.nets import UNet as MonaiUNet
from torch import nn

from fastvision.errors import ConfigError
from fastvision.models import create_model, layers, list_models
from fastvision.registry import MODELS


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


# ---------------------------------------------------------------------------------------- layers
@pytest.mark.parametrize(
    "name,dims,cls",
    [("batch", 2, nn.BatchNorm2d), ("batch", 3, nn.BatchNorm3d), ("instance", 3, nn.InstanceNorm3d),
     ("instance", 2, nn.InstanceNorm2d), ("group", 3, nn.GroupNorm), ("none", 3, nn.Identity)],
)
def test_norm_factory(name, dims, cls):
    m = layers.norm(name, dims, 16)
    assert type(m) is cls
    if name == "instance":
        assert m.affine and not m.track_running_stats
    if name == "group":
        assert m.num_groups == 8 and m.num_channels == 16


@pytest.mark.parametrize(
    "name,x,expected",
    [("relu", -2.0, 0.0), ("leakyrelu", -2.0, -0.02), ("prelu", -2.0, -0.5), ("relu6", 9.0, 6.0),
     ("gelu", 1.0, 0.8413447), ("none", -2.0, -2.0)],
)
def test_act_factory(name, x, expected):
    y = layers.act(name)(torch.tensor([x]))
    assert y.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "dims,kernel,stride,transposed,size,out",
    [(2, 3, 1, False, 8, 8), (2, 3, 2, False, 8, 4), (3, 3, 2, False, 7, 4), (3, 2, 2, True, 4, 8),
     (3, 3, 2, True, 4, 8), (2, 1, 1, False, 5, 5)],
)
def test_conv_norm_act_shapes(dims, kernel, stride, transposed, size, out):
    m = layers.ConvNormAct(dims, 3, 5, kernel, stride, norm="instance", act="leakyrelu", transposed=transposed)
    y = m(torch.randn(2, 3, *(size,) * dims))
    assert y.shape == (2, 5, *(out,) * dims)
    assert m.conv.bias is None  # a norm follows: no bias by default


def test_factories_pick_dims():
    assert layers.conv(2) is nn.Conv2d and layers.conv(3) is nn.Conv3d
    assert layers.conv_transpose(3) is nn.ConvTranspose3d
    assert layers.pool("max", 3) is nn.MaxPool3d and layers.pool("avg", 2) is nn.AvgPool2d
    with pytest.raises(ValueError):
        layers.norm("group", 3, 12, groups=8)


# -------------------------------------------------------------------- every registered model
# (name, overrides, input shape, output channels); overrides keep 3-D nets small where they allow it
CASES = [
    ("unet", {}, (2, 1, 32, 32), 2),
    ("unet", {"up": "interp", "down": "stride", "norm": "group", "act": "gelu", "head_kernel": 3}, (1, 1, 16, 16), 2),
    ("unet", {"residual": True, "filters": (8, 16, 32), "dropout": 0.1, "in_channels": 3}, (2, 3, 16, 16), 2),
    ("unet", {"residual": True, "filters": (8, 16, 32), "down": "maxpool", "up": "interp"}, (1, 1, 16, 16), 2),
    ("unet2d", {"filters": (8, 16), "norm": "instance", "act": "prelu"}, (1, 1, 8, 8), 2),
    ("unet3d", {"filters": (4, 8, 16)}, (1, 1, 16, 16, 16), 2),
    ("unet2d-seed001", {}, (2, 1, 32, 48), 1),
    ("unet3d-nonewnet", {}, (1, 4, 64, 32, 32), 4),  # instance norm needs > 1 voxel at 1/32
    ("unet3d-nonewnet", {"norm": "group", "filters": (16, 32, 32)}, (1, 4, 8, 8, 8), 4),
    ("unet3d-spleen", {}, (1, 1, 32, 32, 32), 2),
    ("segresnet", {}, (1, 4, 16, 16, 16), 3),
    ("segresnet", {"upsample": "deconv", "spatial_dims": 2}, (2, 4, 16, 16), 3),
]
OURS = {"fastvision.models.unet", "fastvision.models.segresnet"}


def test_every_segmentation_model_has_a_case():
    ours = {n for n in list_models() if MODELS.get(n).__module__ in OURS}
    assert ours == {c[0] for c in CASES}


@pytest.mark.parametrize("name,kw,shape,out", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_forward_backward(name, kw, shape, out):
    torch.manual_seed(0)
    model = create_model(name, **kw)
    x = torch.randn(shape, requires_grad=True)
    y = model(x)
    assert y.shape == (shape[0], out, *shape[2:])
    y.square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name,shape", [("unet2d-seed001", (1, 1, 24, 24)), ("segresnet", (1, 4, 12, 12, 12))])
def test_indivisible_size_is_a_clear_error(name, shape):
    with pytest.raises(ValueError, match="divisible"):
        create_model(name)(torch.randn(shape))


@pytest.mark.parametrize(
    "kw,match", [({"bogus": 1}, "unknown key"), ({"filters": "wide"}, "filters"), ({"norm": "layer"}, "norm")]
)
def test_recipe_keys_are_checked(kw, match):
    with pytest.raises(ConfigError, match=match):
        create_model("unet3d-nonewnet", **kw)


# --------------------------------------------------------------- seed 001: hand-counted 2-D U-Net
def conv_p(cin, cout, k, dims, bias=True):
    return cin * cout * k**dims + (cout if bias else 0)


def test_seed001_parameter_count():
    f, dims, total = (8, 16, 32, 64, 128), 2, 0
    enc = (1, *f)
    for cin, cout in itertools.pairwise(enc):  # (conv3x3 + bias + BN(gamma, beta)) x2
        total += conv_p(cin, cout, 3, dims) + 2 * cout + conv_p(cout, cout, 3, dims) + 2 * cout
    for c_low, c in itertools.pairwise(f[::-1]):  # 2x2 up-conv c_low -> c, then block 2c -> c
        total += conv_p(c_low, c, 2, dims) + conv_p(2 * c, c, 3, dims) + 2 * c + conv_p(c, c, 3, dims) + 2 * c
    total += conv_p(8, 1, 1, dims)  # 1x1 head
    assert total == 487_145  # "about 0.49 M" in the seed notes
    assert n_params(create_model("unet2d-seed001")) == total


# --------------------------------------------------------------- seed 000: No New-Net channel plan
def test_nonewnet_channel_plan_and_parameter_count():
    m = create_model("unet3d-nonewnet")
    widths, dims = (32, 64, 128, 256, 320, 320), 3
    total, cin = 0, 4
    for level, (enc, w) in enumerate(zip(m.encoders, widths, strict=True)):
        convs = [c for c in enc.modules() if isinstance(c, nn.Conv3d)]
        assert [(c.in_channels, c.out_channels) for c in convs] == [(cin, w), (w, w)]
        assert convs[0].stride == ((1,) * 3 if level == 0 else (2,) * 3) and convs[1].stride == (1,) * 3
        assert all(c.kernel_size == (3,) * 3 and c.bias is None for c in convs)
        norms = [n for n in enc.modules() if isinstance(n, nn.InstanceNorm3d)]
        assert len(norms) == 2 and all(n.affine for n in norms)
        acts = [a for a in enc.modules() if isinstance(a, nn.LeakyReLU)]
        assert len(acts) == 2 and all(a.negative_slope == 0.01 for a in acts)
        total += conv_p(cin, w, 3, dims, False) + 2 * w + conv_p(w, w, 3, dims, False) + 2 * w
        cin = w
    assert not any(isinstance(x, (nn.MaxPool3d, nn.BatchNorm3d)) for x in m.modules())
    for level in range(5):  # decoder: up-conv from below, concat skip, two convs at this level's width
        w, below = widths[level], widths[level + 1]
        up = [c for c in m.ups[level].modules() if isinstance(c, nn.ConvTranspose3d)]
        assert len(up) == 1 and (up[0].in_channels, up[0].out_channels) == (below, w)
        assert up[0].kernel_size == (2,) * 3 and up[0].stride == (2,) * 3 and up[0].bias is not None
        assert not any(isinstance(x, (nn.InstanceNorm3d, nn.LeakyReLU)) for x in m.ups[level].modules())
        convs = [c for c in m.decoders[level].modules() if isinstance(c, nn.Conv3d)]
        assert [(c.in_channels, c.out_channels) for c in convs] == [(2 * w, w), (w, w)]
        total += conv_p(below, w, 2, dims)
        total += conv_p(2 * w, w, 3, dims, False) + 2 * w + conv_p(w, w, 3, dims, False) + 2 * w
    assert m.head.kernel_size == (3,) * 3 and (m.head.in_channels, m.head.out_channels) == (32, 4)
    total += conv_p(32, 4, 3, dims)
    assert n_params(m) == total == 31_196_196


@pytest.mark.parametrize("norm", ["instance", "instance_cl", "group"])
def test_nonewnet_norm_epsilon_is_the_seeds(norm):
    """Seed 000's instance / group norm (``tf.contrib.layers``) adds 1e-6 to the variance, not torch's
    1e-5: on a feature map of variance 1e-5 the two differ by a factor 1.35. Checked by hand on the
    first stage's first layer (conv -> norm -> leaky ReLU)."""
    torch.manual_seed(0)
    m = create_model("unet3d-nonewnet", filters=(16, 16), norm=norm).eval()
    layer = m.encoders[0][0]
    x = 3e-3 * torch.randn(1, 4, 8, 8, 8)  # a feature variance near 1e-6 after the conv: eps matters
    y = layer.conv(x)
    groups = 16 if norm == "group" else y.shape[1]
    g = y.reshape(1, groups, -1)
    ref = ((g - g.mean(-1, keepdim=True)) / torch.sqrt(g.var(-1, unbiased=False, keepdim=True) + 1e-6)).reshape(y.shape)
    norm_mod = layer.norm
    ref = ref * norm_mod.weight.view(1, -1, 1, 1, 1) + norm_mod.bias.view(1, -1, 1, 1, 1)
    ref = torch.nn.functional.leaky_relu(ref, 0.01)
    assert y.var(dim=(2, 3, 4)).max() < 1e-4  # the regime where 1e-5 and 1e-6 differ
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- against MONAI
def _copy_unet_from_monai(ours: nn.Module, theirs: nn.Module) -> None:
    """MONAI registers down_0 .. bottom, then up stages bottom-up: our encoders, then decoders reversed."""
    dst = [t for m in [*ours.encoders, *ours.decoders[::-1]] for t in m.state_dict().values()]
    src = list(theirs.state_dict().values())
    assert [t.shape for t in dst] == [t.shape for t in src]
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


@pytest.mark.parametrize(
    "dims,channels,kw,size",
    [(3, (32, 64, 128, 256, 512), {}, 32),  # the spleen net itself
     (2, (8, 16, 32), {"n_convs": 3, "norm": "instance", "act": "relu"}, 16),
     (3, (4, 8, 16), {"n_convs": 1}, 8)],
)
def test_residual_unet_matches_monai(dims, channels, kw, size):
    norm = kw.get("norm", "batch").upper()
    monai_kw = {"num_res_units": kw.get("n_convs", 2), "act": kw.get("act", "prelu").upper(), "dropout": 0.2,
                "norm": (norm, {"affine": True}) if norm == "INSTANCE" else norm}  # ours is always affine
    theirs = MonaiUNet(dims, 1, 2, channels, (2,) * (len(channels) - 1), **monai_kw)
    if dims == 3 and "n_convs" not in kw:
        ours = create_model("unet3d-spleen")
    else:
        ours = create_model("unet", spatial_dims=dims, filters=channels, residual=True, down="stride", up_kernel=3,
                            bias=True, dropout=0.2, **{"norm": "batch", "act": "prelu", **kw})
    assert n_params(ours) == n_params(theirs)
    _copy_unet_from_monai(ours, theirs)
    ours.eval(), theirs.eval()
    x = torch.randn(1, 1, *(size,) * dims)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def _segresnet_key(monai_key: str) -> str:
    k = monai_key.replace(".conv.", ".").replace(".deconv.", ".")
    for a, b in (("convInit.", "stem."), ("down_layers.", "down."), ("up_layers.", "up."), ("conv_final.", "head.")):
        if k.startswith(a):
            k = b + k[len(a):]
    # MONAI's first level starts with an Identity where the other levels have the stride-2 conv
    return re.sub(r"^down\.0\.(\d+)", lambda m: f"down.0.{int(m.group(1)) - 1}", k)


@pytest.mark.parametrize("dims,upsample,size", [(3, "nontrainable", 16), (3, "deconv", 8), (2, "nontrainable", 32)])
def test_segresnet_matches_monai(dims, upsample, size):
    theirs = MonaiSegResNet(dims, init_filters=16, in_channels=4, out_channels=3, dropout_prob=0.2,
                            blocks_down=(1, 2, 2, 4), blocks_up=(1, 1, 1), upsample_mode=upsample)
    ours = create_model("segresnet", spatial_dims=dims, upsample=upsample)
    assert n_params(ours) == n_params(theirs)
    if dims == 3 and upsample == "nontrainable":
        assert n_params(ours) == 4_702_227
    ours.load_state_dict({_segresnet_key(k): v for k, v in theirs.state_dict().items()})
    ours.eval(), theirs.eval()
    x = torch.randn(1, 4, *(size,) * dims)
    with torch.no_grad():
        y = ours(x)
        assert y.shape == (1, 3, *(size,) * dims)
        torch.testing.assert_close(y, theirs(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ channels_last
@pytest.mark.parametrize(
    "name,kw,shape",
    [("unet2d-seed001", {}, (2, 1, 16, 16)), ("unet3d-nonewnet", {"filters": (8, 16, 16)}, (1, 4, 8, 8, 8)),
     ("unet3d-spleen", {"filters": (8, 16, 32)}, (1, 1, 8, 8, 8)), ("segresnet", {"init_filters": 8}, (1, 4, 8, 8, 8))],
)
def test_channels_last_input(name, kw, shape):
    torch.manual_seed(0)
    model = create_model(name, **kw).eval()
    x = torch.randn(shape)
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    with torch.no_grad():
        ref = model(x)
        y = model(x.contiguous(memory_format=fmt))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    model.train()
    model(x.contiguous(memory_format=fmt)).mean().backward()


def test_residual_layout_rejects_strided_bottleneck():
    with pytest.raises(ConfigError, match=r"strides\[-1\] == 1"):
        create_model("unet", residual=True, filters=(8, 16), strides=(2, 2))
