"""The batched affine of :mod:`fastvision.data.augment.spatial`: rotation and zoom about the patch centre,
one ``grid_sample`` (or, on the CPU with ``compiled``, the fused kernel of
:mod:`~fastvision.data.augment.resample`) for the batch's firing samples; on the CPU a sample zoomed
without rotation (a diagonal matrix) is resampled separably, one 1-D pass per axis
(:mod:`~fastvision.data.augment.separable`, the same numbers to float rounding, labels bit for bit), and
3-D labels are read by one gather at ``grid_sample``'s nearest positions (:func:`nearest_3d`, bit for bit)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fastvision.data.augment.intensity import Label, _select, owned, put_rows
from fastvision.data.augment.resample import run_compiled
from fastvision.data.augment.separable import Separable, diagonal_rows


@functools.lru_cache(maxsize=64)
def _const(values: tuple, device: torch.device, dtype: torch.dtype) -> Tensor:
    """A small constant vector on ``device``, copied there once: a host-to-device copy of pageable
    memory inside the step would be a host sync. Callers must not modify it in place."""
    return torch.tensor(values, dtype=dtype).to(device)


@dataclass
class Affine:
    """Rotation (uniform in +-``degrees`` about each axis in 3-D, in-plane in 2-D) and per-axis
    zoom (uniform in ``scale``) about the centre, in pixel units so non-square images are not
    sheared. Bilinear for images, nearest for labels, zeros outside.

    ``rotate_axes`` (3-D): the spatial axes to rotate about (default all three; ``[2]`` turns each
    slice along axis 2 in its own plane, nnU-Net's "dummy 2-D" augmentation of anisotropic patches).
    ``zoom_axes``: the spatial axes to zoom along (default all; the others keep their size).
    ``same_zoom``: one zoom factor for every zoomed axis of a sample (nnU-Net's scaling) instead of
    one per axis. ``rotate_prob`` / ``zoom_prob``: separate probabilities of the rotation and of the
    zoom (nnU-Net's p_rotation, p_scaling), each drawn per sample; unset, both happen together with ``prob``.
    ``sampling_scale``: the draw from ``scale`` multiplies the sampling coordinates (nnU-Net's
    ``SpatialTransform``: a draw > 1 shrinks the objects), i.e. the zoom is 1 / draw, instead of being the zoom.
    ``compiled``: on the CPU, resample 3-D patches with a ``torch.compile``'d fused kernel (about 2x cheaper
    than ``grid_sample``; the first call per shape compiles; :mod:`~fastvision.data.augment.resample`).
    ``size``: the output patch (nnU-Net's enlarged initial patch): the input is a larger patch
    (``data.args.patch_size``) and the op samples the centred ``size`` from it, rotated and zoomed where it
    fires (the rotated corners come from the margin, not zeros), a centred crop where it does not
    (``(n - size) // 2`` from the start: the same centre when ``n - size`` is even).
    ``label_mode``: ``nearest``, or ``linear``: class-index labels resampled as batchgeneratorsv2's
    ``SpatialTransform`` does (bilinear per class, argmax; a tie goes to the nearest voxel's label where it
    is among the tied; :func:`_linear_label`; float labels stay nearest). ``label_classes``: the number of
    classes, background included (unset: read from the batch, one host sync on a GPU)."""

    prob: float = 0.2
    degrees: float = 0.0
    scale: list[float] | None = None
    rotate_axes: list[int] | None = None
    zoom_axes: list[int] | None = None
    same_zoom: bool = False
    rotate_prob: float | None = None
    zoom_prob: float | None = None
    sampling_scale: bool = False
    compiled: bool = False
    size: list[int] | None = None
    label_mode: str = "nearest"
    label_classes: int | None = None

    def __call__(self, image: Tensor, label: Label, rng: Any) -> tuple[Tensor, Label]:
        nd = image.dim() - 2
        m = m_zoom = rng.mask(self.prob)
        if self.rotate_prob is not None or self.zoom_prob is not None:
            m, m_zoom = (rng.mask(self.prob if p is None else p) for p in (self.rotate_prob, self.zoom_prob))
        n_angles = 1 if nd == 2 else 3
        ang = rng.uniform(-self.degrees, self.degrees, n_angles) * (math.pi / 180) * m[:, None]
        if nd == 3 and self.rotate_axes is not None:  # angles are about (x, y, z) = spatial axes (2, 1, 0)
            ang = ang * _const(tuple(float(2 - i in self.rotate_axes) for i in range(3)), image.device, torch.float32)
        lo, hi = self.scale if self.scale is not None else (1.0, 1.0)
        draw = rng.uniform(lo, hi, nd)
        if self.same_zoom:
            draw = draw[:, :1].expand(-1, nd)
        if self.sampling_scale:
            draw = 1 / draw
        if self.zoom_axes is not None:  # zoom is in (x, y[, z]) = reversed spatial order too
            keep = _const(tuple(float(nd - 1 - i in self.zoom_axes) for i in range(nd)), image.device, torch.float32)
            draw = draw * keep + (1 - keep)
        zoom = torch.where(m_zoom[:, None], draw, torch.ones((), device=image.device))
        fire = m | m_zoom
        opts = dict(compiled=self.compiled, size=self.size, label_mode=self.label_mode, classes=self.label_classes)
        if image.device.type == "cpu":  # only the samples that fire (finding them costs no sync on the CPU)
            idx = fire.nonzero().squeeze(1)
            if idx.numel() == image.shape[0]:
                return affine(image, label, ang, zoom, None, **opts)
            if idx.numel() < image.shape[0]:
                kept, kept_label = centre_crop(image, self.size), centre_crop(label, self.size, image.dim())
                if idx.numel() == 0:
                    return kept, kept_label
                sub, sub_label = affine(image[idx], None if label is None else label[idx], ang[idx], zoom[idx],
                                        **opts)
                # into the input itself where it is this call's own tensor (and not cut by ``size``)
                image = put_rows(kept, idx, sub, owned(rng, kept))
                return image, None if label is None else put_rows(kept_label, idx, sub_label, owned(rng, kept_label))
        return affine(image, label, ang, zoom, fire, **opts)


def centre_crop(x: Tensor | None, size: list[int] | None, image_dim: int | None = None) -> Tensor | None:
    """The centred ``size`` window of (B, [C,] *S) ``x``, starting at ``(n - size) // 2`` per axis (``x`` when
    ``size`` is None). ``image_dim``: the image's rank, to tell a (B, *S) label from a (B, L, *S) one."""
    if x is None or size is None:
        return x
    nd = len(size)
    lead = x.dim() - nd
    if image_dim is not None and x.dim() == image_dim - 1:
        lead = 1
    start = [(n - s) // 2 for n, s in zip(x.shape[lead:], size, strict=True)]
    return x[(slice(None),) * lead + tuple(slice(a, a + s) for a, s in zip(start, size, strict=True))]


def affine(image: Tensor, label: Label, angles: Tensor, zoom: Tensor, mask: Tensor | None = None,
           compiled: bool = False, size: list[int] | None = None, label_mode: str = "nearest",
           classes: int | None = None) -> tuple[Tensor, Label]:
    """Rotate and zoom a batch about its centre.

    Args:
        image: (B, C, *S) float, bilinear.
        label: (B, *S) int64 or (B, L, *S) float, nearest; or None.
        angles: (B, 1) radians in 2-D (counter-clockwise in (x, y) = (W, H) order) or (B, 3) about x, y, z.
        zoom: (B, nd) zoom factors in (x, y[, z]) = (W, H[, D]) order; > 1 enlarges.
        mask: (B,) bool, samples to transform (default all).
        compiled: on the CPU, resample 3-D images with the fused compiled kernel
            (:mod:`~fastvision.data.augment.resample`) instead of ``grid_sample``.
        size: output spatial size (default the input's), sampled about the input's centre.
        label_mode: ``nearest`` or ``linear`` (class-index labels: per-class bilinear, then argmax).
        classes: ``linear``'s number of classes (default: the batch's largest label + 1, a host sync on a GPU).
    """
    nd = image.dim() - 2
    out_spatial = image.shape[2:] if size is None else torch.Size(size)
    rot = _rotation(angles.float(), nd)  # (B, nd, nd) in (x, y[, z]) order
    half_in = _const(tuple(image.shape[2:][::-1]), image.device, torch.float32) / 2
    half_out = _const(tuple(out_spatial[::-1]), image.device, torch.float32) / 2
    # Sampling maps output -> input: n_in = D_in^-1 Z^-1 R^T D_out n_out, D = half-size, Z = zoom.
    lin = rot.transpose(1, 2) * half_out[None, None, :] / half_in[None, :, None] / zoom.float()[:, :, None]
    linear = label is not None and label_mode == "linear" and label.dim() == nd + 1
    opts = dict(out_spatial=out_spatial, compiled=compiled, linear=linear, classes=classes)
    if image.device.type == "cpu":  # zoom without rotation: separable (reading the matrices is free here)
        out, lab_out = _resample_split(image, label, lin, diagonal_rows(lin), **opts)
    else:
        out, lab_out = _resample(image, label, lin, **opts)
    image = out if mask is None else _select(mask, out, centre_crop(image, size))
    if label is not None:
        label = lab_out if mask is None else _select(mask, lab_out, centre_crop(label, size, nd + 2))
    return image, label


def _resample_split(image: Tensor, label: Label, lin: Tensor, diagonal: list[bool], **opts) -> tuple[Tensor, Label]:
    """:func:`_resample` with the samples whose matrix is ``diagonal`` resampled separably
    (:mod:`~fastvision.data.augment.separable`), the others as before, put back in batch order."""
    if not any(diagonal):
        return _resample(image, label, lin, **opts)
    if all(diagonal):
        return _resample(image, label, lin, separable=True, **opts)
    parts = [torch.tensor([i for i, d in enumerate(diagonal) if d == want], dtype=torch.long) for want in (True, False)]
    done = [_resample(image[i], None if label is None else label[i], lin[i], separable=want, **opts)
            for i, want in zip(parts, (True, False), strict=True)]
    order = torch.cat(parts)
    out = torch.empty((image.shape[0], *done[0][0].shape[1:]), dtype=done[0][0].dtype).index_copy_(
        0, order, torch.cat([done[0][0], done[1][0]]))
    if label is None:
        return out, None
    lab = torch.cat([done[0][1], done[1][1]])
    return out, torch.empty((label.shape[0], *lab.shape[1:]), dtype=lab.dtype).index_copy_(0, order, lab)


def _resample(image: Tensor, label: Label, lin: Tensor, out_spatial: torch.Size, compiled: bool, linear: bool,
              classes: int | None, separable: bool = False) -> tuple[Tensor, Label]:
    """(B, C, *S) ``image`` (bilinear) and ``label`` (nearest, or per class with ``linear``) sampled at
    ``lin`` (B, nd, nd) on the centred ``out_spatial`` grid: ``separable`` (every matrix diagonal: one 1-D
    pass per axis), the fused compiled kernel, or ``grid_sample``."""
    nd = image.dim() - 2
    if separable:
        sep = Separable(lin, image.shape[2:], out_spatial)
        bilinear, nearest = sep.linear, sep.nearest
    else:
        fused = None
        if compiled and image.device.type == "cpu" and out_spatial == image.shape[2:]:
            fused = run_compiled(image, None if linear else label, lin)
        if fused is not None and not linear:
            return fused
        grid = _linear_grid(lin, out_spatial)

        def bilinear(x: Tensor) -> Tensor:
            return F.grid_sample(x, grid.to(x.dtype), mode="bilinear", align_corners=False)

        def nearest(x: Tensor) -> Tensor:
            if _gathers_nearest(x):
                return nearest_3d(x, grid)
            return F.grid_sample(x.to(grid.dtype), grid, mode="nearest", align_corners=False).to(x.dtype)

        if fused is not None:
            return fused[0], _linear_label(label, bilinear, nearest, classes)
    out = bilinear(image)
    if label is None:
        return out, None
    if linear:
        return out, _linear_label(label, bilinear, nearest, classes)
    lab = label[:, None] if label.dim() == nd + 1 else label
    return out, nearest(lab).reshape(label.shape[:-nd] + out_spatial)


def _gathers_nearest(x: Tensor) -> bool:
    """Whether :func:`nearest_3d` serves this ``grid_sample(mode="nearest")``: a 3-D CPU tensor (on a GPU the
    kernel is fast), not bool (no zero padding), padded volume small enough for exact float32 indices."""
    return x.device.type == "cpu" and x.dim() == 5 and x.dtype != torch.bool \
        and math.prod(n + 2 for n in x.shape[2:]) < 2 ** 24


def nearest_3d(x: Tensor, grid: Tensor) -> Tensor:
    """``F.grid_sample(x, grid, mode="nearest", align_corners=False)`` (zeros outside) of a (B, L, D, H, W) CPU
    tensor of any dtype, bit for bit, as one gather: each output voxel's source index is computed as the kernel
    computes it (``((g + 1) size - 1) / 2`` in float32, rounded half to even as its ``nearbyint``) and read from
    ``x`` padded with one voxel of zeros, where every outside coordinate is clamped. The 3-D kernel is a scalar
    loop per voxel on the CPU; this is 2.4x cheaper on 64^3 labels (benchmarks/aug_cpu_paths.py), and the labels
    need no float copy.
    ``grid`` (B, *S_out, 3) is :func:`_linear_grid`'s view of coordinate-major planes (read back as planes)."""
    b, ch, d, h, w = x.shape
    padded = F.pad(x, (1, 1, 1, 1, 1, 1)).reshape(b, ch, -1)
    planes = grid.movedim(-1, 1)  # (B, 3, *S_out): the x, y, z planes
    idx = None
    for k, size, stride in ((2, d, (h + 2) * (w + 2)), (1, h, w + 2), (0, w, 1)):
        c = planes[:, k] + 1  # grid_sample's unnormalise, the same float32 operations in the same order
        c.mul_(size).sub_(1).div_(2).round_().add_(1).clamp_(0, size + 1)  # + 1: the padding's shift
        idx = c.mul_(stride) if idx is None else idx.add_(c, alpha=stride)  # integers < 2^24: exact in float32
    out = torch.gather(padded, 2, idx.long().reshape(b, 1, -1).expand(b, ch, -1))
    return out.reshape(b, ch, *grid.shape[1:4])


def _linear_label(label: Tensor, bilinear, nearest, classes: int | None = None) -> Tensor:
    """(B, *S) class indices resampled by ``bilinear`` and ``nearest`` (grid_sample's, or the separable
    ones, on (B, K, *S) tensors) as batchgeneratorsv2's ``SpatialTransform`` (``mode_seg=
    'bilinear'``, ``seg_tiebreak='nearest'``, nnU-Net's padding label -1): each class's indicator bilinearly
    sampled, x 1000, rounded to float16 (near-ties become ties, as there); outside the input the padding
    label, whose score is what the classes' scores leave of 1000. The argmax (a tie: the lowest label, the
    padding first), except where the nearest voxel's label (the padding outside) has the top score. The
    padding label becomes background (nnU-Net's ``RemoveLabelTansform(-1, 0)``). One pass per class."""
    nd = label.dim() - 1
    k = classes or (int(label.max()) + 1 if label.numel() else 1)  # read from the batch: a host sync on a GPU
    lab = label[:, None]
    classes = torch.arange(k, device=label.device, dtype=label.dtype).view(1, k, *[1] * nd)
    raw = bilinear((lab == classes).float())
    near = nearest(lab.to(torch.int16) + 1)[:, 0]
    best = ((1 - raw.sum(1)) * 1000).half()  # the padding label's score: label index 0 here, -1 in nnU-Net
    win = torch.zeros_like(near)
    own = torch.where(near == 0, best, torch.zeros((), dtype=best.dtype, device=best.device))
    for c in range(k):
        score = (raw[:, c] * 1000).half()
        win = torch.where(score > best, c + 1, win)
        best = torch.maximum(best, score)
        own = torch.where(near == c + 1, score, own)
    return (torch.where(own == best, near, win) - 1).clamp_min(0).to(label.dtype)


def _linear_grid(lin: Tensor, spatial: torch.Size) -> Tensor:
    """``F.affine_grid`` of ``[lin | 0]`` (align_corners=False) as a sum of one broadcast term per axis:
    one pass over the grid instead of a (voxels x (nd + 1)) @ ((nd + 1) x nd) product (5x cheaper on the CPU).
    Summed coordinate-major, (B, nd, *S), and returned as its (B, *S, nd) view: the sum's inner axis is then a
    spatial one the CPU vectorises, not the grid's 2 or 3 coordinates (8x cheaper for 64^3; the same values,
    and ``grid_sample`` reads the view's strides at the contiguous grid's speed)."""
    nd = len(spatial)
    grid = None
    for a, n in enumerate(spatial):  # spatial axis a is grid coordinate nd - 1 - a (x is the last axis)
        base = (torch.arange(n, device=lin.device, dtype=lin.dtype) * 2 + 1) / n - 1
        shape = [1] * nd
        shape[a] = n
        term = base.reshape(1, 1, *shape) * lin[:, :, nd - 1 - a].reshape(-1, nd, *([1] * nd))
        grid = term if grid is None else grid + term
    return grid.movedim(1, -1)


def _rotation(ang: Tensor, nd: int) -> Tensor:
    """(B, nd, nd) rotation matrices from angles (B, 1) in 2-D or (B, 3) about x, y, z in 3-D."""
    c, s = ang.cos(), ang.sin()
    one, zero = torch.ones_like(c[:, 0]), torch.zeros_like(c[:, 0])
    if nd == 2:
        return torch.stack([c[:, 0], -s[:, 0], s[:, 0], c[:, 0]], 1).reshape(-1, 2, 2)
    rx = torch.stack([one, zero, zero, zero, c[:, 0], -s[:, 0], zero, s[:, 0], c[:, 0]], 1)
    ry = torch.stack([c[:, 1], zero, s[:, 1], zero, one, zero, -s[:, 1], zero, c[:, 1]], 1)
    rz = torch.stack([c[:, 2], -s[:, 2], zero, s[:, 2], c[:, 2], zero, zero, zero, one], 1)
    return rz.reshape(-1, 3, 3) @ ry.reshape(-1, 3, 3) @ rx.reshape(-1, 3, 3)
