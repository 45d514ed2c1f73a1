"""Checkpoints: a CPU snapshot written atomically in a background thread; where to resume. (When a
checkpoint is due and which files it becomes: :mod:`fastvision.engine.policy`.)

Host memory of a save: one copy of the checkpoint (the snapshot; GPU tensors land in pinned
buffers kept for the next save), streamed by ``torch.save`` into the temp file: no second,
serialised copy in RAM (``benchmarks/checkpoint_ram.py`` measures the peak).
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fastvision.utils import files
from fastvision.utils.files import (  # noqa: F401
    atomic_link,
    atomic_write,
    strip_prefixes,
)
from fastvision.utils.tree import map_tensors, tensors

log = logging.getLogger(__name__)


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are CPU copies of their own (dicts, lists, tuples walked).

    Training may change the live tensors in place right after this returns; the copy keeps the
    values of this moment. Non-tensor leaves are shared (they are immutable or replaced, not edited).
    """
    return map_tensors(lambda t: t.detach().to("cpu", copy=True), obj)


class PinnedStage:
    """Host copies of a checkpoint's tensors, GPU ones staged asynchronously into pinned buffers.

    :meth:`copy` returns the tree with every CUDA tensor replaced by a pinned host buffer filled by
    a ``non_blocking`` copy on the current stream (after the step's kernels, before any later
    in-place update), and every CPU tensor by a clone; one CUDA event is recorded after the
    copies. :meth:`wait` (the writer thread) waits on that event, not on the whole device. The
    pinned buffers are kept and reused by the next save when the shapes match (pinning is slow and
    pinned memory scarce, so it is allocated once); without CUDA nothing is pinned.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []  # pinned, in the order the tree's CUDA tensors come
        self._event: Any = None

    def copy(self, obj: Any) -> Any:
        cuda = [t for t in tensors(obj) if t.is_cuda]
        if len(self._buffers) != len(cuda) or any(b.shape != t.shape or b.dtype != t.dtype
                                                  for b, t in zip(self._buffers, cuda, strict=True)):
            self._buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in cuda]
        buffers = iter(self._buffers)

        def host(t: torch.Tensor) -> torch.Tensor:
            if t.is_cuda:
                return next(buffers).copy_(t.detach(), non_blocking=True)
            return t.detach().to("cpu", copy=True)

        out = map_tensors(host, obj)
        self._event = None
        if cuda:  # one event after the copies: the thread waits for them, not for the device
            self._event = torch.cuda.Event()
            self._event.record()
        return out

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class BackgroundWriter:
    """Writes checkpoints in a background thread, one at a time, each atomically.

    ``write`` waits for the previous write, stages the checkpoint in host memory
    (:class:`PinnedStage`: GPU tensors by non-blocking copies into reused pinned buffers, one
    event) and returns; the thread waits on the event, streams ``torch.save`` into a temp file
    beside the first path (``last.pt``) and renames it over (:func:`atomic_write`: temp, fsync,
    rename), then makes every other path (``best.pt`` when it improved) a hard link of that file
    with :func:`atomic_link` (an atomic copy where hard links are not available). A crash or kill
    mid-write leaves each file's previous version.
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
        self._stage = PinnedStage()

    def write(self, obj: Any, paths: Sequence[Path], prune: Sequence[Path] = ()) -> None:
        """Snapshot ``obj`` now; write it to ``paths[0]``, link the others, then delete ``prune``."""
        called = time.perf_counter()
        self.join()
        data, paths = self._stage.copy(obj), [Path(p) for p in paths]
        self.snapshot_s.append(time.perf_counter() - called)
        self._thread = threading.Thread(target=self._run, args=(data, paths, list(prune), called),
                                        name="fastvision-checkpoint", daemon=True)
        self._thread.start()

    def _run(self, data: Any, paths: list[Path], prune: list[Path], called: float) -> None:
        try:
            self._stage.wait()
            atomic_write(paths[0], lambda f: torch.save(data, f))  # streamed: no serialised copy in RAM
            for p in paths[1:]:
                if not atomic_link(paths[0], p):
                    atomic_write(p, lambda f, src=paths[0]: _copy_file(src, f))
            self.latencies.append(time.perf_counter() - called)
            for p in prune:
                p.unlink(missing_ok=True)
        except BaseException as e:  # reported by join() in the training thread
            self._error = e

    def raise_failed(self) -> None:
        """Raise the error of a write that already failed (a full disk), without waiting for one in flight:
        the training thread asks after every step, so a run stops at once, not an epoch later at the next
        checkpoint (what it trained since the last good file would be lost with it)."""
        if self._error is not None:
            self.join()

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


def _copy_file(src: Path, f) -> None:
    with open(src, "rb") as s:
        shutil.copyfileobj(s, f, 1 << 20)


def load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint loaded without pickle (:func:`fastvision.utils.files.load`: missing, empty, truncated or
    foreign files are one line naming them), its archive's checksums checked first: ``torch.load`` reads a
    tensor whose bytes changed on disk (a bit flip, a bad copy) without a word, and a resume trained on from
    the damaged weights.

    Raises:
        DataError: ``path`` is not a loadable fastvision checkpoint, or a record's bytes do not match the
            CRC-32 ``torch.save`` stored for it.
    """
    ckpt = files.load(path, map_location)
    damaged = _damaged_record(Path(path))
    if damaged is not None:
        from fastvision.errors import DataError

        raise DataError(f"{path}: damaged: the bytes of {damaged} do not match the checksum torch.save stored "
                        "(a corrupted disk or copy); resume or evaluate another checkpoint (best.pt, a step-N.pt)")
    return ckpt


def _damaged_record(path: Path) -> str | None:
    """The first record of ``path``'s zip archive whose CRC-32 does not match its bytes, else None (also for
    a file that is not a zip archive: torch's legacy format has no checksums). A stored CRC of 0 is not
    checked (``torch.serialization.config.save.compute_crc32 = False`` writes 0)."""
    import zipfile

    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if info.CRC == 0:
                continue
            try:
                with z.open(info) as f:
                    while f.read(1 << 22):  # zipfile checks the CRC-32 at the record's end
                        pass
            except zipfile.BadZipFile:
                return info.filename
    return None


def others_to_resume(path: Path, shown: int = 3) -> str:
    """What to try when the checkpoint ``path`` does not load: the other checkpoints beside it, newest first,
    as a clause to add to the error (``""`` when there are none). Hard links of ``path`` (``rollback.pt`` or
    ``best.pt`` of the same write) hold the same bytes and are left out."""
    from fastvision.engine.policy import step_checkpoints

    path = Path(path)
    try:
        named = [path.parent / n for n in ("last.pt", "best.pt", "rollback.pt")] + step_checkpoints(path.parent)
        found = [p for p in named if p.is_file() and not p.samefile(path) and p.stat().st_size > 0]
    except OSError:
        return ""
    if not found:
        return ""
    found.sort(key=lambda p: (p.stat().st_mtime, p.name), reverse=True)
    names = ", ".join(str(p) for p in found[:shown]) + (", ..." if len(found) > shown else "")
    return f"; other checkpoints of this run, newest first: {names} (--resume PATH continues one)"


def saved_step(path: Path) -> int | None:
    """The global step the checkpoint ``path`` holds, read without reading its tensors (``mmap``), or None
    where it does not load."""
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"])
    except Exception:  # noqa: BLE001  (no rollback target rather than a stopped resume)
        return None


def unfinished_write(path: Path) -> bool:
    """``path`` is the temp file of a checkpoint write a killed process left (``atomic_write``'s
    ``.last.pt.k3x9q1ab.tmp``, ``atomic_link``'s ``.best.pt.<pid>.<hex>.lnk``): never a checkpoint."""
    path = Path(path)
    return path.name.startswith(".") and path.suffix in (".tmp", ".lnk") and path.is_file()


def remove_unfinished_writes(folder: Path) -> list[Path]:
    """Delete the temp files of checkpoint writes that were killed (``kill -9``, the OOM killer, a lost
    node) in ``folder``: a run that continues there would otherwise keep each one, a checkpoint's size,
    for ever. Call it only for a run that takes ``folder`` over (no other process writes there)."""
    folder = Path(folder)
    left = [p for p in folder.iterdir() if unfinished_write(p)] if folder.is_dir() else []
    for p in left:
        p.unlink(missing_ok=True)
    if left:
        log.info("%s: removed %d unfinished checkpoint write(s) of a stopped process (%s)", folder, len(left),
                 ", ".join(p.name for p in left[:3]) + (", ..." if len(left) > 3 else ""))
    return left


def find_resume(run_dir: Path) -> Path | None:
    last = Path(run_dir) / "checkpoints" / "last.pt"
    return last if last.is_file() else None


def load_run_checkpoint(path: Path, map_location: str | torch.device = "cpu"):
    """A checkpoint fastvision wrote and its saved config, for evaluate / predict / export / resume.

    Returns:
        ``(checkpoint dict, RunConfig)``.

    Raises:
        DataError / ConfigError: one line naming ``path`` where it is no fastvision checkpoint (unreadable,
            no saved ``config``: a bare state dict) or its saved config no longer loads.
    """
    from fastvision import config
    from fastvision.errors import ConfigError, DataError

    ckpt = load(path, map_location)
    if not isinstance(ckpt.get("config"), dict):
        raise DataError(f"{path}: not a fastvision run checkpoint (no saved 'config': a bare state dict?)")
    try:
        cfg = config.from_dict(ckpt["config"])
    except ConfigError as e:
        raise ConfigError(f"{path}: its saved config does not load{saved_by(ckpt)}: {e}") from e
    check_saved_components(path, ckpt, cfg)
    return ckpt, cfg


def saved_by(ckpt: dict[str, Any]) -> str:
    """`` (saved by fastvision X, this is Y)`` where the checkpoint names another version than this one."""
    import fastvision

    saved = ckpt.get("fastvision")
    return f" (saved by fastvision {saved}, this is {fastvision.__version__})" \
        if saved and saved != fastvision.__version__ else ""


def check_saved_components(path: Path, ckpt: dict[str, Any], cfg) -> None:
    """The saved config's model, task and loss are builders this version has, with arguments they take:
    one line naming ``path``, the component and its name, the version that saved it, and what this version
    knows (the registry's valid names or keys), not a bare ``unknown model 'X'`` after a build began.

    Raises:
        ConfigError: naming ``path``.
    """
    import fastvision.losses  # noqa: F401  (register the builders)
    import fastvision.models  # noqa: F401
    import fastvision.tasks  # noqa: F401
    from fastvision.errors import ConfigError
    from fastvision.registry import LOSSES, MODELS, TASKS, check_kwargs

    by_code = {"loss", "augment", "info"}  # the task's arguments the build passes, not the config
    for kind, registry, name, args, extra in (("model", MODELS, cfg.model.name, cfg.model.args, set()),
                                              ("task", TASKS, cfg.task.name, cfg.task.args, by_code),
                                              ("loss", LOSSES, cfg.loss.name, cfg.loss.args, set())):
        try:
            check_kwargs(registry.get(name), dict(args or {}), f"{kind}.args", exclude=extra)
        except ConfigError as e:
            raise ConfigError(f"{path}: its {kind} {name!r} does not build in this version{saved_by(ckpt)}: "
                              f"{e}") from e


def load_model_weights(model: torch.nn.Module, state: dict[str, Any], path: Path, what: str = "") -> None:
    """``model.load_state_dict(state)``; where the weights do not fit the model, one line naming ``path``
    and the first key of each kind of mismatch (missing, unexpected, another shape) instead of torch's
    list of every key.

    Raises:
        DataError: the weights of ``path`` do not fit ``model`` (``what`` names it, e.g. its model name).
    """
    from fastvision.errors import DataError

    try:
        model.load_state_dict(state)
        return
    except RuntimeError as e:  # torch lists every key: name the first of each kind
        mine = model.state_dict()
        missing = [k for k in mine if k not in state]
        unexpected = [k for k in state if k not in mine]
        shapes = [k for k in mine if k in state and isinstance(state[k], torch.Tensor)
                  and state[k].shape != mine[k].shape]
        first = lambda keys: keys[0] + (", ..." if len(keys) > 1 else "")  # noqa: E731
        parts = [f"{len(missing)} weight(s) missing ({first(missing)})" if missing else "",
                 f"{len(unexpected)} the model does not have ({first(unexpected)})" if unexpected else "",
                 (f"{len(shapes)} of another shape ({shapes[0]}: {tuple(state[shapes[0]].shape)} in the file, "
                  f"{tuple(mine[shapes[0]].shape)} in the model)") if shapes else ""]
        why = "; ".join(p for p in parts if p) or str(e).strip().splitlines()[-1].strip()[:200]
        raise DataError(f"{path}: its weights do not fit the model{f' ({what})' if what else ''}: {why}") from e


def resume_data(cfg: Any, run_dir: Path, flat: dict[str, Any] | None, extra: Sequence[dict[str, Any]],
                ckpt: str | Path | None = None) -> None:
    """A resumed run reads the data it was trained on: unless the flat options (``--data``) or an override
    (``--set data.args.path``) name a path, ``cfg``'s data path becomes the one in ``run_dir/config.yaml``,
    or, where that has none (``--resume PATH --out NEW``), in the config.yaml of ``ckpt``'s run folder.
    Before, a resume without ``--data`` read the recipe's default folder, and trained on it where its
    classes matched."""
    import yaml

    def names_path(d: dict[str, Any]) -> bool:
        args = d["data"].get("args") if isinstance(d.get("data"), dict) else None
        return isinstance(args, dict) and "path" in args

    given = "data" in (flat or {}) or any(names_path(d) for d in extra)
    if given or not isinstance(cfg.data.args, dict):
        return
    saved = None
    for folder in [run_dir] + ([Path(ckpt).resolve().parent.parent] if ckpt is not None else []):
        try:
            saved = yaml.safe_load((folder / "config.yaml").read_text())["data"]["args"]["path"]
            break
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            continue
    if isinstance(saved, str) and saved != cfg.data.args.get("path"):
        log.info("resuming on the run's data, %s (from its config.yaml; --data trains on other data)", saved)
        cfg.data.args["path"] = saved
