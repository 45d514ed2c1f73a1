"""One N-d U-Net (2-D and 3-D) and its registered variants.

A U-Net here is a list of encoder stages (stage ``i`` down-samples by ``strides[i]``; the last one is
the bottleneck), then decoder stages that each take ``cat(skip_i, ups[i](x))``, then a head. Two
layouts share the same forward code; only what the stages contain differs:

* classic (``residual=False``, seeds 000/001, nnU-Net): stage = ``n_convs`` x (conv + norm + act);
  the up-sampling (transposed conv or interpolation + 1x1 conv) acts on the deeper features before
  the concatenation; a separate output conv (kernel 1 or 3) makes the logits.
* residual (``residual=True``, MONAI ``UNet`` with ``num_res_units``): stage = a residual unit with
  ``n_convs`` sub-units; the bottleneck keeps the resolution (``strides[-1] == 1``) and the
  up-sampling acts on the concatenation, followed by a one-layer residual unit; the top decoder
  stage emits the logits itself.

Variants: ``unet`` (all options), ``unet2d``, ``unet3d``, ``unet2d-seed001``, ``unet3d-nonewnet``,
``unet3d-spleen``.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from fastvision.models.layers import (
    ActName,
    ConvNormAct,
    NormName,
    ResidualUnit,
    ShuffleUp,
    Size,
    conv,
    drop_bias_before_norm,
    per_axis,
    pool,
)
from fastvision.models.pad_in import check_pad_in, pad_input_convs
from fastvision.registry import MODELS


def stage_geometry(spatial_dims: int, filters: Sequence[int], strides: Sequence[Size] | None,
                   kernel_size: Size | Sequence[Size], residual: bool
                   ) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Per-stage, per-axis strides and kernels: ``((2, 2, 1), ...)``, ``((3, 3, 1), ...)``.

    ``strides`` has one entry per filter (an int or one per axis); ``kernel_size`` is one kernel for
    every stage (an int, or a per-axis tuple such as ``(3, 3, 1)``) or a list of one per stage.
    """
    if len(filters) < 2:
        raise ValueError("filters needs at least one encoder width and a bottleneck width")
    depth = len(filters) - 1
    if strides is None:
        strides = (2,) * depth + (1,) if residual else (1,) + (2,) * depth
    if len(strides) != len(filters):
        raise ValueError(f"strides {tuple(strides)} must have one entry per filter {tuple(filters)}")
    st = tuple(per_axis(s, spatial_dims) for s in strides)
    if residual and any(v != 1 for v in st[-1]):
        # the bottleneck output is concatenated with the last skip at the same resolution
        raise ValueError(f"residual layout needs strides[-1] == 1, got {tuple(strides)}")
    per_stage = isinstance(kernel_size, (list, tuple)) and any(isinstance(k, (list, tuple)) for k in kernel_size)
    per_stage = per_stage or (isinstance(kernel_size, (list, tuple)) and len(kernel_size) == len(filters)
                              and len(filters) != spatial_dims)
    kernels = kernel_size if per_stage else [kernel_size] * len(filters)
    if len(kernels) != len(filters):
        raise ValueError(f"kernel_size {kernel_size} must be one kernel or one per filter {tuple(filters)}")
    return st, tuple(per_axis(k, spatial_dims) for k in kernels)


class _Parts:
    """Builders of one stage body, encoder stage and up-sampling step (the layouts differ only here)."""

    def __init__(self, spatial_dims: int, opts: dict, n_convs: int, residual: bool, down: str, up: str,
                 up_kernel: int):
        self.dims, self.opts, self.n_convs, self.residual = spatial_dims, opts, n_convs, residual
        self.down, self.up, self.up_kernel = down, up, up_kernel

    def block(self, cin: int, cout: int, stride: Size, kernel: tuple[int, ...], subunits: int | None = None,
              last_conv_only: bool = False) -> nn.Module:
        """One stage body: a residual unit, or ``subunits`` ConvNormAct with the stride on the first."""
        subunits = self.n_convs if subunits is None else subunits
        if self.residual:
            return ResidualUnit(self.dims, cin, cout, kernel, stride, subunits=subunits,
                                last_conv_only=last_conv_only, **self.opts)
        return nn.Sequential(*[ConvNormAct(self.dims, cin if j == 0 else cout, cout, kernel,
                                           stride if j == 0 else 1, **self.opts) for j in range(subunits)])

    def encoder(self, cin: int, cout: int, stride: tuple[int, ...], kernel: tuple[int, ...]) -> nn.Module:
        if any(s > 1 for s in stride) and self.down == "maxpool":
            return nn.Sequential(pool("max", self.dims)(stride), self.block(cin, cout, 1, kernel))
        return self.block(cin, cout, stride, kernel)

    def resample(self, cin: int, cout: int, stride: tuple[int, ...], kernel: tuple[int, ...]) -> nn.Module:
        """Up-sample by ``stride`` and map cin -> cout; classic: bare (bias, no norm/act).

        An axis not up-sampled gets a transposed kernel of 1 where ``up_kernel`` is even (2 = stride,
        nnU-Net's choice), else ``up_kernel``; both keep its size.
        """
        o = self.opts if self.residual else dict(self.opts, norm="none", act="none", dropout=0.0, bias=True)
        k = kernel if self.residual else (1,) * self.dims
        if all(s == 1 for s in stride):
            return ConvNormAct(self.dims, cin, cout, k, **o)
        if self.up in ("transpose", "shuffle"):
            uk = tuple(self.up_kernel if s > 1 or self.up_kernel % 2 else 1 for s in stride)
            return ConvNormAct(self.dims, cin, cout, uk, stride, transposed=True, up_impl=self.up, **o)
        mode = ("linear", "bilinear", "trilinear")[self.dims - 1]
        return nn.Sequential(nn.Upsample(scale_factor=tuple(float(s) for s in stride), mode=mode, align_corners=False),
                             ConvNormAct(self.dims, cin, cout, k, **o))


INITS = ("default", "xavier", "he", "he_heads")


def _init_weights(model: nn.Module, init: str) -> None:
    """Conv and transposed-conv weights re-drawn, biases zeroed: ``xavier`` Glorot-uniform (seed 000);
    ``he`` nnU-Net's ``InitWeights_He(1e-2)``, ``kaiming_normal_(a=0.01)`` (fan-in, leaky-ReLU gain:
    std ``sqrt(2 / (1 + 0.01^2) / fan_in)``). ``default`` keeps PyTorch's own initialisation."""
    if init not in INITS:
        from fastvision.errors import ConfigError

        raise ConfigError(f"model.args.init: {init!r}; valid: {', '.join(INITS)}")
    if init == "default":
        return
    if init == "he_heads":
        _he_heads(model)
        return
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d, ShuffleUp)):
            if init == "he":
                nn.init.kaiming_normal_(m.weight, a=1e-2)
            else:
                nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def _he_heads(model: nn.Module) -> None:
    """``he_heads``: PyTorch's initialisation in the body, nnU-Net's He draw (``kaiming_normal_(a=0.01)``, zero
    bias) on the logit heads only (``head`` and the deep-supervision heads), drawn on a fork of the global RNG so
    every later draw is the default run's. Every body conv feeds an instance or batch norm, which cancels its
    weight scale; the heads feed none, and PyTorch's default there is ~2.4x smaller than He, which leaves the
    foreground logits below the background's for the first iterations (benchmarks/RESULTS.md, "CT at 16
    iterations: what was checked")."""
    from fastvision.errors import ConfigError

    if not isinstance(getattr(model, "head", None), (nn.Conv2d, nn.Conv3d)):
        raise ConfigError("model.args.init: he_heads needs the classic U-Net layout (residual: false): the residual "
                          "layout's logits come out of its top residual unit")
    with torch.random.fork_rng(devices=[]):
        for h in [model.head, *(model.ds_heads or [])]:
            nn.init.kaiming_normal_(h.weight, a=1e-2)
            if h.bias is not None:
                nn.init.zeros_(h.bias)


class UNet(nn.Module):
    """Configurable N-d U-Net.

    Args:
        spatial_dims: 2 or 3.
        in_channels: input channels C_in.
        out_channels: output channels (classes or regions).
        filters: width of each encoder stage, top to bottom; the last entry is the bottleneck.
        strides: down-sampling factor into each stage (len == len(filters)), each an int or one per
            axis (``(2, 2, 1)`` pools in-plane only, for anisotropic data); default
            ``(1, 2, ..., 2)`` (classic) or ``(2, ..., 2, 1)`` (residual).
        n_convs: convs per stage (classic) or sub-units per encoder residual unit (residual).
        kernel_size: conv kernel (odd): an int, a per-axis tuple such as ``(3, 3, 1)``, or a list of
            one per stage (``[[3, 3, 1], [3, 3, 3], ...]``); decoder stage i uses stage i's kernel.
        norm: "batch", "instance", "group" or "none".
        act: "relu", "leakyrelu", "prelu", "relu6", "gelu".
        act_slope: leakyrelu negative slope.
        norm_groups: groups for group norm.
        norm_eps: every norm's epsilon (1e-5, torch's; ``unet3d-nonewnet``: 1e-6, seed 000's).
        bias: conv bias; ``None`` = only where no norm follows.
        down: "maxpool" (pool, then stride-1 convs) or "stride" (the stage's first conv is strided).
        up: "transpose" (transposed conv), "shuffle" (the same transposed conv computed as a 1x1 conv
            + pixel shuffle, :class:`~fastvision.models.layers.ShuffleUp`; ``up_kernel`` 2 only) or
            "interp" ((bi/tri)linear resize + conv).
        up_kernel: transposed-conv kernel (2 for the classic 2x2x2 stride-2 up-conv, 3 in MONAI).
        head_kernel: kernel of the classic output conv (1 or 3); unused when ``residual``.
        dropout: dropout probability after each norm (0 disables it).
        residual: use the residual layout described in the module docstring.
        init: "default" (PyTorch), "xavier" (Glorot uniform weights, zero bias, as seed 000) or "he"
            (nnU-Net's ``InitWeights_He(1e-2)``: Kaiming-normal weights for leaky-ReLU 0.01, zero bias), or
            "he_heads" (PyTorch's in the body, He on the logit heads only; classic layout).
        drop_bias: after initialisation, remove the bias of every conv that a batch or instance norm
            follows (the norm cancels it: same outputs up to rounding; MLPerf's convs have none).
        pad_in: the first stage's convs read the image zero-padded to a multiple of ``pad_in`` channels
            (1 -> 8: tensor-core kernels; same outputs up to rounding, same parameters;
            :mod:`~fastvision.models.pad_in`). ``None``: off.
        deep_supervision: in training, also return logits of the lower decoder scales (nnU-Net): a
            list, full resolution first, one 1x1 head per lower decoder stage i > 0 (1/2^i of the input
            with the default strides; it reads ``filters[i]`` channels in the classic layout,
            ``filters[i - 1]`` in the residual one); eval returns the full-resolution logits
            only, which the heads do not touch. Needs at least two decoder stages.

    Shapes:
        (B, C_in, *S) -> (B, out_channels, *S); each size in S must be divisible by the product of the
        strides along its axis (``divisor``).
    """

    # train.activation_checkpointing: true checkpoints each encoder and decoder stage
    checkpoint_blocks = ("encoders.*", "decoders.*")

    def __init__(
        self,
        spatial_dims: int = 2,
        in_channels: int = 1,
        out_channels: int = 2,
        filters: tuple[int, ...] = (32, 64, 128, 256, 512),
        *,
        strides: tuple[Size, ...] | None = None,
        n_convs: int = 2,
        kernel_size: Size | tuple[Size, ...] = 3,
        norm: NormName = "batch",
        act: ActName = "relu",
        act_slope: float = 0.01,
        norm_groups: int = 8,
        norm_eps: float = 1e-5,
        bias: bool | None = None,
        down: Literal["maxpool", "stride"] = "maxpool",
        up: Literal["transpose", "interp", "shuffle"] = "transpose",
        up_kernel: int = 2,
        head_kernel: int = 1,
        dropout: float = 0.0,
        residual: bool = False,
        init: str = "default",
        drop_bias: bool = False,
        deep_supervision: bool = False,
        pad_in: int | None = None,
    ):
        super().__init__()
        self.strides, self.kernels = stage_geometry(spatial_dims, filters, strides, kernel_size, residual)
        self.spatial_dims, self.filters, self.out_channels = spatial_dims, tuple(filters), out_channels
        self.divisor = tuple(math.prod(s[a] for s in self.strides) for a in range(spatial_dims))
        opts = dict(norm=norm, act=act, act_slope=act_slope, norm_groups=norm_groups, norm_eps=norm_eps, bias=bias,
                    dropout=dropout)
        parts = _Parts(spatial_dims, opts, n_convs, residual, down, up, up_kernel)
        depth, st, ks = len(filters) - 1, self.strides, self.kernels
        chans = (in_channels, *filters)
        self.encoders = nn.ModuleList(parts.encoder(chans[i], chans[i + 1], st[i], ks[i]) for i in range(depth + 1))
        self.ups = nn.ModuleList()
        self.decoders = nn.ModuleList()
        for i in range(depth):
            if residual:
                below = filters[i + 1] if i == depth - 1 else filters[i]
                cout = filters[i - 1] if i > 0 else out_channels
                self.ups.append(nn.Identity())
                self.decoders.append(nn.Sequential(
                    parts.resample(filters[i] + below, cout, st[i], ks[i]),
                    parts.block(cout, cout, 1, ks[i], subunits=1, last_conv_only=i == 0),
                ))
            else:
                self.ups.append(parts.resample(filters[i + 1], filters[i], st[i + 1], ks[i]))
                self.decoders.append(parts.block(2 * filters[i], filters[i], 1, ks[i]))
        self.head: nn.Module = (
            nn.Identity() if residual
            else conv(spatial_dims)(filters[0], out_channels, head_kernel, padding=(head_kernel - 1) // 2)
        )
        self.ds_heads = _ds_heads(spatial_dims, filters, out_channels, residual) if deep_supervision else None
        _init_weights(self, init)
        if drop_bias:
            drop_bias_before_norm(self)
        pad_input_convs(self, "encoders.0", check_pad_in(pad_in))

    def forward(self, x: Tensor) -> Tensor:
        """Logits (B, out_channels, *S) for images (B, C_in, *S)."""
        if any(s % d for s, d in zip(x.shape[2:], self.divisor, strict=True)):
            raise ValueError(f"U-Net input sizes {tuple(x.shape[2:])} must be divisible by {self.divisor}")
        skips = []
        for enc in self.encoders[:-1]:
            x = enc(x)
            skips.append(x)
        x = self.encoders[-1](x)
        low = []  # deep supervision: logits of decoder stages 1.. (training only)
        for i in reversed(range(len(self.decoders))):
            x = self.decoders[i](torch.cat([skips[i], self.ups[i](x)], dim=1))
            if self.ds_heads is not None and self.training and i > 0:
                low.append(self.ds_heads[i - 1](x))
        return [self.head(x), *low[::-1]] if low else self.head(x)


def _ds_heads(spatial_dims: int, filters: Sequence[int], out_channels: int, residual: bool) -> nn.ModuleList:
    """1x1 logit heads of decoder stages 1 .. depth - 1 (stage 0 makes the model's own logits).

    Decoder stage i outputs ``filters[i]`` channels in the classic layout; in the residual layout its
    up-sampling maps to ``filters[i - 1]`` channels (the width the stage above concatenates), so the
    head reads those."""
    from fastvision.errors import ConfigError

    if len(filters) < 3:
        raise ConfigError(f"model.args.deep_supervision needs at least two decoder scales; filters {list(filters)} "
                          "give one")
    width = (lambda i: filters[i - 1]) if residual else (lambda i: filters[i])
    return nn.ModuleList(conv(spatial_dims)(width(i), out_channels, 1) for i in range(1, len(filters) - 1))


# the generic U-Net: the class is its own builder, its signature the recipe schema
unet = MODELS.register("unet")(UNet)


def _with_dims(spatial_dims: int):
    """``unet`` with ``spatial_dims`` fixed; signature (the recipe schema) is ``unet``'s minus that key."""

    def build(**kw) -> UNet:
        return unet(spatial_dims=spatial_dims, **kw)

    sig = inspect.signature(UNet)
    build.__signature__ = sig.replace(parameters=[p.replace(kind=p.KEYWORD_ONLY) for p in sig.parameters.values()
                                                  if p.name != "spatial_dims"])
    build.__annotations__ = {k: v for k, v in UNet.__init__.__annotations__.items() if k != "spatial_dims"}
    build.__doc__ = f"{spatial_dims}-D U-Net with every option of ``unet``."
    return build


unet2d = MODELS.register("unet2d")(_with_dims(2))
unet3d = MODELS.register("unet3d")(_with_dims(3))


@MODELS.register("unet2d-seed001")
def unet2d_seed001(
    *, in_channels: int = 1, out_channels: int = 1, filters: tuple[int, ...] = (8, 16, 32, 64, 128),
    dropout: float = 0.0, up: Literal["transpose", "shuffle"] = "transpose", drop_bias: bool = False,
    pad_in: int | None = None,
) -> UNet:
    """Seed 001's 2-D U-Net: (conv3x3 + bias + BN + ReLU) x2, 2x2 max-pool, 2x2 stride-2 up-conv, 1x1 head.

    ``up: shuffle``, ``drop_bias: true`` and ``pad_in: 8`` are speed levers with the same results up to rounding.
    """
    return UNet(2, in_channels, out_channels, filters, norm="batch", act="relu", bias=True, down="maxpool",
                up=up, up_kernel=2, head_kernel=1, dropout=dropout, drop_bias=drop_bias, pad_in=pad_in)


@MODELS.register("unet3d-nonewnet")
def unet3d_nonewnet(
    *, in_channels: int = 4, out_channels: int = 4, filters: tuple[int, ...] = (32, 64, 128, 256, 320, 320),
    norm: NormName = "instance", dropout: float = 0.0, up: Literal["transpose", "shuffle"] = "transpose",
    bias: bool | None = None, pad_in: int | None = None,
) -> UNet:
    """Seed 000's 3D U-Net (No New-Net): stride-2 conv down, 2^3 up-conv, InstanceNorm, LeakyReLU 0.01, 3^3 head.

    Convs before a norm have no bias (``bias: true`` adds them, for comparison); instance and group norm
    take the seed's epsilon 1e-6 (``tf.contrib.layers.instance_norm`` / ``group_norm``), group norm 16
    groups as in the seed. ``norm: instance_cl``, ``up: shuffle`` and ``pad_in: 8`` are speed levers (docs/gpu.md).
    """
    return UNet(3, in_channels, out_channels, filters, norm=norm, act="leakyrelu", act_slope=0.01, norm_groups=16,
                norm_eps=1e-3 if norm == "batch" else 1e-6,  # keras' BatchNormalization; TF contrib's norms
                bias=bias, down="stride", up=up, up_kernel=2, head_kernel=3, dropout=dropout, init="xavier",
                pad_in=pad_in)


@MODELS.register("unet3d-spleen")
def unet3d_spleen(
    *, in_channels: int = 1, out_channels: int = 2, filters: tuple[int, ...] = (32, 64, 128, 256, 512),
    n_convs: int = 2, norm: NormName = "batch", act: ActName = "prelu", dropout: float = 0.2, drop_bias: bool = False,
    deep_supervision: bool = False, pad_in: int | None = None,
) -> UNet:
    """MONAI fast-training spleen net: ``UNet(3, 1, 2, (32..512), strides 2, num_res_units=2, BATCH, 0.2)``.

    ``deep_supervision: true`` adds nnU-Net-style 1x1 logit heads on the lower decoder stages (training
    returns ``[full, 1/2, 1/4, ...]``; MONAI's net has none; the full-resolution logits are unchanged)."""
    return UNet(3, in_channels, out_channels, filters, n_convs=n_convs, norm=norm, act=act, bias=True,
                down="stride", up="transpose", up_kernel=3, dropout=dropout, residual=True, drop_bias=drop_bias,
                deep_supervision=deep_supervision, pad_in=pad_in)
