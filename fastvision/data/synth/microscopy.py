"""Synthetic microscopy segmentation data in the ``images/`` + ``masks/`` folder format.

Each image shows cell-like bodies (textured ellipses with a nucleus) and indentation-like marks
(rotated square pyramids with shaded facets, as left by a Vickers indenter in SEM images of
seed 001), on a textured background with uneven illumination, optical blur and sensor noise.
Objects are only moderately brighter or darker than the background, so a network must use shape
and texture, not a global threshold. Output: 8-bit grey PNGs and binary 0/255 mask PNGs.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from fastvision.data.synth import SYNTH, require


def _blur(img: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian blur by FFT (periodic boundary; fine for texture and illumination fields)."""
    h, w = img.shape
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    kernel = np.exp(-2 * (np.pi * sigma) ** 2 * (fx**2 + fy**2))
    return np.fft.irfft2(np.fft.rfft2(img) * kernel, s=(h, w))


def _texture(rng: np.random.Generator, shape: tuple[int, int], sigma: float) -> np.ndarray:
    """White noise blurred by ``sigma``, scaled to unit variance in expectation: by the blur's own gain
    (Parseval: the mean of the squared kernel over all frequencies), not by the field's spread, which a
    blur wider than the image makes nearly zero (dividing by it saturated images under ~100 px)."""
    h, w = shape
    fy, fx = np.fft.fftfreq(h)[:, None], np.fft.fftfreq(w)[None, :]
    gain = np.sqrt(np.mean(np.exp(-4 * (np.pi * sigma) ** 2 * (fx**2 + fy**2))))
    return _blur(rng.standard_normal(shape), sigma) / gain


def _cell(rng, yy, xx, size):
    """Ellipse mask and an intensity pattern (membrane rim + nucleus)."""
    cy, cx = rng.uniform(0.1, 0.9, 2) * size
    a, b = rng.uniform(0.04, 0.11, 2) * size
    th = rng.uniform(0, np.pi)
    dy, dx = yy - cy, xx - cx
    u = (dx * np.cos(th) + dy * np.sin(th)) / a
    v = (-dx * np.sin(th) + dy * np.cos(th)) / b
    r = np.sqrt(u**2 + v**2)
    mask = r <= 1.0
    nucleus = np.sqrt((u - 0.2) ** 2 + (v + 0.1) ** 2) < 0.4
    pattern = 0.35 + 0.25 * np.exp(-((r - 0.9) ** 2) / 0.01) + 0.2 * nucleus
    return mask, pattern


def _indent(rng, yy, xx, size):
    """Rotated square pyramid: four facets shaded by their orientation to a light direction."""
    cy, cx = rng.uniform(0.12, 0.88, 2) * size
    half = rng.uniform(0.05, 0.12) * size
    th = rng.uniform(0, np.pi / 2)
    dy, dx = yy - cy, xx - cx
    u = (dx * np.cos(th) + dy * np.sin(th)) / half
    v = (-dx * np.sin(th) + dy * np.cos(th)) / half
    mask = (np.abs(u) + np.abs(v)) <= 1.0  # a diamond, the usual look of a Vickers mark
    facet = (u > v).astype(int) * 2 + (u > -v).astype(int)
    shades = rng.permutation(np.array([-0.4, -0.25, 0.2, 0.35]))
    pattern = shades[facet] - 0.15 * (1 - (np.abs(u) + np.abs(v)))
    return mask, pattern


def make_sample(rng: np.random.Generator, size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """One (image uint8 (H, W), mask uint8 (H, W) in {0, 255}) pair."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    base = 0.45 + 0.06 * _texture(rng, (size, size), sigma=3)
    gy, gx = rng.uniform(-0.25, 0.25, 2)
    illum = 1 + gy * (yy / size - 0.5) + gx * (xx / size - 0.5) + 0.15 * _texture(rng, (size, size), sigma=40)
    img = base.copy()
    mask = np.zeros((size, size), bool)
    for _ in range(rng.integers(3, 9)):
        shape_fn = _cell if rng.random() < 0.6 else _indent
        m, pattern = shape_fn(rng, yy, xx, size)
        inner = pattern + 0.08 * _texture(rng, (size, size), sigma=1.5)
        img = np.where(m, 0.45 + inner * rng.uniform(0.6, 1.0), img)
        mask |= m
    img = _blur(img * illum, sigma=rng.uniform(0.6, 1.5))
    img = img + rng.normal(0, rng.uniform(0.02, 0.06), img.shape)  # read noise
    img = rng.poisson(np.clip(img, 0, None) * 200) / 200  # shot noise
    img8 = np.clip(img * 255, 0, 255).astype(np.uint8)
    return img8, (mask * 255).astype(np.uint8)


@SYNTH.register("microscopy")
def synth(out: Path, *, seed: int = 0, count: int = 200, size: int = 256) -> Path:
    """Write ``count`` image/mask pairs to ``out/images`` and ``out/masks``, atomically.

    The folder appears complete or not at all (written to a temporary sibling, then renamed).
    """
    require("microscopy", count=(count, 1), size=(size, 16))
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        from fastvision.errors import DataError

        raise DataError(f"{out}: output folder exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "images").mkdir()
        (tmp / "masks").mkdir()
        for i in range(count):
            rng = np.random.default_rng([seed, i])  # per-image stream: any subset is reproducible
            img, mask = make_sample(rng, size)
            Image.fromarray(img).save(tmp / "images" / f"img_{i:04d}.png")
            Image.fromarray(mask).save(tmp / "masks" / f"img_{i:04d}.png")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
