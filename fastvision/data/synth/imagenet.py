"""``fastvision data synth imagenet OUT``: a small, learnable ImageFolder of JPEGs.

Each class is one object pattern: a colour (hue spaced around the wheel), a shape (disk,
square, triangle, ring) and a stripe texture (orientation and frequency), drawn at a random
position and scale over a noisy low-saturation background. Classes differ in several cues at
once, so a ResNet-18 separates them within a few CPU epochs, while the random placement, scale,
hue jitter and noise keep the task from being a lookup of a few pixels. Files follow the
ImageNet layout: ``OUT/{train,val}/<class>/<n>.JPEG``.
"""
from __future__ import annotations

import colorsys
import math
from pathlib import Path

import numpy as np
from PIL import Image

from fastvision.data.synth import SYNTH, require
from fastvision.errors import ConfigError

SHAPES = ("disk", "square", "triangle", "ring")


def _shape_mask(shape: str, yy: np.ndarray, xx: np.ndarray, cy: float, cx: float, r: float) -> np.ndarray:
    """Boolean (H, W) mask of ``shape`` centred at (cy, cx) with half-size ``r`` pixels."""
    dy, dx = yy - cy, xx - cx
    if shape == "disk":
        return dy * dy + dx * dx <= r * r
    if shape == "square":
        return (np.abs(dy) <= r * 0.85) & (np.abs(dx) <= r * 0.85)
    if shape == "triangle":  # apex up: inside when below the apex and within the widening sides
        return (dy >= -r) & (dy <= r * 0.8) & (np.abs(dx) <= (dy + r) * 0.6)
    d2 = dy * dy + dx * dx  # ring
    return (d2 <= r * r) & (d2 >= (0.55 * r) ** 2)


def class_style(c: int, classes: int) -> dict:
    """The fixed pattern of class ``c``: hue, shape, stripe angle (rad) and period (px at size 64)."""
    return {
        "hue": c / classes,
        "shape": SHAPES[c % len(SHAPES)],
        "angle": math.pi * ((c * 3) % 8) / 8,
        "period": 4.0 + 3.0 * ((c // len(SHAPES)) % 3),
    }


def render(c: int, classes: int, size: int, rng: np.random.Generator, height: int | None = None) -> np.ndarray:
    """One (height, size, 3) uint8 image of class ``c`` (``height`` None: square)."""
    st = class_style(c, classes)
    height = height or size
    short = min(size, height)
    yy, xx = np.mgrid[0:height, 0:size].astype(np.float32)
    # background: random grey-ish colour plus pixel noise, so it carries no class signal
    bg = rng.uniform(60, 200) + rng.uniform(-20, 20, size=3)
    img = bg[None, None, :] + rng.normal(0, 18, size=(height, size, 3))
    r = rng.uniform(0.22, 0.38) * short
    cy, cx = rng.uniform(r, np.array([height - r, size - r]))
    mask = _shape_mask(st["shape"], yy, xx, cy, cx, r)
    hue = (st["hue"] + rng.uniform(-0.02, 0.02)) % 1.0
    colour = np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.7, 1.0), rng.uniform(0.75, 1.0))) * 255
    period = st["period"] * short / 64
    phase = rng.uniform(0, 2 * math.pi)
    stripes = np.cos(2 * math.pi * (xx * math.cos(st["angle"]) + yy * math.sin(st["angle"])) / period + phase)
    shade = 0.75 + 0.25 * stripes[..., None]
    img = np.where(mask[..., None], colour[None, None, :] * shade, img)
    img += rng.normal(0, 6, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


@SYNTH.register("imagenet")
def synth(out: Path, *, seed: int = 0, classes: int = 10, per_class: int = 100, val_per_class: int = 20,
          size: int = 64, height: int | None = None, quality: int = 90) -> Path:
    """Write ``OUT/{train,val}/classNNN/NNNNN.JPEG``.

    Args:
        out: output folder (created).
        seed: RNG seed; the same seed gives the same files.
        classes: number of classes (>= 2).
        per_class: training images per class.
        val_per_class: validation images per class.
        size: image side (the width when ``height`` is given) in pixels.
        height: image height in pixels (None: square); ImageNet's typical photo is 500 x 375.
        quality: JPEG quality (1-95).

    Returns:
        ``out``.
    """
    require("imagenet", classes=(classes, 2), per_class=(per_class, 1), val_per_class=(val_per_class, 1),
            size=(size, 16), height=(height or size, 16), quality=(quality, 1))
    if quality > 95:
        raise ConfigError(f"data synth imagenet --quality {quality}: must be at most 95")
    out = Path(out)
    for split, n, stream in (("train", per_class, 0), ("val", val_per_class, 1)):
        rng = np.random.default_rng([seed, stream])
        for c in range(classes):
            d = out / split / f"class{c:03d}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(render(c, classes, size, rng, height)).save(d / f"{i:05d}.JPEG", quality=quality)
    return out
