"""The training crop of a cached 3-D volume: where a patch is cut, and which patches must hold foreground.

Three placements (``data.args.placement``):

* ``monai`` (:func:`random_patch`): the centre is a random foreground voxel (any class) or a random
  background voxel inside the body (label 0, image above 0 in some channel); the patch is then moved
  inside the volume (MONAI ``RandCropByPosNegLabel`` with ``image_key="image", image_threshold=0``, as
  seed 003's spleen tutorials crop).
* ``nnunet`` (:func:`nnunet_patch`): ``nnUNetDataLoader.get_bbox``. A foreground patch picks one of
  the classes present with equal probability, then one of its voxels, and puts it at the patch centre
  (start ``voxel - size // 2``, held above ``-need_to_pad // 2`` only: the patch may reach past the
  volume, read as zeros); any other patch starts uniformly in ``[-need_to_pad // 2, shape +
  need_to_pad // 2 + need_to_pad % 2 - size]``, ``need_to_pad`` being what a volume smaller than the
  patch lacks.
* ``uniform`` (:func:`uniform_patch`): the start uniform over every position where the patch fits
  (``[0, shape - size]`` per axis), whatever the label: MONAI's ``RandSpatialCrop`` (seed 003's BraTS
  recipe) and seed 000's ``RandomCrop3D``; ``pos_fraction`` and ``oversample`` play no part.

Which patches must hold foreground (``data.args.oversample``): ``random``, each with probability
``pos_fraction``; ``batch_tail``, nnU-Net's ``_oversample_last_XX_percent``: the items at batch
positions ``>= round(B * (1 - pos_fraction))`` (with batch 2 and 0.33: the second of each pair).
The position is the item's place in the sampler's order of the epoch
(:func:`~fastvision.data.transforms.batch_slots`), so the rule is a function of (seed, epoch, sampler),
and a resumed epoch redraws what it drew.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fastvision.data.transforms import SLOT_KEY, RandomTransform
from fastvision.errors import ConfigError

PLACEMENTS, OVERSAMPLING = ("monai", "nnunet", "uniform"), ("random", "batch_tail")


def forced_foreground(slot: tuple[int, int], pos_fraction: float) -> bool:
    """nnU-Net's ``_oversample_last_XX_percent``: the last ``B - round(B (1 - p))`` positions of a batch."""
    pos, batch = slot
    return not pos < round(batch * (1 - pos_fraction))


def random_patch(image: torch.Tensor, label: torch.Tensor, size: Sequence[int], pos_fraction: float,
                 generator: torch.Generator | None = None,
                 force: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Crop a ``size`` patch centred on a foreground voxel with probability ``pos_fraction``.

    Otherwise the centre is a background voxel whose image is above 0 in some channel, uniform over
    those: MONAI's ``RandCropByPosNegLabel(image_key="image", image_threshold=0)`` (``FgBgToIndicesd``'s
    background indices), the crop of seed 003's spleen tutorials, whose CT window maps air to 0; a
    uniform voxel put half the negative patches in the air around the body. A volume with no such voxel
    takes a foreground centre, then a uniform one. Volumes smaller than ``size`` are zero-padded first.
    The tensors may live on any device; the random numbers come from ``generator`` (a CPU generator),
    so a crop on the GPU equals the crop on the CPU.

    Args:
        image: (C, *S) float tensor; label: (*S) integer tensor.
        size: patch shape (len(S),).
        generator: CPU generator of the draws (the per-item generator in training).
        force: foreground or not, decided by the caller (the batch position); the draw is made anyway.

    Returns:
        (image (C, *size), label (*size)).
    """
    image, label = _pad_to(image, label, size)
    shape = label.shape
    want = float(torch.rand((), generator=generator)) < pos_fraction
    fg = want if force is None else force
    centre = _voxel_in(label > 0, generator) if fg else _background_voxel(image, label, generator)
    if centre is None:  # none of that kind: the other kind, then anywhere
        centre = _background_voxel(image, label, generator) if fg else _voxel_in(label > 0, generator)
    if centre is None:
        centre = [int(torch.randint(n, (), generator=generator)) for n in shape]
    start = [min(max(0, c - s // 2), n - s) for c, s, n in zip(centre, size, shape, strict=True)]
    sl = tuple(slice(a, a + s) for a, s in zip(start, size, strict=True))
    return image[(slice(None),) + sl], label[sl]


def _voxel_in(mask: torch.Tensor, generator: torch.Generator | None) -> list[int] | None:
    """A voxel of ``mask``, uniform over its true voxels (None where it has none): one host sync, as MONAI's
    crop has on the GPU."""
    where = torch.nonzero(mask)
    return where[int(torch.randint(len(where), (), generator=generator))].tolist() if len(where) else None


def _background_voxel(image: torch.Tensor, label: torch.Tensor, generator: torch.Generator | None,
                      tries: int = 16) -> list[int] | None:
    """A voxel with label 0 and the image above 0 in some channel, uniform over them (None where there is
    none). Uniform draws until one is such a voxel (the body is most of a foreground-cropped volume: one
    or two draws, no index list), the index list after ``tries`` misses: both are uniform over the set."""
    shape = label.shape
    for _ in range(tries):
        v = [int(torch.randint(n, (), generator=generator)) for n in shape]
        if int(label[tuple(v)]) == 0 and bool((image[(slice(None), *v)] > 0).any()):
            return v
    return _voxel_in((label == 0) & (image > 0).any(0), generator)


def _pad_to(image: torch.Tensor, label: torch.Tensor, size: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad (symmetrically, the odd voxel after) the axes shorter than ``size``."""
    pad = [max(0, s - n) for s, n in zip(size, label.shape, strict=True)]
    if any(pad):
        spec = [p for d in reversed(pad) for p in (d // 2, d - d // 2)]
        image, label = F.pad(image, spec), F.pad(label, spec)
    return image, label


def uniform_patch(image: torch.Tensor, label: torch.Tensor, size: Sequence[int],
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``size`` patch whose start is uniform in ``[0, shape - size]`` per axis (MONAI's
    ``RandSpatialCrop(random_size=False)``); volumes smaller than ``size`` are zero-padded first.

    Args: as :func:`random_patch` (no foreground choice).
    """
    image, label = _pad_to(image, label, size)
    start = [int(torch.randint(n - s + 1, (), generator=generator)) for s, n in zip(size, label.shape, strict=True)]
    sl = tuple(slice(a, a + s) for a, s in zip(start, size, strict=True))
    return image[(slice(None),) + sl], label[sl]


def nnunet_patch(image: torch.Tensor, label: torch.Tensor, size: Sequence[int], foreground: bool,
                 generator: torch.Generator | None = None,
                 final_size: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``nnUNetDataLoader.get_bbox`` (``size`` its ``initial_patch_size``), then ``crop_and_pad_nd``:
    zeros (label 0, nnU-Net's -1 after its ``RemoveLabelTansform``) where the box leaves the volume.

    Args:
        image: (C, *S); label: (*S) integer class indices.
        foreground: put a voxel of a random present class at the centre (nnU-Net's ``force_fg``);
            a volume without foreground falls back to a uniform box, as nnU-Net's does.
        final_size: the network's patch where ``size`` is nnU-Net's enlarged initial patch (default
            ``size``): ``need_to_pad`` is then at least ``size - final_size``, so the final patch, cut from
            the centre later (``data.augment.affine.size``), reaches the volume's faces as often as nnU-Net's.
    """
    shape = label.shape
    final = size if final_size is None else final_size
    need = [max(s - f, s - n, 0) for s, f, n in zip(size, final, shape, strict=True)]
    lbs = [-d // 2 for d in need]
    ubs = [n + d // 2 + d % 2 - s for n, d, s in zip(shape, need, size, strict=True)]
    start = None
    if foreground:
        classes = [int(c) for c in torch.unique(label).tolist() if c > 0]
        if classes:
            c = classes[int(torch.randint(len(classes), (), generator=generator))]
            voxels = torch.nonzero(label == c)
            voxel = voxels[int(torch.randint(len(voxels), (), generator=generator))].tolist()
            start = [max(lo, v - s // 2) for lo, v, s in zip(lbs, voxel, size, strict=True)]
    if start is None:
        start = [int(torch.randint(lo, hi + 1, (), generator=generator)) for lo, hi in zip(lbs, ubs, strict=True)]
    return _crop_pad(image, start, size), _crop_pad(label[None], start, size)[0]


def _crop_pad(x: torch.Tensor, start: Sequence[int], size: Sequence[int]) -> torch.Tensor:
    """``x[:, start:start + size]`` per spatial axis, zeros where the box leaves ``x`` (a view when inside)."""
    shape = x.shape[1:]
    lo = [max(0, a) for a in start]
    hi = [min(n, a + s) for n, a, s in zip(shape, start, size, strict=True)]
    out = x[(slice(None),) + tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))]
    pad = [p for a, s, lo_, hi_ in reversed(list(zip(start, size, lo, hi, strict=True)))
           for p in (lo_ - a, a + s - hi_)]
    return F.pad(out, pad) if any(pad) else out


class RandPatch(RandomTransform):
    """The training crop of a cached volume, drawn per item from ``(seed, epoch, index)``. Runs where
    the cached tensors live: a ``gpu`` cache crops on the GPU.

    Per item, not batched: volumes differ in shape, so they cannot be stacked before the crop. With
    ``oversample="batch_tail"`` the cache gives the item its batch position (``SLOT_KEY``, from the
    sampler's order); an item read outside a loader (no position) falls back to the probability.
    """

    def __init__(self, patch_size: Sequence[int], pos_fraction: float, oversample: str = "random",
                 placement: str = "monai", final_size: Sequence[int] | None = None):
        if oversample not in OVERSAMPLING:
            raise ConfigError(f"data.args.oversample: {oversample!r}; valid: {', '.join(OVERSAMPLING)}")
        if placement not in PLACEMENTS:
            raise ConfigError(f"data.args.placement: {placement!r}; valid: {', '.join(PLACEMENTS)}")
        if not 0.0 <= pos_fraction <= 1.0:
            raise ConfigError(f"data.args.pos_fraction: {pos_fraction!r}; a probability in [0, 1]")
        self.patch_size, self.pos_fraction = tuple(patch_size), pos_fraction
        self.oversample, self.placement = oversample, placement
        self.final_size = tuple(final_size) if final_size else None  # nnunet placement: nnunet_patch's final_size

    @property
    def batch_slot(self) -> bool:
        """Whether the cache must pass this item's batch position (``SLOT_KEY``)."""
        return self.oversample == "batch_tail"

    def __call__(self, item: dict[str, Any], generator: torch.Generator) -> dict[str, Any]:
        item = dict(item)
        slot = item.pop(SLOT_KEY, None)
        force = forced_foreground(slot, self.pos_fraction) if slot is not None else None
        if self.placement == "uniform":
            image, label = uniform_patch(item["image"], item["label"], self.patch_size, generator)
        elif self.placement == "nnunet":
            want = float(torch.rand((), generator=generator)) < self.pos_fraction
            image, label = nnunet_patch(item["image"], item["label"], self.patch_size,
                                        want if force is None else force, generator, self.final_size)
        else:
            image, label = random_patch(item["image"], item["label"], self.patch_size, self.pos_fraction,
                                        generator, force)
        # contiguous copies: the cached volume stays untouched and collation is one memcpy
        return {**item, "image": image.contiguous(), "label": label.long()}
