"""Raw BraTS layout (one folder per case with four modalities and a segmentation) as a dataset.

Layout: ``ROOT/**/<case>/<case>_{flair,t1,t1ce,t2,seg}.nii.gz`` (BraTS 2019 puts cases under
``HGG/`` and ``LGG/``; any nesting is accepted). Channels are stacked as FLAIR, T1, T1ce, T2, the
order of MSD Task01, so a model trained on one layout runs on the other.

Labels. BraTS files use 0 background, 1 necrotic and non-enhancing tumour core (NCR/NET),
2 peritumoral edema (ED), 4 GD-enhancing tumour (ET). On load 4 becomes 3, so classes are 0..3
(seed 000's remap); :func:`to_brats_labels` maps 3 back to 4 for files written in BraTS format.
The evaluated regions are nested: whole tumour WT = {1, 2, 3}, tumour core TC = {1, 3},
enhancing tumour ET = {3} (:func:`labels_to_regions`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...errors import DataError
from ...registry import DATASETS
from ..preprocess3d import PreprocessParams, remap_labels
from .base import DatasetSplits
from .decathlon import BRATS_CLASS_NAMES, build_splits

MODALITIES = ("flair", "t1", "t1ce", "t2")
REGION_NAMES = ("wt", "tc", "et")


def from_brats_labels(label: torch.Tensor) -> torch.Tensor:
    """BraTS file ids {0, 1, 2, 4} -> class indices {0, 1, 2, 3}."""
    return remap_labels(label, ((4, 3),))


def to_brats_labels(label: torch.Tensor) -> torch.Tensor:
    """Class indices {0, 1, 2, 3} -> BraTS file ids {0, 1, 2, 4}."""
    return remap_labels(label, ((3, 4),))


def labels_to_regions(label: torch.Tensor) -> torch.Tensor:
    """Nested BraTS regions from class indices.

    Args:
        label: (*S) integer tensor with ids 0..3 (after the 4 -> 3 remap).

    Returns:
        (3, *S) bool tensor: WT (1, 2, 3), TC (1, 3), ET (3), in that order.
    """
    return torch.stack([label > 0, (label == 1) | (label == 3), label == 3])


def regions_to_labels(regions: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`labels_to_regions` for predicted (possibly inconsistent) region masks.

    ET wins over TC, TC over WT, as the BraTS post-processing of MONAI and nnU-Net does.

    Args:
        regions: (3, *S) bool (WT, TC, ET).

    Returns:
        (*S) int64 class indices 0..3.
    """
    wt, tc, et = regions.bool()
    label = torch.zeros(wt.shape, dtype=torch.long, device=regions.device)
    label[wt] = 2
    label[tc] = 1
    label[et] = 3
    return label


def find_cases(root: str | Path) -> list[dict]:
    """All case folders under ``root`` as ``{"id", "image": [flair, t1, t1ce, t2], "label"}``."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"BraTS folder {root} does not exist")
    cases = []
    for flair in sorted(root.rglob("*_flair.nii*")):
        case, ext = flair.name.rsplit("_flair", 1)
        paths = [flair.parent / f"{case}_{m}{ext}" for m in MODALITIES]
        for p in paths:
            if not p.is_file():
                raise DataError(f"BraTS case {flair.parent} lacks {p.name}")
        seg = flair.parent / f"{case}_seg{ext}"
        cases.append({"id": case, "image": paths, "label": seg if seg.is_file() else None})
    if not cases:
        raise DataError(f"no BraTS cases (*_flair.nii.gz) under {root}")
    return cases


@DATASETS.register("brats")
def build_brats(*, path: str, fold: int = 0, num_folds: int = 5, split_seed: int = 0,
                target_spacing: tuple[float, float, float] | None = None, crop_foreground: bool = True,
                crop_margin: int = 0, patch_size: tuple[int, int, int] | None = None,
                pos_fraction: float = 0.5, workers: int = 4, cache_dir: str | None = "auto") -> DatasetSplits:
    """Raw BraTS folder -> train/val of fold ``fold``; MRI z-score on the foreground per channel.

    Args: as :func:`fastvision.data.formats.decathlon.build_decathlon` (no CT options).
    """
    cases = find_cases(path)
    unlabelled = [c["id"] for c in cases if c["label"] is None]
    if unlabelled:
        raise DataError(f"{path}: training cases need *_seg.nii.gz; missing for {', '.join(unlabelled[:3])}")
    params = PreprocessParams(
        target_spacing=tuple(map(float, target_spacing)) if target_spacing else None, intensity="mri",
        crop_foreground=crop_foreground, crop_margin=crop_margin, label_map=((4, 3),))
    info = {"num_classes": 4, "class_names": BRATS_CLASS_NAMES, "in_channels": 4, "channels": list(MODALITIES),
            "regions": list(REGION_NAMES), "preprocess": params.key()}
    return build_splits(cases, params, info, fold=fold, num_folds=num_folds, split_seed=split_seed,
                        patch_size=patch_size, pos_fraction=pos_fraction, workers=workers, cache_dir=cache_dir)
