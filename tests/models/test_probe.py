"""The test model ``probe``: shapes, gradients, and NaN exactly at the listed training forward calls."""
from __future__ import annotations

import pytest
import torch

from fastvision.models import create_model


@pytest.mark.parametrize("dims", [2, 3])
def test_probe_is_nan_at_the_listed_training_calls_only(dims):
    model = create_model("probe", spatial_dims=dims, in_channels=2, out_channels=3, nonfinite_steps=[2])
    x = torch.rand(2, 2, *(4,) * dims, requires_grad=True)
    first = model(x)  # call 1: finite
    assert first.shape == (2, 3, *(4,) * dims) and torch.isfinite(first).all()
    first.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert torch.isnan(model(x)).all()  # call 2 (its NaN also reached the running statistics: the
    assert torch.isfinite(model(x)).all()  # call 3   engine's step puts them back, not the model)
    fresh = create_model("probe", spatial_dims=dims, in_channels=2, out_channels=3, nonfinite_steps=[1]).eval()
    assert torch.isfinite(fresh(x)).all() and fresh.calls == 0  # evaluation calls are not counted
