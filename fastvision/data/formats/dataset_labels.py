"""dataset.json's ``labels`` in either form (MSD's ``{value: name}``, nnU-Net v2's ``{name: value}`` with
region lists): read by the Decathlon reader, ``data inspect`` and ``configure`` alike. A leaf module, so the
reader and the fingerprint (which imports the reader) both take it without a cycle."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fastvision.errors import DataError


def read_meta(f: Path) -> Any:
    """dataset.json's JSON (a UTF-8 BOM, as Windows editors write it, read as UTF-8); one line naming the file
    where it is not UTF-8 or not JSON (an empty file of a stopped copy)."""
    import json

    try:
        return json.loads(f.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DataError(f"{f}: not UTF-8 text ({e})") from e
    except json.JSONDecodeError as e:
        raise DataError(f"{f}: not valid JSON ({e})") from e


def parse_labels(meta: dict[str, Any], path: Path) -> tuple[dict[int, str], dict[str, list[int]] | None]:
    """dataset.json ``labels``: ``({value: name}, regions or None)``.

    MSD writes ``{"0": "background", "1": "spleen"}``; nnU-Net v2 ``{"background": 0, "spleen": 1}``
    and, for region-based training, lists: ``{"background": 0, "whole tumor": [1, 2, 3],
    "tumor core": [2, 3], "enhancing tumor": 3}`` (each region the union of those values; v2 then
    also names ``regions_class_order``). Regions are returned by name, background left out; every
    value a region lists is a valid label value (named ``label <v>`` where no single entry names it).
    v2's ``ignore`` label is refused (one line naming the file): fastvision has no partial loss.
    """
    raw = meta.get("labels") or {}
    if all(str(k).lstrip("-").isdigit() for k in raw):
        return {int(k): str(v) for k, v in raw.items()}, None
    labels: dict[int, str] = {}
    regions: dict[str, list[int]] = {}
    if "ignore" in {str(k).lower() for k in raw}:  # trained as a class it would be learnt and scored as one
        raise DataError(f"{path / 'dataset.json'}: labels.ignore: nnU-Net v2's ignore label (sparse annotation: "
                        "voxels left out of the loss and the metrics) is not supported; fastvision would train it as "
                        "a class")
    for name, value in raw.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        try:
            values = [int(v) for v in values]
        except (TypeError, ValueError):
            raise DataError(f"{path / 'dataset.json'}: labels.{name} must be an integer or a list of integers, "
                            f"got {value!r}") from None
        if isinstance(value, (list, tuple)):
            regions[str(name)] = values
        else:
            labels[values[0]] = str(name)
            if values[0] != 0:
                regions[str(name)] = values
    has_lists = any(isinstance(v, (list, tuple)) for v in raw.values())
    for v in sorted({v for r in regions.values() for v in r} - set(labels)):
        labels[v] = f"label {v}"
    return dict(sorted(labels.items())), (regions if has_lists else None)


def label_names(meta: dict[str, Any], root: Path) -> dict[int, str]:
    """``{value: lower-case name}`` of dataset.json's labels in either form (:func:`parse_labels`): what the
    Decathlon reader trains on, so it reads the labels as ``data inspect`` and ``configure`` do."""
    return {k: v.lower() for k, v in parse_labels(meta, root)[0].items()}


# Task01's label names -> fastvision's BraTS class; predict writes each class back as the file's id
MSD_BRAIN_LABELS = {"edema": 2, "non-enhancing tumor": 1, "enhancing tumour": 3}
# nnU-Net v2's BraTS regions (its Dataset137 conversion, region-based training): the file ids they are
# built from are MSD Task01's (1 edema, 2 non-enhancing, 3 enhancing)
_BRATS_REGIONS = {"whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": [3]}


def task01_label_map(meta: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    """``((file id, BraTS class), ...)`` of a Task01 BrainTumour dataset.json, the renumbering loading applies;
    ``()`` for any other task. Its ``labels`` name edema, non-enhancing and enhancing tumour, in MSD's form
    (``{"1": "edema"}``) or nnU-Net v2's (``{"edema": 1}``, what ``nnUNetv2_convert_MSD_dataset`` writes, the
    ids unchanged), or are v2's BraTS regions (whole tumor [1, 2, 3], tumor core [2, 3], enhancing tumor 3)."""
    labels, regions = parse_labels(meta, Path("dataset.json"))
    if regions and {k.lower(): sorted(v) for k, v in regions.items()} == _BRATS_REGIONS:
        return ((1, 2), (2, 1), (3, 3))
    names = {k: v.lower() for k, v in labels.items()}
    if not set(MSD_BRAIN_LABELS) <= set(names.values()):
        return ()
    return tuple((k, MSD_BRAIN_LABELS[v]) for k, v in names.items() if v in MSD_BRAIN_LABELS)
