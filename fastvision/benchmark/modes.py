"""Benchmark mode: training or inference throughput and latency of any recipe on synthetic batches.

``fastvision benchmark RECIPE --mode train|inference`` builds each (batch size, precision) setting
with the engine's own :func:`~fastvision.engine.build` without a dataset (the task supplies a random
batch already on the device, so the figures measure compute, not input), then runs warm-up steps
and timed steps. A training step is :func:`fastvision.engine.train_step`, the step ``fit`` runs
(accumulation, autocast, scaled backward, non-finite check, clipping, scaler step, schedule, EMA);
an inference step is the task's validation forward under ``no_grad``. ``--mode data`` times the
recipe's input path without the model (:mod:`fastvision.benchmark.data`). Each timed step is bracketed
by ``torch.cuda.synchronize`` on GPU (the measurement's only host syncs). Reported
(:mod:`fastvision.benchmark.report`): items/s (median over steps), latency mean / p50 / p90 / p95 /
p99 in ms, peak GPU memory, and the speed-up of TF32 / AMP over FP32 (and AMP over TF32) at the
same batch size.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import platform
import time
from pathlib import Path
from typing import Any

import torch

from fastvision import __version__, engine
from fastvision.benchmark.flags import check_mode_flags, int_list
from fastvision.benchmark.report import add_speedups, rich_table, step_stats, write_reports
from fastvision.config import RunConfig
from fastvision.engine import runtime
from fastvision.engine.step import step_failure, synthetic_source
from fastvision.errors import ConfigError, interrupted
from fastvision.models import without_weights
from fastvision.utils.files import atomic_text

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


# ------------------------------------------------------------------------------ building
def setting_config(cfg: RunConfig, batch_size: int, precision: str, *, compile: bool = False,
                   channels_last: bool = False, augment: bool = False, device: torch.device | str = "cpu") -> RunConfig:
    """The recipe's config for one measured setting (what :func:`fastvision.engine.build` receives)."""
    out = copy.deepcopy(cfg)
    t = out.train
    t.batch_size, t.compile, t.channels_last, t.device = batch_size, compile, channels_last, str(device)
    t.amp = precision if precision in ("fp16", "bf16") else "off"
    # fp32 means true fp32; AMP runs keep the recipe's TF32 choice for their fp32 ops.
    t.tf32 = precision == "tf32" or (precision in ("fp16", "bf16") and cfg.train.tf32)
    if not augment:
        out.data.augment = {}
    out.model.args = without_weights(out.model.args)  # weights files change values, not the time: never read
    return out


def check_settings(precisions: list[str], steps: int, warmup: int, batch_sizes: list[int] | None) -> None:
    """The benchmark's own arguments, before anything runs (``batch_sizes`` None: chosen later, ``auto``)."""
    for p in precisions:
        if p not in PRECISIONS:
            raise ConfigError(f"--precision: unknown {p!r}; valid: {', '.join(PRECISIONS)}")
    if batch_sizes is not None and (not batch_sizes or min(batch_sizes) < 1):
        raise ConfigError(f"--batch-sizes: every batch size must be >= 1, got {batch_sizes}")
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    if warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {warmup}")


def runnable_precisions(precisions: list[str], device: torch.device) -> tuple[list[str], list[str]]:
    """Precisions that run on ``device`` and notes for the ones skipped."""
    check_settings(precisions, 1, 0, None)
    run, notes = [], []
    for p in precisions:
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
        ``batch_size``, ``precision``, the :func:`step_stats` figures, on CUDA ``peak_memory_mb``,
        ``peak_reserved_mb`` and ``device_used_mb`` (see :func:`_measure`),
        ``speedup_vs_fp32`` / ``speedup_vs_tf32`` where the baseline ran, or ``error``.
    """
    if mode not in ("train", "inference"):
        raise ConfigError(f"--mode: expected train or inference, got {mode!r}")
    check_settings(precisions, steps, warmup, batch_sizes)
    # a setting named twice is measured once (two rows of one setting read as two settings)
    batch_sizes, precisions = list(dict.fromkeys(batch_sizes)), list(dict.fromkeys(precisions))
    device = torch.device(device)
    todo, notes = runnable_precisions(precisions, device)
    if not todo:  # else an empty table and report, and exit 0
        raise ConfigError(f"--precision {','.join(precisions)}: nothing to run on {device.type} "
                          f"({'; '.join(notes)}); add fp32 or bf16")
    tf32_before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        rows = [_measure_setting(cfg, mode, bs, prec, steps, warmup, device=device, compile=compile,
                                 channels_last=channels_last, augment=augment)
                for bs in batch_sizes for prec in todo]
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32_before
    add_speedups(rows)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"recipe": cfg.recipe, "mode": mode, "model": cfg.model.name, "task": cfg.task.name,
            "input": input_size(cfg), "device": str(device), "gpu": gpu,
            "cpu": platform.processor() or platform.machine(),
            "cpu_threads": torch.get_num_threads(), "torch": torch.__version__, "fastvision": __version__,
            "compile": compile, "channels_last": channels_last, "augment": augment, "steps": steps,
            "warmup": warmup, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "notes": notes, "results": rows}


def input_size(cfg: RunConfig) -> dict[str, Any]:
    """The task's keys that shape the synthetic batch (``image_size``, ``sample_shape``): what a step time
    was measured at, so ``plan --calibrate`` can refuse a benchmark of another input size."""
    args = cfg.task.args or {}
    return {k: args[k] for k in ("image_size", "sample_shape") if k in args}


def _measure_setting(cfg: RunConfig, mode: str, bs: int, prec: str, steps: int, warmup: int, *,
                     device: torch.device, **switches: bool) -> dict[str, Any]:
    """One row of :func:`run_benchmark`: a run built afresh for (batch size, precision) and timed.

    ``switches`` are ``compile``, ``channels_last`` and ``augment`` (see :func:`setting_config`).
    """
    log.info("benchmark %s %s batch %d %s", cfg.recipe, mode, bs, prec)
    row: dict[str, Any] = {"batch_size": bs, "precision": prec}
    if switches["compile"]:
        torch._dynamo.reset()  # a fresh graph per setting: no recompilation inside the timed steps
    # every setting is built afresh under the recipe's seed: the same initial weights
    run = engine.build(setting_config(cfg, bs, prec, device=device, **switches), data_info={},
                       train=mode == "train")
    try:
        times, memory = _measure(run, mode, steps, warmup)
        row.update(step_stats(times, bs * (run.step.micro_steps if run.step else 1)))
        row.update(memory)
    except torch.cuda.OutOfMemoryError:
        row["error"] = "out of memory"
        torch.cuda.empty_cache()
    return row


def _measure(run: engine.Run, mode: str, steps: int, warmup: int) -> tuple[list[float], dict[str, float]]:
    """Per-step seconds of ``steps`` timed steps after ``warmup``, and on CUDA the memory of the timed
    steps in MB: ``peak_memory_mb`` (torch's allocated peak), ``peak_reserved_mb`` (its caching
    allocator's reserved peak) and ``device_used_mb`` (the device's used memory at the end, CUDA
    context included: what ``nvidia-smi`` shows on a GPU this process has to itself)."""
    task, device, tc = run.task, run.device, run.cfg.train
    batch = task.to_device(task.synthetic_batch(tc.batch_size, device), device, tc.channels_last)
    if mode == "train":
        run.step.model.train()
        batches = itertools.repeat(batch)

        def step() -> None:
            engine.train_step(run.step, batches)
    else:
        net = runtime.maybe_compile(run.model, tc.compile)
        net.eval()

        def step() -> None:
            with torch.no_grad(), run.precision.autocast():
                task.eval_forward(net, batch)

    step = _first_checked(step, run.cfg, mode)
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
    if not cuda:
        return times, {}
    free, total = torch.cuda.mem_get_info(device)
    return times, {"peak_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20,
                   "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
                   "device_used_mb": (total - free) / 2**20}


def _first_checked(step, cfg: RunConfig, mode: str):
    """``step`` whose first call turns a model that cannot take the synthetic batch (a size its strides do
    not divide, too small for its depth, BatchNorm on one value) into one line naming the task's key that
    shapes the batch, as ``train``'s first step does for the data's; out of memory stays the row's error."""
    done = False

    def checked() -> None:
        nonlocal done
        if done:
            return step()
        try:
            step()
        except torch.cuda.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError, IndexError) as e:
            what = "training" if mode == "train" else "inference"
            raise step_failure(e, cfg, f"the first {what} step", synthetic_source(cfg)) from e
        done = True

    return checked


# ------------------------------------------------------------------------------ CLI
def add_cli(subparsers) -> None:
    """``fastvision benchmark RECIPE``."""
    p = subparsers.add_parser("benchmark", help="training / inference throughput on synthetic batches, "
                                                "or the input path alone (--mode data)",
                              description="train / inference: throughput (items/s) and latency percentiles of a "
                                          "recipe's training step or validation forward on synthetic batches on the "
                                          "device, per batch size and precision. data: items/s and ms/item of the "
                                          "recipe's own input path (dataset, cache, loader, to device, batched "
                                          "augmentation) with the model removed, per --cache mode, interleaved. "
                                          "target: time to a quality target over several seeds, real training runs "
                                          "(MLPerf's olympic mean, median, spread).")
    p.add_argument("recipe", help="shipped recipe name or YAML file")
    p.add_argument("--mode", choices=["train", "inference", "data", "target"], default="train",
                   help="target: real training runs to the recipe's train.target (or --target) over --seeds seeds, "
                        "scored as MLPerf scores time to train (olympic mean)")
    p.add_argument("--seeds", type=int, help="target mode: runs, seeds --seed .. --seed+N-1 (default 5, "
                                                        "MLPerf's count for ResNet-50)")
    p.add_argument("--seed", type=int, help="target mode: the first seed (default 0)")
    p.add_argument("--nproc", type=int, help="target mode: each seed's run on N local workers "
                                                        "(train --nproc)")
    p.add_argument("--target", help="target mode: METRIC=VALUE, e.g. iou=0.9 (default: the recipe's train.target)")
    p.add_argument("--cache", help="data mode: comma-separated data.cache modes to compare, e.g. none,ram,gpu "
                                   "(default: the recipe's)")
    p.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="data mode: a setting to compare (repeatable), timed in the same interleaved rounds, e.g. "
                        "--variant data.args.backend=dali --variant data.args.backend=pillow,data.loader=processes")
    p.add_argument("--rounds", type=int, help="data mode: interleaved turns per cache mode (default 4)")
    p.add_argument("--data", help="data and target modes: dataset folder (data.args.path; default: the recipe's)")
    p.add_argument("--batch-sizes", help="comma-separated, e.g. 1,8,64,256, or auto: the largest that fits "
                                         "(default: the recipe's batch size)")
    p.add_argument("--precision", help="comma-separated subset of fp32,tf32,fp16,bf16 "
                                       "(default: fp32 plus the recipe's AMP mode)")
    p.add_argument("--steps", type=int, help="timed steps (data mode: batches) per setting (default 50)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 10; data mode: one epoch, which "
                                              "fills the caches)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC memory format (default: the recipe's train.channels_last)")
    p.add_argument("--augment", action="store_true", help="include the batched augmentation in training steps")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--out", type=Path, help="folder for <recipe>-<mode>.json and .md (default runs/benchmark; target "
                                            "mode: the seeds' runs too, default runs/benchmark/<recipe>-target)")
    p.add_argument("--force", action="store_true", help="replace an existing <recipe>-<mode>.json / .md in --out "
                                                        "(target mode: start the seeds' runs over)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override, e.g. --set task.args.sample_shape=[1,256,256] for unet2d-microscopy or "
                        "--set task.args.image_size=128 for resnet50-imagenet (repeatable)")
    p.set_defaults(func=cmd_benchmark)


def cmd_benchmark(args) -> int:
    from rich.console import Console

    from fastvision import distributed
    from fastvision.api import refuse_overwrite
    from fastvision.config import load, parse_override

    check_mode_flags(args)
    if args.mode == "target":  # real training runs (under torchrun too), not synthetic batches on one device
        from fastvision.benchmark.target import cmd_target

        return cmd_target(args, [parse_override(s) for s in args.set])
    cfg = load(args.recipe, [parse_override(s) for s in args.set])
    # the flags' values before the output's: a bad value is named, not hidden behind "file exists"
    given = int_list(args.batch_sizes) if args.batch_sizes and args.batch_sizes != "auto" else None
    check_settings(args.precision.split(",") if args.precision else [], args.steps, args.warmup or 0, given)
    if args.mode == "data":
        from fastvision.benchmark.data import check_data_args

        check_data_args(data_caches(args, cfg), args.steps, args.rounds, args.variant)
    out_dir = args.out or Path("runs/benchmark")
    for suffix in (".json", ".md"):  # checked before the run: a refusal costs no benchmark time
        refuse_overwrite(out_dir / f"{cfg.recipe}-{args.mode}{suffix}", args.force)
    env, device = distributed.init(args.device)
    if env.world_size > 1:
        raise ConfigError("benchmark measures one device; run it without torchrun/srun (see `fastvision scale`)")
    if args.mode == "data":
        return _cmd_data(args, cfg, device)
    if args.batch_sizes == "auto" or (not args.batch_sizes and cfg.train.batch_size == "auto"):
        from fastvision.planning.autobatch import resolve_auto_batch

        batch_sizes = [resolve_auto_batch(cfg, device)]
    else:
        batch_sizes = given or [cfg.train.batch_size]
    amp = runtime.resolve_amp(cfg.train.amp, device)[0]  # train.amp auto -> this device's precision
    precisions = args.precision.split(",") if args.precision else ["fp32"] + ([amp] if amp != "off" else [])
    channels_last = cfg.train.channels_last if args.channels_last is None else args.channels_last
    try:
        report = run_benchmark(cfg, args.mode, batch_sizes, precisions, steps=args.steps,
                               warmup=10 if args.warmup is None else args.warmup,
                               compile=args.compile, channels_last=channels_last, augment=args.augment, device=device)
    except KeyboardInterrupt:  # Ctrl-C: the report is of every setting or none, and the line says so
        raise interrupted("benchmark", [out_dir / f"{cfg.recipe}-{args.mode}.json"], "every setting has run") from None
    console = Console()
    console.print(rich_table(report))
    for note in report["notes"]:
        console.print(f"note: {note}")
    json_path, md_path = write_reports(report, out_dir)
    console.print(f"wrote {json_path} and {md_path}")
    return 0 if all("error" not in r for r in report["results"]) else 1


def data_caches(args, cfg: RunConfig) -> list[str]:
    """``--cache``'s modes, else the recipe's ``data.cache``."""
    return [c.strip() for c in args.cache.split(",") if c.strip()] if args.cache else [cfg.data.cache]


def _cmd_data(args, cfg: RunConfig, device: torch.device) -> int:
    from rich.console import Console
    from rich.table import Table

    from fastvision.benchmark.data import markdown as data_markdown
    from fastvision.benchmark.data import per_core_text, run_data_benchmark

    cfg.train.device = str(device)
    if args.data:
        cfg.data.args["path"] = args.data
    if args.batch_sizes:
        cfg.train.batch_size = int_list(args.batch_sizes)[0]
    caches = data_caches(args, cfg)
    out = args.out or Path("runs/benchmark")
    try:
        report = run_data_benchmark(cfg, caches, batches=args.steps, rounds=args.rounds, warmup=args.warmup,
                                    variants=args.variant or None)
    except KeyboardInterrupt:  # Ctrl-C: the report is of every mode or none, and the line says so
        raise interrupted("benchmark", [out / f"{cfg.recipe}-data.json"], "every mode has had its rounds") from None
    table = Table(title=f"{report['recipe']} input path (model removed) on {report['device']}, "
                        f"batch {report['batch_size']}")
    for h in ("setting", "cache", "items/s", "ms/item", "items/s per core", "x first", "pipeline"):
        table.add_column(h, justify="left" if h in ("setting", "cache", "pipeline") else "right")
    for r in report["results"]:
        table.add_row(r["setting"] or "recipe", r["cache"], f"{r['items_per_s']:.1f}", f"{r['ms_per_item']:.2f}",
                      per_core_text(r), f"{r['speedup_vs_first']:.2f}", r["pipeline"])
    console = Console()
    console.print(table)
    unsettled = sum(r["unsettled_chunks"] for r in report["results"])
    if unsettled:
        console.print(f"note: {unsettled} turn(s) started before the loaders went idle (something kept a core busy "
                      "past the wait): their modes may have shared the CPU")
    console.print(f"items/s per core: items over the CPU seconds of this process tree in the timed batches, on "
                  f"{report['host_cpu']}; pass the JSON to `fastvision plan {report['recipe']} --input-rate FILE`")
    stem = f"{report['recipe']}-data"  # the name cmd_benchmark checked with refuse_overwrite
    atomic_text(out / f"{stem}.json", json.dumps(report, indent=2) + "\n")  # whole, or the file before
    atomic_text(out / f"{stem}.md", data_markdown(report))
    console.print(f"wrote {out / (stem + '.json')} and {out / (stem + '.md')}")
    return 0
