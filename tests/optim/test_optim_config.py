"""Schedules, parameter groups and Novograd against hand-computed values and MONAI; strict config."""
from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from torch import nn

from fastvision import config
from fastvision.config import OptimConfig, SchedConfig
from fastvision.errors import ConfigError
from fastvision.optim import (
    Novograd,
    build_optimizer,
    effective_lr,
    lr_lambda,
    param_groups,
)


@pytest.mark.parametrize("base,glob,ref,expected", [
    (1e-3, 16, 16, 1e-3), (1e-3, 128, 16, 8e-3), (0.1, 64, 256, 0.025), (2e-4, 224, 16, 2.8e-3)])
def test_effective_lr_linear_scaling(base, glob, ref, expected):
    """The linear scaling rule (Goyal et al.) as training applies it, hand-computed."""
    assert effective_lr(OptimConfig(lr=base, ref_batch=ref), glob) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("glob,ref", [(0, 16), (16, 0), (-4, 16)])
def test_effective_lr_rejects_nonpositive(glob, ref):
    with pytest.raises(ConfigError):
        effective_lr(OptimConfig(lr=1e-3, ref_batch=ref), glob)


@pytest.mark.parametrize("step,expected", [(0, 0.1), (5, 0.55), (10, 1.0), (50, 1.0)])
def test_warmup_ramp(step, expected):
    """Linear warm-up from 0.1 to 1.0 over 10 steps, then constant: the schedule fit runs."""
    fn = lr_lambda(SchedConfig(name="constant", warmup_epochs=10, warmup_start_factor=0.1), steps_per_epoch=1,
                   epochs=100)
    assert fn(step) == pytest.approx(expected)


@pytest.mark.parametrize("sched,step,expected", [
    # 10 steps/epoch, 10 epochs = 100 steps; 2 warm-up epochs = 20 steps from factor 0.1
    ({"name": "cosine", "warmup_epochs": 2, "warmup_start_factor": 0.1}, 0, 0.1),
    ({"name": "cosine", "warmup_epochs": 2, "warmup_start_factor": 0.1}, 10, 0.1 + 0.9 * 10 / 20),
    ({"name": "cosine", "warmup_epochs": 2, "warmup_start_factor": 0.1}, 20, 1.0),
    ({"name": "cosine", "warmup_epochs": 2, "warmup_start_factor": 0.1}, 60, 0.5),  # halfway through 80
    ({"name": "cosine", "min_lr_factor": 0.1}, 100, 0.1),
    ({"name": "step", "milestones": [3, 6], "gamma": 0.1}, 29, 1.0),
    ({"name": "step", "milestones": [3, 6], "gamma": 0.1}, 30, 0.1),
    ({"name": "step", "milestones": [3, 6], "gamma": 0.1}, 65, 0.01),
    ({"name": "poly", "power": 2.0}, 50, 0.25),
    # seed 000's piecewise schedule: [lr/4, lr, lr/5, lr/20] at [S/2, S/2, 3S/4] (the lr segment never runs)
    ({"name": "piecewise", "milestones": [5, 5, 7.5], "factors": [0.25, 1, 0.2, 0.05]}, 49, 0.25),
    ({"name": "piecewise", "milestones": [5, 5, 7.5], "factors": [0.25, 1, 0.2, 0.05]}, 50, 0.2),
    ({"name": "piecewise", "milestones": [5, 5, 7.5], "factors": [0.25, 1, 0.2, 0.05]}, 75, 0.05),
    ({"name": "constant"}, 99, 1.0),
])
def test_schedule_multiplier(sched, step, expected):
    fn = lr_lambda(SchedConfig(**sched), steps_per_epoch=10, epochs=10)
    assert fn(step) == pytest.approx(expected)


@pytest.mark.parametrize("warmup,epochs,warns", [(8, 5, True), (8, 8, True), (8, 90, False), (0, 1, False)])
def test_warmup_as_long_as_the_run_is_one_warning(caplog, warmup, epochs, warns):
    """resnet50-imagenet's 8 warm-up epochs under --epochs 5: the LR rose all run, to 5/8 of its peak
    (from 0, 10 steps an epoch: the last step's multiplier 49/80), and never decayed, without a word."""
    import logging

    from fastvision.optim import build_scheduler

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with caplog.at_level(logging.WARNING, logger="fastvision.optim.schedules"):
        sched = build_scheduler(opt, SchedConfig(name="cosine", warmup_epochs=warmup, warmup_start_factor=0.0), 10,
                                epochs)
        assert not caplog.records  # not before the first step (a run refused there prints its error alone)
        for _ in range(3):
            opt.step()
            sched.step()
    said = [r.getMessage() for r in caplog.records if "warmup_epochs" in r.getMessage()]
    assert len(said) == int(warns)  # once
    if warns:
        last = (epochs * 10 - 1) / (warmup * 10)  # the multiplier of the run's last step, by hand
        assert f"sched.warmup_epochs={warmup} is not below train.epochs={epochs}" in said[0]
        assert f"to {last:.3g} of its peak" in said[0] and "cosine decay never starts" in said[0]


def test_no_weight_decay_on_norms_and_biases():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Linear(2, 2), nn.GroupNorm(1, 2))
    decay, no_decay = param_groups(model, 1e-4, True)
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert len(no_decay["params"]) == 6 and no_decay["weight_decay"] == 0.0


def test_linear_lr_scaling():
    cfg = OptimConfig(lr=0.256, ref_batch=256)
    assert effective_lr(cfg, 2048) == pytest.approx(2.048)  # seed 004: 8 GPUs x 256
    assert effective_lr(OptimConfig(lr=1e-3), 128) == 1e-3


@pytest.mark.parametrize("kw", [{}, {"weight_decay": 1e-3}, {"grad_averaging": True}, {"amsgrad": True}])
def test_novograd_matches_monai_over_10_steps(kw):
    from monai.optimizers import Novograd as MonaiNovograd

    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    b = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    b.load_state_dict(a.state_dict())
    oa = Novograd(a.parameters(), lr=0.01, betas=(0.9, 0.98), **kw)
    ob = MonaiNovograd(b.parameters(), lr=0.01, betas=(0.9, 0.98), **kw)
    for _ in range(10):
        x = torch.randn(8, 5)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, {"amsgrad": True}])
def test_novograd_zero_first_gradients_start_v_as_monai(kw):
    """A parameter the first batches do not reach (all-zero gradient) starts its second moment at the
    first non-zero ||g||^2, as MONAI's ``if exp_avg_sq == 0``; blending it into 0 gave a ~7x larger update."""
    from monai.optimizers import Novograd as MonaiNovograd

    torch.manual_seed(0)
    pa = nn.Parameter(torch.randn(5, 3))
    pb = nn.Parameter(pa.detach().clone())
    oa, ob = Novograd([pa], lr=0.01, **kw), MonaiNovograd([pb], lr=0.01, **kw)
    for step in range(6):
        g = torch.zeros(5, 3) if step < 2 else torch.randn(5, 3)
        pa.grad, pb.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6)


def test_optimizer_by_name():
    model = nn.Linear(2, 2)
    assert isinstance(build_optimizer(model, OptimConfig(name="sgd", momentum=0.875), 0.1), torch.optim.SGD)
    assert isinstance(build_optimizer(model, OptimConfig(name="novograd"), 0.1), Novograd)


@pytest.mark.parametrize("name, extra", [("sgd", dict(momentum=0.99, nesterov=True, weight_decay=3e-5)),
                                         ("sgd", dict(momentum=0.875, weight_decay=3e-5)),
                                         ("adam", {}), ("adamw", dict(weight_decay=0.05))])
def test_auto_is_torchs_fused_kernel_on_the_cpu_and_steps_as_foreach(name, extra):
    """``optim.impl: auto`` on the CPU takes torch's fused kernel; ten steps on a conv net move the
    weights as torch's foreach implementation does (SGD to the bit here, Adam to an ulp)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv3d(2, 8, 3), nn.InstanceNorm3d(8, affine=True), nn.Conv3d(8, 4, 1))
    a, b, start = net, copy.deepcopy(net), copy.deepcopy(net)
    auto = build_optimizer(a, OptimConfig(name=name, impl="auto", **extra), 0.01)
    ref = build_optimizer(b, OptimConfig(name=name, impl="foreach", **extra), 0.01)
    assert auto.defaults["fused"] and not ref.defaults.get("fused")
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        auto.step()
        ref.step()
    for p, q, p0 in zip(a.parameters(), b.parameters(), start.parameters(), strict=True):
        assert not torch.equal(p, p0)  # the steps moved every weight
        if name == "sgd":
            assert torch.equal(p, q) or (p - q).abs().max() <= 2 * torch.finfo(p.dtype).eps * q.abs().max()
        else:
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_auto_falls_back_to_foreach_where_torch_has_no_fused_kernel(monkeypatch):
    """A torch whose fused SGD refuses the device (as torch's own check words it) gets foreach under
    ``auto``; an explicit ``optim.impl: fused`` keeps torch's error."""
    real = torch.optim.SGD

    def sgd(*args, fused=None, **kw):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of "
                               "supported devices: ['cuda']")
        return real(*args, **kw)

    monkeypatch.setattr(torch.optim, "SGD", sgd)
    opt = build_optimizer(nn.Linear(2, 2), OptimConfig(name="sgd", momentum=0.9, impl="auto"), 0.1)
    assert opt.defaults["foreach"] is True
    with pytest.raises(RuntimeError, match="supported devices"):
        build_optimizer(nn.Linear(2, 2), OptimConfig(name="sgd", momentum=0.9, impl="fused"), 0.1)


@pytest.mark.parametrize("text,expected", [
    ("train.epochs=5", {"train": {"epochs": 5}}),
    ("optim.lr=1e-3", {"optim": {"lr": 1e-3}}),
    ("data.args.image_size=[64, 64]", {"data": {"args": {"image_size": [64, 64]}}}),
    ("train.target=iou=0.9", {"train": {"target": "iou=0.9"}}),
    ('train.checkpoint_every="500"', {"train": {"checkpoint_every": "500"}}),  # quoted: the string stays
    ("optim.lr='2e-4'", {"optim": {"lr": "2e-4"}}),  # ... and a float field reads it (below)
])
def test_parse_override(text, expected):
    assert config.parse_override(text) == expected


def test_a_quoted_number_is_a_string_where_the_key_takes_one():
    """``train.checkpoint_every`` takes steps as an int or a string ("500", "20min"); a quoted number
    was read as the float 500.0, which the key refused."""
    sets = ['train.checkpoint_every="500"', "optim.lr='2e-4'", "train.epochs=3"]
    cfg = config.load("unet2d-microscopy", [config.parse_override(s) for s in sets])
    assert cfg.train.checkpoint_every == "500" and cfg.optim.lr == 2e-4 and cfg.train.epochs == 3


def test_yaml_off_means_off_and_strings_become_floats():
    cfg = config.from_dict({"train": {"amp": False}, "optim": {"lr": "1e-3"}})
    assert cfg.train.amp == "off" and cfg.optim.lr == 1e-3


@pytest.mark.parametrize("data,needle", [
    ({"trian": {}}, "unknown key trian: the top level of the config has no 'trian' (did you mean train?); "
                    "valid keys there:"),
    ({"train": {"epochs": 2.5}}, "train.epochs: expected int"),
    ({"train": {"amp": "fp8"}}, "train.amp"),
    ({"optim": "adam"}, "optim: expected a mapping"),
])
def test_strict_config_errors(data, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        config.from_dict(data)


@pytest.mark.parametrize("recipe", config.list_recipes())
def test_every_shipped_recipe_is_valid(recipe):
    """Every key of every recipe is known to its section or builder (no dataset is built)."""
    import fastvision.data.formats  # noqa: F401  (importing a package registers its components)
    import fastvision.losses  # noqa: F401
    import fastvision.models  # noqa: F401
    import fastvision.tasks  # noqa: F401
    from fastvision.registry import DATASETS, LOSSES, MODELS, TASKS, check_kwargs
    cfg = config.load(recipe)
    for section, reg in (("model", MODELS), ("loss", LOSSES), ("task", TASKS)):
        comp = getattr(cfg, section)
        check_kwargs(reg.get(comp.name), comp.args, f"{section}.args", exclude={"loss", "augment", "info"})
    check_kwargs(DATASETS.get(cfg.data.name), cfg.data.args, "data.args")
    assert cfg.train.epochs >= 1 and not math.isnan(cfg.optim.lr)


def test_recipe_extends_another(tmp_path):
    cfg = config.load("resnet50-imagenet-250ep")
    assert cfg.recipe == "resnet50-imagenet-250ep" and cfg.train.epochs == 250
    assert cfg.task.args == {"num_classes": 1000, "image_size": 224, "mixup": 0.2}  # merged, not replaced
    assert cfg.optim.momentum == 0.875  # inherited
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"extends: {b}\n")
    b.write_text(f"extends: {a}\n")
    with pytest.raises(ConfigError, match="cycle"):
        config.load(str(a))


def test_an_error_in_a_recipe_file_names_the_file(tmp_path):
    bad_key, bad_base = tmp_path / "key.yaml", tmp_path / "base.yaml"
    bad_key.write_text("extends: unet2d-microscopy\ntrain: {epoch: 1}\n")
    bad_base.write_text("extends: nosuch\n")
    with pytest.raises(ConfigError, match=r"key\.yaml: unknown key train\.epoch"):
        config.load(str(bad_key))
    with pytest.raises(ConfigError, match=r"base\.yaml: extends: unknown recipe 'nosuch'"):
        config.load(str(bad_base))
    # the same mistake in an override is the override's: no file named
    with pytest.raises(ConfigError, match=r"^unknown key train\.epoch"):
        config.load("unet2d-microscopy", [config.parse_override("train.epoch=1")])


@pytest.mark.parametrize("name", ["adam", "adamw", "novograd"])
@pytest.mark.parametrize("betas,ok", [([0.9, 0.98], True), ([0.0, 0.0], True), ([0.9], False),
                                      ([0.9, 0.99, 0.9], False), ([1.0, 0.9], False), ([0.9, 1.5], False),
                                      ([-0.1, 0.9], False), ([0.9, float("nan")], False)])
def test_betas_outside_two_values_in_0_1_are_one_config_error(name, betas, ok):
    """Before: one value stopped Novograd's first step ("not enough values to unpack", blamed on the model),
    Adam's beta 1.0 was torch's ValueError traceback, and Novograd took beta2 1.5 and diverged."""
    model = nn.Linear(2, 2)
    cfg = OptimConfig(name=name, betas=betas)
    if ok:
        opt = build_optimizer(model, cfg, 0.1)
        assert tuple(opt.param_groups[0]["betas"]) == tuple(betas)
        return
    with pytest.raises(ConfigError, match=r"optim\.betas must be two numbers in \[0, 1\)"):
        build_optimizer(model, cfg, 0.1)
    build_optimizer(model, OptimConfig(name="sgd", betas=betas), 0.1)  # SGD reads no betas


@pytest.mark.parametrize("sets,section,want", [
    # an empty mapping clears: before, it merged into the recipe's and left it as it was (augmentation kept)
    (["data.augment={}"], ("data", "augment"), {}),
    (["data.augment.rot90={prob: 0.25}"], ("data", "augment"), {"flip": {"axes": [0, 1]}, "rot90": {"prob": 0.25}}),
    # a loss switched with its recipe's arguments cleared first, then its own set
    (["loss.name=dice_focal", "loss.args={}", "loss.args.sigmoid=true"], ("loss",), None),
])
def test_an_empty_mapping_override_replaces_the_recipes(sets, section, want):
    cfg = config.load("unet2d-microscopy", [config.parse_override(s) for s in sets])
    got = config.to_dict(cfg)
    for key in section:
        got = got[key]
    if want is None:
        assert got == {"name": "dice_focal", "args": {"sigmoid": True}}
        import fastvision.losses  # noqa: F401 - registers the losses
        from fastvision.registry import LOSSES

        LOSSES.build(got["name"], got["args"], where="loss.args")  # the recipe's dice_ce keys are gone
        return
    assert got == want


@pytest.mark.parametrize("name,setting,key", [
    ("novograd", dict(momentum=0.95), "optim.momentum 0.95"), ("novograd", dict(nesterov=True), "optim.nesterov True"),
    ("adam", dict(momentum=0.5), "optim.momentum 0.5"), ("adamw", dict(nesterov=True), "optim.nesterov True"),
    ("novograd", dict(impl="fused"), "optim.impl fused"), ("novograd", dict(impl="foreach"), "optim.impl foreach"),
])
def test_a_setting_the_optimizer_does_not_read_is_said(name, setting, key, caplog):
    # Novograd (and Adam) stepped as if momentum / nesterov / impl were not set: a silent no-op of the user's key.
    # SGD's momentum / nesterov, which --set optim.name=adam inherits from an SGD recipe: one warning, the run goes
    # on; an impl Novograd has not: one line
    if "impl" in setting:
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: ") as e:
            build_optimizer(nn.Linear(2, 2), OptimConfig(name=name, **setting), 0.1)
        assert "\n" not in str(e.value)
    else:
        with caplog.at_level("WARNING", logger="fastvision.optim.optimizers"):
            opt = build_optimizer(nn.Linear(2, 2), OptimConfig(name=name, **setting), 0.1)
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(said) == 1 and said[0].startswith(f"{key}: read by optim.name sgd alone, not {name}")
        assert "momentum" not in opt.param_groups[0] and "nesterov" not in opt.param_groups[0]
    # what they do read is taken as before: SGD's momentum, Novograd's betas[0] and its loop
    assert build_optimizer(nn.Linear(2, 2), OptimConfig(name="sgd", momentum=0.95, nesterov=True),
                           0.1).param_groups[0]["momentum"] == 0.95
    opt = build_optimizer(nn.Linear(2, 2), OptimConfig(name="novograd", betas=[0.95, 0.98], impl="loop"), 0.1)
    assert opt.param_groups[0]["betas"] == (0.95, 0.98)


@pytest.mark.parametrize("loader, dali", [("dali", True), ("dali-gpu", True), ("thread", False)])
def test_a_dali_loader_names_the_decoder_key(loader, dali):
    """DLE's --data-backend dali-gpu, tried as data.loader: dali, was told only the two loaders."""
    with pytest.raises(ConfigError, match=rf"^data.loader: expected .*got '{loader}'") as e:
        config.load("resnet18-imagefolder", [{"data": {"loader": loader}}])
    assert ("DALI decodes with data.args.backend: dali" in str(e.value)) == dali
