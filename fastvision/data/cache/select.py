"""The engine's one entry to the caches: ``data.cache: none|ram|disk|shared|smart|gpu``.

:func:`wrap_train_set` turns a registered dataset into the cache the recipe names. A dataset can
say what to cache through ``cache_pipeline() -> (base, transforms)`` (the random transforms marked
``random = True`` run on every access). Without it the dataset's whole ``__getitem__`` is the
cached step (:class:`ReadItem`), which is only right for a deterministic dataset: item 0 is read
twice first, and a dataset whose reads differ is refused instead of silently freezing its
augmentation (move the random part to ``data.augment``, which runs batched on the device).

The persistent cache keys entries on ``dataset.identity(i)`` (the files' path, size and mtime)
and on :func:`dataset_signature` (class, code and scalar settings such as ``image_size``), so a
changed file or setting recomputes. Caches that live in the main process (smart: a replacement
thread; gpu: CUDA tensors) set ``main_process_only`` and ``build_loader`` refuses worker
processes for them.

A cache is storage keyed by the item's index, never an order: item ``i`` of every cache is item
``i`` of ``none`` (the same tensors, the same random draws of ``(seed, epoch, i)``), and the engine's
``TrainSampler`` alone decides which items a rank reads and in which order, on one process or N
ranks. So ``data.cache`` is a speed (and memory) switch, except ``smart`` with a window smaller
than the dataset, which trains each epoch on the window (warned at build; ``fastvision tune``
never switches it).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset

from fastvision.data import transforms as T
from fastvision.data.cache.datasets import (
    CacheDataset,
    LazyCache,
    PersistentDataset,
    Pipeline,
    SharedCacheDataset,
    _Cached,
)
from fastvision.data.cache.device import DeviceCacheDataset, fill_order
from fastvision.data.cache.smart import SmartCacheDataset
from fastvision.distributed.env import DistEnv, job_key
from fastvision.errors import ConfigError

log = logging.getLogger(__name__)

CACHES = ("none", "ram", "disk", "shared", "smart", "gpu")


def files_identity(paths: Sequence[str | Path]) -> str:
    """``path:size:mtime_ns`` of each file: changes when a file is replaced, even under its name."""
    parts = []
    for p in paths:
        st = os.stat(p)
        parts.append(f"{Path(p).resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def item_identity(dataset: Any) -> Callable[[int], str] | None:
    """``i -> str`` naming item ``i`` by its source files (the dataset's ``identity``), or None."""
    return dataset.identity if callable(getattr(dataset, "identity", None)) else None


def _scalar(v: Any) -> bool:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return True
    return isinstance(v, (tuple, list)) and len(v) <= 8 and all(_scalar(x) for x in v)


def dataset_signature(dataset: Any) -> str:
    """What an item's content depends on besides its files: the class, the source of its module
    and its scalar settings (``image_size``, ``fit``...). Lists of files are left to identity."""
    if callable(getattr(dataset, "cache_signature", None)):
        return dataset.cache_signature()
    cls = type(dataset)
    module = inspect.getmodule(cls)
    try:
        code = inspect.getsource(module) if module else ""
    except (OSError, TypeError):
        code = ""
    settings = {k: v for k, v in sorted(vars(dataset).items()) if not k.startswith("_") and _scalar(v)}
    return json.dumps({"class": f"{cls.__module__}.{cls.__qualname__}", "settings": T._jsonable(settings),
                       "code": hashlib.sha256(code.encode()).hexdigest()[:16]}, sort_keys=True)


class ReadItem(T.Transform):
    """The deterministic step "item ``index`` of ``dataset``" (reading, decoding, resizing)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self.__qualname__ = f"{type(dataset).__name__}.__getitem__"  # what cache reports print

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        return self.dataset[item["index"]]

    def signature(self) -> str:
        return dataset_signature(self.dataset)


class _Indices(Dataset):
    """Base of a :class:`ReadItem` pipeline: item ``i`` is ``{"index": i}`` (named by the
    dataset's ``identity`` when it has one)."""

    def __init__(self, n: int, identity: Callable[[int], str] | None = None):
        self.n = n
        if identity is not None:
            self.identity = identity

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype):
            return False
        return bool(torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, 0, 0, equal_nan=True)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def check_deterministic(dataset: Dataset) -> None:
    """Read item 0 twice; raise ConfigError when the reads differ (randomness inside the dataset)."""
    if len(dataset) and not _same(dataset[0], dataset[0]):
        raise ConfigError(f"data.cache: {type(dataset).__name__} returns a different item on every read "
                          "(random transforms inside the dataset); caching would freeze them. Set "
                          "data.cache: none, or move the randomness to data.augment (batched, on the device)")


def cache_source(dataset: Dataset,
                 check: bool = True) -> tuple[Dataset, list[T.TransformFn], Callable[[int], str] | None]:
    """``(base, pipeline, identity)`` for the caches.

    Raises:
        ConfigError: ``check``, the dataset has no ``cache_pipeline`` and two reads of item 0 differ.
    """
    if callable(getattr(dataset, "cache_pipeline", None)):
        base, pipeline = dataset.cache_pipeline()
        return base, list(pipeline), item_identity(base) or item_identity(dataset)
    if check:
        check_deterministic(dataset)
    return _Indices(len(dataset), item_identity(dataset)), [ReadItem(dataset)], item_identity(dataset)


def default_cache_dir() -> Path:
    """``$FASTVISION_CACHE/pipeline`` (default ``~/.cache/fastvision/pipeline``)."""
    root = (os.environ.get("FASTVISION_CACHE")
            or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastvision")
    return Path(root) / "pipeline"


def job_name() -> str:
    """A name the local ranks of one job share and other jobs do not (names the /dev/shm folder)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return f"{uid}-{job_key()}"


def wrap_train_set(dataset: Dataset, *, cache: str, cache_rate: float = 1.0, cache_dir: str | None = None,
                   cache_num: int | None = None, replace_rate: float = 0.1, env: Any = None,
                   device: torch.device | str = "cpu", seed: int = 0,
                   share: Callable[[int], Sequence[int]] | None = None) -> Dataset:
    """The training set behind the cache named by ``data.cache``.

    A dataset with ``cache_pipeline`` is always served through its pipeline (with ``none`` as a
    :class:`~fastvision.data.cache.datasets.Pipeline` that caches nothing): the deterministic prefix is
    what gets cached, the random transforms run per access with generators of
    ``(seed, epoch, sample index)``.

    Every cache serves item ``i`` as ``none`` does; the sampler alone orders them. Under DDP a rank
    reads a different share of the items every epoch, so a rank's memory cache holds all of them:
    ``ram`` one copy per rank, ``shared`` one copy per node, ``disk`` entries are written by
    whichever rank reads them first. ``gpu`` holds on the device only the share the rank reads this
    epoch (``share``, about ``1/world``), swapped at ``set_epoch`` from a host copy: the node-shared
    one with several ranks per node, else this rank's host RAM (each item once, device or host).

    Args:
        dataset: the registered training set (items are dicts).
        cache: none, ram, disk, shared, smart or gpu (``auto`` is resolved to one of them by the build:
            :func:`fastvision.data.cache.auto.resolve`).
        cache_rate: share of items kept in RAM (ram, one process; smart).
        cache_dir: folder of the disk cache (None or "auto": :func:`default_cache_dir`). Given with
            a memory cache (ram, shared, smart, gpu), that cache is filled through the disk cache,
            so a second run reads the preprocessed items instead of computing them.
        cache_num, replace_rate: smart cache window and the share replaced per epoch (MONAI's
            defaults: no ``cache_num`` limit, so ``cache_rate`` of the items; 0.1).
        env: ``fastvision.distributed.DistEnv`` (rank, local rank, world sizes); None: one process.
        device: where the gpu cache places tensors (the training device: also a CPU).
        seed: seed of the random transforms and the smart-cache order (same on every rank).
        share: ``epoch -> indices`` this rank reads (the training sampler's ``indices``): what
            ``gpu`` keeps on the device each epoch. None: every item (as one process reads them).

    Returns:
        A dataset of the same items, indexed as ``dataset`` (``smart``: its window);
        ``set_epoch`` moves the random draws to the next epoch.
    """
    if cache not in CACHES:  # auto is resolved to one of them before (data/cache/auto.py, the build)
        raise ConfigError(f"data.cache must be one of {', '.join(CACHES)} or auto, got {cache!r}")
    _say_unused(cache, cache_rate, cache_num, env)
    if cache == "none":
        return _uncached(dataset, seed)
    src, identity = _source(dataset, cache, cache_dir, env, seed)
    if cache == "ram":
        out = _ram(src, cache_rate)
    elif cache == "disk":
        out = _disk(src, dataset, identity, cache_dir)
    elif cache == "shared":
        out = _shared(src)
    elif cache == "smart":
        out = _smart(src, cache_num, cache_rate, replace_rate)
    else:
        out = _gpu(src, device, share)
    out.seed = seed
    return out


def _say_unused(cache: str, cache_rate: float, cache_num: int | None, env: Any) -> None:
    """One warning (rank 0) where ``data.cache_rate`` / ``data.cache_num`` are set for a tier that does not read
    them: a MONAI user's ``cache_rate: 0.5`` caches half the items with ``ram``, a window with ``smart``, and
    every item (or none) with the others."""
    unused = []
    if cache_rate != 1.0 and cache not in ("ram", "smart"):
        unused.append(f"data.cache_rate {cache_rate:g}")
    if cache_num is not None and cache != "smart":
        unused.append(f"data.cache_num {cache_num}")
    if unused and (env if env is not None else DistEnv()).rank == 0:
        held = "no item" if cache == "none" else "every item"
        log.warning("%s: not read by data.cache %s, which holds %s (data.cache_rate is the share data.cache ram "
                    "holds; both size data.cache smart's window)", " and ".join(unused), cache, held)


class _Source(NamedTuple):
    """What every cache of :func:`wrap_train_set` is built from."""

    base: Dataset
    pipeline: list
    env: Any  # DistEnv
    seed: int
    threads: int  # fill threads
    progress: bool  # show a progress bar


def _source(dataset: Dataset, cache: str, cache_dir: str | None, env: Any,
            seed: int) -> tuple[_Source, Callable[[int], str] | None]:
    """``(source, identity)`` of a cache other than ``none``: the dataset's cached pipeline (a
    memory cache with a ``cache_dir`` reads its prefix through the disk cache), the process's
    ``DistEnv`` (``env`` None: this process's), and the fill threads and progress bar."""
    # A disk cache whose first entry exists was checked when it was written: reading nothing is its point.
    base, pipeline, identity = cache_source(dataset, check=cache != "disk")
    if cache != "disk" and cache_dir:  # a memory cache filled from the persistent one: fast second runs
        base, pipeline = _through_disk(base, pipeline, identity, cache_dir, "training")
    env = env if env is not None else DistEnv()
    src = _Source(base, pipeline, env, seed, threads=min(8, os.cpu_count() or 1),
                  progress=env.rank == 0 and sys.stderr.isatty())
    return src, identity


def _uncached(dataset: Dataset, seed: int) -> Dataset:
    """``data.cache: none``: the dataset itself, or its pipeline with nothing cached."""
    if not callable(getattr(dataset, "cache_pipeline", None)):
        return dataset
    base, pipeline = dataset.cache_pipeline()
    out = Pipeline(base, list(pipeline))
    out.seed = seed
    return out


def _ram(src: _Source, cache_rate: float) -> Dataset:
    """``ram``: a share of the items in this process. Under DDP too: a rank reads a different share
    of the items every epoch (the sampler's global permutation), so it holds all of them (``shared``
    keeps one copy per node instead). A per-rank partition would change which items a step sees."""
    if not 0 < cache_rate <= 1:
        raise ConfigError(f"data.cache_rate must be in (0, 1], got {cache_rate}")
    if src.env.world_size > 1 and src.env.local_world_size > 1:
        log.info("data.cache: ram under DDP holds every item on each of the %d ranks of this node (each reads "
                 "a different share every epoch); data.cache: shared keeps one copy per node",
                 src.env.local_world_size)
    return CacheDataset(src.base, src.pipeline, cache_rate=cache_rate, num_workers=src.threads,
                        progress=src.progress)


def _disk(src: _Source, dataset: Dataset, identity: Callable[[int], str] | None,
          cache_dir: str | None) -> Dataset:
    if identity is None:
        raise ConfigError(f"data.cache: disk needs {type(dataset).__name__}.identity(i) (a stable name of "
                          "item i's files) to key its entries; use data.cache: ram")
    out = PersistentDataset(src.base, src.pipeline, disk_dir(cache_dir), identity=identity)
    if isinstance(src.pipeline[0], ReadItem) and len(out) and not out.path(0).exists():
        check_deterministic(dataset)
    log.info("%s; entries in %s", out.report(), out.dir)
    return out


def _shared(src: _Source) -> Dataset:
    """``shared``: one copy of the items per node in /dev/shm, filled by the node's local ranks."""
    return SharedCacheDataset(src.base, src.pipeline, job_name(), local_rank=src.env.local_rank,
                              local_world_size=src.env.local_world_size, num_workers=src.threads,
                              progress=src.progress)


def smart_cache_num(n: int, cache_num: int | None, cache_rate: float) -> int:
    """Items resident per epoch, as MONAI's SmartCacheDataset counts them:
    ``min(cache_num, int(n * cache_rate), n)``, ``cache_num`` None meaning no limit (MONAI's
    ``sys.maxsize``), so ``data.cache: smart`` alone caches every item."""
    if not 0 < cache_rate <= 1:
        raise ConfigError(f"data.cache_rate must be in (0, 1], got {cache_rate}")
    return min(sys.maxsize if cache_num is None else cache_num, int(n * cache_rate), n)


def _smart(src: _Source, cache_num: int | None, cache_rate: float, replace_rate: float) -> Dataset:
    num = smart_cache_num(len(src.base), cache_num, cache_rate)
    if num < len(src.base):
        log.warning("data.cache: smart trains each epoch on a window of %d of the %d items (data.cache_num / "
                    "data.cache_rate): not a speed switch, the samples of every step differ from data.cache: "
                    "none, ram, disk, shared and gpu", num, len(src.base))
    out = SmartCacheDataset(src.base, src.pipeline, cache_num=num, replace_rate=replace_rate,
                            num_workers=max(1, src.threads // 2), shuffle=True, seed=src.seed, progress=src.progress)
    out.main_process_only = "data.cache: smart replaces items in a background thread of the main process"
    log.info(out.report())
    return out


def wrap_val_set(dataset: Dataset, *, cache: str, cache_dir: str | None = None) -> Dataset:
    """The validation set: deterministic items, cached as they are first read when ``cache`` is not
    ``none`` (a rank keeps only its evaluation shard; ``disk``, or a ``data.cache_dir`` under a
    memory cache, reuses the persistent entries). Its items are ``dataset[i]``, the evaluation view:
    never ``cache_pipeline``, which is the training view (random crops, augmentation)."""
    if cache == "none" or dataset is None:
        return dataset
    identity = item_identity(dataset)
    base, pipeline = _Indices(len(dataset), identity), [ReadItem(dataset)]
    if cache == "disk" and identity is not None:
        return PersistentDataset(base, pipeline, disk_dir(cache_dir), identity=identity)
    if cache_dir:
        base, pipeline = _through_disk(base, pipeline, identity, cache_dir, "validation")
    return LazyCache(base, pipeline)


def disk_dir(cache_dir: str | None) -> Path:
    """``data.cache_dir``: a folder, or None / "auto" for :func:`default_cache_dir`."""
    return default_cache_dir() if cache_dir in (None, "", "auto") else Path(cache_dir)


def _through_disk(base: Dataset, pipeline: list, identity: Callable[[int], str] | None,
                  cache_dir: str, which: str = "training") -> tuple[Dataset, list]:
    """``(persistent prefix, suffix)``: the deterministic prefix read from (or written to) the disk
    cache, so a memory cache's fill reads entries instead of preprocessing again."""
    prefix, suffix = T.split(pipeline)
    if identity is None or not prefix:
        return base, pipeline
    disk = PersistentDataset(base, prefix, disk_dir(cache_dir), identity=identity)
    log.info("data.cache_dir: the %s set's cached prefix is read through the disk cache in %s", which, disk.dir)
    return disk, suffix


def _gpu(src: _Source, device: torch.device | str,
         share: Callable[[int], Sequence[int]] | None = None) -> DeviceCacheDataset:
    """``gpu``: the items indexed as the dataset, this epoch's ``share`` of them on the training
    device (host RAM on a CPU device), the rest in a host copy: under DDP about ``1/world`` of the
    items per device, a different share every epoch (swapped at ``set_epoch``)."""
    prefix, suffix = T.split(src.pipeline)
    device, env = torch.device(device), src.env
    if device.type != "cuda":
        log.info("data.cache: gpu on %s keeps the items in host memory (the training device)", device)
    if env.world_size > 1 and env.local_world_size > 1:  # one host copy per node feeds its ranks' devices
        host: Dataset = SharedCacheDataset(src.base, prefix, job_name(), local_rank=env.local_rank,
                                           local_world_size=env.local_world_size, num_workers=src.threads,
                                           progress=src.progress)
    else:
        host = _Cached(src.base, prefix)  # read once, straight onto the device
    out = DeviceCacheDataset(host, device, seed=src.seed, suffix=suffix, share=share,
                             source_holds=isinstance(host, SharedCacheDataset),
                             order=fill_order(len(host), env.rank, env.world_size), threads=src.threads,
                             progress=src.progress)
    out.main_process_only = "data.cache: gpu holds device tensors, which worker processes cannot share"
    log.info(out.report())
    return out


def describe(dataset: Dataset) -> str:
    """One line for logs and the profiler: the cache class and what it holds."""
    if hasattr(dataset, "report"):
        return dataset.report()
    return f"{type(dataset).__name__}: not cached ({len(dataset)} items)"

