"""Nested label regions (BraTS WT / TC / ET and the like): class ids <-> one mask per region.

A region is a list of class ids, e.g. BraTS ``[[1, 2, 3], [1, 3], [3]]``. The training target,
the evaluation and ``fastvision predict`` all go through these two functions.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def region_lut(regions: Sequence[Sequence[int]], num_ids: int = 256) -> Tensor:
    """(label id -> regions) lookup table for :func:`region_masks`.

    Args:
        regions: class ids of each region.
        num_ids: table rows; at least one more than the largest id.

    Returns:
        (max(num_ids, 1 + largest id), R) bool.
    """
    lut = torch.zeros(max(num_ids, 1 + max(max(r) for r in regions)), len(regions), dtype=torch.bool)
    for i, r in enumerate(regions):
        lut[list(r), i] = True
    return lut


def region_masks(label: Tensor, lut: Tensor) -> Tensor:
    """(B, *S) integer labels -> (B, R, *S) bool region masks.

    Args:
        label: (B, *S) int64 class ids.
        lut: a :func:`region_lut` table on ``label``'s device (a training step keeps one copy per
            device: copying it per call would be a host sync).
    """
    return lut[label].movedim(-1, 1)


def regions_to_classes(masks: Tensor, regions: Sequence[Sequence[int]]) -> Tensor:
    """Nested region masks -> class indices, inner regions painted over outer ones.

    Each region is labelled with the one class it holds that no region inside it holds (BraTS
    WT {1,2,3} -> 2, TC {1,3} -> 1, ET {3} -> 3), so ET wins over TC and TC over WT, as the BraTS
    post-processing of MONAI and nnU-Net does.

    Args:
        masks: (B, R, *S) bool predictions, one channel per entry of ``regions``.
        regions: class ids of each region, e.g. ``[[1, 2, 3], [1, 3], [3]]``.

    Returns:
        (B, *S) int64.
    """
    from fastvision.errors import ConfigError

    sets = [set(r) for r in regions]
    label = torch.zeros((masks.shape[0], *masks.shape[2:]), dtype=torch.long, device=masks.device)
    for r in sorted(range(len(sets)), key=lambda i: -len(sets[i])):
        own = sets[r] - set().union(*[s for s in sets if s < sets[r]])
        if len(own) != 1:
            raise ConfigError(f"task.args.regions {list(map(list, regions))} are not nested; cannot map to labels")
        label[masks[:, r].bool()] = own.pop()
    return label
