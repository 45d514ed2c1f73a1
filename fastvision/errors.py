"""User-facing errors: the CLI prints these as one line and exits with code 2.

Raise a subclass of :class:`FastvisionError` for anything the user can fix (a bad path, a wrong
config key, a corrupt file). Its message must name the file or key. Programming errors stay
ordinary exceptions and keep their traceback.
"""
import errno as _errno
import os as _os


def error_line(e: BaseException) -> str:
    """``Type: first line`` of ``e``, for a one-line report of an error that was caught and survived (a
    compile fallback, a tuner trial); where that line only introduces its cause (torch < 2.5's
    ``BackendCompilerFailed: backend='inductor' raised:``), the cause's line after it."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    line = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    inner = getattr(e, "inner_exception", None)
    if isinstance(inner, BaseException) and (not lines or lines[0].endswith(":")):
        return f"{line}: {error_line(inner)}"
    return line


def did_you_mean(name: str, names, prefix: str = "") -> str:
    """`` (did you mean PREFIX.CLOSEST?)`` for an unknown key ``name`` one typo from one of ``names``
    (``train.epoch``: ``train.epochs``), else ``""``."""
    import difflib

    close = difflib.get_close_matches(str(name), sorted(names), 1, 0.7)
    return f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)" if close else ""


def check_low(flag: str, value: float | None, low: float, inclusive: bool = True) -> None:
    """A command-line number at or above ``low`` (above it with ``inclusive`` False), else one line naming
    the option: ``--batch 0: must be >= 1``; an infinite one too (``--compute-ms inf`` was a
    ZeroDivisionError traceback). None (not given) passes."""
    if value is not None and not (value >= low if inclusive else value > low):
        raise ConfigError(f"{flag} {value:g}: must be {'>=' if inclusive else '>'} {low}")
    if value is not None and value == float("inf"):
        raise ConfigError(f"{flag} {value:g}: must be a finite number {'>=' if inclusive else '>'} {low}")


# what gloo says on a rank whose peer's process ended (its sockets closed) in the middle of a collective
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_lost(e: BaseException) -> str | None:
    """The gloo message's own words when ``e`` is a collective that failed because a peer process ended."""
    text = str(e)
    if isinstance(e, RuntimeError) and "gloo" in text:
        return next((m for m in PEER_GONE if m in text), None)
    return None


# the optional extras of pyproject.toml, by the top-level module each provides
EXTRAS = {"nibabel": "medical", "scipy": "medical", "pycocotools": "detection", "pynvml": "gpu",
          "onnx": "export", "onnxscript": "export", "onnxruntime": "export", "webdataset": "shards",
          "crc32c": "shards", "tensorboard": "tensorboard", "fsspec": "s3", "s3fs": "s3"}


def check_range(key: str, value: float | None, low: float, high: float | None = None, *,
                closed: str = "[)") -> None:
    """One ConfigError naming ``key`` unless ``value`` is None, ``>= low`` (no ``high``), or in the interval
    from ``low`` to ``high`` whose ends ``closed`` gives: ``"[)"`` (a score threshold, a strength), ``"(]"``
    (an IoU). Detection had none of these checks: an IoU above 1 turned NMS off, a score threshold of 1 or
    max_detections 0 scored every run 0, a negative colour jitter switched it off, all without a word."""
    if value is None:
        return
    if high is None:
        ok = value >= low
    else:
        above = low <= value if closed[0] == "[" else low < value
        ok = above and (value <= high if closed[1] == "]" else value < high)
    if not ok:
        rule = f">= {low}" if high is None else f"in {closed[0]}{low:g}, {high:g}{closed[1]}"
        raise ConfigError(f"{key}={value}: must be {rule}")


def missing_extra(e: BaseException) -> str | None:
    """The one line for an optional extra's module that did not import, where ``e`` or its cause /
    context chain is that ``ModuleNotFoundError`` (a base install, as `make demo` makes, has none of
    them); None for any other error."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        name = (getattr(e, "name", None) or "").split(".")[0] if isinstance(e, ModuleNotFoundError) else ""
        if name in EXTRAS:
            return f"this needs {name} (No module named {name!r}): pip install 'fastvision[{EXTRAS[name]}]'"
        e = e.__cause__ or e.__context__
    return None


class FastvisionError(Exception):
    """Base class for errors caused by user input; message is shown without a traceback."""


class ConfigError(FastvisionError):
    """A recipe, override or argument is unknown or has the wrong type."""


class DataError(FastvisionError):
    """A data path is missing, unreadable, corrupt or inconsistent."""


class DiskFullError(FastvisionError, OSError):
    """A file not written because its file system is full or over quota (``ENOSPC`` / ``EDQUOT``), raised by
    :func:`fastvision.utils.files.atomic_write` after removing its partial temp file: the file there before is
    kept. An ``OSError`` too, so callers that turn a failed write into their own message still catch it."""

    def __init__(self, path, code: int = _errno.ENOSPC, free_bytes: int | None = None, kept: bool = False):
        super().__init__(code, _os.strerror(code), str(path))
        self.free_bytes, self.kept = free_bytes, kept

    def __str__(self) -> str:
        free = "" if self.free_bytes is None else f", {self.free_bytes / 2**20:.1f} MiB free there now"
        before = "the file there before is kept" if self.kept else "no partial file left"
        return f"{self.filename}: not written: {self.strerror}{free}; {before}"


class DataWarning(RuntimeWarning):
    """A data problem fastvision steps over (a label resampled onto its image's grid, a corrupt cache
    entry recomputed). Its message names the file; the CLI shows it as one log line
    (``fastvision: warning: ...``), not Python's warning format with a source line."""


class Preempted(FastvisionError):
    """A run stopped on a signal after writing its checkpoint; the CLI exits with ``exit_code``
    (128 + the signal, the shell's code for "ended by signal N": a scheduler sees a stop, not a success)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


def interrupted(command: str, outputs: list, when: str) -> Preempted:
    """What a Ctrl-C (SIGINT) in a command that writes its outputs only at its end raises: one line saying
    that nothing was written, what would have been (``outputs``, None entries left out) and ``when``; the
    CLI prints it and exits 130, as a shell reports SIGINT."""
    import signal

    names = ", ".join(str(p) for p in outputs if p is not None)
    return Preempted(signal.SIGINT, f"{command} interrupted: nothing written ({names}: written only when "
                                    f"{when}); rerun to measure again")


class ReportedByPeer(FastvisionError):
    """This rank's share of an error another rank of the job reports in its own line (rank 0's refusal of
    the run folder): the CLI exits 2 without printing it, so a job of N ranks says it once."""


# set by ``--nproc``'s launcher for its workers: a file of the error lines printed so far
ERROR_LINES_ENV = "FASTVISION_ERROR_LINES"


def first_report(line: str) -> bool:
    """Whether ``line`` is to be printed: always, except in a worker of ``--nproc`` whose sibling printed the
    same line already (every rank stops on the same bad file or setting: the job says it once). The
    launcher's file of printed lines is read and appended under a lock; any trouble with it prints."""
    path = _os.environ.get(ERROR_LINES_ENV)
    if not path:
        return True
    try:
        import fcntl

        with open(path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            if line in f.read().splitlines():
                return False
            f.write(line + "\n")
            f.flush()
    except (OSError, ImportError):
        return True
    return True
