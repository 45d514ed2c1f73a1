"""Recipes against the seeds' published settings, written out from the seeds' code by hand
(docs/fidelity.md cites these tests)."""
from __future__ import annotations

import math

import pytest

from fastvision import config, optim


def _lr_at(cfg, step: int, steps_per_epoch: int, global_batch: int) -> float:
    base = optim.effective_lr(cfg.optim, global_batch)
    return base * optim.lr_lambda(cfg.sched, steps_per_epoch, cfg.train.epochs)(step)


def test_unet3d_brats_schedule_is_seed000_piecewise_constant():
    """DLE model_fn.py: piecewise_constant(step, [S/2N, S/2N, 3S/4N], [lr/4, lr, lr/5, lr/20])."""
    cfg = config.load("unet3d-brats")
    spe = 100
    total = spe * cfg.train.epochs
    lr = 2e-4
    b = [total // 2, total // 2, 3 * total // 4]
    values = [lr / 4, lr, lr / 5, lr / 20]

    def seed(step: int) -> float:  # tf.train.piecewise_constant: v[i] while step <= b[i]
        for i, bound in enumerate(b):
            if step <= bound:
                return values[i]
        return values[-1]

    for step in [0, 1, total // 4, total // 2 - 1, total // 2 + 1, 2 * total // 3, 3 * total // 4 + 1, total - 1]:
        assert _lr_at(cfg, step, spe, 16) == pytest.approx(seed(step), rel=1e-12), step
    assert cfg.loss.name == "dice_bce" and cfg.task.args["mode"] == "softmax" and cfg.optim.name == "adam"
    assert cfg.task.args["region_names"] == ["WT", "TC", "ET"] and cfg.train.batch_size == 2


@pytest.mark.parametrize("workers", [1, 4, 14])
def test_unet2d_seed001_schedule_is_the_seeds_per_epoch_rule(workers):
    """tensorflow_native/training.py lr_schedule(epoch): init_lr * K for epoch < 80, /2 to 119,
    /4 to 150 (inclusive), /8 after; K workers of 16 images each."""
    cfg = config.load("unet2d-seed001")
    spe = 7

    def seed(epoch: int) -> float:
        k, lr = workers, 1e-3
        if epoch < 80:
            return lr * k
        if epoch < 120:
            return lr / 2 * k
        if epoch <= 150:
            return lr / 4 * k
        return lr / 8 * k

    assert cfg.train.epochs == 200 and cfg.train.batch_size == 16
    for epoch in range(cfg.train.epochs):
        assert _lr_at(cfg, epoch * spe, spe, 16 * workers) == pytest.approx(seed(epoch), rel=1e-12), epoch


def test_unet2d_seed001_recipe_as_published():
    cfg = config.load("unet2d-seed001")
    assert cfg.model.name == "unet2d-seed001" and cfg.loss.name == "bce" and cfg.optim.name == "adam"
    assert cfg.data.args["image_size"] == [768, 1024] and cfg.data.args["repeat"] == 2
    assert cfg.task.args["average"] == "pooled" and cfg.train.amp == "off" and not cfg.data.augment
    assert config.load("unet2d-microscopy").task.args["average"] == "pooled"  # seed 001's IoU definition


def test_gpu_recipes_default_to_amp_auto_and_ssd_starts_from_imagenet():
    for name in ("resnet50-imagenet", "ssd320-coco", "unet3d-brats", "segresnet-brats"):
        assert config.load(name).train.amp == "auto", name
    ssd = config.load("ssd320-coco").model.args
    assert ssd["pretrained"] == "imagenet" and ssd["frozen_bn"] is True


def test_resnet50_fp16_uses_seed004s_static_loss_scale():
    """seeds.md: seed 004's AMP scripts use --static_loss_scale 128. Both ResNet-50 recipes build that scaler
    (bf16 and fp32 build none); the other GPU recipes keep the dynamic scaler (seed 000 / 002: TF-AMP's
    automatic loss scaling)."""
    from fastvision.engine import runtime

    for name in ("resnet50-imagenet", "resnet50-imagenet-250ep"):
        scale = config.load(name).train.loss_scale
        assert scale == 128, name
        scaler = runtime.loss_scaler("cpu", True, scale)
        assert scaler.get_scale() == 128.0 and scaler.get_growth_interval() == runtime.STATIC_GROWTH_INTERVAL
    assert all(config.load(n).train.loss_scale == "dynamic" for n in ("ssd320-coco", "unet3d-brats"))


@pytest.mark.parametrize("name, epochs, mixup", [("resnet50-imagenet", 90, 0.0), ("resnet50-imagenet-250ep", 250, 0.2)])
def test_resnet50_recipes_are_seed004s(name, epochs, mixup):
    """seeds.md, seed 004 (DLE resnet50v1.5, TF): SGD momentum 0.875; 0.256 per 256 images (2.048 at
    8 x 256); linear warm-up from 0 over 8 epochs (the scripts), then cosine to 0; weight decay
    1/32768 on every variable but BatchNorm's (the head's bias included); label smoothing 0.1;
    90 epochs, or 250 with MixUp 0.2; 256 per GPU; random-resized crop 224 of area 5-100 % (both TF
    code paths), aspect 3/4-4/3; evaluation: shorter side 256, centre 224."""
    from torch import nn

    from fastvision.models import create_model

    cfg = config.load(name)
    o, d = cfg.optim, cfg.data.args
    assert (o.name, o.momentum, o.nesterov, o.weight_decay) == ("sgd", 0.875, False, 1 / 32768)
    assert (cfg.train.epochs, cfg.task.args["mixup"], cfg.loss.args["label_smoothing"]) == (epochs, mixup, 0.1)
    assert (cfg.train.batch_size, d["image_size"], d["resize_size"], list(d["scale"])) == (256, 224, 256, [0.05, 1.0])
    assert list(d.get("ratio", [0.75, 4 / 3])) == pytest.approx([3 / 4, 4 / 3])
    spe, total, warm = 625, 625 * epochs, 625 * 8  # 1.28 M images / 2048 per step
    for step in (0, 1, warm // 2, warm - 1, warm, warm + 1, (total + warm) // 2, total - 1):
        seed = 2.048 * step / warm if step < warm else \
            2.048 * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
        assert _lr_at(cfg, step, spe, 2048) == pytest.approx(seed, rel=1e-12, abs=1e-15), step
    model = create_model(cfg.model.name, **cfg.model.args)
    decay, no_decay = optim.param_groups(model, o.weight_decay, o.no_decay_norm_bias, o.no_decay_bias)
    bn = {id(p) for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()}
    assert {id(p) for p in no_decay["params"]} == bn and no_decay["weight_decay"] == 0
    assert {id(p) for p in decay["params"]} == {id(p) for p in model.parameters()} - bn
    assert id(model.fc.bias) in {id(p) for p in decay["params"]}


@pytest.mark.parametrize("recipe,patch", [("unet3d-brats", [128, 128, 128]), ("segresnet-brats", [224, 224, 144])])
def test_brats_recipes_crop_as_the_seeds(recipe, patch):
    """Seed 000's RandomCrop3D and MONAI's BraTS RandSpatialCropd: a random crop with no foreground bias
    (``placement: uniform``; the recipes centred half their crops on tumour)."""
    cfg = config.load(recipe)
    assert cfg.data.args["placement"] == "uniform" and cfg.data.args["patch_size"] == patch
    assert cfg.task.args["sample_shape"][1:] == patch


def test_unet3d_brats_augments_as_seed000():
    """DLE's train pipeline with --augment: RandomHorizontalFlip (axis 1, p 0.5) and RandomBrightnessCorrection
    (p 0.5, per channel U(0.9, 1.1) added where the normalised value is > 0); nothing else."""
    aug = config.load("unet3d-brats").data.augment
    assert aug == {"flip": {"prob": 0.5, "axes": [1]}, "foreground_shift": {"prob": 0.5, "range": [0.9, 1.1]}}
