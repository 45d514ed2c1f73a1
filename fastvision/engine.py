"""Training engine: ``fit(cfg, run_dir)`` builds the run, then one visible loop.

The step reads top to bottom: data wait, to device, batched augmentation, autocast forward and
loss, scaled backward (no gradient sync on accumulation micro-steps), unscale + clip, optimizer
step through the scaler, schedule, log. Host syncs happen only where commented.
"""
from __future__ import annotations

import inspect
import json
import logging
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from . import __version__, checkpoint, dist, optim, runtime
from .config import RunConfig, to_dict
from .data.formats import DatasetSplits
from .data.loader import DevicePrefetcher, build_loader
from .errors import ConfigError, FastvisionError
from .log import RunLogger
from .models import create_model  # noqa: F401  (imports register every model)
from .registry import DATASETS, LOSSES, MODELS, TASKS
from .tasks.base import Task

log = logging.getLogger(__name__)


class NonFiniteLossError(FastvisionError):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclass
class Run:
    """Everything a training or evaluation run is made of (built once by :func:`build`)."""

    cfg: RunConfig
    env: dist.DistEnv
    device: torch.device
    task: Task
    model: nn.Module  # bare model (what checkpoints hold)
    train_set: Any
    val_set: Any
    info: dict


def build(cfg: RunConfig, data_info: dict | None = None) -> Run:
    """Resolve the device, then data, loss, task and model from their registries.

    Args:
        cfg: the run configuration.
        data_info: build without touching the dataset (prediction, export): the dataset facts the
            task needs, as saved in a checkpoint. ``train_set``/``val_set`` are then None and there
            is no training augmentation.
    """
    import_components()
    env, device = dist.init(cfg.train.device, backend=cfg.train.backend)
    runtime.set_tf32(cfg.train.tf32)
    runtime.seed_everything(cfg.train.seed, cfg.train.deterministic)
    if data_info is None:
        splits = DATASETS.build(cfg.data.name, cfg.data.args, where="data.args")
    else:
        splits = DatasetSplits(None, None, data_info)
    loss = LOSSES.build(cfg.loss.name, cfg.loss.args, where="loss.args").to(device)  # class-weight buffers
    augment = None
    if cfg.data.augment and splits.train is not None:
        from .data.gpu_aug import build_augment

        augment = build_augment(_spatial_dims(splits.train), **cfg.data.augment)
    extra = {"info": splits.info} if "info" in inspect.signature(TASKS.get(cfg.task.name)).parameters else {}
    task = TASKS.build(cfg.task.name, cfg.task.args, where="task.args", loss=loss, augment=augment, **extra)
    model = MODELS.build(cfg.model.name, cfg.model.args, where="model.args")
    model = runtime.prepare_model(model, device, cfg.train.channels_last)
    return Run(cfg, env, device, task, model, splits.train, splits.val, splits.info)


def import_components() -> None:
    """Import the modules that register datasets, losses, tasks and models."""
    import importlib

    for name in ("losses", "data.formats.microscopy", "tasks.segment", "tasks.classify", "tasks.detect",
                 "data.formats.imagefolder", "data.formats.coco", "data.formats.decathlon",
                 "data.formats.brats", "data.formats.pathology"):
        importlib.import_module(f"fastvision.{name}")


def resolved_config(cfg: RunConfig) -> dict[str, Any]:
    """The config with every builder default filled in (what gets saved and logged)."""
    out = to_dict(cfg)
    for section, reg in (("model", MODELS), ("loss", LOSSES), ("task", TASKS)):
        out[section]["args"] = {**_public_defaults(reg, out[section]["name"]), **out[section]["args"]}
    out["data"]["args"] = {**_public_defaults(DATASETS, cfg.data.name), **out["data"]["args"]}
    return out


def _public_defaults(reg, name: str) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in reg.defaults(name).items()
            if k not in ("loss", "augment", "info")}


def _spatial_dims(dataset) -> int:
    return dataset[0]["image"].dim() - 1


def make_loader(dataset, task: Task, cfg: RunConfig, batch_size: int, train: bool, device: torch.device):
    """Loader over a rank's shard: deterministic per (seed, epoch) for training. A validation set
    is cached as it is first read when ``data.cache`` is not ``none``.

    A dataset that is already this rank's partition (GPU cache under DDP: ``rank_local``) is read
    whole by its rank; every other dataset is sharded here.
    """
    if hasattr(dataset, "make_loader"):  # a dataset with its own sharding loader (DALI)
        return dataset.make_loader(batch_size=batch_size, shard_id=dist.rank(), num_shards=dist.world_size(),
                                   seed=cfg.train.seed, device=device)
    if train:
        emulate = cfg.train.emulate_workers
        local = getattr(dataset, "rank_local", False)
        sampler = dist.TrainSampler(dataset, seed=cfg.train.seed, shuffle=True, emulate_workers=emulate,
                                    batch_size=batch_size, **({"num_replicas": 1, "rank": 0} if local else {}))
        drop_last = emulate > 1 or len(sampler) >= batch_size
    else:
        if cfg.data.cache != "none":  # deterministic items: cached as first read (this rank's shard)
            from .data.cache_select import wrap_val_set

            dataset = wrap_val_set(dataset, cache=cfg.data.cache, cache_dir=cfg.data.cache_dir)
        sampler, drop_last = dist.EvalSampler(dataset), False
    return build_loader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=task.collate,
                        loader=cfg.data.loader, num_workers=cfg.data.num_workers, drop_last=drop_last,
                        seed=cfg.train.seed, repeats=cfg.data.repeats if train else 1,
                        pin_memory=device.type == "cuda")


def cached_train_set(dataset, cfg: RunConfig, env: dist.DistEnv, device: torch.device):
    """The training set behind the configured cache (``data.cache``). Its random transforms run
    per access with generators of (train.seed, epoch, sample index); with ``none`` a dataset
    without random transforms is returned unchanged."""
    from .data.cache_select import wrap_train_set

    d = cfg.data
    return wrap_train_set(dataset, cache=d.cache, cache_rate=d.cache_rate, cache_dir=d.cache_dir,
                          cache_num=d.cache_num, replace_rate=d.replace_rate, env=env, device=device,
                          seed=cfg.train.seed)


def plain(info: dict) -> dict:
    """Dataset facts as JSON-able plain types (checkpoints must load with ``weights_only``)."""
    return json.loads(json.dumps(info, default=str))


def parse_target(target: str | None) -> tuple[str, float] | None:
    if not target:
        return None
    name, sep, value = target.partition("=")
    try:
        return name.strip(), float(value)
    except ValueError:
        raise ConfigError(f"--target {target!r}: expected METRIC=VALUE, e.g. iou=0.9") from None


def environment(env: dist.DistEnv, device: torch.device) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"fastvision": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "device": str(device), "gpu": gpu, "world_size": env.world_size,
            "launcher": env.launcher, "host": platform.node(), "cpu_threads": torch.get_num_threads()}


# ------------------------------------------------------------------------------------- fit
def fit(cfg: RunConfig, run_dir: Path, resume: Path | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Train ``cfg`` into ``run_dir`` (created by the caller); returns the run summary."""
    run = build(cfg)
    tc, env, device, task, model = cfg.train, run.env, run.device, run.task, run.model
    if tc.accum_steps < 1 or tc.emulate_workers < 1:
        raise ConfigError("train.accum_steps and train.emulate_workers must be >= 1")
    if tc.emulate_workers > 1 and env.world_size > 1:
        raise ConfigError("--emulate-workers runs in one process; do not combine it with --nproc or a launcher")
    micro_steps = tc.accum_steps * tc.emulate_workers  # micro-batches per optimizer step
    global_batch = tc.batch_size * micro_steps * env.world_size
    lr = optim.effective_lr(cfg.optim, global_batch)
    optimizer = optim.build_optimizer(model, cfg.optim, lr)
    # horovod: DistributedOptimizer (a new object, so before the scheduler); DDP: unchanged
    optimizer = dist.wrap_optimizer(optimizer, model, backward_passes_per_step=micro_steps)
    train_set = cached_train_set(run.train_set, cfg, env, device)
    train_loader = make_loader(train_set, task, cfg, tc.batch_size, True, device)
    if device.type == "cuda" and not hasattr(train_set, "make_loader"):
        # copy batch k+1 to the GPU on a side stream while batch k computes
        train_loader = DevicePrefetcher(train_loader, device,
                                        lambda b, d: task.to_device(b, d, tc.channels_last))
    val_loader = make_loader(run.val_set, task, cfg, cfg.data.val_batch_size or tc.batch_size, False, device)
    steps_per_epoch = len(train_loader) // micro_steps
    if tc.steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, tc.steps_per_epoch)
    if steps_per_epoch == 0:
        raise ConfigError(f"train.batch_size {tc.batch_size} x {micro_steps} micro-steps is larger than "
                          f"the {len(run.train_set)} training items")
    scheduler = optim.build_scheduler(optimizer, cfg.sched, steps_per_epoch, tc.epochs)
    precision = runtime.Precision(tc.amp, device)
    generator = torch.Generator(device=device)
    generator.manual_seed(tc.seed * 1_000_003 + env.rank)
    target = parse_target(tc.target)

    ema = make_ema(model, tc.ema_decay)
    state = {"epoch": -1, "step": 0, "best": None, "train_time": 0.0, "history": [], "data_info": plain(run.info)}
    if resume is not None:
        # RNG states must stay CPU tensors; load_state_dict moves weights and optimizer state itself
        state = _restore(checkpoint.load(resume, "cpu"), model, optimizer, scheduler, precision, generator, ema)
        log.info("resumed from %s at epoch %d", resume, state["epoch"] + 1)
    dist.broadcast_state(model, optimizer)  # horovod: rank 0's weights (+ resumed optimizer state); DDP: no-op

    ddp = dist.wrap_model(model, device, sync_bn=tc.sync_bn, bucket_cap_mb=tc.ddp_bucket_mb,
                          static_graph=tc.ddp_static_graph)
    train_model = runtime.maybe_compile(ddp, tc.compile)
    if env.is_main:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    logger = RunLogger(run_dir, enabled=env.is_main, tensorboard=cfg.tensorboard, progress=progress)
    logger.history = list(state["history"])
    resolved = resolved_config(cfg)
    if env.is_main:  # the resolved config, every builder default filled in
        (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    logger.parameters(resolved, {**environment(env, device), "global_batch": global_batch,
                                 "base_lr": cfg.optim.lr, "effective_lr": lr, "data": run.info})
    summary: dict[str, Any] = {"run_dir": str(run_dir)}
    try:
        for epoch in range(state["epoch"] + 1, tc.epochs):
            train_loader.set_epoch(epoch)
            t0 = time.perf_counter()
            stats = train_one_epoch(train_model, task, train_loader, optimizer, scheduler, precision, generator,
                                    tc, micro_steps, epoch, steps_per_epoch, state, logger, ema)
            state["train_time"] += time.perf_counter() - t0
            row = {"train_loss": stats["loss"], "lr": optimizer.param_groups[0]["lr"],
                   "images_per_s": stats["images_per_s"], "epoch_time_s": stats["time_s"]}
            if (epoch + 1) % tc.val_every == 0 or epoch + 1 == tc.epochs:
                row.update(evaluate(eval_model(model, ema), task, val_loader, device, precision, tc.channels_last))
                if target and target[0] not in row:  # checked at the first validation: metrics are task-defined
                    raise ConfigError(f"--target {target[0]}: not a metric of this run; valid: "
                                      f"{', '.join(k for k in row if k not in ('lr', 'epoch_time_s'))}")
            logger.epoch_end(epoch, row)
            state["epoch"], state["history"] = epoch, logger.history
            improved = _improved(task, row, state["best"])
            if improved:
                state["best"] = row[task.primary_metric]
            if env.is_main:
                ckpt = _checkpoint(model, optimizer, scheduler, precision, generator, state, resolved, ema)
                checkpoint.atomic_save(ckpt, run_dir / "checkpoints" / "last.pt")
                if improved:
                    checkpoint.atomic_save(ckpt, run_dir / "checkpoints" / "best.pt")
            if target and target[0] in row and _reached(task, target[0], row[target[0]], target[1]):
                summary.update(target_reached=True, time_to_target_s=state["train_time"], target_epoch=epoch + 1)
                log.info("target %s=%g reached at epoch %d after %.1f s", *target, epoch + 1, state["train_time"])
                break
        else:
            if target:
                summary["target_reached"] = False
        dist.barrier()
        last = logger.history[-1] if logger.history else {}
        summary.update({"epochs": state["epoch"] + 1, "train_time_s": state["train_time"],
                        f"best_{task.primary_metric}": state["best"],
                        **{k: v for k, v in last.items() if k != "epoch"}})
        if env.is_main:
            _finish(run, eval_model(model, ema), val_loader, precision, logger, summary, run_dir)
    finally:
        logger.close()
        if hasattr(train_set, "shutdown"):  # smart cache: stop its replacement threads
            train_set.shutdown()
    return summary


def _finish(run: Run, model: nn.Module, val_loader, precision, logger: RunLogger, summary: dict,
            run_dir: Path) -> None:
    """Prediction overlays of a few validation images, curves.png, the summary event and table."""
    if run.cfg.examples and hasattr(run.task, "save_examples"):
        batch = run.task.to_device(next(iter(val_loader)), run.device, run.cfg.train.channels_last)
        model.eval()
        with torch.no_grad(), precision.autocast():
            out = run.task.eval_forward(model, batch)
        out = out.float() if torch.is_tensor(out) else out
        if run.task.save_examples(out, batch, run_dir / "examples", run.cfg.examples):
            summary["examples"] = str(run_dir / "examples")
    curves = logger.plot_curves(run.task.primary_metric)
    if curves:
        summary["curves"] = str(curves)
    logger.summary(summary)


def train_one_epoch(model, task: Task, loader, optimizer, scheduler, precision: runtime.Precision,
                    generator, tc, micro_steps: int, epoch: int, steps: int, state: dict,
                    logger: RunLogger, ema=None) -> dict[str, float]:
    """One epoch of ``steps`` optimizer steps, each over ``micro_steps`` micro-batches."""
    model.train()
    logger.start_epoch(epoch, tc.epochs, steps)
    device = precision.device
    loss_sum = torch.zeros((), device=device)
    loss_count, images, bad_streak, step_in_epoch = 0, 0, 0, 0
    t_start = time.perf_counter()
    data_time = compute_time = 0.0
    it = iter(loader)
    while step_in_epoch < steps:
        micro_losses = []
        for micro in range(micro_steps):
            t0 = time.perf_counter()
            batch = next(it)
            t1 = time.perf_counter()
            data_time += t1 - t0
            batch = task.augment(task.to_device(batch, device, tc.channels_last), generator)
            with dist.no_sync(model, micro + 1 < micro_steps):
                with precision.autocast():
                    loss = task.loss(task.forward(model, batch), batch)
                precision.scaler.scale(loss / micro_steps).backward()
            micro_losses.append(loss.detach())
            images += task.batch_size(batch)
            compute_time += time.perf_counter() - t1
        loss = torch.stack(micro_losses).mean()
        with dist.synchronized(optimizer):  # horovod: all-reduce done before the checks, clip and step
            # Deliberate host sync: a non-finite loss must skip this update (fp16: the scaler checks).
            if tc.check_finite and precision.mode != "fp16" and not finite_everywhere(loss):
                optimizer.zero_grad()  # set_to_none by default (torch >= 2); horovod takes no argument
                bad_streak = _bad_step(bad_streak, tc, state, "loss is not finite")
                step_in_epoch += 1
                logger.advance()
                continue
            if tc.clip_grad:
                precision.scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), tc.clip_grad)
            # fp16: GradScaler.step already syncs to decide whether to skip; reading the scale
            # before and after (two small syncs) tells us it did
            scale_before = precision.scaler.get_scale() if precision.mode == "fp16" else None
            precision.scaler.step(optimizer)
            precision.scaler.update()
            optimizer.zero_grad()  # set_to_none by default (torch >= 2); horovod takes no argument
        if scale_before is not None and precision.scaler.get_scale() < scale_before:  # fp16 overflow: skipped
            bad_streak = _bad_step(bad_streak, tc, state, "fp16 gradients overflowed", quiet=bad_streak < 3)
        else:
            bad_streak = 0
            scheduler.step()
            if ema is not None:
                ema.update_parameters(dist.unwrap(model))
            loss_sum += loss
            loss_count += 1
        state["step"] += 1
        step_in_epoch += 1
        logger.advance()
        if state["step"] % tc.log_every == 0 or step_in_epoch == steps:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # deliberate: honest images/s at log intervals only
            now = time.perf_counter()
            values = {"loss": float(loss), "lr": optimizer.param_groups[0]["lr"],
                      "images_per_s": images * dist.world_size() / max(now - t_start, 1e-9),
                      "data_time_s": data_time / max(1, step_in_epoch * micro_steps),
                      "compute_time_s": compute_time / max(1, step_in_epoch * micro_steps)}
            logger.step(epoch, step_in_epoch, state["step"], values)
    elapsed = time.perf_counter() - t_start
    # one sync and one collective per epoch: the mean loss over every rank's steps
    totals = dist.all_reduce_sum(torch.stack([loss_sum.double(), loss_sum.new_tensor(loss_count).double()]))
    mean_loss = float(totals[0] / totals[1]) if float(totals[1]) else math.nan
    return {"loss": mean_loss, "images_per_s": images * dist.world_size() / max(elapsed, 1e-9), "time_s": elapsed}


def finite_everywhere(loss: torch.Tensor) -> bool:
    """Whether the loss is finite on every rank (a rank alone skipping a step would let the others
    apply its all-reduced NaN gradients and the replicas drift apart)."""
    bad = (~torch.isfinite(loss)).to(torch.float32).reshape(1)
    return not bool(dist.all_reduce_sum(bad) > 0)


def _bad_step(streak: int, tc, state: dict, why: str, quiet: bool = False) -> int:
    streak += 1
    if streak >= tc.max_nonfinite:
        raise NonFiniteLossError(f"stopping: {streak} consecutive steps skipped ({why}) at step {state['step']}; "
                                 "lower optim.lr, set train.clip_grad, or use --amp bf16/off")
    (log.debug if quiet else log.warning)("step %d skipped: %s", state["step"], why)
    return streak


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, loader, device: torch.device, precision: runtime.Precision,
             channels_last: bool = False) -> dict[str, float]:
    """Metrics over the whole validation set: per-rank sums, one all-reduce, then compute."""
    was_training = model.training
    model.eval()
    ev = task.evaluator()
    for batch in loader:
        batch = task.to_device(batch, device, channels_last)
        with precision.autocast():
            out = task.eval_forward(model, batch)
        ev.update(out.float() if torch.is_tensor(out) else out, batch)
    state = ev.state().to(device)
    ev.load_state(dist.all_reduce_sum(state).cpu())
    model.train(was_training)
    return ev.compute()


def _improved(task: Task, row: dict, best: float | None) -> bool:
    value = row.get(task.primary_metric)
    if value is None or value != value:  # missing or NaN
        return False
    return best is None or (value > best if task.higher_is_better else value < best)


def _reached(task: Task, name: str, value: float, goal: float) -> bool:
    """Losses are reached from above; task metrics in the task's direction."""
    higher = task.higher_is_better if name == task.primary_metric else "loss" not in name
    return value >= goal if higher else value <= goal


def make_ema(model: nn.Module, decay: float | None):
    """An exponential moving average of the weights (and buffers), or None."""
    if decay is None:
        return None
    if not 0.0 < decay < 1.0:
        raise ConfigError(f"train.ema_decay must be in (0, 1), got {decay}")
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


def eval_model(model: nn.Module, ema) -> nn.Module:
    """The weights that are validated and that ``predict`` uses: the EMA when there is one."""
    return ema.module if ema is not None else model


def _checkpoint(model, optimizer, scheduler, precision, generator, state, resolved, ema=None) -> dict[str, Any]:
    extra = {"ema": ema.state_dict(), "eval_model": ema.module.state_dict()} if ema is not None else {}
    return {**extra, "model": checkpoint.strip_prefixes(dist.unwrap(model).state_dict()),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": precision.scaler.state_dict(), "epoch": state["epoch"], "step": state["step"],
            "best": state["best"], "train_time": state["train_time"], "history": state["history"],
            "rng": runtime.rng_state(generator), "config": resolved, "data_info": state["data_info"],
            "fastvision": __version__}


def _restore(ckpt, model, optimizer, scheduler, precision, generator, ema=None) -> dict[str, Any]:
    model.load_state_dict(ckpt["model"])
    if ema is not None:
        if "ema" not in ckpt:
            raise ConfigError("train.ema_decay is set but the checkpoint has no EMA weights to resume")
        ema.load_state_dict(ckpt["ema"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    precision.scaler.load_state_dict(ckpt["scaler"])
    runtime.set_rng_state(ckpt["rng"], generator)
    return {k: ckpt[k] for k in ("epoch", "step", "best", "train_time", "history", "data_info")}
