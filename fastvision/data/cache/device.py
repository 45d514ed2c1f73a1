"""The device cache (``data.cache: gpu``): preprocessed items held on the training device.

Like every cache it is storage keyed by the source index, never an order: item ``i`` of the cache
is item ``i`` of the uncached pipeline (same tensors, same random draws of ``(seed, epoch, i)``),
and the engine's :class:`~fastvision.dist.samplers.TrainSampler` alone decides which items a rank
reads in which order. So switching ``data.cache`` between ``none``, ``ram``, ``disk``, ``shared``
and ``gpu`` changes speed and memory, never a step's samples, at any world size.

Under DDP every rank's device therefore holds every item that fits (a rank reads ``1/world`` of
the items per epoch, a different share every epoch, as the global permutation deals them out):
the device memory a rank needs is a one-process run's. An earlier design held one partition per
rank and served it in its own order; that changed the samples of every step (see
``docs/CONTRACTS.md``, "Caches are speed switches").
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils.data import Dataset

from fastvision.data import transforms as T
from fastvision.data.cache.datasets import available_ram, finish, guard, item_nbytes
from fastvision.data.loader import _move


def fill_order(n: int, rank: int = 0, world_size: int = 1) -> list[int]:
    """``range(n)`` with this rank's stripe (``i % world_size == rank``) first: ranks filling through
    one shared disk cache compute different items first and then read each other's entries."""
    return [i for i in range(n) if i % world_size == rank] + [i for i in range(n) if i % world_size != rank]


class DeviceCacheDataset(Dataset):
    """Every item of ``source`` placed on ``device`` (CUDA or CPU) once, indexed as ``source``.

    Random transforms (``suffix``) run per access on the cached tensors, so on CUDA the
    foreground-biased crop of a cached volume runs on the GPU (MONAI: CacheDataset + ToDeviced +
    RandCropByPosNegLabeld); their generator is that of ``(seed, epoch, i)``, as uncached.

    Args:
        source: dataset whose items are already preprocessed (e.g. a node-shared cache, or the
            prefix computed on read).
        device: where to keep the tensors.
        seed: seed of the suffix's draws.
        order: the order the items are read in while filling (default ``range(len(source))``;
            :func:`fill_order` under DDP). It never changes what ``self[i]`` is.
        budget_bytes: device memory allowed (default ``memory_fraction`` of free memory); items
            that do not fit stay in host RAM (read once, copied per access) on CUDA, and are read
            from ``source`` on every access on the CPU, with a warning.
        suffix: random transforms applied on every access.
    """

    def __init__(self, source: Dataset, device: torch.device | str, *, seed: int = 0,
                 order: Sequence[int] | None = None, budget_bytes: int | None = None,
                 memory_fraction: float = 0.8, suffix: Sequence[T.TransformFn] = ()):
        self.source, self.device = source, torch.device(device)
        self.suffix, self.seed, self.epoch = list(suffix), seed, 0
        n = len(source)
        order = list(range(n)) if order is None else list(order)
        if sorted(order) != list(range(n)):
            raise ValueError(f"DeviceCacheDataset: order must be a permutation of range({n})")
        self.items: list[Any] = [None] * n  # None: read from the source on every access
        self.on_device = [False] * n
        self.num_cached = 0
        if not n:
            return
        first = source[order[0]]
        if budget_bytes is None:
            if self.device.type == "cuda":
                budget_bytes = int(torch.cuda.mem_get_info(self.device)[0] * memory_fraction)
            else:
                budget_bytes = int(available_ram() * memory_fraction)
        fits = guard(n, item_nbytes(first), budget_bytes, f"DeviceCacheDataset on {self.device}")
        # beyond the budget: on CUDA the items wait in host RAM; on the CPU that would be the same
        # memory the budget just refused, so they are read from the source on every access
        held = n if self.device.type != "cpu" else fits
        for k, i in enumerate(order[:held]):  # each item read once, moved as it is read
            item = first if k == 0 else source[i]
            self.items[i] = _move(item, self.device) if k < fits else item
            self.on_device[i] = k < fits
        self.num_cached = fits

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the suffix's draws (what is held does not change)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self.items[i]
        if item is None:  # did not fit in the CPU budget: read (the source's pipeline) on every access
            item = self.source[i]
        elif not self.on_device[i]:  # did not fit on the device: held in host RAM
            item = _move(item, self.device)
        return finish(self.suffix, item, self.seed, self.epoch, i)

    def report(self) -> str:
        rest = len(self) - self.num_cached
        where = ("" if not rest else f", {rest} in host RAM" if self.device.type != "cpu"
                 else f", {rest} read from the source on each access")
        random = f"; random transforms per access on {self.device}: {', '.join(T.name(t) for t in self.suffix)}" \
            if self.suffix else ""
        return f"DeviceCacheDataset: {self.num_cached}/{len(self)} items on {self.device}{where}{random}"
