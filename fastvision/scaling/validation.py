"""The scaling simulator against published multi-GPU tables (``fastvision/scaling/anchors.yaml``).

:func:`validate` predicts every anchor row from its 1-GPU rate, hardware preset, input path and
backend with one set of constants, and returns predicted and published speed-up and efficiency.
Input-path rates are either stated in the YAML (with a source) or calibrated from the one row named
``calibrate_from``; that row is reported with ``role: calibration`` and is not validation.
"""
from __future__ import annotations

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


def predict_row(row: dict[str, Any], anchors: dict[str, Any], rates: dict[str, float | None]) -> dict[str, Any]:
    """Prediction for one anchor row: speed-up and efficiency next to the published figures."""
    hw = load_hardware(row["hardware"])
    path = anchors["input_paths"][row["input"]]
    pipe = InputPipeline(row["input"], path["device"], rates[row["input"]], row.get("workers_per_gpu"))
    grad = row["grad_mb"] * 1e6
    if "ref_gpus" in row:  # per-GPU rate at ref_gpus (ref_batch) -> per-GPU rate at gpus (batch)
        ref_rate, ref_batch = row["ref_rate_per_gpu"], row["ref_batch"]
        prof = StepProfile(compute_s=ref_batch / ref_rate, batch=ref_batch, grad_bytes=grad, buckets=bucket_count(grad))
        p = predict_step_time(prof, row["gpus"], hw, pipeline=pipe, backend=row["backend"],
                              per_worker_batch=row["batch"])
        eff = p["images_per_s"] / row["gpus"] / ref_rate
        published_eff = row["published_rate"] / row["gpus"] / ref_rate
        ideal = row["gpus"] / row["ref_gpus"]
        speedup, published = eff * ideal, published_eff * ideal
    else:
        batch, rate1 = row["batch"], row["rate_1gpu"]
        prof = StepProfile(compute_s=batch / rate1, batch=batch, grad_bytes=grad, buckets=bucket_count(grad))
        p = predict_step_time(prof, row["gpus"], hw, pipeline=pipe, backend=row["backend"])
        speedup = p["images_per_s"] / rate1
        published = row.get("published_speedup") or row["published_rate"] / rate1
        ideal = row["gpus"]
        eff, published_eff = speedup / ideal, published / ideal
    return {"id": row["id"], "workload": row["workload"], "impl": row["impl"], "gpu": row["gpu"],
            "hardware": row["hardware"], "precision": row["precision"], "batch": row["batch"], "gpus": row["gpus"],
            "input": row["input"], "backend": row["backend"], "role": row["role"], "source": row["source"],
            "predicted_speedup": speedup, "published_speedup": published, "predicted_efficiency": eff,
            "published_efficiency": published_eff, "error_points": 100 * (eff - published_eff),
            "limit": p["limit"], "step_ms": p["step_s"] * 1e3, "exposed_comm_ms": p["exposed_comm_s"] * 1e3,
            "note": row.get("note", "")}


def validate(path: Path = ANCHORS) -> list[dict[str, Any]]:
    """Every anchor row predicted (see :func:`predict_row`), in file order."""
    anchors = load_anchors(path)
    rates = input_rates(anchors)
    return [predict_row(r, anchors, rates) for r in anchors["rows"]]


def validation_markdown(rows: list[dict[str, Any]]) -> str:
    """Markdown table: row, hardware, input path, predicted vs published speed-up and the error."""
    columns = ["row", "impl", "GPU / precision / batch", "GPUs:", "input, sync", "predicted:", "published:",
               "error (pts):", "binding limit", "role"]
    return markdown(columns, ([r["id"], r["impl"], f"{r['gpu']} {r['precision']} bs{r['batch']}", str(r["gpus"]),
                               f"{r['input']}, {r['backend']}",
                               f"{r['predicted_speedup']:.2f}x ({r['predicted_efficiency']:.1%})",
                               f"{r['published_speedup']:.2f}x ({r['published_efficiency']:.1%})",
                               f"{r['error_points']:+.1f}", r["limit"], r["role"]] for r in rows))
