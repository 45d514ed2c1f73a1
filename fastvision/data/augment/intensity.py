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
        return _select(m, image * _bshape(image, f) + _bshape(image, o), image), label


@dataclass
class Noise:
    """Additive Gaussian noise with a per-sample std drawn from U(0, std) (MONAI ``RandGaussianNoise``)."""

    prob: float = 0.15
    std: float = 0.1

    def __call__(self, image: Tensor, label: Label, rng: Any) -> tuple[Tensor, Label]:
        m = rng.mask(self.prob)
        sd = rng.uniform(0.0, self.std)
        noise = torch.randn(image.shape, generator=rng.device_generator(), device=image.device, dtype=image.dtype)
        return _select(m, image + noise * _bshape(image, sd), image), label


@dataclass
class Brightness:
    """Multiply by U(1 - factor, 1 + factor) per sample (nnU-Net multiplicative brightness)."""

    prob: float = 0.15
    factor: float = 0.25

    def __call__(self, image: Tensor, label: Label, rng: Any) -> tuple[Tensor, Label]:
        m = rng.mask(self.prob)
        f = rng.uniform(1 - self.factor, 1 + self.factor)
        return _select(m, image * _bshape(image, f), image), label


@dataclass
class Contrast:
    """Scale about the per-channel mean by U(1 - factor, 1 + factor), clamped to the original
    per-channel range (nnU-Net contrast augmentation with preserved range)."""

    prob: float = 0.15
    factor: float = 0.25

    def __call__(self, image: Tensor, label: Label, rng: Any) -> tuple[Tensor, Label]:
        m = rng.mask(self.prob)
        f = _bshape(image, rng.uniform(1 - self.factor, 1 + self.factor))
        flat = image.flatten(2)
        mean, lo, hi = (_bshape(image, v) for v in (flat.mean(2), flat.amin(2), flat.amax(2)))
        out = torch.minimum(torch.maximum((image - mean) * f + mean, lo), hi)
        return _select(m, out, image), label


@dataclass
class Gamma:
    """x -> lo + (hi - lo) * ((x - lo) / (hi - lo)) ** g with g ~ U(range), per channel range
    [lo, hi] (MONAI ``RandAdjustContrast``)."""

    prob: float = 0.15
    range: list[float] | None = None

    def __call__(self, image: Tensor, label: Label, rng: Any) -> tuple[Tensor, Label]:
        m = rng.mask(self.prob)
        g_lo, g_hi = self.range if self.range is not None else (0.7, 1.5)
        g = _bshape(image, rng.uniform(g_lo, g_hi))
        flat = image.flatten(2)
        lo, hi = _bshape(image, flat.amin(2)), _bshape(image, flat.amax(2))
        span = (hi - lo).clamp_min(1e-7)
        out = ((image - lo) / span).clamp(0, 1).pow(g) * span + lo
        return _select(m, out, image), label


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
