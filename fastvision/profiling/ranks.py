"""The per-rank half of ``fastvision profile`` under data parallelism: each rank's phase medians,
gathered in one collective, and the rank that holds the job back with the phase that makes it slow.

Under DDP every rank's wall-clock step is about as long as every other's: the forward's buffer
broadcast and the backward's gradient all-reduce make the fast ranks wait for the slowest. A rank's
own *work* (data wait + compute: its step without the time it waited in those collectives, which
the profiler books as communication) is what differs, so the slow rank is the one with the most work
per step, compared with the median of the other ranks (with two ranks: the other one). Its phase
with the largest excess over the other ranks' median names the cause; the other ranks show the same
difference as communication, waiting for it.

``FASTVISION_PROFILE_SLOW_RANK=R:SECONDS`` (a check of this report, used by the tests; never set by
fastvision) makes rank ``R`` wait ``SECONDS`` longer for each batch, a slow input pipeline on one rank
whose cost is known, so the table can be seen to name it.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from fastvision.errors import ConfigError

COMPUTE_PHASES = ("h2d", "augment", "forward", "backward", "optimizer")
WORK_PHASES = ("data", *COMPUTE_PHASES)
SLOW_RATIO = 1.1  # the slowest rank's work over the others' median below this: no rank stands out
SLOW_ENV = "FASTVISION_PROFILE_SLOW_RANK"
CAUSES = {"data": "its input pipeline (loading and per-item transforms on that rank's host)",
          "h2d": "its host-to-device copies", "augment": "its batched augmentation",
          "forward": "its compute (forward)", "backward": "its compute (backward)",
          "optimizer": "its optimizer step"}
LABELS = {"data": "data wait", "h2d": "host-to-device", "augment": "augment", "forward": "forward",
          "backward": "backward", "optimizer": "optimizer"}


def rank_row(rank: int, per: Mapping[str, list[float]], walls: list[float]) -> dict[str, Any]:
    """One rank's medians over the profiled steps.

    Args:
        rank: this process's rank.
        per: seconds per step of each phase (``data``, the compute phases, ``comm``), one value per step.
        walls: wall-clock seconds of each step.

    Returns:
        ``{"rank", "step_ms", "work_ms", "compute_ms", "comm_ms", "data_share", "phases_ms": {phase: ms}}``:
        p50s in milliseconds; ``work`` is data wait + compute per step, ``data_share`` the data wait's p50 over
        the step's.
    """
    def p50(values) -> float:
        return float(np.median(np.asarray(values, dtype=np.float64))) * 1e3 if len(values) else 0.0

    compute = [sum(v) for v in zip(*(per[p] for p in COMPUTE_PHASES), strict=True)]
    work = [d + c for d, c in zip(per["data"], compute, strict=True)]
    step = p50(walls)
    return {"rank": rank, "step_ms": step, "work_ms": p50(work), "compute_ms": p50(compute),
            "comm_ms": p50(per["comm"]), "data_share": p50(per["data"]) / step if step > 0 else 0.0,
            "phases_ms": {p: p50(per[p]) for p in WORK_PHASES}}


def slowest(rows: list[dict[str, Any]], ratio: float = SLOW_RATIO) -> dict[str, Any] | None:
    """The rank with the most work per step, how much more than the other ranks' median, and its phase
    with the largest excess over the other ranks' median of that phase; None for fewer than two ranks.

    Returns:
        ``{"rank", "ratio", "stands_out", "phase", "excess_ms", "share", "others_share", "line"}``:
        ``share`` is that phase's p50 over the rank's step p50, ``others_share`` the other ranks' median of
        theirs, ``stands_out`` whether ``ratio`` reaches the threshold, ``line`` the sentence the report prints.
    """
    if len(rows) < 2:
        return None
    slow = max(rows, key=lambda r: r["work_ms"])  # the first of equals
    others = [r for r in rows if r is not slow]
    ref = float(np.median([r["work_ms"] for r in others]))
    excess = {p: slow["phases_ms"][p] - float(np.median([r["phases_ms"][p] for r in others])) for p in WORK_PHASES}
    phase = max(WORK_PHASES, key=lambda p: excess[p])

    def share(r: dict[str, Any]) -> float:
        return r["phases_ms"][phase] / r["step_ms"] if r["step_ms"] > 0 else 0.0

    times = slow["work_ms"] / ref if ref > 0 else float("inf")
    out = {"rank": slow["rank"], "ratio": times, "stands_out": times >= ratio, "phase": phase,
           "excess_ms": excess[phase], "share": share(slow),
           "others_share": float(np.median([share(r) for r in others]))}
    return {**out, "line": _line(out)}


def _line(s: dict[str, Any]) -> str:
    """``rank 1 is 1.80x the median rank's work per step (...): data wait 62 % of its step (others 3 %): ...``."""
    what = (f"{LABELS[s['phase']]} {100 * s['share']:.0f} % of its step (others {100 * s['others_share']:.0f} %)")
    if not s["stands_out"]:
        return (f"no rank stands out: the slowest, rank {s['rank']}, does {s['ratio']:.2f}x the median rank's work "
                f"per step (largest difference: {what})")
    return (f"rank {s['rank']} is {s['ratio']:.2f}x the median rank's work per step (data wait + compute; the "
            f"others wait for it in the all-reduce): {what}: {CAUSES[s['phase']]}")


def waiting_advice(slow: dict[str, Any] | None, verdict: str, rank: int, advice: str) -> str:
    """``advice`` (this rank's verdict's), led by the slow rank's fix where another rank stands out: every
    step waits for that rank, so its phase is the one to speed up first. A ``communication-bound`` verdict's
    own advice is then dropped: this rank's communication is its wait for the slow rank."""
    if not slow or not slow["stands_out"] or slow["rank"] == rank:
        return advice
    first = f"rank {slow['rank']} holds every step back (per-rank table): speed up {CAUSES[slow['phase']]} first"
    if verdict == "communication-bound":
        return f"{first}; this rank's communication is its wait for it, faster communication would not help"
    return f"{first}; then, on this rank: {advice}"


def delayed(batches: Iterator[Any], rank: int, environ: Mapping[str, str] = os.environ) -> Iterator[Any]:
    """``batches``, each one ``SECONDS`` late on rank ``R`` when ``FASTVISION_PROFILE_SLOW_RANK=R:SECONDS``
    is set (see the module's docstring); ``batches`` itself otherwise.

    Raises:
        ConfigError: the variable is not ``RANK:SECONDS`` with a rank >= 0 and seconds >= 0.
    """
    value = environ.get(SLOW_ENV)
    if not value:
        return batches
    try:
        who, seconds = value.split(":")
        who, seconds = int(who), float(seconds)
    except ValueError:
        who, seconds = -1, -1.0
    if who < 0 or not seconds >= 0:
        raise ConfigError(f"{SLOW_ENV}={value!r}: expected RANK:SECONDS, e.g. 1:0.05")
    if who != rank:
        return batches
    return _late(batches, seconds)


def _late(batches: Iterator[Any], seconds: float) -> Iterator[Any]:
    for batch in batches:
        time.sleep(seconds)  # inside next(): the step's clock books it as data wait
        yield batch


def table(report: dict[str, Any]) -> Any:
    """The per-rank rich Table (rank, step, data wait and its share, compute, communication wait, work: p50
    ms; the slow rank in bold where it stands out), the slowest rank's line as its caption."""
    from rich.table import Table

    t = Table(title=f"per rank: p50 ms of {report['steps']} steps (work = data wait + compute)")
    for c in ("rank", "step", "data wait", "data share", "compute", "comm wait", "work"):
        t.add_column(c, justify="right")
    slow = report.get("slowest") or {}
    for r in report["ranks"]:
        mark = "[bold]" if slow.get("stands_out") and r["rank"] == slow["rank"] else ""
        t.add_row(f"{mark}{r['rank']}", f"{r['step_ms']:.2f}", f"{r['phases_ms']['data']:.2f}",
                  f"{100 * r['data_share']:.0f}%", f"{r['compute_ms']:.2f}", f"{r['comm_ms']:.2f}",
                  f"{r['work_ms']:.2f}")
    if slow:
        t.caption = slow["line"]
    return t
