"""The non-finite guard beside the step it guards: what a skipped step's batch was, and the rollback.

The step skips a non-finite update on the device (``StepResult.skipped``) and leaves the whole
module state as it was; nothing here reads a value inside the step. :class:`NonFiniteGuard` keeps
each step's flags and item names (:meth:`record`, no read) and reads them at the loop's log
interval, where the loop reads its counters anyway: one warning names the items of the batches
whose loss was not finite. After ``train.max_nonfinite`` consecutive skipped steps, or a weight that
is not finite, the run applies ``train.on_nonfinite``:

* ``rollback``: model, EMA, optimizer and loss-scaler state come back from the newest checkpoint
  written while the run was healthy (``checkpoints/rollback.pt``), and training goes on with the
  *next* batches at the current step and schedule (the PaLM recipe: re-reading the batches that
  diverged would diverge again, since a run is deterministic);
* ``rollback_lower_lr`` (default): the same, and the learning rate x 0.5 from then on;
* ``stop``: :class:`NonFiniteLossError`, naming the checkpoint to resume from. So does a rollback
  with no healthy checkpoint yet, or a fourth within ``WINDOW`` x ``max_nonfinite`` steps.

A rollback is on disk, not in memory: every rank loads the file rank 0 wrote, as ``--resume``
does, so a healthy run pays nothing (an in-memory copy would cost host RAM of the checkpoint's
size on every rank, and a copy at every log interval). Every rank decides alike without a
collective: the skip flags come from all-reduced gradients and the weights are the same on every
rank.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastvision import distributed, optim
from fastvision.engine import checkpoint
from fastvision.engine.state import load_weights
from fastvision.engine.step import NonFiniteLossError, StepResult
from fastvision.errors import ConfigError
from fastvision.tasks.base import ids_text

log = logging.getLogger(__name__)

ACTIONS = ("stop", "rollback", "rollback_lower_lr")
LR_FACTOR = 0.5  # rollback_lower_lr: the learning rate after each rollback, as a factor
MAX_ROLLBACKS = 3  # rollbacks within WINDOW x max_nonfinite steps; one more stops the run instead
WINDOW = 10
_NAMED_STEPS, _NAMED_ITEMS = 5, 8  # what one warning lists at most


class NonFiniteGuard:
    """Watches skipped steps for :func:`fastvision.engine.loop.fit` (one per run).

    Args:
        max_nonfinite: consecutive skipped steps that trigger ``on_nonfinite``.
        on_nonfinite: ``stop`` | ``rollback`` | ``rollback_lower_lr``.
        module: the bare model (weights and buffers checked for finiteness).
        streak: consecutive skipped steps before this process (a resumed run's, from its checkpoint).
    """

    def __init__(self, max_nonfinite: int, on_nonfinite: str, module: nn.Module, streak: float = 0.0):
        self.validate(max_nonfinite, on_nonfinite)
        self.max_nonfinite, self.action, self.module = max_nonfinite, on_nonfinite, module
        self.pending: list[tuple[int, Any, torch.Tensor, torch.Tensor]] = []
        self.meter: Any = None  # the running epoch's counters (EpochMeter): its streak
        self.rollbacks: list[int] = []  # the steps of the recent rollbacks
        self.streak = float(streak)  # the streak as last read on the host (at a checkpoint): saved with it
        self._named_bad = False  # the warning on non-finite model values was given (until they are finite again)

    @staticmethod
    def validate(max_nonfinite: int, on_nonfinite: str) -> None:
        """``train.max_nonfinite`` / ``on_nonfinite``, checked (``fit`` asks before anything is built)."""
        if max_nonfinite < 1:
            raise ConfigError(f"train.max_nonfinite must be >= 1, got {max_nonfinite}")
        if on_nonfinite not in ACTIONS:
            raise ConfigError(f"train.on_nonfinite: {on_nonfinite!r}; valid: {', '.join(ACTIONS)}")

    def watch(self, meter: Any) -> None:
        """A new epoch's counters (their device streak is the one checked). A streak goes on across the
        epoch's end (it reset there, so a run of fewer than ``max_nonfinite`` steps an epoch, such as the
        microscopy demo's 10, never acted on one): the new counters start from the last ones' streak, or
        from the resumed checkpoint's (a mid-epoch one's counters then load their own)."""
        if meter is self.meter:
            return
        if self.meter is not None:
            meter.counts[3].copy_(self.meter.counts[3])  # on the device: no read
        elif self.streak:
            meter.counts[3].fill_(self.streak)
        self.meter = meter

    def record(self, global_step: int, out: StepResult) -> None:
        """After each step: keep its flags and item names for the next read (no host read now)."""
        self.pending.append((global_step, out.ids, out.loss, out.skipped))

    def healthy(self, step: int) -> bool:
        """At a checkpoint (a sync point anyway): no skipped-step streak and every weight and buffer finite.
        Non-finite values that no skipped step reports (BatchNorm's running variance overflowed by a
        finite but huge activation: training goes on, validation and every later checkpoint are garbage)
        get one warning naming them (rank 0; again only after the model was finite in between)."""
        found = optim.found_non_finite([*self.module.parameters(), *self.module.buffers()])
        streak = self.meter.counts[3] if self.meter is not None else torch.zeros((), device=found.device)
        bad, self.streak = torch.stack([found, streak.to(found.device)]).tolist()
        if bad and not self._named_bad and distributed.is_main():
            names = [n for n, t in (*self.module.named_parameters(), *self.module.named_buffers())
                     if t.is_floating_point() and not bool(torch.isfinite(t).all())]
            log.warning("step %d: %d tensor(s) of the model are not finite (%s): the run diverged; validation "
                        "and this checkpoint use them, and checkpoints/rollback.pt is not updated while they are: "
                        "lower optim.lr, set train.clip_grad, or use --amp bf16/off", step, len(names),
                        ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))
        self._named_bad = bool(bad)
        return not bad and self.streak == 0

    def check(self, step: int, rollback: Any) -> None:
        """At a log interval: name the skipped batches' items, then act on a long streak or a
        non-finite weight. ``rollback`` is the loop's checkpoint saver (None: nothing to load)."""
        skipped = self._report(step)
        if not skipped:
            return
        streak = int(self.meter.counts[3])
        weights_bad = bool(optim.found_non_finite(list(self.module.parameters())))
        if streak < self.max_nonfinite and not weights_bad:
            return
        why = "a weight is not finite" if weights_bad else \
            f"{streak} consecutive steps skipped (non-finite loss or gradient, or fp16 overflow)"
        good = getattr(rollback, "good", None)
        # a run that keeps diverging soon after each rollback needs a person, not another rollback
        self.rollbacks = [n for n in self.rollbacks if n > step - WINDOW * self.max_nonfinite]
        if self.action == "stop" or good is None or len(self.rollbacks) >= MAX_ROLLBACKS:
            raise NonFiniteLossError(self._stop_message(why, step, good))
        self.rollbacks.append(step)
        rollback.wait_written()
        factor = LR_FACTOR if self.action == "rollback_lower_lr" else 1.0
        load_weights(checkpoint.load(good[0], "cpu"), rollback.run, lr_factor=factor)
        self.meter.counts[3].zero_()
        lr = f", learning rate x{factor:g}" if factor != 1 else ""
        (log.warning if distributed.is_main() else log.debug)(
            "step %d: %s; rolled back to %s (step %d)%s; continuing with the "
            "next batches (train.on_nonfinite: %s)", step, why, good[0], good[1], lr, self.action)

    def _report(self, step: int) -> int:
        """One warning naming the skipped batches since the last read; returns how many (one host read)."""
        if not self.pending:
            return 0
        pending, self.pending = self.pending, []
        skips, losses = torch.stack([torch.stack([s.reshape(()).float() for *_, s in pending]),
                                     torch.stack([x.reshape(()).float() for _, _, x, _ in pending])]).tolist()
        bad = [(n, ids, loss) for (n, ids, _, _), s, loss in zip(pending, skips, losses, strict=True) if s > 0]
        if not bad:
            return 0
        # every rank skipped the same steps (all-reduced gradients): gather their items, a collective
        # at a log interval that had skipped steps only
        mine = [([i for part in ids for i in ids_text(part)], not math.isfinite(loss))
                for _, ids, loss in bad[:_NAMED_STEPS]]
        ranks = distributed.gather_objects(mine)
        named = []
        for k, (n, _, _) in enumerate(bad[:_NAMED_STEPS]):
            items = [i for rank in ranks for i in rank[k][0]]
            more = f" +{len(items) - _NAMED_ITEMS}" if len(items) > _NAMED_ITEMS else ""
            why = "non-finite loss" if any(rank[k][1] for rank in ranks) else "non-finite gradient"
            named.append(f"{n} ({why}; items {', '.join(items[:_NAMED_ITEMS]) or '?'}{more})")
        rest = f", and {len(bad) - _NAMED_STEPS} more" if len(bad) > _NAMED_STEPS else ""
        (log.warning if distributed.is_main() else log.debug)(
            "%d step(s) skipped up to step %d, their updates not applied: step %s%s", len(bad), step,
            "; step ".join(named), rest)
        return len(bad)

    def _stop_message(self, why: str, step: int, good: tuple[Path, int] | None) -> str:
        if good is None:
            where = "no healthy checkpoint of this run to roll back to"
        elif self.action == "stop":
            where = f"the last healthy checkpoint is {good[0]} (step {good[1]}): resume with --resume {good[0]}"
        else:
            where = (f"rolled back {MAX_ROLLBACKS} times in the last {WINDOW * self.max_nonfinite} steps "
                     f"already (last healthy checkpoint: {good[0]}, step {good[1]})")
        return f"stopping at step {step}: {why}; {where}; lower optim.lr, set train.clip_grad, or use --amp bf16/off"
