"""Learning-rate schedules: warm-up, then step / cosine / poly / linear / constant."""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch.optim import Optimizer

from fastvision.config import SchedConfig
from fastvision.errors import ConfigError

log = logging.getLogger(__name__)


def lr_lambda(cfg: SchedConfig, steps_per_epoch: int, epochs: int) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step ``s`` (0-based)."""
    total = max(1, steps_per_epoch * epochs)
    warm = int(round(cfg.warmup_epochs * steps_per_epoch))
    milestones = [int(round(m * steps_per_epoch)) for m in cfg.milestones]
    if cfg.name == "piecewise" and len(cfg.factors) != len(milestones) + 1:
        raise ConfigError("sched.factors: piecewise needs len(milestones) + 1 factors")

    def after_warmup(s: int) -> float:
        t = min(1.0, (s - warm) / max(1, total - warm))
        if cfg.name == "constant":
            return 1.0
        if cfg.name == "cosine":
            return cfg.min_lr_factor + (1 - cfg.min_lr_factor) * 0.5 * (1 + math.cos(math.pi * t))
        if cfg.name == "poly":
            return cfg.min_lr_factor + (1 - cfg.min_lr_factor) * (1 - t) ** cfg.power
        passed = sum(s >= m for m in milestones)
        if cfg.name == "step":
            return cfg.gamma**passed
        if cfg.name == "piecewise":
            return cfg.factors[passed]
        raise ConfigError(f"sched.name: unknown schedule {cfg.name!r}")

    def fn(s: int) -> float:
        if s < warm:
            return cfg.warmup_start_factor + (1 - cfg.warmup_start_factor) * s / warm
        return after_warmup(s)

    return fn


def build_scheduler(opt: Optimizer, cfg: SchedConfig, steps_per_epoch: int, epochs: int):
    fn = lr_lambda(cfg, steps_per_epoch, epochs)
    if cfg.warmup_epochs < epochs or cfg.name == "constant":
        return torch.optim.lr_scheduler.LambdaLR(opt, fn)
    # resnet50-imagenet's 8 warm-up epochs under --epochs 5: said when step 1's rate is asked for, i.e.
    # once the run's first step went through (a run refused before it prints its one line alone; a resume
    # past step 1 does not say it again)
    note = (f"sched.warmup_epochs={cfg.warmup_epochs:g} is not below train.epochs={epochs}: the learning rate "
            f"rises for the whole run, to {fn(max(1, steps_per_epoch * epochs) - 1):.3g} of its peak at the last "
            f"step, and the {cfg.name} decay never starts; set sched.warmup_epochs below it "
            f"(--set sched.warmup_epochs={round(epochs / 10, 3):g})")

    def warned(s: int) -> float:
        if s == 1:
            from fastvision import distributed

            if distributed.is_main():  # once a job: rank 0 of torch.distributed or Horovod
                log.warning(note)
        return fn(s)

    return torch.optim.lr_scheduler.LambdaLR(opt, warned)
