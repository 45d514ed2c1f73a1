"""Distributed data parallelism: the one place that reads the launch environment.

One process, ``torchrun`` (one node or many) and ``srun`` under SLURM share one code path:
:func:`detect_env` turns the environment into a :class:`DistEnv`, :func:`init` starts the process
group (NCCL on CUDA, gloo on CPU) only when there is more than one process, and everything else
(reductions, the DDP wrap, samplers) degrades to a no-op or an identity in a single process, so
the engine never branches on the world size.

Samplers follow two different rules on purpose:

* :class:`TrainSampler` gives every rank the same number of indices (wrap-around padding), because
  DDP needs every rank to run the same number of steps. Rank ``r`` takes every ``world``-th index of
  a permutation fixed by ``(seed, epoch)``, so the union of the ranks' ``k``-th batches is exactly
  the ``k``-th batch of a one-process run with the same global batch.
* :class:`EvalSampler` gives contiguous, uneven shards with no duplicates, so metric sums reduced
  across ranks are exactly the whole-set sums. Evaluate with :func:`unwrap` (the bare module), never
  the DDP wrapper, because ranks run different numbers of validation steps.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Mapping, Sequence, Sized

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Sampler

from .errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_PORT = 29500
# Port derived from a SLURM job id lands in [SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN):
# above the common service ports and below the Linux ephemeral range (32768+), so two jobs sharing a
# node rarely collide and an outgoing connection never holds the port.
SLURM_PORT_BASE = 12000
SLURM_PORT_SPAN = 20000
# Slurm's id for the batch-script step (SLURM_BATCH_SCRIPT): not a task launched by srun.
_SLURM_BATCH_STEP = "4294967294"


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job.

    Attributes:
        rank: global rank in ``[0, world_size)``.
        local_rank: rank among the processes on this node (selects the GPU).
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        launcher: ``"single"``, ``"torchrun"`` or ``"slurm"``.
        master_addr: host of rank 0 (rendezvous address).
        master_port: TCP port of the rendezvous store.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "single"
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


# --------------------------------------------------------------------------- environment


def _int(environ: Mapping[str, str], key: str) -> int:
    try:
        return int(environ[key])
    except ValueError:
        raise ConfigError(f"environment variable {key}={environ[key]!r} is not an integer") from None


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as ``"node[01-03,07],gpu5"`` into host names.

    Zero padding of range bounds is kept (``[08-10]`` -> ``08, 09, 10``); several bracket groups in
    one name expand to their product (``r[1-2]n[1-2]`` -> ``r1n1, r1n2, r2n1, r2n2``).
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        expanded = [""]
        for literal, group in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            if not literal and not group:
                continue
            parts = [literal]
            if group:
                parts = [literal + n for n in _expand_range_group(group, nodelist)]
            expanded = [prefix + p for prefix in expanded for p in parts]
        hosts.extend(h for h in expanded if h)
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_range_group(group: str, nodelist: str) -> list[str]:
    out = []
    for part in group.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ConfigError(f"cannot parse SLURM node list {nodelist!r} (range {part!r})")
        if not hi:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from a SLURM spec such as ``"2(x3),1"``."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ConfigError(f"cannot parse SLURM tasks-per-node {tasks_per_node!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[min(node_id, len(counts) - 1)]


def _slurm_port(environ: Mapping[str, str]) -> int:
    if "MASTER_PORT" in environ:
        return _int(environ, "MASTER_PORT")
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "0"
    digits = re.sub(r"\D", "", job) or "0"
    return SLURM_PORT_BASE + int(digits) % SLURM_PORT_SPAN


def detect_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """Read the launch environment.

    Precedence: torchrun variables (``RANK``/``WORLD_SIZE``, also set by ``torchrun`` inside a SLURM
    job), then a task started by ``srun``, then a single process.

    Args:
        environ: the environment to read (a plain dict in tests).

    Returns:
        The process's place in the job.

    Raises:
        ConfigError: a multi-task SLURM allocation entered without ``srun`` (every task would think
            it is alone and train on the whole data set), or malformed variables.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world = _int(environ, "WORLD_SIZE")
        return DistEnv(
            rank=_int(environ, "RANK"),
            local_rank=_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
            world_size=world,
            local_world_size=_int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world,
            launcher="torchrun",
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else DEFAULT_PORT,
        )

    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    under_srun = "SLURM_PROCID" in environ and step is not None and step != _SLURM_BATCH_STEP
    if job_id is not None and under_srun:
        world_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
        world = _int(environ, world_key) if world_key in environ else 1
        node_id = _int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
        per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
        nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                    or environ.get("SLURM_NODELIST"))
        if "MASTER_ADDR" in environ:
            master = environ["MASTER_ADDR"]
        elif nodelist:
            master = expand_nodelist(nodelist)[0]
        else:
            master = "127.0.0.1"
        return DistEnv(
            rank=_int(environ, "SLURM_PROCID"),
            local_rank=_int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
            world_size=world,
            local_world_size=_tasks_on_node(per_node, node_id) if per_node else world,
            launcher="slurm",
            master_addr=master,
            master_port=_slurm_port(environ),
        )

    if job_id is not None:
        ntasks = _int(environ, "SLURM_NTASKS") if "SLURM_NTASKS" in environ else 1
        if ntasks > 1:
            raise ConfigError(
                f"SLURM job {job_id} has {ntasks} tasks (SLURM_NTASKS) but this process was not started by "
                "srun (no SLURM_PROCID/SLURM_STEP_ID): launch with `srun fastvision train ...` "
                "(see scripts/slurm/train.sbatch), or with torchrun"
            )
    return DistEnv()


# --------------------------------------------------------------------------- process group


def _resolve_device(device: str, env: DistEnv) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} requested but CUDA is not available")
        count = torch.cuda.device_count()
        if dev.index is None:
            # A job step may expose one GPU per task (CUDA_VISIBLE_DEVICES per task), hence the modulo.
            dev = torch.device("cuda", env.local_rank % count)
            if count < env.local_world_size and env.local_rank == 0:
                log.warning("%d processes on this node share %d visible GPU(s)", env.local_world_size, count)
        torch.cuda.set_device(dev)
    return dev


def init(device: str = "auto", timeout_s: float = 300) -> tuple[DistEnv, torch.device]:
    """Detect the launch environment, pick the device and join the process group.

    Args:
        device: ``"auto"`` (``cuda:local_rank`` when CUDA is available, else ``cpu``), ``"cpu"``,
            ``"cuda"`` or ``"cuda:N"``.
        timeout_s: collective timeout in seconds; a hung peer fails the job after this long.

    Returns:
        ``(env, device)``. The process group is started (NCCL on CUDA, gloo otherwise) only when
        ``env.world_size > 1``; calling again after a successful init is harmless.
    """
    env = detect_env()
    dev = _resolve_device(device, env)
    if env.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if env.launcher == "torchrun":
            init_method = "env://"  # torchrun publishes MASTER_ADDR/PORT and may use its own store
        else:
            host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
            init_method = f"tcp://{host}:{env.master_port}"
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = dev  # binds the communicator to our GPU: no guessing in barrier()
        dist.init_process_group(backend, init_method=init_method, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
        log.info("joined %s process group: rank %d of %d (%s, %s:%d)", backend, env.rank, env.world_size,
                 env.launcher, env.master_addr, env.master_port)
    return env, dev


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """Global rank of this process (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    """True on the process that logs and writes checkpoints."""
    return rank() == 0


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum ``t`` across ranks in place and return it (identity in one process)."""
    if _active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def reduce_evaluator(evaluator: Any) -> Any:
    """Sum an :class:`~fastvision.tasks.base.Evaluator`'s state across ranks; returns it."""
    if _active():
        evaluator.load_state(all_reduce_sum(evaluator.state().clone()))
    return evaluator


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (``obj`` itself in one process)."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank (e.g. detections for COCO eval)."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if _active():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group, if one was started."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def launch_local(nproc: int, cmd: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """Run ``cmd`` as ``nproc`` workers on this node through torch's own launcher; return its exit code.

    ``torch.distributed.run --standalone`` picks a free rendezvous port, sets ``RANK``/``LOCAL_RANK``/
    ``WORLD_SIZE`` for each worker and, if one worker dies, stops the others and names the failed
    rank, so a crash never leaves a job hanging in a collective.

    Args:
        nproc: number of worker processes.
        cmd: what torchrun runs, e.g. ``["-m", "fastvision.cli", "train", "unet2d-microscopy"]``.
        environ: environment for the workers (default: this process's).
    """
    env = dict(os.environ if environ is None else environ)
    # Without this torchrun sets 1 thread per worker and warns; share the cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc))))
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *cmd]
    log.info("launching %d local workers: %s", nproc, " ".join(args))
    return subprocess.run(args, env=env).returncode


def strip_option(argv: Sequence[str], option: str, takes_value: bool = True) -> list[str]:
    """``argv`` without ``option`` (``--opt V`` or ``--opt=V``), to re-run a command under a launcher."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = takes_value
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def horovod() -> Any:
    """``horovod.torch``, or a ConfigError that says how to get it and that DDP is the default."""
    try:
        import horovod.torch as hvd  # optional: built by `make horovod`
    except ImportError as e:
        raise ConfigError(
            "--backend horovod: horovod is not installed (it is optional; build it with `make horovod`). "
            f"The default backend, ddp (torch.distributed), needs nothing extra. ({e})"
        ) from None
    return hvd


# --------------------------------------------------------------------------- model wrapping


def wrap_model(model: nn.Module, device: torch.device, *, sync_bn: bool = False, bucket_cap_mb: float = 25.0,
               static_graph: bool = False, find_unused_parameters: bool = False) -> nn.Module:
    """Move ``model`` to ``device`` and wrap it in DDP when there is more than one process.

    Args:
        model: the bare model; call this before ``torch.compile``.
        device: this process's device.
        sync_bn: convert BatchNorm layers to SyncBatchNorm (statistics over the global batch).
        bucket_cap_mb: gradient bucket size in MiB; smaller buckets start communication earlier.
        static_graph: the set of used parameters never changes between steps (enables extra overlap).
        find_unused_parameters: some parameters get no gradient in some steps (costs a graph walk).

    Returns:
        The model itself in one process, else a ``DistributedDataParallel`` wrapper.
    """
    model = model.to(device)
    if not _active():
        return model
    if sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=True,  # gradients alias the buckets: one copy fewer per step
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module under any DDP and ``torch.compile`` wrappers (for eval and checkpoints)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def no_sync(model: nn.Module, skip: bool = True) -> contextlib.AbstractContextManager:
    """Context that skips the gradient all-reduce (accumulation micro-steps) when ``skip``.

    A plain ``nullcontext`` for a bare model or when ``skip`` is false, so the engine writes
    ``with dist.no_sync(model, not last_micro_step):`` without branching.
    """
    inner = model
    if hasattr(inner, "_orig_mod") and not isinstance(inner, nn.parallel.DistributedDataParallel):
        inner = inner._orig_mod
    if skip and isinstance(inner, nn.parallel.DistributedDataParallel):
        return inner.no_sync()
    return contextlib.nullcontext()


# --------------------------------------------------------------------------- samplers


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
        batch_size: per-worker batch, needed only when emulating.
    """

    def __init__(self, data: Sized | int, *, num_replicas: int | None = None, rank: int | None = None,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, emulate_workers: int = 1,
                 batch_size: int = 1):
        self.n = _length(data)
        self.num_replicas, self.rank = _group(num_replicas, rank)
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.emulate, self.batch_size = emulate_workers, batch_size
        if emulate_workers > 1 and self.num_replicas != 1:
            raise ConfigError("emulated workers run in one process; do not combine with several ranks")
        self.epoch = 0
        shards = self.num_replicas * self.emulate
        if drop_last:
            self.total = (self.n // shards) * shards
        else:
            self.total = math.ceil(self.n / shards) * shards

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def permutation(self) -> list[int]:
        """The whole (padded) permutation of this epoch, identical on every rank."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(_mix_seed(self.seed, self.epoch))
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        if self.total > self.n and self.n > 0:
            order = (order * math.ceil(self.total / self.n))[: self.total]
        return order[: self.total]

    def __iter__(self) -> Iterator[int]:
        order = self.permutation()
        if self.emulate == 1:
            return iter(order[self.rank :: self.num_replicas])
        # Emulation: worker w's j-th batch comes right after worker w-1's j-th batch, so a loader
        # with ``batch_size`` and ``emulate`` x accumulation steps sees exactly the micro-batches
        # the ranks of a real ``emulate``-process job would see (same BatchNorm batches).
        shards = [order[w :: self.emulate] for w in range(self.emulate)]
        b, full = self.batch_size, len(shards[0]) // self.batch_size
        return iter([i for j in range(full) for shard in shards for i in shard[j * b:(j + 1) * b]])

    def __len__(self) -> int:
        if self.emulate > 1:
            return (self.total // self.emulate // self.batch_size) * self.batch_size * self.emulate
        return self.total // self.num_replicas


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
