"""Batched intensity and colour ops for :mod:`fastvision.data.augment.spatial` (images only, labels pass).

Each op draws one parameter per sample from the call's ``rng`` (see ``gpu_aug._Rng``: ``mask``,
``uniform``, ``device_generator``) and applies it to the whole batch with broadcasting; a sample
whose probability draw fails keeps its input exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fastvision.errors import ConfigError

Label = Tensor | None


def _bshape(x: Tensor, v: Tensor) -> Tensor:
    """Reshape per-sample (B,) or (B, C) values to broadcast against ``x`` (B, ...)."""
    return v.reshape(*v.shape, *([1] * (x.dim() - v.dim())))


def _select(mask: Tensor, new: Tensor, old: Tensor) -> Tensor:
    return torch.where(_bshape(old, mask), new, old)


def owned(rng: Any, x: Tensor) -> bool:
    """True when ``x`` is a CPU tensor an earlier op of this call made (``rng.owns``: not the caller's
    input) and contiguous: an op may then update it in place instead of writing a new copy (on 64^3
    patches a new tensor costs as much as the op itself: the allocator maps and zeroes fresh pages)."""
    owns = getattr(rng, "owns", None)
    return x.device.type == "cpu" and owns is not None and owns(x) and x.is_contiguous()


def put_rows(x: Tensor, idx: Tensor, rows: Tensor, own: bool) -> Tensor:
    """``x`` with its rows ``idx`` replaced by ``rows``: copied into ``x`` itself where it is this call's own
    tensor (:func:`owned`; one ``copy_`` per row, 2x cheaper than ``index_copy_``), else into a new tensor
    (row copies, no scatter per element)."""
    if not own:
        return x.index_copy(0, idx, rows)
    for j, i in enumerate(idx.tolist()):
        x[i].copy_(rows[j])
    return x


def _on_rows(mask: Tensor, image: Tensor, fn, fn_=None, own: bool = False) -> Tensor:
    """``fn(x, idx)`` on the samples that fire, in place of the others' input: on the CPU only those
    rows (``idx`` their indices; free to find there), on a GPU all of them (``idx`` None) then selected.
    ``own`` (the pipeline's own tensor, :func:`owned`) with ``fn_``: ``fn_(rows, idx)`` updates each firing
    row of ``image`` in place (``idx`` a slice), and ``image`` itself is returned."""
    if image.device.type != "cpu":
        return _select(mask, fn(image, None), image)
    # a CPU mask read as a list: no op runs (``nonzero`` would be one whose size depends on the data,
    # which the host-sync detector counts, as it must on a GPU)
    fires = [i for i, f in enumerate(mask.tolist()) if f]
    if not fires:
        return image
    if own and fn_ is not None:
        for i in [None] if len(fires) == image.shape[0] else fires:
            rows = slice(None) if i is None else slice(i, i + 1)
            fn_(image[rows], rows)
        return image
    idx = torch.tensor(fires, dtype=torch.long)
    if idx.numel() == image.shape[0]:
        return fn(image, idx)
    return put_rows(image, idx, fn(image[idx], idx).to(image.dtype), False)


def _std_mean(flat: Tensor) -> tuple[Tensor, Tensor]:
    """(unbiased std, mean) over the last axis of (N, C, V), two passes (the second a norm of the
    differences): ``torch.std_mean`` over a dim is ~8x slower on the CPU for these shapes."""
    mean = flat.mean(2)
    return _centred_std(flat - mean[..., None]), mean


def _centred_std(centred: Tensor) -> Tensor:
    """Unbiased std over the last axis of (N, C, V) values whose mean is already subtracted: one pass."""
    return torch.linalg.vector_norm(centred, dim=2) / max(centred.shape[2] - 1, 1) ** 0.5


def _idle(mask: Tensor, image: Tensor) -> bool:
    """True when no sample fires on the CPU: the op returns its input untouched, after its draws (so
    the random stream is the same). Asked on the CPU only: on a GPU it would be a host sync."""
    return image.device.type == "cpu" and not bool(mask.any())


@dataclass
class Intensity:
    """x * (1 + U(-scale, scale)) + U(-shift, shift), one factor and offset per sample
    (MONAI ``RandScaleIntensity`` / ``RandShiftIntensity``)."""

    prob: float = 0.5
    scale: float = 0.0
    shift: float = 0.0

    def __call__(self, image: Tensor, label: Label, rng: Any) -> tuple[Tensor, Label]:
        m = rng.mask(self.prob)
        f = rng.uniform(1 - self.scale, 1 + self.scale)
        o = rng.uniform(-self.shift, self.shift)
        if _idle(m, image):
            return image, label
        return _select(m, image * _bshape(image, f) + _bshape(image, o), image), label


@dataclass
class ForegroundShift:
    """Seed 000's ``RandomBrightnessCorrection``: with probability ``prob`` per sample, add U(range) per
    channel to the voxels above 0 (of the z-scored image: those above the channel's foreground mean), the
    others kept. The seed's defaults: p 0.5, U(0.9, 1.1) (``alpha`` 0.1 around 1, added, not multiplied)."""

    prob: float = 0.5
    range: list[float] | None = None

    def __call__(self, image: Tensor, label: Label, rng: Any) -> tuple[Tensor, Label]:
        m = rng.mask(self.prob)
        lo, hi = self.range if self.range is not None else (0.9, 1.1)
        o = rng.uniform(lo, hi, image.shape[1])  # (B, C): one offset per channel
        if _idle(m, image):
            return image, label
        return _select(m, torch.where(image > 0, image + _bshape(image, o), image), image), label


@dataclass
class Noise:
    """Additive Gaussian noise with a per-sample std drawn from U(0, std) (MONAI ``RandGaussianNoise``)."""

    prob: float = 0.15
    std: float = 0.1

    def __call__(self, image: Tensor, label: Label, rng: Any) -> tuple[Tensor, Label]:
        m = rng.mask(self.prob)
        sd = rng.uniform(0.0, self.std)
        call = rng.reserve()
        if owned(rng, image):  # the firing rows' noise drawn at once, as below, then added in place
            fires = [i for i, f in enumerate(m.tolist()) if f]
            if fires:
                n = rng.normal_rows(fires, tuple(image.shape[1:]), image.dtype, call)
                n.mul_(_bshape(n, sd[fires]))
                for j, i in enumerate(fires):
                    image[i].add_(n[j])
            return image, label

        def noise(x: Tensor, idx: Tensor | None) -> Tensor:  # on the CPU: drawn for the firing samples only
            s = _bshape(x, sd if idx is None else sd[idx])
            rows = list(range(x.shape[0])) if idx is None else idx.tolist()
            return rng.normal_rows(rows, tuple(x.shape[1:]), x.dtype, call).mul_(s).add_(x)

        return _on_rows(m, image, noise), label


@dataclass
class Brightness:
    """Multiply by U(1 - factor, 1 + factor) per sample (nnU-Net multiplicative brightness)."""

    prob: float = 0.15
    factor: float = 0.25

    def __call__(self, image: Tensor, label: Label, rng: Any) -> tuple[Tensor, Label]:
        m = rng.mask(self.prob)
        f = rng.uniform(1 - self.factor, 1 + self.factor)
        return _on_rows(m, image, lambda x, idx: x * _bshape(x, f if idx is None else f[idx]),
                        lambda x, rows: x.mul_(_bshape(x, f[rows])), owned(rng, image)), label


@dataclass
class Contrast:
    """Scale about the per-channel mean by U(1 - factor, 1 + factor), clamped to the original
    per-channel range (nnU-Net contrast augmentation with preserved range)."""

    prob: float = 0.15
    factor: float = 0.25

    def __call__(self, image: Tensor, label: Label, rng: Any) -> tuple[Tensor, Label]:
        m = rng.mask(self.prob)
        f_all = rng.uniform(1 - self.factor, 1 + self.factor)

        def contrast(x: Tensor, idx, inplace: bool = False) -> Tensor:
            f = _bshape(x, f_all if idx is None else f_all[idx])
            flat = x.flatten(2)
            # amin, amax and clamp_min_ / clamp_max_: the values of aminmax(dim) and clamp_(tensor, tensor), which
            # are 8-10x slower on the CPU (a reduction and a ternary op without the vectorised loops)
            mean, lo, hi = (_bshape(x, v) for v in (flat.mean(2), flat.amin(2), flat.amax(2)))
            out = x.sub_(mean) if inplace else x - mean  # the in-place form: the same operations, in order
            return out.mul_(f).add_(mean).clamp_min_(lo).clamp_max_(hi)

        return _on_rows(m, image, contrast, lambda x, rows: contrast(x, rows, True), owned(rng, image)), label


@dataclass
class Gamma:
    """x -> lo + (hi - lo) * ((x - lo) / (hi - lo)) ** g with g ~ U(range), per channel range
    [lo, hi] (MONAI ``RandAdjustContrast``).

    nnU-Net's variant (batchgeneratorsv2 ``GammaTransform``): ``per_channel`` draws g per channel,
    ``retain_stats`` restores each channel's mean and (unbiased) std afterwards, ``invert`` applies it
    to ``-x`` (the ``gamma_inverted`` op: dark structures get the bright ones' treatment)."""

    prob: float = 0.15
    range: list[float] | None = None
    per_channel: bool = False
    retain_stats: bool = False
    invert: bool = False

    def __call__(self, image: Tensor, label: Label, rng: Any) -> tuple[Tensor, Label]:
        m = rng.mask(self.prob)
        g_lo, g_hi = self.range if self.range is not None else (0.7, 1.5)
        g_all = rng.uniform(g_lo, g_hi, *((image.shape[1],) if self.per_channel else ()))
        return _on_rows(m, image, lambda x, idx: self._apply(x, g_all if idx is None else g_all[idx]),
                        lambda x, rows: self._apply(x, g_all[rows], True), owned(rng, image)), label

    def _apply(self, image: Tensor, g: Tensor, inplace: bool = False) -> Tensor:
        """The gamma of (N, C, *S) images with exponents g (N,) or (N, C); ``inplace``: in ``image``'s memory
        (the same operations in the same order, so the same numbers).

        Cheap passes over the voxels (on a CPU core each costs what it moves): ``((x - lo) / span) ** g``
        as ``exp(g log(.))`` (the CPU's tensor ``pow`` is a scalar loop, 3x dearer; equal to 1e-7 on
        [0, 1]; 0 stays 0); no clamp to [0, 1] (``x - lo <= span`` holds in floats already); the rescaling
        and the stats-keeping affine folded into one multiply-add per channel, the output's mean and std
        read from the power's (``mean * span + lo``, ``std * span``) instead of a second output; the
        inversion folded into the first and the last pass (``-x - -hi`` is ``hi - x`` exactly)."""
        g = _bshape(image, g)
        flat = image.flatten(2)
        lo, hi = _bshape(image, flat.amin(2)), _bshape(image, flat.amax(2))
        span = (hi - lo).clamp_min(1e-7)
        std_in, mean_in = _std_mean(flat) if self.retain_stats else (None, None)  # before image is updated
        if self.invert:  # the gamma of -x: its minimum is -hi, so x' - lo' = hi - x
            p = torch.sub(hi, image, out=image) if inplace else hi - image
        else:
            p = image.sub_(lo) if inplace else image - lo
        p.div_(span).log_().mul_(g).exp_()  # ((x - lo) / span) ** g
        sign = -1.0 if self.invert else 1.0
        if not self.retain_stats:  # lo + span * p, negated back for the inverted image
            return p.mul_(span * sign).add_(hi if self.invert else lo)
        # (lo + span p - mean_out) * std_in / std_out + mean_in (of x' = -x when inverted: mean_in negated)
        mean_p = _bshape(image, p.flatten(2).mean(2))
        p.sub_(mean_p)
        std_p = _bshape(image, _centred_std(p.flatten(2)))
        factor = span * _bshape(image, std_in) / (std_p * span).clamp_min(1e-7)
        return p.mul_(factor * sign).add_(_bshape(image, mean_in))


@dataclass
class InvertedGamma(Gamma):
    """:class:`Gamma` of the inverted image (nnU-Net: p 0.1, before the plain gamma's p 0.3)."""

    invert: bool = True


@dataclass
class ColorJitter:
    """Brightness, contrast, saturation and hue jitter of RGB images with values in [0, max_value]
    (torchvision ``ColorJitter`` factors, applied in that fixed order)."""

    prob: float = 0.8
    brightness: float = 0.0
    contrast: float = 0.0
    saturation: float = 0.0
    hue: float = 0.0
    max_value: float = 1.0

    def __call__(self, image: Tensor, label: Label, rng: Any) -> tuple[Tensor, Label]:
        if image.shape[1] != 3:
            raise ConfigError(f"data.augment.color_jitter needs RGB images, got {image.shape[1]} channels")
        m = rng.mask(self.prob)
        b = rng.uniform(max(0.0, 1 - self.brightness), 1 + self.brightness)
        c = rng.uniform(max(0.0, 1 - self.contrast), 1 + self.contrast)
        s = rng.uniform(max(0.0, 1 - self.saturation), 1 + self.saturation)
        h = rng.uniform(-self.hue, self.hue)
        x = image / self.max_value
        x = (x * _bshape(x, b)).clamp(0, 1)
        gray_mean = _gray(x).flatten(1).mean(1)
        x = _blend(x, _bshape(x, gray_mean), c)
        x = _blend(x, _gray(x), s)
        if self.hue > 0:
            x = _shift_hue(x, h)
        return _select(m, x * self.max_value, image), label


def _gray(x: Tensor) -> Tensor:
    """(B, 3, *S) RGB -> (B, 1, *S) luma with the ITU-R 601 weights torchvision uses."""
    return (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)


def _blend(x: Tensor, other: Tensor, f: Tensor) -> Tensor:
    """f * x + (1 - f) * other, clamped to [0, 1]; f is (B,)."""
    f = _bshape(x, f)
    return (f * x + (1 - f) * other).clamp(0, 1)


def _shift_hue(x: Tensor, shift: Tensor) -> Tensor:
    """Rotate the hue of (B, 3, *S) RGB in [0, 1] by ``shift`` (B,) turns, through HSV."""
    r, g, b = x.unbind(1)
    v, _ = x.max(1)
    c = v - x.min(1).values
    safe_c = torch.where(c > 0, c, torch.ones_like(c))
    h = torch.where(v == r, ((g - b) / safe_c) % 6,
                    torch.where(v == g, (b - r) / safe_c + 2, (r - g) / safe_c + 4))
    h = torch.where(c > 0, h / 6, torch.zeros_like(h))
    h = (h + _bshape(h, shift)) % 1.0
    # HSV -> RGB: channel n gets v - c * clamp(min(k, 4 - k), 0, 1), k = (n + 6h) mod 6, n = 5, 3, 1
    n = torch.arange(5, 0, -2, device=x.device, dtype=x.dtype).reshape(1, 3, *([1] * (x.dim() - 2)))  # 5, 3, 1
    k = (n + 6 * h.unsqueeze(1)) % 6
    return v.unsqueeze(1) - c.unsqueeze(1) * torch.minimum(k, 4 - k).clamp(0, 1)
