"""On-disk dataset formats. Importing this package registers every format's builders in
``fastvision.registry.DATASETS``; :class:`DatasetSplits` is what each builder returns. The
imagefolder and coco builders also read a shard set (or DLE TFRecords) given as their path
(:mod:`.shard_sets`)."""
from __future__ import annotations

from fastvision.data.formats import (  # noqa: F401  (each registers its builders)
    brats,
    coco,
    decathlon,
    imagefolder,
    microscopy,
    pathology,
)
from fastvision.data.formats.base import DatasetSplits
from fastvision.data.formats.shard_sets import recognise
from fastvision.registry import DATASETS

for _name in ("imagefolder", "coco"):  # --data OUT of a shard set: these builders read its shards
    recognise(DATASETS, _name)

__all__ = ["DatasetSplits"]
