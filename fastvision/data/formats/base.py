"""What every dataset builder returns: :class:`DatasetSplits` (train, val, info)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from fastvision.errors import DataError


@dataclass
class DatasetSplits:
    """Train and validation datasets of dict items, plus facts worth logging (counts, classes)."""

    train: Dataset
    val: Dataset
    info: dict[str, Any] = field(default_factory=dict)


def dataset_folder(path: str | Path, kind: str = "dataset") -> Path:
    """A builder's ``path`` as a folder, else the one-line error naming it and the flag that sets it
    (``--data`` of train / profile / benchmark / evaluate sets ``data.args.path``)."""
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"{kind} folder not found: {root} (pass --data DIR)")
    return root
