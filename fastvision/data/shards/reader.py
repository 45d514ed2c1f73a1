"""Random access to the samples of a split's shards, and the shard-aware epoch order.

:class:`ShardReader` maps sample ``i`` of a split to (shard, position) by the index's sample
counts, opens a shard on first use (fetching it through the :class:`~.store.ShardStore`, reading
it once sequentially to verify its sha256 and build its member table) and keeps a bounded number
of shards open; a sample's members are then ``pread`` from the open file. Files opened per epoch
is the number of shards (``opens`` counts them), not the number of samples.

:func:`shard_order` is the training order: a permutation of the shards, then the samples of each
window of ``window`` consecutive shards of it shuffled together, all drawn from the one generator
the sampler seeds with (seed, epoch). It depends on nothing else, so the sampler's padding,
per-rank striding and mid-epoch start work on it as on a uniform permutation.
"""
from __future__ import annotations

import bisect
import collections
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from fastvision.data.shards import tario
from fastvision.data.shards.store import Shard, ShardStore
from fastvision.errors import DataError

META = ("cls", "id", "json")  # the label members; the other one of a sample is its encoded file


def tar_samples(path: Path, name: str, verify: bool) -> tuple[list, str | None]:
    """A tar shard's samples ``[(key, {ext: (offset, size)})]`` and, with ``verify``, its sha256."""
    table, sha = tario.scan(path, name, verify)
    return tario.samples(table), sha


def shard_order(counts: list[int], window: int, generator: torch.Generator) -> list[int]:
    """A shard-aware permutation of ``sum(counts)`` samples (shard ``s`` holds a contiguous range).

    Args:
        counts: samples per shard, in index order.
        window: shards whose samples are shuffled together (consecutive in the shard permutation).
        generator: the epoch's generator (the sampler seeds it from (seed, epoch)).
    """
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    perm = torch.randperm(len(counts), generator=generator).tolist()
    order: list[int] = []
    for w in range(0, len(perm), max(1, window)):
        block = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in perm[w:w + max(1, window)]])
        order += block[torch.randperm(len(block), generator=generator)].tolist()
    return order


class ShardReader:
    """Samples of one split (see the module docstring).

    Args:
        store: where the shard files come from.
        shards: the split's shards, in index order.
        verify: check each shard's sha256 when this process first opens it (a download is always
            checked while it streams).
        keep_open: shards kept open at once (least recently used closed first).
        scan: ``(path, name, verify) -> (samples, sha256 or None)`` of one file (default: a tar shard's;
            :func:`.tfrecord.scan` for TFRecords).
        convert: ``(name, {member: bytes}) -> {member: bytes}`` applied to each sample read (a
            TFRecord's Example -> ImageFolder members), or None.
    """

    def __init__(self, store: ShardStore, shards: list[Shard], verify: bool = True, keep_open: int = 8,
                 scan: Callable = tar_samples, convert: Callable | None = None):
        self.store, self.shards, self.verify, self.keep_open = store, shards, verify, max(1, keep_open)
        self.scan, self.convert = scan, convert
        self.starts = [0]
        for s in shards:
            self.starts.append(self.starts[-1] + s.nsamples)
        self.opens = 0  # shard files opened by this process
        self._open: collections.OrderedDict[int, tuple[int, list]] = collections.OrderedDict()  # s -> (fd, samples)
        self._busy: collections.Counter[int] = collections.Counter()
        self._verified: set[int] = set()
        self._lock = threading.Lock()
        self._opening: dict[int, threading.Lock] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def counts(self) -> list[int]:
        return [s.nsamples for s in self.shards]

    def locate(self, i: int) -> tuple[int, int]:
        """``(shard index, position in the shard)`` of sample ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} outside [0, {len(self)})")
        s = bisect.bisect_right(self.starts, i) - 1
        return s, i - self.starts[s]

    def name(self, s: int) -> str:
        return self.store.name(self.shards[s].url)

    def check(self, s: int) -> None:
        """Open (fetch, verify, index) shard ``s`` now: a bad shard raises its one-line DataError."""
        self._acquire(s)
        self._release(s)

    def _load(self, s: int) -> tuple[int, list]:
        shard, name = self.shards[s], self.name(s)
        verify = self.verify and not self.store.remote and s not in self._verified
        for attempt in range(2):
            path = self.store.local(shard)
            try:
                samples, sha = self.scan(path, name, verify)
                fd = os.open(path, os.O_RDONLY)
                break
            except FileNotFoundError as e:  # another process evicted the cached copy meanwhile: fetch it again
                if attempt or not self.store.remote:
                    raise DataError(f"{name}: not found ({e.strerror})") from e
            except OSError as e:
                raise DataError(f"{name}: cannot read ({e.strerror or e})") from e
        problem = None
        if verify and sha is not None and sha != shard.sha256:
            problem = (f"{name}: checksum mismatch (sha256 {sha[:12]}..., the index says {shard.sha256[:12]}...): "
                       f"a corrupt or replaced shard")
        elif len(samples) != shard.nsamples:
            problem = (f"{name}: {len(samples)} samples, the index says {shard.nsamples}: the index disagrees "
                       f"with its shards")
        if problem:
            os.close(fd)
            raise DataError(problem)
        self._verified.add(s)
        return fd, samples

    def _acquire(self, s: int) -> tuple[int, list]:
        with self._lock:
            if s in self._open:
                self._open.move_to_end(s)
                self._busy[s] += 1
                return self._open[s]
            opening = self._opening.setdefault(s, threading.Lock())
        with opening:  # one thread opens a shard; the others wait for it instead of fetching it again
            with self._lock:
                entry = self._open.get(s)
            if entry is None:
                entry = self._load(s)
                with self._lock:
                    self._open[s] = entry
                    self.opens += 1
            with self._lock:
                self._busy[s] += 1
                self._open.move_to_end(s)
                return entry

    def _release(self, s: int) -> None:
        with self._lock:
            self._busy[s] -= 1
            idle = [k for k in self._open if self._busy[k] == 0]
            while len(self._open) > self.keep_open and idle:
                os.close(self._open.pop(idle.pop(0))[0])

    def sample(self, i: int) -> tuple[str, dict[str, bytes]]:
        """``(name "shard-url:key", {ext: bytes})`` of sample ``i``."""
        s, j = self.locate(i)
        fd, samples = self._acquire(s)
        try:
            key, members = samples[j]
            data = {ext: os.pread(fd, size, off) for ext, (off, size) in members.items()}
        finally:
            self._release(s)
        name = f"{self.name(s)}:{key}"
        return name, (self.convert(name, data) if self.convert else data)

    def identity(self, i: int) -> str:
        """Sample ``i`` by its shard's checksum and position: the disk-cache key."""
        s, j = self.locate(i)
        return f"shard:{self.shards[s].sha256}:{j}"

    def __getstate__(self):  # worker processes open their own files
        state = dict(self.__dict__)
        state.update(_open=collections.OrderedDict(), _busy=collections.Counter(), _lock=None, _opening={})
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()


def encoded(members: dict[str, bytes], name: str) -> bytes:
    """The encoded file of a sample (its one non-label member)."""
    files = [v for k, v in members.items() if k not in META]
    if len(files) != 1:
        raise DataError(f"{name}: expected one image member beside {'/'.join(META)}, found "
                        f"{', '.join(k for k in members if k not in META) or 'none'}")
    return files[0]
