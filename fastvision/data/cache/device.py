"""The device cache (``data.cache: gpu``): preprocessed items held on the training device.

Like every cache it is storage keyed by the source index, never an order: item ``i`` of the cache
is item ``i`` of the uncached pipeline (same tensors, same random draws of ``(seed, epoch, i)``),
and the engine's :class:`~fastvision.distributed.samplers.TrainSampler` alone decides which items a rank
reads in which order. So switching ``data.cache`` between ``none``, ``ram``, ``disk``, ``shared``
and ``gpu`` changes speed and memory, never a step's samples, at any world size.

What sits on the device follows the sampler instead of deciding it: given ``share`` (the
sampler's ``indices``: the items this rank reads in an epoch), the device holds exactly this
epoch's share, about ``1/world`` of the items under DDP, and :meth:`DeviceCacheDataset.set_epoch`
swaps it for the next epoch's (the items no longer read are freed first, the new ones copied from
the host copy). The host copy is the node-shared cache where several ranks share a node (one copy
per node, in ``/dev/shm``), else this process's host RAM, each item held once: on the device while
in the share, in host RAM otherwise. Without ``share`` every item is in the share (one process).
An earlier design held one partition per rank and served it in its own order; that changed the
samples of every step (see ``docs/CONTRACTS.md``, "Caches are speed switches").
"""
from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from fastvision.data import transforms as T
from fastvision.data.cache.datasets import BatchSlots, available_ram, finish, guard, item_nbytes, ordered_map
from fastvision.data.loader import _move
from fastvision.utils.tree import map_tensors

log = logging.getLogger(__name__)


def fill_order(n: int, rank: int = 0, world_size: int = 1) -> list[int]:
    """``range(n)`` with this rank's stripe (``i % world_size == rank``) first: ranks filling through
    one shared disk cache compute different items first and then read each other's entries."""
    return [i for i in range(n) if i % world_size == rank] + [i for i in range(n) if i % world_size != rank]


class DeviceCacheDataset(BatchSlots, Dataset):
    """Preprocessed items indexed as ``source``, this epoch's share of them on ``device`` (CUDA or CPU).

    Random transforms (``suffix``) run per access on the cached tensors, so on CUDA the
    foreground-biased crop of a cached volume runs on the GPU (MONAI: CacheDataset + ToDeviced +
    RandCropByPosNegLabeld); their generator is that of ``(seed, epoch, i)``, as uncached. An item
    that is not on the device is served from its host copy (copied per access): values never depend
    on where an item is held, and a read never waits on :meth:`set_epoch`.

    Args:
        source: dataset whose items are already preprocessed (e.g. a node-shared cache, or the
            prefix computed on read).
        device: where to keep the tensors.
        seed: seed of the suffix's draws.
        order: the order the items are read in while filling (default ``range(len(source))``;
            :func:`fill_order` under DDP). It never changes what ``self[i]`` is.
        budget_bytes: device memory the share may use (default ``memory_fraction`` of the free
            memory at construction). A share over it warns once; its overflow stays in host RAM
            (copied per access). On the CPU the budget also bounds the host copy: items beyond it
            are read from ``source`` on every access, with a warning.
        suffix: random transforms applied on every access.
        share: ``epoch -> indices`` this process reads in the epoch (the training sampler's
            :meth:`~fastvision.distributed.samplers.TrainSampler.indices`); None: every index, every epoch.
        source_holds: ``source`` already holds every item in host memory (the node-shared cache):
            the share is copied from it and nothing else is kept here.
        threads: threads reading ``source`` while filling (items are placed in ``order`` whatever
            thread computed them, so the fill's outcome does not depend on it).
        progress: show a progress bar while filling.
    """

    def __init__(self, source: Dataset, device: torch.device | str, *, seed: int = 0,
                 order: Sequence[int] | None = None, budget_bytes: int | None = None,
                 memory_fraction: float = 0.8, suffix: Sequence[T.TransformFn] = (),
                 share: Callable[[int], Sequence[int]] | None = None, source_holds: bool = False,
                 threads: int = 1, progress: bool = False):
        self.source, self.device = source, torch.device(device)
        self.suffix, self.seed, self.epoch = list(suffix), seed, 0
        self.share_of, self.source_holds = share, source_holds
        # on the CPU a "device" copy is the host copy itself (moving is a no-op): keep both names
        self._keep_host = self.device.type == "cpu"
        n = len(source)
        order = list(range(n)) if order is None else list(order)
        if sorted(order) != list(range(n)):
            raise ValueError(f"DeviceCacheDataset: order must be a permutation of range({n})")
        self.dev: list[Any] = [None] * n  # the share: items on the device
        self.host: list[Any] = [None] * n  # host copies (unused when the source holds them)
        self.dev_bytes, self.share, self.overflow, self._warned = 0, [], 0, False
        if not n:
            self.budget = 0
            return
        first = source[order[0]]
        if budget_bytes is None:
            if self.device.type == "cuda":
                budget_bytes = int(torch.cuda.mem_get_info(self.device)[0] * memory_fraction)
            else:
                budget_bytes = int(available_ram() * memory_fraction)
        self.budget = budget_bytes
        if not source_holds:
            # each item read once. On the CPU the host copy is the budgeted memory: beyond it items
            # are read from the source on every access; on CUDA every item has a host copy while
            # it is not on the device
            held = n if self.device.type != "cpu" else guard(n, item_nbytes(first), budget_bytes,
                                                            f"DeviceCacheDataset on {self.device}")
            wanted = set(self._indices(0))
            rest = ordered_map(source.__getitem__, order[1:held], threads, progress, f"caching on {self.device}")
            for i, item in zip(order[:held], itertools.chain([first], rest), strict=True):
                if i in wanted and self._admit(i, item):
                    continue
                self.host[i] = item
        self._place(0)

    def _indices(self, epoch: int) -> list[int]:
        """The share of ``epoch``: unique indices in the order they are first read."""
        if self.share_of is None:
            return list(range(len(self.dev)))
        return list(dict.fromkeys(int(i) for i in self.share_of(epoch)))

    def _admit(self, i: int, item: Any) -> bool:
        """Item ``i`` onto the device if the budget allows (else counted as overflow)."""
        size = item_nbytes(item)
        if self.dev_bytes + size > self.budget:
            self.overflow += 1
            return False
        self.dev[i] = _move(item, self.device)
        self.dev_bytes += size
        self.host[i] = item if self._keep_host else None  # one copy: on the device, or on the host
        return True

    def _host_item(self, i: int) -> Any:
        """Item ``i`` from host memory, or None where it is not held (the CPU beyond its budget)."""
        return self.source[i] if self.source_holds else self.host[i]

    def _place(self, epoch: int) -> None:
        """Hold exactly ``epoch``'s share on the device: free what it no longer reads, then copy in
        what it now reads (so the device never holds two shares at once)."""
        wanted = self._indices(epoch)
        keep = set(wanted)
        for i, item in enumerate(self.dev):
            if item is not None and i not in keep:
                if not self.source_holds and self.host[i] is None:  # its only copy: back to host RAM
                    self.host[i] = map_tensors(lambda t: t.to("cpu"), item)
                self.dev[i] = None
                self.dev_bytes -= item_nbytes(item)
        self.overflow = 0
        for i in wanted:
            if self.dev[i] is None:
                item = self._host_item(i)
                if item is not None:
                    self._admit(i, item)
        self.share = sorted(keep)
        if self.overflow and not self._warned:
            self._warned = True
            msg = (f"DeviceCacheDataset on {self.device}: epoch {epoch}'s share of {len(keep)} items does not fit "
                   f"the {self.budget / 2**30:.2f} GiB budget; {self.overflow} items stay in host RAM, copied "
                   "per access (warned once)")
            log.warning(msg)
            warnings.warn(msg, ResourceWarning, stacklevel=3)

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the suffix's draws, and its share on the device (the same for a mid-epoch
        start: the items before it are simply not read)."""
        self.epoch = epoch
        if self.share_of is not None:
            self._place(epoch)

    @property
    def on_device(self) -> list[bool]:
        """Per index: held on the device now."""
        return [item is not None for item in self.dev]

    @property
    def num_cached(self) -> int:
        return sum(self.on_device)

    def __len__(self) -> int:
        return len(self.dev)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self.dev[i]
        if item is None:  # outside the share, or over the budget: from the host copy, per access
            item = self._host_item(i)
            if item is None:  # not held (the CPU beyond its budget): the source's pipeline
                item = self.source[i]
            item = _move(item, self.device)
        return finish(self.suffix, item, self.seed, self.epoch, i, self.slot(i))

    def report(self) -> str:
        n, on = len(self), self.num_cached
        if self.source_holds:
            rest = f", the other {n - on} in the node-shared host cache" if n - on else ""
        else:
            held = sum(d is not None or h is not None for d, h in zip(self.dev, self.host, strict=True))
            rest = (f", {held - on} more in host RAM" if held > on else "") + (
                f", {n - held} read from the source on each access" if held < n else "")
        share = f" (this epoch's share: {len(self.share)})" if self.share_of is not None else ""
        random = f"; random transforms per access on {self.device}: {', '.join(T.name(t) for t in self.suffix)}" \
            if self.suffix else ""
        return f"DeviceCacheDataset: {on}/{n} items on {self.device}{share}{rest}{random}"
