"""SegResNet: the residual encoder-decoder of Myronenko 2018, as in MONAI's BraTS recipe (seed 003).

Design (same layer shapes as ``monai.networks.nets.SegResNet``, written here independently):

* a 3x3 stem conv to ``init_filters`` (F), then optional dropout;
* encoder level ``i`` (width F * 2^i): a stride-2 3x3 conv for ``i > 0``, then ``blocks_down[i]``
  pre-activation residual blocks (norm, act, conv, norm, act, conv, + identity);
* decoder level ``j``: 1x1 conv halving the width, 2x up-sampling ("nontrainable" trilinear, or
  "deconv" 2x2 stride-2 transposed conv), **addition** of the encoder feature, ``blocks_up[j]``
  residual blocks;
* head: norm, act, 1x1 conv with bias to ``out_channels``.

Convs inside the network have no bias (a norm always follows them).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from torch import Tensor, nn

from fastvision.models.layers import (
    ActName,
    NormName,
    Size,
    act,
    conv,
    conv_transpose,
    dropout,
    norm,
    per_axis,
)
from fastvision.registry import MODELS

# SegResNet's arguments ``norm`` / ``act`` shadow the factories inside it
_norm = norm
_act = act


def _same(kernel: tuple[int, ...]) -> tuple[int, ...]:
    return tuple((v - 1) // 2 for v in kernel)


def _level_geometry(spatial_dims: int, levels: int, strides: Sequence[Size] | None, kernel_size: Size | Sequence[Size]
                    ) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Per-axis strides into levels 1.. and per-axis kernels of every level."""
    st = tuple(per_axis(s, spatial_dims) for s in (strides if strides is not None else [2] * (levels - 1)))
    if len(st) != levels - 1:
        raise ValueError(f"strides {strides} needs one entry per level after the first ({levels - 1})")
    per_level = isinstance(kernel_size, (list, tuple)) and isinstance(kernel_size[0], (list, tuple))
    ks = tuple(per_axis(k, spatial_dims) for k in (kernel_size if per_level else [kernel_size] * levels))
    if len(ks) != levels:
        raise ValueError(f"kernel_size {kernel_size} must be one kernel or one per level ({levels})")
    return st, ks


class ResBlock(nn.Module):
    """Pre-activation residual block keeping width and size: x + conv(act(norm(conv(act(norm(x)))))).

    Shapes:
        (B, C, *S) -> (B, C, *S).
    """

    def __init__(self, spatial_dims: int, channels: int, norm_name: NormName, act_name: ActName, groups: int,
                 kernel: Size = 3):
        super().__init__()
        k = per_axis(kernel, spatial_dims)
        pad = tuple((v - 1) // 2 for v in k)
        self.norm1 = norm(norm_name, spatial_dims, channels, groups=groups)
        self.conv1 = conv(spatial_dims)(channels, channels, k, padding=pad, bias=False)
        self.norm2 = norm(norm_name, spatial_dims, channels, groups=groups)
        self.conv2 = conv(spatial_dims)(channels, channels, k, padding=pad, bias=False)
        # in place is safe: each act input is a fresh norm output, never the identity branch
        self.act = act(act_name, inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv1(self.act(self.norm1(x)))
        return x + self.conv2(self.act(self.norm2(y)))


class SegResNet(nn.Module):
    """Residual encoder-decoder with additive skips.

    Args:
        spatial_dims: 2 or 3.
        in_channels: input channels (4 MRI modalities for BraTS).
        out_channels: outputs (3 nested BraTS regions TC / WT / ET, sigmoid).
        init_filters: width F of the first level; level i has F * 2^i channels.
        blocks_down: residual blocks per encoder level (its length sets the depth).
        blocks_up: residual blocks per decoder level (one fewer than ``blocks_down``).
        dropout_prob: whole-channel dropout after the stem (0 disables it).
        norm: "group", "batch" or "instance".
        norm_groups: groups for group norm.
        act: activation.
        upsample: "nontrainable" ((bi/tri)linear, align_corners=False) or "deconv".
        strides: down-sampling into levels 1.. (``len(blocks_down) - 1`` entries, each an int or one
            per axis, e.g. ``(2, 2, 1)`` for an anisotropic axis); default 2 everywhere.
        kernel_size: conv kernel of every level (an int or per axis, e.g. ``(3, 3, 1)``) or a list of
            one per level; the stem uses level 0's, decoder level j the kernel of the level it returns to.

    Shapes:
        (B, in_channels, *S) -> (B, out_channels, *S); each size in S divisible by the product of
        the strides along its axis (``divisor``; 2^(len(blocks_down) - 1) by default).
    """

    # train.activation_checkpointing: true checkpoints each encoder and decoder level
    checkpoint_blocks = ("down.*", "up.*")

    def __init__(
        self,
        spatial_dims: int = 3,
        in_channels: int = 4,
        out_channels: int = 3,
        init_filters: int = 16,
        blocks_down: tuple[int, ...] = (1, 2, 2, 4),
        blocks_up: tuple[int, ...] = (1, 1, 1),
        dropout_prob: float = 0.2,
        norm: NormName = "group",
        norm_groups: int = 8,
        act: ActName = "relu",
        upsample: Literal["nontrainable", "deconv"] = "nontrainable",
        strides: tuple[Size, ...] | None = None,
        kernel_size: Size | tuple[Size, ...] = 3,
    ):
        super().__init__()
        if len(blocks_up) != len(blocks_down) - 1:
            raise ValueError(f"blocks_up {blocks_up} needs one entry fewer than blocks_down {blocks_down}")
        st, ks = _level_geometry(spatial_dims, len(blocks_down), strides, kernel_size)
        self.strides, self.kernels, self.out_channels = st, ks, out_channels  # out_channels: Task.check_model
        self.divisor = tuple(math.prod(s[a] for s in st) for a in range(spatial_dims))
        conv_t, f = conv(spatial_dims), init_filters
        self.stem = conv_t(in_channels, f, ks[0], padding=_same(ks[0]), bias=False)
        self.dropout = dropout(dropout_prob, spatial_dims)

        def res(c: int, n: int, k: tuple[int, ...]) -> list[nn.Module]:
            return [ResBlock(spatial_dims, c, norm, act, norm_groups, k) for _ in range(n)]

        self.down = nn.ModuleList()
        for i, n in enumerate(blocks_down):
            c = f * 2**i
            pre = [conv_t(c // 2, c, ks[i], stride=st[i - 1], padding=_same(ks[i]), bias=False)] if i > 0 else []
            self.down.append(nn.Sequential(*pre, *res(c, n, ks[i])))
        self.up_samples = nn.ModuleList()
        self.up = nn.ModuleList()
        for j, n in enumerate(blocks_up):
            level = len(blocks_up) - j  # the level arriving from below
            c, s = f * 2**level, st[level - 1]
            if upsample == "deconv":
                resize: nn.Module = conv_transpose(spatial_dims)(c // 2, c // 2, s, stride=s)
            else:
                mode = ("linear", "bilinear", "trilinear")[spatial_dims - 1]
                resize = nn.Upsample(scale_factor=tuple(float(v) for v in s), mode=mode, align_corners=False)
            self.up_samples.append(nn.Sequential(conv_t(c, c // 2, 1, bias=False), resize))
            self.up.append(nn.Sequential(*res(c // 2, n, ks[level - 1])))
        self.head = nn.Sequential(
            _norm(norm, spatial_dims, f, groups=norm_groups),
            _act(act, inplace=True),
            conv_t(f, out_channels, 1, bias=True),
        )

    def forward(self, x: Tensor) -> Tensor:
        """Logits (B, out_channels, *S) for images (B, in_channels, *S)."""
        if any(s % d for s, d in zip(x.shape[2:], self.divisor, strict=True)):
            raise ValueError(f"SegResNet input sizes {tuple(x.shape[2:])} must be divisible by {self.divisor}")
        x = self.dropout(self.stem(x))
        skips = []
        for level in self.down:
            x = level(x)
            skips.append(x)
        for j, (resize, blocks) in enumerate(zip(self.up_samples, self.up, strict=True)):
            x = blocks(resize(x) + skips[-2 - j])
        return self.head(x)


# MONAI's BraTS SegResNet (16 filters, blocks 1-2-2-4 / 1-1-1, dropout 0.2, 4 in, 3 region outputs);
# the class is its own builder, its signature the recipe schema
segresnet = MODELS.register("segresnet")(SegResNet)
