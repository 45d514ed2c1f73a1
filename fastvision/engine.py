"""Training engine: one :func:`build` and one :func:`train_step` for train, profile, benchmark and export.

:func:`build` turns a config into a :class:`Run`: device, data (cache, loaders), loss, task, model,
and for training the optimizer, schedule, precision, EMA and the DDP / compile wrap. :func:`train_step`
is the only training step; ``fit`` loops it, ``fastvision profile`` times its phases through its
``clock`` hook, ``fastvision benchmark`` times it on synthetic batches. It reads top to bottom: data
wait, to device, batched augmentation, autocast forward and loss, scaled backward (no gradient sync on
accumulation micro-steps), non-finite check, on-device found-inf check (the
GradScaler's), clip, an optimizer step made a no-op on the device when found-inf is set, schedule,
EMA. No host sync in the step; ``fit`` reads its device counters at log intervals only.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch
import yaml
from torch import nn

from . import checkpoint, dist, losses, models, optim, runtime, tasks  # noqa: F401  (import registers)
from .config import RunConfig
from .data import formats  # noqa: F401  (importing the package registers every dataset format)
from .data.formats import DatasetSplits
from .data.loader import DevicePrefetcher, build_loader
from .errors import ConfigError, FastvisionError
from .log import RunLogger
from .registry import DATASETS, LOSSES, MODELS, TASKS
from .run_state import (checkpoint_state, environment, eval_model, improved, initial_state, make_ema, parse_target,
                        reached, resolved_config, restore)
from .tasks.base import Task

log = logging.getLogger(__name__)



class NonFiniteLossError(FastvisionError):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclass
class Run:
    """Everything a run is made of, built once by :func:`build`.

    The training parts (``optimizer`` ... ``steps_per_epoch``) are None unless built with
    ``train=True``; the loaders are None without a dataset or with ``loaders=False``.
    """

    cfg: RunConfig
    env: dist.DistEnv
    device: torch.device
    task: Task
    model: nn.Module  # bare model (what checkpoints hold)
    train_set: Any  # behind the configured cache when the loaders were built
    val_set: Any
    info: dict
    precision: runtime.Precision
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    generator: torch.Generator | None = None  # batched augmentation draws from it
    train_model: nn.Module | None = None  # the model under DDP / torch.compile: what the step calls
    ema: Any = None
    micro_steps: int = 1  # micro-batches per optimizer step (accumulation x emulated workers)
    global_batch: int = 0  # items per optimizer step over all ranks
    lr: float = 0.0  # learning rate after linear scaling to the global batch
    train_loader: Any = None
    val_loader: Any = None
    steps_per_epoch: int = 0


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
    env, device = dist.init(tc.device, backend=tc.backend)
    runtime.set_tf32(tc.tf32)
    runtime.seed_everything(tc.seed, tc.deterministic)
    if data_info is None:
        splits = DATASETS.build(cfg.data.name, cfg.data.args, where="data.args")
    else:
        splits = DatasetSplits(None, None, data_info)
    loss = LOSSES.build(cfg.loss.name, cfg.loss.args, where="loss.args").to(device)  # class-weight buffers
    task = TASKS.build(cfg.task.name, cfg.task.args, where="task.args", loss=loss, augment=None, info=splits.info)
    if train and cfg.data.augment:
        from .data.gpu_aug import build_augment

        # batched augmentation for the data's dimensionality (the task's synthetic batch without data)
        item = splits.train[0] if splits.train is not None else task.synthetic_batch(1, torch.device("cpu"))
        dims = item[task.input_key].dim() - (1 if splits.train is not None else 2)
        task = TASKS.build(cfg.task.name, cfg.task.args, where="task.args", loss=loss,
                           augment=build_augment(dims, **cfg.data.augment), info=splits.info)
    model = runtime.prepare_model(MODELS.build(cfg.model.name, cfg.model.args, where="model.args"), device,
                                  tc.channels_last)
    run = Run(cfg, env, device, task, model, splits.train, splits.val, splits.info, runtime.Precision(tc.amp, device))
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
    run.micro_steps = tc.accum_steps * tc.emulate_workers
    run.global_batch = tc.batch_size * run.micro_steps * env.world_size
    run.lr = optim.effective_lr(cfg.optim, run.global_batch)
    optimizer = optim.build_optimizer(run.model, cfg.optim, run.lr)
    # horovod: DistributedOptimizer (a new object, so before the scheduler); DDP: unchanged
    run.optimizer = dist.wrap_optimizer(optimizer, run.model, backward_passes_per_step=run.micro_steps)
    run.steps_per_epoch = tc.steps_per_epoch or 1  # without data (benchmark): the schedule's unit
    if loaders and run.train_set is not None:
        raw = run.train_set
        run.train_set = cached_train_set(raw, cfg, env, device)
        data = wrap_train_set(run.train_set) if wrap_train_set else run.train_set
        run.train_loader = make_loader(data, run.task, cfg, tc.batch_size, True, device)
        if device.type == "cuda" and not hasattr(data, "make_loader"):
            # copy batch k+1 to the GPU on a side stream while batch k computes
            run.train_loader = DevicePrefetcher(run.train_loader, device,
                                                lambda b, d: run.task.to_device(b, d, tc.channels_last))
        run.val_loader = make_loader(run.val_set, run.task, cfg, cfg.data.val_batch_size or tc.batch_size, False,
                                     device)
        run.steps_per_epoch = len(run.train_loader) // run.micro_steps
        if tc.steps_per_epoch:
            run.steps_per_epoch = min(run.steps_per_epoch, tc.steps_per_epoch)
        if run.steps_per_epoch == 0:
            raise ConfigError(f"train.batch_size {tc.batch_size} x {run.micro_steps} micro-steps is larger than "
                              f"the {len(raw)} training items")
    run.scheduler = optim.build_scheduler(run.optimizer, cfg.sched, run.steps_per_epoch, tc.epochs)
    run.generator = torch.Generator(device=device)
    run.generator.manual_seed(tc.seed * 1_000_003 + env.rank)
    run.ema = make_ema(run.model, tc.ema_decay)
    ddp = dist.wrap_model(run.model, device, sync_bn=tc.sync_bn, bucket_cap_mb=tc.ddp_bucket_mb,
                          static_graph=tc.ddp_static_graph, comm_hook=tc.ddp_comm_hook)
    run.train_model = runtime.maybe_compile(ddp, tc.compile)


# ------------------------------------------------------------------------------- the step
class StepResult(NamedTuple):
    """What one optimizer step reports back.

    Attributes:
        loss: mean loss of the micro-batches, detached, on the device (no host sync to get it).
        images: items trained on (this rank).
        skipped: 0-d float32 on the device: 1.0 when the update was skipped (non-finite
            gradients, fp16 overflow; the same on every rank), 0.0 when applied. Read it only at
            log intervals: reading it is a host sync.
    """

    loss: torch.Tensor
    images: int
    skipped: torch.Tensor


def _no_clock(phase: str) -> None:
    return None


def train_step(run: Run, batches: Iterator[Any], clock: Callable[[str], None] | None = None) -> StepResult:
    """One optimizer step over ``run.micro_steps`` micro-batches from ``batches``: the only training step.

    Args:
        run: a :func:`build` result with ``train=True``.
        batches: iterator of collated batches (host or device).
        clock: told each phase's name as it starts: per micro-batch "data", "h2d", "augment",
            "forward", "backward"; then "optimizer" and "end". The profiler's timer and fit's
            data-wait meter; None calls a no-op (no sync, no allocation).
    """
    mark = clock or _no_clock
    tc, task, model, optimizer, scaler = run.cfg.train, run.task, run.train_model, run.optimizer, run.precision.scaler
    losses, images = [], 0
    for micro in range(run.micro_steps):
        mark("data")
        batch = next(batches)
        mark("h2d")
        batch = task.to_device(batch, run.device, tc.channels_last)
        mark("augment")
        batch = task.augment(batch, run.generator)
        mark("forward")
        with dist.no_sync(model, micro + 1 < run.micro_steps):  # all-reduce on the last micro-batch only
            with run.precision.autocast():
                loss = task.loss(task.forward(model, batch), batch)
            mark("backward")
            scaler.scale(loss / run.micro_steps).backward()
        losses.append(loss.detach())
        images += task.batch_size(batch)
    mark("optimizer")
    loss = torch.stack(losses).mean()
    with dist.synchronized(optimizer):  # horovod: all-reduce done before the checks, clip and step
        found_inf = _found_inf(run, optimizer, scaler)
        if tc.clip_grad:
            nn.utils.clip_grad_norm_(model.parameters(), tc.clip_grad)  # foreach, no host read
        optim.step_unless(optimizer, found_inf)
        if found_inf is None:  # nothing checked (train.check_finite off): nothing skipped
            found_inf = torch.zeros((), device=run.device)
        if run.precision.mode == "fp16":
            scaler.update()  # backs the scale off on found_inf, on the device
        optimizer.zero_grad()  # set_to_none by default (torch >= 2); horovod takes no argument
    # the schedule advances on skipped steps too: deciding otherwise would need a host read
    run.scheduler.step()
    if run.ema is not None:
        run.ema.update_parameters(run.model, found_inf)
    mark("end")
    return StepResult(loss, images, found_inf)


def _found_inf(run: Run, optimizer, scaler) -> torch.Tensor | None:
    """0-d float32 on the device, non-zero when this update must be skipped; no host read.

    fp16: the GradScaler's unscale checks the gradients (always run: the skip decision needs it).
    bf16 / fp32: the same check of the all-reduced gradients when ``train.check_finite`` (a
    non-finite loss makes non-finite gradients), else None (no check: a plain step).
    """
    if run.precision.mode == "fp16":
        scaler.unscale_(optimizer)
        found = list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        return sum(found[1:], found[0]).reshape(())
    if run.cfg.train.check_finite:
        return optim.grads_found_inf(optimizer)
    return None


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


# ------------------------------------------------------------------------------------- fit
def fit(cfg: RunConfig, run_dir: Path, resume: Path | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Train ``cfg`` into ``run_dir`` (created by the caller); returns the run summary.

    Two clocks: ``train_time_s`` / ``time_to_target_s`` count the training epochs only (the
    seeds' time-to-target); ``wall_time_s`` / ``time_to_target_wall_s`` count everything since
    ``fit`` was called (build, data, validation, checkpoints), what a user waits. Both add up
    over resumed runs.
    """
    started = time.perf_counter()
    run = build(cfg, train=True)
    tc, env, task, model = cfg.train, run.env, run.task, run.model
    target = parse_target(tc.target)
    state = initial_state(run.info)
    if resume is not None:
        # RNG states must stay CPU tensors; load_state_dict moves weights and optimizer state itself
        state = restore(checkpoint.load(resume, "cpu"), run)
        log.info("resumed from %s at epoch %d", resume, state["epoch"] + 1)
    dist.broadcast_state(model, run.optimizer)  # horovod: rank 0's weights (+ resumed optimizer state); DDP: no-op
    wall_before = state["wall_time"]
    wall = lambda: wall_before + time.perf_counter() - started  # noqa: E731
    if env.is_main:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    logger = RunLogger(run_dir, enabled=env.is_main, tensorboard=cfg.tensorboard, progress=progress)
    logger.history = list(state["history"])
    resolved = resolved_config(cfg)
    if env.is_main:  # the resolved config, every builder default filled in
        (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    logger.parameters(resolved, {**environment(env, run.device), "global_batch": run.global_batch,
                                 "base_lr": cfg.optim.lr, "effective_lr": run.lr, "data": run.info})
    writer = checkpoint.BackgroundWriter()  # checkpoints are written while the next epoch trains
    summary: dict[str, Any] = {"run_dir": str(run_dir)}
    try:
        for epoch in range(state["epoch"] + 1, tc.epochs):
            run.train_loader.set_epoch(epoch)
            t0 = time.perf_counter()
            stats = train_one_epoch(run, epoch, state, logger)
            state["train_time"] += time.perf_counter() - t0
            row = {"train_loss": stats["loss"], "lr": run.optimizer.param_groups[0]["lr"],
                   "images_per_s": stats["images_per_s"], "epoch_time_s": stats["time_s"]}
            if (epoch + 1) % tc.val_every == 0 or epoch + 1 == tc.epochs:
                row.update(evaluate(eval_model(model, run.ema), task, run.val_loader, run.device, run.precision,
                                    tc.channels_last))
                if target and target[0] not in row:  # checked at the first validation: metrics are task-defined
                    raise ConfigError(f"--target {target[0]}: not a metric of this run; valid: "
                                      f"{', '.join(k for k in row if k not in ('lr', 'epoch_time_s'))}")
            logger.epoch_end(epoch, row)
            state["epoch"], state["history"], state["wall_time"] = epoch, logger.history, wall()
            better = improved(task, row, state["best"])
            if better:
                state["best"] = row[task.primary_metric]
            if env.is_main:  # a CPU snapshot now; serialised, written and renamed in the background
                writer.write(checkpoint_state(run, state, resolved),
                             [run_dir / "checkpoints" / n for n in ("last.pt", "best.pt")[:1 + better]])
            if target and target[0] in row and reached(task, target[0], row[target[0]], target[1]):
                summary.update(target_reached=True, time_to_target_s=state["train_time"],
                               time_to_target_wall_s=state["wall_time"], target_epoch=epoch + 1)
                log.info("target %s=%g reached at epoch %d after %.1f s of training (%.1f s wall)", *target,
                         epoch + 1, state["train_time"], state["wall_time"])
                break
        else:
            if target:
                summary["target_reached"] = False
        writer.join()  # the last checkpoint is on disk before the run reports
        dist.barrier()
        last = logger.history[-1] if logger.history else {}
        summary.update({"epochs": state["epoch"] + 1, "train_time_s": state["train_time"],
                        f"best_{task.primary_metric}": state["best"],
                        **{k: v for k, v in last.items() if k != "epoch"}})
        if env.is_main:
            _finish(run, eval_model(model, run.ema), logger, summary, run_dir, wall)
    finally:
        writer.join(raise_errors=False)  # after an error: still wait for (and log) a write in flight
        logger.close()
        if hasattr(run.train_set, "shutdown"):  # smart cache: stop its replacement threads
            run.train_set.shutdown()
    return summary


def _finish(run: Run, model: nn.Module, logger: RunLogger, summary: dict, run_dir: Path,
            wall: Callable[[], float]) -> None:
    """Prediction overlays of a few validation images, curves.png, the summary event and table."""
    if run.cfg.examples and hasattr(run.task, "save_examples"):
        batch = run.task.to_device(next(iter(run.val_loader)), run.device, run.cfg.train.channels_last)
        model.eval()
        with torch.no_grad(), run.precision.autocast():
            out = run.task.eval_forward(model, batch)
        out = out.float() if torch.is_tensor(out) else out
        if run.task.save_examples(out, batch, run_dir / "examples", run.cfg.examples):
            summary["examples"] = str(run_dir / "examples")
    curves = logger.plot_curves(run.task.primary_metric)
    if curves:
        summary["curves"] = str(curves)
    summary["wall_time_s"] = wall()
    logger.summary(summary)


class _DataWait:
    """``train_step``'s clock in ``fit``: seconds spent waiting for the loader (the "data" phase)."""

    def __init__(self) -> None:
        self.seconds, self._t = 0.0, 0.0

    def __call__(self, phase: str) -> None:
        if phase == "data":
            self._t = time.perf_counter()
        elif phase == "h2d":
            self.seconds += time.perf_counter() - self._t


def train_one_epoch(run: Run, epoch: int, state: dict, logger: RunLogger) -> dict[str, float]:
    """``run.steps_per_epoch`` calls of :func:`train_step`, logging every ``train.log_every`` steps."""
    tc, device, steps = run.cfg.train, run.device, run.steps_per_epoch
    run.train_model.train()
    logger.start_epoch(epoch, tc.epochs, steps)
    # device counters, read at log intervals only: [loss sum, applied steps, skipped steps, bad streak]
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    applied = torch.zeros((), device=device, dtype=torch.float32)
    skipped = torch.zeros((), device=device, dtype=torch.float32)
    streak = torch.zeros((), device=device, dtype=torch.float32)
    images = 0
    wait = _DataWait()
    t_start = t_log = time.perf_counter()
    last_log, skipped_seen = 0, 0
    batches = iter(run.train_loader)
    for i in range(1, steps + 1):
        out = train_step(run, batches, wait)
        images += out.images
        state["step"] += 1
        bad = out.skipped.reshape(()).float()
        loss_sum += torch.where(bad > 0, 0.0, out.loss.float())  # a skipped step's loss may be NaN
        applied += 1 - bad
        skipped += bad
        streak.mul_(bad).add_(bad)  # +1 when skipped, back to 0 when applied
        logger.advance()
        if state["step"] % tc.log_every == 0 or i == steps:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # deliberate: honest images/s at log intervals only
            skipped_seen = _check_skipped(int(streak), int(skipped), skipped_seen, tc, state)
            now = time.perf_counter()
            micro = i * run.micro_steps
            logger.step(epoch, i, state["step"], {
                "loss": float(out.loss), "lr": run.optimizer.param_groups[0]["lr"],
                "images_per_s": images * dist.world_size() / max(now - t_start, 1e-9),
                "step_time_s": (now - t_log) / (i - last_log),
                "data_time_s": wait.seconds / micro, "compute_time_s": (now - t_start - wait.seconds) / micro})
            t_log, last_log = now, i
    elapsed = time.perf_counter() - t_start
    # one sync and one collective per epoch: the mean loss over every rank's applied steps
    totals = dist.all_reduce_sum(torch.stack([loss_sum, applied]).double())
    mean_loss = float(totals[0] / totals[1]) if float(totals[1]) else math.nan
    return {"loss": mean_loss, "images_per_s": images * dist.world_size() / max(elapsed, 1e-9), "time_s": elapsed}


def _check_skipped(streak: int, skipped: int, seen: int, tc, state: dict) -> int:
    """At a log interval: warn about steps skipped since the last one, stop on a long bad streak.

    The streak is checked here only, so a run stops up to ``train.log_every`` steps after it
    reaches ``train.max_nonfinite``. Returns the skipped count now reported.
    """
    if streak >= tc.max_nonfinite:
        raise NonFiniteLossError(f"stopping: {streak} consecutive steps skipped (non-finite gradients or fp16 "
                                 f"overflow) at step {state['step']}; lower optim.lr, set train.clip_grad, "
                                 "or use --amp bf16/off")
    if skipped > seen:
        log.warning("%d step(s) skipped (non-finite gradients or fp16 overflow) this epoch, up to step %d",
                    skipped, state["step"])
    return skipped


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
