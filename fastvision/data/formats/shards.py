"""Training and validation sets read from shards, item for item as from the source folder.

The items come from the source format's own code: :class:`ShardImageFolder` decodes a sample's
bytes with ImageFolder's ``load_crop`` and augments with its :class:`RandomResizedCrop`;
:class:`ShardCoco` builds COCO's full-size item and augments with :class:`SSDAugment`. Caches and
augmentation therefore behave as from files; only where the bytes come from differs. Each
training set offers ``epoch_order(generator)``, the shard-aware order the training sampler uses
(:func:`fastvision.data.shards.reader.shard_order`).
"""
from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from fastvision.data.formats.coco import SSDAugment, _Decode, resize_to_square
from fastvision.data.formats.imagefolder import RandomResizedCrop, load_crop, open_image
from fastvision.data.shards.reader import ShardReader, encoded, shard_order
from fastvision.data.transforms import Transform
from fastvision.errors import DataError


class _ShardSet(Dataset):
    """What both shard datasets share: length, identity, the shard-aware order, open-file counts."""

    def __init__(self, reader: ShardReader, window: int):
        self.reader, self.window = reader, window

    def __len__(self) -> int:
        return len(self.reader)

    def identity(self, i: int) -> str:
        return self.reader.identity(i)

    def epoch_order(self, generator: torch.Generator) -> list[int]:
        """The epoch's sample order from the sampler's (seed, epoch) generator (see :func:`shard_order`)."""
        return shard_order(self.reader.counts(), self.window, generator)


class _ReadSample(Transform):
    """The cacheable step of a shard training item: the encoded file's bytes and its label."""

    def __init__(self, reader: ShardReader):
        self.reader = reader

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        name, members = self.reader.sample(item["index"])
        data, label, ident = _image_sample(name, members)
        return {"data": torch.frombuffer(bytearray(data), dtype=torch.uint8), "label": label, "id": ident}

    def signature(self) -> str:
        return "fastvision.shards.read_sample/v1"  # identity() names the shard's checksum


def _image_sample(name: str, members: dict[str, bytes]) -> tuple[bytes, int, str]:
    try:
        label = int(members["cls"])
    except (KeyError, ValueError) as e:
        raise DataError(f"{name}: no class label member (.cls)") from e
    ident = members["id"].decode("utf-8", "replace") if "id" in members else name
    return encoded(members, name), label, ident


class ShardImageFolder(_ShardSet):
    """ImageFolder items from shards (arguments as :class:`~fastvision.data.formats.imagefolder.ImageFolderDataset`)."""

    def __init__(self, reader: ShardReader, train: bool, window: int = 2, image_size: int = 224,
                 resize_size: int = 256, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), hflip: float = 0.5):
        super().__init__(reader, window)
        self.train, self.image_size, self.resize_size = train, image_size, resize_size
        self.scale, self.ratio, self.hflip = tuple(scale), tuple(ratio), hflip

    def cache_pipeline(self) -> tuple[Dataset, list]:
        """``(indices, [read sample bytes, RandomResizedCrop])``: caches hold encoded files, as from a folder."""
        from fastvision.data.cache.select import _Indices

        return _Indices(len(self), self.identity), [_ReadSample(self.reader),
                                                    RandomResizedCrop(self.image_size, self.scale, self.ratio,
                                                                      self.hflip)]

    def __getitem__(self, i: int) -> dict:
        data, label, ident = _image_sample(*self.reader.sample(i))
        try:
            arr = load_crop(data, False, self.image_size, self.resize_size, self.scale, self.ratio, self.hflip,
                            name=ident)
        except (UnidentifiedImageError, OSError) as e:  # truncated data surfaces at resize time
            raise DataError(f"{ident}: cannot decode image ({e})") from e
        return {"image": torch.from_numpy(arr).permute(2, 0, 1).contiguous(),
                "label": torch.tensor(label, dtype=torch.int64), "id": ident}


class ShardCoco(_ShardSet):
    """COCO detection items from shards (arguments as :class:`~fastvision.data.formats.coco.CocoDetection`).

    Args:
        cat_ids: category ids in class order (the index's, from the training annotations).
    """

    def __init__(self, reader: ShardReader, cat_ids: list[int], train: bool, window: int = 2,
                 image_size: int = 320, crop: bool = True, flip: bool = True, jitter: float = 0.0):
        super().__init__(reader, window)
        self.cat_ids, self.class_of = list(cat_ids), {c: k for k, c in enumerate(cat_ids)}
        self.train, self.image_size, self.crop, self.flip, self.jitter = train, image_size, crop, flip, jitter

    def _sample(self, i: int) -> tuple[Image.Image, dict, str]:
        name, members = self.reader.sample(i)
        try:
            doc = json.loads(members["json"])
            data = encoded(members, name)
        except (KeyError, ValueError) as e:
            raise DataError(f"{name}: no annotation member (.json) or not JSON ({e})") from e
        try:  # as the folder reader (16-bit grey scaled, not clipped at 255)
            img = open_image(io.BytesIO(data))
        except DataError as e:
            raise DataError(f"{name}: cannot decode image ({e.__cause__})") from e
        return img, doc, name

    def _targets(self, doc: dict, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        anns = doc["annotations"]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        try:
            labels = torch.tensor([self.class_of[a["category_id"]] for a in anns], dtype=torch.int64)
        except KeyError as e:
            raise DataError(f"{name}: category id {e} is not in the training categories") from e
        crowd = torch.tensor([bool(a.get("iscrowd", 0)) for a in anns], dtype=torch.bool)
        return boxes, labels, crowd

    def _item(self, doc: dict, image: torch.Tensor, targets: tuple, h: int, w: int) -> dict[str, Any]:
        boxes, labels, crowd = targets
        return {"image": image, "boxes": boxes, "labels": labels, "iscrowd": crowd,
                "image_id": int(doc["image"]["id"]), "orig_size": (h, w)}

    def decode(self, i: int) -> dict[str, Any]:
        """Sample ``i`` at full size (uint8 (3, h, w)) with original-pixel targets (COCO's cacheable step)."""
        img, doc, name = self._sample(i)
        w, h = img.size
        image = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).contiguous()
        return self._item(doc, image, self._targets(doc, name), h, w)

    def cache_pipeline(self) -> tuple[Dataset, list]:
        from fastvision.data.cache.select import _Indices

        aug = SSDAugment(self.image_size, self.crop and self.train, self.flip and self.train,
                         self.jitter if self.train else 0.0)
        return _Indices(len(self), self.identity), [_Decode(self), aug]  # _Decode calls self.decode

    def __getitem__(self, i: int) -> dict[str, Any]:
        img, doc, name = self._sample(i)
        w, h = img.size
        boxes, labels, crowd = self._targets(doc, name)
        image, boxes = resize_to_square(img, (0, 0, w, h), self.image_size, boxes)
        return self._item(doc, image, (boxes, labels, crowd), h, w)
