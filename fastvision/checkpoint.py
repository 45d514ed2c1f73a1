"""Checkpoints: atomic writes, ``weights_only`` loads, and full resume state.

A checkpoint is a dict of tensors and plain Python values only, so it loads with
``torch.load(weights_only=True)``: opening a checkpoint never executes pickled code. Writes go to a
temporary file in the same directory, are fsync'ed, then renamed over the old file, so a crash or
kill leaves the previous good checkpoint intact.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from .errors import DataError


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
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return result


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda f: torch.save(obj, f))


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
