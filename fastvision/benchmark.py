"""Benchmark mode: training or inference throughput and latency of any recipe on synthetic batches.

``fastvision benchmark RECIPE --mode train|inference`` builds the recipe's model, loss and task
from the registries (no dataset: the task supplies a random batch already on the device, so the
figures measure compute, not input), then for every (batch size, precision) setting runs warm-up
steps and timed steps. A training step is the engine's step (autocast forward + loss, scaled
backward, optimizer step through the same :class:`~fastvision.runtime.Precision` scaler); an
inference step is the task's validation forward under ``no_grad``. Each timed step is bracketed
by ``torch.cuda.synchronize`` on GPU (the measurement's only host syncs). Reported: items/s
(median over steps), latency mean / p50 / p90 / p95 / p99 in ms, peak GPU memory, and the
speed-up of TF32 / AMP over FP32 (and AMP over TF32) at the same batch size.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import __version__, optim, runtime
from .config import RunConfig
from .errors import ConfigError
from .tasks.base import Task

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
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


# ------------------------------------------------------------------------------ building
def build_model_and_task(cfg: RunConfig, device: torch.device, channels_last: bool = False) -> tuple[nn.Module, Task]:
    """The recipe's model (on ``device``) and task, built from the registries without a dataset.

    Tasks that take the dataset's ``info`` (detection) get an empty one: synthetic batches need
    only the task's own arguments. The recipe's batched augmentation is built for the spatial
    dimensionality of the task's synthetic batch.
    """
    from .engine import import_components
    from .registry import LOSSES, MODELS, TASKS

    import_components()
    loss = LOSSES.build(cfg.loss.name, cfg.loss.args, where="loss.args").to(device)
    extra = {"info": {}} if "info" in inspect.signature(TASKS.get(cfg.task.name)).parameters else {}
    task = TASKS.build(cfg.task.name, cfg.task.args, where="task.args", loss=loss, augment=None, **extra)
    if cfg.data.augment:
        from .data.gpu_aug import build_augment

        dims = task.synthetic_batch(1, torch.device("cpu"))[task.input_key].dim() - 2
        augment = build_augment(dims, **cfg.data.augment)
        task = TASKS.build(cfg.task.name, cfg.task.args, where="task.args", loss=loss, augment=augment, **extra)
    model = MODELS.build(cfg.model.name, cfg.model.args, where="model.args")
    return runtime.prepare_model(model, device, channels_last), task


def plan(precisions: list[str], device: torch.device) -> tuple[list[str], list[str]]:
    """Precisions that run on ``device`` and notes for the ones skipped."""
    run, notes = [], []
    for p in precisions:
        if p not in PRECISIONS:
            raise ConfigError(f"--precision: unknown {p!r}; valid: {', '.join(PRECISIONS)}")
        if device.type != "cuda" and p in ("fp16", "tf32"):
            notes.append(f"{p} skipped: needs a CUDA device" + (" (tf32 equals fp32 elsewhere)" if p == "tf32" else ""))
        elif device.type == "cuda" and p == "bf16" and not torch.cuda.is_bf16_supported():
            notes.append("bf16 skipped: this GPU has no bf16 support")
        else:
            run.append(p)
    return run, notes


# ------------------------------------------------------------------------------ measuring
def run_benchmark(cfg: RunConfig, mode: str, batch_sizes: list[int], precisions: list[str], *, steps: int = 50,
                  warmup: int = 10, compile: bool = False, channels_last: bool = False, augment: bool = False,
                  device: torch.device | str = "cpu") -> dict[str, Any]:
    """Measure every (batch size, precision) setting of a recipe; returns the JSON-able report.

    Args:
        cfg: the loaded recipe (``fastvision.config.load``).
        mode: "train" (full optimizer steps) or "inference" (validation forward under no_grad).
        batch_sizes: items per step, e.g. ``[1, 8, 64, 256]``.
        precisions: subset of fp32, tf32, fp16, bf16; the ones the device lacks are skipped
            with a note.
        steps: timed steps per setting.
        warmup: untimed steps first (cuDNN autotuning, allocator, ``torch.compile``).
        compile: ``torch.compile`` the model (compiled afresh for every setting).
        channels_last: NHWC / NDHWC model weights and inputs.
        augment: include the task's batched augmentation in the timed training step.
        device: torch device.

    Returns:
        ``{"recipe", "mode", ..., "notes": [...], "results": [row, ...]}``; a row holds
        ``batch_size``, ``precision``, the :func:`step_stats` figures, ``peak_memory_mb`` (CUDA),
        ``speedup_vs_fp32`` / ``speedup_vs_tf32`` where the baseline ran, or ``error``.
    """
    if mode not in ("train", "inference"):
        raise ConfigError(f"--mode: expected train or inference, got {mode!r}")
    if steps < 1 or warmup < 0 or not batch_sizes or min(batch_sizes) < 1:
        raise ConfigError("--steps must be >= 1, --warmup >= 0 and every batch size >= 1")
    device = torch.device(device)
    todo, notes = plan(precisions, device)
    runtime.seed_everything(cfg.train.seed)
    model, task = build_model_and_task(cfg, device, channels_last)
    initial = copy.deepcopy(model.state_dict())  # every setting starts from the same weights
    tf32_before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    rows = []
    try:
        for bs in batch_sizes:
            for prec in todo:
                model.load_state_dict(initial)
                # fp32 means true fp32; AMP runs keep the recipe's TF32 choice for their fp32 ops.
                runtime.set_tf32(prec == "tf32" or (prec in ("fp16", "bf16") and cfg.train.tf32))
                log.info("benchmark %s %s batch %d %s", cfg.recipe, mode, bs, prec)
                row = {"batch_size": bs, "precision": prec}
                try:
                    times, peak = _measure(model, task, cfg, mode, bs, prec, steps, warmup, compile,
                                           channels_last, augment, device)
                    row.update(step_stats(times, bs))
                    if peak is not None:
                        row["peak_memory_mb"] = peak
                except torch.cuda.OutOfMemoryError:
                    row["error"] = "out of memory"
                    torch.cuda.empty_cache()
                rows.append(row)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32_before
    add_speedups(rows)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"recipe": cfg.recipe, "mode": mode, "model": cfg.model.name, "task": cfg.task.name,
            "device": str(device), "gpu": gpu, "cpu": platform.processor() or platform.machine(),
            "cpu_threads": torch.get_num_threads(), "torch": torch.__version__, "fastvision": __version__,
            "compile": compile, "channels_last": channels_last, "augment": augment, "steps": steps,
            "warmup": warmup, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "notes": notes, "results": rows}


def _measure(model: nn.Module, task: Task, cfg: RunConfig, mode: str, bs: int, prec: str, steps: int,
             warmup: int, compile: bool, channels_last: bool, augment: bool,
             device: torch.device) -> tuple[list[float], float | None]:
    """Per-step seconds of ``steps`` timed steps after ``warmup``, and peak CUDA memory in MB."""
    precision = runtime.Precision(prec if prec in ("fp16", "bf16") else "off", device)
    batch = task.to_device(task.synthetic_batch(bs, device), device, channels_last)
    model.train(mode == "train")
    if compile:
        torch._dynamo.reset()  # a fresh graph per setting: no recompilation inside the timed steps
    net = runtime.maybe_compile(model, compile)
    if mode == "train":
        optimizer = optim.build_optimizer(model, cfg.optim, optim.effective_lr(cfg.optim, bs))
        generator = torch.Generator(device=device)
        generator.manual_seed(cfg.train.seed)

        def step() -> None:
            b = task.augment(batch, generator) if augment else batch
            with precision.autocast():
                loss = task.loss(task.forward(net, b), b)
            precision.scaler.scale(loss).backward()
            precision.scaler.step(optimizer)
            precision.scaler.update()
            optimizer.zero_grad(set_to_none=True)
    else:
        def step() -> None:
            with torch.no_grad(), precision.autocast():
                task.eval_forward(net, batch)

    cuda = device.type == "cuda"
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)  # deliberate: a step's latency ends when the GPU is done
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    return times, peak


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """``speedup_vs_fp32`` / ``speedup_vs_tf32``: median items/s over the baseline's, same batch size."""
    base = {(r["batch_size"], r["precision"]): r["items_per_s"] for r in rows if "items_per_s" in r}
    for r in rows:
        for ref in _BASELINES[r["precision"]]:
            if "items_per_s" in r and (r["batch_size"], ref) in base:
                r[f"speedup_vs_{ref}"] = r["items_per_s"] / base[(r["batch_size"], ref)]


# ------------------------------------------------------------------------------ reports
COLUMNS = [("batch_size", "batch", "{:d}"), ("precision", "precision", "{}"), ("items_per_s", "items/s", "{:.1f}"),
           ("latency_mean_ms", "mean ms", "{:.2f}"), ("latency_p90_ms", "p90 ms", "{:.2f}"),
           ("latency_p95_ms", "p95 ms", "{:.2f}"), ("latency_p99_ms", "p99 ms", "{:.2f}"),
           ("speedup_vs_fp32", "x fp32", "{:.2f}"), ("speedup_vs_tf32", "x tf32", "{:.2f}"),
           ("peak_memory_mb", "peak MB", "{:.0f}")]


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
    lines += [""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def rich_table(report: dict[str, Any]):
    from rich.table import Table

    head, body = _cells(report)
    table = Table(title=title(report))
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
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(markdown(report))
    return json_path, md_path


# ------------------------------------------------------------------------------ CLI
def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--batch-sizes: expected comma-separated integers, got {text!r}") from None


def add_cli(subparsers) -> None:
    """``fastvision benchmark RECIPE``."""
    p = subparsers.add_parser("benchmark", help="training / inference throughput and latency on synthetic batches",
                              description="Throughput (items/s) and latency percentiles of a recipe's model on "
                                          "synthetic batches on the device, per batch size and precision.")
    p.add_argument("recipe", help="shipped recipe name or YAML file")
    p.add_argument("--mode", choices=["train", "inference"], default="train")
    p.add_argument("--batch-sizes", help="comma-separated, e.g. 1,8,64,256 (default: the recipe's batch size)")
    p.add_argument("--precision", help="comma-separated subset of fp32,tf32,fp16,bf16 "
                                       "(default: fp32 plus the recipe's AMP mode)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per setting (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC memory format (default: the recipe's train.channels_last)")
    p.add_argument("--augment", action="store_true", help="include the batched augmentation in training steps")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--out", type=Path, help="folder for <recipe>-<mode>.json and .md (default runs/benchmark)")
    p.add_argument("--force", action="store_true", help="replace an existing <recipe>-<mode>.json / .md in --out")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override, e.g. --set task.args.image_size=128 (repeatable)")
    p.set_defaults(func=cmd_benchmark)


def cmd_benchmark(args) -> int:
    from rich.console import Console

    from . import dist
    from .config import load, parse_override

    from .api import refuse_overwrite

    cfg = load(args.recipe, [parse_override(s) for s in args.set])
    out_dir = args.out or Path("runs/benchmark")
    for suffix in (".json", ".md"):  # checked before the run: a refusal costs no benchmark time
        refuse_overwrite(out_dir / f"{cfg.recipe}-{args.mode}{suffix}", args.force)
    env, device = dist.init(args.device)
    if env.world_size > 1:
        raise ConfigError("benchmark measures one device; run it without torchrun/srun (see `fastvision scale`)")
    batch_sizes = _int_list(args.batch_sizes) if args.batch_sizes else [cfg.train.batch_size]
    amp = runtime.resolve_amp(cfg.train.amp, device)[0]  # train.amp auto -> this device's precision
    precisions = args.precision.split(",") if args.precision else ["fp32"] + ([amp] if amp != "off" else [])
    channels_last = cfg.train.channels_last if args.channels_last is None else args.channels_last
    report = run_benchmark(cfg, args.mode, batch_sizes, precisions, steps=args.steps, warmup=args.warmup,
                           compile=args.compile, channels_last=channels_last, augment=args.augment, device=device)
    console = Console()
    console.print(rich_table(report))
    for note in report["notes"]:
        console.print(f"note: {note}")
    json_path, md_path = write_reports(report, out_dir)
    console.print(f"wrote {json_path} and {md_path}")
    return 0 if all("error" not in r for r in report["results"]) else 1
