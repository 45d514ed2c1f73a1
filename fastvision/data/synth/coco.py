"""``fastvision data synth coco OUT``: a learnable shapes detection set in COCO format.

Each image holds a few filled shapes (disk, square, triangle, cross), one colour family per class,
at sizes from small to large (COCO's small / medium / large area ranges all occur), overlapping
a little, over a noisy background of varying size. Some images are empty and some hold a crowd
region (a swarm of tiny disks annotated once with ``iscrowd: 1`` and an RLE mask), so the empty
and crowd paths of matching and evaluation are exercised. Category ids are deliberately not
contiguous (1, 3, 5, 8) so the id mapping is exercised too.

Layout (the real COCO one): ``OUT/{train2017,val2017}/<id>.jpg`` and
``OUT/annotations/instances_{train2017,val2017}.json``.
"""
from __future__ import annotations

import colorsys
import json
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from fastvision.data.synth import SYNTH, require
from fastvision.utils.files import atomic_write

CATEGORIES = [(1, "disk", 0.0), (3, "square", 0.33), (5, "triangle", 0.62), (8, "cross", 0.8)]
SIZES = [(320, 320), (384, 288), (256, 320), (400, 300)]


def _polygon(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    """Outline of ``shape`` centred at (cx, cy) with half-size ``r`` (pixels), rotated by ``angle``."""
    if shape == "disk":
        pts = [(math.cos(t), math.sin(t)) for t in np.linspace(0, 2 * math.pi, 24, endpoint=False)]
    elif shape == "square":
        pts = [(-0.8, -0.8), (0.8, -0.8), (0.8, 0.8), (-0.8, 0.8)]
    elif shape == "triangle":
        pts = [(0.0, -1.0), (0.9, 0.75), (-0.9, 0.75)]
    else:  # cross
        a, b = 0.3, 1.0
        pts = [(-a, -b), (a, -b), (a, -a), (b, -a), (b, a), (a, a), (a, b), (-a, b), (-a, a), (-b, a), (-b, -a),
               (-a, -a)]
    c, s = math.cos(angle), math.sin(angle)
    if shape == "disk":
        c, s = 1.0, 0.0
    return [(cx + r * (x * c - y * s), cy + r * (x * s + y * c)) for x, y in pts]


def _area(poly: list[tuple[float, float]]) -> float:
    x = np.array([p[0] for p in poly])
    y = np.array([p[1] for p in poly])
    return float(0.5 * abs(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1))))


def _iou(a: list[float], b: list[float]) -> float:
    ix = max(0.0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1]))
    inter = ix * iy
    return inter / (a[2] * a[3] + b[2] * b[3] - inter)


def _colour(hue: float, rng: np.random.Generator) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb((hue + rng.uniform(-0.04, 0.04)) % 1, rng.uniform(0.6, 1.0), rng.uniform(0.7, 1.0))
    return int(r * 255), int(g * 255), int(b * 255)


def _image(image_id: int, rng: np.random.Generator, ann_id: list[int], sizes: tuple[float, float],
           max_objects: int) -> tuple[Image.Image, dict, list[dict]]:
    from pycocotools import mask as mask_utils

    w, h = SIZES[rng.integers(len(SIZES))]
    bg = rng.uniform(40, 140) + rng.normal(0, 12, size=(h, w, 3))
    img = Image.fromarray(bg.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    anns: list[dict] = []
    kind = rng.random()
    if kind < 0.1:
        n = 0  # empty image: kept by the loader, gives only negatives
    else:
        n = int(rng.integers(1, max_objects + 1))
    if 0.1 <= kind < 0.2:  # a crowd: many tiny disks in one region, annotated once
        cw, ch = rng.uniform(60, 120), rng.uniform(40, 90)
        x0, y0 = rng.uniform(0, w - cw), rng.uniform(0, h - ch)
        mask = Image.new("L", (w, h), 0)
        mdraw = ImageDraw.Draw(mask)
        for _ in range(40):
            cx, cy, r = x0 + rng.uniform(0, cw), y0 + rng.uniform(0, ch), rng.uniform(2, 4)
            box = [cx - r, cy - r, cx + r, cy + r]
            draw.ellipse(box, fill=_colour(CATEGORIES[0][2], rng))
            mdraw.ellipse(box, fill=1)
        m = np.asfortranarray(np.array(mask, dtype=np.uint8))
        rle = mask_utils.encode(m)
        x, y, bw, bh = (float(v) for v in mask_utils.toBbox(rle))
        rle["counts"] = rle["counts"].decode("ascii")
        anns.append({"category_id": CATEGORIES[0][0], "bbox": [x, y, bw, bh], "area": float(mask_utils.area(rle)),
                     "iscrowd": 1, "segmentation": rle})
    placed: list[list[float]] = [a["bbox"] for a in anns]
    for _ in range(n):
        for _attempt in range(20):
            # log-uniform half-size; the default 16-90 px spans COCO small (< 32^2), medium and large
            r = float(math.exp(rng.uniform(math.log(sizes[0]), math.log(min(sizes[1], min(w, h) * 0.3)))))
            cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
            cat, shape, hue = CATEGORIES[rng.integers(len(CATEGORIES))]
            poly = _polygon(shape, cx, cy, r, rng.uniform(-0.3, 0.3))
            xs, ys = [p[0] for p in poly], [p[1] for p in poly]
            bbox = [min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys)]
            if all(_iou(bbox, p) < 0.25 for p in placed):  # some overlap, never hidden
                break
        else:
            continue
        placed.append(bbox)
        draw.polygon(poly, fill=_colour(hue, rng))
        anns.append({"category_id": cat, "bbox": bbox, "area": _area(poly), "iscrowd": 0,
                     "segmentation": [[round(v, 2) for p in poly for v in p]]})
    for a in anns:
        a["id"], a["image_id"] = ann_id[0], image_id
        ann_id[0] += 1
    info = {"id": image_id, "file_name": f"{image_id:012d}.jpg", "width": w, "height": h}
    return img, info, anns


def _write_split(out: Path, split: str, count: int, first_id: int, rng: np.random.Generator,
                 sizes: tuple[float, float], max_objects: int) -> None:
    folder = out / split
    folder.mkdir(parents=True, exist_ok=True)
    images, annotations, ann_id = [], [], [1]
    for i in range(count):
        img, info, anns = _image(first_id + i, rng, ann_id, sizes, max_objects)
        img.save(folder / info["file_name"], quality=92)
        images.append(info)
        annotations += anns
    data = {
        "info": {"description": "fastvision synthetic shapes"},
        "images": images,
        "annotations": annotations,
        "categories": [{"id": c, "name": n, "supercategory": "shape"} for c, n, _ in CATEGORIES],
    }
    path = out / "annotations" / f"instances_{split}.json"
    atomic_write(path, lambda f: f.write(json.dumps(data).encode()))


@SYNTH.register("coco")
def synth(out: Path, *, seed: int = 0, train: int = 240, val: int = 60, min_size: float = 16.0,
          max_size: float = 90.0, max_objects: int = 4) -> Path:
    """Write the shapes dataset to ``out`` (deterministic under ``seed``).

    The default object sizes suit the CPU recipe ``ssd320-small-shapes`` (128 px inputs, smallest
    anchors 16 px): a 16 px half-size spans about 13 px there (still a COCO "small" object in
    the original pixels); smaller objects would be matched only by the forced matches.

    Args:
        out: output folder (created).
        seed: random seed.
        train: number of training images.
        val: number of validation images.
        min_size, max_size: range of object half-sizes in image pixels (log-uniform; images are
            256-400 px wide, so ``max_size`` is also capped at 0.3 of the shorter side).
        max_objects: objects per non-empty image are drawn from 1..max_objects.

    Returns:
        ``out``.
    """
    require("coco", train=(train, 1), val=(val, 1), min_size=(min_size, ">0"), max_size=(max_size, min_size),
            max_objects=(max_objects, 1))
    out = Path(out)
    rng = np.random.default_rng(seed)
    _write_split(out, "train2017", train, 1, rng, (min_size, max_size), max_objects)
    _write_split(out, "val2017", val, 100000, rng, (min_size, max_size), max_objects)
    return out
