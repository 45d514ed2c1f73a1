"""nnU-Net v2's resampling, for ``data.args.resample: nnunet``: its grid, its spline orders, its labels.

nnU-Net's ``DefaultPreprocessor`` crops to the non-zero box, normalises, and only then resamples to the
plan's spacing (``default_resampling.resample_data_or_seg_to_shape``):

* the output shape is ``round(spacing / target * shape)`` per axis (``compute_new_shape``), and output
  voxel ``o`` samples input index ``(o + 0.5) * n_in / n_out - 0.5`` (scikit-image ``resize``: the
  voxels' outer extents meet, not their centres as MONAI's ``Spacing`` places them);
* images: third-order B-spline, edges extended (``resize(order=3, mode="edge", anti_aliasing=False)``,
  clipped to the input's range); labels: each label value's indicator resampled linearly, the per-voxel
  argmax, exact ties to the nearest neighbour's label (``resize_segmentation(order=1)`` of batchgenerators
  0.25.5, nnU-Net 2.8.1's);
* an anisotropic case (the coarsest spacing more than 3x the finest, in the input or the target) is
  resampled in-plane slice by slice with those orders and along its coarse axis by nearest neighbour
  (``order_z=0``).

These functions reproduce those calls with scipy (``ndimage.zoom(grid_mode=True)`` is scikit-image's
resize without anti-aliasing); ``benchmarks/nnunet_parity.py --preprocess`` compares the whole case
against nnU-Net's preprocessed arrays. The geometry is an affine, :func:`resize_affine`, so
:func:`~fastvision.data.spatial3d.restore_to_input` maps predictions back exactly.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ANISOTROPY = 3.0  # nnU-Net's separate_z_anisotropy_threshold
IMAGE_ORDER, LABEL_ORDER, COARSE_ORDER = 3, 1, 0  # nnU-Net's plans: data order 3, seg order 1, order_z 0


def new_shape(shape: Sequence[int], spacing: Sequence[float], target: Sequence[float]) -> tuple[int, ...]:
    """nnU-Net's ``compute_new_shape``: ``round(spacing / target * shape)`` per axis."""
    return tuple(int(v) for v in np.round(np.asarray(spacing, float) / np.asarray(target, float) * np.asarray(shape)))


def coarse_axis(spacing: Sequence[float], target: Sequence[float]) -> int | None:
    """The axis nnU-Net resamples apart (``get_do_separate_z`` / ``get_lowres_axis``), or None.

    The input's spacing decides first, then the target's; an axis is apart only when it alone is the
    coarsest one (two equally coarse axes: resampled together, as nnU-Net does)."""
    for s in (np.asarray(spacing, float), np.asarray(target, float)):
        if s.max() / s.min() > ANISOTROPY:
            axes = np.flatnonzero(s.max() / s == 1)
            return int(axes[0]) if len(axes) == 1 else None
    return None


def resize_affine(affine: np.ndarray, shape_in: Sequence[int], shape_out: Sequence[int]) -> np.ndarray:
    """The voxel-to-world affine of the resized grid: output voxel ``o`` at input index
    ``(o + 0.5) * n_in / n_out - 0.5``."""
    scale = np.asarray(shape_in, float) / np.asarray(shape_out, float)
    m = np.eye(4)
    m[:3, :3] = np.diag(scale)
    m[:3, 3] = 0.5 * scale - 0.5
    return np.asarray(affine, np.float64) @ m


def _zoom(x: np.ndarray, shape: Sequence[int], order: int) -> np.ndarray:
    """scikit-image ``resize(x, shape, order, mode="edge", anti_aliasing=False)`` (its clip included)."""
    from scipy import ndimage

    if tuple(x.shape) == tuple(shape):
        return x
    out = ndimage.zoom(x, np.asarray(shape, float) / np.asarray(x.shape), order=order, mode="nearest",
                       grid_mode=True)
    if order > 1:  # resize clips to the input's range (a spline overshoots at steps)
        out = np.clip(out, x.min(), x.max())
    return out


def _along(x: np.ndarray, axis: int, n: int, order: int) -> np.ndarray:
    """``x`` resampled along ``axis`` alone to ``n`` voxels (nnU-Net's ``map_coordinates`` step, mode nearest)."""
    from scipy import ndimage

    if x.shape[axis] == n:
        return x
    coords = list(np.meshgrid(*[np.arange(m if a != axis else n, dtype=float) for a, m in enumerate(x.shape)],
                              indexing="ij"))
    coords[axis] = (coords[axis] + 0.5) * (x.shape[axis] / n) - 0.5
    return ndimage.map_coordinates(x, np.stack(coords), order=order, mode="nearest")


def _resize_channel(x: np.ndarray, shape: Sequence[int], order: int, axis: int | None) -> np.ndarray:
    """One 3-D channel: a 3-D resize, or in-plane slice by slice then nearest along ``axis``."""
    if axis is None:
        return _zoom(x, shape, order)
    plane = [n for a, n in enumerate(shape) if a != axis]
    slices = [_zoom(np.take(x, i, axis=axis), plane, order) for i in range(x.shape[axis])]
    return _along(np.stack(slices, axis=axis), axis, shape[axis], COARSE_ORDER)


def resize(x: np.ndarray, shape: Sequence[int], order: int, axis: int | None = None) -> np.ndarray:
    """(C, *S) values -> (C, *shape) float64 by nnU-Net's ``resample_data_or_seg`` for data: spline ``order``, or
    in-plane with it and nearest along ``axis`` (nnU-Net's export resamples its logits so, with order 1)."""
    x = np.asarray(x, np.float64)
    return np.stack([_resize_channel(c, shape, order, axis) for c in x])


def resize_image(x: np.ndarray, shape: Sequence[int], axis: int | None = None) -> np.ndarray:
    """(C, *S) float image -> (C, *shape) float32 by nnU-Net's data resampling (order 3, or apart along ``axis``)."""
    return resize(x, shape, IMAGE_ORDER, axis).astype(np.float32)


def resize_label(y: np.ndarray, shape: Sequence[int], axis: int | None = None) -> np.ndarray:
    """(*S) label -> (*shape) as nnU-Net's ``resize_segmentation(order=1)`` (batchgenerators 0.25.5): each
    label value's indicator resampled linearly, the per-voxel argmax, an exact tie settled by the nearest
    neighbour's label where it is one of the tied ones (else the lowest); apart along ``axis``: in-plane so,
    then nearest along it (what nnU-Net's separate z does)."""
    y = np.asarray(y)
    if tuple(y.shape) == tuple(shape):
        return y
    if axis is not None:
        plane = [n for a, n in enumerate(shape) if a != axis]
        slices = [resize_label(np.take(y, i, axis=axis), plane) for i in range(y.shape[axis])]
        return _along(np.stack(slices, axis=axis), axis, shape[axis], COARSE_ORDER).astype(y.dtype)
    values = np.unique(y)
    scores = np.stack([_zoom((y == v).astype(np.float64), shape, LABEL_ORDER) for v in values])
    win = scores.argmax(0)  # the first of equal scores: the lowest label
    nearest = np.searchsorted(values, _zoom(y.astype(np.float64), shape, 0).astype(y.dtype))
    top = np.take_along_axis(scores, win[None], 0)[0]
    tied = (np.take_along_axis(scores, nearest[None], 0)[0] == top) & (top > 0)
    return values[np.where(tied, nearest, win)].astype(y.dtype)
