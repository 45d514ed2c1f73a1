"""Cross-validation as one folder: ``train RECIPE --folds`` trains it, ``predict DIR`` ensembles it.

Above the engine, like ``api``::

    DIR/folds.json           recipe, num_folds, folds asked for (written before the first fold)
    DIR/fold-<k>/            an ordinary run directory (data.args.fold = k); finished when its
                             summary.json exists, resumed from checkpoints/last.pt when it does not
    DIR/crossval.json        per-case and pooled Dice / IoU of the out-of-fold predictions (each fold's
                             final checkpoint on its own validation cases, preprocessed grid), before
                             and after postprocessing: what ``fastvision cv DIR`` prints
    DIR/postprocessing.json  the largest-component steps (``--postprocess auto``: decided by the
                             cross-validation as nnU-Net v2 decides them; ``none``; ``lcc``: every target)

Folds are the data readers' own (``data.args.fold`` of ``data.args.num_folds``, the sorted, seeded
split of ``formats.decathlon.kfold_split``). ``predict DIR`` uses each fold's final checkpoint
(``last.pt``, as nnU-Net's ``checkpoint_final``), the same weights the cross-validation scored.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastvision import config, distributed
from fastvision.errors import ConfigError, DataError, FastvisionError
from fastvision.inference import postprocess
from fastvision.utils.files import atomic_text

log = logging.getLogger(__name__)

FOLDS_FILE, CROSSVAL_FILE, POSTPROCESSING_FILE = "folds.json", "crossval.json", "postprocessing.json"


def parse_folds(spec: str, num_folds: int) -> list[int]:
    """``all`` -> 0..num_folds-1; ``K`` -> [K]; ``0,2,4`` -> [0, 2, 4] (each checked against num_folds)."""
    if num_folds < 2:  # before folds.json: "all" of 0 folds trained nothing, 1 fold failed after writing it
        raise ConfigError(f"data.args.num_folds must be >= 2 for --folds, got {num_folds}")
    if spec == "all":
        return list(range(num_folds))
    try:
        folds = sorted({int(x) for x in str(spec).split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--folds {spec!r}: give all, a fold number or a list like 0,2,4") from None
    bad = [k for k in folds if not 0 <= k < num_folds]
    if not folds or bad:
        raise ConfigError(f"--folds {spec!r}: folds are 0..{num_folds - 1} (data.args.num_folds={num_folds})")
    return folds


def fold_dir(root: str | Path, k: int) -> Path:
    return Path(root) / f"fold-{k}"


def is_folds_dir(path: str | Path) -> bool:
    """A ``train --folds`` folder: it holds folds.json or fold-<k>/ folders."""
    p = Path(path)
    return p.is_dir() and ((p / FOLDS_FILE).is_file() or any(p.glob("fold-[0-9]*")))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_text(path, json.dumps(data, indent=2, default=str))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not readable JSON ({e})") from e


def _manifest(root: Path, recipe: str, cfg, folds: list[int]) -> dict[str, Any]:
    """folds.json: refuses a folder whose folds came from another recipe or split."""
    num = int(cfg.data.args.get("num_folds", 5))
    want = {"recipe": recipe, "recipe_name": cfg.recipe, "num_folds": num,
            "split_seed": int(cfg.data.args.get("split_seed", 0)),
            # the data set as `cv RUNS` compares it: reader and folder name (the folder may move, not change)
            "data": f"{cfg.data.name} {Path(str(cfg.data.args.get('path'))).name}",
            # the training length: a fold of other epochs is another trainer (nnU-Net's nnUNetTrainer_<N>epochs)
            **{k: getattr(cfg.train, k) for k in _LENGTH}}
    f = root / FOLDS_FILE
    if f.is_file():
        have = _read_json(f)
        if "epochs" not in have:  # folds.json before the training length: the folds' own saved configs say it
            have = {**have, **_trained_length(root, want)}
        for key in ("recipe_name", "num_folds", "split_seed", "data", *_LENGTH):
            if (key in have or key not in ("data", *_LENGTH)) and have.get(key) != want[key]:  # older folds.json: kept
                hint = " (a fold trained for other epochs is another trainer, as in nnU-Net)" if key in _LENGTH else ""
                raise DataError(f"{f}: folds of {key} {have.get(key)!r}, this command trains {want[key]!r}{hint}; "
                                "choose another --out")
        folds = sorted(set(have.get("folds", [])) | set(folds))
    elif root.is_dir() and any(root.iterdir()):
        raise DataError(f"{root}: exists and is not a train --folds folder (no {FOLDS_FILE}); choose another --out")
    return {**want, "folds": folds}


_LENGTH = ("epochs", "steps_per_epoch")


def _trained_length(root: Path, want: dict[str, Any]) -> dict[str, Any]:
    """The training length of the first fold (its ``config.yaml``) that differs from ``want``'s, else {}."""
    import yaml

    for cfg_file in sorted(root.glob("fold-[0-9]*/config.yaml")):
        try:
            train = (yaml.safe_load(cfg_file.read_text()) or {}).get("train", {})
            have = {k: train.get(k) for k in _LENGTH}
        except (OSError, ValueError, AttributeError, yaml.YAMLError):
            continue  # not readable: the fold's own resume names it
        if have != {k: want[k] for k in _LENGTH}:
            return have
    return {}


def _check_reader_folds(cfg) -> None:
    """The recipe's reader splits by ``fold`` (before anything is written)."""
    import inspect

    import fastvision.data.formats  # noqa: F401  (registers the readers)
    from fastvision.registry import DATASETS

    have = [n for n in DATASETS.names() if "fold" in inspect.signature(DATASETS.get(n)).parameters]
    if cfg.data.name not in have:
        raise ConfigError(f"data.name={cfg.data.name}: its reader has no folds (data.args.fold); --folds needs "
                          f"one that splits by fold ({', '.join(have)})")


def train_folds(recipe: str, out: str, spec: str, overrides: dict[str, Any] | None = None,
                extra: Sequence[dict[str, Any]] = (), postprocess_mode: str = "auto") -> dict[str, Any] | None:
    """Train the folds of ``spec`` one after another into ``out/fold-<k>``, then cross-validate.

    A finished fold (summary.json) is skipped; an interrupted one resumes from its last checkpoint
    (``--resume auto``). Every rank of a torchrun / srun job trains every fold; rank 0 then scores
    the out-of-fold predictions (:func:`cross_validate`). Returns the cross-validation (rank 0) or None.
    """
    from fastvision.api import overrides_to_dicts

    if not out:
        raise ConfigError("train --folds needs --out DIR (the folder of the folds)")
    cfg = config.load(recipe, [*overrides_to_dicts(overrides or {}), *extra])
    _check_reader_folds(cfg)
    folds = parse_folds(spec, int(cfg.data.args.get("num_folds", 5)))
    env, _ = distributed.init(cfg.train.device, timeout_s=cfg.train.dist_timeout_s, backend=cfg.train.backend)
    root = Path(out)
    new_root, new_manifest = not root.exists(), not (root / FOLDS_FILE).is_file()
    if env.is_main:
        if root.exists() and not root.is_dir():
            raise DataError(f"{root}: is a file; --out must be a folder")
        manifest = _manifest(root, recipe, cfg, folds)
        root.mkdir(parents=True, exist_ok=True)
        _write_json(root / FOLDS_FILE, manifest)
    try:
        _train_each(root, folds, recipe, overrides, extra, env)
    except FastvisionError:  # refused before any fold was made (too few cases for num_folds, ...): no folder left
        if env.is_main and new_manifest and not any(root.glob("fold-[0-9]*")):
            (root / FOLDS_FILE).unlink(missing_ok=True)
            if new_root and not any(root.iterdir()):
                root.rmdir()
        raise
    if not env.is_main:
        return None
    finished = [k for k in _read_json(root / FOLDS_FILE)["folds"] if (fold_dir(root, k) / "summary.json").is_file()]
    return cross_validate(root, finished, postprocess_mode, cfg.train.device)


def _train_each(root: Path, folds: list[int], recipe: str, overrides, extra, env) -> None:
    """Each fold not finished yet, one after another (an interrupted one resumes from its last checkpoint)."""
    from fastvision.api import run_training

    for k in folds:
        done = distributed.broadcast_object((fold_dir(root, k) / "summary.json").is_file() if env.is_main else None)
        if done:
            log.info("fold %d: finished already (%s), skipped", k, fold_dir(root, k) / "summary.json")
            continue
        log.info("fold %d of %s: training into %s", k, folds, fold_dir(root, k))
        run_training(recipe, out=str(fold_dir(root, k)), resume="auto", overrides=overrides,
                     extra=[*extra, {"data": {"args": {"fold": k}}}])


def _oof_cases(root: Path, k: int, device: str) -> tuple[Any, list[dict[str, Any]]]:
    """Fold ``k``'s final model on its validation cases: (task, [{"id", "fold", "pred", "truth"}])."""
    from fastvision.api import load_run
    from fastvision.inference.volumes import Ensemble

    run, _ = load_run(fold_dir(root, k) / "checkpoints" / "last.pt", device)
    ens = Ensemble(run.task, run.model, [], run.device, autocast=run.precision.autocast)
    out = []
    for i in range(len(run.val_set)):
        item = run.val_set[i]
        label = ens.labels(ens.probabilities(item["image"])).numpy()
        out.append({"id": str(item["id"]), "fold": k, "pred": label, "truth": item["label"].numpy().astype(np.uint8)})
    return run.task, out


def _counts(pred: np.ndarray, truth: np.ndarray, sets: list[list[int]]) -> dict[str, list[int]]:
    tp, fp, fn = [], [], []
    for s in sets:
        p, t = np.isin(pred, s), np.isin(truth, s)
        both = int(np.count_nonzero(p & t))
        tp.append(both)
        fp.append(int(np.count_nonzero(p)) - both)
        fn.append(int(np.count_nonzero(t)) - both)
    return {"tp": tp, "fp": fp, "fn": fn}


def cross_validate(root: str | Path, folds: Sequence[int], postprocess_mode: str = "auto",
                   device: str = "auto") -> dict[str, Any]:
    """Score the out-of-fold predictions of ``folds``, choose the postprocessing, write
    crossval.json and postprocessing.json into ``root``; returns crossval.json's content."""
    from fastvision.metrics.crossval import fold_table

    root = Path(root)
    if not folds:
        raise DataError(f"{root}: no finished fold to cross-validate")
    task, cases = None, []
    for k in folds:
        task, found = _oof_cases(root, k, device)
        cases += found
    named = postprocess.targets(task)
    names, sets = [n for n, _ in named], [s for _, s in named]
    pairs = [(c["pred"], c["truth"]) for c in cases]
    pp = postprocess.decide(pairs, task) if postprocess_mode == "auto" else postprocess.fixed(task, postprocess_mode)
    pp["folds"] = list(folds)
    res = fold_table([{"id": c["id"], "fold": c["fold"], **_counts(c["pred"], c["truth"], sets)} for c in cases],
                     names, task.empty)
    if pp["steps"]:
        after = [postprocess.apply(c["pred"], pp["steps"]) for c in cases]
        res["postprocessed"] = fold_table([{"id": c["id"], "fold": c["fold"], **_counts(p, c["truth"], sets)}
                                           for c, p in zip(cases, after, strict=True)], names, task.empty)
    res.update({"folds": list(folds), "postprocessing": pp, "grid": "preprocessed (data.args spacing and crop)"})
    _write_json(root / POSTPROCESSING_FILE, pp)
    _write_json(root / CROSSVAL_FILE, res)
    return res


# ----------------------------------------------------------------------------- ensembles
def _identity(ckpt: dict[str, Any]) -> dict[str, Any]:
    """What folds of one ensemble must share: recipe, network, task outputs, label set, preprocessing."""
    cfg, info = ckpt.get("config", {}), ckpt.get("data_info", {}) or {}
    task = cfg.get("task", {}).get("args", {})
    data = cfg.get("data", {}).get("args", {})
    train = cfg.get("train", {})
    return {"recipe": cfg.get("recipe"), "model": cfg.get("model"),
            "training": {k: train.get(k) for k in _LENGTH},
            "labels": {"num_classes": task.get("num_classes"), "mode": task.get("mode"), "regions": task.get("regions"),
                       "class_names": info.get("class_names")},
            "preprocessing": {**{k: data.get(k) for k in ("target_spacing", "intensity", "window", "crop_foreground")},
                              # nnU-Net's order or MONAI's, and the crop's margin: other arrays (defaults as read)
                              "resample": data.get("resample", "monai"),
                              "crop_margin": int(data.get("crop_margin", 0))}}


def fold_checkpoints(root: str | Path, spec: str | None) -> list[Path]:
    """The final checkpoints of the folds to ensemble, every one checked: present, finished, alike.

    ``spec`` None: the folds folds.json lists (else every fold-<k>/ present).

    Raises:
        DataError: one line naming the missing / unfinished fold or the fold that differs.
    """
    from fastvision.engine.checkpoint import load

    root = Path(root)
    listed = _read_json(root / FOLDS_FILE) if (root / FOLDS_FILE).is_file() else {}
    present = sorted(int(p.name.split("-", 1)[1]) for p in root.glob("fold-[0-9]*")
                     if p.name.split("-", 1)[1].isdigit())
    num = int(listed.get("num_folds", max(present, default=0) + 1))
    folds = parse_folds(spec, num) if spec else (listed.get("folds") or present)
    hint = f"fastvision train {listed.get('recipe', 'RECIPE')} --folds {{k}} --out {root}"
    paths, first = [], None
    for k in folds:
        d = fold_dir(root, k)
        if not d.is_dir():
            raise DataError(f"{d}: missing (fold {k} of {root} was never trained); train it with: {hint.format(k=k)}")
        if not (d / "summary.json").is_file():
            raise DataError(f"{d}: unfinished (no summary.json); finish it with: {hint.format(k=k)}")
        if not (d / "checkpoints" / "last.pt").is_file():  # train --folds skips a finished fold: retrain it anew
            raise DataError(f"{d / 'checkpoints' / 'last.pt'}: missing (fold {k} finished, its final weights are "
                            f"gone); move {d} away and retrain it with: {hint.format(k=k)}")
        ident = _identity(load(d / "checkpoints" / "last.pt"))
        if first is None:
            first = (d, ident)
        for key in ("recipe", "labels", "model", "preprocessing", "training"):
            if ident[key] != first[1][key]:
                what = {"recipe": "recipe", "labels": "label set", "model": "network",
                        "preprocessing": "preprocessing", "training": "training length"}[key]
                raise DataError(f"{d}: trained with another {what} than {first[0]} ({ident[key]} vs "
                                f"{first[1][key]}): the folds of one ensemble need one recipe, label set and "
                                "training length")
        paths.append(d / "checkpoints" / "last.pt")
    return paths


def _postprocess_steps(mode: str, task, pp_file: Path) -> list[list[int]]:
    """``auto``: the folder's postprocessing.json (none without one); ``none``; ``lcc``: every target."""
    if mode == "auto":
        steps = postprocess.load_steps(pp_file) if pp_file.is_file() else []
        if not steps:  # nothing to check (a run of another task, which the input checks name, included)
            return []
        labels = sorted({c for _, ids in postprocess.targets(task) for c in ids})
        bad = next((s for s in steps if not s or not set(s) <= set(labels)), None)
        if bad is not None:  # another run's file (more classes), or edited: it would keep nothing or do nothing
            raise DataError(f"{pp_file}: step {bad} is not a set of this model's labels ({', '.join(map(str, labels))})"
                            "; rerun the cross-validation, or predict with --postprocess none")
        return steps
    return postprocess.fixed(task, mode)["steps"]


def _tta_axes(tta: bool | str, cfg) -> list[int]:
    """Mirroring axes: none, the recipe's flip axes (True), or the ones given (``"0,1,2"``)."""
    from fastvision.inference.volumes import tta_axes

    if not tta:
        return []
    if tta is True:
        return tta_axes(cfg, 3)
    try:
        axes = sorted({int(a) for a in str(tta).split(",") if a.strip()})
    except ValueError:
        axes = [-1]
    if not axes or any(not 0 <= a < 3 for a in axes):
        raise ConfigError(f"--tta-axes {tta!r}: spatial axes 0, 1, 2, e.g. 0,1,2")
    return axes


def _models(path: Path, folds: str | None, device: str) -> tuple[Any, list[Path], list[Any], Path]:
    """(the run of the first model, checkpoint files, the folds' weights or [] for one model, the
    postprocessing.json that ``--postprocess auto`` reads) of a folds folder, a run or a checkpoint."""
    from fastvision.api import load_run
    from fastvision.engine.checkpoint import load

    if is_folds_dir(path):
        ckpts = fold_checkpoints(path, folds)
        run, _ = load_run(ckpts[0], device, with_data=False)
        return run, ckpts, [(lambda c: c.get("eval_model", c["model"]))(load(p)) for p in ckpts], \
            path / POSTPROCESSING_FILE
    if folds:
        raise ConfigError(f"--folds: {path} is not a train --folds folder (no folds.json or fold-<k>/)")
    run, ckpt = load_run(path, device, with_data=False)
    return run, [ckpt], [], (path if path.is_dir() else ckpt.resolve().parent.parent) / POSTPROCESSING_FILE


def predict_volumes(model: str | Path, inputs: Sequence[str], out: str | Path, *, folds: str | None = None,
                    tta: bool | str = False, postprocess_mode: str = "auto", device: str = "auto",
                    force: bool = False) -> dict[str, Any]:
    """``fastvision predict`` on NIfTI volumes: a run, a checkpoint, or the ensemble of a folds folder.

    Everything is checked before ``out`` is touched (folds present, finished and alike; every
    input's channels); then this rank's share of the cases is predicted
    (:func:`fastvision.inference.nifti.predict_cases`). Rank and world size come from the launch
    environment (torchrun / srun / single).

    ``tta``: False, True (the recipe's flip axes) or axes as text (``"0,1,2"``).

    Returns:
        ``{"written": [paths], "skipped": n, "mine": n, "cases": n, "rank": r, "world": w}``.
    """
    from fastvision.api import expand_inputs
    from fastvision.inference.inputs import check_input_kind
    from fastvision.inference.nifti import predict_cases, prediction_cases
    from fastvision.inference.volumes import (
        Ensemble,
        check_cases,
        check_not_inputs,
        input_channels,
        prepare_output,
        remove_if_empty,
        shard,
    )

    path, env = Path(model), distributed.detect_env()
    run, ckpts, states, pp_file = _models(path, folds, device)
    axes = _tta_axes(tta, run.cfg)
    if tta and not axes:
        log.warning("--tta: %s trains without flips (data.augment.flip), so nothing is mirrored", run.cfg.recipe)
    steps = _postprocess_steps(postprocess_mode, run.task, pp_file)
    files = expand_inputs(list(inputs))
    check_input_kind(files, run.cfg.data.name, f"{path} ({run.cfg.recipe})", is_folds_dir(path))  # 2-D: not BraTS
    cases = prediction_cases(files, getattr(run.task, "channel_files", None), input_channels(run.model))
    check_cases(cases, input_channels(run.model))
    check_not_inputs(cases, Path(out))
    manifest = {"model": str(path.resolve()), "tta_axes": axes, "postprocess": steps,
                "checkpoints": [{"path": str(p.resolve()), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
                                for p in ckpts]}
    out = Path(out)
    fresh = not out.exists()
    prepare_output(out, manifest, force)
    ens = Ensemble(run.task, run.model, states, run.device, tta_axes=axes, autocast=run.precision.autocast)
    try:
        written, skipped = predict_cases(ens, run.cfg, cases, out, steps=steps, force=force, rank=env.rank,
                                         world=env.world_size)
    except FastvisionError:  # an input refused when read (NaN, truncated): a folder it made holds no case
        if fresh and env.world_size == 1:
            remove_if_empty(out)
        raise
    return {"written": written, "skipped": skipped, "mine": len(shard(cases, env.rank, env.world_size)),
            "cases": len(cases), "rank": env.rank, "world": env.world_size}
