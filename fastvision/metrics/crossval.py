"""``fastvision cv RUNS...``: average the final metrics of k cross-validation folds; ``fastvision cv
DIR`` on a ``train --folds`` folder: the per-case and pooled table of its out-of-fold predictions.

Seed 000 trains folds 0-4 (``--fold k --num_folds 5``) and ``runtime/parse_results.py`` averages the
final evaluation of the fold logs. Here each run directory's ``metrics.jsonl`` (DLLogger-style
events written by ``log.py``) is read: the run summary (the event with ``step == []``) or, for a run
that stopped early, its last epoch event. Every numeric metric present in all runs is averaged;
the population std across folds is reported next to it.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastvision.errors import DataError

log = logging.getLogger(__name__)

# Bookkeeping values in a summary that are not fold metrics.
_SKIP = {"epoch", "epochs", "target_reached", "target_epoch"}


def read_run(run: str | Path) -> tuple[dict[str, float], int | None, dict[str, Any]]:
    """Final numeric metrics of one run, its fold (from the saved config) if recorded, and what it
    trained.

    Args:
        run: a run directory or its ``metrics.jsonl``.

    Returns:
        (metrics, fold or None, ``{"recipe", "data"}``: the recipe and its dataset and folder name; empty
        where ``metrics.jsonl`` has no config event).
    """
    path = Path(run)
    if path.is_dir() and not (path / "metrics.jsonl").is_file() and list(path.glob("fold-[0-9]*/metrics.jsonl")):
        raise DataError(f"{path}: a train --folds folder, not one fold's run: give it alone (fastvision cv {path}) "
                        f"or its runs ({path / 'fold-*'})")
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise DataError(f"{path}: not a run directory with metrics.jsonl")
    summary, last_epoch, cfg = None, None, None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip().removeprefix("DLLL ")
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not JSON ({e})") from e
        step, data = rec.get("step"), rec.get("data", {})
        if step == "PARAMETER":
            cfg = data.get("config", {})
        elif step == []:
            summary = data
        elif isinstance(step, list) and len(step) == 1:
            last_epoch = data
    final = summary if summary is not None else last_epoch
    if final is None:
        raise DataError(f"{path}: no epoch or summary events (did the run finish an epoch?)")
    metrics = {k: float(v) for k, v in final.items()
               if k not in _SKIP and isinstance(v, (int, float)) and not isinstance(v, bool)}
    data_cfg = (cfg or {}).get("data") or {}
    args = data_cfg.get("args") or {}
    trained = {} if cfg is None else {"recipe": cfg.get("recipe"), "data": f"{data_cfg.get('name')} "
                                      f"{Path(str(args.get('path'))).name}"}
    return metrics, args.get("fold"), trained


def _check_same_training(runs: Sequence[str | Path], trained: Sequence[dict[str, Any]]) -> None:
    """Refuse to average runs that trained different recipes or data (not folds of one cross-validation)."""
    known = [(r, t) for r, t in zip(runs, trained, strict=True) if t]
    for key in ("recipe", "data"):
        for run, t in known[1:]:
            if t[key] != known[0][1][key]:
                raise DataError(f"cv: {known[0][0]} and {run} are not folds of one cross-validation: {key} "
                                f"{known[0][1][key]!r} vs {t[key]!r}")


def cross_validate(runs: Sequence[str | Path], metrics: Sequence[str] | None = None) -> dict[str, Any]:
    """Average fold metrics.

    Args:
        runs: run directories (or metrics.jsonl files), one per fold, of one recipe on one data set.
        metrics: names to report; default all numeric metrics common to every run.

    Returns:
        ``{"folds": [fold or None per run], "runs": [...], "mean": {name: v}, "std": {name: v},
        "per_run": {name: [v, ...]}}``; std is None for one run (undefined).

    Raises:
        DataError: no runs, a run unreadable, runs of different recipes or data, a metric not in every run.
    """
    if not runs:
        raise DataError("cv needs at least one run directory")
    read = [read_run(r) for r in runs]
    _check_same_training(runs, [t for _, _, t in read])
    results = [(m, f) for m, f, _ in read]
    folds = [f for _, f in results]
    known = [f for f in folds if f is not None]
    if len(set(known)) != len(known):
        log.warning("runs repeat a fold (%s): the average is not a cross-validation", folds)
    if len(runs) < 2:
        log.warning("cv: one run only: no spread across folds (std left out)")
    common = set.intersection(*(set(m) for m, _ in results))
    names = list(metrics) if metrics else sorted(common)
    missing = [m for m in names if m not in common]
    if missing:
        raise DataError(f"metric(s) {', '.join(missing)} not in every run; common: {', '.join(sorted(common))}")
    per_run = {k: [m[k] for m, _ in results] for k in names}
    mean = {k: sum(v) / len(v) for k, v in per_run.items()}
    std = {k: math.sqrt(sum((x - mean[k]) ** 2 for x in v) / len(v)) if len(v) > 1 else None
           for k, v in per_run.items()}
    return {"runs": [str(r) for r in runs], "folds": folds, "mean": mean, "std": std, "per_run": per_run}


def fold_table(cases: Sequence[dict[str, Any]], names: Sequence[str], empty: str = "ignore") -> dict[str, Any]:
    """Per-case and pooled Dice / IoU of out-of-fold predictions.

    Args:
        cases: ``{"id", "fold", "tp", "fp", "fn"}`` per case, the counts per target (class or region)
            as sequences of ints, in ``names`` order.
        names: the targets' names.
        empty: the task's rule for a case whose truth lacks a target (``metrics.cases.case_scores``).

    Returns:
        ``{"cases": [{"id", "fold", "dice": {name: v}, "iou": {...}, "mean_dice"}], "mean": {"dice":
        {name: v}, "iou": {...}}, "dice", "iou"`` (mean over cases of each case's mean over targets,
        as MONAI's DiceMetric), ``"pooled": {"dice": {name: v}, "iou": {...}}, "dice_pooled",
        "iou_pooled"}``; None where a value is undefined.
    """
    import torch

    from fastvision.metrics.cases import case_scores

    def num(v: float) -> float | None:
        return None if math.isnan(v) else float(v)

    n = len(names)
    counts = [torch.tensor([[int(x) for x in c[k]] for c in cases] or [[0] * n], dtype=torch.int64)
              for k in ("tp", "fp", "fn")]
    out: dict[str, Any] = {"targets": list(names), "cases": [], "mean": {}, "pooled": {}}
    for metric in ("dice", "iou"):
        scores = case_scores(*counts, metric, empty)[: len(cases)]  # (N, T), NaN: left out
        out["mean"][metric] = {k: num(torch.nanmean(scores[:, j]).item()) for j, k in enumerate(names)}
        per_case = torch.nanmean(scores, 1)
        out[metric] = num(torch.nanmean(per_case).item()) if len(cases) else None
        tp, fp, fn = (c.sum(0).double() for c in counts)
        den = (2 * tp + fp + fn) if metric == "dice" else (tp + fp + fn)
        pooled = torch.where(den > 0, (2 * tp if metric == "dice" else tp) / den.clamp(min=1), torch.nan)
        out["pooled"][metric] = {k: num(pooled[j].item()) for j, k in enumerate(names)}
        out[f"{metric}_pooled"] = num(torch.nanmean(pooled).item())
        for i, c in enumerate(cases):
            if metric == "dice":
                out["cases"].append({"id": c["id"], "fold": c["fold"], "dice": {}, "iou": {}})
            row = out["cases"][i]
            row[metric] = {k: num(scores[i, j].item()) for j, k in enumerate(names)}
            row[f"mean_{metric}"] = num(per_case[i].item())
    return out


_TABLE_KEYS = ("targets", "cases", "mean", "pooled", "dice", "dice_pooled")


def read_fold_table(path: Path) -> dict[str, Any]:
    """A ``crossval.json`` as :func:`fold_table` wrote it; a one-line DataError naming the file when it is not."""
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not JSON ({e})") from e
    tables = [res, *([res["postprocessed"]] if res.get("postprocessed") else [])] if isinstance(res, dict) else [res]
    for tab in tables:
        missing = [k for k in _TABLE_KEYS if k not in tab] if isinstance(tab, dict) else list(_TABLE_KEYS)
        bad = not missing and not all(isinstance(c, dict) and {"fold", "id", "dice", "mean_dice"} <= set(c)
                                      for c in tab["cases"])
        if missing or bad:
            what = f"no {', '.join(missing)}" if missing else "a case row without fold, id, dice or mean_dice"
            raise DataError(f"{path}: not a train --folds cross-validation table ({what}); rerun it with: "
                            f"fastvision train RECIPE --folds ... --out {path.parent}")
    return res


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def print_fold_table(res: dict[str, Any], title: str = "") -> None:
    """The table of :func:`fold_table` (and, when present, after postprocessing): one row per case,
    then the mean over cases and the pooled figures."""
    from rich.console import Console
    from rich.table import Table

    names, console = res["targets"], Console()
    for label, tab in (("", res), (" after postprocessing", res.get("postprocessed"))):
        if not tab:
            continue
        console.print(f"{title or 'out-of-fold predictions'}{label}:", soft_wrap=True)
        table = Table(title="Dice per case")
        for col in ("fold", "case", *names, "mean"):
            table.add_column(col, justify="left" if col == "case" else "right")
        for c in tab["cases"]:
            table.add_row(str(c["fold"]), c["id"], *(_fmt(c["dice"][k]) for k in names), _fmt(c["mean_dice"]))
        table.add_row("", "mean over cases", *(_fmt(tab["mean"]["dice"][k]) for k in names), _fmt(tab["dice"]))
        table.add_row("", "pooled", *(_fmt(tab["pooled"]["dice"][k]) for k in names), _fmt(tab["dice_pooled"]))
        console.print(table)
    if "postprocessing" in res:
        steps = res["postprocessing"].get("steps", [])
        console.print(f"postprocessing: {'largest component of ' + '; '.join(map(str, steps)) if steps else 'none'} "
                        f"({res['postprocessing'].get('rule', '')})", soft_wrap=True)


def _main(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from fastvision.api import refuse_overwrite

    if args.json:  # checked before reading: nothing is lost
        refuse_overwrite(args.json, args.force, "--json", file=True)
    if len(args.runs) == 1 and (Path(args.runs[0]) / "crossval.json").is_file():  # a train --folds folder
        f = Path(args.runs[0]) / "crossval.json"
        if args.metrics:  # the table has Dice per case, not the runs' metrics: said, not ignored
            raise DataError(f"--metrics: {args.runs[0]} is a train --folds folder, whose out-of-fold table this "
                            f"prints; average its folds' metrics with: fastvision cv {Path(args.runs[0]) / 'fold-*'} "
                            "--metrics ...")
        res = read_fold_table(f)
        print_fold_table(res, f"{args.runs[0]}: out-of-fold predictions, folds {res.get('folds')}")
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
        return 0
    if len(args.runs) == 1 and list(Path(args.runs[0]).glob("fold-[0-9]*/metrics.jsonl")):
        # a train --folds folder before its cross-validation step: the folds' final metrics
        args.runs = [str(p.parent) for p in sorted(Path(args.runs[0]).glob("fold-[0-9]*/metrics.jsonl"))]
    res = cross_validate(args.runs, args.metrics)
    table = Table(title=f"cross-validation over {len(args.runs)} runs (folds {res['folds']})")
    table.add_column("metric")
    table.add_column("mean", justify="right")
    table.add_column("std", justify="right")
    table.add_column("per run", justify="left")
    for k in res["mean"]:
        table.add_row(k, f"{res['mean'][k]:.4f}", _fmt(res["std"][k]),
                      " ".join(f"{v:.4f}" for v in res["per_run"][k]))
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


def add_cli(subparsers) -> None:
    """Register ``fastvision cv RUNS... [--metrics M ...] [--json OUT]``."""
    p = subparsers.add_parser("cv", help="average the final metrics of cross-validation folds (seed 000), or the "
                                         "out-of-fold table of a train --folds folder")
    p.add_argument("runs", nargs="+",
                   help="run directories, one per fold; or one train --folds folder (its crossval.json)")
    p.add_argument("--metrics", nargs="+", help="metrics to report (default: all common numeric metrics)")
    p.add_argument("--json", help="also write the result as JSON to this file (a new file unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --json file")
    p.set_defaults(func=_main)
