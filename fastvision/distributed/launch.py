"""Launchers: ``--nproc`` on one machine (torchrun's environment), ``horovodrun`` command lines."""
from __future__ import annotations

import logging
import os
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


def relaunch_argv(argv: Sequence[str]) -> list[str]:
    """This very command for each of ``--nproc`` workers: ``-m fastvision.cli ARGV`` without ``--nproc``
    (what :func:`launch_local` runs after ``python``)."""
    return ["-m", "fastvision.cli", *strip_option(argv, "--nproc")]
