"""What a train / inference benchmark reports: per-step figures (items/s, latency percentiles), the
speed-ups of one precision over another, and the report as a table, Markdown and JSON files."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fastvision.utils.files import atomic_text

LATENCY_PERCENTILES = (50, 90, 95, 99)
_BASELINES = {"fp32": (), "tf32": ("fp32",), "fp16": ("fp32", "tf32"), "bf16": ("fp32", "tf32")}


# ------------------------------------------------------------------------------ statistics
def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics.

    Same definition as ``numpy.percentile(values, q)`` (method "linear").
    """
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def step_stats(times_s: list[float], batch_size: int) -> dict[str, float]:
    """Throughput and latency figures from per-step wall times.

    Args:
        times_s: seconds per timed step.
        batch_size: items per step.

    Returns:
        ``items_per_s`` (median of per-step throughput), ``items_per_s_overall`` (items over total
        time), ``latency_mean_ms`` and ``latency_p{50,90,95,99}_ms``.
    """
    ms = [t * 1000 for t in times_s]
    out = {"items_per_s": percentile([batch_size / t for t in times_s], 50),
           "items_per_s_overall": batch_size * len(times_s) / sum(times_s),
           "latency_mean_ms": sum(ms) / len(ms)}
    out.update({f"latency_p{q}_ms": percentile(ms, q) for q in LATENCY_PERCENTILES})
    return out


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """``speedup_vs_fp32`` / ``speedup_vs_tf32``: median items/s over the baseline's, same batch size."""
    base = {(r["batch_size"], r["precision"]): r["items_per_s"] for r in rows if "items_per_s" in r}
    for r in rows:
        for ref in _BASELINES[r["precision"]]:
            if "items_per_s" in r and (r["batch_size"], ref) in base:
                r[f"speedup_vs_{ref}"] = r["items_per_s"] / base[(r["batch_size"], ref)]


# ------------------------------------------------------------------------------ reports
# items/s and ms of one statistic, the median step (the mean ms stays in the JSON): a mean beside a median
# paired two steps that are not the same where a slow step pulls the mean (items/s x ms != batch)
COLUMNS = [("batch_size", "batch", "{:d}"), ("precision", "precision", "{}"), ("items_per_s", "items/s", "{:.1f}"),
           ("latency_p50_ms", "median ms", "{:.2f}"), ("latency_p90_ms", "p90 ms", "{:.2f}"),
           ("latency_p95_ms", "p95 ms", "{:.2f}"), ("latency_p99_ms", "p99 ms", "{:.2f}"),
           ("speedup_vs_fp32", "x fp32", "{:.2f}"), ("speedup_vs_tf32", "x tf32", "{:.2f}"),
           ("peak_memory_mb", "peak MB", "{:.0f}")]


MEDIAN_NOTE = "items/s and median ms: the median step (items/s = batch / median ms, up to the median of an even count)"


def _cells(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = report["results"]
    cols = [c for c in COLUMNS if any(c[0] in r for r in rows) or c[0] in ("batch_size", "precision")]
    body = []
    for r in rows:
        if "error" in r:
            body.append([str(r["batch_size"]), r["precision"], r["error"]] + [""] * (len(cols) - 3))
        else:
            body.append([fmt.format(r[k]) if k in r else "-" for k, _, fmt in cols])
    return [title for _, title, _ in cols], body


def title(report: dict[str, Any]) -> str:
    where = report["gpu"] or f"{report['device']} ({report['cpu_threads']} threads)"
    flags = [f for f in ("compile", "channels_last", "augment") if report[f]]
    return (f"{report['recipe']} {report['mode']} on {where}, {report['steps']} steps after {report['warmup']} "
            f"warm-up" + (f", {' + '.join(flags)}" if flags else ""))


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown section: title line, table, notes."""
    head, body = _cells(report)
    lines = [f"**{title(report)}** (torch {report['torch']}, {report['date']})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    lines += ["", f"- {MEDIAN_NOTE}"] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def rich_table(report: dict[str, Any]):
    from rich.table import Table

    head, body = _cells(report)
    table = Table(title=title(report), caption=MEDIAN_NOTE)
    for i, h in enumerate(head):
        table.add_column(h, justify="left" if i == 1 else "right")
    for row in body:
        table.add_row(*row)
    return table


def write_reports(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """``<recipe>-<mode>.json`` and ``.md`` in ``out_dir`` (replacing earlier ones of that name)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{report['recipe']}-{report['mode']}"
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    atomic_text(json_path, json.dumps(report, indent=2) + "\n")  # whole, or the file before: never half
    atomic_text(md_path, markdown(report))
    return json_path, md_path
