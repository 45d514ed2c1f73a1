"""Profiling: ``fastvision profile`` (time per training phase and a verdict; ``--nproc N`` or under
torchrun / srun also a table per rank naming the slow rank) and ``fastvision monitor`` (NVML
utilisation and memory to CSV and PNG). Library API: :func:`profile`, :func:`render`,
:func:`~fastvision.profiling.monitor.record`, :func:`~fastvision.profiling.monitor.plot_csv`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fastvision.config import AMP_MODES
from fastvision.errors import DataError, check_low, interrupted
from fastvision.profiling.monitor import plot_csv, read_csv, record
from fastvision.profiling.profiler import (
    PHASES,
    advice,
    percentiles_ms,
    profile,
    profile_run,
)
from fastvision.profiling.ranks import table as rank_table
from fastvision.utils.files import atomic_text

__all__ = ["profile", "profile_run", "render", "record", "plot_csv", "read_csv", "advice", "percentiles_ms",
           "add_profile_cli", "add_monitor_cli"]

_LABELS = {"data": "data wait", "h2d": "host-to-device", "augment": "augment (batched)", "forward": "forward",
           "backward": "backward", "optimizer": "optimizer", "comm": "communication"}


def render(report: dict[str, Any]) -> Any:
    """The report as a rich Table (phase, p50/p90/p99 ms, share of the profiled time: mean phase over mean step)
    with a caption."""
    from rich.table import Table

    step = report["step_ms"]["mean"]
    t = Table(title=f"{report['config']['recipe']} on {report['device']}: {report['steps']} steps x "
                    f"{report['global_batch']} images")
    t.add_column("phase")
    for c in ("p50 ms", "p90 ms", "p99 ms", "share of time"):
        t.add_column(c, justify="right")
    for p in PHASES:
        ms = report["phases"][p]
        t.add_row(_LABELS[p], f"{ms['p50']:.2f}", f"{ms['p90']:.2f}", f"{ms['p99']:.2f}",
                  f"{100 * ms['mean'] / max(step, 1e-9):.0f}%")
    s = report["step_ms"]
    t.add_row("[bold]step[/bold]", f"{s['p50']:.2f}", f"{s['p90']:.2f}", f"{s['p99']:.2f}", "100%")
    gpu = report.get("gpu") or {}
    util = f"GPU util {gpu['util_mean']:.0f}%, " if gpu.get("util_mean") is not None else ""
    mem = f"peak {gpu['torch_peak_allocated_mib']:.0f} MiB allocated; " if "torch_peak_allocated_mib" in gpu else ""
    t.caption = (f"{report['images_per_s']:.1f} images/s; {util}{mem}pipeline: {report['pipeline']}\n"
                 f"verdict: [bold]{report['verdict']}[/bold] -> {report['advice']}")
    parts = [t]
    if report.get("top_ops"):
        kind = "kernels (self GPU time)" if report["device"].startswith("cuda") else "ops (self CPU time)"
        ops = Table(title=f"top {kind}, from --trace")
        # calls counted over the profiled steps (a per-step count printed 1.5 for an op of some steps only)
        for c, j in (("op", "left"), (f"calls in {report['steps']} steps", "right"), ("ms / step", "right"),
                     ("share", "right")):
            ops.add_column(c, justify=j, overflow="fold")
        for o in report["top_ops"]:
            ops.add_row(o["name"][:90], str(o.get("calls", round(o["calls_per_step"] * report["steps"]))),
                        f"{o['ms_per_step']:.2f}",
                        f"{100 * o['share']:.1f}%")
        parts.append(ops)
    if len(report.get("ranks") or ()) > 1:
        parts.append(rank_table(report))
    if len(parts) == 1:
        return t
    from rich.console import Group

    return Group(*parts)


def _cmd_profile(args) -> int:
    from rich.console import Console

    from fastvision import config, distributed
    from fastvision.api import overrides_to_dicts, refuse_overwrite

    for flag, value, low in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--nproc", args.nproc, 1)):
        check_low(flag, value, low)
    if args.out:  # checked before profiling: a refusal costs nothing
        refuse_overwrite(args.out, args.force, folder=True)  # a file there is refused even with --force
    if args.trace:  # a trace folder holds the rank files of one run: another run's are not replaced unasked
        refuse_overwrite(args.trace, args.force, "--trace", folder=True)
    flat = {k: v for k, v in {"data": args.data, "device": args.device, "batch_size": args.batch_size,
                              "amp": args.amp}.items() if v is not None}
    cfg = config.load(args.recipe, [*overrides_to_dicts(flat), *[config.parse_override(s) for s in args.set]])
    if args.nproc > 1 and distributed.outer_launcher(args.nproc) == "single":
        distributed.check_nproc(args.nproc, cfg.train.device)
        # this very command under torch's launcher, one process per worker (as train --nproc): every rank
        # profiles the same steps and rank 0 writes the report
        return distributed.launch_local(args.nproc, distributed.relaunch_argv(args.argv), backend=cfg.train.backend)
    out = Path(args.out or f"runs/profile-{Path(cfg.recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        report = profile(cfg, steps=args.steps, warmup=args.warmup, nvtx=args.nvtx, trace=args.trace,
                         synthetic=args.synthetic)
    except KeyboardInterrupt:  # Ctrl-C: nothing half-written to keep, and the line says so
        raise interrupted("profile", [out, args.trace], "every step has run") from None
    if not distributed.detect_env().is_main:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    atomic_text(out / "profile.json", json.dumps(report, indent=2))  # whole, or the file before: never half
    console = Console(record=True)
    console.print(render(report))
    atomic_text(out / "profile.txt", console.export_text())
    print(f"report: {out / 'profile.json'}")
    return 0


def _plot_path(plot: str | Path, force: bool) -> Path:
    """The monitor's plot file, checked before anything is recorded or read: an image format matplotlib
    writes, and no folder there nor (without ``--force``) an existing file.

    Raises:
        DataError: naming ``--plot`` and the path.
    """
    from fastvision.api import refuse_overwrite
    from fastvision.utils.files import check_figure_name

    plot = Path(plot)
    refuse_overwrite(plot, force, "--plot", file=True)
    return check_figure_name(plot, "--plot")


def _cmd_monitor(args) -> int:
    if args.replot:
        if not Path(args.replot).is_file():
            raise DataError(f"--replot: monitor CSV not found: {args.replot}")
        plot = _plot_path(args.plot or Path(args.replot).with_suffix(".png"), args.force)
        print(plot_csv(args.replot, plot))
        return 0
    # the numbers before NVML is asked: a bad value is named, not hidden behind "NVML is not available" (and
    # --interval 0 would read the GPU in a busy loop, a negative one fail at the first sleep)
    check_low("--interval", args.interval, 0, inclusive=False)
    check_low("--duration", args.duration, 0, inclusive=False)
    check_low("--gpu", args.gpu, 0)
    plot = _plot_path(args.plot, args.force) if args.plot else None  # refused before recording, not after it
    csv_path = record(args.out, interval=args.interval, duration=args.duration, index=args.gpu)
    print(f"readings: {csv_path}")
    if plot:
        print(f"plot: {plot_csv(csv_path, plot)}")
    return 0


def add_profile_cli(subparsers) -> None:
    """``fastvision profile RECIPE``."""
    p = subparsers.add_parser("profile", help="time every training phase and name the bottleneck",
                              description="Run --warmup then --steps training steps of RECIPE and report "
                                          "time per phase (p50/p90/p99), images/s, GPU use and a verdict. "
                                          "With --nproc N (or under torchrun / srun) every rank profiles the same "
                                          "steps, and a table per rank names the slow rank and the phase that "
                                          "makes it slow.")
    p.add_argument("recipe")
    p.add_argument("--steps", type=int, default=20, help="profiled steps (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="steps run first and not counted (default 5)")
    p.add_argument("--nvtx", action="store_true", help="NVTX ranges per phase, transform and augment op (nsys)")
    p.add_argument("--trace", metavar="DIR", help="write a torch.profiler Chrome trace into DIR")
    p.add_argument("--synthetic", action="store_true", help="device-resident synthetic batches (no data pipeline)")
    p.add_argument("--nproc", type=int, default=1,
                   help="profile N local data-parallel workers through torch.distributed.run (as train --nproc); "
                        "adds a table per rank")
    p.add_argument("--out", help="report folder (default runs/profile-<recipe>-<time>); new or empty unless --force")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out or --trace, replacing its files")
    p.add_argument("--data", help="dataset folder (data.args.path)")
    p.add_argument("--device")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--amp", choices=AMP_MODES, help="as train's --amp (auto: bf16 where native, else fp16)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config key, dotted")
    p.set_defaults(func=_cmd_profile)


def add_monitor_cli(subparsers) -> None:
    """``fastvision monitor``."""
    p = subparsers.add_parser("monitor", help="record GPU utilisation and memory (NVML) to CSV and PNG")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between readings (default 1)")
    p.add_argument("--out", default="gpu.csv", help="CSV to append to (default gpu.csv)")
    p.add_argument("--duration", type=float, help="seconds to record (default: until Ctrl-C)")
    p.add_argument("--plot", help="also write this PNG (a new file unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --plot file")
    p.add_argument("--gpu", type=int, default=0,
                   help="CUDA device index as the job numbers it (CUDA_VISIBLE_DEVICES honoured; matched to NVML "
                        "by UUID)")
    p.add_argument("--replot", metavar="CSV",
                   help="only plot an existing CSV, to --plot (default: the CSV's name with .png, gpu.csv -> gpu.png)")
    p.set_defaults(func=_cmd_monitor)
