"""The recipe ``fastvision configure`` writes: overrides on a shipped base, each chosen value with
the rule and the fingerprint figure it came from, as YAML comments and as a printed table."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from fastvision.planning.configure.rules import (
    ANISOTROPY,
    BASES,
    MAX_DATASET_COVERED,
    MAX_FEATURES_2D,
    MAX_FEATURES_3D,
    MIN_BATCH,
    MIN_EDGE,
    OVERLAP,
    Topology,
    features,
)
from fastvision.planning.configure.trainer import (
    NUM_FOLDS,
    initial_patch,
    nnunet_augment,
    nnunet_overrides,
    num_folds,
    trainer_choices,
)


def _model(fp: dict[str, Any], topo: Topology, base: str, thin: bool) -> dict[str, Any]:
    c_in, stages = len(fp["channels"]), len(topo.strides)
    c_out = len(fp["regions"]) if fp.get("regions") else len(fp["labels"])  # one sigmoid per region
    if base == "segresnet":
        blocks = ([1, 2, 2] + [4] * stages)[:stages]
        return {"name": "segresnet", "args": {
            "in_channels": c_in, "out_channels": c_out, "init_filters": 16, "blocks_down": blocks,
            "blocks_up": [1] * (stages - 1), "strides": topo.strides[1:], "kernel_size": topo.kernels}}
    return {"name": "unet3d", "args": {
        "in_channels": c_in, "out_channels": c_out,
        "filters": features(stages, MAX_FEATURES_2D if thin else MAX_FEATURES_3D),
        "strides": topo.strides, "kernel_size": topo.kernels, "n_convs": 2, "norm": "instance", "act": "leakyrelu",
        "down": "stride", "up": "transpose", "up_kernel": 2, "head_kernel": 1, "dropout": 0.0, "residual": False}}


def augmentation(patch: list[int], spacing: list[float], thin: int | None,
                 trainer: str = "fast") -> tuple[dict[str, Any], str]:
    """nnU-Net v2's training augmentation (``nnUNetTrainer.get_training_transforms`` and
    ``configure_rotation_dummyDA_mirroring_and_inital_patch_size``) as fastvision's batched ops, and why.

    A patch whose longest edge is over ``ANISOTROPY`` times its edge along the coarsest axis (or a thin
    stack, trained slice-wise) is augmented slice by slice ("dummy 2-D"): rotation up to 180 degrees
    about that axis only and zoom in the slice plane; otherwise rotation up to 30 degrees about every
    axis. Mirroring on every axis a patch has more than one voxel along (nnU-Net mirrors (0, 1, 2) in 3-D;
    ``predict --tta`` mirrors the same axes). ``trainer="nnunet"`` adds the rest of nnU-Net's ops
    (:func:`~fastvision.planning.configure.trainer.nnunet_augment`).
    """
    coarse = thin if thin is not None else int(np.argmax(spacing))
    dummy_2d = thin is not None or max(patch) / patch[coarse] > ANISOTROPY
    others = [a for a in range(3) if a != coarse]
    affine: dict[str, Any] = {"prob": 0.2, "degrees": 180 if dummy_2d else 30, "scale": [0.7, 1.4], "same_zoom": True}
    if dummy_2d:
        affine.update(rotate_axes=[coarse], zoom_axes=others)
    aug = {"flip": {"prob": 0.5, "axes": [a for a in range(3) if patch[a] > 1]}, "affine": affine,
           "noise": {"prob": 0.1, "std": 0.1}, "brightness": {"prob": 0.15, "factor": 0.25},
           "contrast": {"prob": 0.15, "factor": 0.25}, "gamma": {"prob": 0.3, "range": [0.7, 1.5]}}
    why = ("nnU-Net v2's training augmentation in batched GPU ops: mirror each axis with p 0.5 (`predict --tta` "
           "mirrors the same axes); rotation and one zoom 0.7-1.4 with p 0.2, "
           + (f"rotation up to 180 deg about axis {coarse} only, zoom in its plane (anisotropic patch: nnU-Net's "
              "dummy 2-D)" if dummy_2d else "rotation up to 30 deg about every axis")
           + "; Gaussian noise p 0.1, std U(0, 0.1) (batchgeneratorsv2 draws its `noise_variance` (0, 0.1) and "
           "uses it as the std); brightness and contrast 0.75-1.25 p 0.15; gamma 0.7-1.5 "
           "p 0.3. ")
    if trainer == "nnunet":
        aug = nnunet_augment(aug, dummy_2d, coarse, patch)
        return aug, why + (
            "nnU-Net's trainer: rotation and zoom each p 0.2; blur sigma 0.5-1 p 0.2 (per channel 0.5); low "
            "resolution 0.5-1 p 0.25 (per channel 0.5" + (f", not along axis {coarse}" if dummy_2d else "")
            + "); inverted gamma p 0.1; gammas per channel, keeping mean and std"
            + ("; the affine cuts the network's patch from nnU-Net's enlarged initial patch (no zero corners)"
               if "size" in aug["affine"] else "")
            + ("; labels resampled per class, linearly, then argmax (nnU-Net's SpatialTransform)"
               if aug["affine"].get("label_mode") == "linear" else ""))
    return aug, why + ("Not carried over (`--trainer nnunet` has them): blur, low-resolution simulation, the "
                       "inverted-gamma variant, separate probabilities for rotation and zoom")


def recipe_overrides(fp: dict[str, Any], geo: dict[str, Any], topo: Topology, norm: dict[str, Any], base: str,
                     batch: int, data: str, trainer: str = "fast", gpus: int = 1) -> dict[str, Any]:
    """The mapping layered on the base recipe (``extends``); ``trainer``: ``fast`` or ``nnunet``;
    ``batch`` per GPU of ``gpus``."""
    patch = list(topo.patch)
    regions = fp.get("regions")
    augment, _ = augmentation(patch, geo["spacing"], geo["thin_axis"], trainer)
    from fastvision.config import read_recipe, recipe_path

    for op in (read_recipe(recipe_path(BASES[base])).get("data") or {}).get("augment") or {}:
        augment.setdefault(op, None)  # the base recipe's other ops (seed 003's intensity shift) are off
    out: dict[str, Any] = {
        "task": {"name": "segmentation", "args": {
            "num_classes": max(map(int, fp["labels"])) + 1 if regions else len(fp["labels"]),
            "mode": "regions" if regions else "softmax",
            "regions": list(regions.values()) if regions else None,
            "region_names": list(regions) if regions else None,
            "sample_shape": [len(fp["channels"]), *patch],
            "sliding_window": {"roi_size": patch, "overlap": OVERLAP, "mode": "gaussian", "sw_batch_size": batch,
                               **({"style": "nnunet"} if trainer == "nnunet" else {})}}},
        "model": _model(fp, topo, base, geo["thin_axis"] is not None),
        "data": {"name": "decathlon", "args": {
            "path": data, "target_spacing": [round(s, 4) for s in geo["spacing"]], **norm,
            "crop_foreground": "nonzero",
            "patch_size": patch, "pos_fraction": 0.33}, "augment": augment},
        "train": {"batch_size": batch, "amp": "auto"},
    }
    folds = num_folds(fp["n_cases"], data)
    if folds < NUM_FOLDS:  # one case a fold: 5 folds of fewer cases cannot be cut
        out["data"]["args"]["num_folds"] = folds
    if regions:  # nnU-Net's region training: a sigmoid per region, every channel a foreground region
        out["loss"] = {"args": {"sigmoid": True, "softmax": False, "include_background": True}}
    elif base == "segresnet":
        out["loss"] = {"args": {"sigmoid": False, "softmax": True, "include_background": False}}
    if augment["affine"].get("label_mode") == "linear":  # the class count written: no host sync on a GPU
        augment["affine"]["label_classes"] = max(map(int, fp["labels"])) + 1
    if "size" in augment["affine"]:  # nnU-Net's enlarged initial patch: the loader crops it, the affine the net's
        rot = augment["affine"].get("rotate_axes")
        out["data"]["args"]["patch_size"] = initial_patch(patch, augment["affine"]["degrees"], rot is not None,
                                                          rot[0] if rot else 0)
    if trainer == "nnunet":
        from fastvision.config import merge

        out = merge(out, nnunet_overrides(fp["n_cases"], batch, bool(regions), geo["thin_axis"] is not None,
                                          len(topo.strides), gpus))
    return out


TRAINER_WHY = {
    "fast": "the base recipe's optimizer, schedule and loss (seed 003's fast training; the default for --base "
            "segresnet, which has no decoder scales for deep supervision)",
    "nnunet": "nnUNetTrainer's SGD 0.01 Nesterov 0.99, poly decay, Dice + CE with deep supervision, its whole "
              "augmentation, sampling and 1000 x 250 iterations; the default for --base unet3d: it reached the common "
              "Dice as soon or sooner than --trainer fast in 7 of 8 runs on generated CT and MR and ended higher in 5 "
              "(benchmarks/train_vs_nnunet.py, docs/configure.md)",
}


def _budget(plan: dict[str, Any]) -> str:
    gpu = plan["gpu"]
    return gpu if "budget" in gpu else f"{gpu} ({plan['gpu_memory_gib']:.3g} GiB)"


def _vec(v) -> str:
    return " x ".join(f"{x:.3g}" for x in v)


def choices(plan: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """``(dotted key, value, why)`` for every planned value, in reading order."""
    fp, geo, fit, ov = plan["fingerprint"], plan["geometry"], plan["fit"], plan["overrides"]
    topo: Topology = fit["topology"]
    m, d, t = ov["model"]["args"], ov["data"]["args"], ov["task"]["args"]
    rows = [("data.args.target_spacing", d["target_spacing"],
             f"{geo['spacing_why']} (fingerprint median {_vec(fp['median_spacing'])} mm over {fp['n_cases']} cases; "
             f"anisotropic when one axis is >= {ANISOTROPY:g}x coarser)"),
            ("data.args.intensity", d["intensity"], plan["normalisation_why"])]
    rows.append(("data.args.crop_foreground", d["crop_foreground"],
                 "nnU-Net's crop to the non-zero region (any channel != 0), the region the fingerprint measured "
                 "the shapes on (for CT the whole scan: air is -1000 HU, not 0)"))
    if "window" in d:
        rows.append(("data.args.window", d["window"], "foreground p0.5, p99.5 -> (p - mean) / std: clip, then z-score"))
    thin = geo["thin_axis"]
    shape_note = (f"median shape after crop and resampling {_vec(geo['median_shape'])}"
                  + (f"; axis {thin} has < {2 * MIN_EDGE} voxels: a thin stack, trained slice-wise (2-D)"
                     if thin is not None else ""))
    patch = list(topo.patch)
    if "num_folds" in d:
        rows.append(("data.args.num_folds", d["num_folds"],
                     f"one case a fold: {fp['n_cases']} cases cannot be cut into nnU-Net's {NUM_FOLDS} folds"))
    rows.append(("data.args.patch_size", d["patch_size"],
                 (f"nnU-Net's enlarged initial patch for the network's {_vec(patch)} (its get_patch_size over the "
                  "rotation, margins rounded to even: the affine samples the network's patch from it); the network's: "
                  if list(d["patch_size"]) != patch else "")
                 + f"voxel-size aspect at 256^3, clipped to the {shape_note}, padded to the divisor "
                 f"{_vec(topo.divisor)}"
                 + ("; shrunk until batch 2 fits" if fit["shrunk"] else "")))
    rows.append(("model.args.strides", m["strides"],
                 f"pool an axis while its spacing is within 2x of the finest and its map has >= {2 * MIN_EDGE} voxels "
                 f"(edge about {MIN_EDGE}): pools per axis {topo.pools_per_axis}, {len(topo.strides)} stages"))
    rows.append(("model.args.kernel_size", m["kernel_size"],
                 "3 along an axis once its spacing is within 2x of the finest, else 1 (3x3x1 for thick slices)"))
    if "filters" in m:
        rows.append(("model.args.filters", m["filters"], "32 x 2^stage, capped at 320 (3-D) / 512 (2-D), as nnU-Net"))
    split = plan["cluster"]
    rows.append(("train.batch_size", ov["train"]["batch_size"],
                 f"largest that fits {_budget(plan)} by plan's estimate: "
                 f"{fit['batch_fit']}; at most {MAX_DATASET_COVERED:.0%} of the dataset's voxels per step: "
                 f"{fit['batch_cover']}; at least {MIN_BATCH} (estimated {fit['memory_gib']:.2f} GiB)"
                 + (f"; {split.why_batch}" if split.gpus > 1 else "")))
    rows.append(("data.num_workers", ov["data"]["num_workers"], f"CPU workers per GPU: {split.why_workers}"))
    trainer = plan.get("trainer", "fast")
    rows.append(("data.augment", ov["data"]["augment"],
                 augmentation(patch, geo["spacing"], thin, trainer)[1]))
    rows.append(("train.amp", "auto", "bf16 where the GPU has it, else fp16; fp32 on CPU (the batch was sized for "
                                      "the target GPU's precision; on a CPU with AMX or AVX-512 BF16, "
                                      "train.amp=bf16 trains faster: the log names it)"))
    rows.append(("task.args.sliding_window", t["sliding_window"],
                 f"ROI = the training patch, overlap {OVERLAP:g}, Gaussian blending (nnU-Net's predictor)"
                 + ("; style nnunet: its evenly spread windows and Gaussian, logits resampled to each file's "
                    "grid (nnU-Net's network predicts nnU-Net's labels through it: RESULTS.md, issue 41)"
                    if t["sliding_window"].get("style") == "nnunet"
                    else "")))
    return rows + trainer_choices(trainer, ov, fp["n_cases"], split.gpus)


def _flow(v: Any) -> str:
    """JSON is YAML flow style; 1e-05 gets its ".0" (YAML 1.1 reads a float without a dot as a string)."""
    return re.sub(r"(?<![\w.\"])(\d+)e([-+]\d+)", r"\1.0e\2", json.dumps(v))


def _emit(d: dict[str, Any], why: dict[str, str], indent: int = 0, path: str = "") -> list[str]:
    lines = []
    for k, v in d.items():
        key = f"{path}.{k}" if path else k
        pad = "  " * indent
        if isinstance(v, dict) and v and key not in why:
            lines.append(f"{pad}{k}:")
            lines += _emit(v, why, indent + 1, key)
        else:
            line = f"{pad}{k}: {_flow(v)}"
            lines.append(f"{line}  # {why[key]}" if key in why else line)
    return lines


def recipe_text(plan: dict[str, Any]) -> str:
    """The recipe YAML: ``extends`` the base, every planned value commented."""
    fp = plan["fingerprint"]
    why = {k: w for k, _, w in choices(plan)}
    gpus, trainer = plan["cluster"].gpus, plan.get("trainer", "fast")
    head = [f"# Planned by `fastvision configure {plan['data']} --base {plan['base']} --trainer {trainer}"
            f"{f' --gpus {gpus}' if gpus > 1 else ''}` for {_budget(plan)}",
            f"# from the fingerprint of {fp['n_cases']} cases ({fp['name']}): nnU-Net v2's planning rules, batch by",
            "# `fastvision plan`'s estimator. docs/configure.md says when to override a value.",
            f"# Training: {trainer}: {TRAINER_WHY[trainer]}",
            f"extends: {BASES[plan['base']]}"]
    return "\n".join(head + _emit(plan["overrides"], why)) + "\n"


def write_recipe(plan: dict[str, Any], path: Path) -> Path:
    from fastvision.utils.files import atomic_text

    atomic_text(Path(path), recipe_text(plan))
    return Path(path)


def table(plan: dict[str, Any]) -> str:
    """The plan as text: one row per chosen value (value, then the rule and figure)."""
    rows = [(k.split(".")[-1], _flow(v), w) for k, v, w in choices(plan)]
    width = max(len(k) for k, _, _ in rows)
    lines = [f"configure: {plan['data']} -> {plan['base']} on {_budget(plan)}", ""]
    for k, v, w in rows:
        lines += [f"  {k:<{width}}  {v}", f"  {'':<{width}}    {w}"]
    for kind, ids in plan["fingerprint"]["anomalies"].items():
        lines.append(f"warning: {kind}: {', '.join(ids[:10])}")
    return "\n".join(lines)


def plan_json(plan: dict[str, Any]) -> str:
    """The plan without its traced config, as JSON."""
    out = {k: v for k, v in plan.items() if k not in ("fit", "choices", "cluster")}
    out["cluster"] = dataclasses.asdict(plan["cluster"])
    fit = {k: v for k, v in plan["fit"].items() if k not in ("cfg", "trace")}
    fit["topology"] = dataclasses.asdict(fit["topology"])
    out["fit"] = fit
    out["choices"] = [{"key": k, "value": v, "why": w} for k, v, w in choices(plan)]
    return json.dumps(out, indent=2, default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o)) + "\n"
