"""``norm: instance_cl``: an affine instance norm that keeps a channels-last layout, forward and backward,
with its own backward (:class:`InstanceNormCL`).

``nn.InstanceNorm3d`` reshapes its input to run batch norm and so copies a channels_last_3d tensor to
contiguous and returns it contiguous (pytorch #67976, #72341); the next conv copies it back. Here every
op is an elementwise op or a reduction over the spatial axes, whose outputs follow the input's layout.

The statistics are two-pass (the mean, then the mean square of the centred input), each one sum over
all the spatial axes at once: a CPU reduction over the outer axes of a channels-last tensor is
vectorised across the channels, where ``var_mean``'s Welford loop is not (4.1 ms against 0.045 ms for
the CT recipe's largest map, 2 x 32 x 32 x 32 x 24 fp32, on a 2-core AMD EPYC Zen 5, torch 2.13), and
it rounds as well (1.3e-7 relative against float64 for a mean of 1,000). Summing the last spatial axes
first and then the first, as this module did before, took 0.67 ms there. The backward is one function,
not autograd's chain through ``var_mean`` and ``addcmul`` (about eight passes over the map): with the
centred input ``xc`` saved, ``rstd`` and the weight ``w``,

    s1 = sum(dy), s2 = sum(dy * xc)                        (over the spatial axes, per sample and channel)
    dx = w rstd dy - (w rstd^3 s2 / m) xc - w rstd s1 / m  (m voxels)
    dw = sum over the batch of rstd s2,  db = sum over the batch of s1.

Numerics: fp32 accumulation in every reduction of a 16-bit input (fp16 too: a variance of
activations of std 1,000 is above fp16's 65,504; fp64 inputs stay fp64); the centring in the
accumulation dtype; the output and the input gradient in the input's dtype (for fp16 the
gradient's per-channel combination runs in fp32, since ``w rstd^3 s2 / m`` can fall below fp16's
smallest normal); the weight and bias gradients in the parameters' dtype.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _acc(x: Tensor) -> torch.dtype:
    """The accumulation dtype: fp32 for 16-bit inputs, else the input's own (fp64 stays fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


def _spatial_sum(x: Tensor, dims: tuple[int, ...], square: bool = False) -> Tensor:
    """Sum (of squares with ``square``) over the spatial ``dims`` (keepdim) in :func:`_acc`, one reduction
    over all of them. On the CPU the squares are an elementwise product and a sum: ``vector_norm`` over the
    outer axes of a channels-last map is a slow loop there (0.54 against 0.11 ms for a 2 x 32 x 32 x 32 x 24
    fp32 map) and rounds worse (6.9e-6 against 1.3e-7 relative); on a GPU ``vector_norm`` reads the map once."""
    acc = _acc(x)
    if not square:
        return x.sum(dims, keepdim=True, dtype=acc)
    if x.device.type != "cpu":
        return torch.linalg.vector_norm(x, 2, dims, keepdim=True, dtype=acc).square_()
    xf = x.to(acc)  # x itself when it is fp32 / fp64: then the product is the one temporary
    return (xf.square_() if xf is not x else xf * xf).sum(dims, keepdim=True)


class _InstanceNorm(torch.autograd.Function):
    """y = (x - mean) rstd w + b per sample and channel, statistics over the spatial axes."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        dims = tuple(range(2, x.dim()))
        m = math.prod(x.shape[2:])
        shape = (1, -1) + (1,) * len(dims)
        mean = _spatial_sum(x, dims).div_(m)
        xc = (x - mean).to(x.dtype)  # centred in fp32 (mean is fp32), kept in x's dtype and layout
        rstd = torch.rsqrt(_spatial_sum(xc, dims, square=True).div_(m).add_(eps))
        scale = rstd * weight.view(shape).to(rstd.dtype)
        ctx.save_for_backward(xc, weight, rstd)
        return torch.addcmul(bias.view(shape).to(x.dtype), xc, scale.to(x.dtype))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:
        xc, weight, rstd = ctx.saved_tensors
        dims = tuple(range(2, xc.dim()))
        m = math.prod(xc.shape[2:])
        shape = (1, -1) + (1,) * len(dims)
        s1 = _spatial_sum(dy, dims)
        s2 = _spatial_sum(dy * xc, dims)
        a = weight.view(shape).to(rstd.dtype) * rstd
        b = a * rstd * rstd * s2 / -m
        c = a * s1 / -m
        if dy.dtype == torch.float16:  # rstd^3 leaves fp16's range: the combination in fp32, then cast
            dx = torch.addcmul(c, dy, a).addcmul_(xc, b).to(dy.dtype)
        else:
            dx = torch.addcmul(c.to(dy.dtype), dy, a.to(dy.dtype)).addcmul_(xc, b.to(dy.dtype))
        dw = (s2 * rstd).sum(0).flatten().to(weight.dtype)
        return dx, dw, s1.sum(0).flatten().to(weight.dtype), None


class InstanceNormCL(nn.Module):
    """Affine instance norm of (B, C, *S) that keeps the input's memory layout, forward and backward
    (see the module docstring). The same parameters (``weight``, ``bias``: C) and state-dict keys as
    ``nn.InstanceNorm{N}d(affine=True)``.

    Args:
        channels: C.
        eps: added to the variance.
        act: "relu" or "leakyrelu" to apply in place on the output inside this module (MLPerf's
            InstanceNorm with the activation in it); None for none.
        slope: leakyrelu's negative slope.
    """

    def __init__(self, channels: int, eps: float = 1e-5, act: Literal["relu", "leakyrelu"] | None = None,
                 slope: float = 0.01):
        super().__init__()
        if act not in (None, "relu", "leakyrelu"):
            raise ValueError(f"InstanceNormCL fuses relu or leakyrelu only, got {act!r}")
        self.eps, self.act, self.slope = eps, act, slope
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor) -> Tensor:
        y = _InstanceNorm.apply(x, self.weight, self.bias, self.eps)
        if self.act == "relu":
            y = F.relu_(y)  # in place: y is this module's fresh output, and the norm's backward does not read it
        elif self.act == "leakyrelu":
            y = F.leaky_relu_(y, self.slope)
        return y

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}" + (f", act={self.act}" if self.act else "")
