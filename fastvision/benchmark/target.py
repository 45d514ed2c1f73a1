"""``fastvision benchmark RECIPE --mode target``: time to a quality target over several seeds, scored
as MLPerf Training scores it.

Each seed is a real ``fastvision train`` run, in a process of its own (``--nproc N``: N workers) with
``train.seed`` set and ``train.target`` (the recipe's or ``--target``); it stops
once the target is reached. The report gives every seed's epochs and times to the target (two clocks,
as ``fit`` keeps them: the training epochs alone, and wall time since the run began), and the score:
MLPerf's olympic mean (``mlperf_logging``'s result summarizer: drop the fastest and the slowest run;
with 40 runs or more, as the 3D U-Net benchmark's 40, the 4 fastest and the 4 slowest), with the
median, the range and the spread (slowest / fastest), since convergence, not speed, moves these
numbers most (MLPerf's 3D U-Net: 2-3x run to run). A seed that does not reach the target within the
recipe's epochs is reported as such and left out of the score, which then says so.

A rerun with the same ``--out`` picks up where it stopped: a seed whose run finished is read from its
``summary.json``, an interrupted one is resumed (``--resume auto``); ``--force`` starts over. Each seed's
``train`` options are kept beside its run (``seed-S.argv.json``): a rerun with other settings (another
``--set``, ``--data`` or ``--nproc``) is refused rather than scoring runs of two settings as one.
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from fastvision.errors import ConfigError, DataError, check_low


def olympic(values: list[float]) -> tuple[float, int] | None:
    """MLPerf's olympic mean of the runs' times and how many were dropped at each end (1; 4 from 40
    runs); below 3 runs the plain mean, nothing dropped; None without runs."""
    if not values:
        return None
    drop = 4 if len(values) >= 40 else 1 if len(values) >= 3 else 0
    kept = sorted(values)[drop:len(values) - drop]
    return sum(kept) / len(kept), drop


def seed_run(train_argv: list[str], run_dir: Path, seed: int, target: str, force: bool) -> dict[str, Any]:
    """One seed's run to the target, ``fastvision train`` in a process of its own (as MLPerf runs each
    run: every one pays the same start-up, none inherits another's warm caches); its ``summary.json``
    (read back when the run finished earlier; an interrupted one is resumed)."""
    import subprocess

    from fastvision.utils.files import atomic_text

    done, record = run_dir / "summary.json", run_dir.with_name(f"{run_dir.name}.argv.json")
    if run_dir.exists() and force:
        shutil.rmtree(run_dir)
    if force:
        record.unlink(missing_ok=True)
    if run_dir.exists() and record.is_file():  # read back or resumed: only a run of these very settings
        if (ran := json.loads(record.read_text())) != train_argv:
            raise ConfigError(f"{run_dir}: a run of other settings ({_changed(ran, train_argv)}); pass --force to "
                              "start the seeds over, or another --out")
    if done.is_file():
        import yaml

        saved = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("train") or {}
        if saved.get("target") != target or saved.get("seed") != seed:
            raise ConfigError(f"{run_dir}: a finished run of another target or seed ({saved.get('target')}, "
                              f"seed {saved.get('seed')}); pass --force to start the seeds over, or another --out")
        return json.loads(done.read_text())
    resume = ["--resume", "auto"] if (run_dir / "checkpoints").is_dir() else []
    made = not run_dir.parent.exists()
    atomic_text(record, json.dumps(train_argv) + "\n")  # what a rerun with this --out compares its own with
    cmd = [sys.executable, "-m", "fastvision.cli", *train_argv, "--out", str(run_dir), "--seed", str(seed),
           "--target", target, *resume]
    rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode  # its log on stderr, as train's
    if rc != 0 or not done.is_file():
        if not run_dir.exists():  # refused before it began (a bad --target): leave no record, no empty --out
            record.unlink(missing_ok=True)
            if made and not any(run_dir.parent.iterdir()):
                run_dir.parent.rmdir()
        raise SeedFailed(rc or 1)
    return json.loads(done.read_text())


def _changed(ran: list[str], now: list[str]) -> str:
    """``train_argv`` of a seed's earlier run against this one's, as the options that differ."""
    def options(argv: list[str]) -> list[str]:
        return [f"recipe {argv[1]}", *(f"{a} {b}" for a, b in zip(argv[2::2], argv[3::2], strict=False))]

    before, after = options(ran), options(now)
    gone, added = [o for o in before if o not in after], [o for o in after if o not in before]
    return f"it ran with {', '.join(gone) or 'no other option'}; this one has {', '.join(added) or 'none of them'}"


class SeedFailed(Exception):
    """A seed's ``fastvision train`` ended without its summary: its exit status (``code``); its own
    error is what it printed."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def run_target_benchmark(train_argv: list[str], recipe: str, target: str | None, seeds: list[int], out: Path,
                         sets: list[dict], force: bool = False) -> dict[str, Any]:
    """Every seed's run (``fastvision train`` + ``train_argv``) to ``target`` (None: the recipe's
    ``train.target``) under ``out/seed-S``, and the score."""
    from fastvision import config

    cfg = config.load(recipe, sets)  # the recipe and --set checked here: one line before any run
    target = target or cfg.train.target
    if not target:
        raise ConfigError(f"--mode target: {recipe} has no train.target; give one, e.g. --target "
                          f"{'iou=0.9' if 'unet2d' in recipe else 'METRIC=VALUE'}")
    rows = []
    for seed in seeds:
        s = seed_run(train_argv, out / f"seed-{seed}", seed, target, force)
        rows.append({"seed": seed, "reached": bool(s.get("target_reached")), "epochs": s.get("target_epoch"),
                     "train_s": s.get("time_to_target_s"), "wall_s": s.get("time_to_target_wall_s"),
                     "epochs_run": s.get("epochs"), "global_batch": s.get("global_batch"),
                     "items_per_epoch": _items(s), "run": str(out / f"seed-{seed}")})
        # a count of epochs, not the epoch's number (train's log numbers them from 0)
        how = (f"reached after {rows[-1]['epochs']} epoch(s), {rows[-1]['wall_s']:.1f} s wall" if rows[-1]["reached"]
               else f"not reached in {rows[-1]['epochs_run']} epochs")
        print(f"seed {seed}: {target} {how}", flush=True)
    return {"recipe": recipe, "target": target, "seeds": seeds, "rows": rows, **score(rows)}


def _items(summary: dict) -> int | None:
    """Items one epoch of the run trained (steps x global batch), None for a run from before its
    summary recorded them."""
    steps, batch = summary.get("steps_per_epoch"), summary.get("global_batch")
    return steps * batch if steps and batch else None


def score(rows: list[dict]) -> dict[str, Any]:
    """The summary of the seeds that reached the target: MLPerf's olympic mean of the wall times, the
    median, range and spread of both clocks, the epochs' median."""
    reached = [r for r in rows if r["reached"]]
    out: dict[str, Any] = {"reached": len(reached), "runs": len(rows)}
    for clock in ("wall_s", "train_s"):
        times = [r[clock] for r in reached]
        if times:
            mean, drop = olympic(times)
            out[clock] = {"olympic_mean": mean, "dropped_each_end": drop, "median": statistics.median(times),
                          "min": min(times), "max": max(times), "spread": max(times) / min(times)}
    if reached:
        out["epochs_median"] = statistics.median(r["epochs"] for r in reached)
    for key in ("global_batch", "items_per_epoch"):  # what the epochs are in, for `plan --epochs-from`
        seen = {r.get(key) for r in rows}
        out[key] = seen.pop() if len(seen) == 1 else None
    return out


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table per seed and a score line."""
    lines = [f"# {report['recipe']}: time to {report['target']} over {report['runs']} seeds", "",
             "| seed | reached | epochs | training s | wall s |", "|---|---|---|---|---|"]
    for r in report["rows"]:
        if r["reached"]:
            lines.append(f"| {r['seed']} | yes | {r['epochs']} | {r['train_s']:.1f} | {r['wall_s']:.1f} |")
        else:
            lines.append(f"| {r['seed']} | no (ran {r['epochs_run']} epochs) | - | - | - |")
    lines += ["", score_line(report)]
    return "\n".join(lines) + "\n"


def score_line(report: dict[str, Any]) -> str:
    w = report.get("wall_s")
    if not w:
        return f"no seed reached {report['target']}: no score"
    drop = w["dropped_each_end"]
    how = f"olympic mean (fastest and slowest {drop} dropped)" if drop else "mean (under 3 runs: nothing dropped)"
    line = (f"score: {w['olympic_mean']:.1f} s wall to {report['target']}, MLPerf's {how}; median "
            f"{w['median']:.1f} s, {w['min']:.1f}-{w['max']:.1f} s (spread {w['spread']:.2f}x); median "
            f"{report['epochs_median']:g} epochs; training epochs alone: median {report['train_s']['median']:.1f} s")
    if report["reached"] < report["runs"]:
        line += (f"; {report['runs'] - report['reached']} of {report['runs']} seeds did not reach the target "
                 "(left out: MLPerf counts only converged runs)")
    return line


def plot(report: dict[str, Any], path: Path) -> None:
    """Each seed's wall time to the target as a point, with the median and the olympic mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastvision.utils.files import save_figure

    reached = [r for r in report["rows"] if r["reached"]]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.scatter([r["wall_s"] for r in reached], [0] * len(reached), s=40, alpha=0.7, label="a seed's run")
    if reached:
        w = report["wall_s"]
        ax.axvline(w["median"], color="grey", ls="--", label=f"median {w['median']:.1f} s")
        ax.axvline(w["olympic_mean"], color="C3", label=f"olympic mean {w['olympic_mean']:.1f} s")
    ax.set_yticks([])
    ax.set_xlabel(f"wall seconds to {report['target']}")
    ax.set_title(f"{report['recipe']}: {report['reached']} of {report['runs']} seeds reached the target")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def cmd_target(args, sets: list[dict]) -> int:
    """``benchmark --mode target``: the seeds' runs, the report (JSON, Markdown, PNG) in ``--out``."""
    from fastvision.distributed import detect_env
    from fastvision.utils.files import atomic_text

    check_low("--seeds", args.seeds, 1)
    check_low("--nproc", args.nproc, 1)
    if detect_env().world_size > 1:
        raise ConfigError("benchmark --mode target starts each seed's training itself: run it without "
                          "torchrun/srun, with --nproc N for N workers per run")
    out = args.out or Path("runs/benchmark") / f"{Path(args.recipe).stem}-target"
    stem = out / f"{Path(args.recipe).stem}-target"
    if out.is_dir():  # the seeds' runs and this report only: not a user's other folder
        other = [p.name for p in out.iterdir() if not (p.name.startswith("seed-") or p.name.startswith(stem.name))]
        if other:
            raise DataError(f"--out {out}: holds files that are not this benchmark's ({', '.join(sorted(other)[:3])}); "
                            "choose another --out")
    train_argv = ["train", args.recipe, "--device", args.device, *(["--data", args.data] if args.data else []),
                  *(["--nproc", str(args.nproc)] if args.nproc > 1 else []),
                  *[a for s in args.set for a in ("--set", s)]]
    if args.data:
        sets = [{"data": {"args": {"path": args.data}}}, *sets]
    try:
        report = run_target_benchmark(train_argv, args.recipe, args.target,
                                      list(range(args.seed, args.seed + args.seeds)), out, sets, force=args.force)
    except SeedFailed as e:  # a bad setting (2) was the run's own one line; anything else is named here
        if e.code != 2:
            print(f"fastvision: error: a seed's `fastvision train` exited with code {e.code} (its error is above); "
                  f"{out} keeps what it wrote: rerun to resume it", file=sys.stderr)
        return e.code
    report["nproc"] = args.nproc
    # each file whole or as it was: a stop while writing never leaves half a report
    atomic_text(stem.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    atomic_text(stem.with_suffix(".md"), markdown(report))
    plot(report, stem.with_suffix(".png"))
    print(markdown(report), end="")
    print(f"wrote {stem}.json, .md and .png")
    return 0 if report["reached"] else 1
