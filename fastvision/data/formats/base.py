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
    if root.is_file():  # e.g. a COCO annotation file or an image given for its folder
        raise DataError(f"{kind}: {root} is a file; --data takes the {kind} folder"
                        + (f" ({root.parent}?)" if root.parent != Path(".") else ""))
    if not root.is_dir():
        raise DataError(f"{kind} folder not found: {root} (pass --data DIR{_sample_hint(root)})")
    return root


def _sample_hint(root: Path) -> str:
    """``data/synth-KIND``, the shipped CPU recipes' default path: the command that makes it (no
    sample ships with the package), else nothing."""
    if root.is_absolute() or root.parent != Path("data") or not root.name.startswith("synth-"):
        return ""
    from fastvision.data.synth import load_all

    kind = root.name.removeprefix("synth-")
    return f", or make the recipe's sample: fastvision data synth {kind} {root}" if kind in load_all() else ""
