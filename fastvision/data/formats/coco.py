"""COCO detection format: ``annotations/instances_<split>.json`` + ``<split>/`` image folder.

Annotations are read through pycocotools. Category ids map to contiguous class indices in id
order (``cat_ids[k]`` maps back for results). Crowd boxes (RLE segmentation) are kept with
``iscrowd`` set (the matcher ignores anchors inside them); images without boxes are kept (they
teach negatives). Invalid annotations (degenerate boxes, unknown image or category ids) are
skipped with one warning, or refused (``invalid="error"``); see :mod:`.coco_check`. Grey, CMYK,
palette and PNG images are decoded to RGB; pixels are used as stored (no EXIF rotation).

An item is deterministic: the image resized to a square ``image_size`` with its boxes. Training
runs through :meth:`CocoDetection.cache_pipeline`: the decoded full-size image and its targets
are the cacheable prefix, and :class:`SSDAugment` (per item, on the host, because a crop changes
the number of boxes per image) draws from a generator of (seed, epoch, sample index): SSD random
crop (area 0.75-1.0 of the image, aspect 0.75-3.0) that clips boxes and drops degenerate ones,
horizontal flip, optional colour jitter, then the resize. Items follow CONTRACTS.md (detection)
and :func:`collate_detection` pads them into a batch.
"""
from __future__ import annotations

import contextlib
import io
import logging
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from fastvision.data.formats.anomalies import (
    drop_unreadable,
    first_few,
    handle_invalid,
    image_decodes,
)
from fastvision.data.formats.base import DatasetSplits, dataset_folder
from fastvision.data.formats.coco_check import (
    check_annotations,
    check_images,
    layout_hint,
    other_size,
    read_instances,
    renamed_categories,
    untrained_categories,
)
from fastvision.data.transforms import RandomTransform, Transform
from fastvision.errors import ConfigError, DataError, check_range
from fastvision.registry import DATASETS

log = logging.getLogger(__name__)


def load_coco(ann_file: str | Path):
    """A ``pycocotools.coco.COCO`` index of the usable annotations of ``ann_file``.

    The file is read and its structure checked by :func:`.coco_check.read_instances` (one-line
    DataError); annotations :func:`.coco_check.check_annotations` finds unusable (degenerate boxes,
    unknown image or category ids, ids used twice ...) are left out of the index and listed in its
    ``anomalies`` attribute (``{kind: [ids]}``), so training and the COCOeval ground truth see the same boxes.
    """
    try:
        from pycocotools.coco import COCO
    except ImportError as e:  # optional dependency
        raise ConfigError("the coco dataset needs pycocotools: pip install 'fastvision[detection]'") from e
    ann_file = Path(ann_file)
    if not ann_file.is_file():
        raise DataError(f"COCO annotation file not found: {ann_file}")
    data = read_instances(ann_file)
    usable, anomalies = check_annotations(data)
    if not all(type(a["id"]) is int and a["id"] > 0 for a in usable):
        # COCOeval keeps the matched ground truth's id in a float array where 0 is "unmatched": the match of
        # an annotation with id 0 counted as a false positive (perfect detections scored 0.25 for ids 0, 1),
        # and a string id stopped it (ValueError); the index numbers them 1..N in file order instead
        usable = [{**a, "id": k} for k, a in enumerate(usable, 1)]
    coco = COCO()
    coco.dataset = {**data, "annotations": usable}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools reports by print
        coco.createIndex()
    coco.anomalies = anomalies
    return coco


def sample_crop(width: int, height: int, area: tuple[float, float] = (0.75, 1.0),
                aspect: tuple[float, float] = (0.75, 3.0), attempts: int = 100,
                generator: torch.Generator | None = None) -> tuple[int, int, int, int]:
    """TF ``random_crop_image`` window: a fraction of the image area and a width/height ratio.

    Args:
        generator: source of the draws (training: the item's generator).

    Returns:
        ``(x0, y0, x1, y1)`` integer pixels; the whole image when no sample fits.
    """
    g = generator
    for _ in range(attempts):
        a = float(torch.empty(()).uniform_(*area, generator=g)) * width * height
        r = float(torch.empty(()).uniform_(*aspect, generator=g))
        cw, ch = int(round(math.sqrt(a * r))), int(round(math.sqrt(a / r)))
        if 0 < cw <= width and 0 < ch <= height:
            x0 = int(torch.randint(0, width - cw + 1, (), generator=g))
            y0 = int(torch.randint(0, height - ch + 1, (), generator=g))
            return x0, y0, x0 + cw, y0 + ch
    return 0, 0, width, height


def crop_boxes(boxes: Tensor, window: tuple[int, int, int, int]) -> tuple[Tensor, Tensor]:
    """Shift ``(N, 4)`` xyxy boxes into ``window`` and clip them.

    Returns:
        ``(boxes (N', 4), keep (N,) bool)``: clipped boxes with positive width and height.
    """
    x0, y0, x1, y1 = window
    shifted = boxes - torch.tensor([x0, y0, x0, y0], dtype=boxes.dtype)
    shifted[:, 0::2] = shifted[:, 0::2].clamp(0, x1 - x0)
    shifted[:, 1::2] = shifted[:, 1::2].clamp(0, y1 - y0)
    keep = (shifted[:, 2] > shifted[:, 0]) & (shifted[:, 3] > shifted[:, 1])
    return shifted[keep], keep


def color_jitter(image: Tensor, strength: float, generator: torch.Generator | None = None) -> Tensor:
    """Random brightness, contrast and saturation factors in ``[1 - s, 1 + s]`` on ``(3, H, W)`` uint8."""
    x = image.float()
    f = torch.empty(3).uniform_(1 - strength, 1 + strength, generator=generator)
    x = x * f[0]
    x = (x - x.mean()) * f[1] + x.mean()
    grey = x.mean(dim=0, keepdim=True)
    x = (x - grey) * f[2] + grey
    return x.round().clamp(0, 255).to(torch.uint8)


def resize_to_square(img: Image.Image, window: tuple[int, int, int, int], size: int,
                     boxes: Tensor) -> tuple[Tensor, Tensor]:
    """Crop ``window`` and resize to ``size`` x ``size`` in one resampling step (PIL's ``box``).

    Returns:
        ``(image (3, size, size) uint8, boxes scaled from window pixels to output pixels)``.
    """
    img = img.resize((size, size), Image.BILINEAR, box=window)
    cw, ch = window[2] - window[0], window[3] - window[1]
    boxes = boxes * torch.tensor([size / cw, size / ch, size / cw, size / ch])
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).contiguous(), boxes


class SSDAugment(RandomTransform):
    """SSD training augmentation of one decoded item, drawn from the item's generator: random
    crop with box clipping, resize to ``image_size``, horizontal flip, colour jitter."""

    def __init__(self, image_size: int, crop: bool = True, flip: bool = True, jitter: float = 0.0):
        self.image_size, self.crop, self.flip, self.jitter = image_size, crop, flip, jitter

    def __call__(self, item: dict[str, Any], generator: torch.Generator) -> dict[str, Any]:
        # a host transform (PIL resampling): items of a device cache come back to the host
        image, boxes, labels, crowd = (item[k].cpu() for k in ("image", "boxes", "labels", "iscrowd"))
        h, w = image.shape[1:]
        window = sample_crop(w, h, generator=generator) if self.crop else (0, 0, w, h)
        # clipped to the window, the whole image without the crop (a COCO box may reach past the image;
        # one wholly outside, in a file without width/height, is dropped)
        boxes, keep = crop_boxes(boxes, window)
        labels, crowd = labels[keep], crowd[keep]
        S = self.image_size
        image, boxes = resize_to_square(Image.fromarray(image.permute(1, 2, 0).numpy()), window, S, boxes)
        if self.flip and bool(torch.rand((), generator=generator) < 0.5):
            image = image.flip(-1)
            boxes = torch.stack([S - boxes[:, 2], boxes[:, 1], S - boxes[:, 0], boxes[:, 3]], dim=1)
        if self.jitter > 0:
            image = color_jitter(image, self.jitter, generator)
        return {**item, "image": image, "boxes": boxes, "labels": labels, "iscrowd": crowd,
                "orig_size": tuple(item["orig_size"])}


class _Decode(Transform):
    """The cacheable step of a training item: ``{"index": i}`` -> the full-size decoded item."""

    def __init__(self, dataset: CocoDetection):
        self.dataset = dataset

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        return self.dataset.decode(item["index"])

    def signature(self) -> str:
        return "fastvision.coco.decode/v1"  # identity() names the image and annotation files


class CocoDetection(Dataset):
    """Items ``{"image", "boxes", "labels", "iscrowd", "image_id", "orig_size"}`` of one split.

    ``dataset[i]`` is deterministic: image ``i`` resized to ``image_size``. A training split
    (``train=True``) is read through :meth:`cache_pipeline`, which adds :class:`SSDAugment`.

    Args:
        ann_file: ``instances_<split>.json``.
        image_dir: folder of the split's images.
        image_size: side of the square network input (pixels).
        train: the split is trained on (its pipeline has random crop / flip / jitter).
        crop, flip: enable those augmentations (training only).
        jitter: colour-jitter strength (0 disables).
        cat_ids: category ids in class order (default: this file's, sorted).
        invalid: "warn" (skip invalid annotations with one warning naming the file, the count and
            the first ids) or "error" (stop with that line); see :mod:`.coco_check`.
        skip_unreadable: skip (with one warning) images whose file is missing or does not
            decode, instead of stopping with an error naming the file.
    """

    def __init__(self, ann_file: str | Path, image_dir: str | Path, image_size: int = 320, train: bool = False,
                 crop: bool = True, flip: bool = True, jitter: float = 0.0, cat_ids: list[int] | None = None,
                 invalid: str = "warn", skip_unreadable: bool = False):
        self.ann_file = Path(ann_file)
        self.coco = load_coco(ann_file)
        self.image_dir = Path(image_dir)
        if not self.image_dir.is_dir():
            raise DataError(f"COCO image folder not found: {self.image_dir}")
        handle_invalid(ann_file, self.coco.anomalies, invalid)
        self.cat_ids = list(cat_ids) if cat_ids is not None else sorted(self.coco.getCatIds())
        self.class_of = {c: k for k, c in enumerate(self.cat_ids)}
        unknown = set(self.coco.getCatIds()) - set(self.class_of)
        if unknown:
            raise DataError(f"{ann_file}: category ids {sorted(unknown)} are not in the training categories")
        self.train = train
        self.ids = self._usable_images(Path(ann_file), skip_unreadable)
        if train and not any(not a.get("iscrowd") for i in self.ids for a in self.coco.imgToAnns.get(i, [])):
            skipped = sum(len(v) for v in self.coco.anomalies.values())
            raise DataError(f"{ann_file}: no usable box to train on in its {len(self.ids)} images"
                            + (f" ({skipped} invalid annotations skipped)" if skipped else "")
                            + " (images without boxes are kept as negatives, but a training split needs boxes)")
        self.image_size = image_size
        self.crop, self.flip, self.jitter = crop, flip, jitter

    def __len__(self) -> int:
        return len(self.ids)

    def _usable_images(self, ann_file: Path, skip_unreadable: bool) -> list[int]:
        """Sorted image ids whose files exist (and, under ``skip_unreadable``, whose headers decode)."""
        ids = sorted(self.coco.getImgIds())
        if not ids:
            raise DataError(f"{ann_file}: lists no images")
        missing = [i for i in ids if not (self.image_dir / self.coco.imgs[i]["file_name"]).is_file()]
        if len(missing) == len(ids):  # also under skip_unreadable: nothing would be left
            raise DataError(f"{self.image_dir}: none of the {len(ids)} images listed in {ann_file.name} is there "
                            f"(first: {self.coco.imgs[ids[0]]['file_name']}); the wrong split folder?")
        if missing and not skip_unreadable:
            names = [self.coco.imgs[i]["file_name"] for i in missing]
            raise DataError(f"{self.image_dir / names[0]}: image listed in {ann_file.name} not found "
                            f"({len(missing)} missing: {first_few(names)}; data.args.skip_unreadable=true skips them)")
        gone = set(missing)
        ids = [i for i in ids if i not in gone]
        kept = drop_unreadable(ids, lambda i: [self.image_dir / self.coco.imgs[i]["file_name"]], image_decodes,
                               skip_unreadable, self.image_dir)
        if not self.train:
            check_images([self.coco.imgs[i] for i in kept], self.image_dir, ann_file.name, decode=not skip_unreadable)
        if missing:
            log.warning("%s: skipped %d images listed in %s but not found: %s", self.image_dir, len(missing),
                        ann_file.name, first_few([self.coco.imgs[i]["file_name"] for i in missing]))
        return kept

    def targets(self, image_id: int) -> tuple[Tensor, Tensor, Tensor]:
        """Original-pixel ``(boxes (N, 4) xyxy, labels (N,), iscrowd (N,))`` of the usable
        annotations (the index holds only those; the others were reported when it was built)."""
        anns = self.coco.imgToAnns.get(image_id, [])
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        labels = torch.tensor([self.class_of[a["category_id"]] for a in anns], dtype=torch.int64)
        crowd = torch.tensor([bool(a.get("iscrowd", 0)) for a in anns], dtype=torch.bool)
        return boxes, labels, crowd

    def path(self, i: int) -> Path:
        return self.image_dir / self.coco.imgs[self.ids[i]]["file_name"]

    def identity(self, i: int) -> str:
        """Image ``i``'s file and the annotation file (path, size, mtime): the disk-cache key."""
        from fastvision.data.cache.select import files_identity

        return files_identity([self.path(i), self.ann_file]) + f"|{self.ids[i]}"

    def _open(self, i: int) -> Image.Image:
        from fastvision.data.formats.imagefolder import open_image

        try:  # grey, 16-bit grey (scaled, not clipped at 255), CMYK, palette -> RGB, as ImageFolder reads them
            img = open_image(str(self.path(i)))
        except DataError as e:
            raise DataError(f"cannot read image {e}") from e
        if why := other_size(self.coco.imgs[self.ids[i]], img.size, self.path(i), self.ann_file.name):
            raise DataError(why)
        return img

    def _item(self, i: int, image: Tensor, boxes: Tensor, labels: Tensor, crowd: Tensor, h: int, w: int) -> dict:
        return {"image": image, "boxes": boxes, "labels": labels, "iscrowd": crowd,
                "image_id": int(self.ids[i]), "orig_size": (h, w)}

    def decode(self, i: int) -> dict[str, Any]:
        """Image ``i`` at full size (uint8 (3, h, w)) with original-pixel targets."""
        img = self._open(i)
        w, h = img.size
        image = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).contiguous()
        return self._item(i, image, *self.targets(self.ids[i]), h, w)

    def cache_pipeline(self) -> tuple[Dataset, list]:
        """``(image indices, [decode, SSDAugment])`` for training; ``[decode, resize]`` otherwise."""
        aug = SSDAugment(self.image_size, self.crop and self.train, self.flip and self.train,
                         self.jitter if self.train else 0.0)
        from fastvision.data.cache.select import _Indices

        return _Indices(len(self), self.identity), [_Decode(self), aug]

    def __getitem__(self, i: int) -> dict[str, Any]:
        img = self._open(i)
        w, h = img.size
        boxes, labels, crowd = self.targets(self.ids[i])
        image, boxes = resize_to_square(img, (0, 0, w, h), self.image_size, boxes)
        return self._item(i, image, boxes, labels, crowd, h, w)


def collate_detection(items: list[dict[str, Any]], max_boxes: int | None = None) -> dict[str, Tensor]:
    """Stack images and pad per-image targets to the batch's largest box count.

    Args:
        items: dataset items (same image size).
        max_boxes: pad to this fixed count instead (static shapes for compiled models); extra
            boxes beyond it are dropped.

    Returns:
        ``image (B, 3, H, W) uint8``, ``boxes (B, M, 4) float32``, ``labels (B, M) int64`` with -1
        padding, ``iscrowd (B, M) bool``, ``image_id (B,) int64``, ``orig_size (B, 2) int64`` (h, w).
    """
    B = len(items)
    M = max_boxes if max_boxes is not None else max(1, max(len(it["labels"]) for it in items))
    boxes = torch.zeros(B, M, 4)
    labels = torch.full((B, M), -1, dtype=torch.int64)
    crowd = torch.zeros(B, M, dtype=torch.bool)
    for b, it in enumerate(items):
        n = min(M, len(it["labels"]))
        boxes[b, :n], labels[b, :n], crowd[b, :n] = it["boxes"][:n], it["labels"][:n], it["iscrowd"][:n]
    return {
        "image": torch.stack([it["image"] for it in items]),
        "boxes": boxes,
        "labels": labels,
        "iscrowd": crowd,
        "image_id": torch.tensor([it["image_id"] for it in items], dtype=torch.int64),
        "orig_size": torch.tensor([list(it["orig_size"]) for it in items], dtype=torch.int64),
    }


@DATASETS.register("coco")
def build(*, path: str, train_split: str = "train2017", val_split: str = "val2017", image_size: int = 320,
          crop: bool = True, flip: bool = True, color_jitter: float = 0.0, invalid: Literal["warn", "error"] = "warn",
          skip_unreadable: bool = False) -> DatasetSplits:
    """COCO-layout folder ``path`` with ``annotations/instances_<split>.json`` and ``<split>/``.

    Args:
        path: dataset root.
        train_split, val_split: split names (file and folder names).
        image_size: square network input side (pixels); 320 for SSD320.
        crop, flip: training augmentations of the seed config.
        color_jitter: brightness/contrast/saturation strength (0 = off, as the seed configs).
        invalid: invalid annotations (degenerate boxes, unknown image or category ids): "warn"
            skips them with one warning per file, "error" stops.
        skip_unreadable: skip missing or undecodable images with a warning instead of stopping.

    Returns:
        Splits; ``info`` holds ``num_classes``, ``cat_ids``, ``class_names`` (also as ``classes``, which
        ``evaluate --data`` and a resume compare with the checkpoint's), ``val_ann_file`` and
        ``image_size`` for the model, the evaluator and result files.

    Raises:
        DataError: also where the validation file names a category id otherwise than the training file.
    """
    check_range("data.args.image_size", image_size, 1)
    check_range("data.args.color_jitter", color_jitter, 0.0, 1.0)
    given = Path(path)
    if given.is_file() and given.parent.name == "annotations":  # the root is the folder above annotations/
        raise DataError(f"COCO dataset: {given} is a file; --data takes the COCO dataset folder "
                        f"({given.parent.parent}, which holds annotations/ and the image folders)")
    root = dataset_folder(path, "COCO dataset")
    ann = root / "annotations"
    for split in (train_split, val_split):
        if not (ann / f"instances_{split}.json").is_file():
            raise DataError(f"COCO annotation file not found: {ann / f'instances_{split}.json'}{layout_hint(root)}")
    checks = dict(invalid=invalid, skip_unreadable=skip_unreadable)
    train = CocoDetection(ann / f"instances_{train_split}.json", root / train_split, image_size, train=True,
                          crop=crop, flip=flip, jitter=color_jitter, **checks)
    val = CocoDetection(ann / f"instances_{val_split}.json", root / val_split, image_size, train=False,
                        cat_ids=train.cat_ids, **checks)
    renamed = renamed_categories(train.coco.dataset["categories"], val.coco.dataset["categories"])
    if renamed:
        i, v, t = renamed[0]
        raise DataError(f"{val.ann_file}: category id {i} is {v!r} there, {t!r} in {train.ann_file.name} "
                        f"({len(renamed)} id(s) named otherwise; the model's class for an id would be scored "
                        "against another category): give both files the same categories")
    if unused := untrained_categories(train.coco.dataset["categories"], train.coco.dataset["annotations"]):
        log.warning("%s: %d categor%s without a box (%s): the model has a class for each that is never trained",
                    train.ann_file, len(unused), "y" if len(unused) == 1 else "ies", first_few(unused))
    names = [train.coco.cats[c]["name"] for c in train.cat_ids]
    return DatasetSplits(train, val, {
        "num_classes": len(train.cat_ids), "cat_ids": train.cat_ids, "class_names": names, "classes": names,
        "val_ann_file": str(ann / f"instances_{val_split}.json"), "image_size": image_size,
        "train_images": len(train), "val_images": len(val),
    })
