"""Smart cache (a sliding window replaced by a background thread) and the per-rank partition cache.

``SmartCacheDataset`` trains each epoch on ``cache_num`` cached items while a background thread
prepares the ``ceil(cache_num * replace_rate)`` items that enter the window next epoch (Clara
SmartCache, MONAI ``SmartCacheDataset``; seed 003's five-image example: epoch e uses items
``e*R .. e*R + cache_num - 1`` modulo the dataset length).

``PartitionCacheDataset`` places one partition of the data on a device once: the GPU for
``data.cache: gpu``, host memory for ``gpu`` on a CPU and for ``ram`` under DDP. In DDP rank r holds
partition ``(r + epoch) % world_size``: partitions are disjoint, together they are the whole
dataset every epoch, and they rotate between ranks from epoch to epoch so no rank is tied to one
subset (the MONAI recipe fixes it per rank). A rotation re-uploads 1/world_size of the data from
the host source (cheap from a RAM or node-shared cache).
"""
from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import torch
from torch.utils.data import Dataset

from fastvision.data import transforms as T
from fastvision.data.cache.datasets import (
    _Cached,
    available_ram,
    fill,
    finish,
    guard,
    item_nbytes,
)
from fastvision.data.loader import _move
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
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist() if shuffle else list(range(n))
        self.workers = num_workers
        self.epoch = 0
        self.window = self.indices(0)
        self.store = dict(zip(self.window, fill(self._compute, self.window, num_workers, progress, "smart cache")))
        self.num_cached = self.cache_num
        self._pool = ThreadPoolExecutor(max(1, num_workers), thread_name_prefix="fastvision-smartcache")
        self._pending: tuple[int, Future] | None = None
        self._prepare(1)

    def indices(self, epoch: int) -> list[int]:
        """Base indices trained on in ``epoch``."""
        n = len(self.order)
        return [self.order[(epoch * self.replace_num + j) % n] for j in range(self.cache_num)]

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
        have.update(zip(missing, fill(self._compute, missing, self.workers, False, "")))
        self.store, self.window, self.epoch = have, window, epoch
        self._prepare(epoch + 1)

    def __len__(self) -> int:
        return self.cache_num

    def _cached(self, j: int) -> dict[str, Any]:
        return self.store[self.window[j]]

    def __getitem__(self, j: int) -> dict[str, Any]:
        return self.finish(self._cached(j), self.window[j])  # draws keyed by the base index

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def partitions(n: int, world_size: int, seed: int = 0) -> list[list[int]]:
    """Split a seeded permutation of ``range(n)`` into ``world_size`` equal parts (the last few
    items wrap around so every rank has ``ceil(n / world_size)`` and takes as many steps)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    per = math.ceil(n / world_size)
    padded = (perm * (1 + per * world_size // max(n, 1)))[:per * world_size]
    return [padded[p * per:(p + 1) * per] for p in range(world_size)]


class PartitionCacheDataset(Dataset):
    """This rank's partition of ``source`` held on ``device`` (CUDA or CPU); ``set_epoch`` rotates
    partitions.

    Random transforms (``suffix``) run per access on the cached tensors, so on CUDA the
    foreground-biased crop of a cached volume runs on the GPU (MONAI: CacheDataset + ToDeviced +
    RandCropByPosNegLabeld); their generator is keyed by the source index, not the position in
    the partition.

    Args:
        source: dataset whose items are already preprocessed (e.g. a :class:`CacheDataset`).
        device: where to keep the tensors.
        rank, world_size: this process's place in DDP.
        seed: partition seed (same on all ranks) and seed of the suffix's draws.
        rotate: rank r holds partition (r + epoch) % world_size; else always partition r.
        budget_bytes: device memory allowed (default ``memory_fraction`` of free memory); items
            that do not fit stay in host RAM (read once, copied per access) on CUDA, and are read
            from ``source`` on every access on the CPU, with a warning.
        suffix: random transforms applied on every access.
    """

    def __init__(self, source: Dataset, device: torch.device | str, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, rotate: bool = True, budget_bytes: int | None = None,
                 memory_fraction: float = 0.8, suffix: Sequence[T.TransformFn] = ()):
        self.source, self.device = source, torch.device(device)
        self.rank, self.world_size, self.rotate = rank, world_size, rotate
        self.parts = partitions(len(source), world_size, seed)
        self.budget_bytes, self.memory_fraction = budget_bytes, memory_fraction
        self.suffix, self.seed, self.epoch = list(suffix), seed, 0
        self.part_id = -1
        self.items: list[Any] = []
        self.set_epoch(0)

    def partition_id(self, epoch: int) -> int:
        return (self.rank + epoch) % self.world_size if self.rotate else self.rank

    def indices(self) -> list[int]:
        """Source indices served this epoch."""
        return self.parts[self.part_id]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        pid = self.partition_id(epoch)
        if pid == self.part_id:
            return
        self.items = []  # free the old partition before placing the new one
        idx = self.parts[pid]
        first = self.source[idx[0]]
        if self.budget_bytes is not None:
            budget = self.budget_bytes
        elif self.device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(self.device)[0] * self.memory_fraction)
        else:
            budget = int(available_ram() * self.memory_fraction)
        n = guard(len(idx), item_nbytes(first), budget, f"PartitionCacheDataset on {self.device}")
        # beyond the budget: on CUDA the items wait in host RAM; on the CPU that would be the same
        # memory the budget just refused, so they are read from the source on every access
        held = len(idx) if self.device.type != "cpu" else n
        for k, i in enumerate(idx[:held]):  # each item read once, moved as it is read
            item = first if k == 0 else self.source[i]
            self.items.append(_move(item, self.device) if k < n else item)
        self.num_cached, self.part_id = n, pid

    def __len__(self) -> int:
        return len(self.parts[0])

    def __getitem__(self, j: int) -> dict[str, Any]:
        if j < self.num_cached:
            item = self.items[j]
        elif j < len(self.items):  # did not fit on the device: held in host RAM
            item = _move(self.items[j], self.device)
        else:  # did not fit in the CPU budget: read (the source's pipeline) on every access
            item = self.source[self.indices()[j]]
        return finish(self.suffix, item, self.seed, self.epoch, self.indices()[j])
