"""ImageNet's validation set as distributed: one flat folder of images plus a labels file.

No preparation script: ``val/ILSVRC2012_val_00000001.JPEG ...`` is used where it lies, labelled
from the first of these found (explicitly with ``data.args.val_labels``, else searched in the
dataset root and up to three folders above it, which covers the Kaggle layout
``ILSVRC/Data/CLS-LOC/{train,val}`` with ``LOC_val_solution.csv`` at the top):

* ``LOC_val_solution.csv`` (Kaggle): ``ImageId,PredictionString`` rows whose first token is the
  WordNet id, e.g. ``ILSVRC2012_val_00008726,n02119789 255 142 454 329``.
* the devkit's ``ILSVRC2012_validation_ground_truth.txt`` (one ILSVRC2012_ID per line, in file
  order) with ``meta.mat`` beside it (maps ILSVRC2012_ID -> WordNet id; read with scipy), looked
  for as ``ILSVRC2012_devkit_t12/data/``.
* a two-column text file ``FILE LABEL`` (LABEL a WordNet id or an index into the sorted class
  folders, as Caffe's ``val.txt``).

Tiny-ImageNet's ``val/images/`` is read the same way, labelled by the ``val/val_annotations.txt``
beside it (``FILE WNID`` and the box, which is not read).

Labels index the training class folders; files without a label, labels without a file and WordNet
ids not among the training classes are anomalies (one warning, or an error under
``data.args.invalid: error``).
"""
from __future__ import annotations

import csv
from pathlib import Path

from fastvision.data.formats.anomalies import handle_invalid
from fastvision.errors import ConfigError, DataError

CSV_NAME = "LOC_val_solution.csv"
GT_NAME = "ILSVRC2012_validation_ground_truth.txt"
DEVKIT_DATA = Path("ILSVRC2012_devkit_t12") / "data"
TINY_LABELS = "val_annotations.txt"  # Tiny-ImageNet: FILE WNID X0 Y0 X1 Y1, tab-separated


def flat_val_layout(val_dir: Path, extensions: tuple[str, ...]) -> tuple[Path, str | None] | None:
    """``(images folder, the labels file the layout carries)`` of a flat validation split, or None
    (class folders): ImageNet's ``val/`` holding the images (labels found by
    :func:`find_labels_file`), or Tiny-ImageNet's ``val/images/`` with ``val/val_annotations.txt``."""
    if is_flat(val_dir, extensions):
        return val_dir, None
    if is_flat(val_dir / "images", extensions) and (val_dir / TINY_LABELS).is_file():
        return val_dir / "images", str(val_dir / TINY_LABELS)
    return None


def is_flat(folder: Path, extensions: tuple[str, ...]) -> bool:
    """True when ``folder`` holds image files directly and no class sub-folders."""
    if not folder.is_dir():
        return False
    entries = [p for p in folder.iterdir() if not p.name.startswith(".")]
    return not any(p.is_dir() for p in entries) and any(p.suffix.lower() in extensions for p in entries)


def find_labels_file(root: Path, explicit: str | None = None) -> Path:
    """The labels file for a flat val folder (see the module docstring for the search)."""
    if explicit:
        p = Path(explicit) if Path(explicit).is_absolute() else root / explicit
        if not p.is_file():
            raise DataError(f"data.args.val_labels: {p} not found")
        return p
    for d in [root, *list(root.resolve().parents)[:3]]:
        for candidate in (d / CSV_NAME, d / DEVKIT_DATA / GT_NAME, d / GT_NAME):
            if candidate.is_file():
                return candidate
    raise DataError(f"{root}: the val folder is flat (no class folders) and no labels were found: put "
                    f"{CSV_NAME} or {DEVKIT_DATA / GT_NAME} (+ meta.mat) in {root}, or set data.args.val_labels")


def read_labels(path: Path, classes: list[str]) -> dict[str, str]:
    """``{file stem: WordNet id}`` from any of the accepted label files (a UTF-8 byte-order mark, as
    spreadsheet programs write, is read past; a file listed twice with two labels is one line)."""
    if path.name == CSV_NAME or path.suffix.lower() == ".csv":
        return _unique(path, _read_csv(path))
    if path.name == GT_NAME:
        # line n labels ILSVRC2012_val_<n, 8 digits>: by number, so a missing file shifts nothing
        return {f"ILSVRC2012_val_{n:08d}": wnid for n, wnid in enumerate(_devkit_ids(path), 1)}
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if path.name == TINY_LABELS and len(parts) == 6:  # the box after the class: not a label
            parts = parts[:2]
        if len(parts) != 2:
            raise DataError(f"{path}:{n}: expected 'FILE LABEL', got {line!r}")
        rows.append((n, Path(parts[0]).stem, parts[1]))
    return _unique(path, _numbers_as(path, rows, classes))


def _numbers_as(path: Path, rows: list[tuple[int, str, str]], classes: list[str]) -> list[tuple[int, str, str]]:
    """Rows with each number label read as a class folder name or as an index into the sorted
    class folders (Caffe's ``val.txt``), whichever the whole file allows: class folders named
    ``1, 2, 10`` are sorted ``1, 10, 2``, so label ``1`` is folder ``1`` or index 1, folder ``10``.

    Raises:
        DataError: an index past the classes (and no folder of that name), or a file whose
            numbers read both ways with different classes.
    """
    numbers = [(n, label) for n, _, label in rows if label.isdigit()]
    as_name = all(label in classes for _, label in numbers)
    as_index = all(int(label) < len(classes) for _, label in numbers)
    if not as_index and not as_name:
        n, label = next((n, label) for n, label in numbers if int(label) >= len(classes) and label not in classes)
        raise DataError(f"{path}:{n}: class index {label} >= {len(classes)} training classes")
    if as_name and as_index:
        n, label = next(((n, label) for n, label in numbers if classes[int(label)] != label), (0, ""))
        if n:
            raise DataError(f"{path}:{n}: label {label} is both the class folder {label!r} and index {label} of "
                            f"the sorted class folders ({classes[int(label)]!r}); write class names that are not "
                            "numbers, or sort the val folder into class folders (val/<class>/...)")
        return rows
    return rows if as_name else [(n, name, classes[int(label)] if label.isdigit() else label)
                                 for n, name, label in rows]


def _unique(path: Path, rows: list[tuple[int, str, str]]) -> dict[str, str]:
    """``{file stem: label}``; a file given two different labels is one line naming both."""
    out: dict[str, tuple[int, str]] = {}
    for n, name, label in rows:
        first = out.setdefault(name, (n, label))
        if first[1] != label:
            raise DataError(f"{path}:{n}: {name} is labelled {label} here and {first[1]} on line {first[0]}")
    return {name: label for name, (_, label) in out.items()}


def _read_csv(path: Path) -> list[tuple[int, str, str]]:
    with path.open(newline="", encoding="utf-8-sig") as f:
        rows = list(csv.reader(f))
    if not rows or [c.strip() for c in rows[0][:2]] != ["ImageId", "PredictionString"]:
        raise DataError(f"{path}: expected the header ImageId,PredictionString (Kaggle LOC_val_solution.csv)")
    out = []
    for n, row in enumerate(rows[1:], 2):
        if len(row) < 2 or not row[1].split():
            raise DataError(f"{path}:{n}: expected ImageId,WNID ..., got {','.join(row)!r}")
        out.append((n, row[0].strip(), row[1].split()[0]))
    return out


def _devkit_ids(gt: Path) -> list[str]:
    """WordNet ids per line of the devkit ground truth, through ``meta.mat``'s synsets."""
    meta = gt.parent / "meta.mat"
    if not meta.is_file():
        raise DataError(f"{gt}: needs meta.mat beside it (the devkit's ILSVRC2012_ID -> WordNet id table)")
    try:
        from scipy.io import loadmat
    except ImportError as e:  # optional: only this label source needs it
        raise ConfigError("reading the devkit's meta.mat needs scipy: pip install scipy "
                          f"(or use {CSV_NAME})") from e
    try:
        synsets = loadmat(str(meta), squeeze_me=True)["synsets"]
        wnid = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets}
    except Exception as e:  # any malformed MATLAB file
        raise DataError(f"{meta}: not the devkit's meta.mat ({e})") from e
    out = []
    for n, line in enumerate(gt.read_text().split(), 1):
        if not line.isdigit() or int(line) not in wnid:
            raise DataError(f"{gt}:{n}: {line!r} is not an ILSVRC2012_ID in meta.mat")
        out.append(wnid[int(line)])
    return out


def flat_val_samples(val_dir: Path, classes: list[str], root: Path, extensions: tuple[str, ...],
                     val_labels: str | None = None, invalid: str = "warn") -> tuple[list[tuple[str, int]], str]:
    """``(path, class index)`` for a flat val folder, and a description of where the labels came from."""
    files = sorted(p for p in val_dir.iterdir() if p.suffix.lower() in extensions and not p.name.startswith("."))
    source = find_labels_file(root, val_labels)
    labels = read_labels(source, classes)
    index = {c: i for i, c in enumerate(classes)}
    samples, unlabelled, unknown = [], [], []
    for f in files:
        wnid = labels.get(f.stem)
        if wnid is None:
            unlabelled.append(f.name)
        elif wnid not in index:
            unknown.append(f"{f.name}:{wnid}")
        else:
            samples.append((str(f), index[wnid]))
    on_disk = {f.stem for f in files}
    absent = [s for s in labels if s not in on_disk]
    handle_invalid(val_dir, {f"files without a label in {source.name}": unlabelled,
                             "labels whose class is not a training folder": unknown,
                             f"labels in {source.name} without a file": absent},
                   invalid, what="validation entries skipped")
    if not samples:
        raise DataError(f"{val_dir}: no labelled images (labels from {source})")
    return samples, f"flat folder, labels from {source}"
