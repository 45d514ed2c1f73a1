"""Data-parallel scaling: LR scaling, a speed-up simulator, and the sweep report.

Three parts, used by ``fastvision scale``:

* :func:`scaled_lr` / :func:`warmup_lr`: the linear scaling rule and its warm-up ramp.
* The simulator (:func:`predict_step_time`, :func:`simulate`) predicts the step time of synchronous
  data parallelism on ``N`` GPUs from one measured single-worker step and a link profile.
* The report (:func:`summarize`, :func:`write_report`): ``scaling.csv``, ``scaling.json``,
  ``scaling.md`` and ``scaling.png`` (speed-up with the ideal line, parallel efficiency, and the
  metric against workers on a second axis, as in seed 001's figure).

Simulator model (all times in seconds, sizes in bytes):

1. The measured step is ``forward + backward`` compute ``C`` at per-worker batch ``b``; the backward
   pass is the fraction ``f_b`` of it (about 2/3: backward costs about twice the forward).
   Compute is linear in the per-worker batch (weak scaling keeps ``b``; strong scaling uses
   ``b / N``). ``optimizer_s`` and ``overhead_s`` are per step and do not depend on the batch.
2. Gradients (``G`` bytes) travel in ``K`` equal buckets. Bucket ``i`` is ready at
   ``t_f + (i + 1) * t_b / K`` during backward and is all-reduced by a ring:
   ``2 (N - 1) / N * (G / K) / bandwidth + 2 (N - 1) * latency``. Buckets are reduced one after
   another on one communication stream, each starting when it is ready and the previous one is
   done. When a bucket's reduction is shorter than the backward time between buckets, only the
   last bucket's communication is exposed; otherwise the step is communication-bound.
3. Up to ``gpus_per_node`` workers use the intra-node link (NVLink); beyond, the ring crosses nodes
   and every step runs at the inter-node link's bandwidth and latency.
4. ``speedup(N) = throughput(N) / throughput(1)``, ``efficiency = speedup / N``. One worker has no
   communication (DDP with one process does not all-reduce).
"""
from __future__ import annotations

import csv
import json
import logging
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- learning rate


def scaled_lr(base_lr: float, global_batch: int, ref_batch: int) -> float:
    """Linear scaling rule (Goyal et al. 2017): ``base_lr * global_batch / ref_batch``.

    Args:
        base_lr: learning rate the recipe states for ``ref_batch`` images per optimizer step.
        global_batch: images per optimizer step over all workers (per-worker batch x workers x accum).
        ref_batch: the reference global batch of ``base_lr``.
    """
    if global_batch <= 0 or ref_batch <= 0:
        raise ValueError(f"batches must be positive, got global {global_batch}, reference {ref_batch}")
    return base_lr * global_batch / ref_batch


def warmup_lr(step: int, warmup_steps: int, start_lr: float, target_lr: float) -> float:
    """Linear ramp from ``start_lr`` at step 0 to ``target_lr`` at ``warmup_steps`` (then constant)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return target_lr
    return start_lr + (target_lr - start_lr) * step / warmup_steps


# --------------------------------------------------------------------------- simulator


@dataclass(frozen=True)
class Link:
    """An interconnect as seen by one ring all-reduce step.

    Attributes:
        name: preset name.
        bandwidth_gbps: achievable per-GPU bandwidth in GB/s (1e9 bytes/s) on this link.
        latency_us: per-hop latency in microseconds (wire + software).
    """

    name: str
    bandwidth_gbps: float
    latency_us: float


# Rough, documented presets: NVLink 3 (A100, NVSwitch; NCCL bus bandwidth about 230 GB/s),
# HDR InfiniBand 200 Gb/s per GPU (about 23 GB/s achieved), 25 Gb Ethernet with TCP (about 2.8 GB/s).
LINKS: dict[str, Link] = {
    "nvlink": Link("nvlink", 230.0, 3.0),
    "infiniband": Link("infiniband", 23.0, 6.0),
    "ethernet": Link("ethernet", 2.8, 35.0),
}


@dataclass(frozen=True)
class StepProfile:
    """One measured single-worker training step.

    Attributes:
        compute_s: forward + backward time at per-worker batch ``batch``.
        batch: per-worker batch of the measurement.
        grad_bytes: bytes of gradients all-reduced per step (trainable parameters x element size).
        buckets: number of DDP gradient buckets (about ``ceil(grad_bytes / bucket_cap)``).
        backward_fraction: share of ``compute_s`` spent in backward.
        optimizer_s: optimizer step time (independent of the batch).
        overhead_s: other per-step time independent of the batch (data, launch latency).
    """

    compute_s: float
    batch: int
    grad_bytes: float
    buckets: int = 1
    backward_fraction: float = 2 / 3
    optimizer_s: float = 0.0
    overhead_s: float = 0.0


def bucket_count(grad_bytes: float, bucket_cap_mb: float = 25.0) -> int:
    """DDP-like bucket count for ``grad_bytes`` with buckets of ``bucket_cap_mb`` MiB."""
    return max(1, math.ceil(grad_bytes / (bucket_cap_mb * 2**20)))


def ring_allreduce_s(nbytes: float, workers: int, link: Link) -> float:
    """Ring all-reduce time: ``2 (N-1)/N * bytes / bw + 2 (N-1) * latency`` (0 for one worker)."""
    if workers <= 1:
        return 0.0
    steps = 2 * (workers - 1)
    return steps / workers * nbytes / (link.bandwidth_gbps * 1e9) + steps * link.latency_us * 1e-6


def predict_step_time(profile: StepProfile, workers: int, link: Link, *, mode: str = "weak",
                      gpus_per_node: int = 8, intra: Link = LINKS["nvlink"]) -> dict[str, float]:
    """Predicted step time of ``workers`` synchronous data-parallel workers.

    Args:
        profile: the measured single-worker step.
        workers: number of workers ``N``.
        link: inter-node link, used once ``N > gpus_per_node``.
        mode: ``"weak"`` (per-worker batch fixed) or ``"strong"`` (global batch = ``profile.batch``).
        gpus_per_node: workers that share the intra-node link.
        intra: intra-node link.

    Returns:
        ``step_s`` (step time), ``comm_s`` (total all-reduce time), ``exposed_comm_s`` (the part not
        hidden behind backward), ``per_worker_batch``, ``images_per_s``.
    """
    if mode not in ("weak", "strong"):
        raise ValueError(f"mode must be 'weak' or 'strong', got {mode!r}")
    per_worker = profile.batch if mode == "weak" else profile.batch / workers
    compute = profile.compute_s * per_worker / profile.batch
    t_b = compute * profile.backward_fraction
    t_f = compute - t_b
    use = intra if workers <= gpus_per_node else link
    k = max(1, profile.buckets)
    c = ring_allreduce_s(profile.grad_bytes / k, workers, use)
    done = t_f  # end of the previous bucket's all-reduce
    for i in range(k):
        done = max(t_f + (i + 1) * t_b / k, done) + c
    end = max(compute, done)
    step = end + profile.optimizer_s + profile.overhead_s
    return {"step_s": step, "comm_s": k * c, "exposed_comm_s": end - compute,
            "per_worker_batch": per_worker, "images_per_s": per_worker * workers / step}


def simulate(profile: StepProfile, link: Link, workers: Sequence[int] = tuple(2**i for i in range(11)), *,
             mode: str = "weak", gpus_per_node: int = 8, intra: Link = LINKS["nvlink"]) -> list[dict[str, Any]]:
    """Predicted speed-up and efficiency for each worker count (default 1, 2, 4, ..., 1024).

    In strong mode worker counts above the global batch are skipped (less than one image each).
    """
    base = predict_step_time(profile, 1, link, mode=mode, gpus_per_node=gpus_per_node, intra=intra)
    rows = []
    for n in workers:
        if mode == "strong" and n > profile.batch:
            continue
        p = predict_step_time(profile, n, link, mode=mode, gpus_per_node=gpus_per_node, intra=intra)
        speedup = p["images_per_s"] / base["images_per_s"]
        rows.append({"link": link.name, "workers": n, "mode": mode, **p,
                     "speedup": speedup, "efficiency": speedup / n})
    return rows


def simulation_markdown(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`simulate` rows (one column group per link)."""
    lines = ["| link | workers | step (ms) | exposed comm (ms) | images/s | speed-up | efficiency |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['link']} | {r['workers']} | {r['step_s'] * 1e3:.2f} | {r['exposed_comm_s'] * 1e3:.2f} "
                     f"| {r['images_per_s']:.1f} | {r['speedup']:.2f} | {r['efficiency']:.1%} |")
    return "\n".join(lines) + "\n"


def plot_simulation(rows: list[dict[str, Any]], path: Path, measured: list[dict[str, Any]] = ()) -> Path:
    """Speed-up against workers (log-log) per link with the ideal line; measured points overlaid."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    links = sorted({r["link"] for r in rows}, key=[r["link"] for r in rows].index)
    top = max(r["workers"] for r in rows)
    ax.plot([1, top], [1, top], "k--", lw=1, label="ideal")
    for name in links:
        pts = [r for r in rows if r["link"] == name]
        ax.plot([r["workers"] for r in pts], [r["speedup"] for r in pts], marker=".", label=f"predicted: {name}")
    if measured:
        ax.plot([r["workers"] for r in measured], [r["speedup"] for r in measured], "ko", label="measured")
    ax.set(xscale="log", yscale="log", xlabel="workers (GPUs)", ylabel="speed-up", title="Predicted data-parallel speed-up")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


# --------------------------------------------------------------------------- sweep report

FIELDS = ["backend", "mode", "workers", "repeats", "global_batch", "time_per_epoch_s", "images_per_s",
          "speedup", "efficiency", "metric_name", "metric", "predicted_speedup"]


def summarize(results: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over repeats per ``(backend, workers)`` plus speed-up and efficiency.

    Args:
        results: one dict per run with ``workers`` and ``images_per_s`` (required), and optionally
            ``backend`` (default "ddp"), ``mode``, ``global_batch``, ``time_per_epoch_s``,
            ``metric_name``, ``metric``, ``predicted_speedup``.

    Returns:
        Rows sorted by backend then workers, with the keys of :data:`FIELDS`. The speed-up is
        relative to the same backend's smallest worker count, scaled by that count (so a sweep
        starting at 2 workers still reads as "x vs one worker" under linear scaling there).
    """
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in results:
        if "workers" not in r or "images_per_s" not in r:
            raise ValueError(f"result needs 'workers' and 'images_per_s': {r}")
        groups.setdefault((r.get("backend", "ddp"), int(r["workers"])), []).append(r)
    rows = []
    for (backend, n), runs in sorted(groups.items()):
        row = {"backend": backend, "mode": runs[0].get("mode", "weak"), "workers": n, "repeats": len(runs),
               "metric_name": runs[0].get("metric_name", "")}
        for key in ("global_batch", "time_per_epoch_s", "images_per_s", "metric", "predicted_speedup"):
            vals = [float(r[key]) for r in runs if r.get(key) is not None]
            row[key] = statistics.median(vals) if vals else None
        rows.append(row)
    for backend in {r["backend"] for r in rows}:
        mine = [r for r in rows if r["backend"] == backend]
        ref = min(mine, key=lambda r: r["workers"])
        for r in mine:
            r["speedup"] = r["images_per_s"] / ref["images_per_s"] * ref["workers"]
            r["efficiency"] = r["speedup"] / r["workers"]
    return [{k: r.get(k) for k in FIELDS} for r in rows]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`summarize` rows."""
    metric = next((r["metric_name"] for r in rows if r.get("metric_name")), "metric")
    lines = [f"| backend | workers | global batch | epoch (s) | images/s | speed-up | efficiency | {metric} | predicted |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append("| " + " | ".join([
            r["backend"], str(r["workers"]), _fmt(r["global_batch"], "{:.0f}"), _fmt(r["time_per_epoch_s"], "{:.2f}"),
            _fmt(r["images_per_s"], "{:.1f}"), _fmt(r["speedup"], "{:.2f}"), _fmt(r["efficiency"], "{:.1%}"),
            _fmt(r["metric"], "{:.4f}"), _fmt(r["predicted_speedup"], "{:.2f}")]) + " |")
    return "\n".join(lines) + "\n"


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
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    paths["json"].write_text(json.dumps({"title": title, "rows": rows, "runs": results}, indent=2))
    paths["md"].write_text(f"## {title}\n\n" + markdown_table(rows))
    plot_sweep(rows, paths["png"], title)
    return paths


def plot_sweep(rows: list[dict[str, Any]], path: Path, title: str = "Scaling") -> Path:
    """Left: speed-up per backend with the ideal line, the metric on a second axis. Right: efficiency."""
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
        ax.plot(x, [r["speedup"] for r in mine], "o-", color=color, label=f"{backend} speed-up")
        pred = [(r["workers"], r["predicted_speedup"]) for r in mine if r["predicted_speedup"] is not None]
        if pred:
            ax.plot(*zip(*pred), "x:", color=color, label=f"{backend} predicted")
        met = [(r["workers"], r["metric"]) for r in mine if r["metric"] is not None]
        if met:
            ax_metric.plot(*zip(*met), "s--", color=color, alpha=0.6, label=f"{backend} {metric}")
        ax_eff.plot(x, [r["efficiency"] for r in mine], "o-", color=color, label=backend)
    ax.set(xlabel="workers", ylabel="speed-up", title=title, xticks=ns)
    ax_metric.set_ylabel(metric)
    handles = ax.get_legend_handles_labels()
    more = ax_metric.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8, loc="upper left")
    ax_eff.axhline(1.0, color="k", ls="--", lw=1)
    ax_eff.set(xlabel="workers", ylabel="parallel efficiency", title="Efficiency", xticks=ns, ylim=(0, 1.1))
    ax_eff.legend(fontsize=8)
    for a in (ax, ax_eff):
        a.grid(True, alpha=0.3)
    return _save(fig, path)


def _fmt(value: Any, spec: str) -> str:
    return "" if value is None else spec.format(value)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window (headless nodes)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def with_link(link: Link, bandwidth_gbps: float | None = None, latency_us: float | None = None) -> Link:
    """``link`` with measured bandwidth / latency substituted where given."""
    changes = {k: v for k, v in (("bandwidth_gbps", bandwidth_gbps), ("latency_us", latency_us)) if v is not None}
    return replace(link, name=link.name + ("*" if changes else ""), **changes)


# --------------------------------------------------------------------------- runs and CLI


def read_run(run_dir: Path, metric: str | None = None) -> dict[str, Any]:
    """Time per epoch, images/s and the final metric of a finished run, from its ``metrics.jsonl``.

    The first epoch is dropped from the timing when there are more (warm-up: allocator, caches).
    ``metric`` defaults to the summary's ``best_<name>`` key. Gradient bytes come from the last
    checkpoint (floating-point tensors that are not BatchNorm statistics).
    """
    run_dir = Path(run_dir)
    epochs, summary = [], {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if isinstance(ev.get("step"), list) and len(ev["step"]) == 1:
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
           "metric_name": metric or "", "metric": last_metric}
    ckpt = run_dir / "checkpoints" / "last.pt"
    if ckpt.exists():
        import torch

        state = torch.load(ckpt, map_location="cpu", weights_only=True)["model"]
        out["grad_bytes"] = sum(t.numel() * t.element_size() for k, t in state.items()
                                if t.is_floating_point() and not k.endswith(("running_mean", "running_var")))
    return out


def sweep(recipe: str, workers: Sequence[int], out_dir: Path, *, mode: str = "weak", epochs: int = 2,
          repeats: int = 1, backends: Sequence[str] = ("ddp",), extra: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Train ``recipe`` at every worker count (``fastvision train --nproc N``) and collect results.

    Strong mode keeps the 1-worker global batch: the per-worker batch is divided by ``N``.
    ``extra`` holds ``fastvision train`` options as ``--flag value`` pairs (``--set``, ``--data``).
    """
    import subprocess
    import sys

    from .config import load, parse_override
    from .errors import FastvisionError

    # The per-worker batch comes from the recipe with the caller's --set overrides; a --set of
    # train.batch_size is consumed here, else it would override the --batch-size given to each run.
    pairs = list(zip(extra[::2], extra[1::2]))
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
                cmd = [sys.executable, "-m", "fastvision.cli", "train", recipe, "--nproc", str(n),
                       "--out", str(run_dir), "--epochs", str(epochs), "--batch-size", str(per_worker), *extra]
                if backend != "ddp":
                    cmd += ["--backend", backend]
                log.info("scale: %s", " ".join(cmd))
                if subprocess.run(cmd).returncode != 0:  # the run printed its own error above
                    raise FastvisionError(f"scale: the {backend} run with {n} worker(s) failed: {' '.join(cmd)}")
                results.append({"backend": backend, "mode": mode, "workers": n, "global_batch": per_worker * n,
                                **read_run(run_dir)})
    return results


def add_cli(subparsers) -> None:
    """``fastvision scale``: a world-size sweep of a recipe, or the simulator alone."""
    p = subparsers.add_parser("scale", help="data-parallel scaling study: sweep world sizes, or --simulate")
    p.add_argument("recipe", nargs="?", help="recipe to sweep (not needed with --simulate and --compute-ms)")
    p.add_argument("--workers", default="1,2", help="comma-separated world sizes (default 1,2)")
    p.add_argument("--mode", choices=["weak", "strong"], default="weak")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--backends", default="ddp", help="comma-separated: ddp,horovod")
    p.add_argument("--out", type=Path, default=Path("runs/scaling"))
    p.add_argument("--data", help="dataset folder for every run (data.args.path)")
    p.add_argument("--device", help="device for every run: auto, cpu, cuda")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override passed to every run, as in `fastvision train --set` (repeatable)")
    p.add_argument("--simulate", action="store_true", help="predict speed-up for 1..1024 GPUs")
    p.add_argument("--compute-ms", type=float, help="measured forward+backward ms per step (simulate only)")
    p.add_argument("--batch", type=int, default=16, help="per-worker batch of --compute-ms")
    p.add_argument("--grad-mb", type=float, help="gradient MB (1e6 bytes) per step (simulate only)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size in MiB")
    p.add_argument("--links", default="nvlink,infiniband,ethernet", help=f"presets: {', '.join(LINKS)}")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.set_defaults(func=_cli)


def train_args(args) -> list[str]:
    """The ``fastvision train`` options a ``scale`` command passes on to every run."""
    out = [a for flag in ("data", "device") if getattr(args, flag) for a in (f"--{flag}", getattr(args, flag))]
    return out + [a for s in args.set for a in ("--set", s)]


def _cli(args) -> int:
    from .errors import ConfigError

    out = Path(args.out)
    try:
        workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        raise ConfigError(f"--workers {args.workers!r}: expected comma-separated integers, e.g. 1,2,4,8") from None
    if any(w < 1 for w in workers):
        raise ConfigError(f"--workers {args.workers!r}: world sizes must be >= 1")
    links = []
    for name in args.links.split(","):
        if name not in LINKS:
            raise ConfigError(f"--links: unknown link {name!r}; valid: {', '.join(LINKS)}")
        links.append(LINKS[name])
    results = []
    if args.recipe and not (args.simulate and args.compute_ms):
        results = sweep(args.recipe, workers, out, mode=args.mode, epochs=args.epochs, repeats=args.repeats,
                        backends=args.backends.split(","), extra=train_args(args))
    if args.simulate:
        if args.compute_ms and args.grad_mb:
            compute, batch, grad = args.compute_ms / 1e3, args.batch, args.grad_mb * 1e6
        else:
            one = [r for r in results if r["workers"] == 1 and r.get("grad_bytes")]
            if not one:
                raise ConfigError("--simulate needs --compute-ms and --grad-mb, or a sweep that includes 1 worker")
            batch = one[0]["global_batch"]
            compute, grad = batch / one[0]["images_per_s"], one[0]["grad_bytes"]
        prof = StepProfile(compute_s=compute, batch=batch, grad_bytes=grad, buckets=bucket_count(grad, args.bucket_mb))
        rows = [r for link in links for r in simulate(prof, link, mode=args.mode, gpus_per_node=args.gpus_per_node)]
        out.mkdir(parents=True, exist_ok=True)
        (out / "simulation.md").write_text(simulation_markdown(rows))
        (out / "simulation.json").write_text(json.dumps({"profile": prof.__dict__, "rows": rows}, indent=2))
        pred = {r["workers"]: r["speedup"] for r in rows if r["link"] == links[0].name}
        for r in results:
            r["predicted_speedup"] = pred.get(r["workers"])
        plot_simulation(rows, out / "simulation.png", measured=summarize(results) if results else ())
        print((out / "simulation.md").read_text())  # the CLI's output, not library logging
        print(f"simulation: {out / 'simulation.json'}, {out / 'simulation.png'}")
    if results:
        paths = write_report(results, out, title=f"{args.recipe} {args.mode} scaling")
        print(paths["md"].read_text())  # the CLI's output, not library logging
    return 0
