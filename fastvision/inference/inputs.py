"""The files ``fastvision predict`` reads from an input folder, and the one-line error for a folder
that holds none (it used to print "wrote 0 files" and exit 0)."""
from __future__ import annotations

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
