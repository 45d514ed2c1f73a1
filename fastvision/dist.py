"""Distributed data parallelism: the one place that reads the launch environment.

One process, ``torchrun`` (one node or many) and ``srun`` under SLURM share one code path:
:func:`detect_env` turns the environment into a :class:`DistEnv`, :func:`init` starts the process
group (NCCL on CUDA, gloo on CPU) only when there is more than one process, and everything else
(reductions, the DDP wrap, samplers) degrades to a no-op or an identity in a single process, so
the engine never branches on the world size. With ``backend="horovod"`` the same functions go
through ``horovod.torch`` instead (:func:`wrap_optimizer`, :func:`broadcast_state`,
:func:`synchronized` are the horovod-only steps, identities under DDP). Environment parsing lives in
:mod:`fastvision.dist_env`, the samplers in :mod:`fastvision.samplers`; both are re-exported here.

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
import os
import subprocess
import sys
from datetime import timedelta
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import dist_group as group
from .dist_env import DEFAULT_PORT, SLURM_PORT_BASE, SLURM_PORT_SPAN, DistEnv, detect_env, expand_nodelist  # noqa: F401
from .dist_group import rank, world_size  # noqa: F401  (re-exported)
from .errors import ConfigError
from .samplers import EvalSampler, TrainSampler, _mix_seed  # noqa: F401

log = logging.getLogger(__name__)


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


def init(device: str = "auto", timeout_s: float = 300, backend: str = "ddp") -> tuple[DistEnv, torch.device]:
    """Detect the launch environment, pick the device and join the process group.

    Args:
        device: ``"auto"`` (``cuda:local_rank`` when CUDA is available, else ``cpu``), ``"cpu"``,
            ``"cuda"`` or ``"cuda:N"``.
        timeout_s: collective timeout in seconds; a hung peer fails the job after this long.
        backend: ``"ddp"`` (torch.distributed) or ``"horovod"`` (``horovod.torch``, started by
            ``horovodrun``; every collective of this module then goes through horovod).

    Returns:
        ``(env, device)``. The process group is started (NCCL on CUDA, gloo otherwise) only when
        ``env.world_size > 1``; calling again after a successful init is harmless.
    """
    if backend == "horovod":
        return _init_horovod(device)
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


_active = group.active


def _hvd() -> Any:
    """``horovod.torch`` when this job runs under horovod, else None."""
    return group.HOROVOD.module


def is_main() -> bool:
    """True on the process that logs and writes checkpoints."""
    return rank() == 0


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum ``t`` across ranks in place and return it (identity in one process)."""
    if _active() and _hvd() is not None:
        _hvd().allreduce_(t, op=_hvd().Sum)
    elif _active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (``obj`` itself in one process)."""
    if not _active():
        return obj
    if _hvd() is not None:
        # horovod matches collectives by name, and its default name is the object's type, which
        # differs between the sending rank (the object) and the others (None): name it explicitly
        return _hvd().broadcast_object(obj, root_rank=src, name="fastvision.broadcast_object")
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank (e.g. detections for COCO eval)."""
    if not _active():
        return [obj]
    if _hvd() is not None:
        return _hvd().allgather_object(obj, name="fastvision.gather_objects")
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if _active() and _hvd() is not None:
        _hvd().barrier()
    elif _active():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group, if one was started."""
    if _hvd() is not None:
        _hvd().shutdown()
        group.HOROVOD.module = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def launch_local(nproc: int, cmd: Sequence[str], environ: Mapping[str, str] | None = None,
                 backend: str = "ddp") -> int:
    """Run ``cmd`` as ``nproc`` workers on this node; return the launcher's exit code.

    ``ddp``: ``torch.distributed.run --standalone`` picks a free rendezvous port, sets ``RANK``/
    ``LOCAL_RANK``/``WORLD_SIZE`` for each worker and, if one worker dies, stops the others and names
    the failed rank, so a crash never leaves a job hanging in a collective. ``horovod``:
    ``horovodrun --gloo`` on localhost (horovod's own rendezvous; it also stops the job on a failure).

    Args:
        nproc: number of worker processes.
        cmd: what each worker runs after ``python``, e.g. ``["-m", "fastvision.cli", "train", "r"]``.
        environ: environment for the workers (default: this process's).
        backend: ``"ddp"`` or ``"horovod"``.
    """
    env = dict(os.environ if environ is None else environ)
    # Without this torchrun sets 1 thread per worker and warns; share the cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc))))
    if backend == "horovod":
        args = [*horovodrun_command(nproc), sys.executable, *cmd]
    else:
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *cmd]
    log.info("launching %d local workers: %s", nproc, " ".join(args))
    return subprocess.run(args, env=env).returncode


def horovodrun_command(nproc: int, hosts: str | None = None) -> list[str]:
    """``horovodrun`` arguments for ``nproc`` gloo workers (``hosts`` like ``"n1:4,n2:4"``; default localhost)."""
    horovod()  # the actionable error when horovod is absent
    exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(exe):
        exe = "horovodrun"
    return [exe, "--gloo", "-np", str(nproc), "-H", hosts or f"localhost:{nproc}"]


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


def _init_horovod(device: str) -> tuple[DistEnv, torch.device]:
    """``hvd.init()``; rank, size and local rank come from horovod (horovodrun sets them)."""
    hvd = horovod()
    if _hvd() is None:
        hvd.init()
        group.HOROVOD.module = hvd
    env = DistEnv(rank=hvd.rank(), local_rank=hvd.local_rank(), world_size=hvd.size(),
                  local_world_size=hvd.local_size(), launcher="horovod")
    dev = _resolve_device(device, env)
    if env.rank == 0:
        log.info("horovod: %d processes (%s)", env.world_size, "gloo" if hvd.gloo_enabled() else "mpi")
    return env, dev


def wrap_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module,
                   backward_passes_per_step: int = 1) -> torch.optim.Optimizer:
    """Horovod: ``hvd.DistributedOptimizer`` averaging gradients over ranks; otherwise ``optimizer``.

    Call it before building the LR scheduler: horovod returns a new optimizer object (same
    parameter groups). Gradients are all-reduced once per ``backward_passes_per_step`` backward
    passes (the accumulation micro-steps), as DDP does under :func:`no_sync`.

    Args:
        optimizer: the torch optimizer over ``model``'s parameters.
        model: the bare model (its parameter names name the all-reduces).
        backward_passes_per_step: micro-batches per optimizer step.
    """
    if _hvd() is None:
        return optimizer
    return _hvd().DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     backward_passes_per_step=backward_passes_per_step, op=_hvd().Average)


def broadcast_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Horovod: copy rank 0's weights, buffers and (non-empty) optimizer state to every rank.

    DDP does the same when it wraps the model; call this after a resume has loaded a checkpoint.
    A fresh optimizer is not broadcast: horovod would first take a zero-gradient step to create its
    state, which moves weights under weight decay and counts a step in Adam's bias correction.
    """
    if _hvd() is None or _hvd().size() == 1:
        return
    _hvd().broadcast_parameters(model.state_dict(), root_rank=0)
    if optimizer.state_dict()["state"]:
        _hvd().broadcast_optimizer_state(optimizer, root_rank=0)


@contextlib.contextmanager
def synchronized(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Finish the gradient all-reduce now, then step without a second one (horovod); no-op for DDP.

    Wrap everything between the last backward and ``zero_grad`` in it, so that clipping, the AMP
    scaler's unscale and finiteness checks see the averaged gradients (horovod reduces them in the
    background until ``synchronize()``; DDP has finished by the end of ``backward``).
    """
    if _hvd() is None or not hasattr(optimizer, "skip_synchronize"):
        yield
        return
    optimizer.synchronize()
    with optimizer.skip_synchronize():
        yield


# --------------------------------------------------------------------------- model wrapping


def wrap_model(model: nn.Module, device: torch.device, *, sync_bn: bool = False, bucket_cap_mb: float = 25.0,
               static_graph: bool = False, find_unused_parameters: bool = False,
               comm_hook: str = "none") -> nn.Module:
    """Move ``model`` to ``device`` and wrap it in DDP when there is more than one process.

    Args:
        model: the bare model; call this before ``torch.compile``.
        device: this process's device.
        sync_bn: convert BatchNorm layers to SyncBatchNorm (statistics over the global batch).
        bucket_cap_mb: gradient bucket size in MiB; smaller buckets start communication earlier.
        static_graph: the set of used parameters never changes between steps (enables extra overlap).
        find_unused_parameters: some parameters get no gradient in some steps (costs a graph walk).
        comm_hook: ``none``, or ``bf16`` / ``fp16``: gradients are all-reduced in that precision
            (half the bytes; torch's ``default_hooks`` compress hooks), then cast back. ``bf16``
            needs NCCL (CUDA; torch refuses it on gloo: ``ConfigError``), fp16 runs on gloo too.

    Returns:
        The model itself in one process, else a ``DistributedDataParallel`` wrapper.
    """
    model = model.to(device)
    if _hvd() is not None and sync_bn:
        raise ConfigError("train.sync_bn is not supported with --backend horovod; use ddp")
    if _hvd() is not None or not _active():
        return model  # horovod reduces in its optimizer (wrap_optimizer)
    if sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if comm_hook not in ("none", "bf16", "fp16"):
        raise ConfigError(f"train.ddp_comm_hook: expected none, bf16 or fp16, got {comm_hook!r}")
    ddp = nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=True,  # gradients alias the buckets: one copy fewer per step
    )
    if comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.bf16_compress_hook if comm_hook == "bf16" else default_hooks.fp16_compress_hook
        try:
            ddp.register_comm_hook(None, hook)  # state None: the default process group
        except TypeError as e:  # torch refuses bf16 without NCCL (CUDA) or XCCL
            raise ConfigError(f"train.ddp_comm_hook: {comm_hook} is not available here ({e}); use fp16") from None
    return ddp


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
