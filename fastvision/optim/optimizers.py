"""Parameter groups, SGD/Adam/AdamW/Novograd, and the recipe's linear LR scaling."""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn
from torch.optim import Optimizer

from fastvision.config import OptimConfig
from fastvision.errors import ConfigError

log = logging.getLogger(__name__)

_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


def param_groups(model: nn.Module, weight_decay: float, no_decay_norm_bias: bool,
                 no_decay_bias: bool = True) -> list[dict]:
    """Two groups: decayed weights, and norm weights + biases without weight decay.

    Args:
        no_decay_norm_bias: exempt norm layers' parameters (and, with ``no_decay_bias``, every bias).
        no_decay_bias: also exempt the biases of other layers (a classifier head's); False exempts
            the norms alone, as seed 004 (DLE's ResNet-50 filters only the BatchNorm variables).
    """
    if not no_decay_norm_bias or weight_decay == 0:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            exempt = isinstance(module, _NORMS) or (no_decay_bias and name.endswith("bias"))
            (no_decay if exempt else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def effective_lr(cfg: OptimConfig, global_batch: int) -> float:
    """Linear scaling rule (Goyal et al. 2017): ``lr * global_batch / ref_batch``; unscaled if no ref.

    Args:
        cfg: ``lr`` is the learning rate for ``ref_batch`` images per optimizer step.
        global_batch: images per optimizer step over all workers (per-worker batch x workers x accum).
    """
    if global_batch <= 0 or (cfg.ref_batch is not None and cfg.ref_batch <= 0):
        raise ConfigError(f"optim: batches must be positive, got global {global_batch}, "
                          f"optim.ref_batch {cfg.ref_batch}")
    return cfg.lr if cfg.ref_batch is None else cfg.lr * global_batch / cfg.ref_batch


def _impl_kwargs(impl: str, device: torch.device) -> dict:
    """``fused`` / ``foreach`` arguments of torch's SGD / Adam / AdamW for ``optim.impl``.

    ``auto`` is fused on CUDA and on the CPU (one kernel per step, and on CUDA it applies a skip
    decided on the device: :func:`step_unless`), foreach elsewhere. On the CPU fused SGD equals
    foreach SGD bit for bit and steps 4x faster (``benchmarks/fused_cpu_optim.py``); fused Adam /
    AdamW differ from foreach in the last bit, as on CUDA.
    """
    if impl not in ("auto", "fused", "foreach", "loop"):
        raise ConfigError(f"optim.impl: expected auto, fused, foreach or loop, got {impl!r}")
    if impl == "auto":
        impl = "fused" if device.type in ("cuda", "cpu") else "foreach"
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[impl]


def _check_read(cfg: OptimConfig) -> None:
    """A setting the chosen optimizer does not read (it was ignored without a word): momentum and nesterov
    are SGD's (Adam's and Novograd's momentum is ``optim.betas[0]``, as MONAI's Novograd takes it), one
    warning on rank 0, since ``--set optim.name=adam`` on an SGD recipe inherits its momentum; ``optim.impl``
    fused / foreach, torch's SGD / Adam / AdamW kernels, is one line with Novograd, one loop over the tensors."""
    base = OptimConfig()
    unread = [f"optim.{k} {getattr(cfg, k)}" for k in ("momentum", "nesterov") if getattr(cfg, k) != getattr(base, k)]
    from fastvision import distributed  # rank 0 of torch.distributed or Horovod

    if cfg.name != "sgd" and unread and distributed.is_main():
        log.warning("%s: read by optim.name sgd alone, not %s, whose momentum is optim.betas[0] (now %s)",
                    " and ".join(unread), cfg.name, cfg.betas[0])
    if cfg.name == "novograd" and cfg.impl not in ("auto", "loop"):
        raise ConfigError(f"optim.impl {cfg.impl}: novograd has one implementation, a loop over the tensors (auto or "
                          "loop); fused and foreach are torch's sgd / adam / adamw kernels")


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float) -> Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.no_decay_norm_bias, cfg.no_decay_bias)
    betas = tuple(cfg.betas)
    if cfg.name != "sgd" and (len(betas) != 2 or not all(0 <= b < 1 for b in betas)):  # NaN fails too
        # before: one value stopped Novograd's first step naming the model, 1.0 was Adam's ValueError traceback,
        # and Novograd took 1.5 and diverged
        raise ConfigError(f"optim.betas must be two numbers in [0, 1) (beta1, beta2), got {list(cfg.betas)}")
    _check_read(cfg)
    first = next(model.parameters(), None)
    kw = _impl_kwargs(cfg.impl, first.device if first is not None else torch.device("cpu"))
    make = {"sgd": lambda **k: torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **k),
            "adam": lambda **k: torch.optim.Adam(groups, lr=lr, betas=betas, eps=cfg.eps, **k),
            "adamw": lambda **k: torch.optim.AdamW(groups, lr=lr, betas=betas, eps=cfg.eps, **k)}.get(cfg.name)
    if make is not None:
        try:
            return make(**kw)
        except RuntimeError:  # auto: a torch without this device's fused kernel (or a dtype it lacks)
            if cfg.impl != "auto" or "fused" not in kw:
                raise
            return make(foreach=True)
    if cfg.name == "novograd":
        return Novograd(groups, lr=lr, betas=betas, eps=cfg.eps)
    raise ConfigError(f"optim.name: unknown optimizer {cfg.name!r}; valid: sgd, adam, adamw, novograd")

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
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(norm_sq)
                state.pop("applied", None)  # the counter of checkpoints written before 2026-12-05
                # v starts at ||g||^2 while it is still 0, as MONAI's ``if exp_avg_sq == 0``: a skipped step
                # leaves it 0, and so does an all-zero gradient (a parameter the first batches do not reach)
                v_prev = state["exp_avg_sq"]
                v_new = torch.where(v_prev == 0, norm_sq, v_prev * b2 + norm_sq * (1 - b2))
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
                    p.add_(m_new, alpha=-group["lr"])
                    continue
                state["exp_avg_sq"].copy_(torch.where(keep, v_new, state["exp_avg_sq"]))
                if group["amsgrad"]:
                    state["max_exp_avg_sq"].copy_(torch.where(keep, v, state["max_exp_avg_sq"]))
                state["exp_avg"].copy_(torch.where(keep, m_new, state["exp_avg"]))
                p.copy_(torch.where(keep, p - group["lr"] * m_new, p))
        return loss
