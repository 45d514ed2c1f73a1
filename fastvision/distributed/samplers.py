"""Data-parallel samplers: deterministic training shards and unpadded validation shards.

Two different rules on purpose (see :mod:`fastvision.distributed`): :class:`TrainSampler` pads by
wrapping around so every rank runs the same number of steps; :class:`EvalSampler` never pads, so
metric sums reduced across ranks are the whole-set sums. Both default their world size and rank
to the running job's; :mod:`fastvision.distributed` re-exports them.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sized

import torch
from torch.utils.data import Sampler

from fastvision.distributed.group import rank, world_size
from fastvision.errors import ConfigError


def _length(data: Sized | int) -> int:
    return data if isinstance(data, int) else len(data)


def _group(num_replicas: int | None, rank_: int | None) -> tuple[int, int]:
    n = world_size() if num_replicas is None else num_replicas
    r = rank() if rank_ is None else rank_
    if not 0 <= r < n:
        raise ValueError(f"rank {r} outside [0, {n})")
    return n, r


def _mix_seed(seed: int, epoch: int) -> int:
    """A 32-bit generator seed from ``(seed, epoch)`` by splitmix64 finalisation.

    ``seed + epoch`` would make (0, 1) and (1, 0) the same epoch; and torch's CPU generator keeps
    only the low 32 bits of its seed, so the two numbers are mixed rather than concatenated.
    """
    mask = (1 << 64) - 1
    z = ((seed & 0xFFFFFFFF) << 32 | (epoch & 0xFFFFFFFF)) & mask
    z = (z + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & 0xFFFFFFFF


class TrainSampler(Sampler[int]):
    """This rank's share of a permutation that depends only on ``(seed, epoch)``.

    Every rank yields ``ceil(n / world)`` indices (or ``floor`` with ``drop_last``); the permutation
    is padded by wrapping around so all ranks run the same number of steps. Rank ``r`` takes
    positions ``r, r + world, ...``, so with per-rank batch ``b`` the ranks' ``k``-th batches together
    are positions ``[k*b*world, (k+1)*b*world)`` of the permutation: the same global batch as one
    process with batch ``b*world``. Call :meth:`set_epoch` before every epoch.

    Args:
        data: the dataset (anything with ``len``) or its length.
        num_replicas: world size (default: the process group's).
        rank: this rank (default: the process group's).
        seed: permutation seed, shared by all ranks.
        shuffle: permute (else the natural order).
        drop_last: drop the tail instead of padding.
        emulate_workers: in one process, order the indices as the micro-batches of this many
            workers (``--emulate-workers``); each emulated worker's partial last batch is dropped,
            as a training loader with ``drop_last`` does on a real rank.
        batch_size: per-worker batch, needed when emulating and with ``full_batches``.
        full_batches: the training rule: keep whole global batches only (``world x emulate x
            batch_size`` items each) where the set holds at least one, so the epoch reads no item twice
            (a padded shard of ``ceil(n / world)`` could fill a last global batch with a repeat that one
            process at the global batch never reads); a set smaller than one global batch is shared out
            unpadded (shards differ by at most one), padded only where the ranks outnumber the items.
        order: the dataset's own order of an epoch (a shard set's shard-aware permutation), drawn
            from the generator this sampler seeds with (seed, epoch); default a uniform permutation.
    """

    def __init__(self, data: Sized | int, *, num_replicas: int | None = None, rank: int | None = None,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, emulate_workers: int = 1,
                 batch_size: int = 1, order: Callable[[torch.Generator], list[int]] | None = None,
                 full_batches: bool = False):
        self.n, self.order = _length(data), order
        self.num_replicas, self.rank = _group(num_replicas, rank)
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.emulate, self.batch_size = emulate_workers, batch_size
        if emulate_workers > 1 and self.num_replicas != 1:
            raise ConfigError("emulated workers run in one process; do not combine with several ranks")
        self.epoch, self.start = 0, 0
        shards = self.num_replicas * self.emulate
        whole = shards * batch_size
        if full_batches and self.n >= whole:
            self.total = (self.n // whole) * whole
        elif full_batches and self.emulate == 1 and self.n >= shards:
            self.total = self.n  # under one global batch: every item once, shards of unequal length
        elif drop_last:
            self.total = (self.n // shards) * shards
        else:
            self.total = math.ceil(self.n / shards) * shards

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Epoch ``epoch``'s order; iteration begins at position ``start`` of the epoch's (padded)
        permutation, counted over all ranks: a mid-epoch resume continues at the sample it reached,
        whatever the world size then and now (the items before it are never read). Rank ``r``
        begins at its first position ``>= start``."""
        self.epoch, self.start = epoch, start

    def permutation(self, epoch: int | None = None) -> list[int]:
        """The whole (padded) permutation of ``epoch`` (default: the current one), identical on every rank."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(_mix_seed(self.seed, self.epoch if epoch is None else epoch))
            order = self.order(g) if self.order else torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        if self.total > self.n and self.n > 0:
            order = (order * math.ceil(self.total / self.n))[: self.total]
        return order[: self.total]

    def indices(self, epoch: int | None = None) -> list[int]:
        """This rank's indices of ``epoch`` (default: the current one) in the order it reads them,
        from the epoch's first position (a mid-epoch start skips a prefix of them): what a cache
        that holds one epoch's share (``data.cache: gpu``) places on the device."""
        order = self.permutation(epoch)
        if self.emulate == 1:
            return order[self.rank :: self.num_replicas]
        # Emulation: worker w's j-th batch comes right after worker w-1's j-th batch, so a loader
        # with ``batch_size`` and ``emulate`` x accumulation steps sees exactly the micro-batches
        # the ranks of a real ``emulate``-process job would see (same BatchNorm batches).
        shards = [order[w :: self.emulate] for w in range(self.emulate)]
        b, full = self.batch_size, len(shards[0]) // self.batch_size
        return [i for j in range(full) for shard in shards for i in shard[j * b:(j + 1) * b]]

    def __iter__(self) -> Iterator[int]:
        mine = self.indices()
        if self.emulate == 1:  # this rank's first position >= start: ceil((start - rank) / ranks)
            return iter(mine[max(0, -(-(self.start - self.rank) // self.num_replicas)):])
        return iter(mine[self.start:])

    def __len__(self) -> int:
        if self.emulate > 1:
            return (self.total // self.emulate // self.batch_size) * self.batch_size * self.emulate
        return len(range(self.rank, self.total, self.num_replicas))


class EvalSampler(Sampler[int]):
    """A contiguous, unpadded shard of ``range(n)``: every index on exactly one rank.

    Shard lengths differ by at most one. Metric sums from all ranks add up to the whole-set sums, so
    a reduced IoU/Dice is exact (DistributedSampler's padding would count some samples twice).

    Args:
        data: the dataset (anything with ``len``) or its length.
        num_replicas: world size (default: the process group's).
        rank: this rank (default: the process group's).
    """

    def __init__(self, data: Sized | int, *, num_replicas: int | None = None, rank: int | None = None):
        self.n = _length(data)
        self.num_replicas, self.rank = _group(num_replicas, rank)
        self.start = self.rank * self.n // self.num_replicas
        self.stop = (self.rank + 1) * self.n // self.num_replicas

    def set_epoch(self, epoch: int) -> None:  # same order every epoch; present for a uniform loop
        pass

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start
