"""Batched image-degradation ops of nnU-Net v2's training augmentation, beside the others in
:mod:`fastvision.data.augment.spatial` (images only, labels pass):

* :class:`Blur`: a separable Gaussian blur with its own sigma per sample, channel and axis
  (batchgeneratorsv2 ``GaussianBlurTransform``: kernel of ``6 sigma + 0.5`` rounded to an odd size,
  reflect padding), run as one grouped convolution per axis for the whole batch; an axis shorter than the
  kernel's reach (a thin stack's one-slice patch axis) is mirrored as often as it takes (:func:`reflect_pad`),
  so a one-voxel axis is left as it is;
* :class:`LowResolution`: nearest-exact down-sampling by a per-(sample, channel) factor, then linear
  up-sampling back (``SimulateLowResolutionTransform``); each sample's size differs, so instead of
  two resizes it is the composed per-axis map, two gathers and a lerp per axis, exact to the resizes.

Which (sample, channel) pairs fire: the op's ``prob`` per sample, then ``channel_prob`` per channel
(nnU-Net's ``apply_probability`` and ``p_per_channel``). On the CPU only those rows are computed
(indexing them costs no sync there); on a GPU the whole batch is, then selected, with no host sync.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fastvision.data.augment.intensity import Label, _select, owned, put_rows


def _fire(rng, prob: float, channel_prob: float, batch: int, channels: int) -> Tensor:
    """(B, C) bool: the sample's draw (``prob``) and then each channel's (``channel_prob``)."""
    m = rng.mask(prob)
    return m[:, None] & (rng.uniform(0.0, 1.0, channels) < channel_prob)


def _rows(fire: Tensor, image: Tensor, fn: Callable[[Tensor, Tensor], Tensor], own: bool = False) -> Tensor:
    """``fn(x (N, 1, *S), rows (N,))`` on the (sample, channel) rows that fire, put back in place; ``own``
    (the pipeline's own tensor, :func:`~fastvision.data.augment.intensity.owned`): into ``image`` itself."""
    b, c = image.shape[:2]
    flat = image.reshape(b * c, 1, *image.shape[2:])
    if image.device.type == "cpu":  # index the firing rows: no device to sync with, 1/prob less work
        rows = fire.reshape(-1).nonzero().squeeze(1)
        if rows.numel() == 0:
            return image
        if rows.numel() == b * c:
            return fn(flat, rows).to(image.dtype).reshape(image.shape)
        return put_rows(flat, rows, fn(flat[rows], rows).to(image.dtype), own).reshape(image.shape)
    out = fn(flat, torch.arange(b * c, device=image.device)).to(image.dtype).reshape(image.shape)
    return _select(fire, out, image)


def odd_kernel_size(sigma: Tensor) -> Tensor:
    """batchgeneratorsv2's kernel size ``round_to_nearest_odd(6 sigma + 0.5)`` (round half to even)."""
    n = sigma * 6 + 0.5
    r = torch.round(n)
    return torch.where(r % 2 == 1, r, torch.where(n - r >= 0, r + 1, r - 1))


@dataclass
class Blur:
    """Gaussian blur, sigma ~ U(``sigma``) per sample, channel and axis (nnU-Net: p 0.2, per channel 0.5,
    sigma 0.5-1)."""

    prob: float = 0.2
    sigma: list[float] | None = None
    channel_prob: float = 0.5

    def __call__(self, image: Tensor, label: Label, rng) -> tuple[Tensor, Label]:
        b, c, nd = image.shape[0], image.shape[1], image.dim() - 2
        lo, hi = self.sigma if self.sigma is not None else (0.5, 1.0)
        fire = _fire(rng, self.prob, self.channel_prob, b, c)
        sig = rng.uniform(lo, hi, c, nd).reshape(b * c, nd)
        half = int(odd_kernel_size(torch.tensor(float(hi)))) // 2  # the widest kernel any draw needs
        taps = torch.arange(-half, half + 1, device=image.device, dtype=torch.float32)

        def blur(x: Tensor, rows: Tensor) -> Tensor:
            s = sig[rows]  # (N, nd)
            reach = (odd_kernel_size(s) // 2)[..., None]  # each kernel's own half-width; outside: weight 0
            w = torch.exp(-0.5 * (taps / s[..., None]) ** 2) * (taps.abs() <= reach)
            w = w / w.sum(-1, keepdim=True)  # (N, nd, K)
            if x.device.type == "cpu":  # a few rows: shifted adds of each row's own taps, 2-3x cheaper than conv
                return torch.stack([_shift_blur(x[i, 0].float(), w[i], reach[i, :, 0].tolist(), half)
                                    for i in range(x.shape[0])])[:, None]
            y = x.reshape(1, x.shape[0], *x.shape[2:]).float()
            for a in range(nd):
                shape = [1] * nd
                shape[a] = 2 * half + 1
                y = reflect_pad(y, a + 2, half)
                conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
                y = conv(y, w[:, a].reshape(-1, 1, *shape), groups=y.shape[1])
            return y.reshape(x.shape)

        return _rows(fire, image, blur, owned(rng, image)), label


def _shift_blur(x: Tensor, w: Tensor, reach: list[float], half: int) -> Tensor:
    """One row (*S) blurred along each axis by its taps ``w`` (nd, 2 half + 1), of which only the
    ``reach[a]`` either side of the centre are non-zero: reflect padding, then a weighted sum of shifted
    views (the grouped convolution's result, without its zero taps)."""
    nd = x.dim()
    wl = w.tolist()
    for a in range(nd):
        r, n = int(reach[a]), x.shape[a]
        y = reflect_pad(x, a, r) if r else x
        taps = wl[a][half - r:half + r + 1]
        out = y.narrow(a, 0, n) * taps[0]
        for k in range(1, 2 * r + 1):
            out.add_(y.narrow(a, k, n), alpha=taps[k])
        x = out
    return x


def reflect_pad(x: Tensor, axis: int, r: int) -> Tensor:
    """``x`` padded by ``r`` on both sides of ``axis``, mirrored about the edge voxels (torch's ``reflect``,
    batchgeneratorsv2's padding): ``F.pad`` where it is defined (``r`` below the axis' length), else the same
    mirror repeated with period ``2 (n - 1)`` (a one-voxel axis: that voxel everywhere), by one gather."""
    n = x.shape[axis]
    if r < n and x.dim() - axis <= 3:  # F.pad's reflect: the axes from ``axis`` on, after one leading axis
        pad = [0, 0] * (x.dim() - axis)
        pad[-2] = pad[-1] = r
        y = F.pad(x.reshape(-1, *x.shape[axis:]), pad, mode="reflect")
        return y.reshape(*x.shape[:axis], *y.shape[1:])
    i = torch.arange(-r, n + r, device=x.device)
    if n > 1:
        i = i.remainder(2 * (n - 1))
        i = torch.where(i >= n, 2 * (n - 1) - i, i)
    else:
        i = torch.zeros_like(i)
    return x.index_select(axis, i)


def _lowres_axis(n: int, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The composed nearest-exact n -> round(n s) and linear round(n s) -> n maps of one axis:
    ``out[j] = (1 - w[j]) x[i0[j]] + w[j] x[i1[j]]``, each (N, n), as ``F.interpolate`` computes them."""
    m = torch.round(n * scale).clamp_min(1)  # (N,) down-sampled sizes
    j = torch.arange(n, device=scale.device, dtype=torch.float32)
    real = ((m / n)[:, None] * (j + 0.5) - 0.5).clamp_min(0)  # linear: source position in the small grid
    k0 = real.floor()
    k1 = torch.minimum(k0 + 1, (m - 1)[:, None])
    w = (real - k0).clamp(0, 1)

    def src(k: Tensor) -> Tensor:  # nearest-exact: the small grid's voxel k reads voxel floor((k + .5) n / m)
        return ((k + 0.5) * (n / m)[:, None]).floor().clamp_max(n - 1).long()

    return src(k0), src(k1), w


def lowres_gathered(x: Tensor, scale: Tensor, ignore_axes: list[int] | None) -> Tensor:
    """The low-resolution simulation of (N, 1, *S) rows, each at its own ``scale`` (N,), in one pass:
    per axis two gathers and a lerp (:func:`_lowres_axis`), no per-row resize and no host sync."""
    nd = x.dim() - 2
    for a in range(nd):
        if ignore_axes is not None and a in ignore_axes:
            continue
        i0, i1, w = _lowres_axis(x.shape[2 + a], scale)
        shape = [x.shape[0], 1] + [1] * nd
        shape[2 + a] = x.shape[2 + a]
        i0, i1, w = i0.reshape(shape), i1.reshape(shape), w.reshape(shape)
        x = torch.take_along_dim(x, i0, 2 + a) * (1 - w) + torch.take_along_dim(x, i1, 2 + a) * w
    return x


def _two_resizes(x: Tensor, scale: float, ignore_axes: list[int] | None) -> Tensor:
    """batchgeneratorsv2's own steps on one (1, 1, *S) row: nearest-exact down, (bi/tri)linear up."""
    shape = list(x.shape[2:])
    small = [n if ignore_axes and a in ignore_axes else round(n * scale) for a, n in enumerate(shape)]
    small = [max(1, n) for n in small]
    mode = ("linear", "bilinear", "trilinear")[len(shape) - 1]
    return F.interpolate(F.interpolate(x, small, mode="nearest-exact"), shape, mode=mode)


@dataclass
class LowResolution:
    """Simulate a coarser scan: down by ``scale`` ~ U(range) per sample and channel (one factor for all
    axes but ``ignore_axes``), nearest, then back up, (bi/tri)linear (nnU-Net: p 0.25, per channel 0.5,
    scale 0.5-1; ``ignore_axes`` is the coarse axis of a "dummy 2-D" patch)."""

    prob: float = 0.25
    range: list[float] | None = None
    channel_prob: float = 0.5
    ignore_axes: list[int] | None = None

    def __call__(self, image: Tensor, label: Label, rng) -> tuple[Tensor, Label]:
        b, c = image.shape[0], image.shape[1]
        lo, hi = self.range if self.range is not None else (0.5, 1.0)
        fire = _fire(rng, self.prob, self.channel_prob, b, c)
        scale = rng.uniform(lo, hi, c).reshape(b * c)

        def lowres(x: Tensor, rows: Tensor) -> Tensor:
            if x.device.type == "cpu":  # a few rows: the two resizes themselves are cheaper than the gathers
                return torch.cat([_two_resizes(x[i:i + 1].float(), float(scale[r]), self.ignore_axes)
                                  for i, r in enumerate(rows.tolist())])
            return lowres_gathered(x.float(), scale[rows], self.ignore_axes)

        return _rows(fire, image, lowres, owned(rng, image)), label
