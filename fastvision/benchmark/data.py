"""``fastvision benchmark RECIPE --mode data``: the recipe's own input path with the model removed.

Each cache mode is built by the engine's :func:`~fastvision.engine.build` (dataset -> cache ->
sampler -> loader), exactly as ``fastvision train`` builds it; the model, optimizer and DDP wrap
are dropped, and every batch goes through what the training step does before the forward:
``next(loader)`` -> ``task.to_device`` -> ``task.augment``. One epoch per mode first (caches fill,
threads start), untimed; then the modes take turns, ``rounds`` times, each timing a chunk of
batches, so a slow moment of a shared machine falls on every mode alike. On CUDA each chunk ends
with a synchronize (the augmentation runs on the device).

``variants`` (``--variant KEY=VALUE,KEY=VALUE``, repeatable) adds settings beside the cache modes,
e.g. the decoding backend and loader: ``data.args.backend=dali`` vs ``data.args.backend=pillow,
data.loader=processes``, timed in the same interleaved rounds. A dataset that brings its own
loader (DALI) is timed through it, as ``fastvision train`` would run it.
"""
from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from typing import Any

import torch

from fastvision import engine
from fastvision.config import RunConfig, from_dict, merge, parse_override, to_dict
from fastvision.data.loader import endless_batches
from fastvision.errors import ConfigError

log = logging.getLogger(__name__)

CACHES = ("none", "ram", "disk", "shared", "smart", "gpu")


class _Path:
    """One cache mode's input path: the built run (model dropped) and its endless batch stream."""

    def __init__(self, cfg: RunConfig, cache: str, setting: str = ""):
        c = copy.deepcopy(cfg)
        c.data.cache = cache
        c.train.amp, c.train.compile = "off", False  # no model runs: its precision and compilation do not matter
        self.cache, self.setting = cache, setting
        self.run = engine.build(c, train=True)
        self.generator = self.run.step.generator
        self.run.model = self.run.step = None  # the model is removed
        self.batches = endless_batches(self.run.train_loader)
        self.items, self.seconds, self.chunks_ms_per_item = 0, 0.0, []
        from fastvision.data.cache.select import describe

        self.pipeline = describe(self.run.train_set)

    def batch(self) -> int:
        """One batch to the point where the step would call the model; returns its item count."""
        run = self.run
        b = run.task.to_device(next(self.batches), run.device, run.cfg.train.channels_last)
        b = run.task.augment(b, self.generator)
        return run.task.batch_size(b)

    def chunk(self, n: int) -> None:
        sync = self.run.device.type == "cuda"
        t0 = time.perf_counter()
        items = sum(self.batch() for _ in range(n))
        if sync:
            torch.cuda.synchronize(self.run.device)  # deliberate: the chunk ends when the device is done
        dt = time.perf_counter() - t0
        self.items += items
        self.seconds += dt
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
        ``{"recipe", "mode": "data", "device", "batch_size", "results": [{"cache", "setting", "items_per_s",
        "ms_per_item", "ms_per_item_median_chunk", "items", "pipeline"}, ...]}``.
    """
    bad = [c for c in caches if c not in CACHES]
    if bad or not caches:
        raise ConfigError(f"--cache: unknown {', '.join(bad) or '(empty)'}; valid: {', '.join(CACHES)}")
    if batches < 1 or rounds < 1:
        raise ConfigError("--steps and --rounds must be >= 1")
    paths = [_Path(with_setting(cfg, v), c, v) for v in (variants or [""]) for c in caches]
    try:
        for p in paths:
            n = len(p.run.train_loader) if warmup is None else warmup
            for _ in range(n):
                p.batch()
            log.info("data benchmark: %s warmed up (%d batches): %s", p.cache, n, p.pipeline)
        per_round = math.ceil(batches / rounds)
        for _ in range(rounds):
            for p in paths:
                p.chunk(per_round)
    finally:
        for p in paths:
            p.close()
    run = paths[0].run
    rows = [{"cache": p.cache, "setting": p.setting, "items_per_s": p.items / p.seconds, "ms_per_item": 1e3 * p.seconds / p.items,
             "ms_per_item_median_chunk": statistics.median(p.chunks_ms_per_item), "items": p.items,
             "pipeline": p.pipeline} for p in paths]
    base = rows[0]["items_per_s"]
    for r in rows:
        r["speedup_vs_first"] = r["items_per_s"] / base
    return {"recipe": cfg.recipe, "mode": "data", "device": str(run.device), "batch_size": cfg.train.batch_size,
            "loader": "per setting" if variants else cfg.data.loader, "num_workers": cfg.data.num_workers,
            "rounds": rounds,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": rows}


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table (one row per cache mode)."""
    loader = report["loader"] if report["loader"] == "per setting" else f"{report['loader']} x {report['num_workers']}"
    lines = [f"**{report['recipe']} input path on {report['device']}** (batch {report['batch_size']}, "
             f"loader {loader}, {report['rounds']} interleaved rounds, "
             f"torch {report['torch']}, {report['date']})", "",
             "| setting | cache | items/s | ms/item | x first | pipeline |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.get('setting') or 'recipe'} | {r['cache']} | {r['items_per_s']:.1f} | {r['ms_per_item']:.2f} | "
              f"{r['speedup_vs_first']:.2f} | {r['pipeline']} |" for r in report["results"]]
    return "\n".join(lines) + "\n"
