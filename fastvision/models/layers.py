"""N-d layer factories and small blocks shared by every fastvision model.

``spatial_dims`` (2 or 3) picks the layer class, so a 2-D and a 3-D network are one implementation
(the MONAI layer-factory idea). Everything here is plain ``torch.nn``; nothing is registered.

Typical use::

    conv(3)(16, 32, 3, padding=1)                   # nn.Conv3d
    norm("instance", 3, 32)                         # nn.InstanceNorm3d(32, affine=True)
    act("leakyrelu", slope=0.01)                    # nn.LeakyReLU(0.01)
    ConvNormAct(3, 16, 32, stride=2, norm="instance", act="leakyrelu")
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from torch import Tensor, nn

Size = int | Sequence[int]  # one value for every axis, or one per axis (3x3x1 kernels, 2x2x1 strides)
NormName = Literal["batch", "instance", "group", "none"]
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
        return nn.Dropout(p)
    return (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)[_check_dims(spatial_dims) - 1](p)


def norm(name: NormName | None, spatial_dims: int, channels: int, *, groups: int = 8, eps: float = 1e-5) -> nn.Module:
    """Normalisation layer over ``channels`` feature maps.

    Args:
        name: "batch", "instance" (always ``affine=True``, no running stats), "group" or "none"/None.
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
    if name == "group":
        if channels % groups:
            raise ValueError(f"group norm: {groups} groups do not divide {channels} channels")
        return nn.GroupNorm(groups, channels, eps=eps)
    raise ValueError(f"unknown norm {name!r}; valid: batch, instance, group, none")


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
        act_slope: negative slope for leakyrelu.

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
    ):
        if bias is None:
            bias = norm in (None, "none")
        kernel_size, stride = per_axis(kernel_size, spatial_dims), per_axis(stride, spatial_dims)
        padding = tuple((k - 1) // 2 for k in kernel_size)
        if transposed:
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
        if has_norm:
            self.norm = _norm(norm, spatial_dims, out_channels, groups=norm_groups)
        if dropout > 0:
            self.drop = nn.Dropout(dropout)
        if act not in (None, "none"):
            # in place is safe here: the act's input is a fresh conv/norm/dropout output
            self.act = _act(act, slope=act_slope, inplace=True)


class ResidualUnit(nn.Module):
    """``subunits`` ConvNormAct layers plus a residual path (the MONAI ``ResidualUnit`` design).

    The first conv carries the stride. The residual is the identity when shape and width are kept,
    else a conv (kernel 1 at stride 1, ``kernel_size`` when strided) with bias.

    Args:
        spatial_dims, in_channels, out_channels, kernel_size, stride, norm, act, bias, dropout,
        norm_groups, act_slope: as in :class:`ConvNormAct`.
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
                    norm_groups=norm_groups, act_slope=act_slope,
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


# ConvNormAct's arguments shadow the factory names; keep module-level aliases for use inside it.
_norm = norm
_act = act
