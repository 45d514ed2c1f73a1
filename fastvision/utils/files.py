"""Files written atomically (temp file, fsync, rename) and checkpoints loaded without pickle."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from fastvision.errors import DataError, DiskFullError

log = logging.getLogger(__name__)
_UMASK = os.umask(0o022)  # read once at import (os.umask can only be read by setting it) ...
os.umask(_UMASK)  # ... and put back at once


def atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> Any:
    """Call ``write(file)`` on a unique temp file beside ``path``, fsync, rename over ``path``, fsync
    the directory. Readers see the old file or the new one, never a partial one; concurrent writers
    (threads or processes) never share a temp file; the file gets the mode open() would give it (the
    umask's, not mkstemp's 0600). Returns what ``write`` returned. A full file system (``ENOSPC`` /
    ``EDQUOT`` anywhere in the failure's chain: torch's zip writer reports it as a ``RuntimeError``
    whose context is the ``OSError``) raises :class:`DiskFullError` naming ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)  # the mode a plain open() gives (the umask's), not 0600
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


def atomic_by_name(path: Path, write: Callable[[str], Any]) -> Path:
    """``write(name)`` for a writer that takes a file name (torch.profiler's ``export_chrome_trace``): it
    writes a temp file beside ``path``, which then replaces ``path``; a stop or failure removes the temp
    file, so ``path`` is whole or as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        write(str(tmp))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _publish(tmp, path)
    return path


def atomic_text(path: Path, text: str) -> Path:
    """``path`` holding ``text`` (UTF-8), written with :func:`atomic_write`: a report that a stop, a
    failure or a full disk interrupts leaves the file there before, never half of the new one."""
    data = text.encode()
    atomic_write(Path(path), lambda f: f.write(data))
    return Path(path)


def check_figure_name(path: str | Path, flag: str) -> Path:
    """``path`` if its suffix names an image format matplotlib writes (what :func:`save_figure` will be
    asked for), checked before the work that makes the figure.

    Raises:
        DataError: naming ``flag`` and the path.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(path)
    if path.suffix.lower().lstrip(".") not in FigureCanvasBase.get_supported_filetypes():
        raise DataError(f"{flag} {path}: not an image file name matplotlib writes; end it with .png (or .svg, .pdf)")
    return path


def save_figure(fig: Any, path: Path, dpi: int = 100) -> Path:
    """``fig`` (matplotlib) rendered in memory in ``path``'s format (by its suffix; PNG without one), then
    written with :func:`atomic_write`: a stop or a full disk during the write never leaves half a picture."""
    import io

    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format=path.suffix.lstrip(".") or "png")
    data = buf.getvalue()
    atomic_write(path, lambda f: f.write(data))
    return path


def os_error_in(e: BaseException, codes: tuple[int, ...] = USER_FIXABLE) -> OSError | None:
    """The ``OSError`` with one of ``codes`` that is ``e`` or in its cause / context chain, if any. With
    the default codes, also a "No such file or directory" raised by ``mkdir`` itself: a folder asked for
    where none can be made (``--out /proc/x``); ``mkdir(parents=True)`` raises it for nothing else."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and (e.errno in codes or (codes is USER_FIXABLE and _from_mkdir(e))):
            return e
        e = e.__cause__ or e.__context__
    return None


def _from_mkdir(e: OSError) -> bool:
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return e.errno == errno.ENOENT and tb is not None and tb.tb_frame.f_code.co_name in ("mkdir", "makedirs")


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
    _publish(tmp, path)
    return True


def _publish(tmp: Path, path: Path) -> None:
    """Rename the complete temp file ``tmp`` over ``path`` and fsync the directory; a failed rename
    removes ``tmp``, leaving ``path`` as it was."""
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)



def load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint safely; a user-facing error names the file if it is missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"checkpoint not found: {path}")
    try:
        with warnings.catch_warnings():  # torch's note on a pickle protocol it was not written with
            warnings.simplefilter("ignore", UserWarning)
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # corrupt, truncated, empty, or contains non-tensor pickled objects
        raise DataError(f"{path}: not a loadable fastvision checkpoint ({load_failure(path, e)})") from e
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise DataError(f"{path}: not a fastvision checkpoint (no 'model' entry)")
    return ckpt


def load_failure(path: Path, e: Exception, wanted: str = "a file fastvision wrote") -> str:
    """Why ``torch.load(weights_only=True)`` refused ``path``, in a few words (not torch's advice to
    load it unsafely: fastvision never unpickles code); ``wanted`` names what the file should have been."""
    text = str(e).strip()
    if path.stat().st_size == 0:
        return "the file is empty"
    with open(path, "rb") as f:
        head = f.read(2)
    pickled = head[:1] == b"\x80"  # a pickle's protocol opcode: torch's legacy format, or plain pickle
    if head == b"PK" and not zipfile.is_zipfile(path):
        return f"a damaged or truncated torch.save archive: {text.splitlines()[0].split('. This is')[0][:160]}"
    if not zipfile.is_zipfile(path) and not pickled:
        return "not a file torch.save wrote"  # torch's readers on other bytes: KeyError(101), "operand 123", ...
    if text.startswith("Weights only load failed"):
        why = next((ln.split("WeightsUnpickler error:", 1)[1].strip() for ln in text.splitlines()
                    if "WeightsUnpickler error:" in ln), "")
        why = why.split(" was not an allowed global")[0] or next(
            (ln.strip() for ln in text.splitlines() if ln.strip().startswith("Unsupported")), "")
        return ("it holds pickled Python objects" + (f" ({why[:120]})" if why else "")
                + f", which fastvision does not unpickle: not {wanted}")
    # some loaders raise with an empty message: say what it was
    return (text.splitlines() or [type(e).__name__])[0][:200]


def strip_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) prefixes."""
    out = {}
    for k, v in state_dict.items():
        for prefix in ("_orig_mod.", "module."):
            while k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


@contextlib.contextmanager
def term_exits() -> Iterator[None]:
    """SIGTERM / SIGHUP (``kill``, ``timeout``, a closed terminal) exit with 128 + the signal through the ``finally``
    blocks: they ended the process on the spot and left a half-written file (``export``'s ONNX, the model's
    size, in a ``.NAME.xxxx`` folder beside ``--out``); also where the block wraps the exit in an error of its own.
    Only the main thread can set handlers; elsewhere a no-op."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    got: list[int] = []

    def stop(signum, _frame):
        got.append(signum)
        raise SystemExit(128 + signum)

    sigs = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]
    before = {s: signal.signal(s, stop) for s in sigs}
    try:
        yield
        if got:  # the block swallowed the exit
            raise SystemExit(128 + got[0])
    except BaseException:
        if got:  # torch's exporter wraps it in an error of its own, with a traceback
            raise SystemExit(128 + got[0]) from None
        raise
    finally:
        for s, h in before.items():
            signal.signal(s, h)
