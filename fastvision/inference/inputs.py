"""The files ``fastvision predict`` reads from an input folder, and the one-line error for a folder
that holds none (it used to print "wrote 0 files" and exit 0)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastvision.data.formats.imagefolder import EXTENSIONS
from fastvision.errors import DataError

# what predict reads: NIfTI volumes and BraTS-style case folders (3-D segmentation), and the image
# files the image-folder reader takes (2-D segmentation's PNG / TIFF, classification, detection)
SUFFIXES = (".nii.gz", ".nii", *EXTENSIONS)


def folder_inputs(folder: Path) -> list[Path]:
    """The entries of ``folder`` in name order, hidden ones (macOS ``._name`` companions) left out.

    Raises:
        DataError: the folder holds no image file (:data:`SUFFIXES`) and no case folder.
    """
    entries = sorted(q for q in folder.iterdir() if not q.name.startswith("."))
    if not any(q.is_dir() or q.name.lower().endswith(SUFFIXES) for q in entries):
        looked = ", ".join(f"*{s}" for s in SUFFIXES)
        raise DataError(f"{folder}: no images to predict (looked for {looked} files or case folders; "
                        f"found {len(entries)} other entries)")
    return entries


def image_tree(folder: Path) -> list[Path]:
    """Every image file (:data:`EXTENSIONS`) under ``folder``, sub-folders included (a validation split
    of class folders, as torchvision's and timm's folder readers take it), in path order; hidden
    files and folders (macOS ``._name``, ``.ipynb_checkpoints``) left out.

    Raises:
        DataError: the tree holds no image file.
    """
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in EXTENSIONS and p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if not files:
        raise DataError(f"{folder}: no images to predict, sub-folders included (looked for "
                        f"{', '.join('*' + e for e in EXTENSIONS)})")
    return files


# the data formats whose runs predict NIfTI volumes and case folders (inference.nifti's preprocessing); every
# other run predicts image files
VOLUME_DATA = ("decathlon", "brats")


def check_input_kind(files: list[Path], data_name: str, run: str, folds: bool = False) -> None:
    """Before anything is written: each input is what the run predicts (NIfTI volumes or case folders for a
    3-D run, image files for a 2-D one), so a classifier given volumes is not told about BraTS cases, and a
    3-D run given a PNG is no traceback of the sliding window.

    Raises:
        DataError: naming the first input of the other kind and the run, or the run where ``folds`` (a
            ``train --folds`` folder) is a 2-D run's.
    """
    three_d = data_name in VOLUME_DATA
    if folds and not three_d:  # (it said 'expected a NIfTI file' of the first image)
        raise DataError(f"{run}: a train --folds folder of a 2-D run (data.name={data_name}); the folds' ensemble "
                        "predicts 3-D volumes: predict with one fold's run (its fold-0/, say)")
    for f in files:
        volume = f.is_dir() or f.name.endswith((".nii", ".nii.gz"))
        if volume and not three_d:
            what = "a folder inside an input folder" if f.is_dir() else "a NIfTI volume"
            raise DataError(f"{f}: {what}; {run} is a 2-D run (data.name={data_name}): it predicts image files "
                            f"({', '.join(EXTENSIONS)}) or folders of them")
        if three_d and not volume:
            raise DataError(f"{f}: not a NIfTI volume or case folder; {run} is a 3-D run (data.name={data_name}): "
                            "it predicts .nii / .nii.gz files or folders of them")


def check_unique_names(files: list[Path], written: str, stem_of: Callable[[Path], str] | None = None) -> None:
    """Before anything is written: no two inputs whose outputs share a name (``written`` names them, with
    ``{0}`` for an input's stem): ``a/img.png`` and ``b/img.png`` would both write ``img_mask.png``.
    ``stem_of`` gives the stem the outputs are named after (default: the name less ``.nii.gz`` or its
    last suffix).

    Raises:
        DataError: naming both inputs and the output.
    """
    seen: dict[str, Path] = {}
    for f in files:
        stem = stem_of(f) if stem_of else f.name[: -len(".nii.gz")] if f.name.endswith(".nii.gz") else f.stem
        if stem in seen:
            raise DataError(f"{f}: same name {stem!r} as {seen[stem]}: both would write {written.format(stem)} "
                            "(predict them into separate --out folders)")
        seen[stem] = f
