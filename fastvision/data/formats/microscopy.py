"""Microscopy segmentation folders: ``images/`` and ``masks/`` with matching file stems.

Images are PNG or TIFF (multi-page, ImageJ and OME included), 8- or 16-bit, grey or RGB; masks
are binary (0/1, 0/255 or 0/65535, mixed freely across files), instance ids (``binarize``) or
class indices 0..K-1, and may use another extension than their image (``a.tif`` + ``a.png``).
Every file header is checked when the dataset is built, so a missing mask or a shape mismatch is
reported before training starts, naming the file (pairing and header checks:
:mod:`fastvision.data.formats.microscopy_files`). A float image holding NaN or Inf stops the run
naming the file when it is read (``data.args.nonfinite``: ``error`` or ``zero``). Items are
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

from fastvision.data.formats.anomalies import drop_unreadable
from fastvision.data.formats.base import DatasetSplits, dataset_folder
from fastvision.data.formats.microscopy_files import (
    decodes,
    file_stem,
    header_shape,
    needs_codec,
    pair_files,
    pillow_tiff,
    refuse_stack,
    unread_subfolders,
)
from fastvision.data.nonfinite import NonFinite
from fastvision.errors import ConfigError, DataError
from fastvision.registry import DATASETS

log = logging.getLogger(__name__)


def read_array(path: Path, mask: bool = False) -> np.ndarray:
    """Decode a PNG or TIFF to a numpy array (H, W) or (H, W, C); DataError names a bad file.

    Multi-page and ImageJ / OME TIFFs are read as one image: channel (C, S) and plain page (I, Q)
    axes become the last axis, singleton axes are dropped; a Z or T stack is refused (items are 2-D).
    An alpha channel (RGBA, grey + alpha, an RGBA TIFF's extra sample) is dropped. A palette PNG is
    its colours, or with ``mask`` its indices (a label PNG's class ids, as labelme and VOC save them).
    """
    if path.suffix.lower() in (".tif", ".tiff"):
        try:
            with tifffile.TiffFile(path) as tf:
                series = tf.series[0]
                arr, axes = np.asarray(series.asarray()), series.axes
                pages = list(tf.pages)
                if len(series.pages) < len(pages) and len({p.shape for p in pages}) == 1:
                    # pages written one by one land in separate series: same-shape pages are channels
                    arr, axes = np.stack([p.asarray() for p in pages]), "I" + pages[0].axes
                first = pages[0]
                if "S" in axes and first.extrasamples and first.photometric == tifffile.PHOTOMETRIC.RGB:
                    # RGBA: the alpha sample goes (a 4-channel ImageJ stack, axes C, keeps all four)
                    arr = np.take(arr, range(3), axis=axes.index("S"))
        except Exception as e:
            arr, axes = _without_codec(path, e)
        arr = _to_hwc(arr, axes, path)
        if mask and arr.ndim == 3 and "S" not in axes:  # pages or channels, not an RGB-saved mask
            raise DataError(f"{path}: a mask of {arr.shape[2]} pages or channels (TIFF axes {axes}); a mask is one "
                            "plane of class indices: save one page per file, as its image")
        return arr
    try:
        with Image.open(path) as im:
            if mask and im.mode in ("P", "PA"):
                return np.asarray(im)[..., 0] if im.mode == "PA" else np.asarray(im)
            if im.mode in ("P", "PA", "RGBA", "LA"):  # alpha dropped here, where it is known to be alpha
                im = im.convert("L" if im.mode == "LA" else "RGB")
            return np.asarray(im)
    except Exception as e:
        raise DataError(f"{path}: cannot read image ({type(e).__name__}: {str(e)[:120]})") from e


def _without_codec(path: Path, e: Exception) -> tuple[np.ndarray, str]:
    """A TIFF tifffile could not read: decoded by Pillow where only ``imagecodecs`` was missing (LZW),
    else the DataError naming the file."""
    if needs_codec(e):
        try:
            return pillow_tiff(path)
        except Exception:  # noqa: BLE001  (Pillow cannot either: say what would)
            raise DataError(f"{path}: cannot read image ({str(e)[:120]}; pip install imagecodecs)") from e
    raise DataError(f"{path}: cannot read image ({type(e).__name__}: {str(e)[:120]})") from e


def _to_hwc(arr: np.ndarray, axes: str, path: Path) -> np.ndarray:
    """TIFF series data with tifffile ``axes`` (e.g. ``CYX``, ``YXS``, ``IYX``) -> (H, W) or (H, W, C)."""
    if len(axes) != arr.ndim or "Y" not in axes or "X" not in axes:
        return arr  # unusual series: leave it to the shape checks, which name the file
    keep = [i for i, a in enumerate(axes) if arr.shape[i] > 1 or a in "YX"]
    arr = arr.reshape([arr.shape[i] for i in keep])
    axes = "".join(axes[i] for i in keep)
    refuse_stack(arr.shape, axes, path)
    other = [i for i, a in enumerate(axes) if a not in "YX"]  # C, S, I (pages), Q: channels
    arr = np.moveaxis(arr, [axes.index("Y"), axes.index("X")], [0, 1])
    if len(other) > 1:
        arr = arr.reshape(arr.shape[0], arr.shape[1], -1)
    return arr


def to_unit_float(arr: np.ndarray) -> np.ndarray:
    """Integer images scaled by their dtype range to [0, 1]; float images kept."""
    if np.issubdtype(arr.dtype, np.integer):
        return arr.astype(np.float32) / float(np.iinfo(arr.dtype).max)
    if arr.dtype == bool:
        return arr.astype(np.float32)
    return arr.astype(np.float32)


def mask_to_index(arr: np.ndarray, path: Path, num_classes: int, binarize: bool = False) -> np.ndarray:
    """Class indices (H, W) int64 from a mask file's array.

    Binary masks are read per file, so 0/1, 0/255 (8-bit) and 0/65535 (16-bit) may be mixed in one
    dataset: with ``num_classes == 2`` a mask holding 0 and one of 1, 255, 65535 (or its dtype's
    maximum) is background / foreground. ``binarize`` makes every non-zero value foreground
    (instance-labelled masks, where each cell has its own id). Anything else must already be class
    indices 0..num_classes-1.
    """
    if arr.ndim == 3:  # RGB-saved binary masks: take one channel if all channels agree
        if not (arr == arr[..., :1]).all():
            raise DataError(f"{path}: colour mask; expected a single-channel mask of class indices")
        arr = arr[..., 0]
    if binarize:
        return (arr != 0).astype(np.int64)
    values = np.unique(arr)
    on = {1, 255, 65535} | ({int(np.iinfo(arr.dtype).max)} if np.issubdtype(arr.dtype, np.integer) else set())
    if num_classes == 2 and set(values.tolist()) <= {0} | on and len(values) <= 2:
        return (arr > 0).astype(np.int64)
    if values.max(initial=0) >= num_classes or values.min(initial=0) < 0:
        k = int(values.max()) + 1
        classes = f"class indices 0..{k - 1}? set data.args.num_classes={k} (README: multi-class masks)"
        hint = (f"{classes}; instance ids? set data.args.binarize=true for foreground/background"
                if num_classes == 2 and len(values) > 2 else classes)
        if num_classes == 2 and len(values) == 2 and values[0] == 0:  # 0/128, 0/254: a binary mask first
            hint = f"binary 0/{values[1]}? set data.args.binarize=true for foreground/background; {classes}"
        raise DataError(f"{path}: mask values {values[:8].tolist()} outside 0..{num_classes - 1} ({hint})")
    return arr.astype(np.int64)


class MicroscopyDataset(Dataset):
    """Reads, scales and resizes (or pads) image/mask pairs on access.

    Args:
        pairs: (image path, mask path) list.
        size: output (H, W).
        fit: "resize" (bilinear image, nearest mask) or "pad" (keep scale; shrink only if larger,
            then zero-pad bottom/right).
        channels: 1 (grey; RGB is averaged) or 3 (grey is repeated).
        num_classes: mask classes including background.
        nonfinite: what a float file holding NaN / Inf does: ``error`` (DataError naming it) or
            ``zero`` (read as 0, one warning per file).
    """

    def __init__(self, pairs: list[tuple[Path, Path]], size: tuple[int, int], fit: str, channels: int,
                 num_classes: int, binarize: bool = False, nonfinite: str = "error"):
        self.pairs, self.size, self.fit = pairs, tuple(size), fit
        self.channels, self.num_classes, self.binarize = channels, num_classes, binarize
        self.nonfinite = nonfinite  # a scalar setting: part of the disk cache's key
        self._finite = NonFinite(nonfinite)

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def image_size(self) -> tuple[int, int]:
        """(H, W) of every item: what :func:`fastvision.engine.build.check_patch` checks against the model."""
        return self.size

    def identity(self, i: int) -> str:
        """Item ``i``'s files (path, size, mtime): the disk cache's key (settings are keyed separately)."""
        from fastvision.data.cache.select import files_identity

        return files_identity(self.pairs[i])

    def __getitem__(self, i: int) -> dict:
        img_path, mask_path = self.pairs[i]
        # NaN / Inf checked where the file is decoded (once per read, or once per cache fill)
        image, label = prepare_pair(self._finite(read_array(img_path), img_path),
                                    self._finite(read_array(mask_path, mask=True), mask_path), img_path, mask_path,
                                    self.channels, self.num_classes, self.binarize)
        image, label = fit_size(image, label, self.size, self.fit)
        return {"image": image.contiguous(), "label": label.contiguous(), "id": file_stem(img_path)}


def prepare_pair(img: np.ndarray, mask: np.ndarray, img_path: Path, mask_path: Path, channels: int,
                 num_classes: int, binarize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded image and mask -> ``(image (C, H, W) float in [0, 1], label (H, W) int64)``: the one
    rule training and ``data inspect`` apply (sizes, mask values, channels), so inspect lists every
    file training would stop on. DataError names the file."""
    img = to_unit_float(img)
    label = mask_to_index(mask, mask_path, num_classes, binarize)
    if img.shape[:2] != label.shape[:2]:
        raise DataError(f"{img_path}: image is {img.shape[:2]} but mask {mask_path} is {label.shape[:2]}")
    image = torch.from_numpy(img[None] if img.ndim == 2 else img.transpose(2, 0, 1).copy())
    return _to_channels(image, channels, img_path), torch.from_numpy(label)


def _to_channels(image: torch.Tensor, channels: int, path: Path) -> torch.Tensor:
    c = image.shape[0]  # RGBA's alpha is dropped by read_array; four channels here are four channels
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
        by_stem = {file_stem(p[0]): p for p in pairs}
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
    from fastvision.data.synth.microscopy import synth

    cache = Path(os.environ.get("FASTVISION_CACHE",
                                Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastvision"))
    target = cache / "microscopy-sample-v2"  # v2: the generator since 2026-12-04 (textures by the blur's gain)
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
               val_list: str | None = None, repeat: int = 1, binarize: bool = False,
               skip_unreadable: bool = False, nonfinite: Literal["error", "zero"] = "error",
               fold: int | None = None, num_folds: int = 5) -> DatasetSplits:
    """Microscopy folder dataset (``path`` None: the built-in generated sample).

    Args:
        repeat: training list repeated this many times per epoch (seed 001 used 2).
        binarize: every non-zero mask value is foreground (instance-labelled masks).
        skip_unreadable: skip (with one warning) pairs whose image or mask does not decode to its
            end (each file read once here: a truncated file's header decodes), instead of stopping
            with an error naming the file.
        nonfinite: a float image (or mask) holding NaN or Inf: ``error`` stops with one line
            naming the file when it is read (exit 2); ``zero`` reads those values as 0 with one
            warning per file. ``fastvision data inspect`` lists such files up front.
        fold, num_folds: validate on part ``fold`` of a ``num_folds``-fold split of the stems (seeded by
            ``split_seed``, as the 3-D readers split cases; DLE UNet_Medical's 5-fold cross-validation),
            in place of ``val_fraction``; ``train --folds`` sets ``fold``.
    """
    NonFinite(nonfinite)  # a wrong value is a ConfigError now, not in a loader thread
    if len(image_size) != 2 or min(image_size) < 1:  # [64, 0] was torch's interpolate error at the first step
        raise ConfigError(f"data.args.image_size must be [H, W] with sides >= 1, got {list(image_size)}")
    root = dataset_folder(path) if path else default_data_dir()
    pairs = drop_unreadable(pair_files(root), list, decodes, skip_unreadable, root)
    nested = unread_subfolders(root)
    if nested:  # said once, never dropped silently
        log.warning("%s: %d sub-folder(s) not read, pairs are the files directly in images/ and masks/ "
                    "(move them up to train on them): %s", root, len(nested), ", ".join(nested))
    for img, mask in pairs:  # header-only consistency check, before any training
        if header_shape(img) != header_shape(mask):
            raise DataError(f"{img}: image is {header_shape(img)} but mask {mask} is {header_shape(mask)}")
    if fold is not None and (train_list or val_list):  # every fold would be the one fixed split
        raise ConfigError("data.args.fold (train --folds) with data.args.train_list / val_list: a fixed split "
                          "has no folds; drop one")
    if fold is not None:
        from fastvision.data.formats.decathlon import kfold_split

        by_stem = {file_stem(p[0]): p for p in pairs}
        train_ids, val_ids = kfold_split(list(by_stem), fold, num_folds, split_seed)
        train_pairs, val_pairs = [by_stem[s] for s in train_ids], [by_stem[s] for s in val_ids]
    else:
        train_pairs, val_pairs = split_pairs(pairs, root, val_fraction, split_seed, train_list, val_list)
    size = tuple(image_size)
    make = lambda ps: MicroscopyDataset(ps, size, fit, channels, num_classes, binarize, nonfinite)  # noqa: E731
    train = make(train_pairs * repeat)
    return DatasetSplits(train, make(val_pairs), {"root": str(root), "train": len(train_pairs),
                                                  "val": len(val_pairs), "num_classes": num_classes})
