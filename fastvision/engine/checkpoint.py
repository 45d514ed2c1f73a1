"""Checkpoints: a CPU snapshot written atomically in a background thread; where to resume. (When a
checkpoint is due and which files it becomes: :mod:`fastvision.engine.policy`.)"""
from __future__ import annotations

import io
import logging
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from fastvision.utils.files import (  # noqa: F401
    atomic_link,
    atomic_write,
    load,
    strip_prefixes,
)
from fastvision.utils.tree import map_tensors

log = logging.getLogger(__name__)


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are CPU copies of their own (dicts, lists, tuples walked).

    Training may change the live tensors in place right after this returns; the copy keeps the
    values of this moment. Non-tensor leaves are shared (they are immutable or replaced, not edited).
    """
    return map_tensors(lambda t: t.detach().to("cpu", copy=True), obj)


class BackgroundWriter:
    """Writes checkpoints in a background thread, one at a time, each atomically.

    ``write`` waits for the previous write, snapshots the checkpoint, and returns; the thread then
    serialises it once, writes it to the first path (``last.pt``) with :func:`atomic_write` and makes
    every other path (``best.pt`` when it improved) a hard link of that file with :func:`atomic_link`
    (a second atomic write where hard links are not available). A crash or kill mid-write leaves
    each file's previous version.
    Call :meth:`join` before relying on the files (the engine does at the end of ``fit``, and in its
    ``finally``). An error in the thread is raised by the next ``write`` or ``join``.

    Each write's latency, from the call (the step's end) to every file being durable (fsynced and
    renamed), is kept in :attr:`latencies`; it is bounded by one write: a write waits for the one
    before it.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.latencies: list[float] = []  # seconds from write() to durable, per finished write
        self.snapshot_s: list[float] = []  # seconds the training thread spent in write() (wait + snapshot)

    def write(self, obj: Any, paths: Sequence[Path], prune: Sequence[Path] = ()) -> None:
        """Snapshot ``obj`` now; write it to ``paths[0]``, link the others, then delete ``prune``."""
        called = time.perf_counter()
        self.join()
        data, paths = snapshot(obj), [Path(p) for p in paths]
        self.snapshot_s.append(time.perf_counter() - called)
        self._thread = threading.Thread(target=self._run, args=(data, paths, list(prune), called),
                                        name="fastvision-checkpoint", daemon=True)
        self._thread.start()

    def _run(self, data: Any, paths: list[Path], prune: list[Path], called: float) -> None:
        try:
            buf = io.BytesIO()
            torch.save(data, buf)
            for i, p in enumerate(paths):
                if i == 0 or not atomic_link(paths[0], p):
                    atomic_write(p, lambda f: f.write(buf.getbuffer()))
            self.latencies.append(time.perf_counter() - called)
            for p in prune:
                p.unlink(missing_ok=True)
        except BaseException as e:  # reported by join() in the training thread
            self._error = e

    def join(self, raise_errors: bool = True) -> None:
        """Wait for the write in flight; raise its error (or only log it with ``raise_errors=False``)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            if raise_errors:
                raise error
            log.error("checkpoint write failed: %s", error)


def find_resume(run_dir: Path) -> Path | None:
    last = Path(run_dir) / "checkpoints" / "last.pt"
    return last if last.is_file() else None
