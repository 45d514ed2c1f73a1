"""Postprocessing decided by cross-validation: keep only the largest connected component.

A *step* is a set of label ids: the voxels whose label is in the set form one mask, every
connected component of that mask but the largest (26-connectivity in 3-D, as nnU-Net's
``remove_all_but_largest_component``) is set to background. Steps are applied in order on a
label map (class indices; region predictions are turned into labels first).

:func:`decide` chooses the steps as nnU-Net v2's ``determine_postprocessing`` does, on the
out-of-fold predictions of a cross-validation:

1. the whole foreground (all foreground labels as one mask) is kept to its largest component when
   the mean foreground Dice improves strictly **and** no class or region gets worse;
2. then, with more than one class or region, each one in turn (on top of the steps kept so far)
   is kept to its largest component when its own mean Dice improves strictly.

The Dice of a decision is nnU-Net's: per case ``2tp / (2tp + fp + fn)``, NaN (left out of the
mean) only where prediction and truth are both empty, so removing a false blob from a case
without that class counts. The chosen steps go to ``postprocessing.json`` beside the folds.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastvision.errors import ConfigError, DataError


def largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest connected component of a boolean mask (full connectivity: faces, edges, corners).

    Args:
        mask: (*S) bool, 2-D or 3-D.

    Returns:
        (*S) bool; all False when ``mask`` is empty.
    """
    try:
        from scipy import ndimage
    except ImportError as e:  # pragma: no cover - scipy ships with the medical extra
        raise ConfigError("largest-component postprocessing needs scipy: pip install 'fastvision[medical]'") from e
    labels, n = ndimage.label(mask, structure=np.ones((3,) * mask.ndim, dtype=bool))
    if n <= 1:
        return mask.astype(bool, copy=True)
    sizes = np.bincount(labels.ravel())
    sizes[0] = 0
    return labels == int(sizes.argmax())


def keep_largest(label: np.ndarray, labels: Sequence[int]) -> np.ndarray:
    """``label`` with every component of ``isin(label, labels)`` but the largest set to 0 (a copy)."""
    mask = np.isin(label, list(labels))
    out = label.copy()
    out[mask & ~largest_component(mask)] = 0
    return out


def apply(label: np.ndarray | torch.Tensor, steps: Sequence[Sequence[int]]) -> np.ndarray | torch.Tensor:
    """Apply the steps in order to a (*S) label map (numpy or a tensor, returned as given)."""
    if not steps:
        return label
    is_tensor = torch.is_tensor(label)
    arr = label.cpu().numpy() if is_tensor else label
    for s in steps:
        arr = keep_largest(arr, s)
    return torch.from_numpy(arr).to(label.device) if is_tensor else arr


def targets(task) -> list[tuple[str, list[int]]]:
    """(name, label ids) of each foreground class or region of a segmentation task: the regions where the
    task has them (a softmax model scored on regions, ``unet3d-brats``, included: its primary ``dice`` is
    their mean, so the cross-validation's mean is the folds' own ``dice``), else the classes."""
    if task.regions:
        names = task.region_names or [str(i) for i in range(len(task.regions))]
        return [(n, sorted(r)) for n, r in zip(names, task.regions, strict=True)]
    if task.mode == "sigmoid":
        return [("1", [1])]
    return [(str(c), [c]) for c in range(1, task.num_classes)]


def case_dice(pred: np.ndarray, truth: np.ndarray, sets: list[list[int]]) -> np.ndarray:
    """(T,) nnU-Net Dice of one case per target (a label set); NaN where both masks are empty."""
    out = np.empty(len(sets))
    for i, s in enumerate(sets):
        p, t = np.isin(pred, s), np.isin(truth, s)
        tp = np.count_nonzero(p & t)
        den = np.count_nonzero(p) + np.count_nonzero(t)
        out[i] = 2 * tp / den if den else np.nan
    return out


def defined_means(scores: np.ndarray) -> np.ndarray:
    """(N, T) per-case scores -> (T,) means over the cases where each is defined (NaN if none)."""
    with np.errstate(invalid="ignore"):
        n = (~np.isnan(scores)).sum(0)
        return np.where(n > 0, np.nansum(scores, 0) / np.maximum(n, 1), np.nan)


def _better(after: float, before: float) -> bool:
    return bool(np.isfinite(after) and (not np.isfinite(before) or after > before))


def decide(cases: Sequence[tuple[np.ndarray, np.ndarray]], task) -> dict[str, Any]:
    """Choose the largest-component steps from out-of-fold predictions (module docstring).

    Args:
        cases: ``(predicted labels, true labels)`` per case, (*S) integer arrays on one grid.
        task: the segmentation task (its classes or regions are the targets).

    Returns:
        ``{"steps": [[label ids], ...], "targets": {name: ids}, "trials": [...], "dice_before":
        {name: mean}, "dice_after": {name: mean}}`` (``postprocessing.json``'s content).
    """
    named = targets(task)
    names, sets = [n for n, _ in named], [s for _, s in named]
    foreground = sorted({c for s in sets for c in s})
    current = [p for p, _ in cases]
    base = (np.stack([case_dice(p, t, sets) for p, (_, t) in zip(current, cases, strict=True)]) if cases
            else np.zeros((0, len(sets))))
    first = defined_means(base)
    steps, trials = [], []
    candidates = [("foreground", foreground)] + (list(named) if len(named) > 1 else [])
    for name, ids in candidates:
        trial = [keep_largest(p, ids) for p in current]
        scores = np.stack([case_dice(p, t, sets) for p, (_, t) in zip(trial, cases, strict=True)]) if cases else base
        before, after = defined_means(base), defined_means(scores)
        if name == "foreground":  # the mean over targets must rise and no target may fall
            ok = _better(float(np.nanmean(after)) if np.isfinite(after).any() else np.nan,
                         float(np.nanmean(before)) if np.isfinite(before).any() else np.nan)
            ok = ok and not any(a < b for a, b in zip(after, before, strict=True) if np.isfinite(a) and np.isfinite(b))
        else:
            k = names.index(name)
            ok = _better(after[k], before[k])
        trials.append({"target": name, "labels": ids, "applied": ok,
                       "dice_before": dict(zip(names, _floats(before), strict=True)),
                       "dice_after": dict(zip(names, _floats(after), strict=True))})
        if ok:
            steps.append(ids)
            current, base = trial, scores
    return {"steps": steps, "targets": dict(named), "trials": trials, "cases": len(cases),
            "dice_before": dict(zip(names, _floats(first), strict=True)),
            "dice_after": dict(zip(names, _floats(defined_means(base)), strict=True)),
            "rule": "nnU-Net v2: largest foreground component, then per class or region; kept where the "
                    "cross-validated mean Dice rises"}


def _floats(values: np.ndarray) -> list[float | None]:
    return [float(v) if np.isfinite(v) else None for v in values]


def fixed(task, mode: str) -> dict[str, Any]:
    """``postprocessing.json`` content for ``--postprocess none`` (no step) or ``lcc`` (every target)."""
    if mode not in ("none", "lcc"):
        raise ConfigError(f"--postprocess must be auto, none or lcc, got {mode!r}")
    named = targets(task)
    return {"steps": [ids for _, ids in named] if mode == "lcc" else [], "targets": dict(named),
            "rule": f"--postprocess {mode}"}


def load_steps(path: str | Path) -> list[list[int]]:
    """The steps of a ``postprocessing.json`` (a one-line DataError naming it when unreadable)."""
    p = Path(path)
    try:
        steps = json.loads(p.read_text())["steps"]
        return [[int(c) for c in s] for s in steps]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{p}: not a postprocessing.json ({e})") from e
