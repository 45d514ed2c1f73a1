"""Largest-component postprocessing: the component against a plain flood fill (MONAI's
KeepLargestConnectedComponent needs scikit-image, absent here), the decision as nnU-Net v2 takes it."""
from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import pytest
import torch
from torch import nn

from fastvision.inference import postprocess
from fastvision.tasks.segment import SegmentationTask


def _flood_largest(mask: np.ndarray) -> np.ndarray:
    """Largest 26-connected component by breadth-first search (the reference)."""
    seen = np.zeros(mask.shape, bool)
    best: list = []
    steps = [d for d in itertools.product((-1, 0, 1), repeat=mask.ndim) if any(d)]
    for start in zip(*np.nonzero(mask), strict=True):
        if seen[start]:
            continue
        seen[start], comp, todo = True, [], deque([start])
        while todo:
            v = todo.popleft()
            comp.append(v)
            for d in steps:
                w = tuple(a + b for a, b in zip(v, d, strict=True))
                if all(0 <= a < n for a, n in zip(w, mask.shape, strict=True)) and mask[w] and not seen[w]:
                    seen[w] = True
                    todo.append(w)
        if len(comp) > len(best):
            best = comp
    out = np.zeros(mask.shape, bool)
    for v in best:
        out[v] = True
    return out


def _task(num_classes: int = 2, **kw) -> SegmentationTask:
    return SegmentationTask(num_classes=num_classes, sample_shape=[1, 8, 8, 8], loss=nn.MSELoss(), **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("labels", [[1], [1, 2]])
def test_keep_largest_matches_flood_fill(seed, labels):
    rng = np.random.default_rng(seed)
    label = (rng.random((14, 12, 10)) < 0.12).astype(np.uint8) * rng.integers(1, 3, (14, 12, 10)).astype(np.uint8)
    ours = postprocess.keep_largest(label, labels)
    mask = np.isin(label, labels)  # the labels as one foreground, 26-connectivity as nnU-Net's
    ref = np.where(mask & ~_flood_largest(mask), 0, label)
    np.testing.assert_array_equal(ours, ref)
    assert (ours != label).any()  # the random mask has several components: something was removed


def _blob(shape, lo, hi, value=1, out=None):
    out = np.zeros(shape, np.uint8) if out is None else out
    out[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))] = value
    return out


def test_lcc_chosen_where_it_helps():
    """Truth: one organ; prediction: the organ plus a stray blob. Removing the blob raises Dice."""
    shape, cases = (20, 20, 20), []
    for i in range(3):
        truth = _blob(shape, (4, 4, 4), (12, 12, 12))
        pred = _blob(shape, (4, 4, 5), (12, 12, 12))  # a slice short of the organ ...
        _blob(shape, (15 + i % 2, 15, 15), (18, 18, 18), out=pred)  # ... plus a false blob far away
        cases.append((pred, truth))
    res = postprocess.decide(cases, _task())
    assert res["steps"] == [[1]]
    # by hand: tp 448, fp 27 or 18, fn 64 -> after the step fp 0
    before = np.mean([2 * 448 / (2 * 448 + fp + 64) for fp in (27, 18, 27)])
    assert res["dice_before"]["1"] == pytest.approx(before)
    assert res["dice_after"]["1"] == pytest.approx(2 * 448 / (2 * 448 + 64))


def test_lcc_refused_where_it_hurts():
    """Truth: two separate lesions, both predicted; keeping the largest drops the smaller true one."""
    shape = (20, 20, 20)
    truth = _blob(shape, (2, 2, 2), (9, 9, 9))
    _blob(shape, (13, 13, 13), (17, 17, 17), out=truth)
    pred = truth.copy()
    res = postprocess.decide([(pred, truth)], _task())
    assert res["steps"] == [] and res["trials"][0]["applied"] is False
    assert res["trials"][0]["dice_after"]["1"] < res["trials"][0]["dice_before"]["1"] == 1.0


def test_per_class_decision_when_the_whole_foreground_step_hurts():
    """Class 1 gains from its largest component, class 2 (two true blobs) loses: only class 1's step."""
    shape = (24, 24, 24)
    truth = _blob(shape, (2, 2, 2), (10, 10, 10), 1)
    _blob(shape, (14, 2, 2), (20, 8, 8), 2, truth)
    _blob(shape, (14, 14, 14), (18, 18, 18), 2, truth)
    pred = truth.copy()
    _blob(shape, (2, 20, 20), (4, 22, 22), 1, pred)  # a stray class-1 blob
    res = postprocess.decide([(pred, truth)], _task(3))
    assert [t["target"] for t in res["trials"]] == ["foreground", "1", "2"]
    assert [t["applied"] for t in res["trials"]] == [False, True, False]
    assert res["steps"] == [[1]]
    fixed = postprocess.apply(pred, res["steps"])
    np.testing.assert_array_equal(fixed, truth)
    assert postprocess.apply(torch.from_numpy(pred), res["steps"]).equal(torch.from_numpy(truth))


def test_regions_are_label_sets():
    task = _task(4, mode="regions", regions=[[1, 2, 3], [1, 3], [3]], region_names=["WT", "TC", "ET"])
    assert postprocess.targets(task) == [("WT", [1, 2, 3]), ("TC", [1, 3]), ("ET", [3])]
    assert postprocess.fixed(task, "lcc")["steps"] == [[1, 2, 3], [1, 3], [3]]
    assert postprocess.fixed(task, "none")["steps"] == []


def test_softmax_with_regions_scores_its_regions():
    """``unet3d-brats`` (softmax labels, scored on WT / TC / ET): the cross-validation scores its regions,
    so the table's mean is the folds' primary ``dice`` (before, the labels 1..3: ``dice_labels``).
    Checked against the BraTS regions' Dice by hand (both empty: 1, ``empty: one``)."""
    from fastvision.inference.folds import _counts
    from fastvision.metrics.crossval import fold_table

    regions = {"WT": [1, 2, 3], "TC": [1, 3], "ET": [3]}
    task = _task(4, mode="softmax", regions=list(regions.values()), region_names=list(regions), empty="one")
    named = postprocess.targets(task)
    assert named == list(regions.items())
    rng = np.random.default_rng(3)
    pairs = [(rng.integers(0, 4, (6, 5, 4)).astype(np.uint8), rng.integers(0, 4, (6, 5, 4)).astype(np.uint8))
             for _ in range(3)]
    pairs[1][1][pairs[1][1] == 3] = 2  # a case without enhancing tumour in its truth
    pairs[1][0][pairs[1][0] == 3] = 1  # ... nor in its prediction: ET scores 1
    sets = [s for _, s in named]
    res = fold_table([{"id": str(i), "fold": 0, **_counts(p, t, sets)} for i, (p, t) in enumerate(pairs)],
                     [n for n, _ in named], task.empty)

    def dice(p, t):
        return 1.0 if not p.any() and not t.any() else 2 * (p & t).sum() / (p.sum() + t.sum())

    by_hand = [[dice(np.isin(p, s), np.isin(t, s)) for s in regions.values()] for p, t in pairs]
    assert by_hand[1][2] == 1.0
    assert res["dice"] == pytest.approx(np.mean(by_hand), abs=1e-12)
    assert [res["mean"]["dice"][k] for k in regions] == pytest.approx(np.mean(by_hand, 0).tolist(), abs=1e-12)
