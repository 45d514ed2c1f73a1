"""The visible training loop: :func:`fit` (and the steps it takes, one function each), one epoch,
and validation. An epoch's counters: :mod:`fastvision.engine.meter`; the checkpoints written as it
trains: :mod:`fastvision.engine.saver`."""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from fastvision import distributed
from fastvision.config import RunConfig
from fastvision.distributed.preempt import Preemption
from fastvision.distributed.watchdog import Watchdog, check_timeouts, point_dumps_at
from fastvision.engine import checkpoint, runtime
from fastvision.engine.build import Run, build
from fastvision.engine.guard import NonFiniteGuard
from fastvision.engine.log import RunLogger
from fastvision.engine.meter import DataWait, EpochMeter
from fastvision.engine.policy import CheckpointPolicy
from fastvision.engine.saver import Checkpoints
from fastvision.engine.state import (
    Position,
    check_resumable,
    classes_differ,
    environment,
    eval_model,
    improved,
    initial_state,
    keep_global_batch,
    parse_target,
    reached,
    resolved_config,
    restore,
)
from fastvision.engine.step import StepResult, _first_line, step_failure, train_step
from fastvision.errors import ConfigError, DataError, peer_lost
from fastvision.tasks.base import Task
from fastvision.utils.files import atomic_write

log = logging.getLogger(__name__)


def fit(cfg: RunConfig, run_dir: Path, resume: Path | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Train ``cfg`` into ``run_dir`` (created by the caller); returns the run summary.

    Two clocks: ``train_time_s`` / ``time_to_target_s`` count the training epochs only (the
    seeds' time-to-target); ``wall_time_s`` / ``time_to_target_wall_s`` count everything since
    ``fit`` was called (build, data, validation, checkpoints), what a user waits. Both add up
    over resumed runs. A stop signal (``train.stop_signals``) ends the run after a checkpoint with
    :class:`fastvision.errors.Preempted`.
    """
    started = time.perf_counter()
    tc = cfg.train
    # bad values fail here, before anything is built or written
    policy = CheckpointPolicy.from_config(tc, run_dir / "checkpoints")
    preemption = Preemption(tc.stop_signals, tc.requeue, every=tc.log_every)
    check_timeouts(tc.hang_timeout_s, tc.dist_timeout_s)
    NonFiniteGuard.validate(tc.max_nonfinite, tc.on_nonfinite)
    ckpt = _load_resume(resume) if resume is not None else None
    if ckpt is not None:
        check_resumable(ckpt, cfg, resume)  # another recipe's run, or weights alone: one line, before any build
    run = build(_joined_config(cfg, ckpt), train=True)
    check_target_metric(run.task, tc.target)
    state = _start_state(run, ckpt, resume)
    if ckpt is not None:
        policy.resumed(state["step"], checkpoint.saved_step)
    wall_before = state["wall_time"]
    wall = lambda: wall_before + time.perf_counter() - started  # noqa: E731
    logger, resolved = _open_logs(run, state, run_dir, progress, resumed=ckpt is not None)
    guard = NonFiniteGuard(tc.max_nonfinite, tc.on_nonfinite, run.model, streak=state["nonfinite_streak"])
    saver = Checkpoints(run, resolved, wall, policy, preemption, guard)
    preemption.start(run.device, timed_checkpoints=saver.every.seconds is not None)
    point_dumps_at(run_dir / "hang")
    doctor = Watchdog.for_run(tc.hang_timeout_s, run_dir / "hang", run.env.rank, distributed.world_size())
    summary: dict[str, Any] = {"run_dir": str(run_dir)}
    try:
        with preemption:
            _epochs(run, state, logger, saver, summary, doctor)
        doctor.close()  # a long last write is no hang; what follows is rank 0's alone
        saver.writer.join()  # the last checkpoint is on disk before the run reports
        distributed.barrier()
        _summarise(run, state, logger, saver, summary, run_dir, wall)
    finally:
        doctor.close()
        saver.close()
        logger.close()
        if hasattr(run.train_set, "shutdown"):  # smart cache: stop its replacement threads
            run.train_set.shutdown()
    return summary


def _load_resume(resume: Path) -> dict:
    """The checkpoint to resume (RNG states stay CPU tensors); where it does not load (truncated, damaged),
    the one line names the run's other checkpoints to continue from instead."""
    try:
        return checkpoint.load(resume, "cpu")
    except DataError as e:
        raise DataError(f"{e}{checkpoint.others_to_resume(resume)}") from e


def _joined_config(cfg: RunConfig, ckpt: dict | None) -> RunConfig:
    """The config to build: ``cfg``, or for a resume the one that keeps the checkpoint's global
    batch in the world this process joined (horovodrun sets no variable ``detect_env`` reads)."""
    if ckpt is None:
        return cfg
    joined, _ = distributed.init(cfg.train.device, timeout_s=cfg.train.dist_timeout_s, backend=cfg.train.backend)
    return keep_global_batch(cfg, ckpt, joined.world_size, joined.is_main)


def _start_state(run: Run, ckpt: dict | None, resume: Path | None) -> dict:
    """The loop state to start from: a fresh one, or the checkpoint's restored into ``run``; then
    every rank holds rank 0's weights (horovod: broadcast, resumed state included; DDP: no-op)."""
    state = initial_state(run.info)
    if ckpt is not None:
        state = restore(ckpt, run, resume)
        where = classes_differ(state.get("data_info"), run.info)
        if where:  # a class folder added, renamed or gone: every later label an index into another list
            raise DataError(f"{run.cfg.data.args.get('path')}: its classes are not those {resume} was trained on "
                            f"{where}: resume with the run's data, or train these classes in a new run (another --out)")
        at = state["position"] or Position(state["epoch"] + 1, 0, 0)
        (log.info if run.env.is_main else log.debug)(  # once per job, not once per rank
            "resumed from %s at epoch %d step %d", resume, at.epoch, at.step)  # 0-based, as logged
    distributed.broadcast_state(run.model, run.step.optimizer)
    return state


def _open_logs(run: Run, state: dict, run_dir: Path, progress: bool | None,
               resumed: bool) -> tuple[RunLogger, dict]:
    """The run's logger, carrying on the history in ``state``, and its resolved config (every builder
    default filled in), written to ``config.yaml`` and logged with the environment (rank 0)."""
    cfg = run.cfg
    if run.env.is_main:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    logger = RunLogger(run_dir, enabled=run.env.is_main, tensorboard=cfg.tensorboard, progress=progress)
    if resumed:  # the steps after the checkpoint are trained again: one record per step
        at = state["position"]
        logger.rewind(state["epoch"], (at.epoch, at.step) if at else None)
    logger.history = list(state["history"])
    resolved = resolved_config(cfg)
    if run.env.is_main:
        path = run_dir / "config.yaml"
        if resumed and path.is_file():
            _note_changes(path, resolved)
        text = yaml.safe_dump(resolved, sort_keys=False).encode()
        atomic_write(path, lambda f: f.write(text))
    logger.parameters(resolved, {**environment(run.env, run.device), "global_batch": run.global_batch,
                                 "base_lr": cfg.optim.lr, "effective_lr": run.lr, "data": run.info})
    return logger, resolved


def _note_changes(path: Path, resolved: dict, shown: int = 8) -> None:
    """Log the settings of a resumed run that differ from the ``config.yaml`` it was written with (a resume
    continues with what it is given now: a changed size or epoch count is the user's to know of)."""
    try:
        before = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return
    if not isinstance(before, dict):  # a hand-edited file (a list, a number): nothing to compare, rewritten below
        return

    def flat(d: dict, prefix: str = "") -> dict[str, Any]:
        out = {}
        for key, val in d.items():
            if isinstance(val, dict) and val:
                out.update(flat(val, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = val
        return out

    old, new = flat(before), flat(resolved)
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if changed:
        text = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:shown])
        log.info("resumed with %d setting(s) changed from %s: %s%s", len(changed), path, text,
                 f" and {len(changed) - shown} more" if len(changed) > shown else "")


def _epochs(run: Run, state: dict, logger: RunLogger, saver: Checkpoints, summary: dict, doctor: Watchdog) -> None:
    """The epochs from where ``state`` stands: train, validate, checkpoint, check the target. A stop
    signal raises :class:`fastvision.errors.Preempted` once its checkpoint is durable."""
    tc, task, stop = run.cfg.train, run.task, saver.preemption

    def validating() -> bool:  # between validation batches: progress, and whether to stop now
        doctor.beat(state["step"], "validation")
        return stop.requested

    def preempted() -> Exception:  # the stop's checkpoint is written: wait until durable, requeue
        doctor.close()  # however long the write takes
        return stop.preempted(saver.writer.join, saver.folder / "last.pt")

    target = parse_target(tc.target)
    position: Position | None = state["position"]
    first = position.epoch if position else state["epoch"] + 1
    for epoch in range(first, tc.epochs):
        meter = EpochMeter(run.device)
        saver.guard.watch(meter)
        start = 0
        if position and position.epoch == epoch:  # a mid-epoch checkpoint: continue at its sample
            meter.load(position)
            start = position.first_step(run.global_batch)
        run.train_loader.set_epoch(epoch, start_sample=meter.samples)
        stats = train_one_epoch(run, epoch, state, logger, meter, start, saver, doctor)
        if stats is None or saver.agree_stop(state, epoch, run.steps_per_epoch, meter):
            raise preempted()  # resume continues at this step
        row = {"train_loss": stats["loss"], "lr": stats["lr"],
               "images_per_s": stats["images_per_s"], "epoch_time_s": stats["time_s"]}
        if (epoch + 1) % tc.val_every == 0 or epoch + 1 == tc.epochs:
            model = eval_model(run.model, run.step.ema)
            distributed.broadcast_buffers(model)  # every rank validates the model the checkpoint holds
            row.update(evaluate(model, task, run.val_loader, run.device, run.precision, tc.channels_last,
                                stop=validating))
            if saver.agree_stop(state, epoch, run.steps_per_epoch, meter):  # a signal during validation
                raise preempted()  # resume validates this epoch again
            if target and target[0] not in row:  # checked at the first validation: metrics are task-defined
                raise ConfigError(f"--target {target[0]}: not a metric of this run; valid: "
                                  f"{', '.join(k for k in row if k not in ('lr', 'epoch_time_s'))}")
        state["train_time"] += stats["time_s"]  # the whole epoch, the part before a resume included
        logger.epoch_end(epoch, row)
        better = improved(task, row, state["best"])
        if better:
            state["best"] = row[task.primary_metric]
        state.update(epoch=epoch, history=logger.history, position=None)
        saver.save(state, best=better)
        if saver.agree_stop(state, epoch, None, None):
            raise preempted()
        if target and target[0] in row and reached(task, target[0], row[target[0]], target[1]):
            summary.update(target_reached=True, time_to_target_s=state["train_time"],
                           time_to_target_wall_s=state["wall_time"], target_epoch=epoch + 1)
            # the epoch as its log line numbers it (from 0), and how many epochs that is
            log.info("target %s=%g reached at epoch %d (%d epochs) after %.1f s of training (%.1f s wall)",
                     *target, epoch, epoch + 1, state["train_time"], state["wall_time"])
            return None
    if target:
        summary["target_reached"] = False
    return None


def _summarise(run: Run, state: dict, logger: RunLogger, saver: Checkpoints, summary: dict, run_dir: Path,
               wall: Callable[[], float]) -> None:
    last = logger.history[-1] if logger.history else {}
    # global_batch and steps_per_epoch: what an epoch is, for `plan --epochs-from` (a forecast in epochs)
    summary.update({"epochs": state["epoch"] + 1, "train_time_s": state["train_time"],
                    "global_batch": run.global_batch, "steps_per_epoch": run.steps_per_epoch,
                    f"best_{run.task.primary_metric}": state["best"], **saver.report(),
                    **{k: v for k, v in last.items() if k != "epoch"}})
    if run.env.is_main:
        _finish(run, eval_model(run.model, run.step.ema), logger, summary, run_dir, wall)


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


def check_target_metric(task: Task, target: str | None) -> None:
    """``--target NAME=VALUE`` names a metric the task reports, before any training: the metric names
    an empty evaluator computes. An evaluator that cannot compute before it has seen data (COCO's
    reads the annotations it was given) leaves the check to the first validation."""
    parsed = parse_target(target)
    if not parsed:
        return
    try:
        known = set(task.evaluator().compute()) | {"train_loss", "images_per_s"}
    except Exception:  # noqa: BLE001 (a best-effort early check: the first validation checks again)
        return
    if parsed[0] not in known:
        raise ConfigError(f"--target {parsed[0]}: not a metric of this run; valid: {', '.join(sorted(known))}")
    name, value = parsed
    if name.split("/")[0] in task.unit_metrics and not 0 <= value <= 1:  # dice/WT: a class of dice
        hint = f"; for {value:g} % give {name}={value / 100:g}" if 1 < value <= 100 else ""
        raise ConfigError(f"--target {name}={value:g}: {name} is a fraction from 0 to 1, so the run would never "
                          f"reach it{hint}")


def first_step(run: Run, batches: Iterator[Any], wait: DataWait) -> StepResult:
    """The run's first :func:`train_step`, where a model that cannot take the data's batches fails
    (channels, a size the network's strides do not divide, a patch too small for its depth): a
    one-line :class:`ConfigError` naming what to check, not a traceback (``--debug`` shows it).
    Running out of device memory says which batch size did."""
    try:
        return train_step(run.step, batches, wait)
    except torch.cuda.OutOfMemoryError as e:
        raise ConfigError(f"out of memory in the first training step at train.batch_size "
                          f"{run.cfg.train.batch_size}: lower it, set train.batch_size: auto, or turn on "
                          f"train.activation_checkpointing ({_first_line(e)})") from e
    except (RuntimeError, ValueError, IndexError) as e:
        if peer_lost(e):  # another rank stopped (a file it read): its line says why
            raise
        raise step_failure(e, run.cfg, "the first training step") from e


def train_one_epoch(run: Run, epoch: int, state: dict, logger: RunLogger, meter: EpochMeter | None = None,
                    start: int = 0, saver: Checkpoints | None = None,
                    doctor: Watchdog | None = None) -> dict[str, float] | None:
    """Steps ``start + 1 .. run.steps_per_epoch`` of ``epoch``, each one :func:`train_step`, logging every
    ``train.log_every`` steps; returns the epoch's loss and speed, or None when ``saver`` stopped the
    run after a step (its checkpoint written). ``doctor`` hears of every step (the hang watchdog)."""
    tc, device, steps, step = run.cfg.train, run.device, run.steps_per_epoch, run.step
    meter = meter or EpochMeter(device)
    guard = saver.guard if saver is not None else NonFiniteGuard(tc.max_nonfinite, "stop", run.model)
    guard.watch(meter)
    step.model.train()
    logger.start_epoch(epoch, tc.epochs, steps)
    wait = DataWait()
    meter.start()
    t_log, last_log = meter.t_start, start
    batches = iter(run.train_loader)
    out = None
    for i in range(start + 1, steps + 1):
        out = first_step(run, batches, wait) if state["step"] == 0 else train_step(step, batches, wait)
        meter.add(out.loss, out.skipped, out.images)
        state["step"] += 1
        guard.record(state["step"], out)
        if doctor is not None:
            doctor.beat(state["step"])
        logger.advance()
        if state["step"] % tc.log_every == 0 or i == steps:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # deliberate: honest images/s at log intervals only
            guard.check(state["step"], saver)  # names skipped batches' items; rolls back on a long streak
            now = time.perf_counter()
            micro = (i - start) * step.micro_steps
            logger.step(epoch, i, state["step"], {
                "loss": float(out.loss), "lr": out.lr,
                "images_per_s": meter.images * distributed.world_size() / max(meter.elapsed(now), 1e-9),
                "step_time_s": (now - t_log) / (i - last_log),
                "data_time_s": wait.seconds / micro, "compute_time_s": (now - meter.t_start - wait.seconds) / micro})
            t_log, last_log = now, i
        if saver is not None and saver.after_step(state, epoch, i, meter):
            return None
    elapsed = meter.elapsed()
    # one sync and one collective per epoch: the mean loss over every rank's applied steps
    totals = distributed.all_reduce_sum(meter.counts[:2].double())
    mean_loss = float(totals[0] / totals[1]) if float(totals[1]) else math.nan
    return {"loss": mean_loss, "images_per_s": meter.images * distributed.world_size() / max(elapsed, 1e-9),
            "time_s": elapsed,  # and the rate the epoch's last step applied
            "lr": out.lr if out is not None else step.optimizer.param_groups[0]["lr"]}


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, loader, device: torch.device, precision: runtime.Precision,
             channels_last: bool = False, stop: Callable[[], bool] | None = None) -> dict[str, float]:
    """Metrics over the whole validation set: per-rank sums, one all-reduce, then compute.

    ``stop`` is asked before every batch; when it says True the rest of this rank's batches are
    skipped (the all-reduce still happens, so ranks stay in step) and the caller discards the metrics.
    """
    was_training = model.training
    model.eval()
    ev = task.evaluator()
    stopped = False
    for batch in loader:
        if stop is not None and stop():
            stopped = True
            break
        batch = task.to_device(batch, device, channels_last)
        with precision.autocast():
            out = task.eval_forward(model, batch)
        ev.update(out.float() if torch.is_tensor(out) else out, batch)
    state = ev.state().to(device)
    ev.load_state(distributed.all_reduce_sum(state).cpu())
    model.train(was_training)
    return {} if stopped else ev.compute()
