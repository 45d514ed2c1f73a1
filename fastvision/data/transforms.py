"""Deterministic item transforms and their signatures, the unit the caches key on.

A pipeline is a list of callables ``item dict -> item dict``. Its *deterministic prefix* (every
transform before the first one marked ``random = True``) is what the caches in
:mod:`fastvision.data.cache.datasets` run once. Unlike MONAI, a plain function does not silently end the
prefix: it counts as deterministic unless marked, and the cache reports where the prefix ends.

The signature of a transform names its class and parameters (dataclass fields or ``__dict__``), or
for a plain function its qualified name and source; a persistent cache is keyed on it, so changing a
parameter or the code of a function invalidates old entries.

Random transforms (:class:`RandomTransform`) take ``(item, generator)``. The generator is made
per item by :func:`item_generator` from ``(seed, epoch, sample index)``, never torch's global
one, so an augmented item does not depend on which loader thread or process built it, how many
there are, the world size, or what else drew random numbers meanwhile; a resumed run redraws
exactly what the uninterrupted run drew. :func:`random_resized_box` is the random-resized-crop
sampler every ImageNet path (Pillow, DALI, the GPU decoder) draws from such a generator;
:func:`random_resized_crop_draws` adds the flip, in the order all of them draw.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fastvision.errors import DataError

Item = dict[str, Any]
TransformFn = Callable[[Item], Item]


class Transform:
    """Optional base class: set ``random = True`` on transforms that must not be cached."""

    random: bool = False

    def __call__(self, item: Item) -> Item:
        raise NotImplementedError

    def signature(self) -> str:
        return _default_signature(self)


class ReadBytes(Transform):
    """An item's encoded file and label, read as they are: ``{"data": uint8 (N,), "label": int, "id":
    path}``, the cacheable first step of every path that decodes later (the Pillow path after its
    random crop has chosen the DCT scale, nvJPEG on the GPU)."""

    def __init__(self, samples: list[tuple[str, int]]):
        self.samples = samples

    def __call__(self, item: Item) -> Item:
        path, label = self.samples[item["index"]]
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot read image ({e})") from e
        return {"data": torch.frombuffer(bytearray(data), dtype=torch.uint8), "label": label, "id": path}

    def signature(self) -> str:
        return "fastvision.imagefolder.read_bytes/v1"  # identity() names the file's state


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, type) or (callable(v) and not hasattr(v, "__dict__")):  # classes, builtins, ufuncs
        return f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', type(v).__qualname__)}"
    if callable(v) or hasattr(v, "__dict__"):  # nested transforms / objects: their own parameters
        return signature(v)
    text = repr(v)
    # A default repr holds a memory address, which would change the signature in every process.
    return f"{type(v).__module__}.{type(v).__qualname__}" if " at 0x" in text else text


def _default_signature(t: Any) -> str:
    cls = type(t)
    params = ({f.name: getattr(t, f.name) for f in dataclasses.fields(t)} if dataclasses.is_dataclass(t)
              else {k: v for k, v in getattr(t, "__dict__", {}).items() if not k.startswith("_")})
    return f"{cls.__module__}.{cls.__qualname__}{json.dumps(_jsonable(params), sort_keys=True)}"


def signature(t: Any) -> str:
    """A string that changes when the transform's class, parameters or function code change."""
    if hasattr(t, "signature") and callable(t.signature):
        return t.signature()
    if isinstance(t, functools.partial):
        return f"partial({signature(t.func)}, {_jsonable(list(t.args))}, {_jsonable(t.keywords)})"
    if inspect.isfunction(t) or inspect.ismethod(t):
        try:
            code = inspect.getsource(t)
        except (OSError, TypeError):  # no source (REPL): fall back to the bytecode
            code = t.__code__.co_code.hex()
        return f"{t.__module__}.{t.__qualname__}:{hashlib.sha256(code.encode()).hexdigest()[:16]}"
    return _default_signature(t)


class RandomTransform(Transform):
    """A per-item random transform: ``__call__(item, generator)`` draws only from ``generator``."""

    random = True

    def __call__(self, item: Item, generator: torch.Generator) -> Item:  # type: ignore[override]
        raise NotImplementedError


def _mix(a: int, b: int) -> int:
    """splitmix64 finalisation of two 32-bit numbers into a 63-bit seed (distinct pairs differ)."""
    mask = (1 << 64) - 1
    z = ((a & 0xFFFFFFFF) << 32 | (b & 0xFFFFFFFF)) & mask
    z = (z + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def item_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s random draws in ``epoch`` of a run seeded ``seed``."""
    m = _mix(seed, epoch)
    return _mix((m ^ (m >> 32)) & 0xFFFFFFFF, index)  # fold 63 bits to 32, then mix in the index


def item_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU generator private to one (seed, epoch, sample index): random transforms draw from it."""
    return torch.Generator().manual_seed(item_seed(seed, epoch, index))


SLOT_KEY = "batch_slot"  # an item's (position in its batch, batch size), for a transform that asks
SAMPLES_KEY = "samples"  # an item made of several samples (k crops of one volume): the collate flattens them


def batch_slots(order: Sequence[int], batch_size: int) -> dict[int, tuple[int, int]]:
    """Dataset index -> (position in its batch, batch size), from one epoch's whole order of this
    rank (the order's first item starts a batch; an index listed twice keeps its first place)."""
    slots: dict[int, tuple[int, int]] = {}
    for pos, i in enumerate(order):
        slots.setdefault(int(i), (pos % batch_size, batch_size))
    return slots


def apply_random(transforms: Sequence[TransformFn], item: Item, generator: torch.Generator) -> Item:
    """Apply ``transforms`` in order; the random ones get ``generator`` (one stream per item)."""
    for t in transforms:
        item = t(item, generator) if is_random(t) else t(item)
    return item


def is_random(t: Any) -> bool:
    return bool(getattr(t, "random", False))


def split(pipeline: Sequence[TransformFn]) -> tuple[list[TransformFn], list[TransformFn]]:
    """(deterministic prefix, rest): the prefix ends at the first transform marked random."""
    for i, t in enumerate(pipeline):
        if is_random(t):
            return list(pipeline[:i]), list(pipeline[i:])
    return list(pipeline), []


def pipeline_signature(transforms: Sequence[TransformFn]) -> str:
    """sha256 hex over the signatures of ``transforms`` in order."""
    h = hashlib.sha256()
    for t in transforms:
        h.update(signature(t).encode())
        h.update(b"\0")
    return h.hexdigest()


def apply(transforms: Sequence[TransformFn], item: Item) -> Item:
    for t in transforms:
        item = t(item)
    return item


def name(t: Any) -> str:
    return getattr(t, "__qualname__", None) or type(t).__name__


def random_resized_box(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float],
                       generator: torch.Generator | None = None) -> tuple[float, float, float, float]:
    """A random crop box ``(left, top, right, bottom)`` with area fraction in ``scale`` and aspect
    (w/h) log-uniform in ``ratio``; falls back to the largest centred box of clamped aspect.
    Draws from ``generator`` (training: the item's generator)."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        u = torch.rand(4, generator=generator).tolist()
        target = area * (scale[0] + u[0] * (scale[1] - scale[0]))
        aspect = math.exp(log_lo + u[1] * (log_hi - log_lo))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = int(u[2] * (width - w + 1))
            top = int(u[3] * (height - h + 1))
            return float(left), float(top), float(left + w), float(top + h)
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return float(left), float(top), float(left + w), float(top + h)


def random_resized_crop_draws(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float],
                              hflip: float, generator: torch.Generator | None = None
                              ) -> tuple[tuple[float, float, float, float], bool]:
    """``(box, flip)`` of one training sample: :func:`random_resized_box`, then the horizontal flip
    (drawn only when ``hflip > 0``), in this order from ``generator``: the draws every ImageNet path
    (Pillow, the GPU decoder) makes for a sample, so the same (seed, epoch, index) crops alike."""
    box = random_resized_box(width, height, scale, ratio, generator)
    flip = hflip > 0 and torch.rand((), generator=generator).item() < hflip
    return box, flip


def center_box(width: int, height: int, resize: int, crop: int) -> tuple[float, float, float, float]:
    """The box of the original image that "shorter side -> ``resize``, centre crop ``crop``" keeps
    (evaluation on every ImageNet path)."""
    s = min(width, height) / resize  # original pixels per resized pixel
    cw, ch = min(crop * s, width), min(crop * s, height)
    left, top = (width - cw) / 2, (height - ch) / 2
    return left, top, left + cw, top + ch
