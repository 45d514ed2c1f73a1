"""N-d layer factories and small blocks shared by every fastvision model.

``spatial_dims`` (2 or 3) picks the layer class, so a 2-D and a 3-D network are one implementation
(the MONAI layer-factory idea). Everything here is plain ``torch.nn``; nothing is registered.

Typical use::

    conv(3)(16, 32, 3, padding=1)                   # nn.Conv3d
    norm("instance", 3, 32)                         # nn.InstanceNorm3d(32, affine=True)
    norm("instance_cl", 3, 32)                      # the same norm, keeping a channels_last_3d input's layout
    act("leakyrelu", slope=0.01)                    # nn.LeakyReLU(0.01)
    ConvNormAct(3, 16, 32, stride=2, norm="instance", act="leakyrelu")
    ShuffleUp(3, 32, 16, 2)                         # a 2x2x2 stride-2 transposed conv as 1x1x1 conv + 3-D shuffle

The GPU levers (docs/gpu.md, "Model levers"): ``instance_cl`` (an InstanceNorm that keeps a
channels-last layout, the activation inside it), :class:`ShuffleUp` (``up_impl="shuffle"``) and
:func:`drop_bias_before_norm`. Each gives the stock layers' results up to float rounding.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastvision.models.dropout import Dropout
from fastvision.models.instance_norm import InstanceNormCL

Size = int | Sequence[int]  # one value for every axis, or one per axis (3x3x1 kernels, 2x2x1 strides)
NormName = Literal["batch", "instance", "instance_cl", "group", "none"]
ActName = Literal["relu", "leakyrelu", "prelu", "relu6", "gelu", "none"]


def _check_dims(spatial_dims: int) -> int:
    if spatial_dims not in (1, 2, 3):
        raise ValueError(f"spatial_dims must be 1, 2 or 3, got {spatial_dims}")
    return spatial_dims


def per_axis(value: Size, spatial_dims: int) -> tuple[int, ...]:
    """``3`` -> ``(3, 3, 3)``; a sequence must have one entry per spatial axis."""
    if isinstance(value, (list, tuple)):
        if len(value) != spatial_dims:
            raise ValueError(f"{tuple(value)} needs one entry per spatial axis ({spatial_dims})")
        return tuple(int(v) for v in value)
    return (int(value),) * spatial_dims


def conv(spatial_dims: int) -> type[nn.Module]:
    """``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` for ``spatial_dims`` 1 / 2 / 3."""
    return (nn.Conv1d, nn.Conv2d, nn.Conv3d)[_check_dims(spatial_dims) - 1]


def conv_transpose(spatial_dims: int) -> type[nn.Module]:
    """``nn.ConvTranspose{1,2,3}d`` for ``spatial_dims``."""
    return (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[_check_dims(spatial_dims) - 1]


def pool(name: Literal["max", "avg"], spatial_dims: int) -> type[nn.Module]:
    """Pooling class: ``pool("max", 3)`` is ``nn.MaxPool3d``; ``"avg"`` gives ``nn.AvgPool{N}d``."""
    table = {"max": (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d), "avg": (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)}
    if name not in table:
        raise ValueError(f"unknown pool {name!r}; valid: {', '.join(table)}")
    return table[name][_check_dims(spatial_dims) - 1]


def adaptive_avg_pool(spatial_dims: int) -> type[nn.Module]:
    """``nn.AdaptiveAvgPool{N}d`` (global pooling heads)."""
    return (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)[_check_dims(spatial_dims) - 1]


def dropout(p: float, spatial_dims: int = 0) -> nn.Module:
    """Element-wise dropout (``spatial_dims=0``) or whole-channel ``nn.Dropout{2,3}d``; Identity if p == 0."""
    if p <= 0:
        return nn.Identity()
    if spatial_dims == 0:
        return Dropout(p)
    return (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)[_check_dims(spatial_dims) - 1](p)


def norm(name: NormName | None, spatial_dims: int, channels: int, *, groups: int = 8, eps: float = 1e-5) -> nn.Module:
    """Normalisation layer over ``channels`` feature maps.

    Args:
        name: "batch", "instance" (always ``affine=True``, no running stats), "instance_cl" (the same
            norm as :class:`InstanceNormCL`: a channels-last input stays channels-last), "group" or
            "none"/None.
        spatial_dims: 1, 2 or 3 (ignored by "group").
        channels: number of channels C of the (B, C, *S) input.
        groups: number of groups for "group" (must divide ``channels``).
        eps: numerical epsilon.
    """
    d = _check_dims(spatial_dims) - 1
    if name in (None, "none"):
        return nn.Identity()
    if name == "batch":
        return (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[d](channels, eps=eps)
    if name == "instance":
        return (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[d](channels, eps=eps, affine=True)
    if name == "instance_cl":
        return InstanceNormCL(channels, eps=eps)
    if name == "group":
        if channels % groups:
            raise ValueError(f"group norm: {groups} groups do not divide {channels} channels")
        return nn.GroupNorm(groups, channels, eps=eps)
    raise ValueError(f"unknown norm {name!r}; valid: batch, instance, instance_cl, group, none")


def act(name: ActName | None, *, slope: float = 0.01, inplace: bool = False) -> nn.Module:
    """Activation module.

    Args:
        name: "relu", "leakyrelu", "prelu" (one learned slope, init 0.25), "relu6", "gelu", "none"/None.
        slope: negative slope of "leakyrelu".
        inplace: in-place variant where one exists (relu, leakyrelu, relu6). Only safe when the input
            is not needed by autograd afterwards, e.g. directly after a conv or a norm.
    """
    if name in (None, "none"):
        return nn.Identity()
    if name == "relu":
        return nn.ReLU(inplace=inplace)
    if name == "leakyrelu":
        return nn.LeakyReLU(slope, inplace=inplace)
    if name == "prelu":
        return nn.PReLU()
    if name == "relu6":
        return nn.ReLU6(inplace=inplace)
    if name == "gelu":
        return nn.GELU()
    raise ValueError(f"unknown activation {name!r}; valid: relu, leakyrelu, prelu, relu6, gelu, none")


class ConvNormAct(nn.Sequential):
    """conv -> norm -> dropout -> act, with 'same' padding (the output is ``ceil(S / stride)``).

    Args:
        spatial_dims: 2 or 3.
        in_channels / out_channels: C_in -> C_out.
        kernel_size: odd kernel (2 is allowed for a transposed conv); an int or one per axis (3, 3, 1).
        stride: convolution stride (also the up-sampling factor when ``transposed``); int or per axis.
        norm: see :func:`norm`; "none" gives a plain conv (+ act).
        act: see :func:`act`.
        bias: conv bias; ``None`` means "only when there is no norm".
        dropout: element-wise dropout probability after the norm (0 disables it).
        transposed: use a transposed conv whose output is exactly ``S * stride``.
        norm_groups: groups for group norm.
        norm_eps: the norm's epsilon (torch's 1e-5 by default; seed 000's TF instance norm: 1e-6).
        act_slope: negative slope for leakyrelu.
        up_impl: how a transposed conv is computed: "transpose" (``nn.ConvTranspose{N}d``) or
            "shuffle" (:class:`ShuffleUp`, the same weights; kernel == stride only).

    With ``norm="instance_cl"`` and a relu / leakyrelu (no dropout) the activation runs inside the
    norm module (no ``act`` submodule; the state dict is the same).

    Shapes:
        (B, C_in, *S) -> (B, C_out, *S') with S' = ceil(S / stride) (or S * stride if transposed).
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        out_channels: int,
        kernel_size: Size = 3,
        stride: Size = 1,
        *,
        norm: NormName | None = "batch",
        act: ActName | None = "relu",
        bias: bool | None = None,
        dropout: float = 0.0,
        transposed: bool = False,
        norm_groups: int = 8,
        act_slope: float = 0.01,
        up_impl: Literal["transpose", "shuffle"] = "transpose",
        norm_eps: float = 1e-5,
    ):
        if bias is None:
            bias = norm in (None, "none")
        kernel_size, stride = per_axis(kernel_size, spatial_dims), per_axis(stride, spatial_dims)
        padding = tuple((k - 1) // 2 for k in kernel_size)
        if transposed and up_impl == "shuffle":
            layer = ShuffleUp(spatial_dims, in_channels, out_channels, kernel_size, stride, bias=bias)
        elif transposed:
            # output_padding makes (S-1)*s - 2p + k + op == S*s for k=2 and k=3 at stride 2 (and k odd at 1)
            output_padding = tuple(s - 1 - (k - 1) % 2 for k, s in zip(kernel_size, stride, strict=True))
            layer = conv_transpose(spatial_dims)(
                in_channels, out_channels, kernel_size, stride, padding, output_padding=output_padding, bias=bias
            )
        else:
            layer = conv(spatial_dims)(in_channels, out_channels, kernel_size, stride, padding, bias=bias)
        has_norm = norm not in (None, "none")
        super().__init__()
        self.conv = layer
        fuse = norm == "instance_cl" and act in ("relu", "leakyrelu") and dropout <= 0
        if fuse:
            self.norm = InstanceNormCL(out_channels, eps=norm_eps, act=act, slope=act_slope)
        elif has_norm:
            self.norm = _norm(norm, spatial_dims, out_channels, groups=norm_groups, eps=norm_eps)
        if dropout > 0:
            self.drop = Dropout(dropout)
        if act not in (None, "none") and not fuse:
            # in place is safe here: the act's input is a fresh conv/norm/dropout output
            self.act = _act(act, slope=act_slope, inplace=True)


class ResidualUnit(nn.Module):
    """``subunits`` ConvNormAct layers plus a residual path (the MONAI ``ResidualUnit`` design).

    The first conv carries the stride. The residual is the identity when shape and width are kept,
    else a conv (kernel 1 at stride 1, ``kernel_size`` when strided) with bias.

    Args:
        spatial_dims, in_channels, out_channels, kernel_size, stride, norm, act, bias, dropout,
        norm_groups, norm_eps, act_slope: as in :class:`ConvNormAct`.
        subunits: number of stacked ConvNormAct layers (>= 1).
        last_conv_only: the last layer is a bare conv (no norm / dropout / act), for output layers.

    Shapes:
        (B, C_in, *S) -> (B, C_out, *ceil(S / stride)).
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        out_channels: int,
        kernel_size: Size = 3,
        stride: Size = 1,
        *,
        subunits: int = 2,
        norm: NormName | None = "batch",
        act: ActName | None = "prelu",
        bias: bool | None = True,
        dropout: float = 0.0,
        last_conv_only: bool = False,
        norm_groups: int = 8,
        act_slope: float = 0.01,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        layers = []
        for i in range(max(1, subunits)):
            bare = last_conv_only and i == max(1, subunits) - 1
            layers.append(
                ConvNormAct(
                    spatial_dims, in_channels if i == 0 else out_channels, out_channels, kernel_size,
                    stride if i == 0 else 1, norm="none" if bare else norm, act="none" if bare else act,
                    bias=bias if bias is not None else bare, dropout=0.0 if bare else dropout,
                    norm_groups=norm_groups, act_slope=act_slope, norm_eps=norm_eps,
                )
            )
        self.conv = nn.Sequential(*layers)
        self.residual: nn.Module = nn.Identity()
        strided = any(v != 1 for v in per_axis(stride, spatial_dims))
        if strided or in_channels != out_channels:
            k = per_axis(kernel_size if strided else 1, spatial_dims)
            pad = tuple((v - 1) // 2 for v in k)
            self.residual = conv(spatial_dims)(in_channels, out_channels, k, stride, pad, bias=bias is not False)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x) + self.residual(x)


class ShuffleUp(nn.Module):
    """A transposed conv whose kernel equals its stride (2x2x2 at stride 2), computed as a 1x1 conv
    to ``C_out * prod(stride)`` channels and an N-d pixel shuffle.

    Each output voxel of such a transposed conv takes one input voxel through one kernel tap, so
    the result equals ``nn.ConvTranspose{N}d(C_in, C_out, stride, stride)`` given the same weights;
    the parameters are stored in that layer's shapes (``weight``: (C_in, C_out, *stride), ``bias``:
    C_out), so state dicts load either way. On a channels-last input the 1x1 conv's output channels
    are ordered tap-major and the shuffle writes a channels-last output (one copy); on a contiguous
    input channel-major, as ``pixel_shuffle``.

    Args:
        spatial_dims: 1, 2 or 3.
        in_channels / out_channels: C_in -> C_out.
        kernel_size: must equal ``stride`` per axis.
        stride: up-sampling factor, an int or one per axis (``(2, 2, 1)``).
        bias: learn a bias of C_out.

    Shapes:
        (B, C_in, *S) -> (B, C_out, *(S * stride)).
    """

    def __init__(self, spatial_dims: int, in_channels: int, out_channels: int, kernel_size: Size, stride: Size,
                 bias: bool = True):
        super().__init__()
        k, s = per_axis(kernel_size, spatial_dims), per_axis(stride, spatial_dims)
        if k != s:
            raise ValueError(f"up='shuffle' needs the up-convolution's kernel equal to its stride, got kernel {k} "
                             f"at stride {s} (up_kernel 2 with stride 2; else up='transpose')")
        self.dims, self.factors, self.out_channels = spatial_dims, s, out_channels
        self.weight = nn.Parameter(torch.empty(in_channels, out_channels, *s))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        # nn.ConvTranspose's own initialisation, same draws: either implementation starts from the same weights
        nn.modules.conv._ConvNd.reset_parameters(self)

    def forward(self, x: Tensor) -> Tensor:
        n, cin, cout, taps = self.dims, self.weight.shape[0], self.out_channels, math.prod(self.factors)
        cl = x.dim() > 3 and not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last if n == 2 else torch.channels_last_3d)
        spatial = tuple(range(2, 2 + n))
        order = (*spatial, 1, 0) if cl else (1, *spatial, 0)  # output channel = tap * C_out + o, or o * taps + tap
        w = self.weight.permute(order).reshape(cout * taps, cin, *(1,) * n)
        b = None if self.bias is None else (self.bias.repeat(taps) if cl else self.bias.repeat_interleave(taps))
        y = (F.conv1d, F.conv2d, F.conv3d)[n - 1](x, w, b)
        batch, size = y.shape[0], y.shape[2:]
        out = tuple(a * f for a, f in zip(size, self.factors, strict=True))
        inter = [i for a in range(n) for i in (a, n + a)]  # S1, f1, S2, f2, ... as offsets of (*S, *f)
        if cl:  # (B, *S, *f, C_out) in memory -> (B, S1, f1, S2, f2, ..., C_out): one copy, channels-last
            y = y.permute(0, *spatial, 1).reshape(batch, *size, *self.factors, cout)
            y = y.permute(0, *(1 + i for i in inter), 2 * n + 1).reshape(batch, *out, cout)
            return y.permute(0, n + 1, *range(1, n + 1))
        y = y.reshape(batch, cout, *self.factors, *size)  # (B, C_out, *f, *S) -> (B, C_out, S1, f1, S2, f2, ...)
        return y.permute(0, 1, *(2 + (i + n) % (2 * n) for i in inter)).reshape(batch, cout, *out)


def drop_bias_before_norm(model: nn.Module) -> int:
    """Remove the bias of every conv of a :class:`ConvNormAct` that a batch or instance norm follows.

    Such a norm subtracts each channel's mean, so a per-channel constant added before it cancels:
    the training outputs are the same up to float rounding. Instance norm keeps no statistics; batch
    norm's running mean then tracks the unbiased means, so eval outputs agree once it has converged
    (the difference decays as ``(1 - momentum) ** steps``). Group norm is left alone: it subtracts a
    group's mean, not a channel's. Called after initialisation, so the other weights are those the model
    with biases draws. Returns the number of biases removed.
    """
    removed = 0
    for m in model.modules():
        if isinstance(m, ConvNormAct) and getattr(m.conv, "bias", None) is not None and isinstance(
                getattr(m, "norm", None), (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm,
                                           InstanceNormCL)):
            m.conv.bias = None
            removed += 1
    return removed


# ConvNormAct's arguments shadow the factory names; keep module-level aliases for use inside it.
_norm = norm
_act = act
