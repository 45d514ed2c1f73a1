"""``train.bn_momentum``: every batch norm's running statistics follow torch's update law with the
given momentum (checked against the statistics computed by hand), the built run carries it (the EMA's
copy too), and a bad value or a model without batch norm is one line naming the key, exit 2."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fastvision import config, engine
from fastvision.cli import main
from fastvision.engine.state import set_bn_momentum
from fastvision.errors import ConfigError
from tests.cli.test_cli_gaps import TINY, _one_line
from tests.data.test_data_contract import KINDS, RECIPES, _extra


def test_running_statistics_move_by_the_momentum():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.BatchNorm3d(3), nn.ReLU(), nn.BatchNorm3d(3))
    assert set_bn_momentum(net, 0.3) == 2
    x = torch.randn(2, 2, 4, 5, 6)
    mean0, var0 = net[1].running_mean.clone(), net[1].running_var.clone()
    with torch.no_grad():
        y = net[0](x)
        net(x)
    # torch's law: r <- (1 - m) r + m s, the batch mean and the unbiased batch variance per channel
    mean = y.mean(dim=(0, 2, 3, 4))
    var = y.transpose(0, 1).reshape(3, -1).var(dim=1, unbiased=True)
    torch.testing.assert_close(net[1].running_mean, 0.7 * mean0 + 0.3 * mean)
    torch.testing.assert_close(net[1].running_var, 0.7 * var0 + 0.3 * var)
    assert all(m.momentum == 0.3 for m in net.modules() if isinstance(m, nn.BatchNorm3d))


@pytest.mark.parametrize("momentum", [0.0, -0.1, 1.5])
def test_momentum_outside_the_unit_interval_is_refused(momentum):
    with pytest.raises(ConfigError, match=r"train.bn_momentum must be in \(0, 1\]"):
        set_bn_momentum(nn.Sequential(nn.BatchNorm2d(2)), momentum)


def test_a_model_without_batch_norm_is_refused():
    with pytest.raises(ConfigError, match="train.bn_momentum: Sequential has no batch norm"):
        set_bn_momentum(nn.Sequential(nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2, affine=True)), 0.3)


def test_the_built_run_and_its_ema_carry_the_momentum(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "cache"))
    kind = RECIPES["unet3d-spleen-fast"][0]
    from fastvision.data.synth import load_all

    data = load_all().get(kind)(tmp_path / kind, seed=0, **KINDS[kind])
    cfg = config.load("unet3d-spleen-fast", _extra("unet3d-spleen-fast", data, "data.cache=none",
                                                   "train.bn_momentum=0.5", "train.ema_decay=0.9"))
    run = engine.build(cfg, train=True)
    norms = [m for m in run.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    ema = [m for m in run.step.ema.module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms and len(ema) == len(norms) and {m.momentum for m in norms + ema} == {0.5}
    default = engine.build(config.load("unet3d-spleen-fast", _extra("unet3d-spleen-fast", data, "data.cache=none")),
                           train=True)
    assert {m.momentum for m in default.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)} == {0.1}


def test_a_recipe_without_batch_norm_fails_at_build(tmp_path, monkeypatch):
    """unet3d-brats (seed 000's instance norm): the key would do nothing, so the build refuses it."""
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "cache"))
    kind = RECIPES["unet3d-brats"][0]
    from fastvision.data.synth import load_all

    data = load_all().get(kind)(tmp_path / kind, seed=0, **KINDS[kind])
    cfg = config.load("unet3d-brats", _extra("unet3d-brats", data, "data.cache=none", "train.bn_momentum=0.3"))
    with pytest.raises(ConfigError, match="train.bn_momentum: .* has no batch norm"):
        engine.build(cfg, train=True)


@pytest.mark.usefixtures("fresh_logging")
def test_cli_bad_momentum_is_one_line_exit_2(tiny_microscopy, tmp_path, capsys):
    argv = ["train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(tmp_path / "r"), *TINY,
            "--set", "train.bn_momentum=2"]
    _one_line(main(argv), capsys.readouterr().err, "train.bn_momentum must be in (0, 1]", "got 2")
    assert not (tmp_path / "r" / "checkpoints").exists()
