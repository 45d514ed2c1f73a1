"""The speed switches ``fastvision tune`` may change, which apply where, and the batch-size rule.

Each is a config key with the values worth trying, grouped by the profiler verdict it answers and
ordered inside its group by the profiler's advice (``profiling.profiler.advice``): the cache before
the loader before the workers; channels-last, the model's own levers, then compile, then precision
and threads.

A switch's kind says what it does to the numbers (the parity rule of ``trial.parity``): ``exact``
only where the same items meet the same arithmetic (cache tier, loader kind, workers, DDP
buckets); ``numeric`` where the arithmetic changes: precision, compile, layout, the model levers
(the same model up to float rounding) and CPU threads (another reduction order: a microscopy
start's step-2 loss was 1.7187 at one thread count and 1.71873 at another, beyond the exact rule's 1e-5).
"""
from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from fastvision.config import RunConfig
from fastvision.errors import ConfigError
from fastvision.models import levers
from fastvision.planning.tune.search import Switch
from fastvision.registry import DATASETS
from fastvision.utils.hostcpu import process_cores


def catalogue(cfg: RunConfig, device: torch.device, world_size: int, allow_batch: bool,
              auto_workers: int | None = None) -> list[Switch]:
    """Every switch that can run here, in catalogue order (see :func:`fastvision.planning.tune.search.order`).

    ``auto_workers``: what ``data.num_workers: auto`` resolves to here (``data.workers.resolve``), where the
    start says auto: the start stays ``auto`` and the counts around it are the candidates, not that one again."""
    cuda, cores = device.type == "cuda", os.cpu_count() or 1
    bs = cfg.train.batch_size if isinstance(cfg.train.batch_size, int) else None
    # Every cache tier serves the sampler's items (docs/CONTRACTS.md), so a tier is an exact switch;
    # ``smart`` is never a candidate: with a window smaller than the set it trains on other samples.
    # From such a start (a cache_num or cache_rate that may cut the window) no tier is a speed switch.
    caches = ("ram", "disk") + (("gpu",) if cuda else ()) + (("shared",) if world_size > 1 else ())
    own = len(process_cores())  # this process's affinity: more workers than twice that only wait for a core
    workers = tuple(n for n in (0, 2, 4, 8) if n <= max(2, 2 * own) and n != auto_workers)
    out = [] if smart_window(cfg) else [Switch("data.cache", caches, "exact", "input")]
    out += [Switch("data.loader", ("threads", "processes"), "exact", "input"),
           Switch("data.num_workers", workers, "exact", "input")]
    # DALI's import (0.4 s) only where it could apply: not to a shard set or TFRecords (the builder refuses it)
    if "backend" in _dataset_params(cfg) and not _reads_shards(cfg) and _has_dali():
        out.append(Switch("data.args.backend", ("dali",), "numeric", "input"))
    out.append(Switch("train.channels_last", (True, False), "numeric", "compute"))
    # the model's GPU levers still at their stock value (models/levers.py): the same model up to rounding
    out += [Switch(k, v, "numeric", "compute") for k, v in levers.levers(cfg.model.name, cfg.model.args).items()]
    out.append(Switch("train.compile", ("auto",), "numeric", "compute"))
    if cuda:
        # fp16 after bf16: on an H200 (torch 2.11, cuDNN 9) fp16 convolutions ran ResNet-50 1.28-1.30x and
        # the 3-D U-Net 1.13-1.21x faster than bf16 (benchmarks/RESULTS.md); the loss check still decides
        amps = ("bf16", "fp16") if torch.cuda.is_bf16_supported() else ("fp16",)
        out += [Switch("train.amp", amps, "numeric", "compute"),
                Switch("train.tf32", (True,), "numeric", "compute"),
                Switch("train.compile", ("max-autotune",), "numeric", "compute"),
                Switch("train.compile", ("reduce-overhead",), "numeric", "host")]
    else:
        out += [Switch("train.amp", ("bf16",), "numeric", "compute"),
                # None (the start) means torch's current count: only the other ones are candidates. Numeric:
                # another thread count sums in another order (see the module docstring)
                Switch("train.cpu_threads", tuple(sorted({1, cores} - {torch.get_num_threads()})), "numeric",
                       "compute")]
    if allow_batch and bs:
        out.append(Switch("train.batch_size", (2 * bs, 4 * bs), "batch", "host"))
    if world_size > 1:
        out += [Switch("train.ddp_bucket_mb", (50.0, 100.0), "exact", "communication"),
                Switch("train.ddp_comm_hook", ("bf16",), "numeric", "communication")]
        if allow_batch:
            out.append(Switch("train.accum_steps", (2,), "batch", "communication"))
    return out


def smart_window(cfg: RunConfig) -> bool:
    """The config trains on a smart cache whose window may be smaller than the dataset
    (``data.cache_num`` set or ``data.cache_rate`` below 1): not a speed switch to leave."""
    d = cfg.data
    return d.cache == "smart" and (d.cache_num is not None or d.cache_rate < 1)


# every key a switch may set on some machine: what --keep accepts
SWITCH_KEYS = ("data.cache", "data.loader", "data.num_workers", "data.args.backend", "train.channels_last",
               *levers.LEVER_KEYS, "train.compile", "train.amp", "train.tf32", "train.cpu_threads",
               "train.batch_size", "train.ddp_bucket_mb", "train.ddp_comm_hook", "train.accum_steps")


def check_keep(keys: list[str]) -> None:
    """An unknown ``--keep`` key is an error naming it and the valid keys."""
    for k in keys:
        if k not in SWITCH_KEYS:
            raise ConfigError(f"--keep {k}: not a speed switch; valid: {', '.join(SWITCH_KEYS)}")


def implied(candidate: dict[str, Any], switch: Switch) -> dict[str, Any]:
    """What a candidate brings along (``search``'s ``expand``): channels-last with a stock instance
    norm also takes the layout-keeping one, whose copies would otherwise hide the layout's gain
    (nnU-Net measured channels_last_3d with stock norms 24 % slower). Only when the norm is a switch
    (not pinned with ``--keep``)."""
    if (switch.key == "train.channels_last" and candidate.get("train.channels_last") is True
            and candidate.get("model.args.norm") in levers.LAYOUT_COPYING_NORMS):
        return {**candidate, "model.args.norm": "instance_cl"}
    return candidate


def current(cfg: RunConfig, keys: list[str]) -> dict[str, Any]:
    """The config's value of each dotted key (``data.args.backend`` absent: None; a model lever: the
    model's own default where the recipe does not set it)."""
    model = levers.current(cfg.model.name, cfg.model.args)
    out = {}
    for key in keys:
        if key in levers.LEVER_KEYS:
            out[key] = model.get(key)
            continue
        node: Any = cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        out[key] = node
    return out


def lr_line(cfg: RunConfig, batch: int, accum: int, world_size: int) -> str:
    """The recipe's LR scaling rule for a new batch, in one line."""
    o = cfg.optim
    global_batch = batch * accum * world_size
    if o.ref_batch:
        return (f"LR scaled linearly by the recipe's rule: optim.lr {o.lr:g} x {global_batch} / optim.ref_batch "
                f"{o.ref_batch} = {o.lr * global_batch / o.ref_batch:g} at global batch {global_batch}")
    return (f"the recipe sets no optim.ref_batch: optim.lr stays {o.lr:g} at global batch {global_batch} "
            "(set optim.ref_batch to scale it)")


def _reads_shards(cfg: RunConfig) -> bool:
    """``data.args.path`` is a shard set (folder or URL) or a TFRecord folder: read by the pillow backend only."""
    from fastvision.data.shards.store import is_shard_set
    from fastvision.data.shards.tfrecord import is_tfrecord_set

    path = cfg.data.args.get("path")
    return path is not None and (is_shard_set(path) or is_tfrecord_set(path))


def _has_dali() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except Exception:  # noqa: BLE001  (absent or broken: not a candidate)
        return False
    return True


def _dataset_params(cfg: RunConfig) -> set[str]:
    try:
        return set(inspect.signature(DATASETS.get(cfg.data.name)).parameters)
    except Exception:  # noqa: BLE001
        return set()
