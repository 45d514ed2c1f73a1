"""Batched random augmentation for 2-D and 3-D images, run per batch on the batch's device.

Replaces per-sample CPU transforms (MONAI ``Rand*d``, DALI in seed 004): every op draws one random
parameter per sample, then transforms the whole batch with tensor ops (gather, flip/rot90 under a
mask, one ``grid_sample``), so there is no Python loop over samples and no host sync.

Randomness: small per-sample parameters are drawn from the caller's ``torch.Generator`` on its own
device, in a fixed order whether or not an op fires, so a seed gives the same augmentation on CPU
and GPU. Full-size noise is drawn from a device generator seeded from the caller's generator.
Given per-sample keys instead (``train.augment_rng: sample``, :mod:`fastvision.data.augment.keyed`),
every draw of sample ``i`` is a hash of its key and the draw's number: the same whatever batch it is in.

Recipe form (``data.augment``), one dict per op, applied in this order (an affine with ``size``, which cuts
the network's patch from a larger one, right after the crop)::

    crop: {size: [96, 96, 96], pos: 1, neg: 1}   # foreground-biased when pos + neg > 0
    flip: {prob: 0.5, axes: [0, 1, 2]}           # each spatial axis independently
    rot90: {prob: 0.5}                           # in the plane of the last two spatial axes
    affine: {prob: 0.2, degrees: 15, scale: [0.9, 1.1]}   # also rotate_axes, zoom_axes, same_zoom, *_prob,
                                                          # sampling_scale, size, label_mode,
                                                          # label_classes, compiled
    intensity: {prob: 0.5, scale: 0.1, shift: 0.1}
    foreground_shift: {prob: 0.5, range: [0.9, 1.1]}  # seed 000: per channel, added to the voxels above 0
    noise: {prob: 0.15, std: 0.1}
    blur: {prob: 0.2, sigma: [0.5, 1.0], channel_prob: 0.5}          # degrade.py
    brightness: {prob: 0.15, factor: 0.25}
    contrast: {prob: 0.15, factor: 0.25}
    lowres: {prob: 0.25, range: [0.5, 1.0], channel_prob: 0.5}        # degrade.py
    gamma_inverted: {prob: 0.1, range: [0.7, 1.5], retain_stats: true}
    gamma: {prob: 0.15, range: [0.7, 1.5]}                  # also per_channel, retain_stats
    color_jitter: {prob: 0.8, brightness: 0.4, contrast: 0.4, saturation: 0.4, hue: 0.1}
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fastvision.data.augment import keyed
from fastvision.data.augment.affine import Affine, _const, affine  # noqa: F401 (affine: re-exported)
from fastvision.data.augment.checks import _validate
from fastvision.data.augment.degrade import Blur, LowResolution
from fastvision.data.augment.intensity import (
    Brightness,
    ColorJitter,
    Contrast,
    ForegroundShift,
    Gamma,
    Intensity,
    InvertedGamma,
    Label,
    Noise,
    _select,
    owned,
)
from fastvision.errors import ConfigError
from fastvision.registry import check_kwargs


class _Rng:
    """Per-call random source: per-sample parameters on the generator's device, moved to ``device``."""

    def __init__(self, generator: torch.Generator | None, batch: int, device: torch.device,
                 keys: Tensor | None = None):
        self.gen = generator
        self.batch = batch
        self.device = device
        self._dev_gen: torch.Generator | None = None
        # per-sample keys (host int64): each draw a hash of (key, call number), not the generator's
        self.keys = None if keys is None else keys.detach().cpu().numpy().astype(np.uint64)
        if self.keys is not None and len(self.keys) != batch:
            raise ValueError(f"{len(self.keys)} sample keys for a batch of {batch}")
        self.calls = 0
        # the storages of the caller's tensors, never updated in place (None: unknown, nothing is)
        self.caller: set[int] | None = None

    def owns(self, x: Tensor) -> bool:
        """True when ``x`` is not (a view of) one of the caller's tensors: an earlier op of this call made
        it, and no one else holds it, so a later op may update it in place."""
        return self.caller is not None and x.untyped_storage().data_ptr() not in self.caller

    def uniform(self, lo: float, hi: float, *shape: int) -> Tensor:
        """(B, *shape) float32 uniform in [lo, hi) on the data device."""
        if self.keys is not None:
            self.calls += 1
            u = torch.from_numpy(keyed.uniform(self.keys, self.calls, math.prod(shape))).view(self.batch, *shape)
            gdev = torch.device("cpu")
        else:
            gdev = self.gen.device if self.gen is not None else torch.device("cpu")
            u = torch.rand((self.batch, *shape), generator=self.gen, device=gdev)
        u = u.mul_(hi - lo).add_(lo)  # lo + (hi - lo) u, the same float32 operations, no new tensors
        return u if gdev == self.device else u.to(self.device, non_blocking=True)

    def mask(self, prob: float) -> Tensor:
        """(B,) bool: which samples this op is applied to."""
        return self.uniform(0.0, 1.0) < prob

    def reserve(self) -> int:
        """A draw number for a later :meth:`normal_rows`, taken whether or not any row fires (so the
        draws after it keep their numbers). Without keys: the device generator made now, where its seed
        is drawn from the caller's generator whether or not a row fires."""
        if self.keys is None:
            self.device_generator()
        self.calls += 1
        return self.calls

    def normal_rows(self, rows: list[int], shape: tuple[int, ...], dtype: torch.dtype, call: int) -> Tensor:
        """(len(rows), *shape) standard normal noise on the data device for the batch rows ``rows``:
        one draw from :meth:`device_generator`, or with keys one generator per row seeded from its key
        and ``call`` (:meth:`reserve`)."""
        if self.keys is None:
            return torch.randn((len(rows), *shape), generator=self.device_generator(), device=self.device, dtype=dtype)
        out = torch.empty((len(rows), *shape), device=self.device, dtype=dtype)
        for j, i in enumerate(rows):
            g = torch.Generator(device=self.device).manual_seed(keyed.seed_of(int(self.keys[i]), call))
            out[j].normal_(generator=g)
        return out

    def device_generator(self) -> torch.Generator | None:
        """A generator on the data device, seeded from the caller's (drawn on its device, no sync)."""
        if self.gen is None or self.gen.device == self.device:
            return self.gen
        if self._dev_gen is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.gen, device=self.gen.device))
            self._dev_gen = torch.Generator(device=self.device).manual_seed(seed)
        return self._dev_gen


# ---------------------------------------------------------------- geometric ops


@dataclass
class Crop:
    """Random crop to ``size``; with ``pos``/``neg`` > 0 the centre is a random foreground voxel
    with probability pos / (pos + neg), else a random background voxel (MONAI
    ``RandCropByPosNegLabel``). Foreground is ``label > 0`` (any channel for float labels). A sample
    with no candidate voxel falls back to any voxel. Images smaller than ``size`` are zero-padded.
    """

    size: list[int]
    pos: float = 0.0
    neg: float = 0.0

    def __call__(self, image: Tensor, label: Label, rng: _Rng) -> tuple[Tensor, Label]:
        nd = len(self.size)
        image, label = _pad_to(image, label, self.size)
        spatial = image.shape[2:]
        B = image.shape[0]
        size = _const(tuple(self.size), image.device, torch.int64)
        room = _const(tuple(spatial), image.device, torch.int64) - size + 1
        u_axes = rng.uniform(0.0, 1.0, nd)
        u_pos, u_pick = rng.uniform(0.0, 1.0), rng.uniform(0.0, 1.0)
        start = (u_axes * room).long().clamp_max(room - 1)  # (B, nd) uniform crop
        if self.pos + self.neg > 0 and label is not None:
            fg = (label > 0).flatten(1) if label.dim() == nd + 1 else (label > 0).any(1).flatten(1)
            want_pos = u_pos < self.pos / (self.pos + self.neg)
            cand = torch.where(want_pos[:, None], fg, ~fg)
            count = cand.sum(1)
            cand = cand | (count == 0)[:, None]
            count = cand.sum(1)
            k = (u_pick * count).long().clamp_max(count - 1)
            flat = torch.searchsorted(cand.cumsum(1), (k + 1)[:, None]).squeeze(1)
            centre = _unravel(flat, spatial)
            start = (centre - size // 2).clamp(min=torch.zeros_like(room), max=room - 1)
        idx = _window_index(start, self.size, spatial)  # (B, N_crop)
        image = image.flatten(2).gather(2, idx[:, None].expand(B, image.shape[1], -1))
        image = image.reshape(B, -1, *self.size)
        if label is not None:
            if label.dim() == nd + 1:
                label = label.flatten(1).gather(1, idx).reshape(B, *self.size)
            else:
                label = label.flatten(2).gather(2, idx[:, None].expand(B, label.shape[1], -1))
                label = label.reshape(B, -1, *self.size)
        return image, label


def _pad_to(image: Tensor, label: Label, size: list[int]) -> tuple[Tensor, Label]:
    spatial = image.shape[2:]
    if all(s >= c for s, c in zip(spatial, size, strict=True)):
        return image, label
    pad: list[int] = []
    for s, c in reversed(list(zip(spatial, size, strict=True))):  # F.pad lists the last dim first
        extra = max(c - s, 0)
        pad += [extra // 2, extra - extra // 2]
    image = F.pad(image, pad)
    if label is not None:
        label = F.pad(label, pad)
    return image, label


def _unravel(flat: Tensor, shape: torch.Size) -> Tensor:
    """(B,) flat indices -> (B, nd) coordinates."""
    coords = []
    for s in reversed(shape):
        coords.append(flat % s)
        flat = flat // s
    return torch.stack(coords[::-1], 1)


def _window_index(start: Tensor, size: list[int], spatial: torch.Size) -> Tensor:
    """Flat indices (B, prod(size)) of the windows ``start`` (B, nd) + size in a ``spatial`` grid."""
    nd = len(size)
    B = start.shape[0]
    idx = torch.zeros((B,) + (1,) * nd, dtype=torch.long, device=start.device)
    stride = 1
    for a in reversed(range(nd)):
        shape = [1] * (nd + 1)
        shape[a + 1] = size[a]
        ar = torch.arange(size[a], device=start.device).reshape(shape)
        idx = idx + (start[:, a].reshape((B,) + (1,) * nd) + ar) * stride
        stride *= spatial[a]
    return idx.reshape(B, -1)


@dataclass
class Flip:
    """Flip each spatial axis in ``axes`` (default all) independently with probability ``prob``."""

    prob: float = 0.5
    axes: list[int] | None = None

    def __call__(self, image: Tensor, label: Label, rng: _Rng) -> tuple[Tensor, Label]:
        nd = image.dim() - 2
        dims = [a - nd for a in (self.axes if self.axes is not None else range(nd))]  # negative: images and labels
        masks = [rng.mask(self.prob) for _ in dims]
        if image.device.type == "cpu":  # one flip per sample over all its drawn axes (free to read on the CPU)
            per_sample = [[d for d, f in zip(dims, fires, strict=True) if f]
                          for fires in torch.stack(masks, 1).tolist()]
            if not any(per_sample):
                return image, label
            return _flip_rows(image, per_sample, rng), None if label is None else _flip_rows(label, per_sample, rng)
        for m, d in zip(masks, dims, strict=True):
            image = _select(m, image.flip(d), image)
            if label is not None:
                label = _select(m, label.flip(d), label)
        return image, label


def _flip_rows(x: Tensor, per_sample: list[list[int]], rng: _Rng) -> Tensor:
    """(B, ...) ``x`` with sample i flipped over ``per_sample[i]`` (negative dims; empty: as it is). One flip
    of the batch where every sample draws the same axes; else each sample's flip copied into its row of ``x``
    itself where this call owns it (:func:`~fastvision.data.augment.intensity.owned`), or of one new tensor.
    In place it takes 0.55x the CPU time of a stack of per-sample flips on 64^3 two-channel samples; into a new
    tensor (the flip as the pipeline's first op) about the same (``benchmarks/aug_cpu_paths.py``)."""
    if all(d == per_sample[0] for d in per_sample):
        return x.flip(per_sample[0])
    own = owned(rng, x)
    out = x if own else torch.empty_like(x, memory_format=torch.contiguous_format)
    for i, d in enumerate(per_sample):
        if d:
            out[i].copy_(x[i].flip(d))  # the flip is a new tensor: copying it back over x[i] is safe
        elif not own:
            out[i].copy_(x[i])
    return out


@dataclass
class Rot90:
    """Rotate by k * 90 degrees in the plane of the last two spatial axes, k in {1, 2, 3}.
    For a non-square plane only k = 2 keeps the shape, so only that is used."""

    prob: float = 0.5

    def __call__(self, image: Tensor, label: Label, rng: _Rng) -> tuple[Tensor, Label]:
        m = rng.mask(self.prob)
        k = (rng.uniform(0.0, 3.0).long().clamp_max(2) + 1) * m  # 0 where not applied
        square = image.shape[-1] == image.shape[-2]
        out_i, out_l = image, label
        for kk in (1, 2, 3) if square else (2,):
            sel = k == kk if square else k > 0
            out_i = _select(sel, torch.rot90(image, kk, (-2, -1)), out_i)
            if label is not None:
                out_l = _select(sel, torch.rot90(label, kk, (-2, -1)), out_l)
        return out_i, out_l


def _narrow(label: Label, nd: int) -> Label:
    """Class-index labels of 0..255 on the CPU as uint8 while they are flipped, cropped and resampled: an
    8th of int64's bytes to move (given back in the caller's dtype at the end). On a GPU asking the range
    would be a host sync, so they stay as they are."""
    if label is None or label.device.type != "cpu" or label.dim() != nd + 1 or label.dtype.is_floating_point \
            or label.dtype == torch.uint8 or label.numel() == 0:
        return label
    lo, hi = torch.stack(label.aminmax()).tolist()  # a CPU tensor's tolist: no value read the sync detector sees
    return label.to(torch.uint8) if 0 <= lo and hi < 256 else label


OPS: dict[str, type] = {
    "crop": Crop, "flip": Flip, "rot90": Rot90, "affine": Affine, "intensity": Intensity,
    "foreground_shift": ForegroundShift, "noise": Noise,
    "blur": Blur, "brightness": Brightness, "contrast": Contrast, "lowres": LowResolution,
    "gamma_inverted": InvertedGamma, "gamma": Gamma, "color_jitter": ColorJitter,
}


class BatchAugment:
    """A fixed sequence of batched ops.

    Args:
        spatial_dims: 2 or 3.
        ops: (name, op) pairs in application order.
    """

    def __init__(self, spatial_dims: int, ops: list[tuple[str, Any]]):
        self.spatial_dims = spatial_dims
        self.ops = ops
        # labels are narrowed for the ops that move them (an intensity-only chain leaves them alone)
        self.moves_label = any(isinstance(op, (Crop, Flip, Rot90, Affine)) for _, op in ops)

    def __call__(self, image: Tensor, label: Label = None, generator: torch.Generator | None = None,
                 keys: Tensor | None = None) -> tuple[Tensor, Label]:
        """Augment a batch on its device.

        Args:
            image: (B, C, *S) float, S of length ``spatial_dims``.
            label: (B, *S) int64 class indices, (B, L, *S) float masks, or None.
            generator: source of all randomness; same seed and inputs give the same output.
            keys: (B,) int64 per-sample keys (:func:`fastvision.data.augment.keyed.sample_key`): the
                source of all randomness instead of ``generator``; a sample's output then depends only
                on its own key and values, not on the rest of the batch.

        Returns:
            (image, label) with the crop's spatial size if a crop is configured.
        """
        if image.dim() != self.spatial_dims + 2:
            raise ValueError(f"expected (B, C, *S) with {self.spatial_dims} spatial dims, got {tuple(image.shape)}")
        if label is not None and label.shape[-self.spatial_dims:] != image.shape[2:]:
            raise ValueError(f"label {tuple(label.shape)} does not match image {tuple(image.shape)}")
        rng = _Rng(generator, image.shape[0], image.device, keys)
        rng.caller = {t.untyped_storage().data_ptr() for t in (image, label) if t is not None}
        dtype = label.dtype if label is not None else None
        label = _narrow(label, self.spatial_dims) if self.moves_label else label
        for _, op in self.ops:
            image, label = op(image, label, rng)
        return image, label if label is None else label.to(dtype)

    def __repr__(self) -> str:
        return f"BatchAugment({', '.join(f'{n}={op}' for n, op in self.ops)})"


def build_augment(spatial_dims: int, **spec: dict[str, Any]) -> BatchAugment | None:
    """Build the batched augmentation from the recipe's ``data.augment`` dict.

    Args:
        spatial_dims: 2 or 3.
        **spec: op name -> op options (see the module docstring); a ``None`` value disables the op.

    Returns:
        BatchAugment applying the ops in canonical order, or None when no op is configured.

    Raises:
        ConfigError: unknown op or option, wrong type, or a value out of range.
    """
    if spatial_dims not in (2, 3):
        raise ConfigError(f"spatial_dims must be 2 or 3, got {spatial_dims}")
    for key in spec:
        if key not in OPS:
            raise ConfigError(f"unknown key data.augment.{key}; valid keys: {', '.join(OPS)}")
    ops = []
    for name, cls in OPS.items():
        opts = spec.get(name)
        if opts is None:
            continue
        if not isinstance(opts, dict):
            raise ConfigError(f"data.augment.{name}: expected a dict of options, got {opts!r}")
        check_kwargs(cls, opts, f"data.augment.{name}")
        try:
            op = cls(**opts)
        except TypeError as e:  # a required option is missing
            raise ConfigError(f"data.augment.{name}: {e}") from None
        _validate(name, op, spatial_dims)
        ops.append((name, op))
    names = [n for n, _ in ops]
    if "affine" in names and ops[names.index("affine")][1].size is not None:
        # it cuts the network's patch from a larger one: before the flip and rot90 (nnU-Net's order, spatial
        # first), so they move the smaller patch
        ops.insert(names.index("crop") + 1 if "crop" in names else 0, ops.pop(names.index("affine")))
    return BatchAugment(spatial_dims, ops) if ops else None
