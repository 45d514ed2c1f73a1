"""Data-parallel scaling: the ``fastvision scale`` sweep and its CLI.

* The linear LR scaling rule and its warm-up are :func:`fastvision.optim.effective_lr` and
  :func:`fastvision.optim.lr_lambda`, the ones training runs.
* :func:`sweep`: train a recipe at every world size, ``--repeats`` runs with different seeds each.
* The report (:mod:`fastvision.scaling.report`): ``scaling.csv/json/md/png`` with mean +- std.
* The simulator (:mod:`fastvision.scaling.simulator`, re-exported here): predicted speed-up per GPU count
  with the binding limit (compute, input pipeline, communication), from a hardware profile.
"""
from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastvision.scaling.report import (
    FIELDS,
    implausible,
    markdown_table,
    plot_simulation,
    plot_sweep,
    summarize,
    write_report,
    write_text,
)
from fastvision.scaling.simulator import (
    BACKENDS,
    DEFAULT_WORKERS,
    LINKS,
    Backend,
    Hardware,
    InputPipeline,
    Link,
    StepProfile,
    allreduce_s,
    bucket_count,
    hardware_presets,
    load_hardware,
    predict_step_time,
    ring_allreduce_s,
    simulate,
    simulation_markdown,
    tree_allreduce_s,
    with_link,
)

log = logging.getLogger(__name__)

__all__ = ["BACKENDS", "FIELDS", "LINKS", "Backend", "Hardware", "InputPipeline", "Link", "StepProfile", "add_cli",
           "allreduce_s", "bucket_count", "hardware_presets", "load_hardware", "markdown_table", "plot_simulation",
           "plot_sweep", "predict_step_time", "read_run", "ring_allreduce_s",
           "simulate", "simulation_markdown", "summarize", "sweep", "train_args", "tree_allreduce_s",
           "with_link", "write_report"]


# --------------------------------------------------------------------------- runs and CLI


def read_run(run_dir: Path, metric: str | None = None) -> dict[str, Any]:
    """Time per epoch, images/s and the final metric of a finished run, from its ``metrics.jsonl``.

    The first epoch is dropped from the timing when there are more (warm-up: allocator, caches).
    ``metric`` defaults to the summary's ``best_<name>`` key. Gradient bytes come from the last
    checkpoint (floating-point tensors that are not BatchNorm statistics).
    """
    run_dir = Path(run_dir)
    epochs, summary, device = [], {}, None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev.get("step") == "PARAMETER" and isinstance(ev.get("data", {}).get("environment"), dict):
            device = ev["data"]["environment"].get("device")  # what measured the step (--simulate says)
        elif isinstance(ev.get("step"), list) and len(ev["step"]) == 1:
            epochs.append(ev["data"])
        elif ev.get("step") == []:
            summary = ev["data"]
    if not epochs:
        raise ValueError(f"{run_dir}/metrics.jsonl has no epoch events")
    timed = epochs[1:] if len(epochs) > 1 else epochs
    if metric is None:
        metric = next((k[5:] for k in summary if k.startswith("best_")), None)
    last_metric = next((e[metric] for e in reversed(epochs) if metric and e.get(metric) is not None), None)
    out = {"time_per_epoch_s": statistics.median(e["epoch_time_s"] for e in timed),
           "images_per_s": statistics.median(e["images_per_s"] for e in timed),
           "metric_name": metric or "", "metric": last_metric, **({"device": device} if device else {})}
    ckpt = run_dir / "checkpoints" / "last.pt"
    if ckpt.exists():
        import torch

        state = torch.load(ckpt, map_location="cpu", weights_only=True)["model"]
        out["grad_bytes"] = sum(t.numel() * t.element_size() for k, t in state.items()
                                if t.is_floating_point() and not k.endswith(("running_mean", "running_var")))
    return out


def sweep(recipe: str, workers: Sequence[int], out_dir: Path, *, mode: str = "weak", epochs: int = 2,
          repeats: int = 1, backends: Sequence[str] = ("ddp",), extra: Sequence[str] = (),
          seed: int = 0, force: bool = False) -> list[dict[str, Any]]:
    """Train ``recipe`` at every worker count (``fastvision train --nproc N``) and collect results.

    Strong mode keeps the 1-worker global batch: the per-worker batch is divided by ``N``.
    ``extra`` holds ``fastvision train`` options as ``--flag value`` pairs (``--set``, ``--data``).
    Repeat ``r`` trains with seed ``seed + r`` at every world size (as seed 001 repeats with
    different seeds), so the spread over repeats includes the seed's effect on the metric.
    A run finished in ``out_dir`` with the same settings is reused; ``force``: train every run again
    (:mod:`fastvision.scaling.rerun`).
    """
    from fastvision.config import load, parse_override

    # The per-worker batch comes from the recipe with the caller's --set overrides; a --set of
    # train.batch_size is consumed here, else it would override the --batch-size given to each run.
    pairs = list(zip(extra[::2], extra[1::2], strict=True))
    batch = load(recipe, [parse_override(v) for k, v in pairs if k == "--set"]).train.batch_size
    extra = [a for k, v in pairs if not (k == "--set" and v.startswith("train.batch_size=")) for a in (k, v)]
    results = []
    for backend in backends:
        for n in workers:
            if mode == "strong" and batch % n:
                log.warning("strong scaling: batch %d does not split over %d workers; skipped", batch, n)
                continue
            per_worker = batch if mode == "weak" else batch // n
            for rep in range(repeats):
                run_dir = Path(out_dir) / f"{backend}-{n}-r{rep}"
                cmd = ["train", recipe, "--nproc", str(n), "--out", str(run_dir), "--epochs", str(epochs),
                       "--batch-size", str(per_worker), "--seed", str(seed + rep), *extra]
                _train(cmd + (["--backend", backend] if backend != "ddp" else []), out_dir, run_dir, force)
                results.append({"backend": backend, "mode": mode, "workers": n, "seed": seed + rep,
                                "global_batch": per_worker * n, **read_run(run_dir)})
    return results


def _train(cmd: list[str], out_dir: Path, run_dir: Path, force: bool) -> None:
    """Run ``fastvision CMD`` (a ``train`` command) unless ``run_dir`` holds its finished run."""
    import os
    import sys

    from fastvision.distributed.launch import run_forwarding
    from fastvision.errors import FastvisionError, Preempted
    from fastvision.scaling import rerun

    if rerun.prepare(out_dir, run_dir, cmd, force):
        return
    log.info("scale: fastvision %s", " ".join(cmd))
    # a signal to scale (kill PID, Ctrl-C) goes on to the run, which stops its workers; before, scale died
    # alone and the run's launcher and workers trained on without it
    rc = run_forwarding([sys.executable, "-m", "fastvision.cli", *cmd], os.environ)
    if rc > 128:  # the run stopped on a signal (it said so): the sweep stops as it did
        raise Preempted(rc - 128, f"scale: stopped during {run_dir.name}; the same command continues the sweep "
                                  "(finished runs are reused, this one is trained again)")
    if rc != 0:  # it printed its error
        raise FastvisionError(f"scale: the run {run_dir.name} failed: fastvision {' '.join(cmd)}")


def add_cli(subparsers) -> None:
    """``fastvision scale``: a world-size sweep of a recipe, or the simulator alone."""
    p = subparsers.add_parser("scale", help="data-parallel scaling study: sweep world sizes, or --simulate",
                              description="Train a recipe at several world sizes (mean +- std over --repeats seeds), "
                                          "and/or predict speed-up on 1..1024 GPUs with the binding limit per count.")
    p.add_argument("recipe", nargs="?", help="recipe to sweep (not needed with --simulate and --compute-ms)")
    p.add_argument("--workers", default="1,2", help="comma-separated world sizes (default 1,2)")
    p.add_argument("--mode", choices=["weak", "strong"], default="weak",
                   help="weak (default): the recipe's per-worker batch at every world size, as seed 001; strong: "
                        "its global batch divided over the workers")
    p.add_argument("--epochs", type=int, default=3,
                   help="epochs per run (default 3); the timing is the median of the epochs after the first "
                        "(warm-up), so fewer than 3 is warned about")
    p.add_argument("--repeats", type=int, default=1, help="runs per world size, with seeds --seed, --seed+1, ...")
    p.add_argument("--seed", type=int, default=0, help="seed of the first repeat (default 0)")
    p.add_argument("--backends", default="ddp", help="comma-separated: ddp (default), horovod (after `make horovod`)")
    p.add_argument("--out", type=Path, default=Path("runs/scaling"),
                   help="report folder, one run folder per world size and repeat (default runs/scaling). Run again "
                        "with the same settings (after Ctrl-C, say), it reuses the runs that finished and trains "
                        "the rest; a run folder of other settings needs --force")
    p.add_argument("--force", action="store_true", help="train every run again, replacing its folder in --out")
    p.add_argument("--data", help="dataset folder for every run (data.args.path)")
    p.add_argument("--device", help="device for every run: auto, cpu, cuda")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override passed to every run, as in `fastvision train --set` (repeatable)")
    s = p.add_argument_group("simulator (--simulate)")
    s.add_argument("--simulate", action="store_true", help="predict speed-up for 1..1024 GPUs")
    s.add_argument("--compute-ms", type=float, help="measured single-GPU step in ms (forward+backward+overhead)")
    s.add_argument("--batch", type=int, default=16, help="per-GPU batch of --compute-ms")
    s.add_argument("--grad-mb", type=float, help="gradient MB (1e6 bytes) all-reduced per step")
    s.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size in MiB")
    s.add_argument("--overhead-ms", type=float, default=0.0,
                   help="part of --compute-ms that does not scale with the batch (launches, optimizer); "
                        "matters for strong scaling")
    s.add_argument("--hardware", default="dgx-a100,dgx-h100,pcie-node",
                   help="comma-separated hardware profiles: presets "
                        f"({', '.join(hardware_presets())}) or YAML files "
                        "(format: fastvision/scaling/hardware/dgx-a100.yaml)")
    s.add_argument("--links", help=f"old form instead of --hardware: link presets ({', '.join(LINKS)}) between nodes "
                                   "of --gpus-per-node GPUs on NVLink, no host limit")
    s.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node with --links")
    s.add_argument("--input-rate", type=float,
                   help="host input path: items/s per loader process (or per core without --input-workers)")
    s.add_argument("--input-json", type=Path, help="read --input-rate from `fastvision benchmark RECIPE --mode data`: "
                                                   "its items/s per host core (a fully busy loader process)")
    s.add_argument("--input-workers", type=int, help="loader processes per GPU (default: a pool over all cores)")
    s.add_argument("--dali", action="store_true", help="GPU-side decode (DALI 'mixed'): no host input limit")
    s.add_argument("--sync", default="ddp", choices=sorted(BACKENDS),
                   help="gradient sync: ddp, horovod (>= 0.21: 1 ms cycle, 128 MB fusion), horovod-0.20 (5 ms, 64 MB)")
    s.add_argument("--algo", default="auto", choices=["auto", "ring", "tree", "sharp", "nvls"],
                   help="NCCL algorithm beyond a node (sharp: in-network reduction, where the fabric has it; nvls: "
                        "NVLink SHARP inside the node, needs node.intra.nvls_gbps)")
    s.add_argument("--gpus", type=int, help="draw the curve from 1 GPU to this count (default 1024)")
    s.add_argument("--jitter-ms", type=float, help="per-rank step-time jitter for the stragglers term "
                                                   "(default: the value fitted on the MLPerf anchors)")
    s.add_argument("--anchors", help="overlay the published rows of anchors.yaml for this workload, e.g. resnet50 "
                                     "(their efficiency against their own reference, x GPUs)")
    p.set_defaults(func=_cli)


def train_args(args) -> list[str]:
    """The ``fastvision train`` options a ``scale`` command passes on to every run."""
    out = [a for flag in ("data", "device") if getattr(args, flag) for a in (f"--{flag}", getattr(args, flag))]
    return out + [a for s in args.set for a in ("--set", s)]


def _pipeline(args) -> InputPipeline | None:
    """The host input path of the ``scale --simulate`` options (``None``: no host limit)."""
    if args.dali:
        return InputPipeline("dali", device="gpu")
    rate, workers = args.input_rate, args.input_workers
    if args.input_json:
        from fastvision.benchmark.data import read_input_rate

        rate, what = read_input_rate(args.input_json, "--input-json")
        log.info("input path: %.1f items/s per core from %s (%s)", rate, args.input_json, what)
    return InputPipeline("cpu", "cpu", rate, workers) if rate else None


def _counts(top: int | None) -> list[int]:
    """GPU counts 1, 2, 4, ... up to ``top`` and ``top`` itself (default: up to 1024)."""
    from fastvision.errors import ConfigError

    if top is None:
        return list(DEFAULT_WORKERS)
    if top < 1:
        raise ConfigError(f"--gpus {top}: must be >= 1")
    counts = [n for n in (2**i for i in range(40)) if n <= top]
    return counts + ([top] if counts[-1] != top else [])


def _jitter_ms(args) -> float:
    """The stragglers' per-rank jitter: given, or fitted on the MLPerf anchors (validation.fitted)."""
    from fastvision.errors import ConfigError
    from fastvision.scaling.validation import fitted

    if args.jitter_ms is None:
        return fitted()["jitter_ms"]
    if args.jitter_ms < 0:
        raise ConfigError(f"--jitter-ms {args.jitter_ms}: must be >= 0")
    return args.jitter_ms


def _published(workload: str, top: int, hardware: set[str]) -> list[dict[str, Any]]:
    """Published anchor points of ``workload`` on the drawn ``hardware`` up to ``top`` GPUs, as speed-up =
    efficiency x GPUs, each with the model's own prediction for that row (its per-GPU batch)."""
    from fastvision.errors import ConfigError
    from fastvision.scaling.validation import validate

    rows = [r for r in validate() if r["workload"] == workload and r["gpus"] <= top and r["hardware"] in hardware]
    if not rows:
        raise ConfigError(f"--anchors {workload!r}: no published row of that workload on {', '.join(sorted(hardware))} "
                          f"up to {top} GPUs")
    return [{"workers": r["gpus"], "speedup": r["published_efficiency"] * r["gpus"],
             "predicted": r["predicted_efficiency"] * r["gpus"], "label": f"{r['id']} (bs {r['batch']})"}
            for r in rows]


def _targets(args) -> list[Hardware | Link]:
    """What ``--simulate`` draws: the ``--links`` presets (old form), else the ``--hardware`` profiles."""
    from fastvision.errors import ConfigError

    if not args.links:
        return [load_hardware(h) for h in args.hardware.split(",")]
    for name in args.links.split(","):
        if name not in LINKS:
            raise ConfigError(f"--links: unknown link {name!r}; valid: {', '.join(LINKS)}")
    return [LINKS[name] for name in args.links.split(",")]


def _step_profile(args, results: list[dict[str, Any]]) -> StepProfile:
    """The single-GPU step to simulate: ``--compute-ms`` and ``--grad-mb``, else the sweep's 1-worker runs."""
    from fastvision.errors import ConfigError

    if args.compute_ms is not None and args.grad_mb is not None:
        step, batch, grad = args.compute_ms / 1e3, args.batch, args.grad_mb * 1e6
    else:
        one = [r for r in results if r["workers"] == 1 and r.get("grad_bytes")]
        if not one:
            raise ConfigError("--simulate needs --compute-ms and --grad-mb, or a sweep that includes 1 worker")
        batch = one[0]["global_batch"]
        step = batch / statistics.fmean(r["images_per_s"] for r in one)
        grad = one[0]["grad_bytes"]
    overhead = args.overhead_ms / 1e3
    if not 0 <= overhead < step:
        raise ConfigError(f"--overhead-ms {args.overhead_ms}: must be >= 0 and below the step "
                          f"({step * 1e3:.1f} ms)")
    jitter = _jitter_ms(args)
    return StepProfile(compute_s=step - overhead, batch=batch, grad_bytes=grad,
                       buckets=bucket_count(grad, args.bucket_mb), overhead_s=overhead, jitter_s=jitter / 1e3)


def _not_a_gpu_step(args, results: list[dict[str, Any]], prof: StepProfile) -> str:
    """The warning where ``--simulate`` takes its step from a sweep's 1-worker run that was not on a GPU
    (a CPU sweep): the GPU profiles then scale a CPU step, whose length hides the communication."""
    devices = {r.get("device") for r in results if r["workers"] == 1} if args.compute_ms is None else set()
    other = sorted(str(d) for d in devices if d and not str(d).startswith("cuda"))
    if not other:
        return ""
    note = (f"the simulated step ({(prof.compute_s + prof.overhead_s) * 1e3:.0f} ms at batch {prof.batch:g}) is the "
            f"1-worker run's on {', '.join(other)}, not a GPU's: the GPU profiles' speed-ups assume that step, so the "
            "all-reduce looks smaller than it is; sweep on the GPU, or give --compute-ms and --grad-mb of a GPU step")
    log.warning("scale --simulate: %s", note)
    return note


def _simulate_cli(args, results: list[dict[str, Any]], targets: list[Hardware | Link], out: Path) -> None:
    """``scale --simulate``: write and print ``simulation.md/json/png``, and give each sweep result
    its ``predicted_speedup`` on the first target."""
    prof = _step_profile(args, results)
    note = _not_a_gpu_step(args, results, prof)
    pipe = _pipeline(args)
    counts = _counts(args.gpus)
    published = _published(args.anchors, max(counts), {getattr(t, "name", "") for t in targets}) \
        if args.anchors else ()
    rows = [r for t in targets for r in simulate(prof, t, counts, mode=args.mode, gpus_per_node=args.gpus_per_node,
                                                 pipeline=pipe, backend=args.sync, algo=args.algo)]
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "simulation.md", simulation_markdown(rows) + (f"\n**{note}**\n" if note else ""))
    write_text(out / "simulation.json", json.dumps(
        {"profile": prof.__dict__, "pipeline": pipe.__dict__ if pipe else None, "sync": args.sync,
         "hardware": [t.__dict__ if isinstance(t, Link) else _hw_dict(t) for t in targets], "rows": rows},
        indent=2))
    pred = {r["workers"]: r["speedup"] for r in rows if r["link"] == rows[0]["link"]}
    for r in results:
        r["predicted_speedup"] = pred.get(r["workers"])
    plot_simulation(rows, out / "simulation.png", measured=summarize(results) if results else (),
                    published=published)
    print((out / "simulation.md").read_text())  # the CLI's output, not library logging
    print(f"simulation: {out / 'simulation.json'}, {out / 'simulation.png'}")


def _cli(args) -> int:
    from fastvision.errors import ConfigError
    from fastvision.scaling.checks import check_args, sweep_backends, world_sizes

    check_args(args)
    out = Path(args.out)
    workers = world_sizes(args)
    targets = _targets(args)
    if args.simulate and (args.compute_ms is None or args.grad_mb is None) and not (
            args.recipe and args.compute_ms is None and 1 in workers):  # said before any run trains
        raise ConfigError("--simulate needs --compute-ms and --grad-mb, or a sweep that includes 1 worker "
                          f"(--workers {args.workers})")
    results = []
    if args.recipe and not (args.simulate and args.compute_ms):
        backends = sweep_backends(args, workers)
        if args.epochs < 3:  # read_run drops the first epoch (warm-up) when there are more
            log.warning("scale: --epochs %d times %s per run: one noisy epoch decides the speed-up; use --epochs 3 "
                        "or more (or --repeats)", args.epochs, "the warm-up epoch" if args.epochs == 1 else
                        "1 epoch after the warm-up")
        results = sweep(args.recipe, workers, out, mode=args.mode, epochs=args.epochs, repeats=args.repeats,
                        backends=backends, extra=train_args(args), seed=args.seed,
                        force=args.force)
    if args.simulate:
        _simulate_cli(args, results, targets, out)
    if results:
        paths = write_report(results, out, title=f"{args.recipe} {args.mode} scaling")
        print(paths["md"].read_text())  # the CLI's output, not library logging
        if implausible(summarize(results)):
            log.warning("scale: %s", implausible(summarize(results)))
    return 0


def _hw_dict(hw: Hardware) -> dict[str, Any]:
    d = dict(hw.__dict__)
    d["intra"], d["nic"], d["sources"] = hw.intra.__dict__, hw.nic.__dict__, list(hw.sources)
    return d
