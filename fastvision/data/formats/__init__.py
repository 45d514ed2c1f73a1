"""On-disk dataset formats. Importing this package registers every format's builders in
``fastvision.registry.DATASETS``; :class:`DatasetSplits` is what each builder returns."""
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

__all__ = ["DatasetSplits"]
