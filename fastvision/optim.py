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


def _impl_kwargs(impl: str, device: torch.device) -> dict:
    """``fused`` / ``foreach`` arguments of torch's SGD / Adam / AdamW for ``optim.impl``.

    ``auto`` is fused on CUDA (one kernel per step, and it applies a skip decided on the device:
    :func:`step_unless`), foreach elsewhere.
    """
    if impl not in ("auto", "fused", "foreach", "loop"):
        raise ConfigError(f"optim.impl: expected auto, fused, foreach or loop, got {impl!r}")
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[impl]


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float) -> Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.no_decay_norm_bias)
    betas = tuple(cfg.betas)
    first = next(model.parameters(), None)
    kw = _impl_kwargs(cfg.impl, first.device if first is not None else torch.device("cpu"))
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **kw)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=betas, eps=cfg.eps, **kw)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=cfg.eps, **kw)
    if cfg.name == "novograd":
        return Novograd(groups, lr=lr, betas=betas, eps=cfg.eps)
    raise ConfigError(f"optim.name: unknown optimizer {cfg.name!r}; valid: sgd, adam, adamw, novograd")


def grads_found_inf(optimizer: Optimizer) -> torch.Tensor:
    """0-d float32 on the gradients' device: 1.0 when any gradient is not finite, else 0.0.

    On the device, no host read: the GradScaler's own check with an inverse scale of 1. Under DDP
    (after backward) and horovod (after ``synchronize``) the gradients are all-reduced, so every
    rank reaches the same decision without a collective of its own.
    """
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    found = torch.zeros((), dtype=torch.float32, device=device)
    one = torch.ones((), dtype=torch.float32, device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(same, found, one)
    return found


def step_unless(optimizer: Optimizer, found_inf: torch.Tensor | None) -> None:
    """``optimizer.step()``, a no-op on the device where ``found_inf`` (0-d float) is non-zero
    (None: nothing was checked, a plain step).

    Fused torch optimizers take ``found_inf`` as GradScaler passes it (their kernels skip the
    update and undo the step count); :class:`Novograd` masks its own update; on CUDA any other
    optimizer is stepped and then every parameter and state tensor is put back where ``found_inf``
    is set (``torch.where`` against a copy taken before: transient memory of the parameters plus
    the optimizer state). None of these reads a value on the host. State created by a skipped
    first step is reset to zeros (torch's Adam, AdamW and SGD then behave exactly as if it had not
    been created). On the CPU, where reading a value syncs nothing, the non-fused kernels branch on
    the host instead.
    """
    if isinstance(optimizer, Novograd):
        optimizer.step(found_inf=found_inf)
        return
    fused = getattr(optimizer, "_step_supports_amp_scaling", False) and any(g.get("fused") for g in optimizer.param_groups)
    if found_inf is None or (not fused and found_inf.device.type == "cpu"):
        # nothing checked, or a CPU value read that waits for nothing: a plain step unless skipped,
        # instead of copying every parameter and state tensor to restore them (~10 % of a small
        # 3-D U-Net's CPU step)
        if found_inf is None or not bool(found_inf.reshape(()) > 0):
            optimizer.step()
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    fresh = [p for p in params if not optimizer.state.get(p)]  # state this step creates (a host-side check)
    skip = found_inf.reshape(()) > 0
    if fused:
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    else:
        kept = [p.detach().clone() for p in params]
        fresh_ids = {id(p) for p in fresh}
        old_state = {p: {k: v.clone() for k, v in optimizer.state[p].items() if torch.is_tensor(v)}
                     for p in params if id(p) not in fresh_ids}
        optimizer.step()
        with torch.no_grad():
            for p, old in zip(params, kept):
                p.copy_(torch.where(skip, old, p))
            for p, old in old_state.items():
                for k, v in old.items():
                    optimizer.state[p][k].copy_(torch.where(skip, v, optimizer.state[p][k]))
    # a skipped first step leaves zeros (fused SGD would leave its momentum buffer uninitialised)
    with torch.no_grad():
        for p in fresh:
            for v in optimizer.state[p].values():
                if torch.is_tensor(v):
                    v.copy_(torch.where(skip, torch.zeros_like(v), v))


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
    def step(self, closure=None, found_inf: torch.Tensor | None = None):
        """One update; with ``found_inf`` (0-d float, non-zero: skip) a no-op decided on the device."""
        keep = None if found_inf is None else (found_inf.reshape(()) == 0)
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
                    state["exp_avg_sq"] = torch.zeros_like(norm_sq)
                    # applied updates (a device tensor: a skipped first step leaves it 0, no host read)
                    state["applied"] = torch.zeros_like(norm_sq)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(norm_sq)
                applied = state.setdefault("applied", torch.ones_like(norm_sq))  # pre-"applied" checkpoints
                # v starts at ||g||^2 on the first applied update
                v_new = torch.where(applied > 0, state["exp_avg_sq"] * b2 + norm_sq * (1 - b2), norm_sq)
                state["step"] += 1  # step() calls (skipped included); the update does not use it
                v = v_new
                if group["amsgrad"]:
                    v = torch.maximum(state["max_exp_avg_sq"], v_new)
                update = g / (v.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update = update.add(p, alpha=group["weight_decay"])
                if group["grad_averaging"]:
                    update = update.mul(1 - b1)
                m_new = state["exp_avg"] * b1 + update
                if keep is None:
                    state["exp_avg_sq"].copy_(v_new)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"].copy_(v)
                    state["exp_avg"].copy_(m_new)
                    applied.add_(1)
                    p.add_(m_new, alpha=-group["lr"])
                    continue
                state["exp_avg_sq"].copy_(torch.where(keep, v_new, state["exp_avg_sq"]))
                if group["amsgrad"]:
                    state["max_exp_avg_sq"].copy_(torch.where(keep, v, state["max_exp_avg_sq"]))
                state["exp_avg"].copy_(torch.where(keep, m_new, state["exp_avg"]))
                applied.add_(keep.to(applied.dtype))
                p.copy_(torch.where(keep, p - group["lr"] * m_new, p))
        return loss
