"""3-D voxel geometry as MONAI places it: RAS orientation, the output grid of ``Spacing``, resampling
between grids given by affines, a label onto its image's grid, and the inverse for predictions.

Conventions (MONAI ``Orientation(axcodes="RAS")`` + ``Spacing(pixdim, diagonal=False)``, the defaults of
its spleen and BraTS tutorials):

* Orientation permutes and flips the voxel axes so that i, j, k point as close as possible to world
  +x (Right), +y (Anterior), +z (Superior) (nibabel ``io_orientation``); no interpolation.
* The output grid keeps the input's rotation (shear is dropped), has voxel size exactly
  ``target`` mm, and its voxel 0 sits on the world position of input voxel 0 (the "corner" rule of
  MONAI's ``compute_shape_offset``, ``scale_extent=False``): output voxel ``i`` samples input
  continuous index ``i * target / spacing``. The shape is ``round((n - 1) * spacing / target) + 1``,
  which covers the input's voxel centres, not its outer extent.
* Samples beyond the last input voxel centre take the border value (``padding_mode="border"``).
  Images: trilinear (``"bilinear"``); labels: nearest, rounding half to even like ``grid_sample``.

An axis-aligned resampling (the usual case, also for oblique scans without shear: the rotation
cancels) runs as three separable 1-D interpolations, so no (X, Y, Z, 3) sampling grid is built.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fastvision.errors import DataWarning


def _nio():
    """``nibabel.orientations``, imported on first use: nibabel is the optional "medical" extra, and its
    import (about 0.6 s of CPU) would otherwise be paid by every process that imports the tasks, 2-D too."""
    from nibabel import orientations

    return orientations

# MONAI's AFFINE_TOL: a spacing within this of the target is kept, an affine this close is unchanged.
AFFINE_TOL = 1e-3
# A label whose RAS grid moves any image corner by more than this many voxels is on another grid.
LABEL_GRID_TOL = 1e-2


def orientation_to_ras(affine: np.ndarray) -> np.ndarray:
    """nibabel orientation transform (3, 2) taking the voxel axes of ``affine`` to RAS."""
    nio = _nio()
    return nio.ornt_transform(nio.io_orientation(affine), nio.axcodes2ornt("RAS"))


def mirrored_axes(affine: np.ndarray) -> tuple[int, ...]:
    """The RAS axes that reorienting a volume of ``affine`` mirrors (nnU-Net keeps them in the files' direction)."""
    return tuple(int(a) for a, d in orientation_to_ras(np.asarray(affine, np.float64)) if d < 0)


def crop_offset(box: Sequence[Sequence[int]], sign: int = 1) -> np.ndarray:
    """4x4 translation by a crop box's start (``sign`` -1: back): ``affine @ crop_offset(box)`` is the crop's."""
    shift = np.eye(4)
    shift[:3, 3] = [sign * a for a, _ in box]
    return shift


def reorient(array: np.ndarray, affine: np.ndarray, ornt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Permute/flip the first three axes of ``array`` by ``ornt`` and update the affine.

    Args:
        array: (X, Y, Z, ...) voxel data; trailing axes are carried along.
        affine: 4x4 voxel-to-world matrix of ``array``.
        ornt: (3, 2) nibabel orientation transform.

    Returns:
        (array, affine) such that every voxel keeps its world position.
    """
    nio = _nio()
    out = nio.apply_orientation(array, ornt)
    new_affine = affine @ nio.inv_ornt_aff(ornt, array.shape[:3])
    return np.ascontiguousarray(out), new_affine


def spacing_of(affine: np.ndarray) -> np.ndarray:
    """Voxel sizes (3,) in mm: the column norms of the affine's 3x3 block."""
    return np.sqrt((np.asarray(affine)[:3, :3] ** 2).sum(axis=0))


def _corners(shape: Sequence[int]) -> np.ndarray:
    """(4, 8) homogeneous voxel indices of the corner voxel centres of a grid."""
    c = np.asarray(np.meshgrid(*[(0.0, n - 1.0) for n in shape], indexing="ij")).reshape(3, -1)
    return np.concatenate([c, np.ones((1, c.shape[1]))])


def spacing_grid(affine: np.ndarray, shape: Sequence[int],
                 target: Sequence[float]) -> tuple[np.ndarray, tuple[int, ...]]:
    """Output grid of MONAI ``Spacing(target, diagonal=False)`` for a volume on ``(affine, shape)``.

    Args:
        affine: 4x4 voxel-to-world matrix of the input (after orientation).
        shape: input spatial shape (3,).
        target: output voxel size in mm (3,).

    Returns:
        (4x4 output affine with column norms ``target``, output shape).
    """
    affine = np.asarray(affine, dtype=np.float64)
    spacing = spacing_of(affine)
    target = np.asarray(target, dtype=np.float64)
    out_d = np.where(np.abs(spacing - target) <= AFFINE_TOL, spacing, target)  # MONAI keeps near-equal
    rzs = affine[:3, :3]
    zs = np.linalg.cholesky(rzs.T @ rzs).T  # zoom and shear; the rest is the rotation
    out = np.eye(4)
    out[:3, :3] = rzs @ np.linalg.inv(zs) @ np.diag(np.sign(np.diag(zs)) * out_d)
    corners = _corners(shape)
    dist = np.linalg.solve(out, affine) @ corners
    out_shape = np.round(np.ptp(dist[:3], axis=1) + 1.0).astype(int)
    world = affine @ corners
    offset = None
    for i in range(corners.shape[1]):  # the input corner that is the output's minimum on every axis
        if np.allclose(np.min(dist[:3] - dist[:3, i:i + 1], 1), 0.0, rtol=AFFINE_TOL):
            offset = world[:3, i]
            break
    if offset is None:  # sheared: centre the output on the input, as MONAI does
        offset = rzs @ (np.asarray(shape) / 2.0) + affine[:3, 3] - out[:3, :3] @ (out_shape / 2.0)
    out[:3, 3] = offset
    return out, tuple(int(n) for n in out_shape)


def _axis_sample(x: torch.Tensor, axis: int, coords: np.ndarray, mode: str, padding: str) -> torch.Tensor:
    """1-D resampling of ``x`` along ``axis`` at continuous indices ``coords`` (float64)."""
    n = x.shape[axis]
    shape = [1] * x.dim()
    shape[axis] = len(coords)
    if mode == "nearest":  # rint rounds half to even, as grid_sample's nearbyint
        r = np.rint(coords)
        y = x.index_select(axis, torch.from_numpy(np.clip(r, 0, n - 1).astype(np.int64)))
        if padding == "zeros":
            y = y * torch.from_numpy((r >= 0) & (r <= n - 1)).view(shape).to(y.dtype)
        return y
    if padding != "border":
        raise ValueError("linear resampling pads with the border only")
    c = np.clip(coords, 0.0, n - 1.0)
    lo = np.floor(c).astype(np.int64)
    hi = np.minimum(lo + 1, n - 1)
    w = torch.from_numpy(c - lo).to(x.dtype).view(shape)
    return torch.lerp(x.index_select(axis, torch.from_numpy(lo)), x.index_select(axis, torch.from_numpy(hi)), w)


def _linear_weights(coords: np.ndarray, n: int) -> torch.Tensor:
    """(n, len(coords)) matrix of linear (border) interpolation: two weights per column, so
    ``line @ W`` resamples a line. Only for finite data (a 0 weight times NaN spreads the NaN)."""
    c = np.clip(coords, 0.0, n - 1.0)
    lo = np.floor(c).astype(np.int64)
    w = np.zeros((n, len(c)))
    cols = np.arange(len(c))
    np.add.at(w, (lo, cols), 1.0 - (c - lo))
    np.add.at(w, (np.minimum(lo + 1, n - 1), cols), c - lo)
    return torch.from_numpy(w)


def _grid_sample(x: torch.Tensor, xform: np.ndarray, shape: Sequence[int], mode: str, padding: str) -> torch.Tensor:
    """General (sheared or permuting) resampling with ``grid_sample``, ``align_corners=False``."""
    idx = np.stack(np.meshgrid(*[np.arange(n, dtype=np.float64) for n in shape], indexing="ij"), -1)
    src = idx @ xform[:3, :3].T + xform[:3, 3]  # (X, Y, Z, 3) input continuous indices
    norm = (2.0 * src + 1.0) / np.asarray(x.shape[1:], dtype=np.float64) - 1.0
    grid = torch.from_numpy(norm[..., ::-1].copy()).to(torch.float32)[None]  # grid_sample wants (z, y, x)
    y = F.grid_sample(x[None].float(), grid, mode="bilinear" if mode == "linear" else "nearest",
                      padding_mode=padding, align_corners=False)[0]
    return y if mode == "linear" else y.round().to(x.dtype)


def resample_to(x: torch.Tensor, src_affine: np.ndarray, dst_affine: np.ndarray, shape: Sequence[int],
                mode: str = "linear", padding: str = "border") -> torch.Tensor:
    """Resample a channel-first volume from grid ``src_affine`` onto ``(dst_affine, shape)``.

    Output voxel ``v`` takes the input at continuous index ``inv(src_affine) @ dst_affine @ v``
    (voxel centres at integers, MONAI ``SpatialResample`` with ``align_corners=False``).

    Args:
        x: (C, X, Y, Z); float for "linear", any dtype (kept) for "nearest".
        src_affine, dst_affine: 4x4 voxel-to-world matrices.
        shape: output spatial shape (3,).
        mode: "linear" (trilinear) or "nearest".
        padding: "border" (MONAI Spacing) or "zeros" (a label outside its own extent is background).

    Returns:
        (C, *shape) tensor.
    """
    xform = np.linalg.solve(np.asarray(src_affine, np.float64), np.asarray(dst_affine, np.float64))
    if tuple(shape) == tuple(x.shape[1:]) and np.allclose(xform, np.eye(4), atol=AFFINE_TOL):
        return x  # MONAI returns the input unchanged here too
    lin = xform[:3, :3]
    if np.abs(lin - np.diag(np.diag(lin))).max() > 1e-9 * np.abs(lin).max() or (np.diag(lin) <= 0).any():
        return _grid_sample(x, xform, shape, mode, padding)
    for axis in (1, 2, 3):
        coords = lin[axis - 1, axis - 1] * np.arange(shape[axis - 1], dtype=np.float64) + xform[axis - 1, 3]
        if axis == 3 and mode == "linear" and bool(torch.isfinite(x).all()):
            x = x @ _linear_weights(coords, x.shape[3]).to(x.dtype)  # innermost: a product, not a gather
        elif axis == 3:  # index_select on the innermost axis is a strided gather: 5-10x slower than moving it
            x = _axis_sample(x.movedim(3, 1).contiguous(), 1, coords, mode, padding).movedim(1, 3)
        else:
            x = _axis_sample(x, axis, coords, mode, padding)
    return x.contiguous()


def ras_grid(shape: Sequence[int], affine: np.ndarray) -> tuple[tuple[int, ...], np.ndarray]:
    """The spatial shape and affine a volume of ``(shape, affine)`` has after :func:`reorient` to RAS,
    from its header alone (no voxels read)."""
    ornt = orientation_to_ras(np.asarray(affine, np.float64))
    ras_shape = [0, 0, 0]
    for axis, (to, _) in enumerate(ornt):
        ras_shape[int(to)] = int(shape[axis])
    return tuple(ras_shape), np.asarray(affine, np.float64) @ _nio().inv_ornt_aff(ornt, tuple(shape[:3]))


def label_grid_offset(label_shape: Sequence[int], label_affine: np.ndarray, affine: np.ndarray,
                      shape: Sequence[int]) -> float | None:
    """None when a label's grid is its image's (same shape, every image corner within ``LABEL_GRID_TOL``
    voxels in the label's voxel coordinates), else that largest corner distance in voxels (0 for a
    label of another shape on the same origin and axes). Both grids as stored or both in RAS."""
    corners = _corners(shape)
    moved = np.linalg.solve(label_affine, affine) @ corners - corners
    off = float(np.abs(moved[:3]).max())
    return None if tuple(label_shape[:3]) == tuple(shape[:3]) and off <= LABEL_GRID_TOL else off


def label_off_grid(shape: Sequence[int], affine: np.ndarray, label_shape: Sequence[int],
                   label_affine: np.ndarray) -> bool:
    """Whether a label file's grid is another than its image's (:func:`label_onto_image`'s rule), from
    the two headers as stored (each reoriented to RAS first, so another storage order is the same grid)."""
    shape, affine = ras_grid(shape[:3], affine)
    label_shape, label_affine = ras_grid(label_shape[:3], label_affine)
    return label_grid_offset(label_shape, label_affine, affine, shape) is not None


def label_onto_image(label: np.ndarray, label_affine: np.ndarray, affine: np.ndarray, shape: Sequence[int],
                     name: str) -> np.ndarray:
    """A label (RAS) on its image's RAS grid; resampled by world position, with a warning, when apart.

    Args:
        label: (X, Y, Z) integer label in RAS voxel order, on ``label_affine``.
        label_affine: 4x4 affine of ``label`` after reorientation.
        affine, shape: the image's RAS affine and spatial shape.
        name: the label file, for the warning.

    Returns:
        (X, Y, Z) label on the image grid (nearest; outside the label's extent: 0).
    """
    off = label_grid_offset(label.shape, label_affine, affine, shape)
    if off is None:
        return label
    apart = f"up to {off:.3g} voxels apart" if off > LABEL_GRID_TOL else "same origin and axes"
    msg = (f"{name}: label grid {tuple(label.shape)} differs from its image's {tuple(shape)} ({apart}); "
           "resampled onto the image grid by world position (nearest)")
    # warnings, not the log: an uncached run preprocesses every epoch, and the warnings registry
    # prints one message once per process
    warnings.warn(msg, DataWarning, stacklevel=3)
    x = torch.from_numpy(np.ascontiguousarray(label))[None]
    return resample_to(x, label_affine, affine, shape, "nearest", padding="zeros")[0].numpy()


def _nnunet_resize_back(x: torch.Tensor, meta: dict[str, Any], shape: Sequence[int], order: int,
                        crop_spacing: np.ndarray) -> torch.Tensor:
    """(C, *S) on the preprocessed grid -> (C, *shape) on the crop, as nnU-Net's export resamples its logits
    (``resampling_fn_probabilities``: order 1, and for an anisotropic plan or case in-plane with that order and
    nearest along the coarse axis; the plan's spacing decides first), in the files' axis directions."""
    from fastvision.data import nnunet_resampling as nr

    if tuple(x.shape[1:]) == tuple(shape):
        return x
    axis = nr.coarse_axis(meta["spacing"], crop_spacing)
    flips = [1 + a for a in mirrored_axes(meta["input_affine"])]
    out = np.flip(nr.resize(np.flip(x.double().numpy(), flips), shape, order, axis), flips)
    return torch.from_numpy(out.copy()).to(x.dtype)


def restore_to_input(x: torch.Tensor, meta: dict[str, Any], mode: str = "nearest", fill: float = 0.0,
                     nnunet: bool = False) -> np.ndarray:
    """Invert crop, resampling and reorientation: back to the input file's voxel grid.

    Args:
        x: (*S) labels or (C, *S) values on the preprocessed grid (shape of the cropped volume).
        meta: ``meta`` of :func:`~fastvision.data.preprocess3d.preprocess_case`.
        mode: "nearest" for labels, "linear" for probabilities.
        fill: the value outside the crop (0: background for labels; a background probability: 1).
        nnunet: with ``resample: nnunet`` (``meta["crop_first"]``), back onto the crop by nnU-Net's own
            resampling of logits (:func:`_nnunet_resize_back`: its separate-z rule), not by ``resample_to``.

    Returns:
        numpy array (X, Y, Z) or (X, Y, Z, C) in the input file's voxel order.
    """
    squeeze = x.dim() == 3
    x = x[None] if squeeze else x
    box = meta["crop_box"]
    crop = (slice(None),) + tuple(slice(a, b) for a, b in box)
    in_affine = np.asarray(meta["input_affine"], dtype=np.float64)
    ornt = orientation_to_ras(in_affine)
    nio = _nio()
    ras_affine = in_affine @ nio.inv_ornt_aff(ornt, meta["input_shape"])
    interp = "nearest" if mode == "nearest" else "linear"
    affine = np.asarray(meta["affine"], dtype=np.float64)
    if meta.get("crop_first"):  # resample: nnunet cropped before resampling: back onto the crop, then pad it
        full = x.new_full((x.shape[0], *meta["ras_shape"]), fill)
        if nnunet:
            full[crop] = _nnunet_resize_back(x, meta, meta["cropped_shape"], 1 if interp == "linear" else 0,
                                             spacing_of(ras_affine @ crop_offset(box)))
        else:
            full[crop] = resample_to(x, affine, ras_affine @ crop_offset(box), meta["cropped_shape"], interp)
    else:
        full = x.new_full((x.shape[0], *meta["resampled_shape"]), fill)
        full[crop] = x
        # from the affine before the crop
        full = resample_to(full, affine @ crop_offset(box, -1), ras_affine, meta["ras_shape"], interp)
    arr = np.moveaxis(full.cpu().numpy(), 0, -1)
    back = nio.ornt_transform(nio.axcodes2ornt("RAS"), nio.io_orientation(in_affine))
    arr = np.ascontiguousarray(nio.apply_orientation(arr, back))
    return arr[..., 0] if squeeze else arr
