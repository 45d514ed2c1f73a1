"""dataset.json's ``labels`` in either form (MSD's ``{value: name}``, nnU-Net v2's ``{name: value}`` with
region lists): read by the Decathlon reader, ``data inspect`` and ``configure`` alike. A leaf module, so the
reader and the fingerprint (which imports the reader) both take it without a cycle."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fastvision.errors import DataError


def parse_labels(meta: dict[str, Any], path: Path) -> tuple[dict[int, str], dict[str, list[int]] | None]:
    """dataset.json ``labels``: ``({value: name}, regions or None)``.

    MSD writes ``{"0": "background", "1": "spleen"}``; nnU-Net v2 ``{"background": 0, "spleen": 1}``
    and, for region-based training, lists: ``{"background": 0, "whole tumor": [1, 2, 3],
    "tumor core": [2, 3], "enhancing tumor": 3}`` (each region the union of those values; v2 then
    also names ``regions_class_order``). Regions are returned by name, background left out; every
    value a region lists is a valid label value (named ``label <v>`` where no single entry names it).
    """
    raw = meta.get("labels") or {}
    if all(str(k).lstrip("-").isdigit() for k in raw):
        return {int(k): str(v) for k, v in raw.items()}, None
    labels: dict[int, str] = {}
    regions: dict[str, list[int]] = {}
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
