"""``model.args.init: he``: nnU-Net's ``InitWeights_He(1e-2)`` on the U-Net's convs."""
import math

import pytest
import torch
from torch import nn

from fastvision.errors import ConfigError
from fastvision.models import create_model


def test_he_init_std_matches_kaimings_formula_and_zeroes_biases():
    torch.manual_seed(0)
    m = create_model("unet3d", in_channels=2, out_channels=3, filters=(32, 64, 128), init="he", bias=True,
                     norm="instance", act="leakyrelu")
    convs = [x for x in m.modules() if isinstance(x, (nn.Conv3d, nn.ConvTranspose3d))]
    assert convs and all(c.bias is None or not c.bias.any() for c in convs)
    # a 3x3x3 conv from 64 to 64 channels: fan_in = 64 * 27 = 1728; gain sqrt(2 / (1 + 0.01^2))
    c = next(c for c in convs if isinstance(c, nn.Conv3d) and c.weight.shape == (64, 64, 3, 3, 3))
    want = math.sqrt(2 / (1 + 0.01 ** 2) / 1728)
    assert c.weight.std().item() == pytest.approx(want, rel=0.03)  # 110592 draws: std error about 0.2 %
    assert abs(c.weight.mean().item()) < 0.05 * want
    # PyTorch's default (kaiming_uniform a=sqrt(5)) is std 1 / sqrt(3 fan_in): clearly different
    default = create_model("unet3d", in_channels=2, out_channels=3, filters=(32, 64, 128))
    d = next(c for c in default.modules() if isinstance(c, nn.Conv3d) and c.weight.shape == (64, 64, 3, 3, 3))
    assert d.weight.std().item() == pytest.approx(1 / math.sqrt(3 * 1728), rel=0.03)


def test_bad_init_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as e:
        create_model("unet3d", filters=(8, 16), init="kaiming")
    msg = str(e.value)
    assert msg.startswith("model.args.init: 'kaiming'") and "he" in msg and "\n" not in msg


def test_he_heads_draws_he_on_the_logit_heads_only_and_leaves_every_other_draw_as_default():
    kw = dict(in_channels=1, out_channels=3, filters=(32, 64, 128, 256), norm="instance", act="leakyrelu",
              deep_supervision=True)
    torch.manual_seed(0)
    base = create_model("unet3d", **kw)
    after_base = torch.rand(4)  # the next draw of the global stream after building
    torch.manual_seed(0)
    heads = create_model("unet3d", init="he_heads", **kw)
    assert torch.equal(torch.rand(4), after_base)  # drawn on a fork: later draws are the default run's
    head_names = {n for n, _ in heads.named_parameters() if n.startswith(("head.", "ds_heads."))}
    assert head_names == {"head.weight", "head.bias", "ds_heads.0.weight", "ds_heads.0.bias",
                          "ds_heads.1.weight", "ds_heads.1.bias"}
    b = dict(base.named_parameters())
    for n, p in heads.named_parameters():
        if n not in head_names:
            assert torch.equal(p, b[n]), n  # the body keeps PyTorch's initialisation, draw for draw
        elif n.endswith("bias"):
            assert not p.any()
    # the 1x1 heads: fan_in = width; He std sqrt(2 / (1 + 0.01^2) / fan_in), PyTorch's 1 / sqrt(3 fan_in)
    for name, fan_in in (("head.weight", 32), ("ds_heads.0.weight", 64), ("ds_heads.1.weight", 128)):
        w = dict(heads.named_parameters())[name].detach().flatten()
        he = math.sqrt(2 / (1 + 0.01 ** 2) / fan_in)
        sample_sd = w.std().item()  # 3 * fan_in draws: within 35 % of the formula, far from the default's 0.41x
        assert 0.65 * he < sample_sd < 1.35 * he, (name, sample_sd, he)
        assert not torch.equal(w, b[name].detach().flatten())


def test_he_heads_on_the_residual_layout_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as e:
        create_model("unet", spatial_dims=3, filters=(8, 16, 32), residual=True, init="he_heads")
    msg = str(e.value)
    assert msg.startswith("model.args.init: he_heads") and "residual" in msg and "\n" not in msg
