"""Per-sample random draws of the batched augmentation from ``(seed, epoch, sample index)``:
``train.augment_rng: sample``.

With ``train.augment_rng: rank`` (the default) the batched ops draw their per-sample parameters from
one generator per rank, ``B`` values a call: which values sample ``i`` gets depends on its place in
its rank's batch, so the same global batch split over another number of ranks is augmented
otherwise. With ``sample`` every sample carries a key, a 64-bit mix of ``(train.seed, epoch,
dataset index, patch)`` made where the item is read (:class:`KeyedItems`), and seeds a SplitMix64
stream of its own; each draw is the stream's output at (the op's call number, element), one hash
that any output can be computed with directly: a sample is augmented the same way
whatever batch, rank or world size it lands in. With the sampler's world-size-independent order
(:class:`~fastvision.distributed.samplers.TrainSampler`) the global batches of 1 process x batch 8
and 4 ranks x batch 2 then hold the same augmented samples, and a resume on another world size
continues the augmentation exactly (with ``rank`` each rank's stream restarts from (seed, rank, step)).

The hash is splitmix64's finaliser over unsigned 64-bit numpy integers (wrapping multiplication and
logical shifts are defined there), on the host: the draws are a few numbers a sample, the same on a
CPU and a GPU, and they reach the device as the per-rank draws do (one non-blocking copy). Full-size
noise is drawn per sample from a device generator seeded from the sample's key.
"""
from __future__ import annotations

from typing import Any

import numpy as np

SAMPLE_KEY = "sample_key"  # the batch's (B,) int64 keys, kept on the host by Task.to_device

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment


def splitmix64(z: int) -> int:
    """splitmix64's finaliser of a Python integer (mod 2**64): the reference the array version matches."""
    z = (z + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def sample_key(seed: int, epoch: int, index: int, patch: int = 0) -> int:
    """The key of dataset item ``index``'s ``patch``-th patch in ``epoch`` of a run seeded ``seed``:
    a non-negative int64 (so a torch tensor holds it)."""
    z = splitmix64((seed & 0xFFFFFFFF) << 32 | (epoch & 0xFFFFFFFF))
    z = splitmix64(z ^ (index & _M64))
    return splitmix64(z ^ patch) >> 1


_U_GOLDEN, _U_M1, _U_M2 = np.uint64(_GOLDEN), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_U27, _U30, _U31, _U40 = (np.uint64(s) for s in (27, 30, 31, 40))


def _mix(z: np.ndarray) -> np.ndarray:
    """:func:`splitmix64` over a uint64 array (numpy's unsigned arithmetic wraps; its shifts are logical)."""
    with np.errstate(over="ignore"):
        z = z + _U_GOLDEN
        z = (z ^ (z >> _U30)) * _U_M1
        z = (z ^ (z >> _U27)) * _U_M2
    return z ^ (z >> _U31)


def uniform(keys: np.ndarray, call: int, n: int) -> np.ndarray:
    """(B, n) float32 in [0, 1): element ``e`` of draw number ``call`` for each sample, the top 24 bits
    of output ``call * 2**24 + e + 1`` of SplitMix64 seeded with the sample's key (its ``k``-th output
    is the finaliser of ``key + (k - 1) * golden``, so any output is one hash, in any order), exact in
    float32. Each sample has a stream of its own; a draw of up to 2**24 numbers never reaches the next."""
    with np.errstate(over="ignore"):
        steps = (np.arange(call << 24, (call << 24) + n, dtype=np.uint64)) * _U_GOLDEN
        z = _mix(keys.astype(np.uint64, copy=False)[:, None] + steps)
    return (z >> _U40).astype(np.float32) * np.float32(2.0 ** -24)


def echo_keys(keys, echo: int):
    """The keys of the ``echo``-th yield of a batch under data echoing (``data.repeats``; echo 0 keeps
    its keys): each sample's key mixed with the echo number, an int64 tensor as ``keys``."""
    import torch

    z = _mix(keys.numpy().astype(np.uint64) ^ np.uint64(splitmix64(echo)))
    return torch.from_numpy((z >> np.uint64(1)).astype(np.int64))


def seed_of(key: int, call: int) -> int:
    """A generator seed for sample ``key``'s full-size draw at call number ``call``."""
    return splitmix64(splitmix64(key) ^ (call + 1)) >> 1


class KeyedItems:
    """The training set with each item's key (:func:`sample_key`) under :data:`SAMPLE_KEY`; an item of
    several patches (``SAMPLES_KEY``) gets one per patch. Indexed, sized and epoch-set as ``dataset``
    (``set_epoch`` also moves the keys to the epoch); batched reads (``__getitems__``) pass through."""

    def __init__(self, dataset: Any, seed: int):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:  # the wrapped set's other attributes (info, epoch_order, ...)
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _keyed(self, i: int, item: dict[str, Any]) -> dict[str, Any]:
        from fastvision.data.transforms import SAMPLES_KEY

        if SAMPLES_KEY in item:
            patches = [{**p, SAMPLE_KEY: sample_key(self.seed, self.epoch, i, j)}
                       for j, p in enumerate(item[SAMPLES_KEY])]
            return {**item, SAMPLES_KEY: patches}
        return {**item, SAMPLE_KEY: sample_key(self.seed, self.epoch, i)}

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._keyed(int(i), self.dataset[i])

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        if hasattr(self.dataset, "__getitems__"):
            items = self.dataset.__getitems__(indices)
        else:
            items = [self.dataset[i] for i in indices]
        return [self._keyed(int(i), item) for i, item in zip(indices, items, strict=True)]
