"""``model.args.pad_in``: the input convolution reads its image with zero channels appended, up to a
multiple of ``pad_in`` (a GPU speed lever, issue 40; docs/gpu.md, "Model levers").

Tensor-core convolution kernels want a channel count that is a multiple of 4 or 8. A model's first
convolution reads the image: 1 channel (microscopy, CT), 3 (RGB) or 4 (BraTS), so cuDNN may pick a slow
kernel for the one layer that runs at full resolution. MLPerf's ResNet-50 feeds its stem 4 channels
(RGB + a zero channel); the seed-001 U-Net's 1 -> 8 channel first conv is the case
``../shared/reference/gpu_levers.md`` names. Zero channels against zero weights add nothing to a
convolution's sums, so the outputs are the stock layer's up to float rounding and the real weights get
the same gradients (tests/models/test_levers.py). The parameters keep their shapes and state-dict keys:
the padding is made in each forward (one small copy of the input and of the weight; under
``train.compile`` inductor fuses it), so a checkpoint loads with the lever on or off.

Typical use::

    pad_input_convs(model, "conv1", 4)      # ResNet's stem: 3 -> 4 channels
    pad_input_convs(model, "encoders.0", 8) # every conv of a U-Net's first stage that reads the image
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastvision.errors import ConfigError


def padded_channels(channels: int, multiple: int) -> int:
    """``channels`` rounded up to a multiple of ``multiple``."""
    return -(-channels // multiple) * multiple


def check_pad_in(value: object) -> int | None:
    """``model.args.pad_in`` as an int >= 1, or None (off); a one-line error otherwise."""
    if value is None or value is False or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"model.args.pad_in: expected null or a channel multiple >= 1 (e.g. 4 or 8), got {value!r}")
    return value


def _pad_channels(t: Tensor, extra: int) -> Tensor:
    """``t`` (N, C, *S) with ``extra`` zero channels appended, keeping its memory format."""
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, extra))


class _PadIn:
    """Mixin over ``nn.ConvNd``: the input and the weight padded with zero channels to ``padded``."""

    padded: int

    def _conv_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        extra = self.padded - x.shape[1]
        if extra > 0:
            x, weight = _pad_channels(x, extra), _pad_channels(weight, extra)
        return super()._conv_forward(x, weight, bias)  # type: ignore[misc]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, pad_in_to={self.padded}"  # type: ignore[misc]


class PadInConv2d(_PadIn, nn.Conv2d):
    """``nn.Conv2d`` whose input is zero-padded to ``padded`` channels (same parameters)."""


class PadInConv3d(_PadIn, nn.Conv3d):
    """``nn.Conv3d`` whose input is zero-padded to ``padded`` channels (same parameters)."""


def pad_input_convs(model: nn.Module, where: str, multiple: int | None) -> int:
    """Make the convs that read ``model``'s image pad it to a multiple of ``multiple`` channels.

    ``where``: the dotted name of the conv, or of the block the image enters; there, every conv that
    receives the block's input itself pads (a residual unit's main and skip convs both do), found by
    one small forward of the block in eval mode. Each conv keeps its ``weight`` and ``bias`` (the same
    tensors). Returns how many convs now pad (0 when ``multiple`` is None or already a multiple)."""
    if multiple is None:
        return 0
    root = model.get_submodule(where)
    if isinstance(root, nn.modules.conv._ConvNd):
        return int(_pad_one(model, where, multiple))
    return sum(_pad_one(model, f"{where}.{n}" if n else where, multiple) for n in _convs_reading_input(root))


def _convs_reading_input(block: nn.Module) -> list[str]:
    """Names (within ``block``) of the convs whose input is ``block``'s own input tensor."""
    convs = {m: n for n, m in block.named_modules() if isinstance(m, nn.modules.conv._ConvNd) and not m.transposed}
    first = next(iter(convs))
    x = torch.zeros(1, first.in_channels, *(2 * k * s for k, s in zip(first.kernel_size, first.stride, strict=True)),
                    device=first.weight.device, dtype=first.weight.dtype)
    found: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda m, args: found.append(convs[m]) if args[0] is x else None)
             for m in convs]
    modes = {m: m.training for m in block.modules()}
    try:
        with torch.no_grad():
            block.eval()(x)
    finally:
        for h in hooks:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    return found


def _pad_one(model: nn.Module, name: str, multiple: int) -> bool:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr)
    if isinstance(old, _PadIn):  # padded already: only the multiple may change
        target = padded_channels(old.in_channels, multiple)
        changed, old.padded = old.padded != target, target
        return changed
    cls = {nn.Conv2d: PadInConv2d, nn.Conv3d: PadInConv3d}.get(type(old))
    if cls is None or old.groups != 1 or old.padding_mode != "zeros":
        groups = getattr(old, "groups", "?")
        raise ConfigError(f"model.args.pad_in: {name} is a {type(old).__name__} (groups {groups}); only an "
                          "ungrouped, zero-padded Conv2d / Conv3d can pad its input")
    target = padded_channels(old.in_channels, multiple)
    if target == old.in_channels:
        return False
    with torch.device("meta"):  # the shell only: its parameters are replaced by the old conv's
        new = cls(old.in_channels, old.out_channels, old.kernel_size, old.stride, old.padding, old.dilation,
                  bias=old.bias is not None)
    new.weight, new.bias = old.weight, old.bias
    new.padded = target
    new.train(old.training)
    setattr(parent, attr, new)
    return True
