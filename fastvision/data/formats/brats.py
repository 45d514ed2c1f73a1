"""Raw BraTS layout (one folder per case with four modalities and a segmentation) as a dataset.

Layout: ``ROOT/**/<case>/<case>_{flair,t1,t1ce,t2,seg}.nii.gz`` (2017-2021; BraTS 2019 puts cases
under ``HGG/`` and ``LGG/``; any nesting is accepted) or ``<case>-{t2f,t1n,t1c,t2w,seg}`` (2023-2024
GLI, labels already 0..3); :mod:`.brats_layouts` detects which. Channels are stacked as FLAIR, T1,
T1ce, T2, the order of MSD Task01, so a model trained on one layout runs on the other.

Labels. BraTS files use 0 background, 1 necrotic and non-enhancing tumour core (NCR/NET),
2 peritumoral edema (ED), 4 GD-enhancing tumour (ET). On load 4 becomes 3, so classes are 0..3
(seed 000's remap); :func:`to_brats_labels` maps 3 back to 4 for files written in BraTS format.
The evaluated regions are nested: whole tumour WT = {1, 2, 3}, tumour core TC = {1, 3},
enhancing tumour ET = {3} (:data:`BRATS_REGIONS`, the recipes' ``task.args.regions``; masks and
back through :mod:`fastvision.ops.regions`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from fastvision.data.formats.anomalies import case_grid_problems, drop_unreadable, nifti_header
from fastvision.data.formats.base import DatasetSplits, dataset_folder
from fastvision.data.formats.brats_layouts import detect
from fastvision.data.formats.decathlon import BRATS_CLASS_NAMES, build_splits
from fastvision.data.nonfinite import NonFinite
from fastvision.data.preprocess3d import PreprocessParams, remap_labels
from fastvision.errors import DataError
from fastvision.registry import DATASETS

MODALITIES = ("flair", "t1", "t1ce", "t2")
REGION_NAMES = ("wt", "tc", "et")
BRATS_REGIONS = ((1, 2, 3), (1, 3), (3,))  # class ids of WT, TC, ET (after the 4 -> 3 remap)


def from_brats_labels(label: torch.Tensor) -> torch.Tensor:
    """BraTS file ids {0, 1, 2, 4} -> class indices {0, 1, 2, 3}."""
    return remap_labels(label, ((4, 3),))


def to_brats_labels(label: torch.Tensor) -> torch.Tensor:
    """Class indices {0, 1, 2, 3} -> BraTS file ids {0, 1, 2, 4}."""
    return remap_labels(label, ((3, 4),))


def find_cases(root: str | Path) -> list[dict]:
    """All case folders under ``root`` as ``{"id", "image": [flair, t1, t1ce, t2], "label"}``.

    Every release from 2017 to 2024 is recognised (see :mod:`.brats_layouts`).
    """
    return detect(root).cases


@DATASETS.register("brats")
def build_brats(*, path: str, fold: int = 0, num_folds: int = 5, split_seed: int = 0,
                target_spacing: tuple[float, float, float] | None = None, crop_foreground: bool | str = True,
                crop_margin: int = 0, patch_size: tuple[int, int, int] | None = None,
                pos_fraction: float = 0.5, placement: str = "monai", skip_unreadable: bool = False,
                nonfinite: str = "error", resample: str = "monai") -> DatasetSplits:
    """Raw BraTS folder (any release 2017-2024) -> train/val of fold ``fold``; MRI z-score on the
    foreground per channel. The release's label convention is recorded in ``info``.

    Args: as :func:`fastvision.data.formats.decathlon.build_decathlon` (no CT options; ``placement``,
    ``nonfinite`` and ``resample`` included).
    """
    layout = detect(dataset_folder(path, "BraTS"))
    cases = layout.cases
    unlabelled = [c["id"] for c in cases if c["label"] is None]
    if unlabelled:
        raise DataError(f"{path}: training cases need a segmentation (*_seg.nii.gz); missing for "
                        f"{len(unlabelled)} case(s): {', '.join(unlabelled[:3])}")
    cases = drop_unreadable(cases, lambda c: [*c["image"], c["label"]], nifti_header, skip_unreadable, path)
    bad = case_grid_problems(cases, len(MODALITIES))  # headers: before the run folder and any case is read
    if bad:
        raise DataError(bad[0] + (f" ({len(bad) - 1} more case(s) alike: `fastvision data inspect {path}` "
                                  "lists them)" if len(bad) > 1 else ""))
    params = PreprocessParams(
        target_spacing=tuple(map(float, target_spacing)) if target_spacing else None, intensity="mri",
        crop_foreground=crop_foreground, crop_margin=crop_margin, label_map=layout.label_map,
        nonfinite=NonFinite(nonfinite).policy, resample=resample)
    info = {"num_classes": 4, "class_names": BRATS_CLASS_NAMES, "in_channels": 4, "channels": list(MODALITIES),
            "regions": list(REGION_NAMES), "preprocess": params.key(), "label_convention": layout.convention()}
    return build_splits(cases, params, info, fold=fold, num_folds=num_folds, split_seed=split_seed,
                        patch_size=patch_size, pos_fraction=pos_fraction, placement=placement)
