"""What an epoch measures as it trains: :class:`EpochMeter` (the running counters a mid-epoch
checkpoint carries) and :class:`DataWait` (the step clock that times waiting for the loader)."""
from __future__ import annotations

import time
from typing import Any

import torch

from fastvision import distributed
from fastvision.engine.state import Position


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
        """Plain values (a host read: checkpoints only). Every rank calls it at the same step: the loss sum
        and the applied count are the job's, summed over the ranks (one small all-reduce), because only rank
        0's checkpoint is written; :meth:`load` puts them on rank 0 alone, so the resumed epoch's mean loss
        counts every rank's steps before the checkpoint once, on any world size (before, every rank
        restored rank 0's own sum and the epoch's ``train_loss`` differed from the uninterrupted run's)."""
        loss_sum, applied = distributed.all_reduce_sum(self.counts[:2].double()).tolist()
        _, _, skipped, streak = self.counts.tolist()
        return {"loss_sum": loss_sum, "applied": applied, "skipped": skipped, "streak": streak,
                "images": self.images, "time_s": self.elapsed(), "summed": True}

    def load(self, position: Position) -> None:
        saved = position.meter
        loss_sum, applied = saved["loss_sum"], saved["applied"]
        if saved.get("summed") and distributed.rank() != 0:  # the job's sums: counted once, on rank 0
            loss_sum, applied = 0.0, 0.0
        self.counts.copy_(torch.tensor([loss_sum, applied, saved["skipped"], saved["streak"]]))
        self.images, self.resumed_s, self.samples = saved["images"], saved["time_s"], position.samples

    def start(self) -> None:
        self.t_start = time.perf_counter()

    def elapsed(self, now: float | None = None) -> float:
        """Seconds of this epoch's training, the part before a resume included."""
        return self.resumed_s + (time.perf_counter() if now is None else now) - self.t_start
