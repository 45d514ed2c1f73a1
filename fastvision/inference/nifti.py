"""NIfTI prediction: cases from files, the recipe's preprocessing, regions to labels, writers."""
from __future__ import annotations

import gzip
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fastvision.inference import postprocess
from fastvision.inference.volumes import (
    Ensemble,
    check_cases,
    check_not_inputs,
    input_channels,
    output_name,
    run_pipeline,
    shard,
)
from fastvision.utils.files import atomic_write

Predictor = Callable[[Tensor], Tensor]


def write_nifti(array: np.ndarray | Tensor, reference_nifti_path: str | Path, out_path: str | Path) -> Path:
    """Write ``array`` with the affine, header fields and orientation codes of a reference file.

    Args:
        array: (X, Y, Z[, ...]) data already on the reference's voxel grid (see
            :func:`fastvision.data.preprocess3d.restore_to_input`); its dtype is kept.
        reference_nifti_path: the input image the prediction belongs to.
        out_path: output ``.nii.gz`` path (parent folders are created); written atomically (temp
            file, fsync, rename), gzip without a time stamp, so equal data gives equal bytes.

    Returns:
        ``out_path``.
    """
    import nibabel as nib

    from fastvision.errors import DataError

    data = array.detach().cpu().numpy() if isinstance(array, Tensor) else np.asarray(array)
    ref = nib.load(str(reference_nifti_path))
    if data.shape[:3] != ref.shape[:3]:
        raise DataError(f"prediction grid {data.shape[:3]} differs from {reference_nifti_path} {ref.shape[:3]}")
    header = ref.header.copy()
    header.set_data_dtype(data.dtype)
    img = nib.Nifti1Image(data, ref.affine, header=header)
    img.header.set_slope_inter(1.0, 0.0)  # labels must not inherit the image's intensity scaling
    img.header["cal_min"] = img.header["cal_max"] = 0  # nor its display range (0: unset; FSLeyes reads it)
    img.set_qform(ref.header.get_qform(), code=int(ref.header["qform_code"]))
    img.set_sform(ref.header.get_sform(), code=int(ref.header["sform_code"]))
    out_path = Path(out_path)
    raw = img.to_bytes()
    if out_path.name.endswith(".gz"):
        # no time stamp or file name in the gzip header: the same prediction is the same bytes,
        # whichever process wrote it and under whichever temp name
        raw = gzip.compress(raw, compresslevel=1, mtime=0)
    atomic_write(out_path, lambda f: f.write(raw))  # a killed writer never leaves a partial case
    return out_path


def labels_on_input(probs: Tensor, meta: dict, to_labels: Callable[[Tensor], Tensor], softmax: bool,
                    logits: bool = False) -> np.ndarray:
    """Class indices on the input file's grid from (K, *S) probabilities on the preprocessed grid.

    The probabilities are resampled, linearly, and the labels are taken on the input grid, as nnU-Net's
    export does with its logits. Resampling the labels by nearest neighbour would cut a boundary to the
    coarser of the two grids: on generated CT at 1.2-1.8 mm against a 1.47 mm plan, that cost 0.02 of
    the original-space Dice (benchmarks/RESULTS.md, "Dice where nnU-Net measures it").
    ``softmax``: argmax, one class at a time (two input-sized volumes live at once, whatever the number of
    classes; outside the crop the background's probability is 1). Otherwise (sigmoid, regions) all channels
    are resampled and ``to_labels`` (:meth:`~fastvision.inference.volumes.Ensemble.labels`) reads them.

    Args:
        probs: (K, *S) probabilities on the preprocessed (RAS, resampled, cropped) grid.
        meta: the case's preprocessing ``meta``.
        to_labels: (K, *S) probabilities -> (*S) class indices (sigmoid and region tasks).
        softmax: the task's mode is softmax.
        logits: resample logits, not probabilities (nnU-Net's export; ``sliding_window.style: nnunet``):
            ``log p`` for softmax (a logit up to a per-voxel constant, which the argmax ignores, so this
            equals resampling the blended logits), ``log(p / (1 - p))`` for sigmoid, mapped back after;
            with ``resample: nnunet`` by nnU-Net's resampling (nearest along an anisotropic case's coarse axis).

    Returns:
        (X, Y, Z) uint8 class indices in the input file's voxel order.
    """
    from fastvision.data.preprocess3d import restore_to_input

    probs = probs.float().cpu()
    tiny = torch.finfo(torch.float32).tiny
    floor = float(np.log(tiny))  # the logit of the smallest probability: finite, so a linear blend stays a number
    if not softmax:
        if logits:  # outside the crop: probability 0
            z = torch.logit(probs.clamp(tiny, 1 - 2 ** -24))
            back = torch.sigmoid(torch.from_numpy(np.moveaxis(restore_to_input(z, meta, "linear", floor, nnunet=True),
                                                              -1, 0)))
        else:
            back = torch.from_numpy(np.moveaxis(restore_to_input(probs, meta, mode="linear"), -1, 0))
        return to_labels(back).numpy().astype(np.uint8)
    fills = (1.0, 0.0)  # outside the crop the background's probability is 1
    if logits:
        probs, fills = probs.clamp_min(tiny).log(), (0.0, floor)
    best = label = None
    for k in range(probs.shape[0]):
        p = restore_to_input(probs[k], meta, mode="linear", fill=fills[0] if k == 0 else fills[1], nnunet=logits)
        if best is None:
            best, label = p, np.zeros(p.shape, np.uint8)
            continue
        higher = p > best  # a tie keeps the lower class, as argmax
        np.copyto(best, p, where=higher)
        label[higher] = k
    return label


def save_segmentation(label: np.ndarray, reference_nifti_path: str | Path, out_path: str | Path,
                      ids: dict[int, int] | None = None) -> Path:
    """Write a label map on the input file's grid (:func:`labels_on_input`) as uint8 NIfTI.

    Args:
        label: (X, Y, Z) integer class indices in the input file's voxel order.
        reference_nifti_path: the case's (first) input image.
        out_path: output path.
        ids: class index -> the value written, all at once (the training files' label ids:
            :func:`prediction_preprocessing`); None writes the class indices.
    """
    from fastvision.data.preprocess3d import remap_labels

    label = remap_labels(torch.from_numpy(np.asarray(label).astype(np.uint8)), tuple((ids or {}).items()))
    return write_nifti(label.numpy(), reference_nifti_path, out_path)


# ----------------------------------------------------------------------------- NIfTI prediction
def prediction_cases(files: Sequence[str | Path], channel_files: str | None = None,
                     channels: int | None = None) -> list[dict]:
    """Group prediction inputs into cases ``{"id": str, "image": [paths]}``.

    A NIfTI file is one case (a 4-D file carries its channels). A folder holds raw BraTS cases
    (``<case>_{flair,t1,t1ce,t2}.nii.gz`` or 2023-2024's ``<case>-{t2f,t1n,t1c,t2w}.nii.gz``, any nesting).
    Loose files named like BraTS modalities (what a case folder expands to) are grouped into their case
    in FLAIR, T1, T1ce, T2 order; ``seg`` files are skipped. ``channel_files``: an nnU-Net v2 run's
    ``file_ending``: files named ``<case>_XXXX.nii[.gz]`` are that case's channels in XXXX order (as
    ``nnUNetv2_predict`` reads ``imagesTs``), its prediction ``<case><file_ending>`` (``out_name``). Any other
    run of a model of ``channels`` > 1 (an MSD Task01 run given the v2 copy's ``imagesTs``) groups them too
    where a case's files start at ``_0000`` and are more than one (else each file is a case, as before),
    writing ``<case>.nii.gz``.
    """
    if channel_files or (channels or 1) > 1:
        files, cases = _group_channel_files(list(map(Path, files)), channel_files)
        return cases + (prediction_cases(files) if files else [])
    from fastvision.data.formats.brats import find_cases
    from fastvision.data.formats.brats_layouts import case_files
    from fastvision.errors import DataError

    cases, grouped = [], set()
    for f in map(Path, files):
        if f.is_dir():
            cases += [{"id": c["id"], "image": c["image"]} for c in find_cases(f)]
            continue
        if not f.name.endswith((".nii", ".nii.gz")):
            raise DataError(f"{f}: expected a NIfTI file (.nii / .nii.gz) or a BraTS case folder")
        found = case_files(f)  # a BraTS case's file (2017-2021 or 2023-2024 names): the case, once
        if found and all(p.is_file() for p in found[1]):
            if (f.parent, found[0]) not in grouped:
                grouped.add((f.parent, found[0]))
                cases.append({"id": found[0], "image": found[1]})
            continue
        name = f.name
        cases.append({"id": name[: -len(".nii.gz")] if name.endswith(".nii.gz") else f.stem, "image": [f]})
    return cases


def _group_channel_files(files: list[Path], ending: str | None) -> tuple[list[Path], list[dict]]:
    """``(the other inputs, cases of the <case>_XXXX files)``; a case lacking a channel below its highest is a
    DataError naming the missing file (check_cases then compares the count with the model's). ``ending`` None
    (not a v2 run): only files from ``_0000`` on, more than one, are grouped; the others stay single cases."""
    from fastvision.data.formats.nnunetv2 import ENDINGS, channel_of
    from fastvision.errors import DataError

    groups: dict[tuple[Path, str], dict[int, Path]] = {}
    rest = []
    for f in files:
        named = None if f.is_dir() else next(filter(None, (channel_of(f.name, e) for e in ENDINGS)), None)
        if named is None:
            rest.append(f)
            continue
        groups.setdefault((f.parent, named[0]), {})[named[1]] = f
    cases = []
    for (folder, case), channels in groups.items():
        if ending is None and (0 not in channels or len(channels) < 2):
            rest += channels.values()
            continue
        for c in range(max(channels)):
            if c not in channels:
                shown = ending or channels[0].name[len(case) + 5:]
                raise DataError(f"{folder / f'{case}_{c:04d}{shown}'}: not among the inputs (channel {c} of case "
                                f"{case}; nnU-Net v2's layout: <case>_XXXX{shown}, one file per channel)")
        named = {"out_name": f"{case}{ending}"} if ending else {}
        cases.append({"id": case, "image": [channels[c] for c in sorted(channels)], **named})
    return rest, cases


def _brats_release_uses_4(data_args: dict) -> bool:
    """Predictions go out in the training release's ids: 2017-2021 write enhancing tumour as 4,
    2023-2024 GLI as 3. Decided from the training folder when it is still there (else 4)."""
    from fastvision.data.formats.brats_layouts import detect
    from fastvision.errors import DataError

    path = data_args.get("path")
    try:
        return detect(path).name != "brats2023-gli" if path else True
    except DataError:
        return True


_TASK01 = {"labels": {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"}}


def prediction_preprocessing(task, data_name: str, data_args: dict) -> tuple[Any, dict[int, int] | None]:
    """The run's preprocessing (from ``cfg.data.args``) and the label ids its outputs are written in:
    the training files' own. Raw BraTS: the release's (enhancing tumour 4 in 2017-2021, 3 in 2023-2024
    GLI); Decathlon Task01: its MSD ids (1 edema, 2 non-enhancing, 3 enhancing, as its dataset.json names
    them), which loading renumbered to fastvision's BraTS classes (1 core, 2 edema, 3 enhancing).

    Decathlon runs read the run's ``dataset.json`` (if still at ``data.args.path``) to resolve
    ``intensity: auto`` and to recognise Task01; without it, ``intensity`` must be set and a
    4-channel, 4-class task counts as Task01 with MSD's standard ids.

    Returns:
        (:class:`~fastvision.data.preprocess3d.PreprocessParams`, ``{class: value written}`` or None
        for the class indices themselves).
    """
    from fastvision.data.formats.decathlon import auto_intensity, read_meta, task01_label_map
    from fastvision.data.preprocess3d import PreprocessParams
    from fastvision.errors import ConfigError

    if data_name not in ("decathlon", "brats"):
        raise ConfigError(f"NIfTI prediction needs a decathlon or brats run, this one used data.name={data_name!r}")
    spacing = data_args.get("target_spacing")
    common = {"target_spacing": tuple(map(float, spacing)) if spacing else None,
              "crop_foreground": _crop_mode(data_args.get("crop_foreground", True)),
              "crop_margin": int(data_args.get("crop_margin", 0)),
              "nonfinite": str(data_args.get("nonfinite", "error")),  # a NaN input: the run's policy
              "resample": str(data_args.get("resample", "monai"))}
    if data_name == "brats":
        return PreprocessParams(intensity="mri", **common), ({3: 4} if _brats_release_uses_4(data_args) else None)
    meta_file = Path(str(data_args.get("path", ""))) / "dataset.json"
    meta = read_meta(meta_file) if data_args.get("path") and meta_file.is_file() else None
    intensity = data_args.get("intensity", "auto")
    if intensity == "auto":
        if meta is None:
            raise ConfigError(f"data.args.intensity=auto needs {meta_file} to tell CT from MRI; it is gone")
        intensity = auto_intensity(meta)  # as training read it (MSD's modality or nnU-Net v2's channel_names)
    if meta is None and getattr(task, "num_classes", 0) == 4 and tuple(getattr(task, "sample_shape", ()))[:1] == (4,):
        meta = _TASK01  # dataset.json gone: MSD Task01's standard ids
    # Task01: loading renumbered its ids to BraTS classes; written back in its own
    ids = {cls: file_id for file_id, cls in task01_label_map(meta or {})} or None
    window = tuple(map(float, data_args.get("window", (-57.0, 164.0, 0.0, 1.0))))
    return PreprocessParams(intensity=intensity, window=window, **common), ids


def predict_cases(ensemble, cfg, cases: Sequence[dict], out: Path, *, steps: Sequence[Sequence[int]] = (),
                  force: bool = False, rank: int = 0, world: int = 1, overlap: bool = True) -> tuple[list[Path], int]:
    """Predict this rank's share of ``cases`` into ``out/<case>.nii.gz`` (input geometry, atomic),
    through :func:`~fastvision.inference.volumes.run_pipeline` (reading and writing beside the network).

    Args:
        ensemble: a :class:`~fastvision.inference.volumes.Ensemble` (the model(s), mirroring).
        cfg: the run's config (its ``data`` section is the preprocessing).
        cases: :func:`prediction_cases` of the inputs, all of them (every rank passes the same list).
        out: an output folder ready for writing (:func:`~fastvision.inference.volumes.prepare_output`).
        steps: largest-component postprocessing steps (label sets), applied on the input grid (as
            nnU-Net's), where cross-validation decided them.
        force: predict cases whose output exists too.
        rank, world: this process's share (:func:`~fastvision.inference.volumes.shard`).
        overlap: read and write beside the network (False: one step after another, a baseline).

    Returns:
        (written paths, count of this rank's cases skipped because written already).
    """
    from fastvision.data.preprocess3d import preprocess_case

    params, ids = prediction_preprocessing(ensemble.task, cfg.data.name, cfg.data.args)
    mine = shard(cases, rank, world)
    todo = [c for c in mine if force or not (out / output_name(c)).is_file()]
    written: list[Path] = []

    def prepare(case: dict) -> dict:
        return preprocess_case({"image": case["image"], "label": None}, params)

    softmax = ensemble.task.mode == "softmax"

    def infer(pre: dict) -> Tensor:
        return ensemble.probabilities(pre["image"]).float().cpu()

    def export(case: dict, pre: dict, probs: Tensor) -> None:
        label = postprocess.apply(labels_on_input(probs, pre["meta"], ensemble.labels, softmax,
                                                  logits=ensemble.nnunet), steps)
        written.append(save_segmentation(label, case["image"][0], out / output_name(case), ids=ids))

    run_pipeline(todo, prepare, infer, export, overlap=overlap)
    for c in mine:  # temp files that a killed earlier writer of this rank's cases left behind
        for tmp in out.glob(f".{output_name(c)}.*.tmp"):
            tmp.unlink(missing_ok=True)
    return written, len(mine) - len(todo)


@torch.no_grad()
def predict_nifti_files(task, model: torch.nn.Module, files: Sequence[Path], out_dir: Path, cfg,
                        device: torch.device) -> list[Path]:
    """Segment NIfTI volumes (or raw BraTS case folders) with one model: ``OUT/<case>.nii.gz`` per case.

    Each case is preprocessed as the run's dataset did (``cfg.data.args``), predicted with the
    task's ``sliding_window`` settings (softmax / sigmoid of the blended logits; the recipe's
    ``tta_flips`` if it sets them), turned into class indices (argmax, or regions -> labels for
    sigmoid regions), returned to the input's voxel grid and written with the input's affine and
    header; labels in the training files' ids (raw BraTS: its release's, 3 -> 4 for 2017-2021; Task01:
    MSD's). The model runs under the caller's autocast: :func:`fastvision.api.predict` enters the run's
    ``runtime.Precision``, the one amp -> dtype rule that training and ``evaluate`` use. Existing outputs
    are replaced.
    ``fastvision predict`` runs the same :func:`predict_cases` with folds, mirroring,
    postprocessing and shards.

    Args:
        task: a :class:`~fastvision.tasks.segment.SegmentationTask`.
        model: the trained model (put in eval mode here).
        files: NIfTI files and/or BraTS case folders (:func:`prediction_cases`).
        out_dir: output folder (created).
        cfg: the run's config (``data.name``, ``data.args``).
        device: where the model runs.

    Returns:
        Written segmentation paths, one per case, in case-id order.
    """
    cases = prediction_cases(files, getattr(task, "channel_files", None), input_channels(model))
    check_cases(cases, input_channels(model))
    check_not_inputs(cases, Path(out_dir))  # existing outputs are replaced: never an input
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written, _ = predict_cases(Ensemble(task, model, [], device), cfg, cases, out, force=True)
    return written


def _crop_mode(value: Any) -> bool | str:
    """The recipe's ``data.args.crop_foreground`` as training read it: ``"nonzero"`` or a bool."""
    return "nonzero" if value == "nonzero" else bool(value)
