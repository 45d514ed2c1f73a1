"""The scaling simulator against published multi-GPU tables (``fastvision/scaling/anchors.yaml``).

:func:`validate` predicts every anchor row from its 1-GPU rate, hardware preset, input path and
backend with one set of constants, and returns predicted and published speed-up and efficiency.
Input-path rates are either stated in the YAML (with a source) or calibrated from the one row named
``calibrate_from``; that row is reported with ``role: calibration`` and is not validation.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from fastvision.scaling.simulator import (
    InputPipeline,
    StepProfile,
    bucket_count,
    load_hardware,
    predict_step_time,
)
from fastvision.utils.tables import markdown

ANCHORS = Path(__file__).resolve().parent / "anchors.yaml"


_hardware = functools.lru_cache(maxsize=32)(load_hardware)  # the fit predicts each row many times


def load_anchors(path: Path = ANCHORS) -> dict[str, Any]:
    """The anchors file as ``{"input_paths": {...}, "rows": [...]}``."""
    return yaml.safe_load(Path(path).read_text())


def input_rates(anchors: dict[str, Any]) -> dict[str, float | None]:
    """Per-core items/s of every input path: stated, or calibrated from its ``calibrate_from`` row.

    A calibrated rate is ``published 8-GPU rate / (GPUs x workers per GPU)``: the calibration row is
    assumed input-bound, and that assumption is what the other rows of the same path then test.
    """
    rows = {r["id"]: r for r in anchors["rows"]}
    rates = {}
    for name, p in anchors["input_paths"].items():
        if "calibrate_from" in p:
            r = rows[p["calibrate_from"]]
            rates[name] = r["published_rate"] / (r["gpus"] * r["workers_per_gpu"])
        else:
            rates[name] = p.get("per_core_items_s")
    return rates


def _profile(row: dict[str, Any], overhead_s: float, jitter_ms: float) -> tuple[StepProfile, float, int]:
    """``(profile, reference per-GPU rate, reference GPUs)`` of a row: the published reference step
    (1 GPU, or ``ref_gpus`` at ``ref_batch``) is compute (linear in the batch) plus the fixed cost."""
    grad = row["grad_mb"] * 1e6
    if "ref_gpus" in row:
        ref_batch, ref_rate, ref_gpus = row["ref_batch"], row["ref_rate_per_gpu"], row["ref_gpus"]
    else:
        ref_batch, ref_rate, ref_gpus = row["batch"], row["rate_1gpu"], 1
    step = ref_batch / ref_rate
    if overhead_s >= step:
        raise ValueError(f"{row['id']}: fixed per-step cost {overhead_s * 1e3:.2f} ms >= the reference step")
    prof = StepProfile(compute_s=step - overhead_s, batch=ref_batch, grad_bytes=grad, buckets=bucket_count(grad),
                       overhead_s=overhead_s, jitter_s=jitter_ms * 1e-3)
    return prof, ref_rate, ref_gpus


def predict_row(row: dict[str, Any], anchors: dict[str, Any], rates: dict[str, float | None],
                consts: dict[str, Any] | None = None) -> dict[str, Any]:
    """Prediction for one anchor row: speed-up and efficiency next to the published figures.

    Efficiency is throughput per GPU at ``gpus`` over throughput per GPU at the reference (1 GPU, or
    the row's ``ref_gpus``), predicted over predicted and published over published; the speed-up is
    that efficiency times ``gpus / reference GPUs``. ``consts``: the fitted ``jitter_ms`` and the
    ``overhead_ms`` per implementation group (:func:`fit`); ``None``: no at-scale terms.
    """
    consts = consts or {"jitter_ms": 0.0, "overhead_ms": {}}
    hw = _hardware(row["hardware"])
    path = anchors["input_paths"][row["input"]]
    pipe = InputPipeline(row["input"], path["device"], rates[row["input"]], row.get("workers_per_gpu"))
    overhead = consts["overhead_ms"].get(row.get("overhead"), 0.0) * 1e-3
    prof, ref_rate, ref_gpus = _profile(row, overhead, consts["jitter_ms"])
    kw = dict(pipeline=pipe, backend=row["backend"], algo=row.get("algo", "auto"))
    if consts.get("hide_comm"):  # sensitivity check only: the all-reduce costs nothing
        hw = replace(hw, intra=replace(hw.intra, bandwidth_gbps=1e9, latency_us=0.0),
                     nic=replace(hw.nic, bandwidth_gbps=1e9, latency_us=0.0))
        kw["backend"] = "ddp"
    ref = predict_step_time(prof, ref_gpus, hw, per_worker_batch=prof.batch, **kw)
    p = predict_step_time(prof, row["gpus"], hw, per_worker_batch=row["batch"], **kw)
    eff = (p["images_per_s"] / row["gpus"]) / (ref["images_per_s"] / ref_gpus)
    if "published_speedup" in row:
        published_eff = row["published_speedup"] * ref_gpus / row["gpus"]
    else:
        published_eff = row["published_rate"] / row["gpus"] / ref_rate
    ideal = row["gpus"] / ref_gpus
    # the step time the model misses: published step at N minus predicted, both on the reference's rate
    missing_ms = 1e3 * row["batch"] / ref_rate * (1 / published_eff - 1 / eff)
    return {"id": row["id"], "workload": row["workload"], "impl": row["impl"], "gpu": row["gpu"],
            "hardware": row["hardware"], "precision": row["precision"], "batch": row["batch"], "gpus": row["gpus"],
            "ref_gpus": ref_gpus, "input": row["input"], "backend": row["backend"], "role": row["role"],
            "source": row["source"], "predicted_speedup": eff * ideal, "published_speedup": published_eff * ideal,
            "predicted_efficiency": eff, "published_efficiency": published_eff,
            "error_points": 100 * (eff - published_eff), "limit": p["limit"], "step_ms": p["step_s"] * 1e3,
            "exposed_comm_ms": p["exposed_comm_s"] * 1e3, "straggler_ms": p["straggler_s"] * 1e3,
            "fixed_ms": p["fixed_s"] * 1e3, "missing_ms": missing_ms, "note": row.get("note", "")}


def _bisect(f, lo: float, hi: float, iters: int = 60) -> float:
    """Root of the increasing function ``f`` on ``[lo, hi]`` (clamped to the ends)."""
    if f(lo) >= 0:
        return lo
    if f(hi) <= 0:
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def _solve_overhead(group: str, row: dict[str, Any], cv: float, anchors: dict[str, Any],
                    rates: dict[str, float | None]) -> float:
    """The ``overhead_ms`` of implementation ``group`` that predicts calibration ``row`` exactly at
    jitter ``cv`` (ms), by bisection below the row's whole per-GPU step."""
    top = 1e3 * row["ref_batch"] / row["ref_rate_per_gpu"] * 0.999

    def err(ms: float) -> float:  # predicted minus published; falls as the overhead grows
        consts = {"jitter_ms": cv, "overhead_ms": {group: ms}}
        return -predict_row(row, anchors, rates, consts)["error_points"]
    return _bisect(err, 0.0, top)


def fit(anchors: dict[str, Any], rates: dict[str, float | None]) -> dict[str, Any]:
    """The free constants from the calibration rows named in ``anchors["fit"]``, and nothing else.

    ``overhead_ms`` (one per implementation group: the fixed per-step cost a small per-GPU batch
    cannot hide) is solved so that its calibration row is predicted exactly; ``jitter_ms`` (one for
    all rows) so that its calibration row is; the two are solved nested (bisection), as the
    straggler term also moves the overhead's row. Deterministic: the same table gives the same
    constants.
    """
    spec = anchors.get("fit") or {}
    rows = {r["id"]: r for r in anchors["rows"]}

    def overheads(cv: float) -> dict[str, float]:
        return {group: _solve_overhead(group, rows[src], cv, anchors, rates)
                for group, src in (spec.get("overhead_ms") or {}).items()}

    jit_row = spec.get("jitter_ms")
    if jit_row is None:
        return {"jitter_ms": 0.0, "overhead_ms": overheads(0.0)}

    def jit_err(cv: float) -> float:
        consts = {"jitter_ms": cv, "overhead_ms": overheads(cv)}
        return -predict_row(rows[jit_row], anchors, rates, consts)["error_points"]
    cv = _bisect(jit_err, 0.0, 5.0, iters=40)
    return {"jitter_ms": cv, "overhead_ms": overheads(cv)}


def step_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(fixed, per item)``: the least-squares line ``t(b) = b * per_item + fixed`` through ``(batch, step
    time)`` points at two or more distinct batches (exactly through two), in the step times' unit."""
    n = len(points)
    mb, mt = sum(b for b, _ in points) / n, sum(t for _, t in points) / n
    per_item = sum((b - mb) * (t - mt) for b, t in points) / sum((b - mb) ** 2 for b, _ in points)
    return mt - per_item * mb, per_item


def implied_fixed_ms(points: list[list[float]]) -> tuple[float, float]:
    """``(fixed ms per step, ms per item)`` from rates at two per-GPU batches, ``[[b1, items/s], [b2, items/s]]``:
    the line ``t(b) = b * t_item + fixed`` through both step times (a negative fixed cost means the
    larger batch ran less efficiently per item)."""
    fixed, per_item = step_line([(b, b / r) for b, r in points])
    return 1e3 * fixed, 1e3 * per_item


@functools.lru_cache(maxsize=4)
def fitted(path: Path = ANCHORS) -> dict[str, Any]:
    """:func:`fit` of the anchors file, computed once per process (``plan`` asks for every GPU count)."""
    anchors = load_anchors(path)
    return fit(anchors, input_rates(anchors))


def validate(path: Path = ANCHORS) -> list[dict[str, Any]]:
    """Every anchor row predicted with the fitted constants (see :func:`predict_row`), in file order."""
    anchors = load_anchors(path)
    rates = input_rates(anchors)
    consts = fit(anchors, rates)
    return [predict_row(r, anchors, rates, consts) for r in anchors["rows"]]


def validation_markdown(rows: list[dict[str, Any]]) -> str:
    """Markdown table: row, hardware, input path, predicted vs published speed-up, the error and the
    step time the model misses (published minus predicted step at N, ms)."""
    columns = ["row", "impl", "GPU / precision / batch", "GPUs:", "input, sync", "predicted:", "published:",
               "error (pts):", "missed ms/step:", "binding limit", "role"]
    return markdown(columns, ([r["id"], r["impl"], f"{r['gpu']} {r['precision']} bs{r['batch']}", str(r["gpus"]),
                               f"{r['input']}, {r['backend']}",
                               f"{r['predicted_speedup']:.2f}x ({r['predicted_efficiency']:.1%})",
                               f"{r['published_speedup']:.2f}x ({r['published_efficiency']:.1%})",
                               f"{r['error_points']:+.1f}", f"{r['missing_ms']:+.1f}", r["limit"], r["role"]]
                              for r in rows))
