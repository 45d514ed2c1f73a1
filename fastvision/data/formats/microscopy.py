"""Microscopy segmentation folders: ``images/`` and ``masks/`` with matching file stems.

Images are PNG or TIFF, 8- or 16-bit, grey or RGB; masks are binary (0/1 or 0/255) or class
indices 0..K-1. Every file header is checked when the dataset is built, so a missing mask or a
shape mismatch is reported before training starts, naming the file. Items are
``{"image": float32 (C, H, W) in [0, 1], "label": int64 (H, W), "id": stem}``.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Literal

import numpy as np
import tifffile
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from ...errors import DataError
from ...registry import DATASETS
from .base import DatasetSplits

log = logging.getLogger(__name__)
IMAGE_EXTS = (".png", ".tif", ".tiff")


def read_array(path: Path) -> np.ndarray:
    """Decode a PNG or TIFF to a numpy array (H, W) or (H, W, C); DataError names a bad file."""
    try:
        if path.suffix.lower() in (".tif", ".tiff"):
            return np.asarray(tifffile.imread(path))
        with Image.open(path) as im:
            if im.mode == "P":
                im = im.convert("RGB")
            return np.asarray(im)
    except Exception as e:
        raise DataError(f"{path}: cannot read image ({type(e).__name__}: {str(e)[:120]})") from e


def header_shape(path: Path) -> tuple[int, int]:
    """(H, W) from the file header only (cheap), for up-front consistency checks."""
    try:
        if path.suffix.lower() in (".tif", ".tiff"):
            with tifffile.TiffFile(path) as tf:
                shape = tf.pages[0].shape
            return int(shape[0]), int(shape[1])
        with Image.open(path) as im:
            return im.size[1], im.size[0]
    except Exception as e:
        raise DataError(f"{path}: cannot read image header ({type(e).__name__}: {str(e)[:120]})") from e


def to_unit_float(arr: np.ndarray) -> np.ndarray:
    """Integer images scaled by their dtype range to [0, 1]; float images kept."""
    if np.issubdtype(arr.dtype, np.integer):
        return arr.astype(np.float32) / float(np.iinfo(arr.dtype).max)
    if arr.dtype == bool:
        return arr.astype(np.float32)
    return arr.astype(np.float32)


def mask_to_index(arr: np.ndarray, path: Path, num_classes: int) -> np.ndarray:
    """Binary 0/255 masks become 0/1; anything else must already be class indices."""
    if arr.ndim == 3:  # RGB-saved binary masks: take one channel if all channels agree
        if not (arr == arr[..., :1]).all():
            raise DataError(f"{path}: colour mask; expected a single-channel mask of class indices")
        arr = arr[..., 0]
    values = np.unique(arr)
    if num_classes == 2 and set(values.tolist()) <= {0, 255}:
        return (arr > 0).astype(np.int64)
    if values.max(initial=0) >= num_classes or values.min(initial=0) < 0:
        raise DataError(f"{path}: mask values {values[:8].tolist()} outside 0..{num_classes - 1} "
                        f"(set data.args.num_classes)")
    return arr.astype(np.int64)


def pair_files(root: Path) -> list[tuple[Path, Path]]:
    """Match ``images/<stem>.*`` with ``masks/<stem>.*``; every image must have a mask."""
    img_dir, mask_dir = root / "images", root / "masks"
    for d in (root, img_dir, mask_dir):
        if not d.is_dir():
            raise DataError(f"{d}: folder not found (expected {root}/images and {root}/masks)")
    masks = {p.stem: p for p in mask_dir.iterdir() if p.suffix.lower() in IMAGE_EXTS}
    pairs = []
    for p in sorted(img_dir.iterdir()):
        if p.suffix.lower() not in IMAGE_EXTS:
            continue
        if p.stem not in masks:
            raise DataError(f"{p}: no mask with the same stem in {mask_dir}")
        pairs.append((p, masks[p.stem]))
    if not pairs:
        raise DataError(f"{img_dir}: no PNG or TIFF images found")
    return pairs


class MicroscopyDataset(Dataset):
    """Reads, scales and resizes (or pads) image/mask pairs on access.

    Args:
        pairs: (image path, mask path) list.
        size: output (H, W).
        fit: "resize" (bilinear image, nearest mask) or "pad" (keep scale; shrink only if larger,
            then zero-pad bottom/right).
        channels: 1 (grey; RGB is averaged) or 3 (grey is repeated).
        num_classes: mask classes including background.
    """

    def __init__(self, pairs: list[tuple[Path, Path]], size: tuple[int, int], fit: str, channels: int,
                 num_classes: int):
        self.pairs, self.size, self.fit = pairs, tuple(size), fit
        self.channels, self.num_classes = channels, num_classes

    def __len__(self) -> int:
        return len(self.pairs)

    def identity(self, i: int) -> str:
        """Item ``i``'s files (path, size, mtime): the disk cache's key (settings are keyed separately)."""
        from ..cache_select import files_identity

        return files_identity(self.pairs[i])

    def __getitem__(self, i: int) -> dict:
        img_path, mask_path = self.pairs[i]
        img = to_unit_float(read_array(img_path))
        mask = mask_to_index(read_array(mask_path), mask_path, self.num_classes)
        if img.shape[:2] != mask.shape[:2]:
            raise DataError(f"{img_path}: image is {img.shape[:2]} but mask {mask_path} is {mask.shape[:2]}")
        image = torch.from_numpy(img[None] if img.ndim == 2 else img.transpose(2, 0, 1).copy())
        image = _to_channels(image, self.channels, img_path)
        label = torch.from_numpy(mask)
        image, label = fit_size(image, label, self.size, self.fit)
        return {"image": image.contiguous(), "label": label.contiguous(), "id": img_path.stem}


def _to_channels(image: torch.Tensor, channels: int, path: Path) -> torch.Tensor:
    c = image.shape[0]
    if c == 4:  # RGBA: drop alpha
        image, c = image[:3], 3
    if c == channels:
        return image
    if channels == 1 and c == 3:
        return image.mean(0, keepdim=True)
    if channels == 3 and c == 1:
        return image.expand(3, -1, -1)
    raise DataError(f"{path}: has {c} channels, recipe expects {channels} (data.args.channels)")


def fit_size(image: torch.Tensor, label: torch.Tensor, size: tuple[int, int], fit: str):
    """Resize or pad (C, H, W) image and (H, W) label to ``size``."""
    h, w = label.shape
    if (h, w) == size:
        return image, label
    if fit == "pad":
        scale = min(1.0, size[0] / h, size[1] / w)
        new = (max(1, int(h * scale)), max(1, int(w * scale)))
    else:
        new = size
    if new != (h, w):
        image = F.interpolate(image[None], size=new, mode="bilinear", align_corners=False, antialias=True)[0]
        label = F.interpolate(label[None, None].float(), size=new, mode="nearest")[0, 0].long()
    if new != size:
        image = F.pad(image, (0, size[1] - new[1], 0, size[0] - new[0]))
        label = F.pad(label, (0, size[1] - new[1], 0, size[0] - new[0]))
    return image, label


def split_pairs(pairs, root: Path, val_fraction: float, seed: int, train_list: str | None,
                val_list: str | None):
    """Split by seeded permutation, or by files listing stems (one per line)."""
    if train_list or val_list:
        if not (train_list and val_list):
            raise DataError("data.args: give both train_list and val_list, or neither")
        by_stem = {p[0].stem: p for p in pairs}
        out = []
        for lst in (train_list, val_list):
            f = Path(lst) if Path(lst).is_absolute() else root / lst
            if not f.is_file():
                raise DataError(f"{f}: split file not found")
            stems = [s.strip() for s in f.read_text().splitlines() if s.strip()]
            missing = [s for s in stems if s not in by_stem]
            if missing:
                raise DataError(f"{f}: unknown image stem {missing[0]!r}")
            out.append([by_stem[s] for s in stems])
        return out
    if not 0 < val_fraction < 1:
        raise DataError(f"data.args.val_fraction must be in (0, 1), got {val_fraction}")
    order = np.random.default_rng(seed).permutation(len(pairs))
    n_val = max(1, int(round(len(pairs) * val_fraction)))
    if n_val >= len(pairs):
        raise DataError(f"{root}: {len(pairs)} image(s) are too few to split off a validation set")
    return [pairs[i] for i in sorted(order[n_val:])], [pairs[i] for i in sorted(order[:n_val])]


def default_data_dir() -> Path:
    """The built-in sample: generated once, deterministically, into the user cache."""
    from ..synth.microscopy import synth

    cache = Path(os.environ.get("FASTVISION_CACHE", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastvision"))
    target = cache / "microscopy-sample-v1"
    if not (target / "images").is_dir():
        log.info("generating the built-in microscopy sample (200 images) in %s", target)
        try:
            synth(target, seed=0)
        except FileExistsError:
            pass  # another process finished first
        except OSError:
            if not (target / "images").is_dir():
                raise
    return target


@DATASETS.register("microscopy")
def microscopy(*, path: str | None = None, image_size: list[int] = (256, 256),
               fit: Literal["resize", "pad"] = "resize", channels: int = 1, num_classes: int = 2,
               val_fraction: float = 0.2, split_seed: int = 0, train_list: str | None = None,
               val_list: str | None = None, repeat: int = 1) -> DatasetSplits:
    """Microscopy folder dataset (``path`` None: the built-in generated sample).

    Args:
        repeat: training list repeated this many times per epoch (seed 001 used 2).
    """
    root = Path(path) if path else default_data_dir()
    pairs = pair_files(root)
    for img, mask in pairs:  # header-only consistency check, before any training
        if header_shape(img) != header_shape(mask):
            raise DataError(f"{img}: image is {header_shape(img)} but mask {mask} is {header_shape(mask)}")
    train_pairs, val_pairs = split_pairs(pairs, root, val_fraction, split_seed, train_list, val_list)
    size = tuple(image_size)
    make = lambda ps: MicroscopyDataset(ps, size, fit, channels, num_classes)  # noqa: E731
    train = make(train_pairs * repeat)
    return DatasetSplits(train, make(val_pairs), {"root": str(root), "train": len(train_pairs),
                                                  "val": len(val_pairs), "num_classes": num_classes})
