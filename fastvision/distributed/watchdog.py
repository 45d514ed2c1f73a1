"""The hang doctor: which rank did not arrive, and what every live rank was doing.

A multi-rank job that hangs usually shows nothing: every rank but one waits inside a collective,
and the one that does not arrive is stopped, swapped out, stuck on a file system or in a data
loader. :class:`Watchdog` turns that into one line and a file per rank:

* The training loop calls :meth:`Watchdog.beat` after every step and between validation batches
  (two attribute writes: no I/O, no sync). A daemon thread publishes a heartbeat, a counter it
  bumps every ``interval`` seconds plus the last step, to the job's key-value store.
* When the loop has not beaten for ``train.hang_timeout_s``, the thread writes this process's
  Python stacks (every thread) to ``RUN/hang/rank-<r>.txt`` (and, on NCCL, PyTorch's flight
  recorder to ``RUN/hang/nccl-trace-rank-<r>``), keeps beating for a grace period, and then
  rank 0 names the ranks whose heartbeat did not move in that period (their whole process is
  frozen, or gone), or, when every process is alive, those whose step is behind. One line:
  ``step N: rank 1 (host, pid) did not arrive; stacks in RUN/hang/`` (logged, and kept in
  ``RUN/hang/report.txt``). Every live rank then exits
  with :data:`HANG_EXIT` (124, as ``timeout`` reports), so torchrun ``--max-restarts`` or a SLURM
  requeue restarts the job from its last checkpoint, which an exit never touches (checkpoints are
  renamed into place whole).

Why a heartbeat in the store and not gloo's ``monitored_barrier`` on a side group: the store is
already there under every launcher (torchrun's rendezvous store, or the ``tcp://`` one of an
``srun`` job), it needs no gloo connectivity between the nodes (on NCCL clusters with several NICs
a gloo group needs ``GLOO_SOCKET_IFNAME``), it costs each rank one small write every few seconds
from a thread, and it tells more: a barrier only sees who is missing, the heartbeat also tells a
frozen process (no beats: SIGSTOP, swapped out, a hung kernel call that holds the GIL) from a live
one that is behind (beats, but an older step). A rank that cannot report (rank 0 frozen) is covered
too: the others wait for rank 0's report and write the line themselves when it does not come.
Horovod has no store: there each rank writes its stacks and exits, naming no one (horovod's own
``HOROVOD_STALL_CHECK_TIME_SECONDS`` warning names the missing ranks).

On NCCL, :func:`nccl_flight_recorder_env` switches on PyTorch's own flight recorder and its dump on
the NCCL watchdog's timeout before the process group is made, and :func:`point_dumps_at` points the
dump into ``RUN/hang/`` (the dump file's name is read at the first dump, so setting it once the run
directory is known still works). The names differ between torch versions; both are set.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from fastvision.utils.files import atomic_write

log = logging.getLogger(__name__)

HANG_EXIT = 124  # what ``timeout`` returns for a command that ran out of time

# torch 2.4 .. 2.13 read these when the NCCL process group is made (TORCH_FR_*: newer releases' names)
FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000",
                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
DUMP_FILE = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")  # read at the first dump


def nccl_flight_recorder_env() -> None:
    """Switch on NCCL's flight recorder (the last 2000 collectives) and its dump on a timeout,
    unless the user set these variables; call before ``init_process_group``."""
    for key, value in FLIGHT_RECORDER.items():
        os.environ.setdefault(key, value)


def point_dumps_at(folder: Path) -> None:
    """NCCL flight-recorder dumps go to ``folder/nccl-trace-rank-<r>``, unless the user chose a
    place (a value that is not an earlier run's ``hang`` folder)."""
    for key in DUMP_FILE:
        if os.environ.get(key, "/hang/nccl-trace-rank-").endswith("/hang/nccl-trace-rank-"):
            os.environ[key] = str(folder / "nccl-trace-rank-")


def check_timeouts(hang_timeout_s: float | None, dist_timeout_s: float) -> None:
    """``train.hang_timeout_s`` must fire before a collective's own timeout, which fails the job
    with no report; a ConfigError names both keys."""
    from fastvision.errors import ConfigError

    if hang_timeout_s is not None and hang_timeout_s < 0:
        raise ConfigError(f"train.hang_timeout_s must be >= 0 (0: off), got {hang_timeout_s}")
    if hang_timeout_s and hang_timeout_s >= dist_timeout_s:
        raise ConfigError(f"train.hang_timeout_s ({hang_timeout_s:g} s) must be below train.dist_timeout_s "
                          f"({dist_timeout_s:g} s): a collective's own timeout would end the job first, with "
                          "no report; raise dist_timeout_s or lower hang_timeout_s (0: off)")


def _default_store():
    """The key-value store the default process group was made with (None without one)."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store  # private, stable since torch 1.x

    store = _get_default_store()
    return store.clone() if hasattr(store, "clone") else store  # its own connection: no shared timeout


class Watchdog:
    """Beats from the training loop, a heartbeat thread, and the report when the beats stop.

    Args:
        timeout_s: seconds without a beat that count as a hang (0: off).
        folder: where the stacks go (``RUN/hang``).
        rank, world: this process and the job's size.
        store: the job's key-value store (``torch.distributed.Store``), or None (no names).
        exit: called with :data:`HANG_EXIT` at the end of a report (``os._exit``: the main thread
            is stuck in a collective and cannot be interrupted).
    """

    def __init__(self, timeout_s: float, folder: Path, rank: int = 0, world: int = 1, store=None,
                 exit=os._exit):
        self.timeout_s, self.folder, self.rank, self.world, self.store = timeout_s, folder, rank, world, store
        self.interval = min(max(timeout_s / 10, 0.2), 10.0)
        self.grace = 3 * self.interval + 1.0  # a live rank's heartbeat moves at least twice in it
        self.who = f"{socket.gethostname()}, {os.getpid()}"
        self.step, self.phase, self._last = 0, "start", None  # armed by the first beat
        self._exit, self._seq = exit, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_run(cls, timeout_s: float | None, folder: Path, rank: int, world: int) -> Watchdog:
        """The run's watchdog: started when ``timeout_s`` is set and more than one rank trains
        (one process has no one to wait for); otherwise one whose :meth:`beat` does nothing."""
        dog = cls(timeout_s or 0, folder, rank, world, _default_store() if timeout_s and world > 1 else None)
        if timeout_s and world > 1:
            dog.start()
        return dog

    def beat(self, step: int, phase: str = "train") -> None:
        """The loop made progress (called after every step and validation batch: keep it cheap)."""
        self.step, self.phase, self._last = step, phase, time.monotonic()

    def start(self) -> None:
        self._publish()
        self._thread = threading.Thread(target=self._run, name="fastvision-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop watching (the run ended, or failed on its own)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._publish()
            if self._last is not None and time.monotonic() - self._last > self.timeout_s:
                self._fire()
                return

    # -------------------------------------------------------------------- the store
    def _key(self, what: str, rank: int | None = None) -> str:
        return f"fastvision/hang/{what}/{self.rank if rank is None else rank}"

    def _publish(self) -> None:
        if self.store is None:
            return
        self._seq += 1
        try:
            self.store.set(self._key("beat"), f"{self._seq} {self.step} {self.who}")
        except Exception as e:  # noqa: BLE001 - the store's host went away: nothing to tell it
            log.debug("watchdog: heartbeat not written: %s", e)

    def _heartbeats(self) -> dict[int, tuple[int, int, str]]:
        """``{rank: (sequence, step, "host, pid")}`` of every rank that published one."""
        out = {}
        for r in range(self.world):
            key = self._key("beat", r)
            try:
                if self.store.check([key]):
                    seq, step, who = self.store.get(key).decode().split(" ", 2)
                    out[r] = (int(seq), int(step), who)
            except Exception as e:  # noqa: BLE001
                log.debug("watchdog: heartbeat of rank %d not read: %s", r, e)
        return out

    # -------------------------------------------------------------------- the report
    def _fire(self) -> None:
        """No beat for ``timeout_s``: stacks, the names, exit."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._write_stacks()
            self._write_flight_recorder()
        except OSError as e:  # a full or read-only disk: still name the missing rank and exit
            log.error("watchdog: stacks not written to %s: %s", self.folder, e)
        if self.store is None:
            log.error("step %d: no progress for %.0f s on rank %d (%s); stacks in %s/", self.step, self.timeout_s,
                      self.rank, self.who, self.folder)
            return self._leave()
        before = self._heartbeats()
        deadline = time.monotonic() + (self.grace if self.rank == 0 else 2 * self.grace)
        while time.monotonic() < deadline:  # keep beating, so the others see this process alive
            time.sleep(self.interval / 2)
            self._publish()
            if self.rank != 0 and self._reported():
                return self._leave()
        line = self.summary(before, self._heartbeats())
        if self.rank != 0:
            line += " (rank 0 did not report)"
        log.error("%s", line)
        try:
            self.store.set("fastvision/hang/report", line)
            atomic_write(self.folder / "report.txt", lambda f: f.write((line + "\n").encode()))  # whole or absent
        except Exception:  # noqa: BLE001 - the line is in the log already
            pass
        self._leave()

    def _reported(self) -> bool:
        try:
            return self.store.check(["fastvision/hang/report"])
        except Exception:  # noqa: BLE001
            return False

    def summary(self, before: dict, after: dict) -> str:
        """The one line: who did not arrive, from two heartbeat reads a grace period apart."""
        frozen = [r for r in range(self.world) if r not in after or before.get(r, (None,))[0] == after[r][0]]
        if frozen:
            missing, why = frozen, ""
        else:
            newest = max(s for _, s, _ in after.values())
            missing, why = [r for r, (_, s, _) in after.items() if s < newest], " (alive, behind)"
        if not missing:
            return (f"step {self.step}: every rank is alive and at step {self.step}, none missing: a collective "
                    f"that does not complete; stacks in {self.folder}/")
        names = ", ".join(f"rank {r} ({after.get(r, before.get(r, (0, 0, 'never reported')))[2]})" for r in missing)
        verb = "did" if len(missing) == 1 else "do"
        return f"step {self.step}: {names} {verb} not arrive{why}; stacks in {self.folder}/"

    def _write_stacks(self) -> None:
        """Every thread's Python stack, to ``rank-<r>.txt``."""
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = [f"rank {self.rank} ({self.who}): no progress for {self.timeout_s:g} s after step {self.step} "
                 f"({self.phase})\n"]
        for ident, frame in sys._current_frames().items():
            lines.append(f"\nThread {names.get(ident, ident)}:\n")
            lines.extend(traceback.format_stack(frame))
        atomic_write(self.folder / f"rank-{self.rank}.txt", lambda f: f.write("".join(lines).encode()))

    def _write_flight_recorder(self) -> None:
        """On NCCL: PyTorch's record of the last collectives (which one each rank waits in), in the
        file and format torch's own dump on a timeout uses, so ``torchfrtrace`` reads both."""
        import torch

        c10d = getattr(torch._C, "_distributed_c10d", None)
        dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)  # older / newer
        if dump is None or not torch.cuda.is_available():
            return
        try:
            (self.folder / f"nccl-trace-rank-{self.rank}").write_bytes(dump())
        except Exception as e:  # noqa: BLE001 - no NCCL group, or a torch without the recorder
            log.debug("watchdog: no flight recorder dump: %s", e)

    def _leave(self) -> None:
        for h in logging.getLogger().handlers:
            h.flush()
        self._exit(HANG_EXIT)
