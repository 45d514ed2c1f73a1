"""``fastvision plan RECIPE --epochs-from TARGET.json``: time to a quality target as a distribution.

``benchmark --mode target`` measures, over several seeds, how many epochs a recipe needs to reach
its target (MLPerf's convergence spread: 2-3x run to run for the 3D U-Net). The epochs to a target
are a property of the recipe, its data and its global batch, not of the hardware; the epoch time
is a property of the hardware, which ``plan`` estimates for GPUs the user does not have. The
forecast multiplies the two: each converged seed's epochs times the plan's epoch time range, so the
answer is a distribution over seeds (median, MLPerf's olympic mean, the fastest and the slowest
seed) with the estimate's low-high range inside each figure.

What it assumes, and says when it does not hold: the same data (the runs' epoch size is the plan's
dataset unless ``--data`` / ``--dataset-size`` says otherwise), the same global batch (the recipe's
LR rule keeps the epochs near the measured batch; MLPerf's ResNet-50 needs more epochs at much
larger ones), and training time only (validation, start-up and compile are not in an epoch time).
Seeds that did not reach the target are left out of the times, as MLPerf scores, and counted.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from fastvision.benchmark.target import olympic
from fastvision.errors import ConfigError


def load_report(path: str | Path) -> dict[str, Any]:
    """A ``benchmark --mode target`` JSON, checked: its seeds' rows with their epochs to the target."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--epochs-from {path}: no such file (a `fastvision benchmark RECIPE --mode target` JSON)")
    try:
        report = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--epochs-from {path}: not JSON ({e})") from None
    rows = report.get("rows") if isinstance(report, dict) else None
    if not isinstance(rows, list) or not rows or "target" not in report:
        raise ConfigError(f"--epochs-from {path}: not a `benchmark --mode target` report (no target and seed rows)")
    for r in rows:
        ok = isinstance(r, dict) and isinstance(r.get("reached"), bool)
        if ok and r["reached"]:
            ok = isinstance(r.get("epochs"), (int, float)) and not isinstance(r["epochs"], bool) and r["epochs"] > 0
        if not ok:
            raise ConfigError(f"--epochs-from {path}: a seed row without reached / epochs: {json.dumps(r)[:120]}")
    if not any(r["reached"] for r in rows):
        raise ConfigError(f"--epochs-from {path}: no seed reached {report['target']}: nothing to forecast from")
    return report


def measured_items(report: dict[str, Any]) -> int | None:
    """Items per epoch of the runs (all seeds alike), None when they did not record it."""
    items = report.get("items_per_epoch")
    return items if isinstance(items, int) and items > 0 else None


def forecast(report: dict[str, Any], source: str, epoch_s: list[float] | None, gpus: int, price: float | None,
             recipe: str, global_batch: int, items: int | None) -> tuple[dict[str, Any] | None, list[str]]:
    """The distribution of training time to ``report``'s target: each converged seed's epochs x
    ``epoch_s`` (the plan's [low, high] epoch time), summarised as the median, the olympic mean and the
    range over seeds, with GPU-hours and cost; and the notes that qualify it. No epoch time (the
    dataset size unknown): None and the note that says what to pass."""
    if epoch_s is None:
        return None, ["--epochs-from: no forecast without the epoch size: the runs did not record it (a report "
                      "from before fastvision recorded it); pass --data DIR or --dataset-size N"]
    reached = sorted(r["epochs"] for r in report["rows"] if r["reached"])
    runs = len(report["rows"])
    med, oly = statistics.median(reached), olympic(reached)[0]
    fast, slow = epoch_s

    def span(lo_epochs: float, hi_epochs: float) -> list[float]:
        return [lo_epochs * fast, hi_epochs * slow]

    out: dict[str, Any] = {
        "target": report["target"], "source": source, "seeds": runs, "reached": len(reached), "epochs": reached,
        "epochs_median": med, "epochs_olympic_mean": oly, "global_batch": report.get("global_batch"),
        "train_s": {"median": span(med, med), "olympic_mean": span(oly, oly), "range": span(reached[0], reached[-1])}}
    out["gpu_hours"] = {k: [v / 3600 * gpus for v in pair] for k, pair in out["train_s"].items()}
    if price is not None:
        out["cost"] = {k: [h * price for h in pair] for k, pair in out["gpu_hours"].items()}
    notes = []
    measured_recipe = Path(str(report.get("recipe", ""))).stem
    if measured_recipe and measured_recipe != Path(recipe).stem:
        notes.append(f"--epochs-from: epochs to {report['target']} measured on recipe {measured_recipe}, "
                     f"this plan is of {Path(recipe).stem}")
    if len(reached) < runs:
        notes.append(f"--epochs-from: {runs - len(reached)} of {runs} seeds did not reach {report['target']}; the "
                     "forecast is of the runs that do (as MLPerf scores), about "
                     f"{len(reached) / runs:.0%} of runs")
    if len(reached) < 3:
        notes.append(f"--epochs-from: {len(reached)} converged seed(s): too few for a spread (MLPerf's smallest "
                     "set is 5 runs); run more with benchmark --mode target --seeds N")
    measured_batch = report.get("global_batch")
    if measured_batch and measured_batch != global_batch:
        notes.append(f"--epochs-from: epochs measured at a global batch of {measured_batch}, this plan's is "
                     f"{global_batch}: assumed equal (the LR rule keeps them close near the measured batch; "
                     "far above it more epochs are usual)")
    elif not measured_batch:
        notes.append("--epochs-from: the runs did not record their global batch (a report from before "
                     "fastvision recorded it); assumed to be this plan's")
    m_items = measured_items(report)
    if m_items and items and abs(m_items - items) > max(measured_batch or 0, 1):
        notes.append(f"--epochs-from: the runs trained {m_items:,} items an epoch, this plan {items:,}: epochs to "
                     "the target on other data may differ")
    return out, notes
