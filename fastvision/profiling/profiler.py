"""``fastvision profile``: time every phase of the training step and name the bottleneck.

The run is the engine's (:func:`fastvision.engine.build`) and so is the step: the profiler calls
:func:`fastvision.engine.train_step` with a clock that the step tells each phase as it starts:
data wait, host-to-device, augment, forward, backward (each summed over the accumulation
micro-batches), optimizer (non-finite check, clip, step, schedule, EMA), and communication. Host
phases use the wall clock; on CUDA the device phases use CUDA events read once after the last step,
so profiling adds no host sync per step. Communication is the exposed time of DDP's collectives:
forward (its buffer broadcast) and backward (its gradient all-reduce) beyond their medians under
``no_sync`` (measured on extra steps after the profiled ones; 0 in one process), which includes any
wait for a slower rank. With more than one rank, every rank's medians are gathered in one collective
and :mod:`fastvision.profiling.ranks` names the slow rank and its phase.

The verdict is the largest share of the median step: ``input-bound`` (data wait),
``communication-bound``, ``host-sync-bound`` (CUDA only: the GPU waits for the host, seen as low
NVML utilisation or as launch time close to device time) or ``compute-bound``, each with the
recipe switch to try first.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastvision import distributed, engine
from fastvision.config import RunConfig
from fastvision.data.loader import endless_batches
from fastvision.models import levers
from fastvision.profiling.monitor import NvmlSampler
from fastvision.profiling.ranks import delayed, rank_row, slowest, waiting_advice
from fastvision.utils.files import atomic_by_name

log = logging.getLogger(__name__)

PHASES = ("data", "h2d", "augment", "forward", "backward", "optimizer", "comm")
DEVICE_PHASES = ("h2d", "augment", "forward", "backward", "optimizer")


class _Clock:
    """Phase boundaries of one step (the ``clock`` hook of ``engine.train_step``): host times always,
    CUDA events on a CUDA device. A phase seen several times (accumulation micro-batches) is summed."""

    def __init__(self, device: torch.device, nvtx: bool):
        self.cuda = device.type == "cuda"
        self.nvtx = nvtx and self.cuda
        self.host: list[tuple[str, float]] = []
        self.events: list[tuple[str, Any]] = []

    def __call__(self, phase: str) -> None:
        """Start ``phase`` (``"end"`` closes the step)."""
        if self.nvtx and self.host:
            torch.cuda.nvtx.range_pop()
        self.host.append((phase, time.perf_counter()))
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events.append((phase, ev))
        if self.nvtx and phase != "end":
            torch.cuda.nvtx.range_push(phase)

    def durations(self) -> tuple[dict[str, float], dict[str, float]]:
        """(host seconds, device seconds) per phase; device equals host off CUDA."""
        host = _sums((a, t1 - t0) for (a, t0), (_, t1) in itertools.pairwise(self.host))
        if not self.cuda:
            return host, dict(host)
        dev = _sums((a, e0.elapsed_time(e1) / 1e3) for (a, e0), (_, e1) in itertools.pairwise(self.events))
        return host, dev


def _sums(pairs) -> dict[str, float]:
    out = {p: 0.0 for p in PHASES}
    for phase, seconds in pairs:
        out[phase] += seconds
    return out


def _ranged(name: str, fn: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.nvtx.range_push(name)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.nvtx.range_pop()
    call.random = getattr(fn, "random", False)  # a random transform still gets its per-item generator
    return call


def add_nvtx_ranges(train_set: Any, task: Any) -> None:
    """NVTX ranges around every per-access transform of a cache and every batched augmentation op."""
    for holder in (train_set, getattr(train_set, "source", None)):
        if holder is not None and hasattr(holder, "suffix"):
            holder.suffix = [_ranged(f"transform:{getattr(t, '__qualname__', type(t).__name__)}", t)
                             for t in holder.suffix]
    aug = getattr(task, "augment_fn", None)
    if aug is not None and hasattr(aug, "ops"):
        aug.ops = [(n, _ranged(f"augment:{n}", op)) for n, op in aug.ops]


class _NvtxItems(torch.utils.data.Dataset):
    """Dataset view that puts an NVTX range around every item read (the whole per-item pipeline)."""

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self._name = f"item:{type(dataset).__name__}"

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        with torch.cuda.nvtx.range(self._name):
            return self.dataset[i]

    def __getattr__(self, name: str) -> Any:  # set_epoch, main_process_only...
        return getattr(self.__dict__["dataset"], name)


def _nvtx_items(train_set: Any) -> Any:
    """The training set with NVTX ranges around its per-access transforms and item reads (CUDA)."""
    if not torch.cuda.is_available():
        return train_set
    add_nvtx_ranges(train_set, None)
    return _NvtxItems(train_set)


def percentiles_ms(values: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 / mean of ``values`` in milliseconds."""
    a = np.asarray(values, dtype=np.float64) * 1e3 if values else np.zeros(1)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def profile(cfg: RunConfig, *, steps: int = 20, warmup: int = 5, nvtx: bool = False, trace: str | Path | None = None,
            synthetic: bool = False) -> dict[str, Any]:
    """Run ``warmup`` + ``steps`` training steps of ``cfg`` and report time per phase.

    Args:
        cfg: resolved run config (recipe + overrides).
        steps: profiled steps.
        warmup: steps run first and not counted (allocator, cudnn autotune, compile, cache fill).
        nvtx: emit NVTX ranges per phase, transform and augmentation op (CUDA only).
        trace: folder for a torch.profiler Chrome trace of the profiled steps.
        synthetic: feed ``task.synthetic_batch`` already on the device (no data pipeline); the
            dataset is not read (built with ``data_info={}``, as ``benchmark`` builds), so no data
            folder is needed.

    Returns:
        ``{"phases": {name: {p50, p90, p99, mean} ms}, "step_ms", "images_per_s", "shares",
        "verdict", "advice", "gpu", "config", "world_size", "launcher", "ranks", "slowest"}``: ``ranks``
        holds every rank's medians in rank order (:func:`~fastvision.profiling.ranks.rank_row`), ``slowest``
        the slow rank and its phase (:func:`~fastvision.profiling.ranks.slowest`; None in one process).
    """
    run = engine.build(cfg, {} if synthetic else None, train=True, loaders=not synthetic,
                       wrap_train_set=_nvtx_items if nvtx else None)
    return profile_run(run, steps=steps, warmup=warmup, nvtx=nvtx, trace=trace)


def profile_run(run: engine.Run, *, steps: int = 20, warmup: int = 5, nvtx: bool = False,
                trace: str | Path | None = None) -> dict[str, Any]:
    """:func:`profile` of a run already built by ``engine.build(cfg, train=True)``: its training
    loader, or synthetic batches on the device when it has none (built with ``loaders=False``).
    The run trains on: its weights afterwards are those of ``warmup + steps`` training steps; with
    more than one rank, up to 5 further steps follow without the gradient all-reduce (to time forward
    and backward without the collectives), so each rank then also holds a few steps of its own local
    gradients. Every rank must call it: the ranks' medians are gathered at the end (one collective)."""
    cfg, env, device, task = run.cfg, run.env, run.device, run.task
    if nvtx and device.type == "cuda":
        add_nvtx_ranges(None, task)  # every batched augmentation op
    batches, cache_line = _batches(run)
    batches = delayed(batches, env.rank)  # FASTVISION_PROFILE_SLOW_RANK: a check of the per-rank table
    run.step.model.train()
    for _ in range(warmup):
        engine.train_step(run.step, batches, _Clock(device, False))
    sampler = NvmlSampler(device) if device.type == "cuda" else None
    prof = _trace_context(trace, device)
    clocks: list[_Clock] = []
    starts: list[float] = []
    with prof, (sampler or contextlib.nullcontext()):
        for _ in range(steps):
            starts.append(time.perf_counter())
            clocks.append(_Clock(device, nvtx))
            engine.train_step(run.step, batches, clocks[-1])  # the step fit runs, timed by its clock hook
            if hasattr(prof, "step"):
                prof.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # once: read every event recorded above
        starts.append(time.perf_counter())
    no_sync = []
    if env.world_size > 1:  # forward and backward without the collectives, to isolate their exposed time
        extra = [_Clock(device, False) for _ in range(min(steps, 5))]
        for c in extra:
            with distributed.no_sync(run.step.model):  # the step's own no_sync calls nest inside this one
                engine.train_step(run.step, batches, c)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        no_sync = [c.durations()[1] for c in extra]
    walls = np.diff(starts).tolist()
    per, launch = _phase_times(clocks, no_sync)
    report = _report(cfg, per, launch, walls, run.global_batch, device, sampler, cache_line, run.precision.mode)
    report.update(world_size=env.world_size, launcher=env.launcher,
                  ranks=distributed.gather_objects(rank_row(env.rank, per, walls)))  # the one collective
    report["slowest"] = slowest(report["ranks"])
    report["advice"] = waiting_advice(report["slowest"], report["verdict"], env.rank, report["advice"])
    if trace:
        # torch writes the trace (tens of MB) by name: into a temp file beside, renamed when whole
        atomic_by_name(Path(trace) / f"trace_rank{env.rank}.json", prof.export_chrome_trace)
        report["top_ops"] = top_ops(prof, device, steps)
    return report


def _batches(run: engine.Run) -> tuple[Iterator[Any], str]:
    """The run's endless training batches (synthetic on the device without a loader) and their pipeline line."""
    if run.train_loader is None:
        fixed = run.task.synthetic_batch(run.cfg.train.batch_size, run.device)
        return iter(lambda: fixed, None), "synthetic batches on the device (no data pipeline)"
    from fastvision.data.cache.select import describe

    line = describe(run.train_set)
    if not hasattr(run.train_set, "make_loader"):  # a torch loader (data.num_workers: auto resolved by now)
        line += f"; loader {run.cfg.data.loader} x {run.cfg.data.num_workers}"
    return endless_batches(run.train_loader), line


def top_ops(prof: Any, device: torch.device, steps: int, n: int = 12) -> list[dict[str, Any]]:
    """The ``n`` operations that took the most self time in a torch.profiler run of ``steps`` steps:
    on CUDA the device kernels (self device time: which convolution or elementwise kernels the step
    is), on a CPU the aten ops (self CPU time). Each: name, calls (over the ``steps``: a whole number; per step
    an op of some steps only, or of the loader, is a fraction), calls and ms per step, share of the total self
    time of its kind."""
    cuda = device.type == "cuda"

    def self_us(e: Any) -> float:
        if not cuda:
            return float(e.self_cpu_time_total)
        # torch >= 2.4 names it device time; older releases cuda time
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0))

    events = [(e.key, e.count, self_us(e)) for e in prof.key_averages()]
    events = [x for x in events if x[2] > 0]
    total = sum(us for _, _, us in events) or 1.0
    events.sort(key=lambda x: -x[2])
    return [{"name": name, "calls": int(count), "calls_per_step": count / steps, "ms_per_step": us / 1e3 / steps,
             "share": us / total} for name, count, us in events[:n]]


def _trace_context(trace: str | Path | None, device: torch.device) -> Any:
    if not trace:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return torch_profile(activities=acts, record_shapes=False)


def _phase_times(clocks: list[_Clock], no_sync: list[dict[str, float]]) -> tuple[dict[str, list[float]], list[float]]:
    """Seconds per step of each phase (data on the host, the rest on the device), forward's and
    backward's time beyond their ``no_sync`` medians moved to ``comm``; and each step's launch time
    (host seconds spent issuing device work; CUDA: excludes waiting at the sync)."""
    per: dict[str, list[float]] = {p: [] for p in PHASES}
    launch = []
    base = {p: float(np.median([d[p] for d in no_sync])) for p in ("forward", "backward")} if no_sync else {}
    for c in clocks:
        host, dev = c.durations()
        per["data"].append(host["data"])
        for p in DEVICE_PHASES:
            per[p].append(dev[p])
        waits = {p: max(0.0, dev[p] - b) for p, b in base.items()}
        for p, wait in waits.items():
            per[p][-1] -= wait
        per["comm"].append(sum(waits.values()))
        launch.append(sum(host[p] for p in ("h2d", "augment", "forward", "backward")))
    return per, launch


def _report(cfg: RunConfig, per: dict[str, list[float]], launch: list[float], walls: list[float], global_batch: int,
            device: torch.device, sampler: Any, cache_line: str, precision: str) -> dict[str, Any]:
    phases = {p: percentiles_ms(v) for p, v in per.items()}
    step_s = float(np.median(walls))
    # Shares of the profiled time (totals, not medians): a prefetching loader waits in bursts (most steps
    # find a batch ready, every few steps wait for several), so the median wait says ~0 of an input-bound run.
    total_s = max(float(np.sum(walls)), 1e-12)
    shares = {"input": float(np.sum(per["data"])) / total_s, "communication": float(np.sum(per["comm"])) / total_s}
    device_s = sum(float(np.median(per[p])) for p in DEVICE_PHASES)
    gpu = sampler.summary() if sampler is not None else None
    if device.type == "cuda":
        busy = gpu["util_mean"] / 100 if gpu and gpu.get("util_mean") is not None else None
        # GPU starved by the host: low measured utilisation, or launching takes as long as running.
        starved = (1 - busy) if busy is not None else min(1.0, float(np.median(launch)) / max(device_s, 1e-9))
        shares["host-sync"] = max(0.0, starved * (1 - shares["input"] - shares["communication"]))
    shares["compute"] = max(0.0, 1 - sum(shares.values()))
    verdict = max(shares, key=shares.get)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        gpu = {**(gpu or {}), "torch_peak_allocated_mib": peak}
    return {"verdict": f"{verdict}-bound", "advice": advice(verdict, cfg, device, precision), "shares": shares,
            "phases": phases, "step_ms": percentiles_ms(walls), "images_per_s": global_batch / step_s,
            "steps": len(walls), "global_batch": global_batch, "device": str(device), "gpu": gpu,
            "pipeline": cache_line,
            "config": {"recipe": cfg.recipe, "data.cache": cfg.data.cache, "data.loader": cfg.data.loader,
                       "data.num_workers": cfg.data.num_workers, "train.amp": cfg.train.amp,
                       "precision": precision,  # what train.amp resolved to on this device (auto)
                       "train.batch_size": cfg.train.batch_size, "train.compile": cfg.train.compile,
                       "train.channels_last": cfg.train.channels_last,
                       **levers.current(cfg.model.name, cfg.model.args)}}


def _and_list(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def advice(verdict: str, cfg: RunConfig, device: torch.device, precision: str | None = None) -> str:
    """The recipe switch to try first for a verdict, given what the recipe already sets; ``precision``:
    what ``train.amp`` resolved to (``auto`` is fp16 on a GPU without bf16), else ``train.amp``."""
    d, t = cfg.data, cfg.train
    if verdict == "input":
        if d.cache == "none":
            cache = "shared" if distributed.world_size() > 1 else "ram"
            return f"set data.cache: {cache} and data.loader: threads (cache the deterministic preprocessing once)"
        if d.loader == "processes":
            return "set data.loader: threads (no pickling or IPC of cached items)"
        gpu = ("; or data.cache: gpu with data.augment on the device"
               if device.type == "cuda" and d.cache != "gpu" else "")
        return (f"raise data.num_workers (now {d.num_workers}), move random transforms into data.augment, "
                f"or set data.repeats: 2{gpu}")
    if verdict == "communication":
        # autocast keeps fp32 gradients, so bf16 AMP alone does not shrink the all-reduce
        hook = "" if t.ddp_comm_hook != "none" else ", set train.ddp_comm_hook: bf16 (half the gradient bytes)"
        return (f"raise train.accum_steps (fewer all-reduces per image){hook}, raise train.ddp_bucket_mb "
                f"(now {t.ddp_bucket_mb:g}) or train.batch_size")
    if verdict == "host-sync":
        return ("raise train.batch_size, and set train.compile: reduce-overhead (CUDA graphs: fewer kernel "
                "launches; needs static shapes)")
    if device.type == "cuda":
        lever = levers.levers(cfg.model.name, cfg.model.args)
        layout = _layout_switch(cfg, every_model=True)
        off = [s for s, on in (("train.amp: bf16", t.amp != "off"), (layout, layout is None),
                               ("train.compile: true", bool(t.compile))) if not on]
        if off:
            return "set " + _and_list(off)
        # every switch is on: the convolution kernels are the cost. On an H200 (torch 2.11, cuDNN 9)
        # fp16 ran ResNet-50 1.28-1.30x and the 3-D U-Net 1.13-1.21x faster than bf16 (RESULTS.md).
        fp16 = ("; try train.amp: fp16 (`fastvision benchmark --precision bf16,fp16`)"
                if (precision or t.amp) != "fp16" else "")
        autotune = " or try train.compile: max-autotune" if t.compile != "max-autotune" else ""
        rest = [f"{k.removeprefix('model.args.')}: {str(v[0]).lower()}" for k, v in lever.items()]
        model = (f"; measure model.args {_and_list(rest)} (the same model up to rounding: `fastvision tune` "
                 "tries them)" if rest else "")
        return f"the model is the cost: raise train.batch_size{autotune}{fp16}{model}"
    return _cpu_compute_advice(cfg, precision)


def _layout_switch(cfg: RunConfig, every_model: bool) -> str | None:
    """The layout switch still off, or None: a stock instance norm copies channels-last activations, so
    the layout pays with ``instance_cl`` only (named together, or the norm alone once channels-last is on).
    ``every_model``: channels-last for any model (CUDA); else only for one with an instance norm (the CPU,
    where only that pair was measured)."""
    stock_norm = "model.args.norm" in levers.levers(cfg.model.name, cfg.model.args)
    if cfg.train.channels_last:
        return "model.args.norm: instance_cl" if stock_norm else None
    if stock_norm:
        return "train.channels_last: true with model.args.norm: instance_cl"
    own_norm = levers.current(cfg.model.name, cfg.model.args).get("model.args.norm") == "instance_cl"
    return "train.channels_last: true" if every_model or own_norm else None


def _cpu_compute_advice(cfg: RunConfig, precision: str | None) -> str:
    """A compute-bound CPU step: ``train.amp: bf16`` only where the CPU computes bf16 natively (AMX or
    AVX-512 BF16: 1.3-2.3x on the 3-D U-Net; emulated it is slower, RESULTS.md "bf16 on the CPU"), the
    layout pair for a model with instance norm (NDHWC with ``instance_cl`` beat NCDHW with the stock norm
    on a CPU, NDHWC with the stock norm lost), compile; then the model's size or a GPU."""
    from fastvision.engine import runtime

    t = cfg.train
    unit = runtime.cpu_native_bf16()
    items = [f"train.amp: bf16 (this CPU has {unit})"] if unit and (precision or t.amp) != "bf16" else []
    layout = _layout_switch(cfg, every_model=False)
    if layout:
        items.append(layout)
    if not t.compile:
        items.append("train.compile: true")
    first = f"set {_and_list(items)}; or " if items else ""
    return f"the model is the cost: {first}a smaller model or image size, or run on a GPU (--device cuda)"
