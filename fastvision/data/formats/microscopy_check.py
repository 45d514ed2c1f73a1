"""Microscopy folders as ``fastvision data inspect`` sees them: which pairs training would stop on,
and why, and what the usable ones hold (shapes, dtypes, intensity range, mask encodings).

The counterpart of :mod:`fastvision.data.formats.coco_check` for ``images/`` + ``masks/``
folders: pairs are read with the reader's own :func:`~fastvision.data.formats.microscopy.read_array`
under the microscopy builder's settings (:func:`microscopy_rule`), so inspect names every file the
training run would stop on. Nothing here decides anything training does.
"""
from __future__ import annotations

import inspect
import typing
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastvision.data.formats.microscopy import microscopy, read_array
from fastvision.data.nonfinite import NONFINITE_FILES, count_nonfinite, zero_nonfinite
from fastvision.errors import ConfigError, DataError
from fastvision.registry import type_name, type_ok


def microscopy_rule(settings: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``(rule, row)``: the microscopy builder's ``channels`` / ``num_classes`` / ``binarize`` /
    ``nonfinite`` (its defaults overridden by ``settings``) and the anomaly row of the files training
    stops on."""
    defaults = {k: p.default for k, p in inspect.signature(microscopy).parameters.items()
                if k in ("channels", "num_classes", "binarize", "nonfinite")}
    unknown = set(settings) - set(defaults)
    if unknown:
        raise ConfigError(f"data inspect --set {sorted(unknown)[0]}: valid for microscopy: {', '.join(defaults)}")
    hints = typing.get_type_hints(microscopy)
    for key, value in settings.items():  # a wrong type is the setting's fault, not every file's
        if not type_ok(value, hints[key]):
            raise ConfigError(f"data inspect --set {key}={value}: expected {type_name(hints[key])} "
                              f"(data.args.{key})")
    rule = {**defaults, **settings}
    stops = ("files training stops on (as data.args "
             + ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in rule.items()) + ")")
    return rule, stops


def read_pair(img_path: Path, mask_path: Path, root: Path, unusable: dict[str, list[str]],
              nonfinite: str = "error", notes: dict[str, list[str]] | None = None
              ) -> tuple[np.ndarray, np.ndarray] | None:
    """``(image, mask)`` as training reads them, or None with the reason added to ``unusable``
    (unreadable or a stack, NaN / Inf values, image and mask of different sizes). With ``nonfinite``
    ``zero`` (training's ``data.args.nonfinite``) NaN / Inf are read as 0 and the files named in ``notes``."""
    try:
        img, mask = read_array(img_path), read_array(mask_path, mask=True)
    except DataError as e:  # "<file>: why" -> "name: why"
        unusable.setdefault("unreadable files, or Z / T stacks (items are 2-D)", []).append(
            str(e).replace(str(root) + "/", ""))
        return None
    counts = ((img_path, count_nonfinite(img)), (mask_path, count_nonfinite(mask)))
    bad = [f"{p.name} ({n})" for p, n in counts if n]
    if bad and nonfinite == "zero" and notes is not None:  # training warns and reads them as 0
        notes.setdefault(ZEROED, []).extend(bad)
        img, mask = zero_nonfinite(img), zero_nonfinite(mask)
    elif bad:
        unusable.setdefault(NONFINITE_FILES, []).extend(bad)
        return None
    if img.shape[:2] != mask.shape[:2]:
        unusable.setdefault("image and mask of different sizes", []).append(
            f"{img_path.name} {img.shape[:2]} vs {mask_path.name} {mask.shape[:2]}")
        return None
    return img, mask


ZEROED = "files with NaN/Inf values, read as 0 (nonfinite=zero)"
# 12-bit camera data saved as 16-bit: scaled by 65535 the images read as 0..0.06 (train on, but say so)
DARK = "16-bit images using under 1/8 of their range (12-bit data? read as 0..max/65535)"


def _format(path: Path) -> str:
    """``.png`` or ``.tif`` (``.TIFF``, ``.tiff`` and ``.Tif`` alike)."""
    return path.suffix.lower().replace(".tiff", ".tif")


@dataclass
class MaskTally:
    """What :func:`~fastvision.data.inspect.inspect_microscopy` counts over the readable pairs:
    image shapes, dtypes and intensity range, mask pixel values and encodings, and the anomalies
    (which do not stop training)."""

    shapes: Counter = field(default_factory=Counter)
    dtypes: Counter = field(default_factory=Counter)
    classes: Counter = field(default_factory=Counter)  # mask value -> pixels
    encodings: Counter = field(default_factory=Counter)  # "0/1", "0/255", "12 values" -> files
    by_encoding: dict[str, list[str]] = field(default_factory=dict)  # encoding -> mask names
    anomalies: dict[str, list[str]] = field(default_factory=dict)
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)  # image dtype -> (min, max)

    def add(self, img: np.ndarray, mask: np.ndarray, img_path: Path, mask_path: Path) -> None:
        """Count one pair (image (H, W[, C]), mask (H, W[, C]): its first channel)."""
        self.shapes[str(tuple(img.shape))] += 1
        self.dtypes[f"{img.dtype} / mask {mask.dtype}"] += 1
        lo, hi = self.ranges.get(str(img.dtype), (np.inf, -np.inf))
        top = img.max()
        self.ranges[str(img.dtype)] = min(lo, float(img.min())), max(hi, float(top))
        full = np.iinfo(img.dtype).max if img.dtype.kind in "ui" and img.dtype.itemsize == 2 else None
        if full is not None and top < full / 8:
            self.anomalies.setdefault(DARK, []).append(f"{img_path.name} (max {top} of {full})")
        values, counts = np.unique(mask if mask.ndim == 2 else mask[..., 0], return_counts=True)
        for v, c in zip(values.tolist(), counts.tolist(), strict=True):
            self.classes[v] += c
        enc = "/".join(str(v) for v in values.tolist()) if len(values) <= 3 else f"{len(values)} values"
        self.encodings[enc] += 1
        self.by_encoding.setdefault(enc, []).append(mask_path.name)
        if _format(img_path) != _format(mask_path):  # a.TIF + a.tiff is one format
            self.anomalies.setdefault("masks with another extension than their image (paired by stem)",
                                      []).append(f"{img_path.name}+{mask_path.name}")
        if len(values) > 3:
            self.anomalies.setdefault("masks with more than 3 values (instance ids? data.args.binarize)",
                                      []).append(mask_path.name)

    def range_text(self) -> str:
        """``"0 .. 4095 (uint16)"``, or one range per image dtype (``"uint16 0 .. 4095, uint8 0 .. 255"``):
        integer images are scaled by their dtype's range, so one range over mixed dtypes says nothing."""
        if len(self.ranges) == 1:
            [(dtype, (lo, hi))] = self.ranges.items()
            return f"{lo:g} .. {hi:g} ({dtype})"
        return ", ".join(f"{d} {lo:g} .. {hi:g}" for d, (lo, hi) in self.ranges.items())

    def flag_mixed_binary_encodings(self) -> None:
        """Name the binary masks encoded unlike most (e.g. 0/1 beside 0/255): each is read as 0/1."""
        if len([e for e in self.encodings if e.count("/") == 1]) > 1:
            common = self.encodings.most_common(1)[0][0]
            self.anomalies["binary masks encoded differently from most (each read as 0/1)"] = [
                f"{n} ({e})" for e, names in self.by_encoding.items() if e != common and e.count("/") == 1
                for n in names]
