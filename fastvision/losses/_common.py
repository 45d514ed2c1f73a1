"""Helpers shared by the loss modules: float32 under autocast, target densification, weights,
activations and MONAI's ``reduction`` shapes."""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

Reduction = Literal["mean", "sum", "none"]


def _fp32(x: Tensor) -> Tensor:
    return x.float() if x.dtype != torch.float32 and x.is_floating_point() else x


def _no_autocast(x: Tensor) -> torch.autocast:
    """A context that disables autocast on ``x``'s device so the loss runs in float32."""
    return torch.autocast(device_type=x.device.type, enabled=False)


def _reduce(x: Tensor, reduction: str) -> Tensor:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return x.mean() if reduction == "mean" else x.sum() if reduction == "sum" else x


def _reduce_region(f: Tensor, reduction: str, ndim: int) -> Tensor:
    """Reduce per-item, per-channel region losses ``f`` ((B, C), or (C,) / (1, C) with ``batch``).

    ``"none"`` keeps MONAI's broadcastable shape ``f.shape[:2] + (1,) * (ndim - 2)``, so a region
    loss adds correctly to an elementwise one ``(B, C, *S)`` (DiceFocal).
    """
    if reduction == "none":
        return f.reshape(list(f.shape[:2]) + [1] * (ndim - 2))
    return _reduce(f, reduction)


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu, "exp": torch.exp,
    "softplus": nn.functional.softplus, "identity": lambda x: x,
}


def _activation(other_act: str | Callable[[Tensor], Tensor] | None) -> Callable[[Tensor], Tensor] | None:
    """MONAI's ``other_act``: a callable, or (from a recipe) the name of one in ``ACTIVATIONS``."""
    if other_act is None or callable(other_act):
        return other_act
    if other_act not in ACTIVATIONS:
        raise ValueError(f"other_act: unknown activation {other_act!r}; valid: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[other_act]


def _check_acts(sigmoid: bool, softmax: bool, other_act) -> None:
    if int(sigmoid) + int(softmax) + int(other_act is not None) > 1:
        raise ValueError("choose at most one of sigmoid, softmax and other_act")


def _activate(x: Tensor, sigmoid: bool, softmax: bool, other_act) -> Tensor:
    if sigmoid:
        return torch.sigmoid(x)
    if softmax and x.shape[1] > 1:
        return torch.softmax(x, dim=1)
    if other_act is not None:
        return other_act(x)
    return x


def class_indices(logits: Tensor, target: Tensor) -> Tensor:
    """Integer target ``(B, *S)`` or ``(B, 1, *S)`` as ``(B, *S)`` int64 class indices."""
    if target.dim() == logits.dim():
        target = target.squeeze(1)
    return target.long()


def dense_target(logits: Tensor, target: Tensor) -> Tensor:
    """The target as a float32 tensor shaped like ``logits`` ``(B, C, *S)``.

    Integer indices are one-hot encoded by comparison with ``arange(C)`` rather than
    ``F.one_hot``, which may validate the value range (a device sync on CUDA). An index
    outside ``[0, C)`` therefore gives an all-zero row. With ``C == 1`` indices are a 0/1 map.
    """
    if target.is_floating_point():
        if target.shape != logits.shape:
            raise ValueError(f"float target shape {tuple(target.shape)} differs from logits {tuple(logits.shape)}")
        return target.float()
    idx = class_indices(logits, target)
    c = logits.shape[1]
    if c == 1:
        return idx.unsqueeze(1).float()
    classes = torch.arange(c, device=idx.device).view(1, c, *([1] * (idx.dim() - 1)))
    return (idx.unsqueeze(1) == classes).float()


def _weight_buffer(module: nn.Module, name: str, weight: list[float] | float | None) -> None:
    value = None if weight is None else torch.as_tensor(weight, dtype=torch.float32)
    if value is not None and (value < 0).any():
        raise ValueError(f"{name} must be non-negative, got {weight}")
    # non-persistent: the weights come from the recipe, not from a checkpoint
    module.register_buffer(name, value, persistent=False)


def _per_class(weight: Tensor, channels: int, what: str) -> Tensor:
    """A scalar or length-``channels`` weight as a ``(channels,)`` tensor."""
    if weight.dim() == 0:
        return weight.expand(channels)
    if weight.numel() != channels:
        raise ValueError(f"{what} has {weight.numel()} values but the loss sees {channels} channels")
    return weight
