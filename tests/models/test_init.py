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
