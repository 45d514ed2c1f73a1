"""The affine's resampling when a sample's matrix is diagonal (zoom without rotation: nnU-Net's scaling
fires alone on 16 % of patches): on an axis-aligned grid, trilinear interpolation is the product of one
1-D linear interpolation per axis and nearest is one index per axis, so the sample is resampled by two
``index_select`` s and a weighted sum per axis (image) and one ``index_select`` per axis (labels)
instead of ``grid_sample``'s scalar loop over every voxel (about 10x cheaper on one CPU core).

The same sampling as ``grid_sample(grid, align_corners=False, padding_mode="zeros")`` on the grid
:func:`~fastvision.data.augment.affine._linear_grid` makes: each axis's source position is computed
with the same float32 operations (``g = base * m``, then ``((g + 1) n - 1) / 2``, grid_sample's
unnormalisation), so nearest picks the same voxel bit for bit (a position at an exact .5 rounds half to
even, as grid_sample's ``nearbyint``) and the linear result differs only by the order of the float sums
(the weights are the same per-axis factors; grid_sample multiplies them per corner)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def diagonal_rows(lin: Tensor) -> list[bool]:
    """Which samples of (B, nd, nd) ``lin`` are diagonal (no rotation): those resample separably. Reads
    the matrices on the host: call it on the CPU only (on a GPU it would be a sync)."""
    off = lin - torch.diag_embed(torch.diagonal(lin, dim1=1, dim2=2))
    return (off == 0).flatten(1).all(1).tolist()


class AxisMaps:
    """One sample's per-axis sampling maps, spatial axis ``a`` from ``lin``'s coordinate ``nd - 1 - a``
    (x is the last axis): the two linear neighbours with their weights (0 for a neighbour outside the
    input: zero padding) and the nearest voxel with whether it is inside."""

    def __init__(self, diag: Sequence[Tensor], in_shape: Sequence[int], out_shape: Sequence[int]):
        nd = len(in_shape)
        self.linear, self.nearest = [], []
        for a, (n_in, n_out) in enumerate(zip(in_shape, out_shape, strict=True)):
            m = diag[nd - 1 - a]
            base = (torch.arange(n_out, device=m.device, dtype=m.dtype) * 2 + 1) / n_out - 1
            pos = ((base * m + 1) * n_in - 1) / 2  # _linear_grid's coordinate, then grid_sample's unnormalise
            lo = pos.floor()
            i0 = lo.long()
            w0 = ((lo + 1) - pos) * ((i0 >= 0) & (i0 <= n_in - 1))
            w1 = (pos - lo) * ((i0 >= -1) & (i0 <= n_in - 2))
            self.linear.append((i0.clamp(0, n_in - 1), (i0 + 1).clamp(0, n_in - 1), w0, w1))
            near = pos.round().long()  # round half to even: grid_sample's nearbyint
            outside = (near < 0) | (near > n_in - 1)
            # None: no voxel outside, nothing to zero (asked on the CPU only; on a GPU it would be a sync)
            self.nearest.append((near.clamp(0, n_in - 1), None if m.device.type == "cpu" and not bool(outside.any())
                                 else outside))

    def resample_linear(self, x: Tensor) -> Tensor:
        """(C, *S_in) float -> (C, *S_out): one 1-D linear interpolation per axis."""
        for a, (i0, i1, w0, w1) in enumerate(self.linear):
            shape = [1] * x.dim()
            shape[1 + a] = -1
            out = _take(x, 1 + a, i0).mul_(w0.view(shape).to(x.dtype))
            x = out.addcmul_(_take(x, 1 + a, i1), w1.view(shape).to(x.dtype))
        return x

    def resample_nearest(self, x: Tensor) -> Tensor:
        """(C, *S_in) any dtype -> (C, *S_out): the nearest voxel per axis, 0 outside."""
        for a, (idx, outside) in enumerate(self.nearest):
            shape = [1] * x.dim()
            shape[1 + a] = -1
            x = _take(x, 1 + a, idx)
            if outside is not None:
                x = x.masked_fill_(outside.view(shape), 0)
        return x


def _take(x: Tensor, dim: int, idx: Tensor) -> Tensor:
    """``x.index_select(dim, idx)`` on a contiguous ``x`` seen as (before, n, after): ``index_select``
    along the last axis of a 4-D tensor is 5-20x slower on the CPU than along the middle of a 3-D one."""
    before = 1
    for n in x.shape[:dim]:
        before *= n
    out = x.reshape(before, x.shape[dim], -1).index_select(1, idx)
    return out.reshape(*x.shape[:dim], idx.numel(), *x.shape[dim + 1:])


class Separable:
    """The batch's per-sample :class:`AxisMaps`, as the resampling functions of (B, C, *S) tensors the
    affine applies (``linear`` for images and per-class label scores, ``nearest`` for labels)."""

    def __init__(self, lin: Tensor, in_shape: Sequence[int], out_shape: Sequence[int]):
        diag = torch.diagonal(lin, dim1=1, dim2=2)
        self.maps = [AxisMaps(d.unbind(0), in_shape, out_shape) for d in diag]

    def linear(self, x: Tensor) -> Tensor:
        return _per_sample([m.resample_linear(r) for m, r in zip(self.maps, x, strict=True)])

    def nearest(self, x: Tensor) -> Tensor:
        return _per_sample([m.resample_nearest(r) for m, r in zip(self.maps, x, strict=True)])


def _per_sample(rows: list[Tensor]) -> Tensor:
    """The rows as one batch (one row: a view, no copy)."""
    return rows[0][None] if len(rows) == 1 else torch.stack(rows)
