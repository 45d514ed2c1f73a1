"""A microscopy folder's files before they are decoded: pairing ``images/`` with ``masks/`` by stem, the
header checks the builder runs on every file before training (size, Z / T stacks), and the probe of
``data.args.skip_unreadable``. Pixels are read by :mod:`fastvision.data.formats.microscopy`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import tifffile
from PIL import Image, ImageSequence

from fastvision.data.formats.anomalies import image_decodes
from fastvision.errors import DataError

IMAGE_EXTS = (".png", ".tif", ".tiff")


def refuse_stack(shape: tuple[int, ...], axes: str, path: Path) -> None:
    """DataError naming ``path`` if its TIFF axes (singletons dropped) hold a Z or T stack."""
    stacked = [a for a, n in zip(axes, shape, strict=True) if a in "ZT" and n > 1]
    if stacked:
        n = shape[axes.index(stacked[0])]
        raise DataError(f"{path}: a {stacked[0]} stack of {n} planes (TIFF axes {axes}); microscopy items are "
                        "2-D images: save one plane per file")


def header_shape(path: Path) -> tuple[int, int]:
    """(H, W) from the file header only (cheap), for up-front consistency checks; a Z or T stack
    (series axes) is refused here, before a run folder is made, as reading it would."""
    try:
        if path.suffix.lower() in (".tif", ".tiff"):
            with tifffile.TiffFile(path) as tf:
                page, series = tf.pages[0], tf.series[0]
                shape, axes = page.shape, page.axes
                if len(series.axes) == len(series.shape):
                    refuse_stack(series.shape, series.axes, path)
            if "Y" in axes and "X" in axes:  # planar RGB (tifffile's default for (3, H, W)) is SYX
                return int(shape[axes.index("Y")]), int(shape[axes.index("X")])
            return int(shape[0]), int(shape[1])
        with Image.open(path) as im:
            return im.size[1], im.size[0]
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}: cannot read image header ({type(e).__name__}: {str(e)[:120]})") from e


def decodes(path: Path) -> None:
    """Raise if ``path`` does not decode to its end (a truncated download keeps a readable header): the
    probe of ``data.args.skip_unreadable``. A PNG ending with its end marker is taken as complete; a
    TIFF's first series is read in full (a Z stack decodes: it is refused, not skipped, when read)."""
    if path.suffix.lower() in (".tif", ".tiff"):
        try:
            with tifffile.TiffFile(path) as tf:
                tf.series[0].asarray()
        except Exception as e:  # LZW without imagecodecs: Pillow decodes it, as read_array does
            if not needs_codec(e):
                raise
            pillow_tiff(path)
        return
    image_decodes(path)


def needs_codec(e: Exception) -> bool:
    """tifffile's error for a compression it decodes only with the optional ``imagecodecs`` (LZW, JPEG)."""
    return "imagecodecs" in str(e)


def pillow_tiff(path: Path) -> tuple[np.ndarray, str]:
    """``(pixels, tifffile-style axes)`` of a TIFF decoded by Pillow: for the LZW- or JPEG-compressed
    files tifffile reads only with ``imagecodecs`` (Fiji, ZEN and Photoshop write LZW). Pages are
    ``I``, RGB samples ``S``, alpha dropped."""
    with Image.open(path) as im:
        frames = [np.asarray(f.convert("RGB") if f.mode == "RGBA" else f.convert("L") if f.mode == "LA" else f)
                  for f in ImageSequence.Iterator(im)]
    arr = frames[0] if len(frames) == 1 else np.stack(frames)
    return arr, ("I" if len(frames) > 1 else "") + "YX" + ("S" if frames[0].ndim == 3 else "")


def file_stem(p: Path) -> str:
    """``a.ome.tif`` -> ``a``: OME-TIFF's double suffix is part of the extension. The stem pairs an
    image with its mask, names its item (``id``), is what split lists hold and what ``predict`` names
    its outputs after."""
    name = p.name
    return name[: -len(".ome.tif")] if name.lower().endswith(".ome.tif") else \
        name[: -len(".ome.tiff")] if name.lower().endswith(".ome.tiff") else p.stem


def pair_files(root: Path, problems: dict[str, list[str]] | None = None) -> list[tuple[Path, Path]]:
    """Match ``images/<stem>.*`` with ``masks/<stem>.*``; every image must have a mask.

    Args:
        root: the folder holding ``images/`` and ``masks/``.
        problems: given (``data inspect``), an image without a mask or a stem with two masks is
            recorded here under its kind (and left out) instead of stopping at the first.
    """
    img_dir, mask_dir = root / "images", root / "masks"
    for d in (root, img_dir, mask_dir):
        if not d.is_dir():
            raise DataError(f"{d}: folder not found (expected {root}/images and {root}/masks)")
    masks: dict[str, Path] = {}
    for p in sorted(mask_dir.iterdir()):  # the mask's extension may differ from its image's (a.tif, a.png)
        if p.suffix.lower() not in IMAGE_EXTS or p.name.startswith("."):  # "._a.png": macOS companion
            continue
        stem = file_stem(p)
        if stem in masks:
            if problems is None:
                raise DataError(f"{p}: two masks for stem {stem!r} ({masks[stem].name} and {p.name}); keep one")
            problems.setdefault("stems with two masks (keep one)", []).append(f"{masks[stem].name}+{p.name}")
            continue
        masks[stem] = p
    pairs = []
    for p in sorted(img_dir.iterdir()):
        if p.suffix.lower() not in IMAGE_EXTS or p.name.startswith("."):
            continue
        if file_stem(p) not in masks:
            near = _suffixed_mask(file_stem(p), masks)
            if problems is None:
                raise DataError(f"{p}: no mask with the same stem in {mask_dir}" + near)
            problems.setdefault("images without a mask of the same stem", []).append(p.name + near)
            continue
        pairs.append((p, masks[file_stem(p)]))
    if not pairs and not problems:
        raise DataError(f"{img_dir}: no PNG or TIFF images found")
    return pairs


def _suffixed_mask(stem: str, masks: dict[str, Path]) -> str:
    """``" (masks/a_mask.png is a.png's mask plus '_mask'? ...)"``: the hint for an image whose mask was
    saved with a suffix (``_mask``, ``_label``, ``-seg``), which pairing by stem does not strip; else ``""``."""
    near = sorted((k for k in masks if k.startswith(stem) and not k[len(stem):][:1].isalnum()
                   and len(k) > len(stem)), key=len)
    if not near:
        return ""
    extra = near[0][len(stem):]
    return (f" (masks/{masks[near[0]].name} has the stem plus {extra!r}: masks are paired by the "
            f"image's own stem, rename it {stem}{masks[near[0]].suffix})")


def unread_subfolders(root: Path) -> list[str]:
    """``["images/plate1 (6)", ...]``: sub-folders of ``images/`` and ``masks/`` holding PNG / TIFF files,
    which pairing does not read (pairs are the files directly in ``images/`` and ``masks/``)."""
    out = []
    for sub in ("images", "masks"):
        for d in sorted(q for q in (root / sub).iterdir() if q.is_dir() and not q.name.startswith(".")):
            n = sum(1 for f in d.rglob("*") if f.suffix.lower() in IMAGE_EXTS and not f.name.startswith("."))
            if n:
                out.append(f"{sub}/{d.name} ({n})")
    return out
