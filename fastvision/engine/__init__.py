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
from fastvision.engine.build import Run, build, cached_train_set, make_loader
from fastvision.engine.loop import evaluate, fit, train_one_epoch
from fastvision.engine.step import NonFiniteLossError, StepResult, train_step

__all__ = ["NonFiniteLossError", "Run", "StepResult", "build", "cached_train_set", "evaluate", "fit", "make_loader",
           "train_one_epoch", "train_step"]
