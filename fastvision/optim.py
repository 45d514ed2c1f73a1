"""Optimizers, parameter groups, learning-rate schedules and linear LR scaling.

Schedules are a per-step multiplier (``LambdaLR``) built from epochs and steps per epoch, so a
recipe states warm-up and milestones in epochs whatever the batch size or world size.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import nn
from torch.optim import Optimizer

from .config import OptimConfig, SchedConfig
from .errors import ConfigError

_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


def param_groups(model: nn.Module, weight_decay: float, no_decay_norm_bias: bool) -> list[dict]:
    """Two groups: decayed weights, and norm weights + biases without weight decay."""
    if not no_decay_norm_bias or weight_decay == 0:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            (no_decay if isinstance(module, _NORMS) or name.endswith("bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def effective_lr(cfg: OptimConfig, global_batch: int) -> float:
    """Linear scaling rule: ``lr * global_batch / ref_batch`` (Goyal et al.); unscaled if no ref."""
    return cfg.lr if not cfg.ref_batch else cfg.lr * global_batch / cfg.ref_batch


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float) -> Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.no_decay_norm_bias)
    betas = tuple(cfg.betas)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=betas, eps=cfg.eps)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=cfg.eps)
    if cfg.name == "novograd":
        return Novograd(groups, lr=lr, betas=betas, eps=cfg.eps)
    raise ConfigError(f"optim.name: unknown optimizer {cfg.name!r}; valid: sgd, adam, adamw, novograd")


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
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, steps_per_epoch, epochs))


class Novograd(Optimizer):
    """NovoGrad (Ginsburg et al., 2019): Adam-like with layer-wise second moments.

    Per parameter tensor: ``v = b2 * v + (1 - b2) * ||g||^2`` (a scalar, initialised to ``||g||^2``),
    ``m = b1 * m + g / (sqrt(v) + eps) + wd * w``, ``w -= lr * m``. ``grad_averaging`` scales the
    normalised gradient by ``1 - b1``. Matches MONAI's ``Novograd`` options.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.98),
                 eps: float = 1e-8, weight_decay: float = 0.0, grad_averaging: bool = False,
                 amsgrad: bool = False):
        if lr <= 0:
            raise ConfigError(f"optim.lr must be positive, got {lr}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, amsgrad=amsgrad)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                norm_sq = g.pow(2).sum()
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = norm_sq.clone()
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(norm_sq)
                else:
                    state["exp_avg_sq"].mul_(b2).add_(norm_sq, alpha=1 - b2)
                state["step"] += 1
                v = state["exp_avg_sq"]
                if group["amsgrad"]:
                    torch.maximum(state["max_exp_avg_sq"], v, out=state["max_exp_avg_sq"])
                    v = state["max_exp_avg_sq"]
                update = g / (v.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update = update.add(p, alpha=group["weight_decay"])
                if group["grad_averaging"]:
                    update = update.mul(1 - b1)
                state["exp_avg"].mul_(b1).add_(update)
                p.add_(state["exp_avg"], alpha=-group["lr"])
        return loss
