"""The process group: init (torchrun, SLURM, Horovod), reductions, broadcast, barrier, shutdown."""
from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Imported before any group exists, on purpose: its functions take ``group=group.WORLD`` as a default
# argument, read when the module is first imported. DDP imports it on first use; with a group
# running by then, those defaults keep that group alive for good and gloo's worker threads are never
# joined (see shutdown).
import torch.distributed.nn  # noqa: F401  isort: skip
from torch import Tensor

from fastvision.distributed import group
from fastvision.distributed.env import DistEnv, detect_env
from fastvision.distributed.group import rank
from fastvision.distributed.watchdog import nccl_flight_recorder_env
from fastvision.errors import ConfigError

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- process group


def _resolve_device(device: str, env: DistEnv) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: fastvision trains on cpu or cuda (auto, cpu, cuda, cuda:N)")
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
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = dev  # binds the communicator to our GPU: no guessing in barrier()
            nccl_flight_recorder_env()  # read when the group is made: the hang report's NCCL half
        with _rendezvous_errors(env, timeout_s):
            if env.launcher == "torchrun":
                kwargs["store"] = _attempt_store(env, timeout_s)
            else:
                host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
                kwargs["init_method"] = f"tcp://{host}:{env.master_port}"
            dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                    timeout=timedelta(seconds=timeout_s), **kwargs)
        if backend == "gloo":
            _hold(dist.group.WORLD)
        log.info("joined %s process group: rank %d of %d (%s, %s:%d)", backend, env.rank, env.world_size,
                 env.launcher, env.master_addr, env.master_port)
    return env, dev


@contextlib.contextmanager
def _rendezvous_errors(env: DistEnv, timeout_s: float) -> Iterator[None]:
    """One line, where each was torch's 30-line traceback on every rank: rank 0's rendezvous store could not
    listen on ``MASTER_PORT`` (another job or process holds it), the ranks did not all meet there within
    ``train.dist_timeout_s`` (a rank that never started or stopped first, a MASTER_ADDR / MASTER_PORT that is not
    rank 0's), or ``GLOO_SOCKET_IFNAME`` names no interface of this host."""
    where = f"the rendezvous at {env.master_addr}:{env.master_port}"
    said = lambda e: str(e).splitlines()[0].rstrip(".")  # noqa: E731  (torch's own first line)
    try:
        yield
    except dist.DistNetworkError as e:
        if "EADDRINUSE" in str(e):
            raise ConfigError(f"MASTER_PORT {env.master_port} on {env.master_addr} is in use (another job or "
                              "process listens there): set MASTER_PORT to a free port") from e
        if env.rank == 0:
            raise
        raise ConfigError(f"rank {env.rank} could not reach {where} within {timeout_s:g} s (train.dist_timeout_s: "
                          f"{said(e)}): rank 0 did not start it (its line says why), or MASTER_ADDR / "
                          "MASTER_PORT are not rank 0's") from e
    except dist.DistStoreError as e:
        if env.rank != 0 or "waiting for clients" not in str(e):
            raise
        raise ConfigError(f"rank 0: not every rank joined {where} within {timeout_s:g} s (train.dist_timeout_s: "
                          f"{said(e)}): the others did not start, stopped first (their lines say why) "
                          "or cannot reach this host") from e
    except RuntimeError as e:
        name = os.environ.get("GLOO_SOCKET_IFNAME")
        if not name or "Unable to find address for" not in str(e):
            raise
        import socket

        have = ", ".join(n for _, n in socket.if_nameindex())
        raise ConfigError(f"GLOO_SOCKET_IFNAME={name}: no such network interface on this host (it has {have})"
                          ) from e


def _attempt_store(env: DistEnv, timeout_s: float) -> dist.Store:
    """torchrun's rendezvous store, under a prefix of its own for this restart of the workers.

    The agent keeps one store for all restarts of its workers. A group built on it afresh after a
    restart reads what the failed attempt wrote under the same keys (gloo's peer addresses, the
    member counts of a group's barrier): it connects to dead peers or waits for members that never
    come. That, not the checkpoint, is what made a ``torchrun --max-restarts`` restart fail or hang
    where a relaunch of the same command resumed cleanly.
    """
    store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timedelta(seconds=timeout_s)))
    return dist.PrefixStore(f"fastvision/attempt-{env.restart}", store)


_active = group.active


def _hvd() -> Any:
    """``horovod.torch`` when this job runs under horovod, else None (also inside ``group.alone``)."""
    return None if group.ALONE.depth else group.HOROVOD.module


def is_main() -> bool:
    """True on the process that logs and writes checkpoints."""
    return rank() == 0


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum ``t`` across ranks in place and return it (identity in one process)."""
    hvd = _hvd()
    if _active() and hvd is not None:
        hvd.allreduce_(t, op=hvd.Sum)
    elif _active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (``obj`` itself in one process)."""
    if not _active():
        return obj
    hvd = _hvd()
    if hvd is not None:
        # horovod matches collectives by name, and its default name is the object's type, which
        # differs between the sending rank (the object) and the others (None): name it explicitly
        return hvd.broadcast_object(obj, root_rank=src, name="fastvision.broadcast_object")
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank (e.g. detections for COCO eval)."""
    if not _active():
        return [obj]
    hvd = _hvd()
    if hvd is not None:
        return hvd.allgather_object(obj, name="fastvision.gather_objects")
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    hvd = _hvd()
    if _active() and hvd is not None:
        hvd.barrier()
    elif _active():
        dist.barrier()


def joined() -> bool:
    """A process group is joined (torch.distributed's or horovod's), by anyone in this process."""
    return _hvd() is not None or (dist.is_available() and dist.is_initialized())


def shutdown(join_threads: bool = True) -> None:
    """Leave the process group, if one was started.

    Args:
        join_threads: also stop gloo's worker threads before the interpreter exits (below). Pass
            False when leaving after an error: a thread still inside a collective whose peer failed
            would hold the exit up until the collective's timeout.

    ``destroy_process_group`` does not stop gloo's worker threads: gloo has no shutdown, they stop
    when the group object is freed. A thread that ends a collective releases its work a moment
    after the waiting rank has moved on, and releasing a work issued inside ``backward`` (DDP's
    all-reduces; a barrier holds on to the works before it, so freeing the barrier can free them)
    drops the autograd context torch keeps in the work's thread-local state, which takes the GIL.
    A thread that asks for the GIL while the interpreter finalizes is ended by CPython inside a C++
    destructor: ``terminate called without an active exception``, SIGABRT, after a ``barrier();
    shutdown()`` at the end of a good run on a loaded machine. So a gloo group made by :func:`init`
    is freed (its destructor joins the threads) while the interpreter is whole: here, or at exit
    when the caller still holds a DDP model (which holds the group).
    """
    hvd = _hvd()
    if hvd is not None:
        hvd.shutdown()
        group.HOROVOD.module = None
    if dist.is_available() and dist.is_initialized():
        pg = dist.group.WORLD
        dist.destroy_process_group()
        if not join_threads and any(g is pg for g in _held):
            _held[:] = [g for g in _held if g is not pg]
            _kept.append(pg)  # never freed: the process exits with its threads, as torch leaves them
        del pg
        if _held:
            _release_held()


def exit_process(code: int):
    """End the process with ``code``. After :func:`shutdown` left a group with its threads running
    (``join_threads=False``, after an error), without finalizing the interpreter: a gloo thread whose
    peer disconnects then (the other ranks leaving too) asks for the GIL while it finalizes and is
    ended inside a C++ destructor, SIGABRT, and the launcher sees -6 for the error's own exit code.
    Output is flushed and logging shut down first; atexit handlers do not run (a handler that joins
    those threads could wait on the stuck collective). Otherwise a plain ``sys.exit``."""
    if not _kept:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more to say
            pass
    os._exit(code)


_held: list = []  # gloo groups init() made; freed by _release_held() once nothing else holds them
_kept: list = []  # groups left after an error: never freed (a join could wait on a stuck collective)
_at_exit: list = []  # [True] once _release_held is registered to run at exit


def _hold(pg: Any) -> None:
    """Keep a reference to a new gloo group, to be the last one (:func:`_release_held`)."""
    if not _at_exit:  # registered at the first group, not at import: atexit runs the latest first
        atexit.register(_release_held)  # atexit handlers run before the interpreter finalizes
        _at_exit.append(True)
    _held.append(pg)


def _release_held() -> None:
    """Free each held group that nothing else holds any more (destroyed, its DDP models gone).

    Our reference must be the last: a DDP model's C++ reducer that frees the group last does so
    holding the GIL, and the join in the group's destructor then waits for a thread that waits for
    the GIL; a Python reference is dropped with the GIL released. Hence also the early import of
    ``torch.distributed.nn`` above.
    """
    if not _held:
        return
    gc.collect()  # DDP wrappers that are garbage in reference cycles still hold their group
    for i in reversed(range(len(_held))):
        if sys.getrefcount(_held[i]) == 2:  # this list's reference and getrefcount's argument
            del _held[i]


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
