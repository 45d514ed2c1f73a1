"""Caches of a pipeline's deterministic prefix: RAM, persistent disk, and node-shared memory.

Each cache wraps a base dataset of dict items and a pipeline (see :mod:`fastvision.data.transforms`):
the deterministic prefix runs once per item, the rest on every access. Faults MONAI users report
are designed out: the number cached and where the prefix ends are logged (no silent partial
cache); a memory guard measures item bytes first and caches only what fits, with a warning; disk
entries are keyed by item identity *and* the prefix's signature (no stale cache), written
atomically, checksummed and pickle-free; ranks on one node share one copy through ``/dev/shm``.
The smart cache lives in :mod:`fastvision.data.cache.smart`, the GPU cache in :mod:`fastvision.data.cache.device`.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import mmap
import os
import shutil
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from fastvision.data import transforms as T
from fastvision.data.cache.format import CorruptEntry, decode, read_item, write_item
from fastvision.data.cache.stale import remove_stale_shared
from fastvision.distributed.env import detect_env
from fastvision.errors import ConfigError, DataWarning

log = logging.getLogger(__name__)


def item_nbytes(item: Any) -> int:
    """Bytes held by the tensors / arrays in an item (recursively)."""
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if isinstance(item, np.ndarray):
        return item.nbytes
    if isinstance(item, dict):
        return sum(item_nbytes(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(item_nbytes(v) for v in item)
    return 0


def available_ram() -> int:
    """MemAvailable from /proc/meminfo in bytes (total physical memory where that is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def guard(wanted: int, bytes_per_item: int, budget: int, what: str) -> int:
    """How many of ``wanted`` items fit in ``budget`` bytes; warns visibly when not all do."""
    fits = wanted if bytes_per_item == 0 else min(wanted, budget // bytes_per_item)
    if fits < wanted:
        msg = (f"{what}: {wanted} items x {bytes_per_item / 2**20:.1f} MiB need "
               f"{wanted * bytes_per_item / 2**30:.2f} GiB but the budget is {budget / 2**30:.2f} GiB; "
               f"caching {fits} items, the rest run the full pipeline on every access")
        log.warning(msg)
        warnings.warn(msg, ResourceWarning, stacklevel=3)
    return fits


def fill(fn: Callable[[int], Any], indices: Sequence[int], workers: int, progress: bool, label: str) -> list[Any]:
    """``[fn(i) for i in indices]`` on a thread pool, with a rich progress bar when asked."""
    return list(ordered_map(fn, indices, workers, progress, label))


def ordered_map(fn: Callable[[int], Any], indices: Sequence[int], workers: int, progress: bool = False,
                label: str = "caching") -> Iterator[Any]:
    """``fn(i)`` for ``i`` in ``indices``, yielded in that order, computed by ``workers`` threads.

    At most ``2 * workers`` results wait for the consumer, so a cache moving each item onto a device
    as it comes never holds the whole set twice. An error of ``fn`` is raised at its item; the items
    not started by then are cancelled. ``workers`` <= 1 computes in the calling thread.
    """
    indices = list(indices)
    bar = _Bar(progress, label, len(indices))
    try:
        if workers <= 1:
            for i in indices:
                yield fn(i)
                bar.advance()
            return
        pool = ThreadPoolExecutor(workers, thread_name_prefix="fastvision-cache")
        try:
            ahead = deque(pool.submit(fn, i) for i in indices[:2 * workers])
            for i in indices[2 * workers:] + [None] * len(ahead):
                result = ahead.popleft().result()
                if i is not None:
                    ahead.append(pool.submit(fn, i))
                yield result
                bar.advance()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        bar.close()


class _Bar:
    """A transient rich progress bar over ``total`` items, or nothing when ``show`` is false."""

    def __init__(self, show: bool, label: str, total: int):
        self.progress = None
        if show and total:
            from rich.progress import Progress

            self.progress = Progress(transient=True)
            self.progress.start()
            self.task = self.progress.add_task(label, total=total)

    def advance(self) -> None:
        if self.progress is not None:
            self.progress.advance(self.task)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def finish(suffix: Sequence[T.TransformFn], item: dict[str, Any], seed: int, epoch: int,
           index: int, slot: tuple[int, int] | None = None) -> dict[str, Any]:
    """A cached item as served: the random ``suffix`` run on a shallow copy (so the cache's dict is
    never edited) with the generator of ``(seed, epoch, index)``, ``index`` being the base index.
    ``slot``: the item's (position, batch size) in the epoch's order, handed to a suffix transform
    that asks for it (``batch_slot``; nnU-Net's foreground oversampling of a batch's last items)."""
    if not suffix:
        return dict(item)
    item = dict(item)
    if slot is not None and any(getattr(t, "batch_slot", False) for t in suffix):
        item[T.SLOT_KEY] = slot
    return T.apply_random(suffix, item, T.item_generator(seed, epoch, index))


class BatchSlots:
    """The batch position of each index of the loader's epoch order, for :func:`finish` (set by the
    loader at every ``set_epoch``: :func:`~fastvision.data.loader.build_loader`)."""

    slots: dict[int, tuple[int, int]] | None = None

    def set_batch_slots(self, order: Sequence[int], batch_size: int) -> None:
        self.slots = T.batch_slots(order, batch_size)

    def slot(self, i: int) -> tuple[int, int] | None:
        return None if self.slots is None else self.slots.get(i)


class _Cached(BatchSlots, Dataset):
    """Shared plumbing: prefix/suffix split, reporting, per-access suffix.

    The suffix (random transforms, and whatever follows the first one) runs on every access with
    a generator of ``(seed, epoch, base index)`` (:func:`~fastvision.data.transforms.item_generator`);
    ``set_epoch`` moves to the next epoch's draws. ``seed`` is set by the code that builds the
    training set (``wrap_train_set``).
    """

    seed: int = 0
    epoch: int = 0

    def __init__(self, base: Dataset, pipeline: Sequence[T.TransformFn]):
        self.base = base
        self.prefix, self.suffix = T.split(pipeline)
        self.signature = T.pipeline_signature(self.prefix)
        self.num_cached = 0

    def __len__(self) -> int:
        return len(self.base)

    def _compute(self, i: int) -> dict[str, Any]:
        return T.apply(self.prefix, self.base[i])

    def _cached(self, i: int) -> dict[str, Any]:
        return self._compute(i)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def finish(self, item: dict[str, Any], index: int) -> dict[str, Any]:
        """Run the suffix on a cached item of base index ``index`` (a shallow copy: suffix
        transforms may replace keys without touching the cached dict)."""
        return finish(self.suffix, item, self.seed, self.epoch, index, self.slot(index))

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.finish(self._cached(i), i)

    def report(self) -> str:
        """One line: how many items are cached and where the cached prefix ends."""
        names = [T.name(t) for t in self.prefix]
        end = f"after {names[-1]}" if names else "before the first transform"
        nxt = f"; first uncached transform: {T.name(self.suffix[0])}" if self.suffix else ""
        return (f"{type(self).__name__}: {self.num_cached}/{len(self.base)} items cached, prefix of "
                f"{len(self.prefix)}/{len(self.prefix) + len(self.suffix)} transforms ends {end}{nxt}")


class Pipeline(_Cached):
    """No cache: the whole pipeline on every access (the plain path, ``data.cache: none``)."""

    def report(self) -> str:
        return (f"Pipeline: not cached ({len(self.base)} items), "
                f"{len(self.prefix) + len(self.suffix)} transforms per access")


class LazyCache(_Cached):
    """RAM cache filled on first access (validation sets: a rank keeps only the items it reads)."""

    def __init__(self, base: Dataset, pipeline: Sequence[T.TransformFn]):
        super().__init__(base, pipeline)
        self.items: dict[int, dict[str, Any]] = {}

    def _cached(self, i: int) -> dict[str, Any]:
        item = self.items.get(i)
        if item is None:  # two threads may both compute one item: same result, one kept
            item = self.items.setdefault(i, self._compute(i))
        self.num_cached = len(self.items)
        return item


class CacheDataset(_Cached):
    """RAM cache of the deterministic prefix, filled by threads at construction.

    Args:
        base: dataset of dict items.
        pipeline: transforms; the prefix before the first ``random`` one is cached.
        cache_rate: fraction of items to cache (the first ``ceil(rate * len)``).
        num_workers: threads filling the cache.
        progress: show a progress bar while filling.
        budget_bytes: memory allowed for the cache (default: ``memory_fraction`` of MemAvailable).
        memory_fraction: share of available RAM the cache may use.
    """

    def __init__(self, base: Dataset, pipeline: Sequence[T.TransformFn], *, cache_rate: float = 1.0,
                 num_workers: int = 4, progress: bool = True, budget_bytes: int | None = None,
                 memory_fraction: float = 0.7):
        super().__init__(base, pipeline)
        wanted = int(np.ceil(min(max(cache_rate, 0.0), 1.0) * len(base)))
        self.items: list[dict[str, Any] | None] = [None] * len(base)
        if wanted:
            first = self._compute(0)  # measure before committing memory
            budget = budget_bytes if budget_bytes is not None else int(available_ram() * memory_fraction)
            n = guard(wanted, item_nbytes(first), budget, "CacheDataset")
            self.items[0] = first if n else None
            rest = fill(self._compute, range(1, n), num_workers, progress, "caching")
            self.items[1:n] = rest
            self.num_cached = n
        log.info(self.report())

    def _cached(self, i: int) -> dict[str, Any]:
        item = self.items[i]
        return item if item is not None else self._compute(i)


class PersistentDataset(_Cached):
    """Disk cache: ``cache_dir/<key>.fvc`` with key = sha256(item identity, prefix signature).

    Args:
        base: dataset of dict items.
        pipeline: transforms; the prefix before the first ``random`` one is cached.
        cache_dir: folder for entries (created).
        identity: ``i -> str`` naming item ``i`` stably (e.g. file path and mtime); default
            ``base.identity(i)`` if the dataset has it, else the index and dataset length.
    """

    def __init__(self, base: Dataset, pipeline: Sequence[T.TransformFn], cache_dir: str | Path, *,
                 identity: Callable[[int], str] | None = None):
        super().__init__(base, pipeline)
        self.dir = Path(cache_dir)
        self.identity = identity or getattr(base, "identity", None) or (lambda i: f"{i}/{len(base)}")
        self.num_cached = len(base)
        self.recomputed = 0
        self.read_only = False  # a folder that takes no file but holds every entry: read, never written
        if (cause := _unwritable(self.dir)) is not None:
            missing = sum(not self.path(i).exists() for i in range(len(base)))
            if missing:  # before: an OSError at the first entry written, mid-epoch, naming a temp file
                raise ConfigError(f"data.cache_dir: cannot write cache entries in {self.dir} ({cause}), and {missing} "
                                  f"of {len(base)} are not there; pass a writable folder (--set data.cache_dir=DIR), "
                                  "or data.cache_dir=null with a memory cache (ram, shared, smart, gpu) to skip it")
            self.read_only = True
            log.info("data.cache_dir %s takes no new file (%s); every entry is there: read as is", self.dir, cause)

    def path(self, i: int) -> Path:
        key = hashlib.sha256(f"{self.identity(i)}\0{self.signature}".encode()).hexdigest()
        return self.dir / f"{key[:40]}.fvc"

    def _cached(self, i: int) -> dict[str, Any]:
        p = self.path(i)
        if p.exists():
            try:
                return read_item(p)
            except (CorruptEntry, OSError) as e:
                # a DataWarning: the CLI logs it as one line naming the entry
                warnings.warn(f"cache entry {p} is corrupt ({e}); recomputing item {i}", DataWarning, stacklevel=2)
                self.recomputed += 1
        item = self._compute(i)
        if not self.read_only:  # read-only: a corrupt entry is recomputed each time it is read
            write_item(p, item)
        return item

    def warm(self, num_workers: int = 4, progress: bool = True) -> None:
        """Fill every missing entry now (threaded) instead of during the first epoch."""
        fill(self._cached, range(len(self)), num_workers, progress, "caching to disk")


def _unwritable(folder: Path) -> str | None:
    """Why no entry can be written in ``folder`` (made first; a temp file made and removed), None if one can."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:  # read-only, forbidden, under a file, a place that takes no folder
        return e.strerror or str(e)
    return None


class SharedCacheDataset(_Cached):
    """One RAM copy per node: entries live in ``/dev/shm`` and every local rank memory-maps them.

    Local rank r fills items ``i % local_world_size == r``; then all ranks wait for each other's
    marker files and map every entry copy-on-write, so the pages are the shared page cache and a
    node holds the data once, whatever the number of ranks.

    Args:
        base: dataset of dict items.
        pipeline: transforms; the prefix before the first ``random`` one is cached.
        name: cache name shared by the ranks of one job (e.g. the run name).
        local_rank, local_world_size: default: this process's place on its node
            (:func:`fastvision.distributed.env.detect_env`).
        root: folder on a memory file system.
        timeout_s: how long to wait for the other ranks.
        cleanup: local rank 0 deletes the folder at exit (mapped pages stay valid); it also removes the
            folders of this user's ended jobs that a kill left behind (:func:`remove_stale_shared`).
    """

    def __init__(self, base: Dataset, pipeline: Sequence[T.TransformFn], name: str, *,
                 local_rank: int | None = None, local_world_size: int | None = None,
                 root: str | Path = "/dev/shm", num_workers: int = 4, progress: bool = True,
                 timeout_s: float = 3600.0, cleanup: bool = True):
        super().__init__(base, pipeline)
        env = detect_env() if local_rank is None or local_world_size is None else None
        rank = env.local_rank if local_rank is None else local_rank
        world = env.local_world_size if local_world_size is None else local_world_size
        self.dir = Path(root) / f"fastvision-{name}-{self._content_key()}-{len(base)}"
        if rank == 0:  # a killed job's copy would hold the node's memory until reboot
            remove_stale_shared(root)
        self.dir.mkdir(parents=True, exist_ok=True)
        if cleanup and rank == 0:
            atexit.register(shutil.rmtree, self.dir, True)
        mine = [i for i in range(len(base)) if i % world == rank and not self._file(i).exists()]
        fill(lambda i: write_item(self._file(i), self._compute(i)), mine, num_workers, progress,
             f"caching to {self.dir}")
        (self.dir / f"rank{rank}.done").touch()
        deadline = time.monotonic() + timeout_s
        while not all((self.dir / f"rank{r}.done").exists() for r in range(world)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.dir}: other local ranks did not finish caching in {timeout_s} s")
            time.sleep(0.05)
        self._maps: list[mmap.mmap] = []
        self.items = [self._map(i) for i in range(len(base))]
        self.num_cached = len(base)
        log.info(self.report())

    def _content_key(self) -> str:
        """What the entries hold: the prefix's signature, a cached base's own signature and every
        item's identity, so two datasets of one job never share a folder."""
        h = hashlib.sha256(self.signature.encode())
        h.update(str(getattr(self.base, "signature", "")).encode())
        identity = getattr(self.base, "identity", None)
        for i in range(len(self.base) if callable(identity) else 0):
            h.update(b"\0" + identity(i).encode())
        return h.hexdigest()[:16]

    def _file(self, i: int) -> Path:
        return self.dir / f"{i}.fvc"

    def _map(self, i: int) -> dict[str, Any]:
        with open(self._file(i), "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._maps.append(mm)  # the tensors are views of the mapping: keep it open
        return decode(mm, verify=False)  # written this run by a local rank, atomically

    def _cached(self, i: int) -> dict[str, Any]:
        return self.items[i]
