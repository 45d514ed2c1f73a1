"""The training ``fastvision configure --trainer`` writes: ``fast`` (the base recipe's, seed 003's fast
training) or ``nnunet`` (``nnUNetTrainer``'s, value for value, mapped onto fastvision's keys).

nnU-Net v2.8's ``nnUNetTrainer`` (read from its source): SGD lr 0.01, Nesterov momentum 0.99, weight
decay 3e-5 on every parameter; ``PolyLRScheduler`` (1 - epoch / 1000) ** 0.9; 1000 epochs of 250
iterations; Dice (``MemoryEfficientSoftDiceLoss``, smooth 1e-5, no background for softmax labels,
with it for sigmoid regions; batch Dice only where a 3d_lowres cascade exists) + CE, weights 1 / 1;
deep supervision over the decoder scales, weights 1 / 2^i with the lowest set to 0, normalised; the
gradient's global norm clipped to 12;
``oversample_foreground_percent`` 0.33 (the last ``round(0.33 B)`` items of a batch, ``get_bbox``'s
placement); and ``get_training_transforms``' augmentation.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from fastvision.errors import ConfigError, DataError

TRAINERS = ("fast", "nnunet")
# docs/configure.md "Which trainer": in benchmarks/train_vs_nnunet.py nnunet reached the common Dice as soon or
# sooner than fast in 7 of 8 runs (CT and MR) and ended higher in 5; SegResNet has no decoder scales
DEFAULT_TRAINER = {"unet3d": "nnunet", "segresnet": "fast"}
NNUNET_EPOCHS, NNUNET_ITERATIONS = 1000, 250  # nnUNetTrainer.num_epochs, num_iterations_per_epoch
VAL_EVERY_ITERATIONS = 2500  # our sliding-window validation every 10 nnU-Net epochs (it validates 50 patches each)
# issue 41's third pass (benchmarks/RESULTS.md, "MR: nnU-Net's differences ..."): each measured alone over 3 seeds
# He init stays off after the fourth pass ("MR and CT over eight runs per side"): over 12 MR seeds it ends
# 0.049 below the default at 64 iterations (lower in 11; one seed never learns the second class) and is
# worse on CT from 32 iterations on; what it buys is fewer seeds at the 0.44 mode at 16 iterations
HE_INIT = False  # model.args.init: he
# He on the logit heads only (model.args.init: he_heads), issue 41's fourth pass ("CT at 16 iterations: what was
# checked"): the body's convs feed instance norms, which cancel their weight scale; the heads feed none, and with
# PyTorch's default there (2.4x smaller than He) the foreground logit stays below the background's for the first
# iterations (CT Dice 0.000 at 16 in 4 of 4 seeds, nnU-Net 0.26-0.42). With it: Dice at every checkpoint no lower
# than nnU-Net's (MR 12 seeds, CT 4) and the 64-iteration Dice level with the default's
HEAD_INIT = True
ENLARGED_PATCH = False  # data.args.patch_size: the initial patch, data.augment.affine.size: the network's
LINEAR_LABELS = False  # data.augment.affine.label_mode: linear
# data.args.resample: nnunet (crop, normalise, then nnU-Net's spline / per-label resampling), RESAMPLE_NOTE's screen
NNUNET_RESAMPLE = True
RESAMPLE_NOTE = ("nnU-Net's DefaultPreprocessor: crop, clip and z-score, then resample (3rd-order spline image, "
                 "per-label linear labels, its grid); MONAI's order (trilinear, then the window) saturates CT: "
                 "first validation 0.445 against 0.311 over 12 seeds (RESULTS.md, issue 41)")


def check_trainer(trainer: str, base: str) -> None:
    """One-line errors for ``--trainer``: an unknown choice, or nnU-Net's on a net without decoder scales."""
    if trainer not in TRAINERS:
        raise ConfigError(f"--trainer {trainer!r}: valid: {', '.join(TRAINERS)}")
    if trainer == "nnunet" and base != "unet3d":
        raise ConfigError(f"--trainer nnunet needs deep supervision over decoder scales: --base {base} has none "
                          "(use --base unet3d, or --trainer fast)")


NUM_FOLDS = 5  # nnU-Net's cross-validation (and data.args.num_folds' default)


def num_folds(n_cases: int, where: str = "the dataset") -> int:
    """nnU-Net's 5 folds, or one case a fold for fewer cases (nnU-Net's KFold(5) stops there); 2 at least:
    a fold must leave a case to validate on and one to train on."""
    if n_cases < 2:
        raise DataError(f"{where}: {n_cases} training case(s); a planned recipe validates on a held-out fold, "
                        "which needs 2 cases or more")
    return min(NUM_FOLDS, n_cases)


def steps_per_epoch(n_cases: int, batch: int, folds: int | None = None, gpus: int = 1) -> int:
    """Optimizer steps in one pass over fold 0's training cases (``kfold_split``: fold 0 holds
    ``ceil(n / folds)`` cases; ``folds`` None: :func:`num_folds`) at ``batch`` per GPU on ``gpus`` GPUs:
    each rank steps through its ``ceil(cases / gpus)`` share (the training sampler pads it), so N GPUs
    take about 1/N the steps."""
    folds = folds or num_folds(n_cases)
    return max(1, math.ceil((n_cases - math.ceil(n_cases / folds)) / gpus) // batch)


def initial_patch(patch: list[int], degrees: float, dummy_2d: bool, coarse: int) -> list[int]:
    """nnU-Net's enlarged initial patch: ``get_patch_size(patch, rot, rot, rot, (0.85, 1.25))`` (the patch's
    corner vector rotated by the largest angle about each axis in turn, capped at 90 degrees, the largest
    extent per axis, divided by 0.85, truncated; the coarse axis kept in dummy 2-D), then each margin
    rounded up to an even number, so the final patch's centre is the larger one's (a centred crop and a
    rotation about the centre read the same voxels)."""
    a = min(math.radians(degrees), math.pi / 2)
    c, s = math.cos(a), math.sin(a)
    mats = (np.array([[1, 0, 0], [0, c, -s], [0, s, c]]), np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]]),
            np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]]))
    coords = np.array(patch, dtype=float)
    extent = np.max(np.vstack([coords, *[np.abs(coords @ m) for m in mats]]), 0) / 0.85
    out = [int(v) for v in extent]
    if dummy_2d:
        out[coarse] = patch[coarse]
    return [p + (max(o - p, 0) + 1) // 2 * 2 for p, o in zip(patch, out, strict=True)]


def nnunet_augment(augment: dict[str, Any], dummy_2d: bool, coarse: int, patch: list[int]) -> dict[str, Any]:
    """The fast recipe's ops (:func:`~fastvision.planning.configure.recipe.augmentation`) completed to
    ``get_training_transforms``: rotation and zoom each p 0.2, the scale drawn as nnU-Net's (it scales the
    sampling coordinates: zoom 1 / U(0.7, 1.4)), blur, low resolution, both gammas; with
    ``ENLARGED_PATCH`` the affine samples the network's ``patch`` from the loader's larger initial patch
    (:func:`initial_patch`); with ``LINEAR_LABELS`` it resamples labels per class, linearly, as nnU-Net."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in augment.items()}
    out["affine"].update(rotate_prob=0.2, zoom_prob=0.2, sampling_scale=True)
    if ENLARGED_PATCH:
        out["affine"]["size"] = list(patch)
    if LINEAR_LABELS:
        out["affine"]["label_mode"] = "linear"
    out["blur"] = {"prob": 0.2, "sigma": [0.5, 1.0], "channel_prob": 0.5}
    out["lowres"] = {"prob": 0.25, "range": [0.5, 1.0], "channel_prob": 0.5,
                     **({"ignore_axes": [coarse]} if dummy_2d else {})}
    out["gamma_inverted"] = {"prob": 0.1, "range": [0.7, 1.5], "per_channel": True, "retain_stats": True}
    out["gamma"] = {"prob": 0.3, "range": [0.7, 1.5], "per_channel": True, "retain_stats": True}
    return out


def _init() -> dict[str, str]:
    """``model.args.init`` as the switches say: nnU-Net's He everywhere, He on the logit heads only, or none."""
    return {"init": "he"} if HE_INIT else {"init": "he_heads"} if HEAD_INIT else {}


def nnunet_overrides(n_cases: int, batch: int, regions: bool, thin: bool, stages: int,
                     gpus: int = 1) -> dict[str, Any]:
    """``optim``, ``sched``, ``loss``, ``train`` and the model's deep supervision of nnU-Net's trainer
    (a U-Net of ``stages`` stages; with 2 there is one decoder scale and nothing to supervise deeply);
    ``batch`` per GPU of ``gpus``: nnU-Net's iterations count steps of the global batch."""
    steps = steps_per_epoch(n_cases, batch, gpus=gpus)
    return {
        "model": {"args": {"deep_supervision": stages >= 3, **_init()}},
        "data": {"args": {"oversample": "batch_tail", "placement": "nnunet",
                          **({"resample": "nnunet"} if NNUNET_RESAMPLE else {})}},
        "loss": {"name": "dice_ce", "args": {
            "include_background": regions, "softmax": not regions, "sigmoid": regions, "squared_pred": False,
            "batch": thin, "smooth_nr": 1e-5, "smooth_dr": 1e-5, "lambda_dice": 1.0, "lambda_ce": 1.0}},
        "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.99, "nesterov": True, "weight_decay": 3e-5,
                  "no_decay_norm_bias": False, "ref_batch": None},
        "sched": {"name": "poly", "power": 0.9, "warmup_epochs": 0.0, "min_lr_factor": 0.0},
        "train": {"clip_grad": 12.0, "epochs": math.ceil(NNUNET_EPOCHS * NNUNET_ITERATIONS / steps),
                  "val_every": max(1, round(VAL_EVERY_ITERATIONS / steps))},
    }


def trainer_choices(trainer: str, ov: dict[str, Any], n_cases: int, gpus: int = 1) -> list[tuple[str, Any, str]]:
    """``(key, value, why)`` rows of the trainer's keys, for the table and the YAML comments."""
    if trainer != "nnunet":
        return [("trainer", "fast", "the base recipe's optimizer, schedule and loss, no deep supervision "
                                    "(unet3d-spleen-fast: seed 003's SGD 0.2, constant LR, DiceCE 0.5/0.5)")]
    batch, steps = ov["train"]["batch_size"], steps_per_epoch(n_cases, ov["train"]["batch_size"], gpus=gpus)
    total = NNUNET_EPOCHS * NNUNET_ITERATIONS
    return [
        ("optim", ov["optim"], "nnUNetTrainer: SGD lr 0.01, Nesterov momentum 0.99, weight decay 3e-5 on every "
                               "parameter (norms and biases too), no LR scaling"),
        ("sched", ov["sched"], "nnU-Net's PolyLRScheduler, (1 - t)^0.9, no warm-up; stepped per iteration here "
                               "(nnU-Net steps it per 250-iteration epoch: within 0.4 % of it)"),
        ("loss", ov["loss"], "nnU-Net's Dice + CE, weights 1/1, smooth 1e-5, Dice without background for labels "
                             "(with it for sigmoid regions), batch Dice only for 2-D / cascade plans"),
        ("data.args.oversample", "batch_tail",
         "nnUNetDataLoader: the last round(0.33 B) items of every batch are centred on foreground (batch 2: "
         "the second), by their place in the sampler's order; not each item with probability 0.33"),
        ("data.args.placement", "nnunet",
         "nnUNetDataLoader.get_bbox: a random present class, one of its voxels exactly at the patch centre (the "
         "patch may reach past the volume, zeros there); other patches uniform over the volume"),
        *([("data.args.resample", "nnunet", RESAMPLE_NOTE)] if NNUNET_RESAMPLE else []),
        ("model.args.deep_supervision", ov["model"]["args"]["deep_supervision"],
         "logits at every decoder scale in training, weights 1/2^i, the lowest 0, normalised; targets by "
         "nearest-exact down-sampling (off with a single decoder scale)"),
        *([("model.args.init", "he", "nnU-Net's InitWeights_He(1e-2): Kaiming-normal conv weights for leaky ReLU "
                                     "0.01, zero biases")] if HE_INIT else []),
        *([("model.args.init", "he_heads", "nnU-Net's He draw on the logit heads only, PyTorch's in the normalised "
                                           "body: the foreground logit crosses the background's within the first "
                                           "iterations (He everywhere ends lower: RESULTS.md, issue 41 fourth pass)")]
          if HEAD_INIT and not HE_INIT else []),
        ("train.clip_grad", ov["train"]["clip_grad"], "nnUNetTrainer.train_step: clip_grad_norm_(parameters, 12)"),
        ("train.epochs", ov["train"]["epochs"],
         f"nnU-Net's {NNUNET_EPOCHS} epochs x {NNUNET_ITERATIONS} iterations = {total} iterations, at {steps} "
         f"step{'' if steps == 1 else 's'} per pass over fold 0's cases (batch {batch}"
         + (f" on each of {gpus} GPUs)" if gpus > 1 else ")")),
        ("train.val_every", ov["train"]["val_every"],
         f"sliding-window validation about every {VAL_EVERY_ITERATIONS} iterations (nnU-Net: 50 patches per "
         "epoch, whole cases only at the end)"),
    ]
