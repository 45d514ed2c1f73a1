"""Pictures people look at: segmentation overlays (image grey, truth green, prediction red)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fastvision.utils.files import atomic_write


def _outline(mask: np.ndarray) -> np.ndarray:
    """Boundary pixels of a boolean mask (4-neighbourhood)."""
    m = np.pad(mask, 1)
    inner = m[1:-1, 1:-1] & m[:-2, 1:-1] & m[2:, 1:-1] & m[1:-1, :-2] & m[1:-1, 2:]
    return mask & ~inner


def to_grey_uint8(image: torch.Tensor) -> np.ndarray:
    """(C, H, W) float -> (H, W) uint8, min-max scaled (first 3 channels averaged)."""
    img = image.detach().float().cpu()[:3].mean(0).numpy()
    lo, hi = np.percentile(img, 0.5), np.percentile(img, 99.5)
    return (np.clip((img - lo) / max(hi - lo, 1e-8), 0, 1) * 255).astype(np.uint8)


def overlay_png(image: torch.Tensor, label: torch.Tensor | None, pred: torch.Tensor, path: Path,
                pixel: tuple[float, float] = (1.0, 1.0)) -> Path:
    """Write an overlay: prediction filled red at 35 %, its outline red, ground truth outline green.

    Args:
        image: (C, H, W); label, pred: (H, W).
        pixel: (height, width) of one pixel in any unit (a 3-D slice's voxel spacing): the picture
            is stretched to that aspect, so a 0.6 x 3.6 mm pixel is drawn 6x as tall as wide.
    """
    grey = to_grey_uint8(image)
    rgb = np.repeat(grey[..., None], 3, -1).astype(np.float32)
    p = pred.detach().cpu().numpy() > 0
    rgb[p] = 0.65 * rgb[p] + 0.35 * np.array([255, 0, 0])
    rgb[_outline(p)] = (255, 40, 40)
    if label is not None:
        rgb[_outline(label.detach().cpu().numpy() > 0)] = (40, 255, 40)
    fine = min(pixel)
    rows, cols = rgb.shape[0] * pixel[0] / fine, rgb.shape[1] * pixel[1] / fine  # in units of the finer side
    zoom = max(1.0, 256 // max(rows, cols))  # small images are enlarged (nearest) to be legible
    size = (max(1, round(cols * zoom)), max(1, round(rows * zoom)))
    picture = Image.fromarray(rgb.astype(np.uint8)).resize(size, Image.NEAREST)
    atomic_write(Path(path), lambda f: picture.save(f, format="PNG"))  # never a half-written picture
    return path
