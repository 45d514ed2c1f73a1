"""Optimizers, parameter groups, learning-rate schedules and linear LR scaling.

Schedules are a per-step multiplier (``LambdaLR``) built from epochs and steps per epoch, so a
recipe states warm-up and milestones in epochs whatever the batch size or world size.
"""
from fastvision.optim.optimizers import (
           Novograd,
           build_optimizer,
           effective_lr,
           param_groups,
)
from fastvision.optim.schedules import build_scheduler, lr_lambda
from fastvision.optim.step import found_non_finite, grads_found_inf, step_unless

__all__ = ["Novograd", "build_optimizer", "build_scheduler", "effective_lr", "found_non_finite", "grads_found_inf",
           "lr_lambda", "param_groups", "step_unless"]
