"""``fastvision data inspect PATH``: what is in a dataset folder, before you train on it.

Recognises the layout, then reports counts, shapes, dtypes, intensity range and class balance.
Layouts register an inspector with :func:`inspector`; the first whose ``detect`` accepts the
folder reports on it.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
from rich.console import Console
from rich.table import Table

from ..errors import DataError

_INSPECTORS: list[tuple[str, Callable[[Path], bool], Callable[[Path], dict[str, Any]]]] = []


def inspector(name: str, detect: Callable[[Path], bool]):
    """Register ``fn(path) -> report dict`` for folders where ``detect(path)`` is true."""

    def deco(fn):
        _INSPECTORS.append((name, detect, fn))
        return fn

    return deco


def inspect_path(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise DataError(f"{path}: not found")
    for name, detect, fn in _INSPECTORS:
        if detect(path):
            return {"layout": name, "path": str(path), **fn(path)}
    raise DataError(f"{path}: unrecognised dataset layout; known: {', '.join(n for n, _, _ in _INSPECTORS)}")


def print_report(report: dict[str, Any]) -> None:
    table = Table(title=f"{report['layout']} dataset: {report['path']}", show_header=False)
    for k, v in report.items():
        if k in ("layout", "path"):
            continue
        table.add_row(k, ", ".join(f"{a}: {b}" for a, b in v.items()) if isinstance(v, dict) else str(v))
    Console().print(table)


@inspector("microscopy", lambda p: (p / "images").is_dir() and (p / "masks").is_dir())
def inspect_microscopy(path: Path) -> dict[str, Any]:
    from .formats.microscopy import pair_files, read_array

    pairs = pair_files(path)
    shapes, dtypes, classes = Counter(), Counter(), Counter()
    lo, hi = np.inf, -np.inf
    for img_path, mask_path in pairs:
        img, mask = read_array(img_path), read_array(mask_path)
        if img.shape[:2] != mask.shape[:2]:
            raise DataError(f"{img_path}: image is {img.shape[:2]} but mask {mask_path} is {mask.shape[:2]}")
        shapes[str(tuple(img.shape))] += 1
        dtypes[str(img.dtype)] += 1
        lo, hi = min(lo, float(img.min())), max(hi, float(img.max()))
        values, counts = np.unique(mask if mask.ndim == 2 else mask[..., 0], return_counts=True)
        for v, c in zip(values.tolist(), counts.tolist()):
            classes[v] += c
    total = sum(classes.values())
    return {"pairs": len(pairs), "image shapes": dict(shapes), "image dtypes": dict(dtypes),
            "intensity range": f"{lo:g} .. {hi:g}",
            "mask values (pixel share)": {v: f"{c / total:.2%}" for v, c in sorted(classes.items())}}
