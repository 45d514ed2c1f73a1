"""Pictures people look at: segmentation overlays (image grey, truth green, prediction red)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image


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


def overlay_png(image: torch.Tensor, label: torch.Tensor | None, pred: torch.Tensor, path: Path) -> Path:
    """Write an overlay: prediction filled red at 35 %, its outline red, ground truth outline green."""
    grey = to_grey_uint8(image)
    rgb = np.repeat(grey[..., None], 3, -1).astype(np.float32)
    p = pred.detach().cpu().numpy() > 0
    rgb[p] = 0.65 * rgb[p] + 0.35 * np.array([255, 0, 0])
    rgb[_outline(p)] = (255, 40, 40)
    if label is not None:
        rgb[_outline(label.detach().cpu().numpy() > 0)] = (40, 255, 40)
    zoom = max(1, 256 // max(rgb.shape[:2]))  # small images are enlarged (nearest) to be legible
    Image.fromarray(rgb.astype(np.uint8)).resize((rgb.shape[1] * zoom, rgb.shape[0] * zoom), Image.NEAREST).save(path)
    return path
