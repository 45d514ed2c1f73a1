"""Planning rules of ``fastvision configure`` (pure functions of fingerprint figures): nnU-Net v2's
``ExperimentPlanner.determine_fullres_target_spacing``, ``get_plans_for_configuration`` (initial
patch, shrink order) and ``network_topology.get_pool_and_conv_props``, restated; plus the
normalisation and thin-stack choices. docs/configure.md explains each.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

ANISOTROPY = 3.0  # nnU-Net's anisotropy_threshold
MIN_EDGE = 4  # nnU-Net's UNet_featuremap_min_edge_length: pool an axis while its map has >= 2 x this
PATCH_VOXELS_3D = 256**3  # nnU-Net's initial patch volume (before it is clipped and shrunk)
PATCH_PIXELS_2D = 2048**2
BASE_FEATURES, MAX_FEATURES_3D, MAX_FEATURES_2D = 32, 320, 512
MIN_BATCH = 2
MAX_DATASET_COVERED = 0.05  # nnU-Net: a batch covers at most 5 % of the dataset's voxels
OVERLAP = 0.5
MASK_NORM_BELOW = 0.75  # nnU-Net: z-score inside the non-zero mask when the median case keeps < 3/4 after the crop
NNUNET_DA_PROCS = 12  # nnU-Net's get_allowed_n_proc_DA default: CPU augmentation processes per GPU
HOST_COPY_GBS = 1.0  # bytes/s one CPU core cuts and pins from a host-RAM cache (a strided copy; conservative)
BASES = {"unet3d": "unet3d-spleen-fast", "segresnet": "segresnet-brats"}


# ------------------------------------------------------------------------------ rules (pure)
def target_spacing(spacings: Sequence[Sequence[float]], shapes: Sequence[Sequence[int]]) -> tuple[list[float], str]:
    """nnU-Net v2 ``determine_fullres_target_spacing``: the median, or the anisotropic-axis rule.

    Args:
        spacings: per-case spacing (N, 3) in mm; shapes: per-case shape after the crop (N, 3).

    Returns:
        (spacing (3,), the rule applied, as text).
    """
    sp = np.asarray(spacings, dtype=float)
    target = np.percentile(sp, 50, axis=0)
    size = np.percentile(np.asarray(shapes, dtype=float), 50, axis=0)
    worst = int(np.argmax(target))
    others = [i for i in range(len(target)) if i != worst]
    aniso_spacing = target[worst] > ANISOTROPY * max(target[i] for i in others)
    aniso_voxels = size[worst] * ANISOTROPY < min(size[i] for i in others)
    if not (aniso_spacing and aniso_voxels):
        return target.tolist(), "median spacing"
    axis = float(np.percentile(sp[:, worst], 10))
    if axis < max(target[i] for i in others):
        axis = max(target[i] for i in others) + 1e-5
    target[worst] = axis
    return target.tolist(), (f"median, axis {worst} anisotropic ({ANISOTROPY:g}x coarser spacing and {ANISOTROPY:g}x "
                             f"fewer voxels): its 10th percentile {axis:.3g} mm")


def resampled_shape(shape: Sequence[float], spacing: Sequence[float], target: Sequence[float]) -> list[int]:
    """nnU-Net ``compute_new_shape``: round(shape * spacing / target)."""
    return [int(round(n * s / t)) for n, s, t in zip(shape, spacing, target, strict=True)]


def initial_patch(spacing: Sequence[float], median_shape: Sequence[float]) -> list[int]:
    """Aspect ratio of the voxel size (1 / spacing) at 256^3 voxels (2048^2 in 2-D), clipped to the median."""
    tmp = 1 / np.asarray(spacing, dtype=float)
    volume = PATCH_VOXELS_3D if len(spacing) == 3 else PATCH_PIXELS_2D
    patch = [round(v) for v in tmp * (volume / np.prod(tmp)) ** (1 / len(spacing))]
    return [int(min(p, m)) for p, m in zip(patch, median_shape, strict=True)]


@dataclasses.dataclass
class Topology:
    """Network geometry: per-stage strides (stage 0 is 1), per-stage kernels, the padded patch."""

    strides: list[list[int]]
    kernels: list[list[int]]
    patch: list[int]
    pools_per_axis: list[int]

    @property
    def divisor(self) -> list[int]:
        return [2**n for n in self.pools_per_axis]


def topology(spacing: Sequence[float], patch: Sequence[int], min_edge: int = MIN_EDGE) -> Topology:
    """nnU-Net v2 ``get_pool_and_conv_props``: spacing-aware pooling and kernels; patch padded to the divisor."""
    dim = len(spacing)
    cur_sp, cur_size = [float(s) for s in spacing], [float(p) for p in patch]
    strides, kernels, pools, kernel = [[1] * dim], [], [0] * dim, [1] * dim
    while True:
        valid = [i for i in range(dim) if cur_size[i] >= 2 * min_edge]
        if not valid:
            break
        finest = min(cur_sp[i] for i in valid)
        valid = [i for i in valid if cur_sp[i] / finest < 2]
        if len(valid) == 1 and cur_size[valid[0]] < 3 * min_edge:
            break
        if not valid:
            break
        for d in range(dim):
            if kernel[d] != 3 and cur_sp[d] / min(cur_sp) < 2:
                kernel[d] = 3
        step = [2 if i in valid else 1 for i in range(dim)]
        for i in valid:
            pools[i] += 1
            cur_sp[i] *= 2
            cur_size[i] = math.ceil(cur_size[i] / 2)
        strides.append(step)
        kernels.append(list(kernel))
    kernels.append([3] * dim)  # the bottleneck
    div = [2**n for n in pools]
    padded = [int(math.ceil(p / d) * d) for p, d in zip(patch, div, strict=True)]
    return Topology(strides, kernels, padded, pools)


def shrink_patch(spacing: Sequence[float], patch: Sequence[int], median_shape: Sequence[float]) -> list[int]:
    """One nnU-Net shrink step: the axis largest relative to the median shape loses one divisor step."""
    patch = list(patch)
    axis = int(np.argsort([p / m for p, m in zip(patch, median_shape, strict=True)])[-1])
    trial = list(patch)
    trial[axis] -= topology(spacing, patch).divisor[axis]
    step = topology(spacing, trial).divisor[axis] if trial[axis] > 0 else topology(spacing, patch).divisor[axis]
    patch[axis] = max(1, patch[axis] - step)
    return topology(spacing, patch).patch


def features(stages: int, max_features: int) -> list[int]:
    """nnU-Net's widths: 32 x 2^i, capped."""
    return [min(BASE_FEATURES * 2**i, max_features) for i in range(stages)]


def normalisation(channels: list[dict[str, Any]], relative_size_after_crop: float = 0.0) -> tuple[dict[str, Any], str]:
    """``data.args`` intensity keys and the reason: CT -> clip + z-score as one window; else per-case z-score,
    over the non-zero mask only where the crop to the non-zero region kept less than 3/4 of the median
    case (nnU-Net v2 ``determine_normalization_scheme_and_whether_mask_is_used_for_norm``), else over
    every voxel.

    Args:
        channels: the fingerprint's per-channel records (``modality`` and, for CT, the statistics).
        relative_size_after_crop: the fingerprint's ``median_relative_size_after_cropping``
            (voxels after the crop / before, the median over cases).
    """
    mods = [str(c["modality"]).upper() for c in channels]
    if mods == ["CT"]:
        c = channels[0]
        lo, hi, mean, std = c["percentile_00_5"], c["percentile_99_5"], c["mean"], max(c["std"], 1e-8)
        window = [round(lo, 4), round(hi, 4), round((lo - mean) / std, 6), round((hi - mean) / std, 6)]
        return {"intensity": "ct", "window": window}, (
            f"CT: clip to foreground p0.5..p99.5 = {lo:.4g}..{hi:.4g}, z-score with mean {mean:.4g} std {std:.4g}")
    kept = float(relative_size_after_crop)
    if kept < MASK_NORM_BELOW:
        intensity, over = "mri", (f"over non-zero voxels: the crop to the non-zero region keeps {kept:.0%} of the "
                                  f"median case (< {MASK_NORM_BELOW:.0%})")
    else:
        intensity, over = "zscore", (f"over every voxel: the crop to the non-zero region keeps {kept:.0%} of the "
                                     f"median case (>= {MASK_NORM_BELOW:.0%}, so zeros are image, not background)")
    why = f"per-case z-score {over} (" + ", ".join(map(str, mods)) + ")"
    if "CT" in mods:
        why += "; CT beside other channels: one scheme serves all channels, so CT is z-scored too"
    return {"intensity": intensity}, why


@dataclasses.dataclass
class Cluster:
    """The batch and CPU workers of one GPU among ``gpus`` (see :func:`cluster`)."""

    gpus: int
    per_gpu: int
    global_batch: int
    workers: int
    why_batch: str
    why_workers: str


def cluster(batch: int, gpus: int, step_s: float, item_bytes: float, dataset_bytes: float,
            free_bytes: float) -> Cluster:
    """Split nnU-Net's global batch over ``gpus`` and count the CPU workers one GPU needs.

    nnU-Net plans one batch for one GPU and, under DDP, splits that global batch over the GPUs
    (``nnUNetTrainer._set_batch_size_and_oversample``); fastvision's ``train.batch_size`` is per GPU
    and equal on every rank, so it is ``ceil(batch / gpus)`` (at least 1 item per GPU: the global
    batch grows to ``gpus`` where it was smaller). fastvision augments batched on the GPU, so CPU
    workers only cut patches from a host-RAM cache: none where this GPU's share of the cache
    (``data.cache: gpu`` holds the items its rank reads in the epoch, ``ceil(n / gpus)`` of ``n``:
    ``1 / gpus`` of the dataset under DDP) fits beside the step, else enough cores to cut
    ``per_gpu`` patches per step at ``HOST_COPY_GBS`` each.

    Args:
        batch: the planned (global) batch; gpus: GPUs of the job (>= 1).
        step_s: estimated seconds per step at the per-GPU batch.
        item_bytes: bytes of one training patch (image channels float32 + label).
        dataset_bytes: the preprocessed dataset (float32 images + labels).
        free_bytes: GPU memory left beside the training step.
    """
    per_gpu = max(1, math.ceil(batch / gpus))
    why_batch = (f"nnU-Net's global batch {batch} split over {gpus} GPUs: ceil({batch} / {gpus}) = {per_gpu} per GPU, "
                 f"global {per_gpu * gpus}")
    share = dataset_bytes / gpus
    if share <= free_bytes:
        workers = 0
        why = (f"augmentation runs batched on the GPU and this GPU's 1/{gpus} of the dataset "
               f"({share / 2**30:.2f} GiB) fits beside the step ({free_bytes / 2**30:.1f} GiB free): the training "
               f"process feeds it, no CPU worker (nnU-Net: {NNUNET_DA_PROCS} augmentation processes per GPU)")
    else:
        need = per_gpu * item_bytes / max(step_s, 1e-6)
        workers = max(1, math.ceil(need / (HOST_COPY_GBS * 1e9)))
        why = (f"this GPU's 1/{gpus} of the dataset ({share / 2**30:.1f} GiB) exceeds the {free_bytes / 2**30:.1f} GiB "
               f"free: patches are cut on the host, {need / 1e6:.0f} MB/s at an estimated {step_s * 1e3:.0f} ms per "
               f"step, {HOST_COPY_GBS:g} GB/s per core; augmentation stays on the GPU (nnU-Net: "
               f"{NNUNET_DA_PROCS} processes per GPU)")
    return Cluster(gpus, per_gpu, per_gpu * gpus, workers, why_batch, why)


def thin_axis(median_shape: Sequence[float], min_edge: int = MIN_EDGE) -> int | None:
    """The axis of a thin stack (fewer than 2 x min_edge resampled voxels), else None."""
    axis = int(np.argmin(median_shape))
    return axis if median_shape[axis] < 2 * min_edge else None
