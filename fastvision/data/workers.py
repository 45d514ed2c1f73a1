"""``data.num_workers: auto``: the loader workers this rank's own cores allow, resolved once at build.

The rule (:func:`choose`, a pure function of the numbers; :func:`resolve` gathers them here):

1. **Cores**: the CPUs this process may run on, ``os.sched_getaffinity(0)`` (what a cpuset, ``taskset``,
   srun's ``--cpu-bind`` or torchrun's ``--numa-binding`` left it; the set torch's DataLoader checks its
   worker count against), else ``os.cpu_count()``.
2. **This rank's share**: every one of those cores split evenly among the ranks of this node that may run
   on it. The ranks gather (node, affinity) once, the node named by the kernel's boot id (the machine,
   whatever the container's host name), so the rule needs no launcher variable: ranks with one set
   (torchrun, srun without binding, horovodrun) take ``cores / ranks on the node`` each; ranks pinned to
   disjoint sets (srun ``--cpu-bind=cores``, DLE's ``--affinity socket_unique_*``) keep their own set,
   not divided again; overlapping sets (a NUMA binding with two ranks per socket) take the sum over their
   cores of ``1 / ranks allowed on that core``. Where no gather is possible (inside
   ``distributed.alone``), the rank assumes the ``DistEnv.local_world_size`` ranks of its node share its set.
3. **Minus the main process's compute**: on the CPU the torch intra-op threads (``train.cpu_threads``, else
   torch's count: OMP_NUM_THREADS, 1 under torchrun), which run the model; on CUDA one core, the training
   thread that launches the kernels and collates (the GPU computes).
4. **Bounded** to ``[0, MAX_WORKERS]``: 8 per process is NVIDIA DeepLearningExamples' nnU-Net default
   (``--num_workers 8`` per GPU process, PyTorch/Segmentation/nnUNet/utils/args.py); more workers than that
   mostly hold memory. 0: the batches are built by the loader's one background thread (``threads``) or
   the main process (``processes``).

A CPU time quota without a cpuset (cgroup ``cpu.max``, docker ``--cpus``) is not read: it leaves the
affinity whole, so such a container should set ``data.num_workers`` (or ``taskset`` the process).

Every rank decides for itself (the loader count never changes which items a step reads, their order or
values: docs/CONTRACTS.md), and the number replaces ``auto`` in the run's config, so its ``config.yaml``
holds rank 0's.
"""
from __future__ import annotations

import logging
import socket
from collections import Counter
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from fastvision.utils.hostcpu import process_cores

log = logging.getLogger(__name__)

MAX_WORKERS = 8  # per process: NVIDIA DLE nnU-Net's --num_workers default (one process per GPU)


def node_key() -> str:
    """What the ranks of one machine share: the kernel's boot id, else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def share_of(mine: Collection[int], node: Sequence[Collection[int]]) -> float:
    """This rank's share of its cores: each core of ``mine`` split among the sets of ``node`` (every rank
    of this node, this one included) that hold it."""
    holders = Counter(c for s in node for c in set(s))
    return sum(1 / max(1, holders[c]) for c in set(mine))


def _sharing(mine: Collection[int], node: Sequence[Collection[int]]) -> str:
    """The share's reason: ``"8 cores in this process's affinity / 2 ranks on the node"`` and the like."""
    n, ranks, own = len(set(mine)), len(node), set(mine)
    text = f"{n} core{'s' * (n != 1)} in this process's affinity"
    if ranks == 1:
        return text
    overlap = [s for s in node if own & set(s)]
    if len(overlap) == 1:
        others = "rank runs" if ranks == 2 else f"{ranks - 1} ranks run"
        return f"{text}, its own (the node's other {others} on other cores)"
    if all(set(s) == own for s in overlap):
        return f"{text} / {len(overlap)} ranks on the node"
    return (f"{text}, shared in part with {len(overlap) - 1} of the node's other ranks: a share of "
            f"{share_of(mine, node):.1f}")


def choose(mine: Collection[int], node: Sequence[Collection[int]], *, threads: int, device_type: str,
           cap: int = MAX_WORKERS) -> tuple[int, str]:
    """``(workers, why)`` for a rank that may run on the cores ``mine`` (the rule of the module docstring).

    Args:
        mine: this process's CPUs (its affinity set).
        node: the affinity set of every rank on this node, ``mine`` included (``[mine]`` alone).
        threads: the main process's torch intra-op threads (what it computes with on the CPU).
        device_type: ``"cpu"`` or ``"cuda"``: on CUDA the main process needs one core, on the CPU ``threads``.
        cap: the most workers a process gets.
    """
    share = int(share_of(mine, node) + 1e-9)
    main = 1 if device_type == "cuda" else max(1, threads)
    want = share - main
    workers = max(0, min(cap, want))
    why = _sharing(mine, node)
    why += (", 1 for the main process (the GPU computes)" if device_type == "cuda"
            else f", {main} for the main process's torch thread{'s' * (main != 1)} (the {device_type} computes)")
    if want > cap:
        why += f"; at most {cap} per process (NVIDIA DLE nnU-Net's default)"
    elif want <= 0:
        why += "; the loader's own thread or the main process builds the batches"
    return workers, why


def resolve(env: Any, device: torch.device | str, threads: int | None = None) -> int:
    """``data.num_workers: auto`` -> this rank's number, logged in one line with its reason.

    Every rank of the job calls it at the same point (one gather of each rank's node and affinity).

    Args:
        env: the job's :class:`~fastvision.distributed.DistEnv` (local world size where no gather runs).
        device: the training device.
        threads: the main process's intra-op threads; None: torch's count now.
    """
    from fastvision import distributed

    mine, key = process_cores(), node_key()
    every = distributed.gather_objects((key, sorted(mine)))
    node = [frozenset(s) for k, s in every if k == key]
    if len(every) == 1 and env.local_world_size > 1:  # no collective here: assume the node's ranks share the set
        node = [mine] * env.local_world_size
    device_type = torch.device(device).type
    workers, why = choose(mine, node, threads=threads or torch.get_num_threads(), device_type=device_type)
    who = f"rank {env.rank}: " if env.world_size > 1 else ""
    log.info("%sdata.num_workers auto: %d (%s)", who, workers, why)
    return workers
