"""What the CLI and the notebook API share: overrides, run directories, train / evaluate / predict.

An existing run directory is never silently overwritten: a new run needs a new (or empty)
directory, and continuing one needs ``--resume``.
"""
from __future__ import annotations

import inspect
import json
import logging
import time
from pathlib import Path
from typing import Any

from fastvision import config, distributed
from fastvision.engine import checkpoint
from fastvision.errors import ConfigError, DataError, FastvisionError, Preempted, ReportedByPeer, peer_lost

log = logging.getLogger(__name__)

# Flat option -> dotted config key (the CLI's common flags and train(**kwargs) names).
FLAT_KEYS = {
    "data": "data.args.path", "epochs": "train.epochs", "batch_size": "train.batch_size", "lr": "optim.lr",
    "amp": "train.amp", "tf32": "train.tf32", "compile": "train.compile", "channels_last": "train.channels_last",
    "device": "train.device", "seed": "train.seed", "target": "train.target", "tensorboard": "tensorboard",
    "emulate_workers": "train.emulate_workers", "backend": "train.backend",
}


def overrides_to_dicts(overrides: dict[str, Any]) -> list[dict[str, Any]]:
    """``{"epochs": 3, "optim.lr": 0.1}`` -> nested override mappings, flat names translated. A local
    ``data`` folder (``--data``) is made absolute, so the run's saved config names it from anywhere (a
    later ``predict`` or ``evaluate`` run from another directory); a URL stays as given."""
    import os

    def value_of(key: str, value: Any) -> Any:
        if key == "data" and isinstance(value, (str, Path)) and "://" not in str(value):
            return os.path.abspath(os.path.expanduser(str(value)))
        return value

    return [config.nested(FLAT_KEYS.get(key, key), value_of(key, value)) for key, value in overrides.items()]


def refuse_overwrite(path: str | Path, force: bool, flag: str = "--out", *, file: bool = False,
                     folder: bool = False) -> None:
    """Stop before writing to ``path`` if it holds something (a file, or a non-empty folder) and
    ``force`` is not set, so predict / export / profile / benchmark never silently replace results.
    ``file``: ``path`` is to be a file, so an existing folder there is refused even with ``force``;
    ``folder``: the other way round. A file where a folder above ``path`` is to be is refused too.

    Raises:
        DataError: naming the path and the way out (``--force`` or another ``flag``).
    """
    p = Path(path)
    above = next((a for a in p.parents if a.exists()), None)
    if above is not None and not above.is_dir():
        raise DataError(f"{flag} {p}: {above} is a file, not a folder")
    if file and p.is_dir():
        raise DataError(f"{flag} {p}: is a folder; give a file path")
    if folder and p.exists() and not p.is_dir():
        raise DataError(f"{flag} {p}: is a file; {flag} must be a folder")
    if force or not p.exists() or (p.is_dir() and not any(p.iterdir())):
        return
    kind = "folder is not empty" if p.is_dir() else "file exists"
    raise DataError(f"{p}: {kind}; pass --force to overwrite, or choose another {flag}")


def prepare_run_dir(recipe_name: str, out: str | None, resume: str | None) -> tuple[Path, Path | None]:
    """Choose the run directory and the checkpoint to resume from (if any); the run takes it over, so the
    temp files of checkpoint writes killed there (``kill -9`` mid-write) are removed.

    Rules: ``--out`` that exists and is non-empty needs ``--resume``, unless it holds only what a
    run writes before its first checkpoint (an attempt that stopped early: a bad setting, a
    restart): the run starts afresh there, its old ``metrics.jsonl`` kept as
    ``metrics.previous.jsonl``; ``--resume auto`` without ``--out`` continues the
    ``runs/<recipe>-*`` whose last checkpoint is newest (else starts a new run); ``--resume PATH``
    continues that checkpoint's run directory.
    """
    run_dir, ckpt = _choose_run_dir(recipe_name, out, resume)
    for folder in (run_dir, run_dir / "checkpoints"):  # config.yaml's too: a kill as the run started
        checkpoint.remove_unfinished_writes(folder)
    return run_dir, ckpt


def _choose_run_dir(recipe_name: str, out: str | None, resume: str | None) -> tuple[Path, Path | None]:
    if resume and resume != "auto":
        ckpt = Path(resume)
        if ckpt.is_dir():  # a run folder, or its checkpoints/: the two ways that say what to continue
            run = ckpt.parent if ckpt.name == "checkpoints" and not (ckpt / "checkpoints").is_dir() else ckpt
            raise DataError(f"--resume {ckpt}: a folder, not a checkpoint file; continue that run with --out {run} "
                            f"--resume auto, or pass --resume {run / 'checkpoints' / 'last.pt'}")
        if not ckpt.is_file():  # a misspelt 'auto' too ('aut', 'Auto'): say the word
            raise DataError(f"--resume: checkpoint not found: {ckpt} (--resume auto continues the newest run)")
        run_dir = Path(out) if out else ckpt.resolve().parent.parent
        return run_dir, ckpt
    if out:
        run_dir = Path(out)
        if run_dir.exists() and any(run_dir.iterdir()):
            found = checkpoint.find_resume(run_dir)
            if resume == "auto" and found:
                return run_dir, found
            if not found and _only_run_files(run_dir):
                # an earlier attempt stopped before its first checkpoint (a torchrun restart): start afresh here
                log.info("%s holds no checkpoint yet (an attempt that stopped early): starting from scratch", run_dir)
                old = run_dir / "metrics.jsonl"
                if old.exists():
                    old.replace(run_dir / "metrics.previous.jsonl")
                return run_dir, None
            if resume == "auto":
                raise DataError(f"{run_dir}: exists but holds no checkpoints/last.pt to resume")
            raise DataError(f"{run_dir}: run directory already exists; pass --resume auto to continue it "
                            "or choose another --out")
        return run_dir, None
    runs = Path("runs")
    if resume == "auto":
        # the run whose last checkpoint is newest: a folder's own time moves when a finished run writes its
        # summary or plots, and the checkpoints are written in checkpoints/, not in it
        found = [last for p in runs.glob(f"{recipe_name}-*") if (last := checkpoint.find_resume(p))]
        if found:
            last = max(found, key=lambda q: q.stat().st_mtime)
            return last.parent.parent, last
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = runs / f"{recipe_name}-{stamp}"
    n = 1
    while run_dir.exists():
        n += 1
        run_dir = runs / f"{recipe_name}-{stamp}-{n}"
    return run_dir, None


# what a run writes before its first checkpoint; "hang": the watchdog's stack dumps, written when a rank stopped
# arriving (a killed worker: torchrun's restart then finds them beside no checkpoint)
_RUN_FILES = {"config.yaml", "metrics.jsonl", "metrics.previous.jsonl", "checkpoints", "tensorboard", "hang"}


def _only_run_files(run_dir: Path) -> bool:
    """True when ``run_dir`` holds only what a run writes before its first checkpoint (the temp files of
    writes that were killed included, config.yaml's or the first checkpoint's: torchrun's restart then
    starts afresh)."""
    def no_checkpoint(p: Path) -> bool:
        return not (p.name == "checkpoints" and p.is_dir()
                    and any(not checkpoint.unfinished_write(q) for q in p.iterdir()))

    return all((p.name in _RUN_FILES or p.name.startswith("events.") or checkpoint.unfinished_write(p))
               and no_checkpoint(p) for p in run_dir.iterdir())


def _agree_run_dir(env, recipe: str, out: str | None, resume: str | None) -> tuple[Path, Path | None]:
    """Rank 0's :func:`prepare_run_dir` on every rank; its error raised on rank 0, :class:`ReportedByPeer`
    on the others (before, they waited in the broadcast and printed gloo's "Connection closed by peer"
    traceback when rank 0 exited)."""
    choice: Any = None
    if env.is_main:
        try:
            choice = prepare_run_dir(recipe, out, resume)
        except FastvisionError as e:
            distributed.broadcast_object(("error", str(e)))
            raise
    choice = distributed.broadcast_object(choice)
    if choice and choice[0] == "error":
        raise ReportedByPeer(choice[1])
    return choice


def run_training(recipe: str, out: str | None = None, resume: str | None = None,
                 overrides: dict[str, Any] | None = None, extra: list[dict[str, Any]] = (),
                 progress: bool | None = None) -> dict[str, Any]:
    """Load the recipe with overrides, prepare the run directory, train; returns the summary."""
    from fastvision.engine import fit

    cfg = config.load(recipe, [*overrides_to_dicts(overrides or {}), *extra])
    joined = not distributed.joined()  # a group the caller made stays theirs
    env, device = distributed.init(cfg.train.device, timeout_s=cfg.train.dist_timeout_s, backend=cfg.train.backend)
    clean = False  # every rank ended together: gloo's threads can be joined (distributed.shutdown)
    try:
        if cfg.train.batch_size == "auto":  # every rank searches its device; all train at the smallest
            from fastvision.planning.autobatch import agree_auto_batch

            agree_auto_batch(cfg, device)
        # Rank 0 names the run directory; every rank uses its choice (timestamps differ per process),
        # or stops with its refusal (an existing --out): rank 0 prints it, the others exit quietly
        run_dir, ckpt = _agree_run_dir(env, cfg.recipe, out, resume)
        if ckpt is not None:  # the run's own data, unless --data / --set data.args.path names other
            checkpoint.resume_data(cfg, run_dir, overrides, extra, ckpt)
        in_run_dir(cfg, run_dir)
        made = env.is_main and not run_dir.exists()  # (an empty --out the user made is kept, emptied)
        fresh = env.is_main and (made or not any(run_dir.iterdir()))
        try:
            summary = fit(cfg, run_dir, resume=ckpt, progress=progress)
        except Exception as e:  # a user error here, or on another rank (this rank's collective then broke)
            if fresh and not isinstance(e, Preempted) and (isinstance(e, FastvisionError) or peer_lost(e)):
                _remove_unstarted(run_dir, made, restarts=not isinstance(e, FastvisionError))
            raise
        if env.is_main:  # atomic: a reader (cv, benchmark --mode target, a rerun) never sees half of it
            text = json.dumps(summary, indent=2, default=str).encode()
            checkpoint.atomic_write(run_dir / "summary.json", lambda f: f.write(text))
        else:  # another rank's copy (not written anywhere): the CLI prints rank 0's alone
            summary = {**summary, "rank": env.rank}
        clean = True
    except Preempted:  # every rank stopped at the agreed step, after a barrier
        clean = True
        raise
    finally:
        if joined:  # leave the process group this call joined, also after an error or a stop signal
            distributed.shutdown(join_threads=clean)
    return summary


def _remove_unstarted(run_dir: Path, made: bool, restarts: bool = False) -> None:
    """What a run stopped by a user error before its first checkpoint wrote in a new or empty folder (a mask
    refused when first read): removed, and the folder where this run ``made`` it; kept for a lost peer
    (``restarts``) under a torchrun with --max-restarts, whose next attempt starts afresh in it."""
    import os
    import shutil

    elastic = restarts and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0
    if elastic or not run_dir.is_dir() or not _only_run_files(run_dir):
        return
    if made:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for p in run_dir.iterdir():
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def in_run_dir(cfg: Any, run_dir: Path) -> None:
    """A relative ``task.args.results_path`` (detection's validation results file) names a file in the run
    directory, absolutely in the saved config: it was written to the current directory, and a later
    ``evaluate`` run elsewhere wrote another copy there."""
    import os

    path = cfg.task.args.get("results_path") if isinstance(cfg.task.args, dict) else None
    if isinstance(path, str) and path and not os.path.isabs(os.path.expanduser(path)):
        cfg.task.args["results_path"] = os.path.abspath(run_dir / path)


def load_run(path: str | Path, device: str = "auto", with_data: bool = True):
    """A run directory or checkpoint -> (Run with the checkpoint's weights loaded, checkpoint path).

    ``with_data=False`` rebuilds model and task from the checkpoint alone (its config and saved
    dataset facts), so prediction works after the training data has moved.
    """
    from fastvision.engine import build

    path = Path(path)
    if path.is_dir():
        ckpt_path = next((p for p in (path / "checkpoints" / "best.pt", path / "checkpoints" / "last.pt")
                          if p.is_file()), None)
        if ckpt_path is None and ((path / "folds.json").is_file() or any(path.glob("fold-[0-9]*"))):
            raise DataError(f"{path}: a train --folds folder, not one run: give one fold's run (e.g. "
                            f"{path / 'fold-0'}), or see its out-of-fold table with: fastvision cv {path}")
        if ckpt_path is None:
            raise DataError(f"{path}: no checkpoints/best.pt or checkpoints/last.pt")
    else:
        ckpt_path = path
    ckpt, cfg = checkpoint.load_run_checkpoint(ckpt_path)  # one line naming the file where it is not one
    cfg.train.device = device
    cfg.train.compile = False
    cfg.train.backend = "ddp"  # evaluation is one process: no horovod needed for a horovod-trained run
    if cfg.train.amp == "fp16" and not _on_cuda(device):
        # fp16 autocast (and its loss scaler) is CUDA's; a run trained so on a GPU evaluates and
        # predicts in fp32 elsewhere instead of stopping on the training-time precision check
        log.info("precision: off (the run trained with train.amp=fp16 on CUDA; %s device: fp32)", device)
        cfg.train.amp = "off"
    run = build(cfg, data_info=None if with_data else ckpt.get("data_info", {}))
    # EMA weights when trained with EMA
    checkpoint.load_model_weights(run.model, ckpt.get("eval_model", ckpt["model"]), ckpt_path, cfg.model.name)
    run.model.eval()
    return run, ckpt_path


def _on_cuda(device: str) -> bool:
    """Whether ``--device`` (``auto`` picks CUDA where present) is a CUDA device."""
    import torch

    if device == "auto":
        return torch.cuda.is_available()
    try:
        return torch.device(device).type == "cuda"
    except RuntimeError:  # not a device name: the build names it in a one-line error
        return False


def evaluate_path(path: str | Path, device: str = "auto", data: str | None = None) -> dict[str, Any]:
    """Validation metrics of a run's best (else last) checkpoint, on its validation split."""
    from fastvision.engine import evaluate, make_loader

    run, ckpt_path = _load_for(path, device, data)
    loader = make_loader(run.val_set, run.task, run.cfg, run.cfg.data.val_batch_size or run.cfg.train.batch_size,
                         False, run.device)
    metrics = evaluate(run.model, run.task, loader, run.device, run.precision, run.cfg.train.channels_last)
    return {"checkpoint": str(ckpt_path), "items": len(run.val_set), **metrics}


def _load_for(path, device: str, data: str | None):
    """The run's model with ``data`` (``evaluate --data``) in place of its training data, which is never
    read (it may have moved: that is what ``--data`` is for); the dataset's classes must be the ones
    the checkpoint was trained on, in the same order (:func:`check_same_classes`)."""
    if data is None:
        return load_run(path, device)
    from fastvision.engine import build
    from fastvision.engine.build import check_volume_channels
    from fastvision.registry import DATASETS

    run, ckpt_path = load_run(path, device, with_data=False)
    cfg = run.cfg
    cfg.data.args["path"] = data
    if other := brats_layout_of(cfg.data.name, data):  # BraTS in the other layout: read it with that reader
        keep = inspect.signature(DATASETS.get(other)).parameters
        log.info("--data %s: BraTS in the %s layout, read as data.name %s", data, other, other)
        cfg.data.name, cfg.data.args = other, {k: v for k, v in cfg.data.args.items() if k in keep}
    splits = DATASETS.build(cfg.data.name, cfg.data.args, where="data.args")
    check_same_classes(run.info, splits.info, data, ckpt_path)
    weights = run.model.state_dict()
    run = build(cfg, data_info=splits.info)
    check_volume_channels(splits.info, run.model, cfg)
    run.model.load_state_dict(weights)
    run.model.eval()
    run.train_set, run.val_set = splits.train, splits.val
    return run, ckpt_path


def brats_layout_of(name: str, data: str) -> str | None:
    """The dataset builder for ``evaluate --data`` where ``data`` is BraTS in the other layout than the run's
    (a raw challenge folder given to a run trained on MSD Task01, or the reverse), else None. Both read
    to the same classes and channel order (:mod:`fastvision.data.formats.brats`), as ``predict`` takes either."""
    from fastvision.data.formats.decathlon import looks_like_brats

    folder = Path(data)
    if name == "decathlon" and not (folder / "dataset.json").is_file() and looks_like_brats(folder):
        return "brats"
    if name == "brats" and (folder / "dataset.json").is_file() and not looks_like_brats(folder):
        return "decathlon"
    return None


def check_same_classes(trained: dict, given: dict, data: str, ckpt: str | Path) -> None:
    """One line where dataset ``data``'s class list is not the one checkpoint ``ckpt`` was trained on
    (:func:`fastvision.engine.state.classes_differ`: labels are class indices)."""
    from fastvision.engine.state import classes_differ

    where = classes_differ(trained, given)
    if where:
        raise DataError(f"--data {data}: its classes are not those {ckpt} was trained on {where}: each image "
                        "would be scored against another class; give a folder of the training classes, in order")


def expand_inputs(inputs: list[str], tree: bool = False) -> list[Path]:
    """Input paths with each folder replaced by its entries (sorted), or with ``tree`` by every image
    file under it (a task that writes one table row per file: classification); a missing one is a
    DataError."""
    files = [Path(p) for p in inputs]
    for f in files:
        if not f.exists():
            raise DataError(f"{f}: input not found")
    from fastvision.inference.inputs import folder_inputs, image_tree  # a folder without images: one line

    listing = image_tree if tree else folder_inputs
    return [p for f in files for p in (listing(f) if f.is_dir() else [f])]


def is_volume_input(files: list[Path]) -> bool:
    """NIfTI volumes or BraTS case folders (the 3-D predict), as ``SegmentationTask.predict_files`` tells them.
    A folder counts as a case when it holds a NIfTI file: one of images (a class folder of a
    validation split) goes to the 2-D predict, which takes it or names it."""
    nifti = (".nii", ".nii.gz")
    return any(f.name.endswith(nifti) or (f.is_dir() and any(q.name.endswith(nifti) for q in f.iterdir()))
               for f in files)


def predict(ckpt: str | Path, inputs: list[str], out_dir: str | Path, device: str = "auto",
            coco_ids: str = "auto") -> list[Path]:
    """Write one prediction per input file (format chosen by the task) into ``out_dir``; ``coco_ids``: where
    a detection run's ``detections.json`` takes its image ids (``DetectionTask.predict_files``)."""
    run, _ = load_run(ckpt, device, with_data=False)
    if not hasattr(run.task, "predict_files"):
        raise ConfigError(f"task {run.cfg.task.name!r} has no file prediction")
    detection = run.cfg.task.name == "detection"
    if coco_ids != "auto" and not detection:
        raise ConfigError(f"--coco-ids applies to detection runs; {ckpt} is a {run.cfg.task.name} run")
    options = {"coco_ids": coco_ids} if detection else {}
    expanded = expand_inputs(inputs, tree=getattr(run.task, "predicts_tree", False))
    from fastvision.inference.inputs import check_input_kind

    check_input_kind(expanded, run.cfg.data.name, f"{ckpt} ({run.cfg.recipe})")  # volumes to a 2-D run, or back
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.iterdir())
    try:
        with run.precision.autocast():  # the run's precision, as evaluate: train.amp=auto is bf16 / fp16 on a GPU
            return run.task.predict_files(run.model, expanded, out, run.cfg, run.device, **options)
    except DataError as e:  # a bad input part-way: say what is already written and how to go on
        written = [f for f in out.iterdir() if f not in before]
        if not written:
            if created:  # nothing of this call is left behind: not even the empty --out it made
                out.rmdir()
            raise
        raise DataError(f"{e}; {len(written)} file(s) of the inputs before it are in {out}: fix or remove that "
                        "input, then rerun with --force") from e
