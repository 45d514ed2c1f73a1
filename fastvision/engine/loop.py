"""The visible training loop: :func:`fit`, one epoch, validation."""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from torch import nn

from fastvision import dist
from fastvision.config import RunConfig
from fastvision.engine import checkpoint, runtime
from fastvision.engine.build import Run, build
from fastvision.engine.log import RunLogger
from fastvision.engine.state import (
    checkpoint_state,
    environment,
    eval_model,
    improved,
    initial_state,
    parse_target,
    reached,
    resolved_config,
    restore,
)
from fastvision.engine.step import NonFiniteLossError, train_step
from fastvision.errors import ConfigError
from fastvision.tasks.base import Task

log = logging.getLogger(__name__)


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
