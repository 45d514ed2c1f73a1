"""The training step: :func:`train_step` is the only step (train, profile, benchmark, plan, export).

It reads a :class:`StepState`, the few things one optimizer step touches, not the whole run: the
training build makes one (``Run.step``), and ``plan``'s fake-tensor trace and ``--batch-size auto``
make their own.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from fastvision import distributed, optim
from fastvision.errors import ConfigError, FastvisionError
from fastvision.optim import torch_private

log = logging.getLogger(__name__)


class NonFiniteLossError(FastvisionError):
    """Too many consecutive steps had a non-finite loss or gradient."""

class StepResult(NamedTuple):
    """What one optimizer step reports back.

    Attributes:
        loss: mean loss of the micro-batches, detached, on the device (no host sync to get it).
        images: items trained on (this rank).
        skipped: 0-d float32 on the device: 1.0 when the update was skipped (non-finite
            gradients, fp16 overflow; the same on every rank), 0.0 when applied. Read it only at
            log intervals: reading it is a host sync.
        ids: each micro-batch's item names as the task gives them (``Task.item_ids``), unread (a
            device tensor is read only when a message names a skipped batch's items).
        lr: the first parameter group's learning rate this step applied (read before the schedule
            advances: the optimizer's own value afterwards is the next step's).
    """

    loss: torch.Tensor
    images: int
    skipped: torch.Tensor
    ids: tuple = ()
    lr: float = math.nan


@dataclass
class StepState:
    """What one optimizer step reads and updates.

    Attributes:
        task: turns batches into a loss (``to_device``, ``augment``, ``forward``, ``loss``).
        model: what the step calls (under DDP / torch.compile when the build wrapped it).
        optimizer, scheduler: stepped once per call; the scheduler also on skipped steps.
        precision: ``mode`` ("off" / "fp16" / "bf16"), ``autocast()`` and ``scaler``
            (:class:`fastvision.engine.runtime.Precision`).
        device: where batches go.
        generator: batched augmentation draws from it (seeded per rank by the build).
        ema: averaged weights (:class:`fastvision.engine.state.Ema`) or None.
        bare: the model the EMA averages (the unwrapped ``model``; default ``model``).
        micro_steps: micro-batches per optimizer step (accumulation x emulated workers).
        channels_last: NHWC / NDHWC batches.
        clip_grad: max global gradient norm, or None.
        check_finite: skip steps with non-finite gradients (fp16 always checks).
    """

    task: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    precision: Any
    device: torch.device
    generator: torch.Generator | None = None
    ema: Any = None
    bare: nn.Module | None = None
    micro_steps: int = 1
    channels_last: bool = False
    clip_grad: float | None = None
    check_finite: bool = True


def _no_clock(phase: str) -> None:
    return None


def train_step(state: StepState, batches: Iterator[Any], clock: Callable[[str], None] | None = None) -> StepResult:
    """One optimizer step over ``state.micro_steps`` micro-batches from ``batches``: the only training step.

    Args:
        state: the model, optimizer, schedule, precision ... this step updates.
        batches: iterator of collated batches (host or device).
        clock: told each phase's name as it starts: per micro-batch "data", "h2d", "augment",
            "forward", "backward"; then "optimizer" and "end". The profiler's timer and fit's
            data-wait meter; None calls a no-op (no sync, no allocation).
    """
    mark = clock or _no_clock
    task, model, optimizer, scaler = state.task, state.model, state.optimizer, state.precision.scaler
    micro_losses, images, ids = [], 0, []
    # a skipped step must leave the whole module state as it was, and the forward already updates
    # buffers (BatchNorm's running statistics, num_batches_tracked): keep them to put back
    kept = _keep_buffers(state.bare if state.bare is not None else model) if _checks(state) else None
    for micro in range(state.micro_steps):
        mark("data")
        batch = next(batches)
        ids.append(task.item_ids(batch))
        mark("h2d")
        batch = task.to_device(batch, state.device, state.channels_last)
        mark("augment")
        batch = task.augment(batch, state.generator)
        mark("forward")
        with distributed.no_sync(model, micro + 1 < state.micro_steps):  # all-reduce on the last micro-batch only
            with state.precision.autocast():
                loss = task.loss(task.forward(model, batch), batch)
            mark("backward")
            scaler.scale(loss / state.micro_steps).backward()
        micro_losses.append(loss.detach())
        images += task.batch_size(batch)
    mark("optimizer")
    loss = torch.stack(micro_losses).mean()
    lr = optimizer.param_groups[0]["lr"]
    with distributed.synchronized(optimizer):  # horovod: all-reduce done before the checks, clip and step
        found_inf = _found_inf(state)
        if state.clip_grad:
            nn.utils.clip_grad_norm_(model.parameters(), state.clip_grad)  # foreach, no host read
        optim.step_unless(optimizer, found_inf)
        if found_inf is None:  # nothing checked (train.check_finite off): nothing skipped
            found_inf = torch.zeros((), device=state.device)
        else:
            _restore_buffers(kept, found_inf)
        if state.precision.mode == "fp16":
            scaler.update()  # backs the scale off on found_inf, on the device
        optimizer.zero_grad()  # set_to_none by default (torch >= 2); horovod takes no argument
    # the schedule advances on skipped steps too: deciding otherwise would need a host read
    state.scheduler.step()
    if state.ema is not None:
        state.ema.update_parameters(state.bare if state.bare is not None else model, found_inf)
    mark("end")
    return StepResult(loss, images, found_inf, tuple(ids), float(lr))


def _checks(state: StepState) -> bool:
    """Whether this step can be skipped (a found-inf flag is computed): fp16 always, else ``check_finite``."""
    return state.precision.mode == "fp16" or state.check_finite


def _keep_buffers(module: nn.Module) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """Every buffer, grouped by dtype and device, with one flat copy of each group's values before the
    forward (transient memory of the buffers: BatchNorm's statistics, a few KB to MB). One flat copy
    per group, not one per buffer: a few kernels instead of two per buffer (launches dominate, the
    bytes are few)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for b in module.buffers():
        groups.setdefault((b.dtype, b.device), []).append(b)
    return [(bufs, _flat(bufs)) for bufs in groups.values()]


def _flat(bufs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([b.detach().reshape(-1) for b in bufs])


def _restore_buffers(kept: list[tuple[list[torch.Tensor], torch.Tensor]], found_inf: torch.Tensor) -> None:
    """Put the buffers back where ``found_inf`` is set: ``torch.where`` on the device, no host read
    (a skipped step's NaN must not stay in the running statistics: NaN * 0 is NaN, so select)."""
    skip = found_inf.reshape(()) > 0
    with torch.no_grad():
        for bufs, old in kept:
            chosen = torch.where(skip.to(old.device), old, _flat(bufs))
            parts = chosen.split([b.numel() for b in bufs])
            torch._foreach_copy_(bufs, [p.view_as(b) for p, b in zip(parts, bufs, strict=True)])


def _found_inf(state: StepState) -> torch.Tensor | None:
    """0-d float32 on the device, non-zero when this update must be skipped; no host read.

    fp16: the GradScaler's unscale checks the gradients (always run: the skip decision needs it).
    bf16 / fp32: the same check of the all-reduced gradients when ``check_finite``, else None
    (no check: a plain step).
    """
    if state.precision.mode == "fp16":
        state.precision.scaler.unscale_(state.optimizer)
        return torch_private.scaler_found_inf(state.precision.scaler, state.optimizer)
    if state.check_finite:
        return optim.grads_found_inf(state.optimizer)
    return None


# ------------------------------------------------------------------------------ a step that failed
# where in the package a first step's error was raised, when it was not the model: the config key to check
_BLAME = (("data/augment/", "data.augment"), ("losses/", "loss (loss.name, loss.args)"))


def step_failure(e: BaseException, cfg, step: str, fed: str | None = None) -> ConfigError:
    """The one line for ``step`` (e.g. "the first training step") that raised ``e`` because the model, the
    batched augmentation or the loss could not take its batch (channels, a size the network's strides do
    not divide, a patch too small for its depth): what failed and the keys to check. ``fed`` names what
    fed the step; default the data's batches. ``fastvision benchmark`` and ``plan`` step on the task's
    synthetic batch: :func:`synthetic_source`."""
    fed = fed or "the data's batches (data.args, task.args)"
    where = _failed_in(e)
    if where is not None:  # not the model: the batched augmentation or the loss (their keys)
        return ConfigError(f"{step} failed in {where[0]}: {_first_line(e)}. Check {where[1]} against {fed}; "
                           f"--debug for the traceback")
    return ConfigError(f"{step} failed: {_first_line(e)}. Check model {cfg.model.name!r} (model.args) against "
                       f"{fed}; --debug for the traceback")


def synthetic_source(cfg, batch_size: int | None = None) -> str:
    """What shapes a task's synthetic batch, for :func:`step_failure`: ``task.args.sample_shape [1, 8]``
    (segmentation) or ``task.args.image_size 0`` (classification, detection), and its batch size."""
    key = next((k for k in ("sample_shape", "image_size") if k in (cfg.task.args or {})), None)
    value = f"task.args.{key} {cfg.task.args[key]}" if key else "task.args"
    return f"the task's synthetic batch ({value}, batch {batch_size or cfg.train.batch_size})"


def _failed_in(e: BaseException) -> tuple[str, str] | None:
    """(``module.function``, the config key to check) of the innermost frame of ``e``'s traceback in the
    augmentation or the losses (each runs beside the model in the step, never inside it); None when no
    frame is (the model's, or the step's own)."""
    import traceback
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = None
    for frame in traceback.extract_tb(e.__traceback__):
        path = Path(frame.filename).resolve()
        if not path.is_relative_to(root):
            continue
        rel = path.relative_to(root).as_posix()
        key = next((k for prefix, k in _BLAME if rel.startswith(prefix)), None)
        if key is not None:
            found = (f"fastvision.{rel[:-3].replace('/', '.')}.{frame.name}", key)
    return found


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
