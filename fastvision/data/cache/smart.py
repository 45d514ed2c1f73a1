"""Smart cache: a sliding window of the items, replaced by a background thread.

``SmartCacheDataset`` trains each epoch on ``cache_num`` cached items while a background thread
prepares the ``ceil(cache_num * replace_rate)`` items that enter the window next epoch (Clara
SmartCache, MONAI ``SmartCacheDataset``; seed 003's five-image example: epoch e uses items
``e*R .. e*R + cache_num - 1`` modulo the dataset length).

**Not a speed switch when the window is smaller than the dataset** (``cache_num < len``): an epoch
then trains on the window only, so the samples differ from every other ``data.cache``. With the
whole dataset in the window (MONAI's default, ``data.cache: smart`` alone) position ``j`` of the
window is item ``j`` (the window is kept in index order), and the cache serves exactly what
``none`` serves. The device cache (``data.cache: gpu``) is :mod:`fastvision.data.cache.device`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import Dataset

from fastvision.data import transforms as T
from fastvision.data.cache.datasets import _Cached, fill, finish
from fastvision.errors import ConfigError


class SmartCacheDataset(_Cached):
    """Sliding-window cache of ``cache_num`` items; ``set_epoch(e)`` swaps in the prepared ones.

    Args:
        base: dataset of dict items.
        pipeline: transforms; the prefix before the first ``random`` one is cached.
        cache_num: items per epoch (capped at ``len(base)``).
        replace_rate: fraction of the window replaced per epoch (> 0).
        num_workers: threads for the initial fill and for replacements.
        shuffle: shuffle the item order once by ``seed`` before windowing.
    """

    def __init__(self, base: Dataset, pipeline: Sequence[T.TransformFn], *, cache_num: int,
                 replace_rate: float, num_workers: int = 1, shuffle: bool = False, seed: int = 0,
                 progress: bool = True):
        super().__init__(base, pipeline)
        if not 0 < replace_rate <= 1 or cache_num < 1:
            raise ConfigError(f"smart cache: need cache_num >= 1 and 0 < replace_rate <= 1, "
                              f"got {cache_num}, {replace_rate}")
        n = len(base)
        self.cache_num = min(cache_num, n)
        self.replace_num = min(math.ceil(self.cache_num * replace_rate), n)
        self.order = (torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist() if shuffle
                      else list(range(n)))
        self.workers = num_workers
        self.epoch = 0
        self.window = self.indices(0)
        self.store = dict(zip(self.window, fill(self._compute, self.window, num_workers, progress, "smart cache"),
                              strict=True))
        self.num_cached = self.cache_num
        self._pool = ThreadPoolExecutor(max(1, num_workers), thread_name_prefix="fastvision-smartcache")
        self._pending: tuple[int, Future] | None = None
        self._prepare(1)

    def indices(self, epoch: int) -> list[int]:
        """Base indices trained on in ``epoch``, in index order: window position ``j`` is the
        ``j``-th smallest (the sampler shuffles positions; with the whole dataset in the window,
        position ``j`` is item ``j``, as uncached)."""
        n = len(self.order)
        return sorted(self.order[(epoch * self.replace_num + j) % n] for j in range(self.cache_num))

    def _prepare(self, epoch: int) -> None:
        missing = [i for i in self.indices(epoch) if i not in self.store]
        fut = self._pool.submit(lambda: {i: self._compute(i) for i in missing})
        self._pending = (epoch, fut)

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch``'s window current (blocks until its replacements are ready)."""
        if epoch == self.epoch:
            return
        super().set_epoch(epoch)  # the suffix's draws
        ready: dict[int, Any] = {}
        if self._pending is not None and self._pending[0] == epoch:
            ready = self._pending[1].result()
        window = self.indices(epoch)
        have = {i: self.store[i] if i in self.store else ready.get(i) for i in window}
        missing = [i for i, v in have.items() if v is None]  # jumped epochs: compute here
        have.update(zip(missing, fill(self._compute, missing, self.workers, False, ""), strict=True))
        self.store, self.window, self.epoch = have, window, epoch
        self._prepare(epoch + 1)

    def __len__(self) -> int:
        return self.cache_num

    def _cached(self, j: int) -> dict[str, Any]:
        return self.store[self.window[j]]

    def __getitem__(self, j: int) -> dict[str, Any]:
        # draws keyed by the base index, the batch position by the loader's index
        return finish(self.suffix, self._cached(j), self.seed, self.epoch, self.window[j], self.slot(j))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
