"""Whole-volume inference: sliding-window prediction, flip test-time augmentation, NIfTI writers.

:func:`sliding_window` tiles a 2-D or 3-D input with overlapping ROIs, runs the model on batches of
windows and blends the outputs with a constant or Gaussian weight, the scheme of MONAI's
``sliding_window_inference`` (same window positions and weights, so results agree to float
rounding). :func:`flip_tta` averages predictions over mirrored inputs. :func:`write_nifti` and
:func:`save_segmentation` write predictions in the geometry (affine and header) of the input file;
:func:`predict_nifti_files` runs all of it for ``fastvision predict`` on NIfTI files and BraTS folders.
"""
from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

Predictor = Callable[[Tensor], Tensor]


def window_starts(size: int, roi: int, overlap: float) -> list[int]:
    """Start offsets of the windows along one axis.

    The step is ``int(roi * (1 - overlap))`` (at least 1; a ROI filling the axis is one window).
    Windows are placed at multiples of the step and the last one is shifted back to end at the
    border, so every voxel is covered and no window leaves the volume.
    """
    if roi >= size:
        return [0]
    step = max(1, int(roi * (1 - overlap)))
    count = math.ceil((size - roi) / step) + 1
    return [min(i * step, size - roi) for i in range(count)]


def importance_map(roi: Sequence[int], mode: str = "gaussian", sigma_scale: float = 0.125,
                   device: torch.device | str = "cpu") -> Tensor:
    """Per-voxel blending weight of one window.

    Args:
        roi: window shape (*R).
        mode: "constant" (all ones) or "gaussian" (separable Gaussian, sigma = sigma_scale * edge,
            centred on the window; floored at 1e-3 so border voxels still count where only one
            window covers them).
        sigma_scale: Gaussian width relative to each window edge.

    Returns:
        float32 tensor (*R).
    """
    if mode == "constant":
        return torch.ones(tuple(roi), device=device)
    if mode != "gaussian":
        raise ValueError(f"blend mode must be 'constant' or 'gaussian', got {mode!r}")
    w = torch.ones((), device=device)
    for n in roi:
        x = torch.arange(n, dtype=torch.float32, device=device) - (n - 1) / 2.0
        g = torch.exp(-(x**2) / (2 * (sigma_scale * n) ** 2))
        w = w[..., None] * g
    return w.clamp(min=1e-3)


@torch.no_grad()
def sliding_window(predict: Predictor, x: Tensor, roi: Sequence[int], *, overlap: float = 0.25,
                   mode: str = "gaussian", sigma_scale: float = 0.125, sw_batch_size: int = 1,
                   device: torch.device | str | None = None, pad_value: float = 0.0) -> Tensor:
    """Sliding-window prediction over a batch of 2-D or 3-D images.

    Args:
        predict: maps windows (N, C, *R) to outputs (N, K, *R) on the input's device (e.g. a model
            under autocast; apply softmax inside it to blend probabilities instead of logits).
        x: (B, C, *S) input with len(S) in (2, 3); it stays on its device, where windows run.
        roi: window shape (*R); an entry <= 0 means the whole axis. Axes smaller than the ROI are
            padded symmetrically with ``pad_value`` and the padding is cropped from the result.
        overlap: fraction of the ROI shared by neighbouring windows, in [0, 1).
        mode: "gaussian" or "constant" blending (:func:`importance_map`).
        sigma_scale: Gaussian width relative to the ROI edge.
        sw_batch_size: windows per ``predict`` call.
        device: where outputs are accumulated and returned (default: ``x.device``); use "cpu" for
            volumes whose output does not fit next to the model on the GPU.

    Returns:
        (B, K, *S) float32 blended outputs.
    """
    dims = x.dim() - 2
    if dims not in (2, 3) or len(roi) != dims:
        raise ValueError(f"input (B, C, *S) with 2 or 3 spatial dims and a matching roi, got {tuple(x.shape)}, {roi}")
    if not 0 <= overlap < 1:
        raise ValueError(f"overlap must be in [0, 1), got {overlap}")
    out_device = torch.device(device) if device is not None else x.device
    size = tuple(x.shape[2:])
    roi = tuple(s if r <= 0 else int(r) for r, s in zip(roi, size))
    pad = [max(0, r - s) for r, s in zip(roi, size)]
    if any(pad):
        # F.pad lists the last axis first.
        x = F.pad(x, [p for d in reversed(pad) for p in (d // 2, d - d // 2)], value=pad_value)
    padded = tuple(x.shape[2:])
    starts = list(itertools.product(*[window_starts(s, r, overlap) for s, r in zip(padded, roi)]))
    weight = importance_map(roi, mode, sigma_scale, device=out_device)
    out = None
    norm = torch.zeros(padded, device=out_device)
    for start in starts:  # the normaliser depends only on the window layout, not on the batch
        norm[tuple(slice(a, a + r) for a, r in zip(start, roi))] += weight
    jobs = [(b, s) for b in range(x.shape[0]) for s in starts]
    for i in range(0, len(jobs), sw_batch_size):
        chunk = jobs[i: i + sw_batch_size]
        sls = [tuple(slice(a, a + r) for a, r in zip(s, roi)) for _, s in chunk]
        windows = torch.stack([x[(b, slice(None)) + sl] for (b, _), sl in zip(chunk, sls)])
        pred = predict(windows).to(out_device, torch.float32)
        if out is None:
            out = torch.zeros((x.shape[0], pred.shape[1], *padded), device=out_device)
        for (b, _), sl, p in zip(chunk, sls, pred):
            out[(b, slice(None)) + sl] += p * weight
    out = out / norm
    crop = tuple(slice(d // 2, d // 2 + s) for d, s in zip(pad, size))
    return out[(slice(None), slice(None)) + crop]


def sliding_window_inference(inputs: Tensor, model: Predictor, roi_size: Sequence[int], *, overlap: float = 0.25,
                             mode: str = "gaussian", sigma_scale: float = 0.125, sw_batch_size: int = 1,
                             device: torch.device | str | None = None, tta_flips: Sequence[int] = ()) -> Tensor:
    """Keyword form used by recipes (``task.args.sliding_window``): :func:`sliding_window` of ``model``.

    Args:
        inputs: (B, C, *S); model: (N, C, *R) -> (N, K, *R); roi_size, overlap, mode, sigma_scale,
            sw_batch_size, device: as :func:`sliding_window`.
        tta_flips: spatial axes (0-based, of *S) to mirror for :func:`flip_tta`; empty = no TTA.

    Returns:
        (B, K, *S) blended logits.
    """
    def run(x: Tensor) -> Tensor:
        return sliding_window(model, x, roi_size, overlap=overlap, mode=mode, sigma_scale=sigma_scale,
                              sw_batch_size=sw_batch_size, device=device)

    if tta_flips:
        return flip_tta(run, inputs, dims=[2 + d for d in tta_flips])
    return run(inputs)


def flip_tta(predict: Predictor, x: Tensor, dims: Sequence[int] = (2, 3, 4)) -> Tensor:
    """Average ``predict`` over the input mirrored along every subset of ``dims``.

    Each prediction is flipped back before averaging, so with three axes this is the eight-way
    mirroring of nnU-Net (the unflipped input included).

    Args:
        predict: (B, C, *S) -> (B, K, *S), e.g. a :func:`sliding_window` closure returning
            probabilities.
        x: (B, C, *S) input.
        dims: tensor axes to mirror (spatial axes are 2.. for (B, C, *S)).

    Returns:
        (B, K, *S) mean prediction.
    """
    total = None
    subsets = [c for k in range(len(dims) + 1) for c in itertools.combinations(dims, k)]
    for flip in subsets:
        y = predict(torch.flip(x, flip) if flip else x)
        y = torch.flip(y, flip) if flip else y
        total = y.float() if total is None else total + y
    return total / len(subsets)


def write_nifti(array: np.ndarray | Tensor, reference_nifti_path: str | Path, out_path: str | Path) -> Path:
    """Write ``array`` with the affine, header fields and orientation codes of a reference file.

    Args:
        array: (X, Y, Z[, ...]) data already on the reference's voxel grid (see
            :func:`fastvision.data.preprocess3d.restore_to_input`); its dtype is kept.
        reference_nifti_path: the input image the prediction belongs to.
        out_path: output ``.nii.gz`` path (parent folders are created).

    Returns:
        ``out_path``.
    """
    import nibabel as nib

    from .errors import DataError

    data = array.detach().cpu().numpy() if isinstance(array, Tensor) else np.asarray(array)
    ref = nib.load(str(reference_nifti_path))
    if data.shape[:3] != ref.shape[:3]:
        raise DataError(f"prediction grid {data.shape[:3]} differs from {reference_nifti_path} {ref.shape[:3]}")
    header = ref.header.copy()
    header.set_data_dtype(data.dtype)
    img = nib.Nifti1Image(data, ref.affine, header=header)
    img.header.set_slope_inter(1.0, 0.0)  # labels must not inherit the image's intensity scaling
    img.set_qform(ref.header.get_qform(), code=int(ref.header["qform_code"]))
    img.set_sform(ref.header.get_sform(), code=int(ref.header["sform_code"]))
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(img, str(out_path))
    return out_path


def save_segmentation(label: Tensor, meta: dict, reference_nifti_path: str | Path, out_path: str | Path,
                      brats_ids: bool = False) -> Path:
    """Write a predicted label map (on the preprocessed grid) in the input file's space.

    Args:
        label: (X, Y, Z) integer class indices on the preprocessed (RAS, resampled, cropped) grid.
        meta: the case's preprocessing ``meta`` (``VolumeDataset.meta(i)``).
        reference_nifti_path: the case's (first) input image.
        out_path: output path.
        brats_ids: map class 3 back to BraTS label 4.
    """
    from .data.preprocess3d import remap_labels, restore_to_input

    label = label.long()
    if brats_ids:
        label = remap_labels(label, ((3, 4),))
    arr = restore_to_input(label.cpu(), meta, mode="nearest").astype(np.uint8)
    return write_nifti(arr, reference_nifti_path, out_path)


# ----------------------------------------------------------------------------- NIfTI prediction
_BRATS_FILE = re.compile(r"^(?P<case>.+)_(?P<mod>flair|t1|t1ce|t2|seg)(?P<ext>\.nii(\.gz)?)$")


def prediction_cases(files: Sequence[str | Path]) -> list[dict]:
    """Group prediction inputs into cases ``{"id": str, "image": [paths]}``.

    A NIfTI file is one case (a 4-D file carries its channels). A folder holds raw BraTS cases
    (``<case>_{flair,t1,t1ce,t2}.nii.gz``, any nesting). Loose files named like BraTS modalities
    (what a folder expands to) are grouped into their case in FLAIR, T1, T1ce, T2 order; ``_seg``
    files are skipped.
    """
    from .data.formats.brats import MODALITIES, find_cases
    from .errors import DataError

    cases, grouped = [], set()
    for f in map(Path, files):
        if f.is_dir():
            cases += [{"id": c["id"], "image": c["image"]} for c in find_cases(f)]
            continue
        if not f.name.endswith((".nii", ".nii.gz")):
            raise DataError(f"{f}: expected a NIfTI file (.nii / .nii.gz) or a BraTS case folder")
        m = _BRATS_FILE.match(f.name)
        siblings = [f.parent / f"{m['case']}_{mod}{m['ext']}" for mod in MODALITIES] if m else []
        if m and all(p.is_file() for p in siblings):
            if (f.parent, m["case"]) not in grouped:
                grouped.add((f.parent, m["case"]))
                cases.append({"id": m["case"], "image": siblings})
            continue
        name = f.name
        cases.append({"id": name[: -len(".nii.gz")] if name.endswith(".nii.gz") else f.stem, "image": [f]})
    return cases


def _brats_release_uses_4(data_args: dict) -> bool:
    """Predictions go out in the training release's ids: 2017-2021 write enhancing tumour as 4,
    2023-2024 GLI as 3. Decided from the training folder when it is still there (else 4)."""
    from .data.formats.brats_layouts import detect
    from .errors import DataError

    path = data_args.get("path")
    try:
        return detect(path).name != "brats2023-gli" if path else True
    except DataError:
        return True


def prediction_preprocessing(task, data_name: str, data_args: dict) -> tuple[Any, bool]:
    """The run's preprocessing (from ``cfg.data.args``) and whether outputs use BraTS ids (3 -> 4).

    Decathlon runs read the run's ``dataset.json`` (if still at ``data.args.path``) to resolve
    ``intensity: auto`` and to recognise Task01 (BraTS ids); without it, ``intensity`` must be set
    and a 4-channel, 4-class task counts as BraTS.

    Returns:
        (:class:`~fastvision.data.preprocess3d.PreprocessParams`, brats_ids).
    """
    import json

    from .data.preprocess3d import PreprocessParams
    from .errors import ConfigError

    if data_name not in ("decathlon", "brats"):
        raise ConfigError(f"NIfTI prediction needs a decathlon or brats run, this one used data.name={data_name!r}")
    spacing = data_args.get("target_spacing")
    common = {"target_spacing": tuple(map(float, spacing)) if spacing else None,
              "crop_foreground": bool(data_args.get("crop_foreground", True)),
              "crop_margin": int(data_args.get("crop_margin", 0))}
    if data_name == "brats":
        return PreprocessParams(intensity="mri", **common), _brats_release_uses_4(data_args)
    meta_file = Path(str(data_args.get("path", ""))) / "dataset.json"
    meta = json.loads(meta_file.read_text()) if data_args.get("path") and meta_file.is_file() else None
    intensity = data_args.get("intensity", "auto")
    if intensity == "auto":
        if meta is None:
            raise ConfigError(f"data.args.intensity=auto needs {meta_file} to tell CT from MRI; it is gone")
        intensity = "ct" if [str(m).upper() for m in meta.get("modality", {}).values()] == ["CT"] else "mri"
    if meta is not None:
        names = {str(v).lower() for v in meta.get("labels", {}).values()}
        brats = {"edema", "non-enhancing tumor", "enhancing tumour"} <= names
    else:
        brats = getattr(task, "num_classes", 0) == 4 and tuple(getattr(task, "sample_shape", ()))[:1] == (4,)
    window = tuple(map(float, data_args.get("window", (-57.0, 164.0, 0.0, 1.0))))
    return PreprocessParams(intensity=intensity, window=window, **common), brats


def regions_to_classes(masks: Tensor, regions: Sequence[Sequence[int]]) -> Tensor:
    """Nested region masks -> class indices, inner regions painted over outer ones.

    Each region is labelled with the one class it holds that no region inside it holds (BraTS
    WT {1,2,3} -> 2, TC {1,3} -> 1, ET {3} -> 3), so ET wins over TC and TC over WT.

    Args:
        masks: (B, R, *S) bool predictions, one channel per entry of ``regions``.
        regions: class ids of each region, e.g. ``[[1, 2, 3], [1, 3], [3]]``.

    Returns:
        (B, *S) int64.
    """
    from .errors import ConfigError

    sets = [set(r) for r in regions]
    label = torch.zeros((masks.shape[0], *masks.shape[2:]), dtype=torch.long, device=masks.device)
    for r in sorted(range(len(sets)), key=lambda i: -len(sets[i])):
        own = sets[r] - set().union(*[s for s in sets if s < sets[r]])
        if len(own) != 1:
            raise ConfigError(f"task.args.regions {list(map(list, regions))} are not nested; cannot map to labels")
        label[masks[:, r]] = own.pop()
    return label


@torch.no_grad()
def predict_nifti_files(task, model: torch.nn.Module, files: Sequence[Path], out_dir: Path, cfg,
                        device: torch.device) -> list[Path]:
    """Segment NIfTI volumes (or raw BraTS case folders) and write ``OUT/<case>.nii.gz`` per case.

    Each case is preprocessed as the run's dataset did (``cfg.data.args``), predicted with the
    task's ``sliding_window`` settings (``task.eval_forward``), turned into class indices (argmax,
    or regions -> labels for sigmoid regions), returned to the input's voxel grid and written with
    the input's affine and header; BraTS / Task01 runs write BraTS ids (3 -> 4).

    Args:
        task: a :class:`~fastvision.tasks.segment.SegmentationTask`.
        model: the trained model (put in eval mode here).
        files: NIfTI files and/or BraTS case folders (:func:`prediction_cases`).
        out_dir: output folder (created).
        cfg: the run's config (``data.name``, ``data.args``, ``train.amp``).
        device: where the model runs.

    Returns:
        Written segmentation paths, one per case.
    """
    from .data.preprocess3d import preprocess_case

    params, brats_ids = prediction_preprocessing(task, cfg.data.name, cfg.data.args)
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.train.amp) if device.type == "cuda" else None
    model.eval()
    written = []
    for case in prediction_cases(files):
        pre = preprocess_case({"image": case["image"], "label": None}, params)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            logits = task.eval_forward(model, {"image": pre["image"][None].to(device)}).float()
        pred = task.predict_labels(logits)
        if task.mode == "regions":
            pred = regions_to_classes(pred, task.regions)
        out = Path(out_dir) / f"{case['id']}.nii.gz"
        written.append(save_segmentation(pred[0], pre["meta"], case["image"][0], out, brats_ids=brats_ids))
    return written
