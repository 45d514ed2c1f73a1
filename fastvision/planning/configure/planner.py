"""The plan behind ``fastvision configure DATA``: a 3-D segmentation recipe from the dataset and the GPU.

From the fingerprint (:mod:`fastvision.data.fingerprint`) it chooses, by nnU-Net v2's rules
(``ExperimentPlanner`` and ``get_pool_and_conv_props``; docs/configure.md cites each):

* target spacing: the median spacing; when one axis is 3x coarser than the others and has 3x
  fewer voxels, that axis takes the 10th percentile of its spacings instead (not finer than the
  other axes);
* normalisation: CT clips to the foreground 0.5 / 99.5 percentiles and z-scores with the
  foreground mean and std; other modalities z-score each case over its non-zero voxels;
* patch and topology: a patch with the aspect ratio of the voxel size, as large as 256^3 voxels
  and at most the median resampled shape; an axis is pooled only while its spacing is within 2x of
  the finest and its map holds >= 8 voxels (so the coarsest map edge is about 4); a conv kernel is
  3 along an axis once its spacing is within 2x of the finest, else 1 (3x3x1);
* batch: the largest that fits the memory budget by ``plan``'s estimator (one fake-tensor trace
  of the actual model at the patch), at least 2: the patch shrinks (the axis largest relative to
  the median shape first) until batch 2 fits; at most 5 % of the dataset's voxels per step;
* a thin stack (fewer than 8 resampled voxels along an axis: never pooled, the patch would be
  the whole stack) trains slice-wise: patch depth 1, 3x3x1 kernels, 2x2x1 pooling (a 2-D U-Net);
* sliding window: ROI = the patch, overlap 0.5, Gaussian blending (nnU-Net's predictor).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastvision.errors import ConfigError
from fastvision.planning.configure import rules
from fastvision.planning.configure.recipe import choices, recipe_overrides

log = logging.getLogger(__name__)

def memory_target(gpu: str | None = None, memory: str | None = None):
    """The :class:`~fastvision.planning.devices.GPU` to fit: a named GPU, or a budget (``24GiB``)
    on an A100-80GB's speeds; default the local CUDA device (its own memory where the table lacks
    it), else an A100-80GB."""
    from fastvision.planning.devices import get_gpu, local_gpu

    if gpu and memory:
        raise ConfigError("configure: give --gpu or --memory, not both")
    if memory:
        text = memory.strip().lower().replace(" ", "")
        scale = {"gib": 1.0, "gb": 1e9 / 2**30, "mib": 1 / 1024}
        unit = next((u for u in scale if text.endswith(u)), None)
        try:
            value = float(text[: -len(unit)] if unit else text) * scale[unit or "gib"]
        except ValueError:
            raise ConfigError(f"--memory {memory!r}: expected a size such as 24GiB") from None
        if not 0 < value < float("inf"):  # "0", "nan", "inf" parse as floats
            raise ConfigError(f"--memory {memory!r}: expected a positive size such as 24GiB")
        return dataclasses.replace(get_gpu("A100-80GB"), name=f"{value:.3g} GiB budget", memory_gib=value)
    if gpu is None:
        import torch

        return local_gpu() if torch.cuda.is_available() else get_gpu("A100-80GB")
    return get_gpu(gpu)


# ------------------------------------------------------------------------------ the plan
def plan_geometry(fp: dict[str, Any]) -> dict[str, Any]:
    """Spacing, resampled median shape, 2-D / 3-D and the starting patch of a fingerprint."""
    cases = fp["cases"]
    spacing, spacing_why = rules.target_spacing([c["spacing"] for c in cases], [c["shape_after_crop"] for c in cases])
    shapes = [rules.resampled_shape(c["shape_after_crop"], c["spacing"], spacing) for c in cases]
    median = np.median(np.asarray(shapes, dtype=float), axis=0).tolist()
    thin = rules.thin_axis(median)
    if thin is None:
        patch = rules.initial_patch(spacing, median)
    else:
        inplane = [a for a in range(3) if a != thin]
        p2 = rules.initial_patch([spacing[a] for a in inplane], [median[a] for a in inplane])
        patch = [1] * 3
        for a, p in zip(inplane, p2, strict=True):
            patch[a] = p
    n_voxels = float(np.prod(median)) * len(cases)
    return {"spacing": spacing, "spacing_why": spacing_why, "median_shape": median, "thin_axis": thin,
            "patch": patch, "n_voxels": n_voxels}


def topology_for(geo: dict[str, Any], patch: Sequence[int]) -> rules.Topology:
    """3-D topology, or the in-plane one with depth-1 kernels and strides for a thin stack."""
    thin = geo["thin_axis"]
    if thin is None:
        return rules.topology(geo["spacing"], patch)
    inplane = [a for a in range(3) if a != thin]
    t2 = rules.topology([geo["spacing"][a] for a in inplane], [patch[a] for a in inplane])

    def lift(v: list[int], fill: int) -> list[int]:
        out = [fill] * 3
        for a, x in zip(inplane, v, strict=True):
            out[a] = x
        return out

    return rules.Topology([lift(s, 1) for s in t2.strides], [lift(k, 1) for k in t2.kernels], lift(t2.patch, 1),
                    lift(t2.pools_per_axis, 0))


def _shrink(geo: dict[str, Any], patch: list[int]) -> list[int]:
    thin = geo["thin_axis"]
    if thin is None:
        return rules.shrink_patch(geo["spacing"], patch, geo["median_shape"])
    inplane = [a for a in range(3) if a != thin]
    small = rules.shrink_patch([geo["spacing"][a] for a in inplane], [patch[a] for a in inplane],
                         [geo["median_shape"][a] for a in inplane])
    out = [1] * 3
    for a, p in zip(inplane, small, strict=True):
        out[a] = p
    return out


def fit_budget(geo: dict[str, Any], make_cfg, spec, max_traces: int = 12) -> dict[str, Any]:
    """Shrink the patch until batch 2 fits ``spec`` by plan's estimate, then take the largest batch.

    Args:
        geo: :func:`plan_geometry`'s result.
        make_cfg: ``Topology -> RunConfig`` (the recipe at that patch and network, batch irrelevant).
        spec: the GPU (its ``memory_gib``).

    Returns:
        ``{"topology", "cfg", "batch", "batch_fit", "memory_gib", "traces", "shrunk"}``.
    """
    from fastvision.planning import estimate as est

    cap = spec.memory_gib * 2**30
    patch, traces, shrunk, total, last = list(geo["patch"]), 0, False, None, None
    while True:
        topo = topology_for(geo, patch)
        if len(topo.strides) < 2:  # a patch this small leaves no pooling stage: not a U-Net
            raise ConfigError(f"configure: a {'x'.join(map(str, last or topo.patch))} patch at batch {rules.MIN_BATCH} "
                              f"needs {(total or 0) / 2**30:.1f} GiB, over the {spec.memory_gib:.3g} GiB of "
                              f"{spec.name}, and a patch small enough to fit leaves no pooling stage")
        cfg = make_cfg(topo)
        t = est.trace(cfg, rules.MIN_BATCH)
        traces += 1
        total = est.memory(t).total
        if total <= cap:
            break
        # memory is about linear in voxels: drop axes (nnU-Net's order) until the voxels fit, then re-trace
        last = topo.patch
        want = np.prod(topo.patch) * cap / total
        patch = _shrink(geo, topo.patch)
        while np.prod(patch) > want and any(p > d for p, d in zip(patch, topology_for(geo, patch).divisor,
                                                                  strict=True)):
            smaller = _shrink(geo, patch)
            if smaller == patch:  # the axis nnU-Net's rule picks cannot shrink further
                break
            patch = smaller
        if traces >= max_traces or patch == topo.patch:
            raise ConfigError(f"configure: even a {'x'.join(map(str, topo.patch))} patch at batch {rules.MIN_BATCH} "
                              f"needs {total / 2**30:.1f} GiB, over the {spec.memory_gib:.3g} GiB of {spec.name}")
        shrunk = True
    fit = est.largest_batch(cfg, spec, t)
    cover = max(1, round(geo["n_voxels"] * rules.MAX_DATASET_COVERED / float(np.prod(topo.patch))))
    batch = max(rules.MIN_BATCH, min(fit, cover))
    m = est.memory(t)  # linear in the batch (est.linear_batch's model): no extra trace for the figure
    per_item = (m.activations + m.inputs) / rules.MIN_BATCH * (1 + est.WORKSPACE_FRACTION)
    mem = total + per_item * (batch - rules.MIN_BATCH)
    return {"topology": topo, "cfg": cfg, "batch": batch, "batch_fit": fit, "batch_cover": cover,
            "memory_gib": mem / 2**30, "traces": traces, "shrunk": shrunk, "trace": t,
            "bytes_at_2": total, "bytes_per_item": per_item}


def relative_size_after_crop(cases: Sequence[dict[str, Any]]) -> float:
    """nnU-Net's ``median_relative_size_after_cropping``: median over cases of voxels after / before the crop."""
    return float(np.median([np.prod(c["shape_after_crop"]) / np.prod(c["shape"]) for c in cases]))


def plan_cluster(geo: dict[str, Any], fit: dict[str, Any], spec, gpus: int, channels: int) -> rules.Cluster:
    """:func:`fastvision.planning.configure.rules.cluster` with this plan's figures: the step time by
    ``plan``'s estimator at the per-GPU batch (linear from the batch-2 trace), patch and dataset bytes
    (float32 channels + int64 label, as cached), and the GPU memory the step leaves."""
    from fastvision.planning import estimate as est

    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: expected 1 or more")
    per_gpu = max(1, -(-fit["batch"] // gpus))
    t = fit["trace"]
    step_s = est.step_time(t, spec, est.precision_of(fit["cfg"]))[0] * per_gpu / t.batch
    voxel_bytes = 4 * channels + 8
    used = fit["bytes_at_2"] + fit["bytes_per_item"] * (per_gpu - rules.MIN_BATCH)
    return rules.cluster(fit["batch"], gpus, step_s, float(np.prod(fit["topology"].patch)) * voxel_bytes,
                         geo["n_voxels"] * voxel_bytes, max(0.0, spec.memory_gib * 2**30 - used))


def configure(data: str | Path, *, gpu: str | None = None, memory: str | None = None, base: str = "unet3d",
              fingerprint: dict[str, Any] | None = None, gpus: int = 1, trainer: str | None = None) -> dict[str, Any]:
    """Plan a recipe for the Decathlon folder ``data`` (see the module docstring); ``gpus``: the
    GPUs of the job, each taking ``ceil(batch / gpus)`` of the planned batch; ``trainer``: ``fast`` or
    ``nnunet`` (:mod:`~fastvision.planning.configure.trainer`; None: the base's ``DEFAULT_TRAINER``).

    Returns:
        ``{"fingerprint", "geometry", "fit", "gpu", "base", "choices": [(key, value, why)],
        "overrides": recipe mapping}``; :func:`fastvision.planning.configure.recipe.write_recipe`
        writes it.
    """
    from fastvision.data.fingerprint import fingerprint as take_fingerprint
    from fastvision.planning.configure.trainer import DEFAULT_TRAINER, check_trainer

    if base not in rules.BASES:
        raise ConfigError(f"--base {base!r}: valid: {', '.join(rules.BASES)}")
    trainer = trainer or DEFAULT_TRAINER[base]
    check_trainer(trainer, base)
    fp = fingerprint or take_fingerprint(data)
    spec = memory_target(gpu, memory)
    geo = plan_geometry(fp)
    kept = fp.get("median_relative_size_after_cropping", None)
    norm, norm_why = rules.normalisation(fp["channels"],
                                         relative_size_after_crop(fp["cases"]) if kept is None else kept)

    def make_cfg(topo: rules.Topology):
        from fastvision.config import load
        from fastvision.planning import estimate as est

        cfg = load(rules.BASES[base], [recipe_overrides(fp, geo, topo, norm, base, rules.MIN_BATCH, str(data),
                                                        trainer)])
        cfg = copy.deepcopy(cfg)
        cfg.train.amp = est.amp_for(cfg.train.amp, spec)  # what it means on the target GPU
        return cfg

    fit = fit_budget(geo, make_cfg, spec)
    split = plan_cluster(geo, fit, spec, gpus, len(fp["channels"]))
    plan = {"fingerprint": fp, "geometry": geo, "fit": fit, "gpu": spec.name, "gpu_memory_gib": spec.memory_gib,
            "base": base, "trainer": trainer, "normalisation": norm, "normalisation_why": norm_why, "data": str(data),
            "cluster": split}
    # the folder as an absolute path: the recipe trains from any working directory (a relative one would
    # be read against the directory `train` runs in, not the one `configure` ran in)
    plan["overrides"] = recipe_overrides(fp, geo, fit["topology"], norm, base, split.per_gpu,
                                         str(Path(data).resolve()), trainer, split.gpus)
    plan["overrides"]["data"]["num_workers"] = split.workers
    plan["choices"] = choices(plan)
    return plan
