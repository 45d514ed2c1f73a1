"""Preemption: stop signals, the per-step agreement between ranks, and the SLURM requeue.

Schedulers warn before they stop a job: SLURM sends ``--signal=USR1@120`` ahead of the time limit
and SIGTERM at it, Kubernetes and torchrun send SIGTERM. :class:`StopSignals` turns those signals
into a flag (the handler does nothing else, so a second signal during the save changes nothing).
Ranks see a signal at different steps, so they agree through :class:`Agreement`: after every step
each rank contributes its flags to one small all-reduce (MAX) on a gloo group of its own, issued
asynchronously and read after the next step, so its latency hides behind a step and no GPU stream
waits for it. Every rank reads the same reduced flags at the same step: they stop, or take a
checkpoint, at one step. A rank that died makes the read fail at once (gloo sees the closed
connection) or after ``timeout_s``; the others then exit instead of hanging.
"""
from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import threading
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as tdist

from fastvision.dist.env import requeue_job_id
from fastvision.dist.group import active, world_size
from fastvision.errors import ConfigError

log = logging.getLogger(__name__)

STOP, CHECKPOINT = 0, 1  # positions of the flags :class:`Agreement` reduces


def signal_numbers(names: Sequence[str | int]) -> list[int]:
    """``["SIGTERM", "USR1", 15]`` -> signal numbers; a ConfigError names an unknown one."""
    out = []
    for name in names:
        if isinstance(name, int):
            out.append(int(name))
            continue
        key = str(name).upper()
        key = key if key.startswith("SIG") else f"SIG{key}"
        sig = getattr(signal, key, None)
        if not isinstance(sig, signal.Signals) or key in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"train.stop_signals: {name!r} is not a signal that can be caught "
                              "(e.g. SIGTERM, SIGUSR1, SIGUSR2, SIGINT)")
        out.append(int(sig))
    return out


class StopSignals:
    """Catch ``signals`` while open: the first one received is kept in :attr:`received`.

    Handlers can only be installed from the main thread; elsewhere (a notebook's worker thread)
    nothing is installed and the run is not preemptible, which is logged once.
    """

    def __init__(self, signals: Sequence[str | int]):
        self.numbers = signal_numbers(signals)
        self.received: int | None = None
        self._old: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        if self.received is None:
            self.received = signum  # the loop logs it: no I/O inside a signal handler

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            if self.numbers:
                log.info("not in the main thread: %s will not stop the run cleanly", self.names())
            return self
        for n in self.numbers:
            self._old[n] = signal.signal(n, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for n, old in self._old.items():
            signal.signal(n, old)
        self._old.clear()

    def names(self) -> str:
        return ", ".join(signal.Signals(n).name for n in self.numbers)


class Agreement:
    """Flags every rank agrees on, one step late: :meth:`exchange` after each step, :meth:`now` at
    an epoch's end (synchronous).

    In one process the flags are returned as given. Across ranks they go through an all-reduce
    (MAX) on a gloo group made for this (CPU tensors: no CUDA stream waits, and it works beside
    NCCL); under horovod through its own all-reduce, synchronously.

    Args:
        timeout_s: how long a rank waits for the others' flags before it gives up (a peer that
            died is usually detected at once, when gloo sees its connection close).
    """

    def __init__(self, timeout_s: float = 300.0, size: int = 2):
        self.size = size
        self.group = None
        self._pending: tuple[torch.Tensor, object] | None = None
        self._horovod = False
        if active() and world_size() > 1:
            if tdist.is_available() and tdist.is_initialized():
                self.group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            else:
                self._horovod = True

    def _reduce(self, flags: torch.Tensor, wait: bool):
        if self._horovod:
            from fastvision.dist.comm import _hvd

            return _hvd().allreduce(flags, op=_hvd().Max, name="fastvision.agreement"), None
        work = tdist.all_reduce(flags, op=tdist.ReduceOp.MAX, group=self.group, async_op=not wait)
        return flags, work

    def exchange(self, flags: Sequence[int]) -> list[int]:
        """Contribute this step's ``flags``; returns the flags agreed on from the previous call
        (zeros on the first call). In one process: ``flags`` at once."""
        if self.group is None and not self._horovod:
            return [int(f) for f in flags]
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        if self._horovod:  # no async handle: agree now (a collective per step)
            return [int(v) for v in self._reduce(t, True)[0]]
        agreed = self._collect()
        self._pending = self._reduce(t, False)
        return agreed

    def _collect(self) -> list[int]:
        """The pending exchange's agreed flags (zeros when none is pending)."""
        if self._pending is None:
            return [0] * self.size
        t, work = self._pending
        self._pending = None
        work.wait()  # raises when a peer is gone (closed connection) or after the timeout
        return [int(v) for v in t]

    def now(self, flags: Sequence[int]) -> list[int]:
        """Agree on ``flags`` now (an epoch's end), the pending exchange folded in."""
        merged = [max(int(a), int(b)) for a, b in zip(flags, self._collect())]
        if self.group is None and not self._horovod:
            return merged
        return [int(v) for v in self._reduce(torch.tensor(merged, dtype=torch.int32), True)[0]]

    def close(self) -> None:
        self._pending = None
        if self.group is not None and tdist.is_initialized():
            tdist.destroy_process_group(self.group)
        self.group = None


def requeue() -> bool:
    """``scontrol requeue $SLURM_JOB_ID``; False (with a warning) outside SLURM or when it fails."""
    job = requeue_job_id()
    if job is None:
        log.warning("train.requeue: not a SLURM job (no SLURM_JOB_ID): nothing requeued")
        return False
    exe = shutil.which("scontrol")
    if exe is None:
        log.warning("train.requeue: scontrol is not on PATH: job %s not requeued", job)
        return False
    res = subprocess.run([exe, "requeue", job], capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        log.warning("train.requeue: scontrol requeue %s failed: %s", job, (res.stderr or res.stdout).strip()[:200])
        return False
    log.info("requeued SLURM job %s", job)
    return True
