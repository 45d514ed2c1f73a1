"""Medical Segmentation Decathlon layout (``dataset.json``, imagesTr/labelsTr/imagesTs) as a dataset.

Also holds what every 3-D volume format shares: deterministic k-fold splits, :class:`VolumeDataset`
(item = one preprocessed case, deterministic, so ``data.cache`` can hold it) and the training
crop :class:`~fastvision.data.formats.patches.RandPatch`, which runs after the cache with a per-item generator.

Items: ``{"image": float32 (C, X, Y, Z), "label": int64 (X, Y, Z), "id": str}`` where X, Y, Z are
the NIfTI voxel axes after reorientation to RAS (MONAI's order; see ``data/preprocess3d.py``).
Task01 BrainTumour channels are FLAIR, T1w, T1gd, T2w (the 4-D file's order). Its labels are
renumbered from the MSD ids (1 edema, 2 non-enhancing tumour, 3 enhancing tumour, as the
``labels`` of dataset.json name them) to the BraTS ids used everywhere in fastvision
(1 necrotic/non-enhancing core, 2 edema, 3 enhancing; see ``formats/brats.py``), so the same case
loads identically from either layout.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from fastvision.data import nnunet_resampling, spatial3d
from fastvision.data.formats.anomalies import check_channels, drop_unreadable, first_few, nifti_header
from fastvision.data.formats.base import DatasetSplits, dataset_folder
from fastvision.data.formats.dataset_labels import (  # noqa: F401 (MSD_BRAIN_LABELS, task01_label_map re-exported)
    MSD_BRAIN_LABELS,
    label_names,
    read_meta,
    task01_label_map,
)
from fastvision.data.formats.nnunetv2 import folder_hint, is_v2, read_raw
from fastvision.data.formats.patches import RandPatch, random_patch  # noqa: F401 (re-exported)
from fastvision.data.nonfinite import NonFinite
from fastvision.data.preprocess3d import PreprocessParams, check_label_values, preprocess_case
from fastvision.data.transforms import SAMPLES_KEY, SLOT_KEY, RandomTransform, Transform
from fastvision.errors import ConfigError, DataError
from fastvision.registry import DATASETS

log = logging.getLogger(__name__)

# Class names of the BraTS ids 0..3, as seed 000 names its per-label Dice.
BRATS_CLASS_NAMES = ["background", "tumor_core", "peritumoral_edema", "enhancing_tumor"]


def kfold_split(ids: Sequence[str], fold: int, num_folds: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """Deterministic k-fold split: sort, shuffle with ``seed``, cut into ``num_folds`` near-equal parts.

    Seed 000 splits the unsorted ``os.listdir`` order, which differs between file systems; sorting
    first makes fold k the same cases everywhere.

    Returns:
        (train ids, val ids) with val = part ``fold``; disjoint and together all of ``ids``.
    """
    if num_folds < 2:
        raise ConfigError(f"data.args.num_folds must be >= 2, got {num_folds}")
    if not 0 <= fold < num_folds:
        raise ConfigError(f"data.args.fold must be in [0, {num_folds}), got {fold}")
    if len(ids) < num_folds:
        fix = f"set data.args.num_folds to at most {len(ids)}" if len(ids) >= 2 else "it needs 2 cases or more"
        raise DataError(f"{len(ids)} cases cannot be split into {num_folds} folds (data.args.num_folds): {fix}")
    order = sorted(ids)
    perm = np.random.default_rng(seed).permutation(len(order))
    parts = np.array_split(perm, num_folds)
    val = set(parts[fold].tolist())
    return [order[i] for i in sorted(set(perm.tolist()) - val)], [order[i] for i in sorted(val)]


class VolumeDataset(Dataset):
    """3-D cases: item ``i`` is case ``i`` preprocessed (deterministic; no cache of its own).

    Training sets with ``patch_size`` expose :meth:`cache_pipeline`: the preprocessing is the
    cached prefix (``data.cache``: RAM, disk keyed by the files and the preprocessing signature,
    node-shared, smart or on the training device) and :class:`RandPatch` runs per access after
    the cache. ``__getitem__`` returns the whole preprocessed volume.

    Args:
        cases: ``[{"id": str, "image": [paths], "label": path or None}]``.
        params: preprocessing settings.
        patch_size: training patch shape (the random crop of :meth:`cache_pipeline`); None:
            whole volumes (validation, prediction).
        pos_fraction: share of patches centred on a foreground voxel.
        oversample, placement: which patches must hold foreground and where a patch is cut
            (:mod:`~fastvision.data.formats.patches`).
        num_samples: crops per cached volume per access (:class:`MultiPatch`; 1: one patch, the item
            as before).
        compute: ``compute(paths, params) -> dict``, :func:`preprocess_case` unless a test counts calls.
    """

    def __init__(self, cases: list[dict[str, Any]], params: PreprocessParams, *,
                 patch_size: Sequence[int] | None = None, pos_fraction: float = 0.5,
                 oversample: str = "random", placement: str = "monai", num_samples: int = 1,
                 compute: Callable[[dict[str, Any], PreprocessParams], dict[str, Any]] = preprocess_case,
                 num_classes: int | None = None):
        self.cases = cases
        self.params, self.compute = params, compute
        self.patch_size = tuple(patch_size) if patch_size else None
        self.pos_fraction = pos_fraction
        self.crop = RandPatch(self.patch_size, pos_fraction, oversample, placement) if self.patch_size else None
        if check_num_samples(num_samples) > 1 and self.crop is not None:
            self.crop = MultiPatch(self.crop, num_samples)
        # Cached labels are uint8 when a crop follows (an 8th of int64's bytes; the crop widens
        # only the patch), int64 when the volume itself is the item.
        self._prefix = [_Preprocess(params, compute, "uint8" if self.patch_size else "int64", num_classes)]

    def __len__(self) -> int:
        return len(self.cases)

    def identity(self, index: int) -> str:
        """Case ``index``'s files (path, size, mtime), the key of ``data.cache: disk`` entries."""
        return _CaseFiles(self.cases).identity(index)

    def cache_signature(self) -> str:
        return self._prefix[0].signature()

    def cache_pipeline(self) -> tuple[Dataset, list]:
        """``(case files, [preprocess, random patch])``: what the caches of ``data.cache`` run."""
        return _CaseFiles(self.cases), [*self._prefix, *([self.crop] if self.crop else [])]

    def meta(self, index: int) -> dict[str, Any]:
        """Geometry of case ``index`` for :func:`~fastvision.data.preprocess3d.restore_to_input`."""
        case = _CaseFiles(self.cases)[index]
        return self.compute({"image": case["image"], "label": case.get("label")}, self.params)["meta"]

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self._prefix[0](_CaseFiles(self.cases)[index])
        return {**item, "label": item["label"].long()}


def check_num_samples(k: Any) -> int:
    """``data.args.num_samples`` as an int >= 1, else a one-line :class:`ConfigError` naming the key."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"data.args.num_samples must be an integer >= 1, got {k!r}")
    return k


class MultiPatch(RandomTransform):
    """``k`` crops of one cached volume per access (MONAI ``RandCropByPosNegLabeld(num_samples=k)``):
    the volume is read once for ``k`` patches. The crops are drawn one after another from the item's
    own generator of ``(seed, epoch, index)``, so they are deterministic and a resumed run draws them
    again alike. The item holds them as ``SAMPLES_KEY``: a list of ``k`` patch items, which the
    segmentation task's ``collate`` flattens (a batch of ``B`` volumes is ``B * k`` patches, crop
    ``j`` of batch position ``p`` at row ``p * k + j``).

    Batch-tail oversampling (``oversample: batch_tail``) keeps its meaning in patches: crop ``j`` of
    the item at batch position ``p`` (batch of ``B`` volumes) gets position ``p * k + j`` of ``B * k``,
    so the last ``round(pos_fraction * B * k)`` patches of every batch hold foreground, as with ``B * k``
    volumes of one patch each.
    """

    def __init__(self, crop: RandPatch, k: int):
        self.crop, self.k = crop, check_num_samples(k)

    @property
    def batch_slot(self) -> bool:
        return bool(getattr(self.crop, "batch_slot", False))

    def __call__(self, item: dict[str, Any], generator: torch.Generator) -> dict[str, Any]:
        base = dict(item)
        slot = base.pop(SLOT_KEY, None)
        patches = []
        for j in range(self.k):
            one = dict(base)
            if slot is not None:
                one[SLOT_KEY] = (slot[0] * self.k + j, slot[1] * self.k)
            patches.append(self.crop(one, generator))
        return {SAMPLES_KEY: patches}


class _CaseFiles(Dataset):
    """Base dataset of the caches: item i is case i's file paths; identity names the files' state."""

    def __init__(self, cases: list[dict[str, Any]]):
        self.cases = cases

    def __len__(self) -> int:
        return len(self.cases)

    def __getitem__(self, i: int) -> dict[str, Any]:
        c = self.cases[i]
        return {"image": list(c["image"]), "label": c.get("label"), "id": c["id"]}

    def identity(self, i: int) -> str:
        c = self.cases[i]
        files = [*c["image"], *([c["label"]] if c.get("label") else [])]
        # Size and mtime catch a file replaced in place under the same name.
        return "|".join(f"{Path(p).resolve()}:{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}" for p in files)


class _Preprocess(Transform):
    """The cached step: case files -> ``{"image" (C, X, Y, Z) float32, "label" (X, Y, Z), "id"}``.

    Its signature covers the params, the label dtype and the source of ``compute``'s module and of
    :mod:`fastvision.data.spatial3d` (the resampling), so a change in either misses old entries.
    """

    def __init__(self, params: PreprocessParams, compute: Callable[[dict[str, Any], PreprocessParams], dict[str, Any]],
                 label_dtype: str = "int64", num_classes: int | None = None):
        self.params, self.compute, self.label_dtype = params, compute, label_dtype
        self.num_classes = num_classes  # a label value past the classes stops the case (not in the signature)
        # one NaN / Inf check per dataset, so that ``nonfinite: zero`` warns once per file
        takes = "finite" in inspect.signature(compute).parameters
        self._finite = {"finite": NonFinite(params.nonfinite)} if takes else {}

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        out = self.compute({"image": item["image"], "label": item.get("label")}, self.params, **self._finite)
        image = out["image"]
        label = out["label"] if "label" in out else torch.zeros(image.shape[1:], dtype=torch.long)
        if self.num_classes and "label" in out and label.numel():
            check_label_values(label, self.num_classes, item.get("label"))
        res = {"image": image, "label": label.to(getattr(torch, self.label_dtype)), "id": item["id"]}
        return res

    def signature(self) -> str:
        module = inspect.getmodule(self.compute)
        try:  # the geometry modules' source too: a change in resampling changes every cached array
            code = inspect.getsource(module) if module else ""
            code += inspect.getsource(spatial3d) + inspect.getsource(nnunet_resampling)
        except (OSError, TypeError):  # no source file: fall back to the function's bytecode
            code = self.compute.__code__.co_code.hex()
        return json.dumps({"params": self.params.key(), "compute": getattr(self.compute, "__qualname__", ""),
                           # "meta": entries once held the geometry too; the key keeps old entries valid
                           "label": self.label_dtype, "meta": False,
                           "code": hashlib.sha256(code.encode()).hexdigest()}, sort_keys=True)


def looks_like_brats(root: str | Path) -> bool:
    """``root`` holds raw BraTS case folders (FLAIR files of 2017-2021 or 2023-24 names, one or two levels
    down), not a Decathlon task."""
    root = Path(root)
    return root.is_dir() and any(next(root.glob(d + p), None) for p in ("*_flair.nii*", "*-t2f.nii*")
                                 for d in ("*/", "*/*/"))


def read_dataset_json(root: str | Path, missing: list[str] | None = None) -> dict[str, Any]:
    """Parse ``root/dataset.json`` and resolve its paths; nnU-Net v2's raw layout (no ``training`` list, one
    file per channel) is read by :func:`~fastvision.data.formats.nnunetv2.read_raw` into the same cases.

    A listed file that does not exist is an error naming it, or, with a ``missing`` list (``data
    inspect``: every problem listed), its path is appended there and its case left out.

    Accepts the archives as released: paths written ``./imagesTr/x.nii.gz`` or bare, ``test`` as a
    list of paths (or of ``{"image": path}``), macOS ``._x.nii.gz`` companions beside the volumes
    (never listed, so never read; reported under ``anomalies``).

    Returns:
        ``{"meta": dict, "training": [{"id", "image": [path], "label": path}], "test": [path],
        "anomalies": {kind: [names]}}``.
    """
    root = Path(root)
    f = root / "dataset.json"
    if not f.is_file():
        hint = "; this looks like a BraTS challenge folder: --set data.name=brats" if looks_like_brats(root) else ""
        hint = hint or folder_hint(root)  # nnUNet_raw (its Dataset folders inside) or an imagesTr
        raise DataError(f"{f} not found: a Decathlon folder holds dataset.json, imagesTr/, labelsTr/{hint}")
    try:
        meta = read_meta(f)  # UTF-8 JSON, or one line naming the file
        if is_v2(meta):  # nnU-Net v2's raw layout: the cases are the files
            return read_raw(root, meta, missing)
        training = [
            {"id": _case_id(e["image"]), "image": [root / e["image"]], "label": root / e["label"]}
            for e in meta["training"]
        ]
        test = [root / (e["image"] if isinstance(e, dict) else e) for e in meta.get("test", [])]
    except (KeyError, TypeError) as e:
        raise DataError(f"{f}: not a Decathlon dataset.json ({e})") from e
    absent = [(case, p) for case in training for p in case["image"] + [case["label"]] if not p.is_file()]
    if absent and missing is None:
        raise DataError(f"{f} lists {absent[0][1]}, which does not exist")
    if absent:
        missing.extend(str(p.relative_to(root)) for _, p in absent)
    gone = {id(case) for case, _ in absent}
    return {"meta": meta, "training": [c for c in training if id(c) not in gone],
            "test": [p for p in test if p.is_file()], "anomalies": _folder_anomalies(root, training, test)}


def _folder_anomalies(root: Path, training: list[dict[str, Any]], test: list[Path]) -> dict[str, list[str]]:
    """Files in imagesTr/labelsTr/imagesTs that dataset.json does not explain, and test entries missing."""
    listed = {p.resolve() for c in training for p in [*c["image"], c["label"]]} | {p.resolve() for p in test}
    out: dict[str, list[str]] = {"macOS ._ companion files (ignored)": [], "volumes not in dataset.json (ignored)": [],
                                 "test entries missing on disk": [str(p.relative_to(root)) for p in test
                                                                  if not p.is_file()]}
    for sub in ("imagesTr", "labelsTr", "imagesTs"):
        d = root / sub
        for p in sorted(d.iterdir()) if d.is_dir() else []:
            if p.name.startswith("._"):
                out["macOS ._ companion files (ignored)"].append(f"{sub}/{p.name}")
            elif p.name.endswith((".nii", ".nii.gz")) and p.resolve() not in listed:
                out["volumes not in dataset.json (ignored)"].append(f"{sub}/{p.name}")
    return {k: v for k, v in out.items() if v}


def auto_intensity(meta: dict[str, Any]) -> str:
    """``data.args.intensity: auto``: ``ct`` for a single CT channel, else ``mri``."""
    return "ct" if [m.upper() for m in modality_names(meta)] == ["CT"] else "mri"


def modality_names(meta: dict[str, Any]) -> list[str]:
    """dataset.json's channel names in channel order: MSD's ``modality`` or nnU-Net v2's ``channel_names``."""
    names = meta.get("modality") or meta.get("channel_names") or {}
    return [str(v) for _, v in sorted(names.items(), key=lambda kv: int(kv[0]))]


def _case_files(case: dict[str, Any]) -> list[Path]:
    return [*case["image"], case["label"]]


def _case_id(path: str) -> str:
    name = Path(path).name
    return name[: -len(".nii.gz")] if name.endswith(".nii.gz") else Path(name).stem


def build_splits(cases: list[dict[str, Any]], params: PreprocessParams, info: dict[str, Any], *, fold: int,
                 num_folds: int, split_seed: int, patch_size: Sequence[int] | None,
                 pos_fraction: float, oversample: str = "random", placement: str = "monai",
                 num_samples: int = 1) -> DatasetSplits:
    """Split ``cases`` by fold and wrap both parts in :class:`VolumeDataset` (caching is
    ``data.cache``'s job)."""
    train_ids, val_ids = kfold_split([c["id"] for c in cases], fold, num_folds, split_seed)
    by_id = {c["id"]: c for c in cases}
    classes = info.get("num_classes")
    train = VolumeDataset([by_id[i] for i in train_ids], params, patch_size=patch_size,
                          pos_fraction=pos_fraction, oversample=oversample, placement=placement,
                          num_samples=num_samples, num_classes=classes)
    val = VolumeDataset([by_id[i] for i in val_ids], params, num_classes=classes)
    info = {**info, "train_cases": len(train), "val_cases": len(val), "fold": fold, "num_folds": num_folds,
            "spatial_dims": 3, "axis_order": "C,X,Y,Z (RAS voxel axes)"}
    return DatasetSplits(train, val, info)


@DATASETS.register("decathlon")
def build_decathlon(*, path: str, fold: int = 0, num_folds: int = 5, split_seed: int = 0,
                    target_spacing: tuple[float, float, float] | None = None, intensity: str = "auto",
                    window: tuple[float, float, float, float] = (-57.0, 164.0, 0.0, 1.0),
                    crop_foreground: bool | str = True, crop_margin: int = 0,
                    patch_size: tuple[int, int, int] | None = None, pos_fraction: float = 0.5,
                    oversample: str = "random", placement: str = "monai", num_samples: int = 1,
                    skip_unreadable: bool = False, nonfinite: str = "error", resample: str = "monai") -> DatasetSplits:
    """Decathlon task folder -> train/val of fold ``fold`` (of ``num_folds``); the preprocessed volumes
    are cached by ``data.cache`` (ram, disk, shared, smart, gpu), not here.

    Args:
        path: folder with dataset.json (e.g. ``Task09_Spleen``).
        fold, num_folds, split_seed: cross-validation split (:func:`kfold_split`).
        target_spacing: resample to this voxel size in mm (spleen recipe: 1.5, 1.5, 2.0).
        intensity: "ct", "mri", "zscore", "none" or "auto" (ct when dataset.json's modality is CT).
        window: CT window a_min, a_max, b_min, b_max.
        crop_foreground, crop_margin: crop to the foreground box (``"nonzero"``: nnU-Net's crop to
            the non-zero region, see :class:`~fastvision.data.preprocess3d.PreprocessParams`).
        patch_size: training patch shape; None trains on whole volumes.
        pos_fraction: share of patches centred on foreground.
        oversample: ``random`` (each patch with probability ``pos_fraction``) or ``batch_tail``
            (nnU-Net: the last ``round(pos_fraction * B)`` of every batch, by the sampler's order).
        placement: ``monai`` (kept inside the volume), ``nnunet`` (``get_bbox``: a present class's voxel at
            the centre, may leave the volume) or ``uniform`` (MONAI's ``RandSpatialCrop``; no ``pos_fraction``).
        num_samples: patches cut from each cached volume per step (MONAI's; :class:`MultiPatch`).
        skip_unreadable: drop (one warning) cases whose NIfTI headers do not read, not stop naming the file.
        nonfinite: NaN or Inf in a volume: ``error`` stops with one line naming the file when it
            is read (the cache fill, or the item); ``zero`` reads them as 0, one warning per file.
        resample: ``monai`` or ``nnunet`` (nnU-Net's order and interpolation): :class:`PreprocessParams`.
    """
    check_num_samples(num_samples)  # before any file is read
    found = read_dataset_json(dataset_folder(path, "Decathlon dataset"))
    for kind, names in found["anomalies"].items():
        log.info("%s: %d %s, e.g. %s", path, len(names), kind, first_few(names))
    meta, source = found["meta"], Path(path) / "dataset.json"
    modalities = modality_names(meta)
    intensity = auto_intensity(meta) if intensity == "auto" else intensity
    names = label_names(meta, Path(path))  # MSD's {"1": "spleen"} or nnU-Net v2's {"spleen": 1}
    label_map = task01_label_map(meta)  # Task01: renumbered to BraTS ids
    class_names = [names[k] for k in sorted(names)]
    layout = found.get("layout", "msd")  # nnunetv2: its file_ending names predict's outputs too
    convention = {"layout": layout, "file_labels": ", ".join(f"{k} {v}" for k, v in sorted(names.items())),
                  "label_map": "none", **({"file_ending": meta["file_ending"]} if layout == "nnunetv2" else {})}
    if label_map:
        class_names = BRATS_CLASS_NAMES
        convention = {**convention, "layout": f"{layout}-task01", "label_map": {str(a): b for a, b in label_map}}
    training = drop_unreadable(found["training"], _case_files, nifti_header, skip_unreadable, source)
    check_channels(training, modalities, source)  # headers: a model for the wrong channel count stops here
    params = PreprocessParams(
        target_spacing=tuple(map(float, target_spacing)) if target_spacing else None, intensity=intensity,
        window=tuple(map(float, window)), crop_foreground=crop_foreground, crop_margin=crop_margin,
        label_map=label_map, nonfinite=NonFinite(nonfinite).policy, resample=resample)
    info = {"num_classes": len(class_names), "class_names": class_names, "in_channels": max(1, len(modalities)),
            "channels": modalities, "regions": ["wt", "tc", "et"] if label_map else None,
            "test_images": [str(p) for p in found["test"]], "preprocess": params.key(),
            "label_convention": convention}
    return build_splits(training, params, info, fold=fold, num_folds=num_folds, split_seed=split_seed,
                        patch_size=patch_size, pos_fraction=pos_fraction, oversample=oversample,
                        placement=placement, num_samples=num_samples)
