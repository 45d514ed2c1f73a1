"""The scaling study's report: ``scaling.csv``, ``scaling.json``, ``scaling.md``, ``scaling.png``.

Repeats of one world size (different seeds) are summarised as mean and sample standard deviation
of throughput, speed-up and the final metric. Figures: speed-up with the ideal line and the metric
against workers on a second axis (as seed 001's figure), parallel efficiency, error bars of one std.
"""
from __future__ import annotations

import csv
import io
import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastvision.utils.tables import markdown

FIELDS = ["backend", "mode", "workers", "repeats", "seeds", "global_batch", "time_per_epoch_s", "images_per_s",
          "images_per_s_std", "speedup", "speedup_std", "efficiency", "metric_name", "metric", "metric_std",
          "predicted_speedup"]


def _mean_std(vals: list[float]) -> tuple[float | None, float | None]:
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def summarize(results: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and standard deviation over repeats per ``(backend, workers)``, plus speed-up and efficiency.

    Args:
        results: one dict per run with ``workers`` and ``images_per_s`` (required), and optionally
            ``backend`` (default "ddp"), ``mode``, ``seed``, ``global_batch``, ``time_per_epoch_s``,
            ``metric_name``, ``metric``, ``predicted_speedup``.

    Returns:
        Rows sorted by backend then workers, with the keys of :data:`FIELDS`. The speed-up is seed 001's:
        the mean epoch time (``time_per_epoch_s``) of the same backend's smallest worker count over this
        row's, scaled by that count (a sweep starting at 2 workers still reads as "x vs one worker" under
        linear scaling there); where a backend's runs lack epoch times, the mean throughput's ratio. The two
        differ where the world sizes' epochs hold different numbers of items (each drops its partial global
        batch): images/s is then the throughput. ``speedup_std`` propagates both runs' relative spreads to
        first order (independent runs); ``*_std`` is ``None`` with a single repeat.
    """
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in results:
        if "workers" not in r or "images_per_s" not in r:
            raise ValueError(f"result needs 'workers' and 'images_per_s': {r}")
        groups.setdefault((r.get("backend", "ddp"), int(r["workers"])), []).append(r)
    rows = []
    for (backend, n), runs in sorted(groups.items()):
        seeds = [str(r["seed"]) for r in runs if r.get("seed") is not None]
        row = {"backend": backend, "mode": runs[0].get("mode", "weak"), "workers": n, "repeats": len(runs),
               "seeds": " ".join(seeds), "metric_name": runs[0].get("metric_name", "")}
        for key in ("global_batch", "time_per_epoch_s", "images_per_s", "metric", "predicted_speedup"):
            vals = [float(r[key]) for r in runs if r.get(key) is not None]
            mean, std = _mean_std(vals)
            row[key], row[f"{key}_std"] = mean, std
            if key == "time_per_epoch_s" and len(vals) < len(runs):
                row[key] = None  # a run without it: the speed-up falls back to throughput
        rows.append(row)
    for backend in {r["backend"] for r in rows}:
        mine = [r for r in rows if r["backend"] == backend]
        ref = min(mine, key=lambda r: r["workers"])
        timed = all(r["time_per_epoch_s"] is not None for r in mine)
        key = "time_per_epoch_s" if timed else "images_per_s"
        ref_rel = (ref[f"{key}_std"] or 0.0) / ref[key]
        for r in mine:
            ratio = ref[key] / r[key] if timed else r[key] / ref[key]  # seed 001: epoch time at 1 over at N
            r["speedup"] = ratio * ref["workers"]
            r["efficiency"] = r["speedup"] / r["workers"]
            rel = (r[f"{key}_std"] or 0.0) / r[key]
            if r[f"{key}_std"] is None and ref[f"{key}_std"] is None:
                r["speedup_std"] = None
            else:
                r["speedup_std"] = r["speedup"] * (rel if r is ref else math.hypot(rel, ref_rel))
    return [{k: r.get(k) for k in FIELDS} for r in rows]


# A measured efficiency above this is not a scaling result but timing noise (a loaded machine, one timed epoch).
IMPLAUSIBLE_EFFICIENCY = 1.10


def implausible(rows: list[dict[str, Any]]) -> str:
    """One line naming the rows whose efficiency is above :data:`IMPLAUSIBLE_EFFICIENCY`, or ``""``."""
    bad = [f"{r['backend']} x{r['workers']} ({r['efficiency']:.0%})" for r in rows
           if r.get("efficiency") is not None and r["efficiency"] > IMPLAUSIBLE_EFFICIENCY]
    if not bad:
        return ""
    return (f"implausible efficiency above {IMPLAUSIBLE_EFFICIENCY:.0%}: {', '.join(bad)}; the timing is noisy: "
            "rerun with more --epochs or --repeats (on an otherwise idle machine)")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`summarize` rows (``mean ± std`` where there are repeats); an efficiency above
    :data:`IMPLAUSIBLE_EFFICIENCY` is marked ``(noisy)`` and explained below the table."""
    note = implausible(rows)
    return _table(rows) + (f"\n**{note}**\n" if note else "")


def _eff(r: dict[str, Any]) -> str:
    noisy = r["efficiency"] is not None and r["efficiency"] > IMPLAUSIBLE_EFFICIENCY
    return _fmt(r["efficiency"], "{:.1%}") + (" (noisy)" if noisy else "")


def _table(rows: list[dict[str, Any]]) -> str:
    metric = next((r["metric_name"] for r in rows if r.get("metric_name")), "metric")
    columns = ["backend", "workers:", "runs (seeds)", "global batch:", "epoch (s):", "images/s:", "speed-up:",
               "efficiency:", f"{metric}:", "predicted:"]
    return markdown(columns, ([r["backend"], str(r["workers"]),
                               f"{r['repeats']}" + (f" ({r['seeds']})" if r.get("seeds") else ""),
                               _fmt(r["global_batch"], "{:.0f}"), _fmt(r["time_per_epoch_s"], "{:.2f}"),
                               _pm(r["images_per_s"], r["images_per_s_std"], "{:.1f}"),
                               _pm(r["speedup"], r["speedup_std"], "{:.2f}"), _eff(r),
                               _pm(r["metric"], r["metric_std"], "{:.4f}"), _fmt(r["predicted_speedup"], "{:.2f}")]
                              for r in rows))


def write_report(results: Iterable[dict[str, Any]], out_dir: Path, title: str = "Scaling") -> dict[str, Path]:
    """Write ``scaling.csv``, ``scaling.json``, ``scaling.md`` and ``scaling.png`` into ``out_dir``.

    Args:
        results: per-run dicts as accepted by :func:`summarize` (repeats allowed).
        out_dir: output folder (created).
        title: figure and Markdown title.

    Returns:
        Paths by kind: ``csv``, ``json``, ``md``, ``png``.
    """
    results = list(results)
    rows = summarize(results)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: out_dir / f"scaling.{k}" for k in ("csv", "json", "md", "png")}
    table = io.StringIO(newline="")
    w = csv.DictWriter(table, fieldnames=FIELDS)
    w.writeheader()
    w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    write_text(paths["csv"], table.getvalue())
    write_text(paths["json"], json.dumps({"title": title, "rows": rows, "runs": results}, indent=2))
    write_text(paths["md"], f"## {title}\n\n" + markdown_table(rows))
    plot_sweep(rows, paths["png"], title)
    return paths


def write_text(path: Path, text: str) -> Path:
    """``path`` holding ``text``, written atomically (a stopped or failed write leaves the file before)."""
    from fastvision.utils.files import atomic_write

    data = text.encode()
    atomic_write(Path(path), lambda f: f.write(data))
    return Path(path)


def plot_sweep(rows: list[dict[str, Any]], path: Path, title: str = "Scaling") -> Path:
    """:func:`sweep_figure` of ``rows`` saved as ``path`` (atomically)."""
    return save(sweep_figure(rows, title), path)


def sweep_figure(rows: list[dict[str, Any]], title: str = "Scaling"):
    """Left: speed-up per backend with the ideal line, the metric on a second axis. Right: efficiency, its
    axis up to 110 % or past the highest point.

    Error bars are one standard deviation over the repeats (none with a single run).
    """
    plt = _pyplot()
    fig, (ax, ax_eff) = plt.subplots(1, 2, figsize=(10, 4))
    ns = sorted({r["workers"] for r in rows})
    ax.plot(ns, ns, "k--", lw=1, label="ideal")
    ax_metric = ax.twinx()
    metric = next((r["metric_name"] for r in rows if r.get("metric_name")), "metric")
    for i, backend in enumerate(sorted({r["backend"] for r in rows})):
        mine = [r for r in rows if r["backend"] == backend]
        color = f"C{i}"
        x = [r["workers"] for r in mine]
        ax.errorbar(x, [r["speedup"] for r in mine], yerr=[r["speedup_std"] or 0.0 for r in mine], fmt="o-",
                    color=color, capsize=3, label=f"{backend} speed-up")
        pred = [(r["workers"], r["predicted_speedup"]) for r in mine if r["predicted_speedup"] is not None]
        if pred:
            ax.plot(*zip(*pred, strict=True), "x:", color=color, label=f"{backend} predicted")
        met = [(r["workers"], r["metric"], r["metric_std"] or 0.0) for r in mine if r["metric"] is not None]
        if met:
            mx, my, ms = zip(*met, strict=True)
            ax_metric.errorbar(mx, my, yerr=ms, fmt="s--", color=color, alpha=0.6, capsize=3,
                               label=f"{backend} {metric}")
        ax_eff.plot(x, [r["efficiency"] for r in mine], "o-", color=color, label=backend)
    ax.set(xlabel="workers", ylabel="speed-up", title=title, xticks=ns)
    ax_metric.set_ylabel(metric)
    handles = ax.get_legend_handles_labels()
    more = ax_metric.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8, loc="upper left")
    ax_eff.axhline(1.0, color="k", ls="--", lw=1)
    # up to 110 %, or past the highest point (a noisy run's 347 % was drawn off the axes)
    top = max([1.1, *(1.05 * r["efficiency"] for r in rows if r.get("efficiency") is not None)])
    ax_eff.set(xlabel="workers", ylabel="parallel efficiency", title="Efficiency", xticks=ns, ylim=(0, top))
    ax_eff.legend(fontsize=8)
    for a in (ax, ax_eff):
        a.grid(True, alpha=0.3)
    return fig


def plot_simulation(rows: list[dict[str, Any]], path: Path, measured: list[dict[str, Any]] = (),
                    published: list[dict[str, Any]] = ()) -> Path:
    """Speed-up against GPUs (log-log) per hardware profile with the ideal line; measured points and
    published rows (``workers``, ``speedup``, ``label``) overlaid."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.5 if published else 6, 4.5))  # published rows: the legend goes beside
    links = sorted({r["link"] for r in rows}, key=[r["link"] for r in rows].index)
    top = max(r["workers"] for r in rows)
    ax.plot([1, top], [1, top], "k--", lw=1, label="ideal")
    for name in links:
        pts = [r for r in rows if r["link"] == name]
        ax.plot([r["workers"] for r in pts], [r["speedup"] for r in pts], marker=".", label=f"predicted: {name}")
    if measured:
        ax.plot([r["workers"] for r in measured], [r["speedup"] for r in measured], "ko", label="measured")
    colours = plt.get_cmap("tab20").colors  # the curves take C0, C1, ...: the points start past them
    for i, r in enumerate(published):  # filled: published; hollow: the model at that row's own batch
        c = colours[(2 * len(links) + 2 * i + (i // 10)) % 20]
        ax.plot([r["workers"]], [r["speedup"]], "s", color=c, ms=6, label=f"published: {r['label']}")
        if r.get("predicted") is not None:
            ax.plot([r["workers"]], [r["predicted"]], "o", color=c, mfc="none", ms=8)
    if any(r.get("predicted") is not None for r in published):
        ax.plot([], [], "o", color="grey", mfc="none", ms=8, label="hollow: the model at that row's own batch")
    ax.set(xscale="log", yscale="log", xlabel="workers (GPUs)", ylabel="speed-up",
           title="Predicted data-parallel speed-up")
    if published:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    else:
        ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    return save(fig, path)


def _fmt(value: Any, spec: str) -> str:
    return "" if value is None else spec.format(value)


def _pm(value: Any, std: Any, spec: str) -> str:
    """``mean ± std`` (just the mean with one run)."""
    return _fmt(value, spec) + ("" if std is None or value is None else " ± " + spec.format(std))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window (headless nodes)
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    """Save ``fig`` as ``path`` (folders created), atomically, and close it."""
    from fastvision.utils.files import save_figure

    try:
        fig.tight_layout()
        return save_figure(fig, Path(path), dpi=120)
    finally:
        _pyplot().close(fig)


def simulation_markdown(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`simulate` rows, with the binding limit per GPU count."""
    columns = ["hardware", "GPUs:", "step (ms):", "exposed comm (ms):", "all-reduce", "images/s:", "speed-up:",
               "efficiency:", "binding limit"]
    return markdown(columns, ([r["link"], str(r["workers"]), f"{r['step_s'] * 1e3:.2f}",
                               f"{r['exposed_comm_s'] * 1e3:.2f}", r.get("algo", ""), f"{r['images_per_s']:.1f}",
                               f"{r['speedup']:.2f}", f"{r['efficiency']:.1%}", r.get("limit", "")] for r in rows))
