"""``fastvision benchmark RECIPE --mode data``: the recipe's own input path with the model removed.

Each cache mode is built by the engine's :func:`~fastvision.engine.build` (dataset -> cache ->
sampler -> loader), exactly as ``fastvision train`` builds it; the model, optimizer and DDP wrap
are dropped, and every batch goes through what the training step does before the forward:
``next(loader)`` -> ``task.to_device`` -> ``task.augment``. One epoch per mode first (caches fill,
threads start), untimed; then the modes take turns, ``rounds`` times, each timing a chunk of
batches, so a slow moment of a shared machine falls on every mode alike. On CUDA each chunk ends
with a synchronize (the augmentation runs on the device).

A loader runs ahead of its consumer: while the other modes take their turn, its threads or
processes fill their queue (``prefetch_depth`` batches). So that this head start is not timed as
its rate, and its work not charged to the mode timed meanwhile, each chunk first waits until the
whole process tree is idle (every loader's queue full), then takes the mode's prefetched batches
and one more per loader thread or process untimed (so the timed batches begin, as they end, with
every producer busy), then times its batches: wall time, and the CPU seconds of the process tree (main thread,
loader threads, worker processes), whose ratio ``items_per_cpu_s`` is the items/s one fully busy
host core delivers through this path (what ``fastvision plan --input-rate`` and ``scale
--input-json`` take). On CUDA the CPU seconds include the wait in the synchronize.

``variants`` (``--variant KEY=VALUE,KEY=VALUE``, repeatable) adds settings beside the cache modes,
e.g. the decoding backend and loader: ``data.args.backend=dali`` vs ``data.args.backend=pillow,
data.loader=processes``, timed in the same interleaved rounds. A dataset that brings its own
loader (DALI) is timed through it, as ``fastvision train`` would run it.
"""
from __future__ import annotations

import copy
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fastvision import engine
from fastvision.config import RunConfig, from_dict, merge, parse_override, to_dict
from fastvision.data.loader import endless_batches, prefetch_depth
from fastvision.errors import ConfigError
from fastvision.models import without_weights
from fastvision.utils.hostcpu import host_cpu_name, tree_cpu_seconds, wait_idle

log = logging.getLogger(__name__)

CACHES = ("none", "ram", "disk", "shared", "smart", "gpu")


class _Path:
    """One cache mode's input path: the built run (model dropped) and its endless batch stream."""

    def __init__(self, cfg: RunConfig, cache: str, setting: str = ""):
        c = copy.deepcopy(cfg)
        c.data.cache = cache
        c.train.amp, c.train.compile = "off", False  # no model runs: its precision and compilation do not matter
        c.model.args = without_weights(c.model.args)  # ... nor its weights: no weights file is read or downloaded
        self.cache, self.setting = cache, setting
        self.run = engine.build(c, train=True)
        self.generator = self.run.step.generator
        self.run.model = self.run.step = None  # the model is removed
        self.batches = endless_batches(self.run.train_loader)
        ready, producers = prefetch_depth(self.run.train_loader)
        self.lead = ready + producers  # the ready batches, then one per producer: the pipeline in its steady state
        self.items, self.seconds, self.chunks_ms_per_item = 0, 0.0, []
        self.cpu_seconds, self.cpu_complete, self.unsettled = 0.0, True, 0
        from fastvision.data.cache.select import describe

        self.pipeline = describe(self.run.train_set)

    def batch(self) -> int:
        """One batch to the point where the step would call the model; returns its item count."""
        run = self.run
        b = run.task.to_device(next(self.batches), run.device, run.cfg.train.channels_last)
        b = run.task.augment(b, self.generator)
        return run.task.batch_size(b)

    def chunk(self, n: int, settle: dict[str, float]) -> None:
        """Times ``n`` batches: after the tree is idle and this path's head start is taken untimed.
        ``settle["timeout"]``: how long to wait for idle; once a wait runs out (something keeps a core
        busy) later ones wait 2 s, so a tree that never idles costs one long wait, not one per turn."""
        sync = self.run.device.type == "cuda"
        if not wait_idle(timeout=settle["timeout"]):  # every loader's producers have filled their queues
            self.unsettled += 1
            settle["timeout"] = 2.0
        for _ in range(self.lead):  # built ahead while this path waited, then refilled: not timed
            self.batch()
        if sync:
            torch.cuda.synchronize(self.run.device)  # deliberate: the timed batches start on an idle device
        c0, t0 = tree_cpu_seconds()[0], time.perf_counter()
        items = sum(self.batch() for _ in range(n))
        if sync:
            torch.cuda.synchronize(self.run.device)  # deliberate: the chunk ends when the device is done
        dt = time.perf_counter() - t0
        c1, complete = tree_cpu_seconds()
        self.items += items
        self.seconds += dt
        self.cpu_seconds += c1 - c0
        self.cpu_complete &= complete
        self.chunks_ms_per_item.append(1e3 * dt / max(items, 1))

    def close(self) -> None:
        if hasattr(self.run.train_set, "shutdown"):
            self.run.train_set.shutdown()


def split_setting(setting: str) -> list[str]:
    """``"a=1,b=[2, 3]"`` -> ``["a=1", "b=[2, 3]"]``: commas inside brackets stay."""
    parts, depth, cur = [], 0, ""
    for ch in setting:
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [p for p in [*parts, cur.strip()] if p]


def with_setting(cfg: RunConfig, setting: str) -> RunConfig:
    """``cfg`` with the comma-separated ``KEY=VALUE`` overrides of ``setting`` applied."""
    data = to_dict(cfg)
    for item in split_setting(setting):
        data = merge(data, parse_override(item))
    return from_dict(data)


def check_data_args(caches: list[str], batches: int, rounds: int, variants: list[str] | None) -> None:
    """``--cache``, ``--steps``, ``--rounds`` and ``--variant`` of ``--mode data``, before any output is
    looked at or any path built: one ConfigError naming the flag."""
    bad = [c for c in caches if c not in CACHES]
    if bad or not caches:
        raise ConfigError(f"--cache: unknown {', '.join(bad) or '(empty)'}; valid: {', '.join(CACHES)}")
    if batches < 1 or rounds < 1:
        raise ConfigError("--steps and --rounds must be >= 1")
    for v in variants or []:  # each path's cache is --cache's: a variant's data.cache would be dropped unseen
        if any(item.split("=", 1)[0].strip() == "data.cache" for item in split_setting(v)):
            raise ConfigError(f"--variant {v}: the cache modes are --cache's (e.g. --cache none,gpu), timed under "
                              "every variant; a variant sets other keys")


def run_data_benchmark(cfg: RunConfig, caches: list[str], *, batches: int = 40, rounds: int = 4,
                       warmup: int | None = None, variants: list[str] | None = None) -> dict[str, Any]:
    """Items/s of the recipe's input path under each cache mode (and variant), interleaved.

    Args:
        cfg: the loaded recipe (with overrides).
        caches: ``data.cache`` modes to compare, e.g. ``["none", "ram"]``.
        variants: override sets ``"KEY=VALUE,KEY=VALUE"`` to compare, each under every cache mode
            (e.g. ``["data.args.backend=dali", "data.loader=processes"]``); None: the recipe as is.
        batches: timed batches per mode (split over ``rounds``).
        rounds: turns each mode takes.
        warmup: untimed batches per mode first; None: one epoch (fills the caches).

    Returns:
        ``{"recipe", "mode": "data", "device", "batch_size", "host_cpu", "results": [{"cache", "setting",
        "items_per_s", "ms_per_item", "ms_per_item_median_chunk", "items", "cpu_s", "items_per_cpu_s",
        "prefetch_untimed", "unsettled_chunks", "pipeline"}, ...]}``; ``cpu_s`` and ``items_per_cpu_s``
        are None where a worker process's CPU time cannot be read (no ``/proc``).
    """
    check_data_args(caches, batches, rounds, variants)
    paths = [_Path(with_setting(cfg, v), c, v) for v in (variants or [""]) for c in caches]
    try:
        for p in paths:
            n = len(p.run.train_loader) if warmup is None else warmup
            for _ in range(n):
                p.batch()
            log.info("data benchmark: %s warmed up (%d batches): %s", p.cache, n, p.pipeline)
        per_round = math.ceil(batches / rounds)
        settle = {"timeout": 30.0}
        for _ in range(rounds):
            for p in paths:
                p.chunk(per_round, settle)
    finally:
        for p in paths:
            p.close()
    run = paths[0].run
    rows = [{"cache": p.cache, "setting": p.setting, "items_per_s": p.items / p.seconds,
             "ms_per_item": 1e3 * p.seconds / p.items,
             "ms_per_item_median_chunk": statistics.median(p.chunks_ms_per_item), "items": p.items,
             "cpu_s": p.cpu_seconds if p.cpu_complete else None,
             "items_per_cpu_s": p.items / p.cpu_seconds if p.cpu_complete and p.cpu_seconds > 0 else None,
             "prefetch_untimed": p.lead, "unsettled_chunks": p.unsettled,
             "pipeline": p.pipeline} for p in paths]
    base = rows[0]["items_per_s"]
    for r in rows:
        r["speedup_vs_first"] = r["items_per_s"] / base
    return {"recipe": cfg.recipe, "mode": "data", "data": cfg.data.name, "device": str(run.device),
            "batch_size": cfg.train.batch_size,
            "loader": "per setting" if variants else cfg.data.loader, "num_workers": run.cfg.data.num_workers,
            "rounds": rounds, "host_cpu": host_cpu_name(), "host_cores": os.cpu_count(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": rows}


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table (one row per cache mode)."""
    loader = report["loader"] if report["loader"] == "per setting" else f"{report['loader']} x {report['num_workers']}"
    lines = [f"**{report['recipe']} input path on {report['device']}** (batch {report['batch_size']}, "
             f"loader {loader}, {report['rounds']} interleaved rounds, "
             f"torch {report['torch']}, {report['date']})", "",
             "| setting | cache | items/s | ms/item | items/s per core | x first | pipeline |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.get('setting') or 'recipe'} | {r['cache']} | {r['items_per_s']:.1f} | {r['ms_per_item']:.2f} | "
              f"{per_core_text(r)} | {r['speedup_vs_first']:.2f} | {r['pipeline']} |" for r in report["results"]]
    if report.get("host_cpu"):
        lines += ["", f"Host: {report['host_cpu']}, {report.get('host_cores')} logical cores. Items/s per core: "
                      "items over the CPU seconds of the process tree (loader threads and processes, the main "
                      "thread's copy and augmentation) in the timed batches."]
    return "\n".join(lines) + "\n"


def per_core_text(row: dict[str, Any]) -> str:
    """A row's items/s per host core, or why there is none."""
    rate = row.get("items_per_cpu_s")
    return f"{rate:.1f}" if rate else "n/a (no /proc)"


def read_input_rate(path: str | Path, flag: str = "--input-rate", cache: str | None = None,
                    data_name: str | None = None) -> tuple[float, str]:
    """``(items/s per host core, what it is)`` from a ``fastvision benchmark RECIPE --mode data`` JSON.

    The row is the recipe's own setting (no ``--variant``) under ``cache`` if given and present, else
    the first row. Its ``items_per_cpu_s`` is the measured per-core rate; a report without one (an
    older report, or no ``/proc``) gives items/s over the loader's processes (``num_workers``; 0 is
    the main process), the rate per process, which is a per-core rate only while each process keeps
    one core busy. With ``data_name``, a report of another dataset's input path (its ``data``) is refused:
    a microscopy loader's rate says nothing of an ImageNet folder's.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {path}: cannot read a benchmark report: {e}") from None
    rows = [r for r in (data.get("results", []) if isinstance(data, dict) else [])
            if isinstance(r, dict) and r.get("items_per_s")]
    if not rows:
        raise ConfigError(f"{flag} {path}: no items_per_s (expected `fastvision benchmark RECIPE --mode data` JSON)")
    if data_name and data.get("data") and data["data"] != data_name:
        raise ConfigError(f"{flag} {path}: measures the {data['data']!r} input path of {data.get('recipe', '?')}, "
                          f"not this recipe's {data_name!r}; run fastvision benchmark RECIPE --mode data for it")
    own = [r for r in rows if not r.get("setting")] or rows
    row = next((r for r in own if r.get("cache") == cache), own[0])
    where = f"{path}: {data.get('recipe', '?')}, cache {row.get('cache', '?')}, {data.get('date', 'undated')}"
    key = "items_per_cpu_s" if row.get("items_per_cpu_s") else "items_per_s"
    try:
        rate = float(row[key])
    except (TypeError, ValueError):
        rate = float("nan")
    if not 0 < rate < float("inf"):  # Infinity planned "no host limit" (0.0 cores per GPU), a negative one nonsense
        raise ConfigError(f"{flag} {path}: {key} {row[key]!r} is not a finite rate > 0; measure it again with "
                          f"fastvision benchmark {data.get('recipe', 'RECIPE')} --mode data")
    if key == "items_per_cpu_s":
        return rate, f"measured per core, {where}, {data.get('host_cpu') or 'host not named'}"
    workers = next((int(d[k]) for d in (row, data) for k in ("num_workers", "workers") if d.get(k) is not None), 0)
    return rate / max(1, workers), f"measured per loader process ({max(1, workers)}), {where}"
