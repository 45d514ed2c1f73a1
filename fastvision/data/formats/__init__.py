"""On-disk dataset formats. Importing this package registers every format's builders in
``fastvision.registry.DATASETS``; :class:`DatasetSplits` is what each builder returns."""
from __future__ import annotations

from . import brats, coco, decathlon, imagefolder, microscopy, pathology  # noqa: F401  (each registers its builders)
from .base import DatasetSplits

__all__ = ["DatasetSplits"]
