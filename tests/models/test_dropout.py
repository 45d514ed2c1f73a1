"""fastvision's CPU dropout (models/dropout.py) against the Bernoulli law it claims, computed by hand: the drop
rate of every 16-bit lane, the scale of what is kept, the gradient, the seed, and torch's own dropout wherever
the fast mask does not apply."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fastvision.models import create_model, layers
from fastvision.models.dropout import Dropout, cpu_mask

N = 1 << 20  # elements per draw: the drop rate's standard deviation is about 4e-4 at p = 0.2


def _p_eff(p: float) -> float:
    return round(p * 65536) / 65536  # by hand: 0.2 -> 13107 / 65536


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5, 0.9])
def test_each_lane_drops_at_the_rounded_rate_and_keeps_the_rest_scaled(p):
    torch.manual_seed(1)
    x = torch.rand(N) + 0.5  # no zeros: a zero in the output is a dropped element
    d = Dropout(p).train()
    y = d(x)
    q = _p_eff(p)
    dropped = y == 0
    # each of the four 16-bit lanes of a 64-bit draw separately (elements i, i + 4, ...): a lane whose bits
    # were not uniform (the sign bit of torch's default int64 range is always 0) would drop at 0 or at 2p
    sd = math.sqrt(q * (1 - q) / (N / 4))
    for lane in range(4):
        assert abs(dropped[lane::4].double().mean().item() - q) < 5 * sd, lane
    kept = ~dropped
    torch.testing.assert_close(y[kept], x[kept] * (65536 / (65536 - round(p * 65536))), rtol=1e-6, atol=0)


def test_the_output_is_unbiased_and_the_gradient_is_the_mask():
    torch.manual_seed(2)
    x = torch.ones(N, requires_grad=True)
    y = Dropout(0.2).train()(x)
    q = _p_eff(0.2)
    # E[y] = 1 for x = 1: the kept share times the scale; its standard deviation is sqrt(q / (1 - q) / N)
    assert abs(y.mean().item() - 1) < 5 * math.sqrt(q / (1 - q) / N)
    g = torch.randn(N)
    y.backward(g)
    assert torch.equal(x.grad, g * y.detach())  # y = x * mask with x = 1: y is the mask itself


def test_same_seed_same_mask_from_torchs_default_generator():
    torch.manual_seed(3)
    a = cpu_mask(torch.Size([5, 7, 9]), 0.3, torch.float32)
    torch.manual_seed(3)
    b = cpu_mask(torch.Size([5, 7, 9]), 0.3, torch.float32)
    c = cpu_mask(torch.Size([5, 7, 9]), 0.3, torch.float32)  # the generator moved on
    assert torch.equal(a, b) and not torch.equal(a, c)
    gen = torch.Generator().manual_seed(3)
    assert torch.equal(cpu_mask(torch.Size([5, 7, 9]), 0.3, torch.float32, gen), a)  # the same law, any generator


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_the_mask_is_made_in_the_inputs_dtype(dtype):
    x = torch.randn(4, 8, 16, dtype=dtype)
    y = Dropout(0.25).train()(x)
    assert y.dtype == dtype
    kept = y != 0
    assert torch.equal(y[kept], x[kept] * torch.tensor(4 / 3, dtype=dtype))  # 0.25 * 2^16 = 16384 exactly


@pytest.mark.parametrize("kwargs, p", [({"inplace": True}, 0.2), ({}, 1.0), ({}, 1e-6)])
def test_torchs_dropout_where_the_mask_does_not_apply(kwargs, p):
    """In place, p = 1 and a p that rounds to 0 / 2^16 are nn.Dropout's own, draw for draw."""
    x = torch.randn(3, 4, 5)
    torch.manual_seed(4)
    ref = nn.Dropout(p, **kwargs).train()(x.clone())
    torch.manual_seed(4)
    assert torch.equal(Dropout(p, **kwargs).train()(x.clone()), ref)


def test_eval_is_the_identity_and_bad_p_is_refused():
    x = torch.randn(3, 4)
    assert torch.equal(Dropout(0.5).eval()(x), x)
    with pytest.raises(ValueError, match="0 / 65536|0/65536"):
        cpu_mask(torch.Size([3]), 1e-7, torch.float32)


def test_compile_traces_torchs_dropout_without_a_graph_break():
    m = nn.Sequential(nn.Linear(8, 8), Dropout(0.5)).train()
    compiled = torch.compile(m, backend="aot_eager_default_partitioner", fullgraph=True)
    y = compiled(torch.ones(64, 8))
    assert y.shape == (64, 8) and 0 < (y == 0).float().mean().item() < 1


def test_the_models_build_it():
    net = create_model("unet3d-spleen", filters=(4, 8), dropout=0.2)
    drops = [m for m in net.modules() if isinstance(m, nn.Dropout)]
    assert drops and all(isinstance(m, Dropout) for m in drops)
    assert isinstance(layers.dropout(0.1), Dropout) and isinstance(layers.dropout(0.1, 3), nn.Dropout3d)
