"""The training step: :func:`train_step` is the only step (train, profile, benchmark, plan, export)."""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn

from fastvision import dist, optim
from fastvision.engine.build import Run
from fastvision.errors import FastvisionError

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
