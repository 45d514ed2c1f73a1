"""Checkpoints: atomic writes, ``weights_only`` loads, and full resume state.

A checkpoint is a dict of tensors and plain Python values only, so it loads with
``torch.load(weights_only=True)``: opening a checkpoint never executes pickled code. Writes go to a
temporary file in the same directory, are fsync'ed, then renamed over the old file, so a crash or
kill leaves the previous good checkpoint intact. When ``last.pt`` and ``best.pt`` hold the same state,
``best.pt`` becomes a hard link of the ``last.pt`` just written (linked under a temporary name, then
renamed over ``best.pt``): one serialisation and one file write, not two. Every later write
replaces ``last.pt`` by renaming a new file over it, so the linked ``best.pt`` keeps its content.

:class:`BackgroundWriter` takes a CPU snapshot of a checkpoint (the only part that waits for the
device) and serialises, writes and renames it in a thread, so training goes on meanwhile.
"""
from __future__ import annotations

import io
import logging
import os
import secrets
import tempfile
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable, Sequence

import torch

from .errors import DataError
from .tree import map_tensors

log = logging.getLogger(__name__)


def atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> Any:
    """Call ``write(file)`` on a unique temp file beside ``path``, fsync, rename over ``path``, fsync
    the directory. Readers see the old file or the new one, never a partial one; concurrent writers
    (threads or processes) never share a temp file. Returns what ``write`` returned."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return result


def _fsync_dir(folder: Path) -> None:
    """Make renames in ``folder`` durable (a crash right after cannot bring back the old entry)."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_link(src: Path, path: Path) -> bool:
    """Make ``path`` a hard link of the complete file ``src``, atomically: link to a unique temp name
    beside ``path``, rename it over ``path``, fsync the directory. Returns False (``path`` untouched)
    where the file system has no hard links, so the caller can write a copy instead."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.lnk"
    try:
        os.link(src, tmp)  # fails if tmp exists: never follows or reuses another writer's name
    except OSError:
        return False
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return True


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda f: torch.save(obj, f))


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
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def write(self, obj: Any, paths: Sequence[Path]) -> None:
        self.join()
        data, paths = snapshot(obj), [Path(p) for p in paths]
        self._thread = threading.Thread(target=self._run, args=(data, paths), name="fastvision-checkpoint",
                                        daemon=True)
        self._thread.start()

    def _run(self, data: Any, paths: list[Path]) -> None:
        try:
            buf = io.BytesIO()
            torch.save(data, buf)
            for i, p in enumerate(paths):
                if i == 0 or not atomic_link(paths[0], p):
                    atomic_write(p, lambda f: f.write(buf.getbuffer()))
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


def load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint safely; a user-facing error names the file if it is missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # corrupt, truncated, empty, or contains non-tensor pickled objects
        # Some loaders raise with an empty message (an empty file gives EOFError("")): say what it was.
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if path.stat().st_size == 0:
            reason = "the file is empty"
        raise DataError(f"{path}: not a loadable fastvision checkpoint ({reason})") from e
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise DataError(f"{path}: not a fastvision checkpoint (no 'model' entry)")
    return ckpt


def strip_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) prefixes."""
    out = {}
    for k, v in state_dict.items():
        for prefix in ("_orig_mod.", "module."):
            while k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


def find_resume(run_dir: Path) -> Path | None:
    last = Path(run_dir) / "checkpoints" / "last.pt"
    return last if last.is_file() else None
