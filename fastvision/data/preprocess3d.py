"""Deterministic 3-D preprocessing of NIfTI volumes, run once per case and then cached.

Steps, in order (the same order as MONAI's spleen and BraTS tutorials):
load -> reorient to RAS -> resample to a target spacing -> intensity (CT window or MRI foreground
z-score) -> crop to the foreground box. Orientation and resampling place voxels exactly as MONAI's
``Orientationd("RAS")`` + ``Spacingd`` do (:mod:`fastvision.data.spatial3d`); a label on another
grid than its image is resampled onto the image grid by world position, with a warning.
:func:`preprocess_case` is a pure function of file paths and :class:`PreprocessParams`, so its
output can be stored in a persistent cache keyed on both.
:func:`restore_to_input` inverts the geometry (crop, resampling, orientation) so predictions can be
written back in the voxel space of the input file. A volume holding NaN or Inf stops with one line
naming the file, or is read with those voxels 0 (``PreprocessParams.nonfinite``; checked as the
file is decoded, so once per cache fill).

Axis order: arrays are ``(C, X, Y, Z)`` where X, Y, Z are the NIfTI voxel axes (i, j, k) after
reorientation to RAS: index i grows towards world +x (Right), j towards +y (Anterior), k towards
+z (Superior), as nibabel's RAS+ world convention defines them. This is the order of MONAI's ``LoadImage`` +
``Orientation("RAS")``, so ROI sizes from MONAI recipes (e.g. 240x240x160 for BraTS) carry over.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastvision.data.nonfinite import NonFinite
from fastvision.data.spatial3d import (  # noqa: F401  (re-exported: the geometry of this module's output)
    crop_offset,
    label_onto_image,
    mirrored_axes,
    orientation_to_ras,
    reorient,
    resample_to,
    restore_to_input,
    spacing_grid,
    spacing_of,
)
from fastvision.errors import ConfigError, DataError


def _nibabel():
    """nibabel, imported on first use (the optional "medical" extra; importing it costs every process that
    imports the tasks about 0.6 s of CPU, 2-D runs too), or one line saying how to install it."""
    try:
        import nibabel
    except ModuleNotFoundError:  # pragma: no cover - the medical extra is installed wherever tests run
        raise DataError("reading NIfTI needs nibabel: pip install 'fastvision[medical]'") from None
    return nibabel


RESAMPLE = ("monai", "nnunet")  # data.args.resample: whose preprocessing order and interpolation


@dataclass(frozen=True)
class PreprocessParams:
    """Everything that changes the cached result; part of the cache key.

    Attributes:
        target_spacing: output voxel size in mm along (X, Y, Z), or None to keep the input grid.
        intensity: "ct" (window ``window``), "mri" (per-channel z-score on non-zero voxels), "zscore"
            (per-channel z-score over every voxel: nnU-Net where the crop keeps >= 3/4) or "none".
        window: CT window ``(a_min, a_max, b_min, b_max)`` in HU -> output range, clipped.
        crop_foreground: crop to the bounding box of the foreground, plus ``crop_margin`` voxels:
            ``True`` - MRI and z-score: any channel != 0; CT: any channel > a_min (MONAI's
            ``CropForegroundd`` after its window); ``"nonzero"`` - any channel != 0 for every
            modality (nnU-Net's ``crop_to_nonzero``, what ``data inspect --fingerprint`` measures and
            ``configure`` plans on; for CT it keeps the whole scanned volume); ``False`` - no crop.
        crop_margin: margin in voxels around the foreground box.
        label_map: ``((from, to), ...)`` applied to label values on load (BraTS: ``((4, 3),)``).
        nonfinite: a file holding NaN / Inf: ``error`` (DataError naming it) or ``zero`` (read as 0).
        resample: ``monai`` - resample, then intensity, then crop, on MONAI ``Spacing``'s grid with a
            trilinear image and a nearest label (the module's steps); ``nnunet`` - nnU-Net v2's
            ``DefaultPreprocessor``: crop, intensity, then resample on its grid, third-order spline
            image, per-label linear label, the coarse axis of an anisotropic case apart
            (:mod:`fastvision.data.nnunet_resampling`).
    """

    target_spacing: tuple[float, float, float] | None = None
    intensity: str = "mri"
    window: tuple[float, float, float, float] = (-57.0, 164.0, 0.0, 1.0)
    crop_foreground: bool | str = True
    crop_margin: int = 0
    label_map: tuple[tuple[int, int], ...] = ()
    nonfinite: str = "error"
    resample: str = "monai"

    def __post_init__(self):
        if self.crop_foreground not in (True, False, "nonzero"):
            raise ConfigError(f"data.args.crop_foreground: true, false or nonzero, got {self.crop_foreground!r}")
        if self.resample not in RESAMPLE:
            raise ConfigError(f"data.args.resample: {' or '.join(RESAMPLE)}, got {self.resample!r}")

    def key(self) -> dict[str, Any]:
        """Plain-data form for hashing into a cache key."""
        return asdict(self)


def load_nifti(path: str | Path) -> tuple[np.ndarray, np.ndarray, Any]:
    """Read a NIfTI file.

    Returns:
        (data, affine, header): data as stored (X, Y, Z[, T]) in float32 for images, the 4x4
        voxel-to-world affine (float64) and the nibabel header.
    """
    nib = _nibabel()
    try:
        img = nib.load(str(path))
        data = np.asanyarray(img.dataobj)
    except FileNotFoundError as e:
        raise DataError(f"missing NIfTI file {path}") from e
    except Exception as e:  # nibabel raises several types for corrupt files
        raise DataError(f"cannot read NIfTI file {path}: {e}") from e
    return data, np.asarray(img.affine, dtype=np.float64), img.header


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


def zscore(x: torch.Tensor) -> torch.Tensor:
    """Per-channel z-score over every voxel (population std; a constant channel is only mean-shifted).

    Args:
        x: (C, *S) float tensor.
    """
    v = x.flatten(1).double()
    mean, std = v.mean(1), v.std(1, unbiased=False)
    std = torch.where(std > 0, std, torch.ones_like(std))
    shape = (-1,) + (1,) * (x.dim() - 1)
    return ((x.double() - mean.view(shape)) / std.view(shape)).to(x.dtype)


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


def check_channel_file(path: str | Path, shape: Sequence[int], affine: np.ndarray,
                       first: tuple[str | Path, Sequence[int], np.ndarray] | None = None) -> None:
    """One image file of a case (from its header or its data): 3-D or 4-D (a 4-D file's last axis holds
    channels), on the grid of the case's first file ``first = (path, shape, affine)``.

    Raises:
        DataError: naming the file.
    """
    if len(shape) not in (3, 4):
        raise DataError(f"{path}: expected a 3-D or 4-D NIfTI image, got shape {tuple(shape)}")
    if first is not None and (tuple(shape[:3]) != tuple(first[1][:3]) or not np.allclose(affine, first[2], atol=1e-3)):
        raise DataError(f"{path}: grid (shape/affine) differs from {first[0]}")


def check_label_values(label: torch.Tensor, num_classes: int, path: str | Path | None) -> None:
    """A preprocessed label's values are classes ``0 .. num_classes - 1`` (after the dataset's label map).

    Raises:
        DataError: naming the file and the value; a value past the classes was read as no class at all
            (trained as background by some losses, never scored), e.g. BraTS 2024's resection cavity 4.
    """
    lo, hi = (int(v) for v in torch.stack(label.aminmax()).tolist())
    if lo < 0 or hi >= num_classes:
        bad = lo if lo < 0 else hi
        raise DataError(f"{path}: label value {bad} is not a class of this dataset (0..{num_classes - 1}, after its "
                        "label map); remap it in the file (BraTS 2024's resection cavity 4: to 0, or to a class)")


def whole_labels(label: np.ndarray, path: str | Path) -> np.ndarray:
    """A label file's values as int16 class ids: a float file's values rounded (float noise within 1e-3 of a
    whole number); a value farther from one (a label resampled with interpolation) is an error naming the
    file, as the cast truncated it to a class silently (1.9999 edema read as 1, 0.9999 core as background)."""
    if np.issubdtype(label.dtype, np.floating):
        off = ~(np.abs(label - np.rint(label)) <= 1e-3)  # NaN too
        if off.any():
            raise DataError(f"{path}: label value {float(label[off].flat[0]):.6g} is not a whole number: a label file "
                            "holds class ids (was it resampled by interpolation? resample it by nearest neighbour)")
        label = np.rint(label)
    return label.astype(np.int16)


def _read_channels(paths: Sequence[str | Path], finite: NonFinite) -> tuple[np.ndarray, np.ndarray, Any]:
    """Stack image files into (X, Y, Z, C); a 4-D file contributes its last axis as channels;
    ``finite`` checks each file for NaN / Inf (after the float32 cast, which can overflow to Inf)."""
    arrays, affine, header = [], None, None
    for p in paths:
        data, aff, hdr = load_nifti(p)
        check_channel_file(p, data.shape, aff, None if affine is None else (paths[0], arrays[0].shape, affine))
        if data.ndim == 3:
            data = data[..., None]
        if affine is None:
            affine, header = aff, hdr
        arrays.append(finite(np.asarray(data, dtype=np.float32), p))
    return np.concatenate(arrays, axis=-1), affine, header


def _load_case(paths: dict[str, Any], params: PreprocessParams, finite: NonFinite) -> dict[str, Any]:
    """Read the image channels and the label, both reoriented to RAS, the label on the image grid."""
    data, in_affine, _ = _read_channels(paths["image"], finite)
    input_shape = list(data.shape[:3])
    data, affine = reorient(data, in_affine, orientation_to_ras(in_affine))
    case = {"image": torch.from_numpy(np.moveaxis(data, -1, 0).copy()), "affine": affine, "label": None,
            "meta": {"input_affine": torch.from_numpy(in_affine), "input_shape": input_shape,
                     "ras_shape": list(data.shape[:3])}}
    if paths.get("label"):
        lab, lab_affine, _ = load_nifti(paths["label"])
        lab = finite(lab[..., 0] if lab.ndim == 4 and lab.shape[3] == 1 else lab, paths["label"])
        if lab.ndim != 3:
            raise DataError(f"{paths['label']}: expected a 3-D NIfTI label, got shape {lab.shape}")
        lab, lab_affine = reorient(whole_labels(np.asarray(lab), paths["label"]), lab_affine,
                                   orientation_to_ras(lab_affine))
        lab = label_onto_image(lab, lab_affine, affine, data.shape[:3], str(paths["label"]))
        case["label"] = remap_labels(torch.from_numpy(np.ascontiguousarray(lab)), params.label_map)[None]  # int16
    return case


def _resample_case(case: dict[str, Any], target: Sequence[float] | None) -> None:
    """MONAI ``Spacingd``: voxel size ``target``, trilinear image, nearest label (in place)."""
    if target is None:
        return
    affine, shape = spacing_grid(case["affine"], case["image"].shape[1:], target)
    case["image"] = resample_to(case["image"], case["affine"], affine, shape, "linear")
    if case["label"] is not None:
        case["label"] = resample_to(case["label"], case["affine"], affine, shape, "nearest")
    case["affine"] = affine


def _intensity(image: torch.Tensor, params: PreprocessParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalised image, foreground mask (X, Y, Z) of ``params.crop_foreground``) for ``params.intensity``."""
    if params.intensity == "ct":
        out = window(image, *params.window)
    elif params.intensity == "mri":
        out = zscore_nonzero(image)
    elif params.intensity == "zscore":
        out = zscore(image)
    elif params.intensity == "none":
        out = image
    else:
        raise DataError(f"preprocess intensity must be ct, mri, zscore or none, got {params.intensity!r}")
    return out, _crop_mask(image, params)


def _crop_mask(image: torch.Tensor, params: PreprocessParams) -> torch.Tensor:
    """(X, Y, Z) mask of the crop on the raw image: CT above the window's low end (MONAI, crop_foreground
    true), else any channel != 0 (nnU-Net's crop_to_nonzero, every modality with crop_foreground nonzero)."""
    ct_body = params.intensity == "ct" and params.crop_foreground is True
    return ((image > params.window[0]) if ct_body else (image != 0)).any(0)


def preprocess_case(paths: dict[str, Any], params: PreprocessParams,
                    finite: NonFinite | None = None) -> dict[str, Any]:
    """Load and preprocess one case; a pure function of its arguments (safe to cache).

    Args:
        paths: ``{"image": [path, ...], "label": path or None}``; image files are stacked as
            channels in the given order.
        params: preprocessing settings.
        finite: the dataset's NaN / Inf check (it warns once per file under ``zero``); None: a
            fresh one of ``params.nonfinite``.

    Returns:
        ``{"image": float32 (C, X, Y, Z), "label": uint8 (X, Y, Z) (only with a label file),
        "meta": dict}`` with tensors in RAS voxel order. ``meta`` holds what
        :func:`restore_to_input` needs: ``input_affine`` (4, 4), ``input_shape``, ``ras_shape``,
        ``resampled_shape``, ``crop_box`` and the final ``affine`` and ``spacing``.
    """
    case = _load_case(paths, params, finite or NonFinite(params.nonfinite))
    if params.resample == "nnunet":
        return _preprocess_nnunet(case, params)
    _resample_case(case, params.target_spacing)
    res_shape = tuple(case["image"].shape[1:])
    image, fg = _intensity(case["image"].float(), params)
    box = foreground_box(fg, params.crop_margin) if params.crop_foreground else [(0, n) for n in res_shape]
    sl = tuple(slice(a, b) for a, b in box)
    affine = case["affine"] @ crop_offset(box)
    meta = {**case["meta"], "resampled_shape": list(res_shape), "crop_box": [list(b) for b in box],
            "affine": torch.from_numpy(affine), "spacing": spacing_of(affine).tolist()}
    out: dict[str, Any] = {"image": image[(slice(None),) + sl].contiguous().float(), "meta": meta}
    if case["label"] is not None:
        out["label"] = case["label"][0][sl].to(torch.uint8).contiguous()
    return out


def _preprocess_nnunet(case: dict[str, Any], params: PreprocessParams) -> dict[str, Any]:
    """``resample: nnunet``: crop, intensity, then nnU-Net's resampling, run with the axes the RAS reorientation
    mirrored flipped back (its resize is symmetric up to float rounding; in the files' directions a label's exact
    0.5 ties round as nnU-Net's do on its arrays). ``meta["crop_first"]`` tells :func:`restore_to_input` the order."""
    from fastvision.data import nnunet_resampling as nr

    raw = case["image"].float()
    ras_shape = tuple(raw.shape[1:])
    box = foreground_box(_crop_mask(raw, params), params.crop_margin) if params.crop_foreground \
        else [(0, n) for n in ras_shape]
    sl = tuple(slice(a, b) for a, b in box)
    crop_affine = case["affine"] @ crop_offset(box)
    image, _ = _intensity(raw[(slice(None),) + sl], params)
    label = case["label"][0][sl] if case["label"] is not None else None
    cropped = tuple(image.shape[1:])
    affine = crop_affine
    if params.target_spacing is not None:
        spacing = spacing_of(crop_affine)
        shape = nr.new_shape(cropped, spacing, params.target_spacing)
        axis = nr.coarse_axis(spacing, params.target_spacing)
        if shape != cropped:
            flips = mirrored_axes(case["meta"]["input_affine"])

            def filed(x: np.ndarray, lead: int) -> np.ndarray:
                return np.flip(x, [lead + a for a in flips]) if flips else x

            image = torch.from_numpy(filed(nr.resize_image(filed(image.numpy(), 1), shape, axis), 1).copy())
            if label is not None:
                label = torch.from_numpy(filed(nr.resize_label(filed(label.numpy(), 0), shape, axis), 0).copy())
            affine = nr.resize_affine(crop_affine, cropped, shape)
    meta = {**case["meta"], "crop_first": True, "crop_box": [list(b) for b in box], "cropped_shape": list(cropped),
            "resampled_shape": list(image.shape[1:]), "affine": torch.from_numpy(affine),
            "spacing": spacing_of(affine).tolist()}
    out: dict[str, Any] = {"image": image.contiguous().float(), "meta": meta}
    if label is not None:
        out["label"] = label.to(torch.uint8).contiguous()
    return out
