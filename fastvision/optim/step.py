"""The optimizer step that skips on non-finite gradients, on the device (no host sync on CUDA)."""
from __future__ import annotations

import torch
from torch.optim import Optimizer

from fastvision.optim import torch_private
from fastvision.optim.optimizers import Novograd


def grads_found_inf(optimizer: Optimizer) -> torch.Tensor:
    """0-d float32 on the gradients' device: 1.0 when any gradient is not finite, else 0.0.

    On the device, no host read: the GradScaler's own check with an inverse scale of 1. Under DDP
    (after backward) and horovod (after ``synchronize``) the gradients are all-reduced, so every
    rank reaches the same decision without a collective of its own.
    """
    return found_non_finite([p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None])


def found_non_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-d float32 on the tensors' device: 1.0 when any floating-point tensor holds a NaN or Inf,
    else 0.0; on the device (multi-tensor kernels, one per dtype), no host read."""
    tensors = [t.detach() for t in tensors if t.is_floating_point()]
    device = tensors[0].device if tensors else torch.device("cpu")
    found = torch.zeros((), dtype=torch.float32, device=device)
    one = torch.ones((), dtype=torch.float32, device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        torch_private.non_finite_check_(same, found, one)  # x * 1 in place: values unchanged
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
    fused = (getattr(optimizer, "_step_supports_amp_scaling", False)
             and any(g.get("fused") for g in optimizer.param_groups))
    if found_inf is None or (not fused and found_inf.device.type == "cpu"):
        # nothing checked, or a CPU value read that waits for nothing: a plain step unless skipped,
        # instead of copying every parameter and state tensor to restore them (~10 % of a small
        # 3-D U-Net's CPU step)
        if found_inf is None or not bool(found_inf.reshape(()) > 0):
            optimizer.step()
        else:
            torch_private.mark_stepped(optimizer)  # the schedule steps anyway: no torch warning
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    fresh = [p for p in params if not optimizer.state.get(p)]  # state this step creates (a host-side check)
    skip = found_inf.reshape(()) > 0
    if fused:
        with torch_private.fused_skip(optimizer, found_inf):
            optimizer.step()
    else:
        kept = [p.detach().clone() for p in params]
        fresh_ids = {id(p) for p in fresh}
        old_state = {p: {k: v.clone() for k, v in optimizer.state[p].items() if torch.is_tensor(v)}
                     for p in params if id(p) not in fresh_ids}
        optimizer.step()
        with torch.no_grad():
            for p, old in zip(params, kept, strict=True):
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
