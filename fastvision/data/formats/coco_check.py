"""COCO annotation files as found in the wild: which annotations and images are usable, and why not.

Shared by the reader (:class:`~fastvision.data.formats.coco.CocoDetection` skips what is listed,
with one warning or a one-line error, per ``data.args.invalid``) and by ``fastvision data inspect``
(which prints the same counts and first ids). Nothing is dropped without being reported.

Image files follow what pycocotools and the COCO evaluation assume: pixels as stored. An EXIF
orientation tag is not applied, because COCO's ``width``/``height`` and boxes describe the stored
bitmap; an image whose stored size differs from the file's ``width``/``height`` is reported.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# Kinds of invalid annotation, in the order they are tested (the first that applies is reported).
UNKNOWN_IMAGE = "unknown image_id"
UNKNOWN_CATEGORY = "unknown category_id"
BAD_BBOX = "missing or malformed bbox"
DEGENERATE = "degenerate box (width or height <= 0)"
OUTSIDE = "box outside its image"
EXIF_ORIENTATION = 0x0112


def check_annotations(dataset: dict[str, Any]) -> tuple[set[int], dict[str, list[Any]]]:
    """Split a COCO instances dict's annotations into usable ones and anomalies.

    Args:
        dataset: the parsed JSON (``images``, ``annotations``, ``categories``).

    Returns:
        (ids of usable annotations, ``{kind: [annotation ids]}`` of the rest; kinds with none omitted).
    """
    images = {im.get("id"): im for im in dataset.get("images", [])}
    cats = {c.get("id") for c in dataset.get("categories", [])}
    valid: set[int] = set()
    bad: dict[str, list[Any]] = {}
    for a in dataset.get("annotations", []):
        kind = _problem(a, images, cats)
        if kind is None:
            valid.add(a["id"])
        else:
            bad.setdefault(kind, []).append(a.get("id"))
    return valid, bad


def _problem(a: dict[str, Any], images: dict[Any, dict], cats: set[Any]) -> str | None:
    image = images.get(a.get("image_id"))
    if image is None:
        return UNKNOWN_IMAGE
    if a.get("category_id") not in cats:
        return UNKNOWN_CATEGORY
    box = a.get("bbox")
    if not isinstance(box, (list, tuple)) or len(box) != 4 or \
            not all(isinstance(v, (int, float)) and math.isfinite(v) for v in box):
        return BAD_BBOX
    x, y, w, h = box
    if w <= 0 or h <= 0:
        return DEGENERATE
    width, height = image.get("width"), image.get("height")
    if isinstance(width, (int, float)) and isinstance(height, (int, float)) and \
            (x >= width or y >= height or x + w <= 0 or y + h <= 0):
        return OUTSIDE
    return None


def missing_images(dataset: dict[str, Any], image_dir: Path) -> list[str]:
    """File names listed in ``images`` that are not files under ``image_dir``."""
    return [im.get("file_name", "?") for im in dataset.get("images", [])
            if not (image_dir / str(im.get("file_name", ""))).is_file()]


def image_facts(dataset: dict[str, Any], image_dir: Path, limit: int = 2000) -> dict[str, Any]:
    """Headers of (up to ``limit``, evenly spaced) listed images: formats, modes, and anomalies.

    Returns:
        ``{"checked": n, "formats": {...}, "modes": {...}, "anomalies": {kind: [file names]}}``.
    """
    from collections import Counter

    from PIL import Image

    images = dataset.get("images", [])
    step = max(1, len(images) // limit)
    formats, modes = Counter(), Counter()
    anomalies: dict[str, list[str]] = {}
    checked = 0
    for im in images[::step]:
        name = str(im.get("file_name", ""))
        path = image_dir / name
        if not path.is_file():
            continue  # reported by missing_images
        checked += 1
        try:
            with Image.open(path) as pil:
                formats[pil.format] += 1
                modes[pil.mode] += 1
                size = pil.size
                orientation = pil.getexif().get(EXIF_ORIENTATION, 1)
        except Exception:  # any decoder failure
            anomalies.setdefault("unreadable image file", []).append(name)
            continue
        if Path(name).suffix.lower() in (".jpg", ".jpeg") and formats and pil.format != "JPEG":
            anomalies.setdefault(f"{pil.format} file named {Path(name).suffix}", []).append(name)
        if orientation not in (1, None):
            anomalies.setdefault("EXIF orientation tag (not applied: boxes refer to stored pixels)", []).append(name)
        if (im.get("width"), im.get("height")) != size:
            anomalies.setdefault("stored size differs from width/height in the file", []).append(name)
    return {"checked": checked, "formats": dict(formats), "modes": dict(modes), "anomalies": anomalies}
