"""The visible training loop: :func:`fit`, one epoch, validation, and when checkpoints are written."""
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
from fastvision.engine.policy import CheckpointPolicy
from fastvision.engine.state import (
    Position,
    checkpoint_state,
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
from fastvision.engine.step import StepResult, train_step
from fastvision.errors import ConfigError
from fastvision.tasks.base import Task

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
    ckpt = checkpoint.load(resume, "cpu") if resume is not None else None  # RNG states stay CPU tensors
    if ckpt is not None:  # the world this process joined decides (horovodrun sets no variable detect_env reads)
        joined, _ = distributed.init(tc.device, timeout_s=tc.dist_timeout_s, backend=tc.backend)
        cfg = keep_global_batch(cfg, ckpt, joined.world_size, joined.is_main)
    run = build(cfg, train=True)
    check_target_metric(run.task, tc.target)
    state = initial_state(run.info)
    if ckpt is not None:
        state = restore(ckpt, run)
        at = state["position"] or Position(state["epoch"] + 1, 0, 0)
        log.info("resumed from %s at epoch %d step %d", resume, at.epoch, at.step)  # 0-based, as logged
    distributed.broadcast_state(run.model, run.step.optimizer)  # horovod: rank 0's weights (+ resumed state); DDP: no-op
    wall_before = state["wall_time"]
    wall = lambda: wall_before + time.perf_counter() - started  # noqa: E731
    if run.env.is_main:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    logger = RunLogger(run_dir, enabled=run.env.is_main, tensorboard=cfg.tensorboard, progress=progress)
    if ckpt is not None:  # the steps after the checkpoint are trained again: one record per step
        at = state["position"]
        logger.rewind(state["epoch"], (at.epoch, at.step) if at else None)
    logger.history = list(state["history"])
    resolved = resolved_config(cfg)
    if run.env.is_main:  # the resolved config, every builder default filled in
        (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    logger.parameters(resolved, {**environment(run.env, run.device), "global_batch": run.global_batch,
                                 "base_lr": cfg.optim.lr, "effective_lr": run.lr, "data": run.info})
    guard = NonFiniteGuard(tc.max_nonfinite, tc.on_nonfinite, run.model)
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
        row = {"train_loss": stats["loss"], "lr": run.step.optimizer.param_groups[0]["lr"],
               "images_per_s": stats["images_per_s"], "epoch_time_s": stats["time_s"]}
        if (epoch + 1) % tc.val_every == 0 or epoch + 1 == tc.epochs:
            row.update(evaluate(eval_model(run.model, run.step.ema), task, run.val_loader, run.device,
                                run.precision, tc.channels_last, stop=validating))
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
            log.info("target %s=%g reached at epoch %d after %.1f s of training (%.1f s wall)", *target,
                     epoch + 1, state["train_time"], state["wall_time"])
            return None
    if target:
        summary["target_reached"] = False
    return None


def _summarise(run: Run, state: dict, logger: RunLogger, saver: Checkpoints, summary: dict, run_dir: Path,
               wall: Callable[[], float]) -> None:
    last = logger.history[-1] if logger.history else {}
    summary.update({"epochs": state["epoch"] + 1, "train_time_s": state["train_time"],
                    f"best_{run.task.primary_metric}": state["best"], **saver.report(),
                    **{k: v for k, v in last.items() if k != "epoch"}})
    if run.env.is_main:
        _finish(run, eval_model(run.model, run.step.ema), logger, summary, run_dir, wall)


class Checkpoints:
    """The checkpoints of a run as it trains.

    Which files and when: :class:`CheckpointPolicy`; this writes them, always in the background and
    atomically (rank 0). Every rank takes part in deciding (through ``preemption``, which owns the
    signals and the ranks' agreement) and sends its random-generator states, so all ranks act at the
    same step.
    """

    def __init__(self, run: Run, resolved: dict, wall: Callable[[], float], policy: CheckpointPolicy,
                 preemption: Preemption, guard: NonFiniteGuard):
        self.run, self.resolved, self.wall, self.policy = run, resolved, wall, policy
        self.folder, self.every, self.preemption, self.guard = policy.folder, policy.every, preemption, guard
        self.writer = checkpoint.BackgroundWriter()

    @property
    def good(self) -> tuple[Path, int] | None:
        """The newest healthy checkpoint of this run (``rollback.pt``, its step), or None."""
        return self.policy.good

    def wait_written(self) -> None:
        """Every rank: the checkpoints rank 0 queued are on disk (before a rank reads one)."""
        self.writer.join()
        distributed.barrier()

    def _timed(self) -> bool:
        """Rank 0's clock says a period's checkpoint is due (the ranks agree on it)."""
        return self.run.env.is_main and self.every.due_by_time()

    def after_step(self, state: dict, epoch: int, i: int, meter: EpochMeter) -> bool:
        """After step ``i`` of ``epoch``: write a step checkpoint when due; True when the run must stop
        (its checkpoint is then written)."""
        stop, timed = self.preemption.after_step(state["step"], self._timed())
        if stop or timed or self.every.due_by_steps(state["step"]):
            self._save_position(state, epoch, i, meter)
        return stop

    def agree_stop(self, state: dict, epoch: int, steps: int | None, meter: EpochMeter | None) -> bool:
        """At an epoch's end (``steps`` given: before validation, else after the epoch checkpoint):
        whether the ranks stop now. Before validation its checkpoint is of the last step, so a resume
        validates the epoch."""
        stop, _ = self.preemption.agree_now()
        if not stop:
            return False
        if steps is not None:
            self._save_position(state, epoch, steps, meter)
        return True

    def _save_position(self, state: dict, epoch: int, i: int, meter: EpochMeter) -> None:
        """A step checkpoint: the loop state at step ``i`` of ``epoch``, the epoch's counters with it."""
        state["position"] = Position(epoch, i, meter.samples, meter.state())
        self.save(state, step=True)
        state["position"] = None

    def save(self, state: dict, best: bool = False, step: bool = False) -> None:
        """Every rank calls this at the same step; rank 0 snapshots now and writes in the background."""
        rng_ranks = distributed.gather_objects(runtime.rng_state(self.run.step.generator))
        self.every.reset()
        state["wall_time"] = self.wall()
        paths = self.policy.files(state["step"], best=best, step=step, healthy=self.guard.healthy())
        if not self.run.env.is_main:
            return
        prune = []
        if step:
            self.writer.join()  # the previous step-N.pt is on disk (write() would wait for it anyway)
            prune = self.policy.prune(state["step"])
        self.writer.write(checkpoint_state(self.run, state, self.resolved, rng_ranks), paths, prune)

    def report(self) -> dict[str, float]:
        """Checkpoint latencies for the summary: seconds from a step's end to its file being durable."""
        lat = self.writer.latencies
        return {"checkpoints_written": len(lat), "checkpoint_durable_max_s": max(lat) if lat else None,
                "checkpoint_stall_mean_s": sum(self.writer.snapshot_s) / len(lat) if lat else None}

    def close(self) -> None:
        self.writer.join(raise_errors=False)  # after an error: still wait for (and log) a write in flight


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


class DataWait:
    """``train_step``'s clock in ``fit`` and tune's trials: seconds spent waiting for the loader (the "data" phase)."""

    def __init__(self) -> None:
        self.seconds, self._t = 0.0, 0.0

    def __call__(self, phase: str) -> None:
        if phase == "data":
            self._t = time.perf_counter()
        elif phase == "h2d":
            self.seconds += time.perf_counter() - self._t


class EpochMeter:
    """One epoch's running counters: on the device (read at log intervals and checkpoints only) the
    loss sum and applied / skipped / consecutive-skipped step counts; on the host this rank's items,
    the samples all ranks consumed (where a resume continues) and the seconds before a resume.
    :meth:`state` / :meth:`load` carry them through a mid-epoch checkpoint, so a resumed epoch
    reports what the uninterrupted one would."""

    def __init__(self, device: torch.device):
        self.counts = torch.zeros(4, device=device, dtype=torch.float32)  # loss sum, applied, skipped, streak
        self.images, self.samples, self.resumed_s = 0, 0, 0.0
        self.t_start = time.perf_counter()

    def add(self, loss: torch.Tensor, skipped: torch.Tensor, images: int) -> None:
        bad = skipped.reshape(()).float()
        loss_sum, applied, skipped_n, streak = self.counts.unbind()
        loss_sum += torch.where(bad > 0, 0.0, loss.float())  # a skipped step's loss may be NaN
        applied += 1 - bad
        skipped_n += bad
        streak.mul_(bad).add_(bad)  # +1 when skipped, back to 0 when applied
        self.images += images
        self.samples += images * distributed.world_size()  # every rank trains as many items per step

    def state(self) -> dict[str, Any]:
        """Plain values (a host read: checkpoints only)."""
        loss_sum, applied, skipped, streak = self.counts.tolist()
        return {"loss_sum": loss_sum, "applied": applied, "skipped": skipped, "streak": streak,
                "images": self.images, "time_s": self.elapsed()}

    def load(self, position: Position) -> None:
        saved = position.meter
        self.counts.copy_(torch.tensor([saved["loss_sum"], saved["applied"], saved["skipped"], saved["streak"]]))
        self.images, self.resumed_s, self.samples = saved["images"], saved["time_s"], position.samples

    def start(self) -> None:
        self.t_start = time.perf_counter()

    def elapsed(self, now: float | None = None) -> float:
        """Seconds of this epoch's training, the part before a resume included."""
        return self.resumed_s + (time.perf_counter() if now is None else now) - self.t_start


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
        raise ConfigError(f"the first training step failed: {_first_line(e)}. Check model {run.cfg.model.name!r} "
                          f"(model.args) against the data's batches (data.args, task.args); --debug for the "
                          f"traceback") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


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
                "loss": float(out.loss), "lr": step.optimizer.param_groups[0]["lr"],
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
    return {"loss": mean_loss, "images_per_s": meter.images * distributed.world_size() / max(elapsed, 1e-9), "time_s": elapsed}


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
