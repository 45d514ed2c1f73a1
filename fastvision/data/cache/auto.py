"""``data.cache: auto``: the fastest memory tier the training set fits in, chosen before the fill.

The cached bytes are measured, not guessed: item 0 through the dataset's deterministic prefix (what a
cache holds), times the items. Then, with half of what is free kept for the step, the model and the
other processes (``HEADROOM``):

* ``gpu`` on a CUDA device when this rank's share of the items (about ``1/world`` of them, the epoch's
  share that cache keeps on the device) fits in half the device's free memory, and their host copy (one
  per node) fits in half the host's;
* ``shared`` (one copy per node in ``/dev/shm``) with several ranks on the node, when the items fit in
  half of ``/dev/shm``'s free space; ``ram`` in one process (or, with several ranks, when a copy per rank
  fits) in half the available RAM;
* else ``none``: each access runs the pipeline. ``disk`` is never chosen: whether preprocessed items
  read from a disk beat preprocessing again depends on the disk (``fastvision tune`` or ``benchmark
  --mode data --cache none,disk`` measure it).

In a job every rank decides for its own device and memory, and all take the slowest tier any rank chose
(the node-shared tiers are filled by the node's ranks together). Every tier serves the same items (the
caches' contract), so the choice changes speed, never the run.
"""
from __future__ import annotations

import logging
import shutil
from typing import Any

import torch

from fastvision.data import transforms as T
from fastvision.data.cache.datasets import available_ram, item_nbytes

log = logging.getLogger(__name__)

HEADROOM = 0.5  # share of the free memory a cache may take
ORDER = ("gpu", "shared", "ram", "none")  # fastest first; a job takes the slowest tier any rank chose


def choose(total: int, *, device_type: str, world_size: int, local_world_size: int, ram_free: int,
           shm_free: int = 0, gpu_free: int = 0) -> tuple[str, str]:
    """``(tier, why)`` for ``total`` cached bytes on this machine (the rule of the module docstring)."""
    gib = 2**30
    host_free = shm_free if local_world_size > 1 else ram_free  # the gpu cache's host copy: one per node
    if device_type == "cuda" and total / max(1, world_size) <= HEADROOM * gpu_free and total <= HEADROOM * host_free:
        return "gpu", (f"this rank's share {total / max(1, world_size) / gib:.2f} GiB of {gpu_free / gib:.1f} GiB "
                       f"free on the device")
    if local_world_size > 1 and total <= HEADROOM * shm_free:
        return "shared", f"{total / gib:.2f} GiB of {shm_free / gib:.1f} GiB free in /dev/shm, one copy per node"
    copies = local_world_size if local_world_size > 1 else 1
    if copies * total <= HEADROOM * ram_free:
        per = f"{copies} copies: " if copies > 1 else ""
        return "ram", f"{per}{copies * total / gib:.2f} GiB of {ram_free / gib:.1f} GiB of available RAM"
    return "none", (f"{total / gib:.2f} GiB fits no memory tier (RAM {ram_free / gib:.1f} GiB available); "
                    "data.cache: disk keeps the preprocessed items on disk")


def cached_bytes(dataset: Any) -> int:
    """Bytes a cache would hold: item 0 through the deterministic prefix, times the items."""
    from fastvision.data.cache.select import cache_source

    n = len(dataset)
    if n == 0:
        return 0
    base, pipeline, _ = cache_source(dataset, check=False)
    prefix, _ = T.split(pipeline)
    return item_nbytes(T.apply(prefix, base[0])) * n


def resolve(dataset: Any, env: Any, device: torch.device | str) -> str:
    """``data.cache: auto`` -> the tier for this dataset here, logged in one line with its reason."""
    device = torch.device(device)
    total = cached_bytes(dataset)
    gpu_free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    try:
        shm_free = shutil.disk_usage("/dev/shm").free
    except OSError:
        shm_free = 0
    tier, why = choose(total, device_type=device.type, world_size=env.world_size,
                       local_world_size=env.local_world_size, ram_free=available_ram(), shm_free=shm_free,
                       gpu_free=gpu_free)
    from fastvision import distributed

    tiers = distributed.gather_objects(tier)  # the ranks fill the shared tiers together: one tier for the job
    job = max(tiers, key=ORDER.index)
    if job != tier:
        why = f"rank {tiers.index(job)} fits only {job}; here: {tier}, {why}"
    log.info("data.cache auto: %s (%d items, %.1f MiB cached; %s)", job, len(dataset), total / 2**20, why)
    return job
