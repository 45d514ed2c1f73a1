"""The running job's process group as seen by this process: rank, world size, horovod or not.

A leaf module (no fastvision imports) so that both :mod:`fastvision.distributed` (collectives, DDP wrap)
and :mod:`fastvision.distributed.samplers` (which shard by rank) can read it without importing each other.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist


class _Horovod:
    """Holds ``horovod.torch`` once ``distributed.init(backend="horovod")`` ran (None otherwise)."""

    module: Any = None


HOROVOD = _Horovod()


class _Alone:
    """Depth of :func:`alone` blocks open in this process."""

    depth = 0


ALONE = _Alone()


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """While open, this process works by itself inside its job: :func:`active` is False, so the
    collectives are identities and a model is not wrapped (no DDP, no SyncBatchNorm, no horovod
    optimizer). For work each rank does on its own device, a number of steps that differs between
    ranks (``--batch-size auto``'s search): a collective then would wait for ranks that never make it.
    :func:`rank` and :func:`world_size` still name the job's."""
    ALONE.depth += 1
    try:
        yield
    finally:
        ALONE.depth -= 1


def active() -> bool:
    """More than one process joined a group (collectives do something), outside :func:`alone`."""
    if ALONE.depth:
        return False
    if HOROVOD.module is not None:
        return HOROVOD.module.size() > 1
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """Global rank of this process (0 without a process group)."""
    if HOROVOD.module is not None:
        return HOROVOD.module.rank()
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    if HOROVOD.module is not None:
        return HOROVOD.module.size()
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
