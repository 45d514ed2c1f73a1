"""Launchers: ``--nproc`` on one machine (torchrun's environment), ``horovodrun`` command lines."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

from fastvision.distributed.comm import horovod

log = logging.getLogger(__name__)


def launch_local(nproc: int, cmd: Sequence[str], environ: Mapping[str, str] | None = None,
                 backend: str = "ddp") -> int:
    """Run ``cmd`` as ``nproc`` workers on this node; return the launcher's exit code (for ``ddp`` the
    first failed worker's).

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
        # torchrun itself, its failure as the first failed worker's exit code in one line (distributed/torchrun.py)
        args = [sys.executable, "-m", "fastvision.distributed.torchrun", "--standalone", "--nproc-per-node", str(nproc),
                *cmd]
    # torchrun forwards these to its workers (torch >= 2.6 reads the variable; SIGUSR1 is SLURM's warning)
    env.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", ",".join(FORWARDED))
    log.info("launching %d local workers: %s", nproc, " ".join(args))
    import tempfile

    from fastvision.errors import ERROR_LINES_ENV

    fd, lines = tempfile.mkstemp(prefix="fastvision-errors-", suffix=".txt")
    os.close(fd)
    env.setdefault(ERROR_LINES_ENV, lines)  # the same error on every rank is printed once (errors.first_report)
    try:
        return run_forwarding(args, env)
    finally:
        os.unlink(lines)


# what a scheduler, `kill PID`, a closed terminal or Ctrl-C sends the launcher, passed on to the job's launcher
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")


def run_forwarding(args: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``args`` (torchrun or horovodrun) in a process group of its own and pass every signal of
    :data:`FORWARDED` this process gets to it, once; return its exit code. A ``kill`` of this process (a
    Kubernetes pod's PID 1, a scheduler, a user) thus stops the workers the way it would stop one process
    (their stop signal: checkpoint, exit 128 + N) instead of leaving torchrun and its workers training on
    without a parent; a signal sent to the whole group (Ctrl-C, ``timeout``) reaches the launcher once,
    through here, not a second time in the middle of its shutdown."""
    proc = subprocess.Popen(list(args), env=dict(env), start_new_session=True)

    def forward(signum, _frame) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {}
    for name in FORWARDED:
        sig = getattr(signal, name, None)
        if sig is not None:
            try:
                previous[sig] = signal.signal(sig, forward)
            except ValueError:  # not the main thread: the launcher's signals stay as they are
                break
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # a SIGINT handler of the caller's own: pass it on, keep waiting
                forward(signal.SIGINT, None)
    except BaseException:  # the caller gave up (a time limit): nothing of the job outlives it
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def local_slots(device: str | None = None) -> tuple[int, str]:
    """How many workers ``--nproc`` may start on this machine, and what of: its GPUs where ``device`` is
    CUDA (``auto``/None: where CUDA is available), else the CPU cores this process may run on."""
    import torch

    dev = device or "auto"
    if dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available()):
        return torch.cuda.device_count(), "GPUs"
    from fastvision.utils.hostcpu import process_cores

    return len(process_cores()), "CPU cores"


def check_nproc(nproc: int, device: str | None = None, flag: str = "--nproc") -> None:
    """``--nproc N`` is at least 1 and, where this machine starts the workers, at most one per GPU (a worker
    takes ``cuda:<local rank>``) or per CPU core (each needs a core of its own): one line naming the option,
    before any worker starts (before, 0 or -1 trained one process silently, and 99 on a 2-core machine
    started 99 torch processes)."""
    from fastvision.errors import ConfigError

    if nproc < 1:
        raise ConfigError(f"{flag} {nproc}: must be >= 1")
    if nproc == 1:
        return
    limit, what = local_slots(device)
    if nproc > limit:
        raise ConfigError(f"{flag} {nproc}: more workers than this machine has {what} ({limit}); use at most "
                          f"{limit}, or torchrun / srun across nodes (docs/distributed.md)")


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


def relaunch_argv(argv: Sequence[str]) -> list[str]:
    """This very command for each of ``--nproc`` workers: ``-m fastvision.cli ARGV`` without ``--nproc``
    (what :func:`launch_local` runs after ``python``)."""
    return ["-m", "fastvision.cli", *strip_option(argv, "--nproc")]
