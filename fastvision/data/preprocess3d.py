"""Deterministic 3-D preprocessing of NIfTI volumes, run once per case and then cached.

Steps, in order (the same order as MONAI's spleen and BraTS tutorials):
load -> reorient to RAS -> resample to a target spacing -> intensity (CT window or MRI foreground
z-score) -> crop to the foreground box. :func:`preprocess_case` is a pure function of file paths
and :class:`PreprocessParams`, so its output can be stored in a persistent cache keyed on both.
:func:`restore_to_input` inverts the geometry (crop, resampling, orientation) so predictions can be
written back in the voxel space of the input file.

Axis order: arrays are ``(C, X, Y, Z)`` where X, Y, Z are the NIfTI voxel axes (i, j, k) after
reorientation to RAS: index i grows towards world +x (Right), j towards +y (Anterior), k towards
+z (Superior), as nibabel's RAS+ world convention defines them. This is the order of MONAI's ``LoadImage`` +
``Orientation("RAS")``, so ROI sizes from MONAI recipes (e.g. 240x240x160 for BraTS) carry over.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fastvision.errors import DataError

try:  # nibabel is the optional "medical" extra
    import nibabel as nib
    from nibabel import orientations as nio
except ModuleNotFoundError:  # pragma: no cover - reported when used
    nib = None


def _need_nibabel() -> None:
    if nib is None:
        raise DataError("reading NIfTI needs nibabel: pip install 'fastvision[medical]'")


@dataclass(frozen=True)
class PreprocessParams:
    """Everything that changes the cached result; part of the cache key.

    Attributes:
        target_spacing: output voxel size in mm along (X, Y, Z), or None to keep the input grid.
        intensity: "ct" (window ``window``), "mri" (per-channel z-score on non-zero voxels) or "none".
        window: CT window ``(a_min, a_max, b_min, b_max)`` in HU -> output range, clipped.
        crop_foreground: crop to the bounding box of the foreground (MRI: any channel != 0;
            CT: any channel > a_min), plus ``crop_margin`` voxels.
        crop_margin: margin in voxels around the foreground box.
        label_map: ``((from, to), ...)`` applied to label values on load (BraTS: ``((4, 3),)``).
    """

    target_spacing: tuple[float, float, float] | None = None
    intensity: str = "mri"
    window: tuple[float, float, float, float] = (-57.0, 164.0, 0.0, 1.0)
    crop_foreground: bool = True
    crop_margin: int = 0
    label_map: tuple[tuple[int, int], ...] = ()

    def key(self) -> dict[str, Any]:
        """Plain-data form for hashing into a cache key."""
        return asdict(self)


def load_nifti(path: str | Path) -> tuple[np.ndarray, np.ndarray, Any]:
    """Read a NIfTI file.

    Returns:
        (data, affine, header): data as stored (X, Y, Z[, T]) in float32 for images, the 4x4
        voxel-to-world affine (float64) and the nibabel header.
    """
    _need_nibabel()
    try:
        img = nib.load(str(path))
        data = np.asanyarray(img.dataobj)
    except FileNotFoundError as e:
        raise DataError(f"missing NIfTI file {path}") from e
    except Exception as e:  # nibabel raises several types for corrupt files
        raise DataError(f"cannot read NIfTI file {path}: {e}") from e
    return data, np.asarray(img.affine, dtype=np.float64), img.header


def orientation_to_ras(affine: np.ndarray) -> np.ndarray:
    """nibabel orientation transform (3, 2) taking the voxel axes of ``affine`` to RAS."""
    return nio.ornt_transform(nio.io_orientation(affine), nio.axcodes2ornt("RAS"))


def reorient(array: np.ndarray, affine: np.ndarray, ornt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Permute/flip the first three axes of ``array`` by ``ornt`` and update the affine.

    Args:
        array: (X, Y, Z, ...) voxel data; trailing axes are carried along.
        affine: 4x4 voxel-to-world matrix of ``array``.
        ornt: (3, 2) nibabel orientation transform.

    Returns:
        (array, affine) such that every voxel keeps its world position.
    """
    out = nio.apply_orientation(array, ornt)
    new_affine = affine @ nio.inv_ornt_aff(ornt, array.shape[:3])
    return np.ascontiguousarray(out), new_affine


def spacing_of(affine: np.ndarray) -> np.ndarray:
    """Voxel sizes (3,) in mm: the column norms of the affine's 3x3 block."""
    return np.sqrt((np.asarray(affine)[:3, :3] ** 2).sum(axis=0))


def resampled_shape(shape: Sequence[int], spacing: Sequence[float], target: Sequence[float]) -> tuple[int, ...]:
    """Grid size covering the same extent at ``target`` spacing: round(n * spacing / target)."""
    return tuple(max(1, int(round(n * s / t))) for n, s, t in zip(shape, spacing, target))


def resample(x: torch.Tensor, affine: np.ndarray, shape: Sequence[int], mode: str) -> tuple[torch.Tensor, np.ndarray]:
    """Resample a channel-first volume onto a grid of ``shape`` voxels covering the same extent.

    Voxel centres follow ``align_corners=False``: new voxel i sits at old continuous index
    ``(i + 0.5) * s - 0.5`` with ``s = old_n / new_n``, which the returned affine encodes exactly.
    Labels use "nearest-exact" (torch's "nearest" is off by half a voxel for this convention).

    Args:
        x: (C, X, Y, Z) tensor; float for "trilinear", any dtype for "nearest".
        affine: 4x4 affine of ``x``.
        shape: output spatial shape (3,).
        mode: "trilinear" or "nearest".

    Returns:
        (tensor (C, *shape), new affine).
    """
    old = np.asarray(x.shape[1:], dtype=np.float64)
    scale = old / np.asarray(shape, dtype=np.float64)
    step = np.eye(4)
    step[:3, :3] = np.diag(scale)
    step[:3, 3] = (scale - 1.0) / 2.0
    if tuple(shape) == tuple(x.shape[1:]):
        return x, affine
    if mode == "nearest":
        y = F.interpolate(x[None].float(), size=tuple(shape), mode="nearest-exact")[0].to(x.dtype)
    else:
        y = F.interpolate(x[None].float(), size=tuple(shape), mode="trilinear", align_corners=False)[0]
    return y, affine @ step


def window(x: torch.Tensor, a_min: float, a_max: float, b_min: float, b_max: float, clip: bool = True) -> torch.Tensor:
    """Linear map of ``[a_min, a_max]`` (e.g. HU) onto ``[b_min, b_max]``, optionally clipped."""
    y = (x - a_min) / (a_max - a_min) * (b_max - b_min) + b_min
    return y.clamp(min(b_min, b_max), max(b_min, b_max)) if clip else y


def zscore_nonzero(x: torch.Tensor) -> torch.Tensor:
    """Per-channel z-score over the non-zero voxels; zeros (outside the head) stay zero.

    Uses the population std (as MONAI ``NormalizeIntensity(nonzero=True, channel_wise=True)``); a
    constant channel is only mean-shifted.

    Args:
        x: (C, *S) float tensor.
    """
    out = x.clone()
    for c in range(x.shape[0]):
        mask = x[c] != 0
        if not bool(mask.any()):
            continue
        v = x[c][mask].double()
        mean, std = v.mean(), v.std(unbiased=False)
        std = std if std > 0 else torch.ones_like(std)
        out[c][mask] = ((v - mean) / std).to(x.dtype)
    return out


def foreground_box(mask: torch.Tensor, margin: int = 0) -> list[tuple[int, int]]:
    """Half-open bounding box ``[(start, stop)] * ndim`` of a bool mask, grown by ``margin``.

    An empty mask gives the whole volume.
    """
    box = []
    for axis, n in enumerate(mask.shape):
        other = tuple(a for a in range(mask.dim()) if a != axis)
        hits = torch.nonzero(mask.any(dim=other) if other else mask).flatten()
        if hits.numel() == 0:
            return [(0, s) for s in mask.shape]
        box.append((max(0, int(hits[0]) - margin), min(n, int(hits[-1]) + 1 + margin)))
    return box


def remap_labels(label: torch.Tensor, mapping: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Replace label values by ``mapping`` pairs simultaneously (so swaps such as 1<->2 work)."""
    if not mapping:
        return label
    out = label.clone()
    for src, dst in mapping:
        out[label == src] = dst
    return out


def _read_channels(paths: Sequence[str | Path]) -> tuple[np.ndarray, np.ndarray, Any]:
    """Stack image files into (X, Y, Z, C); a 4-D file contributes its last axis as channels."""
    arrays, affine, header = [], None, None
    for p in paths:
        data, aff, hdr = load_nifti(p)
        if data.ndim == 3:
            data = data[..., None]
        elif data.ndim != 4:
            raise DataError(f"{p}: expected a 3-D or 4-D NIfTI image, got shape {data.shape}")
        if affine is None:
            affine, header = aff, hdr
        elif data.shape[:3] != arrays[0].shape[:3] or not np.allclose(aff, affine, atol=1e-3):
            raise DataError(f"{p}: grid (shape/affine) differs from {paths[0]}")
        arrays.append(np.asarray(data, dtype=np.float32))
    return np.concatenate(arrays, axis=-1), affine, header


def preprocess_case(paths: dict[str, Any], params: PreprocessParams) -> dict[str, Any]:
    """Load and preprocess one case; a pure function of its arguments (safe to cache).

    Args:
        paths: ``{"image": [path, ...], "label": path or None}``; image files are stacked as
            channels in the given order.
        params: preprocessing settings.

    Returns:
        ``{"image": float32 (C, X, Y, Z), "label": uint8 (X, Y, Z) (only with a label file),
        "meta": dict}`` with tensors in RAS voxel order. ``meta`` holds what
        :func:`restore_to_input` needs: ``input_affine`` (4, 4), ``input_shape``, ``ras_shape``,
        ``resampled_shape``, ``crop_box`` and the final ``affine`` and ``spacing``.
    """
    data, in_affine, _ = _read_channels(paths["image"])
    input_shape = list(data.shape[:3])
    ornt = orientation_to_ras(in_affine)
    data, affine = reorient(data, in_affine, ornt)
    ras_shape = data.shape[:3]
    image = torch.from_numpy(np.moveaxis(data, -1, 0).copy())
    label = None
    if paths.get("label"):
        lab, lab_affine, _ = load_nifti(paths["label"])
        lab, _ = reorient(np.asarray(lab).astype(np.int16), lab_affine, orientation_to_ras(lab_affine))
        if lab.shape != tuple(ras_shape):
            raise DataError(f"{paths['label']}: label grid {lab.shape} does not match image {tuple(ras_shape)}")
        label = remap_labels(torch.from_numpy(lab.astype(np.int64)), params.label_map)[None]

    if params.target_spacing is not None:
        shape = resampled_shape(ras_shape, spacing_of(affine), params.target_spacing)
        image, new_affine = resample(image, affine, shape, "trilinear")
        if label is not None:
            label, _ = resample(label, affine, shape, "nearest")
        affine = new_affine
    res_shape = tuple(image.shape[1:])

    if params.intensity == "ct":
        fg = (image > params.window[0]).any(0)
        image = window(image, *params.window)
    elif params.intensity == "mri":
        fg = (image != 0).any(0)
        image = zscore_nonzero(image)
    elif params.intensity == "none":
        fg = (image != 0).any(0)
    else:
        raise DataError(f"preprocess intensity must be ct, mri or none, got {params.intensity!r}")

    box = foreground_box(fg, params.crop_margin) if params.crop_foreground else [(0, n) for n in res_shape]
    sl = tuple(slice(a, b) for a, b in box)
    image = image[(slice(None),) + sl].contiguous()
    shift = np.eye(4)
    shift[:3, 3] = [a for a, _ in box]
    affine = affine @ shift
    out: dict[str, Any] = {
        "image": image.float(),
        "meta": {
            "input_affine": torch.from_numpy(in_affine),
            "input_shape": input_shape,
            "ras_shape": list(ras_shape),
            "resampled_shape": list(res_shape),
            "crop_box": [list(b) for b in box],
            "affine": torch.from_numpy(affine),
            "spacing": spacing_of(affine).tolist(),
        },
    }
    if label is not None:
        out["label"] = label[0][sl].to(torch.uint8).contiguous()
    return out


def restore_to_input(x: torch.Tensor, meta: dict[str, Any], mode: str = "nearest") -> np.ndarray:
    """Invert crop, resampling and reorientation: back to the input file's voxel grid.

    Args:
        x: (*S) labels or (C, *S) values on the preprocessed grid (shape of the cropped volume).
        meta: ``meta`` of :func:`preprocess_case`.
        mode: "nearest" for labels, "trilinear" for probabilities.

    Returns:
        numpy array (X, Y, Z) or (X, Y, Z, C) in the input file's voxel order.
    """
    squeeze = x.dim() == 3
    x = x[None] if squeeze else x
    full = x.new_zeros((x.shape[0], *meta["resampled_shape"]))
    sl = tuple(slice(a, b) for a, b in meta["crop_box"])
    full[(slice(None),) + sl] = x
    full, _ = resample(full, np.eye(4), meta["ras_shape"], mode)
    arr = np.moveaxis(full.cpu().numpy(), 0, -1)
    in_affine = np.asarray(meta["input_affine"], dtype=np.float64)
    back = nio.ornt_transform(nio.axcodes2ornt("RAS"), nio.io_orientation(in_affine))
    arr = nio.apply_orientation(arr, back)
    arr = np.ascontiguousarray(arr)
    return arr[..., 0] if squeeze else arr
