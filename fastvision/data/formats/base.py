"""What every dataset builder returns: :class:`DatasetSplits` (train, val, info)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset


@dataclass
class DatasetSplits:
    """Train and validation datasets of dict items, plus facts worth logging (counts, classes)."""

    train: Dataset
    val: Dataset
    info: dict[str, Any] = field(default_factory=dict)
