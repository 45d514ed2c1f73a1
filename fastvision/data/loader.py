"""Batch loaders: a thread loader (default), the process DataLoader, and a device prefetcher.

With cached data the per-item work is small, and worker processes only add pickling, IPC and the
copy-on-read memory growth MONAI users report (pytorch#13246). :class:`ThreadLoader` builds whole
batches in background threads and keeps a bounded window of them ready, in order. Batch order is a
function of (seed, epoch) and the sampler only, never of ``num_workers`` or thread timing.
:class:`DevicePrefetcher` copies the next batch to the GPU on a side stream while the current one
trains. ``build_loader`` picks between ``data.loader: threads|processes``.
"""
from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from fastvision.distributed.samplers import TrainSampler
from fastvision.errors import ConfigError
from fastvision.utils.tree import map_tensors, tensors


def epoch_sampler(n: int, shuffle: bool, seed: int = 0) -> TrainSampler:
    """All ``n`` indices of one process, shuffled by (seed, epoch): a one-replica TrainSampler."""
    return TrainSampler(n, num_replicas=1, rank=0, seed=seed, shuffle=shuffle)


def _batches(indices: list[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    stop = len(indices) - len(indices) % batch_size if drop_last else len(indices)
    return [indices[i:i + batch_size] for i in range(0, stop, batch_size)]


def endless_batches(loader: Any, start_epoch: int = 0) -> Iterator[Any]:
    """``loader``'s batches across epoch boundaries (``set_epoch`` at each), forever: what the
    profiler and ``benchmark --mode data`` draw steps from."""
    epoch = start_epoch
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def _pin(x: Any) -> Any:
    # a GPU cache's batches are already on the device
    return map_tensors(lambda t: t.pin_memory() if t.device.type == "cpu" else t, x)


class ThreadLoader:
    """Batches built by background threads, delivered in sampler order.

    Args:
        dataset: map-style dataset of dict items.
        batch_size: items per batch.
        sampler: index order (e.g. a rank's shard with ``set_epoch``); default :func:`epoch_sampler`.
        collate_fn: list of items -> batch (default ``default_collate``).
        num_workers: threads building batches (0 still uses one background thread).
        drop_last: drop a final short batch.
        repeats: yield each batch this many times ("data echoing"; MONAI ``ThreadDataLoader``).
        prefetch: batches kept ready per thread; bounds memory.
        pin_memory: pin batches in the worker thread so the device copy can be asynchronous.
    """

    def __init__(self, dataset: Dataset, *, batch_size: int, sampler: Iterable[int] | None = None,
                 shuffle: bool = False, seed: int = 0, collate_fn: Callable | None = None,
                 num_workers: int = 2, drop_last: bool = False, repeats: int = 1, prefetch: int = 2,
                 pin_memory: bool = False):
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = sampler if sampler is not None else epoch_sampler(len(dataset), shuffle, seed)
        self.collate_fn = collate_fn or default_collate
        self.num_workers = max(1, num_workers)
        self.drop_last = drop_last
        self.repeats = repeats
        self.window = self.num_workers * max(1, prefetch)
        self.pin_memory = pin_memory
        self._first_repeats = repeats  # yields of the first batch (fewer after a mid-epoch resume)
        self._pool: ThreadPoolExecutor | None = None  # made on first use, kept across epochs

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="fastvision-loader")
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        return self._pool

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        """Epoch ``epoch``'s order; the next iteration begins at sample ``start_sample`` of the epoch
        (all ranks together, repeats counted), reading none of the items before it."""
        self._first_repeats = _set_epoch(self.sampler, self.dataset, epoch, start_sample, self.batch_size, self.repeats)

    def __len__(self) -> int:
        n = len(self.sampler)
        batches = n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        return batches * self.repeats

    def _make(self, idx: list[int]) -> Any:
        batch = self.collate_fn([self.dataset[i] for i in idx])
        return _pin(batch) if self.pin_memory else batch

    def __iter__(self) -> Iterator[Any]:
        batches = _batches(list(self.sampler), self.batch_size, self.drop_last)
        pool = self._executor()  # one pool for every epoch: no thread start-up and join per epoch
        pending: collections.deque[Future] = collections.deque()
        try:
            nxt = done = 0
            while nxt < len(batches) or pending:
                # Keep a bounded window submitted: threads run ahead, memory stays bounded.
                while nxt < len(batches) and len(pending) < self.window:
                    pending.append(pool.submit(self._make, batches[nxt]))
                    nxt += 1
                batch = pending.popleft().result()
                yield from echoes(batch, self._first_repeats if done == 0 else self.repeats, self.repeats)
                done += 1
        finally:
            for f in pending:
                f.cancel()
            wait(pending)  # an abandoned epoch leaves no batch still being built


class ProcessLoader:
    """torch ``DataLoader`` with worker processes behind the same interface (len, set_epoch)."""

    def __init__(self, dataset: Dataset, *, batch_size: int, sampler: Iterable[int] | None = None,
                 shuffle: bool = False, seed: int = 0, collate_fn: Callable | None = None,
                 num_workers: int = 2, drop_last: bool = False, repeats: int = 1, pin_memory: bool = False):
        self.dataset = dataset
        self.sampler = sampler if sampler is not None else epoch_sampler(len(dataset), shuffle, seed)
        self.repeats, self.batch_size, self._first_repeats = repeats, batch_size, repeats
        # A dataset with per-epoch state (the epoch of its random draws) needs workers forked
        # after set_epoch: persistent workers would keep drawing epoch 0's augmentations.
        persistent = num_workers > 0 and not hasattr(dataset, "set_epoch")
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler,
                                 collate_fn=collate_fn or default_collate, num_workers=num_workers,
                                 drop_last=drop_last, pin_memory=pin_memory, persistent_workers=persistent)

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        # The dataset here is the main process's copy; workers fork from it at the next
        # iteration (not persistent for such datasets), so they see this epoch. Main-process
        # caches (smart, gpu) refuse worker processes.
        self._first_repeats = _set_epoch(self.sampler, self.dataset, epoch, start_sample, self.batch_size, self.repeats)

    def __len__(self) -> int:
        return len(self.loader) * self.repeats

    def __iter__(self) -> Iterator[Any]:
        for k, batch in enumerate(self.loader):
            yield from echoes(batch, self._first_repeats if k == 0 else self.repeats, self.repeats)


def echoes(batch: Any, count: int, repeats: int) -> Iterator[Any]:
    """The last ``count`` of a batch's ``repeats`` yields (data echoing; fewer than ``repeats`` for the first
    batch after a mid-epoch resume). Keyed samples (``train.augment_rng: sample``) get each echo's own keys,
    so an echo is augmented anew, as with the per-rank generator."""
    from fastvision.data.augment.keyed import SAMPLE_KEY, echo_keys

    for r in range(repeats - count, repeats):
        if r and isinstance(batch, dict) and SAMPLE_KEY in batch:
            yield {**batch, SAMPLE_KEY: echo_keys(batch[SAMPLE_KEY], r)}
        else:
            yield batch


def _set_epoch(sampler, dataset, epoch: int, start_sample: int, batch_size: int, repeats: int) -> int:
    """``set_epoch`` on the sampler and dataset, the sampler starting at sample ``start_sample`` of
    the epoch (all ranks together, repeats counted: each batch is yielded ``repeats`` times);
    returns how often the first batch is still yielded."""
    done = 0
    if start_sample and not isinstance(sampler, TrainSampler):
        raise ValueError("a mid-epoch start needs a TrainSampler")
    if isinstance(sampler, TrainSampler):
        start = start_sample
        if repeats > 1:  # this rank's yields so far, in whole batches of every rank
            ranks = sampler.num_replicas
            first, done = divmod(start_sample // (batch_size * ranks), repeats)
            start = first * batch_size * ranks
        sampler.set_epoch(epoch, start=start)
    elif hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)
    if hasattr(dataset, "set_batch_slots") and isinstance(sampler, TrainSampler):
        # each index's place in its batch, from the epoch's whole order (a resume mid-epoch gets the same)
        dataset.set_batch_slots(sampler.indices(), batch_size)
    return repeats - done


def build_loader(dataset: Dataset, *, batch_size: int, shuffle: bool = False, sampler: Iterable[int] | None = None,
                 collate_fn: Callable | None = None, loader: Literal["threads", "processes"] = "threads",
                 num_workers: int = 2, drop_last: bool = False, seed: int = 0, repeats: int = 1,
                 pin_memory: bool = False) -> ThreadLoader | ProcessLoader:
    """A loader with ``len()``, ``set_epoch(epoch)`` and ``.sampler``; batch order depends only on
    (seed, epoch) or the sampler, not on ``num_workers``.

    Args:
        dataset: map-style dataset of dict items.
        batch_size: items per batch.
        shuffle: shuffle by (seed, epoch) when no sampler is given.
        sampler: explicit index order (e.g. a distributed shard); overrides ``shuffle``.
        collate_fn: items -> batch.
        loader: ``threads`` (default) or ``processes`` (torch DataLoader workers).
        num_workers: threads or processes.
        drop_last: drop a final short batch.
        seed: shuffle seed.
        repeats: yield each batch this many times.
        pin_memory: pin batches for asynchronous host-to-device copies.
    """
    if batch_size < 1 or repeats < 1 or num_workers < 0:
        raise ConfigError(f"loader: batch_size and repeats must be >= 1, num_workers >= 0 "
                          f"(got {batch_size}, {repeats}, {num_workers})")
    reason = getattr(dataset, "main_process_only", None)
    if reason and loader == "processes" and num_workers > 0:
        raise ConfigError(f"{reason}: set data.loader: threads (or data.num_workers: 0)")
    kw = dict(batch_size=batch_size, sampler=sampler, shuffle=shuffle, seed=seed, collate_fn=collate_fn,
              num_workers=num_workers, drop_last=drop_last, repeats=repeats, pin_memory=pin_memory)
    if loader == "threads":
        return ThreadLoader(dataset, **kw)
    if loader == "processes":
        return ProcessLoader(dataset, **kw)
    raise ConfigError(f"data.loader must be 'threads' or 'processes', got {loader!r}")


def prefetch_depth(loader: Any) -> tuple[int, int]:
    """``(ready, producers)``: the batches ``loader`` has built ahead of a consumer that paused (what it
    finds ready when it resumes, so a timer takes them untimed) and the threads or processes that
    build them. A :class:`ThreadLoader` tops its window up before it hands a batch out, so one less
    than the window is ready; a torch ``DataLoader`` keeps ``prefetch_factor`` batches per worker
    outstanding. A :class:`DevicePrefetcher` fetches its next batch in the consumer's thread, so it
    adds none; a loader of another kind says so with a ``prefetch_depth`` attribute (DALI: its
    queue depth) and builds with one producer as far as a timer can tell."""
    if isinstance(loader, DevicePrefetcher):
        return prefetch_depth(loader.loader)
    if isinstance(loader, ThreadLoader):
        return (loader.window - 1) * loader.repeats, loader.num_workers
    if isinstance(loader, ProcessLoader):
        dl = loader.loader
        if not dl.num_workers:
            return 0, 1
        return dl.num_workers * (dl.prefetch_factor or 2) * loader.repeats, dl.num_workers
    return int(getattr(loader, "prefetch_depth", 2)), 1


class DevicePrefetcher:
    """Iterate ``loader`` with each batch already on ``device``: on CUDA the copy of batch k+1 runs
    on a side stream while batch k computes (pin the batches for it to be asynchronous).

    Stream order: the current stream waits on the side stream before a batch is used, and its
    tensors are recorded on the current stream (their memory was allocated on the side stream);
    a batch that is already on the GPU (GPU cache) was made on the current stream, so the side
    stream first waits on the current stream and records the batch as used by the side stream.

    Args:
        loader: any iterable of batches (with ``len`` and optionally ``set_epoch``).
        device: target device.
        to_device: ``(batch, device) -> batch`` (e.g. ``Task.to_device``); default moves every tensor.
    """

    def __init__(self, loader: Any, device: torch.device, to_device: Callable[[Any, torch.device], Any] | None = None):
        self.loader, self.device = loader, torch.device(device)
        self.to_device = to_device or _move
        self.sampler = getattr(loader, "sampler", None)

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        self.loader.set_epoch(epoch, start_sample=start_sample)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            for batch in self.loader:
                yield self.to_device(batch, self.device)
            return
        stream = torch.cuda.Stream(self.device)
        it = iter(self.loader)

        def ahead() -> Any:
            try:
                host = next(it)
            except StopIteration:
                return None
            if _has_cuda(host):  # already on the GPU (the GPU cache): made by work on the current stream
                stream.wait_stream(torch.cuda.current_stream(self.device))  # ... that must finish first
                _record(host, stream)  # and its memory is not reused while the side stream reads it
            with torch.cuda.stream(stream):
                return self.to_device(host, self.device)

        nxt = ahead()
        while nxt is not None:
            cur = nxt
            torch.cuda.current_stream(self.device).wait_stream(stream)
            _record(cur, torch.cuda.current_stream(self.device))  # memory made on the side stream
            nxt = ahead()
            yield cur


def _move(batch: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device, non_blocking=True), batch)


def _has_cuda(batch: Any) -> bool:
    return any(t.is_cuda for t in tensors(batch))


def _record(batch: Any, stream: torch.cuda.Stream) -> None:
    for t in tensors(batch):
        t.record_stream(stream)
