"""One build for every command: :func:`build` turns a config into a :class:`Run`, and the loaders."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastvision import distributed, losses, models, optim, tasks  # noqa: F401  (import registers)
from fastvision.config import RunConfig
from fastvision.data import formats  # noqa: F401  (importing the package registers every dataset format)
from fastvision.data.formats import DatasetSplits
from fastvision.data.loader import DevicePrefetcher, build_loader
from fastvision.engine import runtime
from fastvision.engine.state import make_ema, parse_target, set_bn_momentum
from fastvision.engine.step import StepState
from fastvision.errors import ConfigError
from fastvision.models.checkpointing import apply_activation_checkpointing
from fastvision.registry import DATASETS, LOSSES, MODELS, TASKS
from fastvision.tasks.base import Task

log = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything a run is made of, built once by :func:`build`.

    ``step`` (what :func:`fastvision.engine.step.train_step` reads and updates) is None unless built
    with ``train=True``; the loaders are None without a dataset or with ``loaders=False``.
    """

    cfg: RunConfig
    env: distributed.DistEnv
    device: torch.device
    task: Task
    model: nn.Module  # bare model (what checkpoints hold)
    train_set: Any  # behind the configured cache when the loaders were built
    val_set: Any
    info: dict
    precision: runtime.Precision
    step: StepState | None = None
    global_batch: int = 0  # items per optimizer step over all ranks
    lr: float = 0.0  # learning rate after linear scaling to the global batch
    train_loader: Any = None
    val_loader: Any = None
    steps_per_epoch: int = 0


def build_components(cfg: RunConfig, info: dict, device: torch.device | str, *, train: bool = False,
                     weights: bool = True) -> tuple[Task, nn.Module]:
    """The recipe's task (with its loss and, for training, its batched augmentation) and model: the
    one component build, shared by :func:`build` and ``plan``'s trace.

    Args:
        cfg: the run configuration.
        info: the dataset facts (``DatasetSplits.info`` or a checkpoint's ``data_info``).
        device: where the model is made (``"meta"`` for a trace: shapes only, no memory).
        train: build ``data.augment`` for the model's spatial rank.
        weights: load weights files named in ``model.args`` (``False``: shapes only, for planning).
    """
    model_args = cfg.model.args if weights else models.without_weights(cfg.model.args)
    with torch.device(device):
        model = MODELS.build(cfg.model.name, model_args, where="model.args")
    augment = None
    if train and cfg.data.augment:
        from fastvision.data.augment.spatial import build_augment

        augment = build_augment(info.get("spatial_dims") or models.spatial_dims(model), **cfg.data.augment)
    loss = LOSSES.build(cfg.loss.name, cfg.loss.args, where="loss.args")
    if str(device) != "meta":
        loss = loss.to(device)  # class-weight buffers
    task = TASKS.build(cfg.task.name, cfg.task.args, where="task.args", loss=loss, augment=augment, info=info)
    task.check_model(model)  # e.g. a classifier's head against task.args.num_classes
    target = parse_target(cfg.train.target)
    if target:  # best.pt, curves.png and best_* follow the metric the recipe targets
        task.follow_target(target[0])
    return task, model


def check_volume_channels(info: dict, model: nn.Module, cfg: RunConfig) -> None:
    """A volume dataset's channels (its ``in_channels``: dataset.json's modalities, checked against the
    images) against the model's first convolution, before any step or file: one line naming both keys."""
    conv = next((m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    have = info.get("in_channels")
    if info.get("spatial_dims") != 3 or conv is None or have is None or conv.in_channels == have:
        return
    names = f" ({', '.join(map(str, info['channels']))})" if info.get("channels") else ""
    raise ConfigError(f"data.args.path {cfg.data.args.get('path')}: the dataset has {have} channel(s){names}, "
                      f"the model takes {conv.in_channels} (model.args.in_channels); a recipe planned for another "
                      "dataset? (fastvision configure DATA plans one for this one)")


def check_patch(train_set: Any, model: nn.Module, cfg: RunConfig) -> None:
    """The training patch the model sees (``data.args.patch_size``, or the size the batched augmentation
    cuts from it: ``data.augment.affine.size``, else ``crop.size``) against the U-Net / SegResNet it feeds,
    before any step: each side a multiple of the model's divisor, and more than one voxel left at the bottleneck
    when the model normalises per instance (one voxel has no variance: torch stops the first step)."""
    import math

    patch, key = getattr(train_set, "patch_size", None), "data.args.patch_size"
    if patch is None and getattr(train_set, "image_size", None) is not None:  # 2-D image files, resized to it
        patch, key = train_set.image_size, "data.args.image_size"
    augment = cfg.data.augment or {}
    for op in ("affine", "crop"):  # the batched augmentation cuts the patch the model sees, the affine last
        size = (augment.get(op) or {}).get("size") if isinstance(augment.get(op), dict) else None
        if size is not None and patch is not None:
            patch, key = size, f"data.augment.{op}.size"
            break
    divisor = getattr(model, "divisor", None)
    if not isinstance(patch, (tuple, list)) or not divisor or len(patch) != len(divisor):
        return
    shown = f"{key}={list(patch)}"
    if any(p % d for p, d in zip(patch, divisor, strict=True)):
        raise ConfigError(f"{shown}: each side must be a multiple of the model's divisor {list(divisor)} (the "
                          "product of its strides, model.args)")
    from fastvision.models.instance_norm import InstanceNormCL

    instance = (nn.modules.instancenorm._InstanceNorm, InstanceNormCL)
    if math.prod(p // d for p, d in zip(patch, divisor, strict=True)) == 1 and any(
            isinstance(m, instance) for m in model.modules()):
        raise ConfigError(f"{shown}: the model halves it down to one voxel at its bottleneck (divisor "
                          f"{list(divisor)}), where instance norm has nothing to normalise; use sides of at least "
                          f"{[2 * d for d in divisor]}, or fewer levels (model.args.filters and strides)")


def check_window(task: Any, model: nn.Module) -> None:
    """The sliding window's ``roi_size`` (``task.args.sliding_window``), and with ``task.args.eval: crop`` the
    ``eval_crop``, against the U-Net / SegResNet it feeds,
    before any step or run folder: each side a multiple of the model's divisor (it stopped the first validation
    with the model's traceback, after the first epoch had trained); a side <= 0 (the whole axis) is left to the
    volume."""
    divisor = getattr(model, "divisor", None)
    window = (getattr(task, "sliding_window", None) or {}).get("roi_size")
    crop = getattr(task, "eval_crop", None) if getattr(task, "eval_mode", None) == "crop" else None
    for key, roi in (("task.args.sliding_window.roi_size", window), ("task.args.eval_crop", crop)):
        if not roi or not divisor:
            continue
        if len(roi) != len(divisor):
            raise ConfigError(f"{key}={list(roi)}: {len(roi)} sides for a model of {len(divisor)} spatial axes")
        if any(r > 0 and r % d for r, d in zip(roi, divisor, strict=True)):
            raise ConfigError(f"{key}={list(roi)}: each side must be a multiple of the model's divisor "
                              f"{list(divisor)} (the product of its strides, model.args)")


def build(cfg: RunConfig, data_info: dict | None = None, *, train: bool = False, loaders: bool = True,
          wrap_train_set: Callable[[Any], Any] | None = None) -> Run:
    """Build a run from its config: the one place model, task, loss, optimizer and data are made.

    Args:
        cfg: the run configuration.
        data_info: build without touching the dataset (prediction, export, benchmark): the dataset
            facts the task needs, as saved in a checkpoint (``{}`` for none). ``train_set`` /
            ``val_set`` are then None.
        train: also build what training needs (optimizer, schedule, generator, EMA, DDP / compile).
        loaders: with ``train`` and a dataset, also the cached training set and both loaders.
        wrap_train_set: applied to the cached training set before its loader is made (the
            profiler's NVTX ranges).
    """
    tc = cfg.train
    env, device = distributed.init(tc.device, timeout_s=tc.dist_timeout_s, backend=tc.backend)
    runtime.set_tf32(tc.tf32)
    runtime.set_threads(tc.cpu_threads)
    runtime.set_heap(tc.cpu_heap)
    runtime.seed_everything(tc.seed, tc.deterministic)
    if data_info is None:
        if cfg.data.num_workers == "auto":  # once, after the threads are set; the number is kept in cfg (config.yaml)
            from fastvision.data.workers import resolve

            cfg.data.num_workers = resolve(env, device, tc.cpu_threads)
        splits = DATASETS.build(cfg.data.name, cfg.data.args, where="data.args")
    else:
        splits = DatasetSplits(None, None, data_info)
    task, model = build_components(cfg, splits.info, device, train=train)
    if data_info is None:
        check_volume_channels(splits.info, model, cfg)
        check_patch(splits.train, model, cfg)
        check_window(task, model)
    model = runtime.prepare_model(model, device, tc.channels_last)
    precision = runtime.Precision(tc.amp, device, tc.loss_scale)
    run = Run(cfg, env, device, task, model, splits.train, splits.val, splits.info, precision)
    if train:
        _build_training(run, loaders, wrap_train_set)
    return run


def _build_training(run: Run, loaders: bool, wrap_train_set: Callable[[Any], Any] | None) -> None:
    """Optimizer (LR scaled to the global batch), data, schedule, generator, EMA, DDP / compile."""
    cfg, tc, env, device = run.cfg, run.cfg.train, run.env, run.device
    if tc.accum_steps < 1 or tc.emulate_workers < 1:
        raise ConfigError("train.accum_steps and train.emulate_workers must be >= 1")
    if tc.emulate_workers > 1 and env.world_size > 1:
        raise ConfigError("--emulate-workers runs in one process; do not combine it with --nproc or a launcher")
    micro_steps = tc.accum_steps * tc.emulate_workers
    run.global_batch = tc.batch_size * micro_steps * env.world_size
    run.lr = optim.effective_lr(cfg.optim, run.global_batch)
    optimizer = optim.build_optimizer(run.model, cfg.optim, run.lr)
    # horovod: DistributedOptimizer (a new object, so before the scheduler); DDP: unchanged
    optimizer = distributed.wrap_optimizer(optimizer, run.model, backward_passes_per_step=micro_steps)
    run.steps_per_epoch = tc.steps_per_epoch or 1  # without data (benchmark): the schedule's unit
    if loaders and run.train_set is not None:
        _build_loaders(run, micro_steps, wrap_train_set)
    generator = torch.Generator(device=device)
    generator.manual_seed(runtime.augment_seed(tc.seed, env.rank))
    if tc.bn_momentum is not None:  # before the EMA's copy and SyncBatchNorm, which keep it
        set_bn_momentum(run.model, tc.bn_momentum)
    ema = make_ema(run.model, tc.ema_decay)
    apply_activation_checkpointing(run.model, tc.activation_checkpointing)  # the bare model, before DDP / compile
    ddp = distributed.wrap_model(run.model, device, sync_bn=tc.sync_bn, bucket_cap_mb=tc.ddp_bucket_mb,
                          static_graph=tc.ddp_static_graph, comm_hook=tc.ddp_comm_hook)
    run.step = StepState(run.task, runtime.maybe_compile(ddp, tc.compile), optimizer,
                         optim.build_scheduler(optimizer, cfg.sched, run.steps_per_epoch, tc.epochs), run.precision,
                         device, generator, ema, bare=run.model, micro_steps=micro_steps,
                         channels_last=tc.channels_last, clip_grad=tc.clip_grad, check_finite=tc.check_finite)


def _build_loaders(run: Run, micro_steps: int, wrap_train_set: Callable[[Any], Any] | None) -> None:
    """The cached training set, both loaders (a device prefetcher on CUDA) and the steps per epoch."""
    cfg, tc, device = run.cfg, run.cfg.train, run.device
    raw = run.train_set
    # the sampler first: the gpu cache holds on the device the share it reads each epoch
    sampler = train_sampler(len(raw), cfg, tc.batch_size, order=getattr(raw, "epoch_order", None))
    run.train_set = cached_train_set(raw, cfg, run.env, device, share=sampler.indices)
    data = wrap_train_set(run.train_set) if wrap_train_set else run.train_set
    if tc.augment_rng == "sample":  # each item keyed by (seed, epoch, index): the draws follow the sample
        from fastvision.data.augment.keyed import KeyedItems

        check_keyed_augment(run, data)
        data = KeyedItems(data, tc.seed)
    run.train_loader = make_loader(data, run.task, cfg, tc.batch_size, True, device,
                                   sampler=sampler if len(data) == len(raw) else None)  # smart: its window
    if device.type == "cuda" and not hasattr(data, "make_loader"):
        # copy batch k+1 to the GPU on a side stream while batch k computes
        run.train_loader = DevicePrefetcher(run.train_loader, device,
                                            lambda b, d: run.task.to_device(b, d, tc.channels_last))
    run.val_loader = make_loader(run.val_set, run.task, cfg, cfg.data.val_batch_size or tc.batch_size, False, device)
    run.steps_per_epoch = len(run.train_loader) // micro_steps
    if tc.steps_per_epoch:
        run.steps_per_epoch = min(run.steps_per_epoch, tc.steps_per_epoch)
    if run.steps_per_epoch == 0:
        raise ConfigError(f"train.batch_size {tc.batch_size} x {micro_steps} micro-steps is larger than "
                          f"the {len(raw)} training items")


def check_keyed_augment(run: Run, data) -> None:
    """``train.augment_rng: sample`` where every draw can follow its sample; else a one-line error."""
    cfg, task = run.cfg, run.task
    why = None
    if hasattr(data, "make_loader"):
        why = "this dataset's own loader (data.args.backend: dali) draws its augmentation itself"
    elif cfg.data.cache == "smart":
        why = "data.cache: smart trains each epoch on a window indexed apart from the dataset"
    elif getattr(task, "mixup", 0):
        why = f"MixUp (task.args.mixup {task.mixup}) pairs the samples of a rank's batch"
    elif cfg.task.name not in ("segmentation", "classification"):
        why = f"the {cfg.task.name} task's augmentation is not per-sample keyed"
    if why:
        raise ConfigError(f"train.augment_rng: sample: {why}; use train.augment_rng: rank")


def train_sampler(n: int, cfg: RunConfig, batch_size: int, order=None) -> distributed.TrainSampler:
    """The training order of ``n`` items: this rank's share of the (train.seed, epoch) permutation
    (emulated workers' micro-batches with ``train.emulate_workers``); ``order``: the dataset's own
    permutation of a (seed, epoch) generator (a shard set's ``epoch_order``)."""
    return distributed.TrainSampler(n, seed=cfg.train.seed, shuffle=True, emulate_workers=cfg.train.emulate_workers,
                                    batch_size=batch_size, order=order, full_batches=True)


def make_loader(dataset, task: Task, cfg: RunConfig, batch_size: int, train: bool, device: torch.device,
                sampler: distributed.TrainSampler | None = None):
    """Loader over a rank's shard: deterministic per (seed, epoch) for training. A validation set
    is cached as it is first read when ``data.cache`` is not ``none``.

    The training sampler (``sampler``, default :func:`train_sampler`) is the one order of every
    cache tier: a cache is indexed as the dataset, so ``data.cache`` never changes which items a
    step reads (docs/CONTRACTS.md).
    """
    if hasattr(dataset, "make_loader"):  # a dataset with its own sharding loader (DALI)
        return dataset.make_loader(batch_size=batch_size, shard_id=distributed.rank(),
                                   num_shards=distributed.world_size(), seed=cfg.train.seed, device=device)
    if train:
        sampler = sampler or train_sampler(len(dataset), cfg, batch_size)
        drop_last = cfg.train.emulate_workers > 1 or len(sampler) >= batch_size
    else:
        if cfg.data.cache != "none":  # deterministic items: cached as first read (this rank's shard)
            from fastvision.data.cache.select import wrap_val_set

            dataset = wrap_val_set(dataset, cache=cfg.data.cache, cache_dir=cfg.data.cache_dir)
        sampler, drop_last = distributed.EvalSampler(dataset), False
    return build_loader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=task.collate,
                        loader=cfg.data.loader, num_workers=cfg.data.num_workers, drop_last=drop_last,
                        seed=cfg.train.seed, repeats=cfg.data.repeats if train else 1,
                        pin_memory=device.type == "cuda")


def cached_train_set(dataset, cfg: RunConfig, env: distributed.DistEnv, device: torch.device, share=None):
    """The training set behind the configured cache (``data.cache``). Its random transforms run
    per access with generators of (train.seed, epoch, sample index); with ``none`` a dataset
    without random transforms is returned unchanged. ``share``: ``epoch -> indices`` this rank
    reads (the training sampler's ``indices``), what the gpu cache keeps on the device."""
    from fastvision.data.cache.select import wrap_train_set

    d = cfg.data
    if d.cache == "auto":  # the tier for this set here, kept in cfg: the validation set's cache follows it
        from fastvision.data.cache.auto import resolve

        d.cache = resolve(dataset, env, device)
    return wrap_train_set(dataset, cache=d.cache, cache_rate=d.cache_rate, cache_dir=d.cache_dir,
                          cache_num=d.cache_num, replace_rate=d.replace_rate, env=env, device=device,
                          seed=cfg.train.seed, share=share)
