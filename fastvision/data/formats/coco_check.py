"""COCO annotation files as found in the wild: which annotations and images are usable, and why not.

Shared by the reader (:class:`~fastvision.data.formats.coco.CocoDetection` skips what is listed,
with one warning or a one-line error, per ``data.args.invalid``) and by ``fastvision data inspect``
(which prints the same counts and first ids). Nothing is dropped without being reported.

Image files follow what pycocotools and the COCO evaluation assume: pixels as stored. An EXIF
orientation tag is not applied, because COCO's ``width``/``height`` and boxes describe the stored
bitmap; an image whose stored size differs from the file's ``width``/``height`` (a resized copy, or boxes
drawn on an EXIF-turned picture) is reported, and the reader stops on it.

A file whose structure cannot be read as COCO (not JSON, no ``images`` list, an image without
``id`` or ``file_name``, an image id listed twice) is one :class:`DataError` naming the file and the
first such entry (:func:`read_instances`); single annotations that cannot be used are anomalies.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fastvision.errors import DataError

# Kinds of invalid annotation, in the order they are tested (the first that applies is reported).
MISSING_ID = "annotation without an id (integer or string)"
DUPLICATE_ID = "annotation id used before in the file"
UNKNOWN_IMAGE = "unknown image_id"
UNKNOWN_CATEGORY = "unknown category_id"
BAD_BBOX = "missing or malformed bbox"
DEGENERATE = "degenerate box (width or height <= 0)"
BAD_CROWD = "iscrowd not 0 or 1"
OUTSIDE = "box outside its image"
UNREADABLE = "unreadable image file (header or pixels do not decode, e.g. a truncated download)"
OTHER_SIZE = "stored size differs from width/height in the file (the grid of its boxes)"


def read_instances(ann_file: str | Path) -> dict[str, Any]:
    """The parsed instances JSON of ``ann_file``, its structure checked.

    Raises:
        DataError: one line naming the file and the first entry that is not COCO: not JSON, not an
            object with ``images``, ``annotations`` and ``categories`` lists, an image without an integer
            ``id`` (one that fits a 64-bit integer, as the batches and results carry it) or a ``file_name``,
            an image id or file_name listed twice, a category without an integer ``id`` or a ``name``, a category id
            listed twice, an annotation that is not an object.
    """
    def bad(why: str) -> DataError:
        return DataError(f"{ann_file}: not a COCO instances file ({why})")

    try:
        data = json.loads(Path(ann_file).read_bytes())
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad(f"not JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad(f"a JSON {type(data).__name__}, expected an object with images, annotations and categories")
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise bad(f"no {key!r} list")
    seen: set[int] = set()
    files: dict[str, int] = {}
    for k, im in enumerate(data["images"]):
        if why := _image_problem(k, im):
            raise bad(why)
        if im["id"] in seen:
            raise bad(f"images[{k}]: image id {im['id']} listed twice")
        if im["file_name"] in files:  # a merged export: each id holds part of the boxes, scored apart
            raise bad(f"images[{k}] (id {im['id']}): file_name {im['file_name']} listed before, "
                      f"as image id {files[im['file_name']]}")
        seen.add(im["id"])
        files[im["file_name"]] = im["id"]
    cats: set[int] = set()
    for k, c in enumerate(data["categories"]):
        if not isinstance(c, dict) or "id" not in c or "name" not in c:
            raise bad(f"categories[{k}] has no id or name")
        if not _is_int(c["id"]):  # a string id ("1") matches no integer category_id of the results
            raise bad(f"categories[{k}] ({c['name']!r}): id {c['id']!r} is not an integer")
        if c["id"] in cats:  # pycocotools' getCatIds lists it twice: one class too many, never trained
            raise bad(f"categories[{k}] ({c['name']!r}): category id {c['id']} listed twice")
        cats.add(c["id"])
    for k, a in enumerate(data["annotations"]):
        if not isinstance(a, dict):
            raise bad(f"annotations[{k}] is not an object")
    return data


def image_ids(ann_file: str | Path) -> dict[str, int]:
    """``{file name: image id}`` of a COCO file's ``images`` list (:func:`image_entries`)."""
    return {name: im["id"] for name, im in image_entries(ann_file).items()}


def image_entries(ann_file: str | Path) -> dict[str, dict[str, Any]]:
    """``{file name: images entry}`` of a COCO file's ``images`` list: an instances file, or an image-info file
    without annotations (test-dev's ``image_info_test-dev2017.json``), matched by the name's last part.

    Raises:
        DataError: one line naming the file where it is not JSON, has no ``images`` list, an image has no
            integer ``id`` or ``file_name``, or two images share a file name.
    """
    def bad(why: str) -> DataError:
        return DataError(f"{ann_file}: not a COCO instances or image-info file ({why})")

    try:
        raw = Path(ann_file).read_bytes()
    except OSError as e:
        raise DataError(f"{ann_file}: cannot read it ({e.strerror})") from None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise bad(f"not JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise bad("no 'images' list")
    ids: dict[str, dict[str, Any]] = {}
    for k, im in enumerate(data["images"]):
        if why := _image_problem(k, im):
            raise bad(why)
        name = Path(im["file_name"]).name
        if name in ids:
            raise bad(f"images[{k}]: file name {name} listed twice")
        ids[name] = im
    return ids


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


INT64 = 2**63  # image ids travel in int64 tensors (batches, detections): |id| must stay below


def _image_problem(k: int, im: Any) -> str | None:
    """Why ``images[k]`` is not a COCO image entry (no integer id in int64's range, no file_name), else None."""
    if not isinstance(im, dict) or not _is_int(im.get("id")):
        return f"images[{k}] has no integer id"
    if not -INT64 <= im["id"] < INT64:
        return f"images[{k}]: image id {im['id']} does not fit a 64-bit integer"
    if not isinstance(im.get("file_name"), str) or not im["file_name"]:
        return f"images[{k}] (id {im['id']}) has no file_name"
    return None


def check_annotations(dataset: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """Split a COCO instances dict's annotations into usable ones and anomalies.

    An annotation id that was used before in the file (a merged export) is an anomaly: pycocotools
    indexes annotations by id, so a second one would silently replace the first in training and in
    COCOeval's ground truth; the first is kept.

    Args:
        dataset: the parsed JSON (``images``, ``annotations``, ``categories``).

    Returns:
        (the usable annotations in file order, ``{kind: [annotation ids]}`` of the rest; kinds with
        none omitted).
    """
    images = {im.get("id"): im for im in dataset.get("images", [])}
    cats = {c.get("id") for c in dataset.get("categories", [])}
    usable: list[dict[str, Any]] = []
    ids: set[Any] = set()
    bad: dict[str, list[Any]] = {}
    for a in dataset.get("annotations", []):
        ann_id = a.get("id")
        if not isinstance(ann_id, (int, str)) or isinstance(ann_id, bool):
            kind, ann_id = MISSING_ID, None
        elif ann_id in ids:
            kind = DUPLICATE_ID
        else:
            kind = _problem(a, images, cats)
        if ann_id is not None:
            ids.add(ann_id)
        if kind is None:
            usable.append(_with_defaults(a))
        else:
            bad.setdefault(kind, []).append(ann_id if ann_id is not None else f"image {a.get('image_id')}")
    return usable, bad


def _with_defaults(a: dict[str, Any]) -> dict[str, Any]:
    """``a`` with the fields COCOeval reads that exports often leave out: ``iscrowd`` 0 (also for ``null``, on
    which COCOeval's ``int()`` fails), and ``area`` (missing, not a number, or <= 0) the box's, as pycocotools gives
    detections (``loadRes``); the original dict if complete."""
    area = a.get("area")
    # > 0: an export writing area 0 (no segmentation measured) put every box in COCOeval's small range, and a
    # negative one left the box out of every range (ignored ground truth)
    has_area = isinstance(area, (int, float)) and not isinstance(area, bool) and math.isfinite(area) and area > 0
    if a.get("iscrowd") is not None and has_area:
        return a
    fixed = {**a, "iscrowd": a.get("iscrowd") or 0}
    if not has_area:
        fixed["area"] = float(a["bbox"][2]) * float(a["bbox"][3])
    return fixed


def _problem(a: dict[str, Any], images: dict[Any, dict], cats: set[Any]) -> str | None:
    image = images.get(a.get("image_id"))
    if image is None:
        return UNKNOWN_IMAGE
    if a.get("category_id") not in cats:
        return UNKNOWN_CATEGORY
    if a.get("iscrowd") not in (0, 1, None):  # "0" is true: pycocotools would ignore the box as a crowd
        return BAD_CROWD
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


def renamed_categories(train: list[dict[str, Any]], val: list[dict[str, Any]]) -> list[tuple[Any, Any, Any]]:
    """``[(id, val name, train name)]`` of the category ids two ``categories`` lists name differently: an
    export that numbers the categories per file (in order of appearance) gives a validation box of one
    category another's id, and the model's class for that id is scored against it."""
    names = {c["id"]: c["name"] for c in train}
    return [(c["id"], c["name"], names[c["id"]]) for c in val if c["id"] in names and c["name"] != names[c["id"]]]


def other_size(image: dict[str, Any], size: tuple[int, int], path: Path, ann_name: str,
               remedy: str = "give the images as annotated, or correct width/height") -> str | None:
    """The one-line reason where ``image`` (an ``images`` entry; its file ``path``) is stored at ``size`` but
    lists another ``width`` x ``height``, the grid of its boxes (a resized copy, or boxes drawn on an EXIF-turned
    picture; detectron2 refuses it too), ending with ``remedy``; else None (also where the file gives no
    integer width/height)."""
    listed = (image.get("width"), image.get("height"))
    if not all(type(v) is int for v in listed) or listed == tuple(size):
        return None
    why = ("the transposed size: boxes drawn on the picture as its EXIF orientation turns it? COCO's boxes "
           "refer to the stored pixels" if listed == tuple(size)[::-1] else "a resized copy of the images?")
    return (f"{path}: stored {size[0]}x{size[1]}, but {ann_name} lists it as {listed[0]}x{listed[1]}, the grid of "
            f"its boxes ({why}); {remedy}")


def check_images(images: list[dict[str, Any]], image_dir: Path, ann_name: str, decode: bool = True) -> None:
    """A validation split's ``images`` all decode (header, end marker or a full decode; with ``decode``) and
    are stored at their ``width`` x ``height``, checked when the dataset is built: a truncated one stopped
    the run at the first validation, after a training epoch, and one of another size was scored against
    boxes of another grid (a training split's image is checked when first read, as the docs say).

    Raises:
        DataError: one line naming the first such image and the count.
    """
    from PIL import Image

    from fastvision.data.formats.anomalies import first_few
    from fastvision.data.formats.anomalies import image_facts as read_facts

    bad, wrong = [], []
    for im in images:
        path = image_dir / im["file_name"]
        if decode:
            facts = read_facts(path)  # None: the header or the pixels do not decode
            if facts is None:
                bad.append(im["file_name"])
                continue
            size = facts.size
        else:  # skip_unreadable: the reader decoded it already
            with Image.open(path) as f:
                size = f.size
        if why := other_size(im, size, path, ann_name):
            wrong.append((why, im["file_name"]))
    if bad:
        raise DataError(f"{image_dir / bad[0]}: image listed in {ann_name} does not decode "
                        f"({len(bad)} such: {first_few(bad)}; a truncated download? "
                        "data.args.skip_unreadable=true skips them)")
    if wrong:
        raise DataError(wrong[0][0] + (f" ({len(wrong)} such: {first_few([n for _, n in wrong])})"
                                       if len(wrong) > 1 else ""))


def layout_hint(root: Path) -> str:
    """Where a COCO folder lacks a split's instances file: the instances files it has (another split name),
    or the folder above where ``root`` is its ``annotations/`` or an image folder."""
    have = sorted(f.name for f in (root / "annotations").glob("instances_*.json"))
    if have:
        splits = [n.removeprefix("instances_").removesuffix(".json") for n in have]
        return (f" (annotations/ holds {', '.join(have)}: --set data.args.train_split=... "
                f"--set data.args.val_split=... name the splits, e.g. {', '.join(splits)})")
    if root.name == "annotations" or any(root.parent.glob("annotations/instances_*.json")):
        return f" ({root} is inside a COCO folder: --data takes {root.parent}, which holds annotations/)"
    return " (a COCO folder holds annotations/instances_<split>.json and <split>/ image folders)"


def untrained_categories(categories: list[dict[str, Any]], usable: list[dict[str, Any]]) -> list[str]:
    """``["0 'objects'", ...]``: the categories no usable non-crowd box of a training file has (an export's
    placeholder category 0, a class filtered out): each is a class of the model that is never trained."""
    used = {a["category_id"] for a in usable if not a.get("iscrowd")}
    return [f"{c['id']} {c['name']!r}" for c in categories if c["id"] not in used]


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

    from fastvision.data.formats.anomalies import image_facts as read_facts  # this function's name too

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
        facts = read_facts(path)
        if facts is None:  # the header or the pixels do not decode
            anomalies.setdefault(UNREADABLE, []).append(name)
            continue
        formats[facts.format] += 1
        modes[facts.mode] += 1
        if Path(name).suffix.lower() in (".jpg", ".jpeg") and facts.format != "JPEG":
            anomalies.setdefault(f"{facts.format} file named {Path(name).suffix}", []).append(name)
        if facts.orientation not in (1, None):
            anomalies.setdefault("EXIF orientation tag (not applied: boxes refer to stored pixels)", []).append(name)
        listed = (im.get("width"), im.get("height"))
        if all(type(v) is int for v in listed) and listed != facts.size:  # the reader stops on it
            anomalies.setdefault(OTHER_SIZE, []).append(name)
    return {"checked": checked, "formats": dict(formats), "modes": dict(modes), "anomalies": anomalies}


def inspect_folder(path: Path) -> tuple[dict[str, Any], dict[str, list[Any]], dict[str, list[Any]]]:
    """``data inspect`` of a COCO folder: every ``annotations/instances_<split>.json`` with its ``<split>/``.

    Returns:
        ``(facts, anomalies, unusable)``: per split image and box counts, boxes per category, image
        formats and modes; ``{kind: [ids or names]}`` of what the reader skips with a warning; and of
        what training stops on (an image folder or listed images missing, images that do not decode or
        whose stored size is not the file's width/height, validation categories the training file lacks
        or names otherwise), which makes ``data inspect`` exit 2.
    """
    from collections import Counter

    report: dict[str, Any] = {"detected": "COCO instances (annotations/instances_<split>.json + <split>/)"}
    anomalies: dict[str, list[Any]] = {}
    unusable: dict[str, list[Any]] = {}
    cat_ids: dict[str, list[Any]] = {}
    categories: dict[str, list[dict[str, Any]]] = {}
    for ann in sorted((path / "annotations").glob("instances_*.json")):
        data = read_instances(ann)  # one line naming the file where it is not COCO
        images, cats = data["images"], data["categories"]
        split = ann.stem.removeprefix("instances_")
        cat_ids[split], categories[split] = [c["id"] for c in cats], cats
        usable, bad = check_annotations(data)
        names = {c["id"]: c["name"] for c in cats}
        with_boxes = {a["image_id"] for a in usable}
        boxless = sum(im["id"] not in with_boxes for im in images)
        report[f"{split} images (without boxes)"] = f"{len(images)} ({boxless})"
        report[f"{split} boxes (crowd)"] = f"{len(usable)} ({sum(bool(a.get('iscrowd')) for a in usable)})"
        report[f"{split} boxes per category"] = dict(Counter(names[a["category_id"]] for a in usable))
        if "train" in split and (unused := untrained_categories(cats, usable)):
            anomalies[f"{split}: categories without a box (classes never trained)"] = unused
        for kind, ids in bad.items():
            anomalies[f"{split}: annotations with {kind} (skipped; ids)"] = ids
        if not images:
            unusable[f"{split}: the file lists no images"] = [ann.name]
        elif "train" in split and not any(not a.get("iscrowd") for a in usable):
            unusable[f"{split}: no usable box to train on"] = [ann.name]
        image_dir = path / split
        if not image_dir.is_dir():
            unusable[f"{split}: image folder missing"] = [str(image_dir)]
            continue
        unusable[f"{split}: listed images missing on disk"] = missing_images(data, image_dir)
        facts = image_facts(data, image_dir)
        report[f"{split} image formats (headers of {facts['checked']})"] = facts["formats"]
        report[f"{split} image modes"] = facts["modes"]
        for kind, files in facts["anomalies"].items():
            (unusable if kind in (UNREADABLE, OTHER_SIZE) else anomalies)[f"{split}: {kind}"] = files
    train = [s for s in cat_ids if "train" in s]
    for val in (s for s in cat_ids if "val" in s and len(train) == 1):
        extra = sorted(set(cat_ids[val]) - set(cat_ids[train[0]]), key=str)
        if extra:  # the reader refuses them: the model has no class for them
            unusable[f"{val}: category ids not in {train[0]}'s categories"] = extra
        renamed = renamed_categories(categories[train[0]], categories[val])
        if renamed:  # the reader refuses them too: the model's class for the id is another category
            unusable[f"{val}: category ids named otherwise in {train[0]}"] = [
                f"{i}: {v!r} ({t!r} in {train[0]})" for i, v, t in renamed]
    return report, anomalies, unusable
