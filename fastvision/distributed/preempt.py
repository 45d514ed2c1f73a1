"""Preemption: stop signals, the agreement between ranks, the SLURM requeue, and the stop itself.

Schedulers warn before they stop a job: SLURM sends ``--signal=USR1@120`` ahead of the time limit
and SIGTERM at it, Kubernetes and torchrun send SIGTERM. :class:`Preemption` is the one home of
what follows: :class:`StopSignals` turns those signals into a flag (the handler does nothing else,
so a second signal during the save changes nothing); ranks see a signal at different steps, so
they agree through :class:`Agreement` on one step to stop at (or to take a timed checkpoint at);
after the checkpoint :meth:`Preemption.preempted` waits until it is durable, requeues the SLURM
job and hands back the :class:`~fastvision.errors.Preempted` to raise.

When the ranks agree, and what it costs. The flags ride on the default process group (NCCL or
gloo, whatever the run uses: no group of its own, so no gloo connectivity is needed beside NCCL
and ``GLOO_SOCKET_IFNAME`` matters only where gloo itself runs) as one 8-byte all-reduce (MAX)
every ``every`` steps (the loop's ``train.log_every``, where it reads the loss anyway) and at each
epoch's end. Only a multi-rank run that can be asked to stop (``train.stop_signals`` not empty) or
takes checkpoints by time needs it; otherwise no collective is issued. One process needs no
agreement and acts after the very step a signal arrived in. The price of the interval: several
ranks stop up to ``train.log_every`` steps after the signal (SLURM's 120 s warning leaves room for
many steps); ``benchmarks/agreement_cost.py`` measures the per-step cost against an exchange every
step on a gloo side group, the design this replaced.
"""
from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as tdist

from fastvision.distributed.comm import barrier
from fastvision.distributed.env import requeue_job_id
from fastvision.distributed.group import HOROVOD, active, rank
from fastvision.errors import ConfigError, Preempted

log = logging.getLogger(__name__)

REQUEUE_TIMEOUT_S = 60.0  # how long ``scontrol requeue`` may take before the job exits without it
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def signal_numbers(names: Sequence[str | int]) -> list[int]:
    """``["SIGTERM", "USR1", 15, "10"]`` -> signal numbers; a ConfigError names one that cannot be
    caught (unknown names and numbers, SIGKILL, SIGSTOP)."""
    out = []
    for name in names:
        text = str(name).strip().upper()
        if isinstance(name, int) or text.isdigit():
            try:
                sig = signal.Signals(int(text))
            except ValueError:
                sig = None
        else:
            sig = getattr(signal, text if text.startswith("SIG") else f"SIG{text}", None)
        if not isinstance(sig, signal.Signals) or sig in _UNCATCHABLE or isinstance(name, bool):
            raise ConfigError(f"train.stop_signals: {name!r} is not a signal that can be caught "
                              "(e.g. SIGTERM, SIGUSR1, SIGUSR2, SIGINT, or their numbers)")
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

    def __enter__(self) -> StopSignals:
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
    """Flags every rank agrees on (an all-reduce MAX of small integers), at a step multiple of
    ``every`` (:meth:`at`) or now (:meth:`now`, an epoch's end). In one process: the flags as given.

    Args:
        device: where the flags' tensor lives (the run's device: NCCL reduces CUDA tensors).
        every: steps between exchanges.
    """

    def __init__(self, device: torch.device | str = "cpu", every: int = 1):
        self.device, self.every = torch.device(device), max(1, int(every))

    def at(self, step: int, flags: Sequence[int]) -> list[int] | None:
        """After optimizer step ``step`` (the same on every rank): the agreed flags when ``step`` is
        a multiple of ``every`` (or in one process), else None."""
        if active() and step % self.every:
            return None
        return self.now(flags)

    def now(self, flags: Sequence[int]) -> list[int]:
        """Agree on ``flags`` now: every rank must call this at the same point."""
        if not active():
            return [int(f) for f in flags]
        hvd = HOROVOD.module
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device="cpu" if hvd else self.device)
        if hvd is not None:  # horovod reduces CPU tensors on every build (GPU ops are optional)
            t = hvd.allreduce(t, op=hvd.Max, name="fastvision.agreement")
        else:
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return t.tolist()  # a host read, at log intervals only: the loop reads the loss there anyway


class Preemption:
    """Stop handling: the signals, the ranks' agreement, the requeue, and the stop itself.

    Used as a context (the handlers are installed inside it). :meth:`after_step` and
    :meth:`agree_now` tell the loop when to stop (and when rank 0 asked for a timed checkpoint);
    :attr:`requested` is this rank's own flag, for places without a collective (between
    validation batches); :meth:`preempted` ends it.

    Args:
        signals: ``train.stop_signals``, checked here (a bad one fails before anything is built).
        requeue: ``train.requeue``: ``scontrol requeue`` after the stop's checkpoint.
        every: steps between agreements in a multi-rank run (``train.log_every``).
    """

    def __init__(self, signals: Sequence[str | int], requeue: bool = False, every: int = 1):
        self.signals = StopSignals(signals)
        self.requeue, self.every = requeue, every
        self.agreement: Agreement | None = None
        self.stopped: int | None = None

    def start(self, device: torch.device, timed_checkpoints: bool) -> None:
        """Before the first step. Across ranks, agree only when something can ask for it: a stop
        signal, or rank 0's clock; one process reads its own flags after every step."""
        if not active():
            self.agreement = Agreement()
        elif self.signals.numbers or timed_checkpoints:
            self.agreement = Agreement(device, self.every)

    def __enter__(self) -> Preemption:
        self.signals.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.signals.__exit__(*exc)

    @property
    def requested(self) -> bool:
        """A stop signal reached this process (no collective: ranks may differ)."""
        return self.signals.received is not None

    def after_step(self, step: int, checkpoint: bool = False) -> tuple[bool, bool]:
        """After optimizer step ``step``: ``(stop, checkpoint)`` as the ranks agree (both False
        between agreements). ``checkpoint`` is this rank's wish for a checkpoint now."""
        if self.agreement is None:  # nothing can ask for a stop or a timed checkpoint
            return False, False
        agreed = self.agreement.at(step, self._flags(checkpoint))
        return self._read(agreed) if agreed is not None else (False, False)

    def agree_now(self, checkpoint: bool = False) -> tuple[bool, bool]:
        """``(stop, checkpoint)`` agreed now (every rank calls this at the same point)."""
        if self.agreement is None:
            return False, False
        return self._read(self.agreement.now(self._flags(checkpoint)))

    def _flags(self, checkpoint: bool) -> list[int]:
        return [self.signals.received or 0, int(checkpoint)]

    def _read(self, agreed: list[int]) -> tuple[bool, bool]:
        if agreed[0]:
            self.stopped = agreed[0]
        return bool(agreed[0]), bool(agreed[1])

    def preempted(self, durable: Callable[[], None], last: Path) -> Preempted:
        """The stop after its checkpoint: wait until ``durable()`` returns (the write is on disk),
        requeue (rank 0), wait for every rank, and return the error for the caller to raise."""
        durable()
        if self.requeue and rank() == 0:
            requeue()
        barrier()
        name = signal.Signals(self.stopped).name
        return Preempted(self.stopped, f"stopped by {name}: checkpoint {last} written; continue with --resume auto")


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
    try:
        res = subprocess.run([exe, "requeue", job], capture_output=True, text=True, timeout=REQUEUE_TIMEOUT_S)
    except (subprocess.TimeoutExpired, OSError) as e:  # the stop still ends with 128 + signal
        log.warning("train.requeue: scontrol requeue %s did not finish: %s", job, e)
        return False
    if res.returncode != 0:
        log.warning("train.requeue: scontrol requeue %s failed: %s", job, (res.stderr or res.stdout).strip()[:200])
        return False
    log.info("requeued SLURM job %s", job)
    return True
