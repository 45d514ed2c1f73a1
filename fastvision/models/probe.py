"""``probe``: a two-layer test model whose forward can be told to produce NaN (train.on_nonfinite's tests).

Not for training anything: BatchNorm on the input (so its running statistics are a hand-computable
function of the batches) and a 1x1 convolution to the class logits. ``nonfinite_steps`` lists the
training-mode forward calls, counted from 1 by the model itself (on the host: no sync), whose input
is replaced by NaN before the BatchNorm, as a corrupt batch or an overflow would: the loss, the
gradients and the running statistics of that call are all non-finite. The count is not part of the
state dict, so a rollback does not replay it.
"""
from __future__ import annotations

import torch
from torch import nn

from fastvision.models import layers
from fastvision.registry import MODELS


class Probe(nn.Module):
    def __init__(self, spatial_dims: int, in_channels: int, out_channels: int, nonfinite_steps: list[int]):
        super().__init__()
        self.norm = layers.norm("batch", spatial_dims, in_channels)
        self.head = layers.conv(spatial_dims)(in_channels, out_channels, kernel_size=1)
        self.nonfinite_steps = set(nonfinite_steps)
        self.calls = 0  # training-mode forward calls so far

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls in self.nonfinite_steps:
                x = torch.full_like(x, float("nan"))
        return self.head(self.norm(x))


@MODELS.register("probe", hidden=True)  # not in list_models(): a test model
def probe(spatial_dims: int = 2, in_channels: int = 1, out_channels: int = 2,
          nonfinite_steps: list[int] = ()) -> Probe:
    """A test model (see the module doc): ``nonfinite_steps``: training forward calls, from 1, made NaN."""
    return Probe(spatial_dims, in_channels, out_channels, list(nonfinite_steps))
