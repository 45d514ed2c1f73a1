"""Tumour / normal patches for pathology (seed 003's metastasis example), from two layouts.

* Patch folders: ``PATH/{train,val}/{normal,tumor}/*.png|jpg|tif``.
* Whole slides: ``PATH/{train,val}/images/NAME.tif`` (tiled RGB TIFF, pyramidal or not) with
  optional lesion masks ``PATH/{train,val}/masks/NAME.tif`` (tiled uint8, non-zero = tumour, same
  size) or ASAP XML ``annotations/NAME.xml``; no lesion file = a normal slide. Camelyon16 as
  released (``training/{tumor,normal}/*.tif`` + ``lesion_annotations/*.xml``) too: see
  :mod:`.camelyon`; patches can be read at any pyramid level (``level``). Slides are cut into a
  grid of ``patch_size`` patches: tumour when at least half of the patch's central region is
  lesion, normal when the patch holds no lesion pixel at all (border patches are ambiguous and
  skipped), normals subsampled to ``normal_per_tumor``.

Slides are never decoded whole: :class:`TiledTiff` reads only the TIFF tiles a region touches,
so a 100k x 200k slide costs the memory of a patch. Items are
``{"image": uint8 (3, P, P), "label": int64 (0 normal, 1 tumour), "id": str}``; colour jitter
runs batched on the device in the task (seed 003: CPU colour jitter was the bottleneck).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Literal

import numpy as np
import tifffile
import torch
from PIL import Image
from torch.utils.data import Dataset

from fastvision.data.formats.anomalies import handle_invalid
from fastvision.data.formats.asap import (
    grid_labels_from_mask,
    mask_downsample_for,
    rasterize,
    read_polygons,
)
from fastvision.data.formats.base import DatasetSplits, dataset_folder
from fastvision.data.formats.camelyon import find_slides, is_slide_split
from fastvision.data.formats.imagefolder import open_image
from fastvision.errors import ConfigError, DataError
from fastvision.registry import DATASETS

CLASSES = ("normal", "tumor")
PATCH_EXTENSIONS = (".png", ".jpg", ".jpeg", ".tif", ".tiff")


def pyramid_pages(tif: tifffile.TiffFile) -> list:
    """The resolution levels of a slide, largest first (level 0 = full resolution).

    tifffile's series levels when it recognises the pyramid (SubIFDs, or pages flagged as reduced
    images); otherwise (some scanners' plain multi-page files) every tiled page of the same aspect
    ratio and smaller size, which leaves out label and macro images.
    """
    levels = [lvl.pages[0] for lvl in tif.series[0].levels] if tif.series else []
    if len(levels) > 1:
        return levels
    first = tif.pages[0]
    h0, w0 = first.shape[:2]
    found = [first]
    for page in list(tif.pages)[1:]:
        h, w = page.shape[:2]
        if page.is_tiled and w < found[-1].shape[1] and abs(h / w - h0 / w0) < 0.02:
            found.append(page)
    return found


class TiledTiff:
    """Region reader for one resolution level of a (tiled, possibly pyramidal) TIFF.

    Args:
        path: TIFF file; tiled pages are read tile by tile, stripped pages are read once.
        level: pyramid level (0 = full resolution; see :func:`pyramid_pages`).

    Attributes:
        shape: ``(H, W, C)`` of the level (C = 1 for greyscale).
        level_shapes: ``(H, W)`` of every level, largest first.
        downsample: level-0 pixels per pixel of this level (width ratio).
    """

    def __init__(self, path: str | Path, level: int = 0):
        self.path = str(path)
        try:
            self.tif = tifffile.TiffFile(self.path)
            levels = pyramid_pages(self.tif)
        except Exception as e:  # tifffile raises several types for non-TIFF or truncated files
            raise DataError(f"{self.path}: cannot read TIFF ({e})") from e
        if not 0 <= level < len(levels):
            self.tif.close()
            raise DataError(f"{self.path}: has {len(levels)} pyramid level(s); level {level} requested "
                            f"(data.args.level)")
        self.page = levels[level]
        self.level_shapes = [tuple(p.shape[:2]) for p in levels]
        self.downsample = levels[0].shape[1] / self.page.shape[1]
        shape = self.page.shape
        self.shape = (shape[0], shape[1], shape[2] if len(shape) == 3 else 1)
        self.dtype = self.page.dtype
        self._whole = None if self.page.is_tiled else self.page.asarray().reshape(self.shape)

    def close(self) -> None:
        self.tif.close()

    def _tile(self, ty: int, tx: int) -> np.ndarray:
        p = self.page
        index = ty * (-(-self.shape[1] // p.tilewidth)) + tx
        fh = self.tif.filehandle
        fh.seek(p.dataoffsets[index])
        data = fh.read(p.databytecounts[index])
        seg, _, _ = p.decode(data, index, jpegtables=p.jpegtables)
        return seg.reshape(p.tilelength, p.tilewidth, self.shape[2])

    def read_region(self, y: int, x: int, h: int, w: int) -> np.ndarray:
        """Pixels ``[y:y+h, x:x+w]`` as ``(h, w, C)``, zero outside the image."""
        out = np.zeros((h, w, self.shape[2]), self.dtype)
        y0, x0, y1, x1 = max(y, 0), max(x, 0), min(y + h, self.shape[0]), min(x + w, self.shape[1])
        if y0 >= y1 or x0 >= x1:
            return out
        if self._whole is not None:
            out[y0 - y:y1 - y, x0 - x:x1 - x] = self._whole[y0:y1, x0:x1]
            return out
        th, tw = self.page.tilelength, self.page.tilewidth
        for ty in range(y0 // th, (y1 - 1) // th + 1):
            for tx in range(x0 // tw, (x1 - 1) // tw + 1):
                tile = self._tile(ty, tx)
                ya, yb = max(y0, ty * th), min(y1, (ty + 1) * th)
                xa, xb = max(x0, tx * tw), min(x1, (tx + 1) * tw)
                out[ya - y:yb - y, xa - x:xb - x] = tile[ya - ty * th:yb - ty * th, xa - tx * tw:xb - tx * tw]
        return out


def mask_channel(arr: np.ndarray, path: str | Path) -> np.ndarray:
    """A lesion mask's ``(h, w)`` values: its one channel, or the first of channels that are all equal
    (a grey mask stored as RGB). Channels that differ are a picture, not a mask: a slide put in
    ``masks/`` (or given to ``froc`` as its own mask) would make every tissue pixel a lesion.

    Raises:
        DataError: naming ``path``.
    """
    if arr.ndim == 2:
        return arr
    if arr.shape[2] > 1 and not (arr == arr[..., :1]).all():
        raise DataError(f"{path}: {arr.shape[2]} channels that differ: a lesion mask has one (non-zero = "
                        "tumour); is this the slide image?")
    return arr[..., 0]


def grid_labels(mask: TiledTiff | None, height: int, width: int, patch: int) -> list[tuple[int, int, int]]:
    """``(y, x, label)`` for every grid patch that is clearly tumour (1) or clearly normal (0).

    Reads the mask one strip of patch rows at a time.
    """
    out = []
    q = patch // 4  # central region: the middle half of the patch in each direction
    for y in range(0, height - patch + 1, patch):
        strip = None if mask is None else mask_channel(mask.read_region(y, 0, patch, width), mask.path) > 0
        for x in range(0, width - patch + 1, patch):
            if strip is None:
                out.append((y, x, 0))
                continue
            p = strip[:, x:x + patch]
            if p[q:patch - q, q:patch - q].mean() >= 0.5:
                out.append((y, x, 1))
            elif not p.any():
                out.append((y, x, 0))
    return out


def slide_samples(split_dir: Path, patch: int, normal_per_tumor: float, rng: np.random.Generator,
                  level: int = 0, invalid: str = "warn", skip_unreadable: bool = False) -> list[tuple]:
    """``(slide path, y, x, label)`` for the slides of ``split_dir`` (layouts: :mod:`.camelyon`).

    Coordinates are pixels of pyramid ``level``; lesion polygons are rasterised at the scale the
    grid needs (:func:`.asap.mask_downsample_for`), never at level 0.
    """
    slides, anomalies = find_slides(split_dir)
    if not slides and not anomalies:
        raise DataError(f"{split_dir}: no .tif slides (images/, or Camelyon16's tumor/ and normal/)")
    samples = []
    for img_path, lesion in slides:
        try:
            grid = _slide_grid(img_path, lesion, patch, level)
        except DataError:
            if not skip_unreadable:
                raise
            anomalies.setdefault("unreadable slides or annotations (skipped)", []).append(img_path.name)
            continue
        samples += [(str(img_path), y, x, lab) for y, x, lab in grid]
    handle_invalid(split_dir, anomalies, invalid, what="slide problems")
    tumour = [s for s in samples if s[3] == 1]
    normal = [s for s in samples if s[3] == 0]
    if normal_per_tumor > 0 and tumour:
        keep = min(len(normal), int(round(normal_per_tumor * len(tumour))))
        normal = [normal[i] for i in sorted(rng.choice(len(normal), keep, replace=False))]
    return tumour + normal


def _slide_grid(img_path: Path, lesion: Path | None, patch: int, level: int) -> list[tuple[int, int, int]]:
    slide = TiledTiff(img_path, level)
    h, w = slide.shape[:2]
    (h0, w0), downsample = slide.level_shapes[0], slide.downsample
    slide.close()
    if lesion is not None and lesion.suffix.lower() == ".xml":
        d = mask_downsample_for(patch)
        mask = rasterize(read_polygons(lesion), h0, w0, downsample * d)
        return grid_labels_from_mask(mask, d, h, w, patch)
    mask = TiledTiff(lesion, level) if lesion is not None else None
    if mask is not None and mask.shape[:2] != (h, w):
        mask.close()
        raise DataError(f"{lesion}: mask size {mask.shape[:2]} differs from slide {(h, w)} (level {level})")
    grid = grid_labels(mask, h, w, patch)
    if mask is not None:
        mask.close()
    return grid


def folder_samples(split_dir: Path) -> list[tuple]:
    """``(patch path, label)`` from ``split_dir/{normal,tumor}/``; names starting with "." (macOS
    ``._x.png`` companions, which are no images) are left out, as ImageFolder leaves them."""
    samples = []
    for label, name in enumerate(CLASSES):
        d = split_dir / name
        if not d.is_dir():
            there = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
            raise DataError(f"{d}: missing (patch layout needs {split_dir}/normal and {split_dir}/tumor, in lower "
                            f"case and US spelling; there: {', '.join(there) or 'no folders'})")
        files = sorted(str(p) for p in d.iterdir()
                       if p.suffix.lower() in PATCH_EXTENSIONS and not p.name.startswith("."))
        if not files:
            raise DataError(f"{d}: no patch images")
        samples += [(f, label) for f in files]
    return samples


class PathologyPatches(Dataset):
    """Patch items from patch files or slide regions.

    Args:
        samples: ``(file, label)`` for patch files or ``(slide, y, x, label)`` for slide regions.
        patch_size: side P of the items; patch files of another size are resized.
        level: pyramid level slide regions are read at (sample coordinates are that level's pixels).
    """

    def __init__(self, samples: list[tuple], patch_size: int, level: int = 0):
        self.samples = samples
        self.patch_size = patch_size
        self.level = level
        self._slides: dict[str, TiledTiff] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.samples)

    def identity(self, i: int) -> str:
        """Sample ``i``'s file (path, size, mtime) and region: the ``data.cache: disk`` key."""
        from fastvision.data.cache.select import files_identity

        s = self.samples[i]
        return files_identity([s[0]]) + f"@{s[1:-1]}"

    def _slide(self, path: str) -> TiledTiff:
        # a forked DataLoader worker must not share the parent's file offsets, nor may two loader
        # or cache-filling threads seek one handle at once: one handle per (process, thread)
        if os.getpid() != self._pid:
            self._slides, self._pid = {}, os.getpid()
        key = f"{path}\0{threading.get_ident()}"
        if key not in self._slides:
            self._slides[key] = TiledTiff(path, self.level)
        return self._slides[key]

    def __getitem__(self, i: int) -> dict:
        s = self.samples[i]
        p = self.patch_size
        if len(s) == 4:
            path, y, x, label = s
            arr = self._slide(path).read_region(y, x, p, p)[..., :3]
            ident = f"{path}@{y},{x}"
        else:
            path, label = s
            img = open_image(path)  # ImageFolder's decode: 16-bit grey scaled (a plain convert clips it white), CMYK
            if img.size != (p, p):
                img = img.resize((p, p), Image.BILINEAR)
            arr, ident = np.array(img, dtype=np.uint8), path
        image = torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1).contiguous()
        return {"image": image, "label": torch.tensor(label, dtype=torch.int64), "id": ident}


@DATASETS.register("pathology")
def build(*, path: str, patch_size: int = 224, normal_per_tumor: float = 1.0, seed: int = 0,
          train_dir: str = "train", val_dir: str = "val", level: int = 0,
          invalid: Literal["warn", "error"] = "warn", skip_unreadable: bool = False) -> DatasetSplits:
    """Tumour/normal patch splits from patch folders or slides + lesion masks or ASAP XML
    (Camelyon16 as released: ``train_dir="training", val_dir="testing"``).

    Args:
        path: dataset root holding ``train_dir`` and ``val_dir``.
        patch_size: patch side P in pixels of ``level``.
        level: pyramid level the patches are read at (0 = full resolution; Camelyon16's level 1
            is 2x down).
        invalid: slide problems (a tumour slide without annotation): "warn" skips with one
            warning, "error" stops.
        skip_unreadable: skip slides (or annotations) that do not read, with a warning.
        normal_per_tumor: slide layout only: normal patches kept per tumour patch (<= 0 keeps all).
        seed: seed of the normal-patch subsampling.
        train_dir: training split folder name.
        val_dir: validation split folder name.
    """
    if patch_size < 1:
        raise ConfigError(f"data.args.patch_size={patch_size}: a patch side in pixels, at least 1")
    if level < 0:
        raise ConfigError(f"data.args.level={level}: a pyramid level, 0 (full resolution) or more")
    if seed < 0:
        raise ConfigError(f"data.args.seed={seed}: the seed of the normal-patch subsampling, 0 or more")
    root = dataset_folder(path)
    splits = []
    for k, name in enumerate((train_dir, val_dir)):
        d = root / name
        if is_slide_split(d):
            samples = slide_samples(d, patch_size, normal_per_tumor, np.random.default_rng([seed, k]), level,
                                    invalid, skip_unreadable)
        elif d.is_dir():
            samples = folder_samples(d)
        else:
            raise DataError(f"{d}: missing (expected {name}/images + {name}/masks, or {name}/normal + {name}/tumor)")
        if not any(s[-1] == 1 for s in samples) and k == 0:
            raise DataError(f"{d}: no tumour patches found")
        splits.append(PathologyPatches(samples, patch_size, level))
    info = {"classes": list(CLASSES), "num_classes": 2, "level": level,
            "train_patches": len(splits[0]), "val_patches": len(splits[1]),
            "train_tumor": sum(s[-1] for s in splits[0].samples), "val_tumor": sum(s[-1] for s in splits[1].samples)}
    return DatasetSplits(splits[0], splits[1], info)
