"""Files written atomically (temp file, fsync, rename) and checkpoints loaded without pickle."""
from __future__ import annotations

import errno
import logging
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from fastvision.errors import DataError, DiskFullError

log = logging.getLogger(__name__)


def atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> Any:
    """Call ``write(file)`` on a unique temp file beside ``path``, fsync, rename over ``path``, fsync
    the directory. Readers see the old file or the new one, never a partial one; concurrent writers
    (threads or processes) never share a temp file. Returns what ``write`` returned. A full file system
    (``ENOSPC`` / ``EDQUOT`` anywhere in the failure's chain: torch's zip writer reports it as a
    ``RuntimeError`` whose context is the ``OSError``) raises :class:`DiskFullError` naming ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        full = disk_full(e)
        if full is not None and not isinstance(full, DiskFullError):
            raise DiskFullError(path, full.errno, _free_bytes(path.parent), path.exists()) from e
        raise
    _fsync_dir(path.parent)
    return result


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# what a user fixes, not a bug: a full, read-only or forbidden place, a path under a file (the CLI prints
# these as one line naming the path)
USER_FIXABLE = (*DISK_FULL, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR)


def os_error_in(e: BaseException, codes: tuple[int, ...] = USER_FIXABLE) -> OSError | None:
    """The ``OSError`` with one of ``codes`` that is ``e`` or in its cause / context chain, if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in codes:
            return e
        e = e.__cause__ or e.__context__
    return None


def disk_full(e: BaseException) -> OSError | None:
    """The ``OSError`` with ``ENOSPC`` or ``EDQUOT`` that is ``e`` or in its cause / context chain, if any."""
    return os_error_in(e, DISK_FULL)


def _free_bytes(folder: Path) -> int | None:
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


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
