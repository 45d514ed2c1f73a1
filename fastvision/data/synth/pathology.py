"""``fastvision data synth pathology OUT``: tiled TIFF "slides" with tumour lesions and masks.

Each slide is H&E-like tissue: pink stroma with sparse small purple nuclei. Tumour slides carry
1..``lesions`` irregular blobs where nuclei are dense, large and dark on a more violet stroma,
so patch texture (not a single colour) separates tumour from normal, as in Camelyon16. Half of
the slides are tumour slides (with a lesion mask), the rest normal (mask of zeros). Files:
``OUT/{train,val}/images/slide_NNN.tif`` (tiled RGB) and ``OUT/{train,val}/masks/slide_NNN.tif``
(tiled uint8, 1 = tumour), the layout :mod:`fastvision.data.formats.pathology` reads.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import tifffile

from fastvision.data.synth import SYNTH, require
from fastvision.errors import ConfigError


def _box_blur(a: np.ndarray, k: int) -> np.ndarray:
    """Mean over a (2k+1)^2 window with edge padding, via cumulative sums (separable)."""
    for axis in (0, 1):
        pad = [(0, 0), (0, 0)]
        pad[axis] = (k + 1, k)
        c = np.cumsum(np.pad(a, pad, mode="edge"), axis=axis)
        n = a.shape[axis]
        a = (np.take(c, np.arange(2 * k + 1, n + 2 * k + 1), axis=axis)
             - np.take(c, np.arange(0, n), axis=axis)) / (2 * k + 1)
    return a


def _nuclei(shape: tuple[int, int], density: float, radius: int, rng: np.random.Generator) -> np.ndarray:
    """Boolean mask of roughly round nuclei: seeds blurred into blobs, then thresholded."""
    seeds = (rng.random(shape) < density).astype(np.float32)
    blob = _box_blur(_box_blur(seeds, radius), max(radius // 2, 1))
    return blob > 0.5 / (2 * radius + 1) ** 2


def lesion_mask(size: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 (size, size) mask of ``n`` irregular blobs (ellipse level sets plus smooth noise)."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    k = size // 32 + 1
    # blurred twice: one box blur still wiggles from pixel to pixel by more than the ellipse level
    # changes, which frays lesion borders into hundreds of specks (false lesions for FROC)
    noise = _box_blur(_box_blur(rng.normal(0, 1, (size, size)).astype(np.float32), k), k)
    noise /= noise.std() + 1e-6
    mask = np.zeros((size, size), bool)
    for _ in range(n):
        ry, rx = rng.uniform(0.06, 0.16, size=2) * size
        cy, cx = rng.uniform(0.2, 0.8, size=2) * size
        level = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2
        mask |= level + 0.25 * noise < 1.0
    return mask.astype(np.uint8)


def render_slide(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 (H, W, 3) H&E-like tissue with tumour texture where ``mask`` is 1."""
    shape = mask.shape
    tum = mask.astype(bool)
    stroma = np.where(tum[..., None], [205, 140, 200], [235, 170, 205]).astype(np.float32)
    img = stroma + rng.normal(0, 10, shape + (3,)).astype(np.float32)
    normal_nuc = _nuclei(shape, 0.0015, 3, rng) & ~tum
    tumour_nuc = _nuclei(shape, 0.006, 5, rng) & tum
    img[normal_nuc] = [120, 70, 160] + rng.normal(0, 12, (int(normal_nuc.sum()), 3))
    img[tumour_nuc] = [70, 30, 115] + rng.normal(0, 12, (int(tumour_nuc.sum()), 3))
    return np.clip(img, 0, 255).astype(np.uint8)


@SYNTH.register("pathology")
def synth(out: Path, *, seed: int = 0, slides: int = 4, val_slides: int = 2, size: int = 1024,
          lesions: int = 3, tile: int = 256) -> Path:
    """Write tumour and normal slides with lesion masks for train and val.

    Args:
        out: output folder (created).
        seed: RNG seed; the same seed gives the same files.
        slides: training slides (the first half, rounded up, are tumour slides).
        val_slides: validation slides (same split rule).
        size: slide side in pixels.
        lesions: maximum lesions per tumour slide (at least 1).
        tile: TIFF tile side (multiple of 16).

    Returns:
        ``out``.
    """
    require("pathology", slides=(slides, 1), val_slides=(val_slides, 1), lesions=(lesions, 1), tile=(tile, 16),
            size=(size, tile))
    if tile % 16:
        raise ConfigError(f"data synth pathology --tile {tile}: must be a multiple of 16")
    out = Path(out)
    for split, n, stream in (("train", slides, 0), ("val", val_slides, 1)):
        rng = np.random.default_rng([seed, stream])
        for d in ("images", "masks"):
            (out / split / d).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            tumour = i < (n + 1) // 2
            mask = (lesion_mask(size, int(rng.integers(1, lesions + 1)), rng) if tumour
                    else np.zeros((size, size), np.uint8))
            name = f"slide_{i:03d}.tif"
            tifffile.imwrite(out / split / "images" / name, render_slide(mask, rng), tile=(tile, tile),
                             photometric="rgb", compression="zlib")
            tifffile.imwrite(out / split / "masks" / name, mask, tile=(tile, tile),
                             photometric="minisblack", compression="zlib")
    return out
