"""Deep supervision in the residual U-Net layout (``UNet(residual=True)``, ``unet3d-spleen``): a 1x1 head
per lower decoder stage, at the scale worked out by hand from the strides; eval returns the full logits
alone, which the heads do not touch (a deep-supervised checkpoint predicts as the same net without
heads); the loss's gradient reaches every head; too few decoder scales is one line naming the key."""
from __future__ import annotations

import pytest
import torch

from fastvision.errors import ConfigError
from fastvision.losses import DeepSupervisionLoss, DiceCELoss
from fastvision.models import create_model
from fastvision.models.unet import UNet


@pytest.mark.parametrize("dims, filters, strides, size, scales", [
    # decoder stage i (residual) outputs at the input size over strides[0] * ... * strides[i - 1]
    (3, (4, 8, 16, 32), ((2, 2, 1), 2, 2, 1), (16, 16, 8), [(16, 16, 8), (8, 8, 8), (4, 4, 4)]),
    (3, (4, 8, 16, 32, 64), None, (32, 32, 16), [(32, 32, 16), (16, 16, 8), (8, 8, 4), (4, 4, 2)]),
    (2, (4, 8, 16, 32, 64), None, (32, 48), [(32, 48), (16, 24), (8, 12), (4, 6)]),
    (2, (4, 8, 16), ((1, 2), 2, 1), (8, 16), [(8, 16), (8, 8)]),
])
def test_residual_outputs_every_decoder_scale_in_training(dims, filters, strides, size, scales):
    net = UNet(dims, 1, 3, filters, strides=strides, residual=True, deep_supervision=True)
    assert [h.in_channels for h in net.ds_heads] == list(filters[:len(filters) - 2])  # stage i reads filters[i-1]
    x = torch.randn(2, 1, *size)
    outs = net(x)
    assert [tuple(o.shape) for o in outs] == [(2, 3, *s) for s in scales]
    net.eval()
    assert torch.is_tensor(net(x)) and net(x).shape == (2, 3, *size)


def test_gradient_reaches_every_head():
    net = UNet(3, 1, 2, (4, 8, 16, 32, 64), residual=True, deep_supervision=True)
    outs = net(torch.randn(2, 1, 32, 32, 16))
    label = (torch.rand(2, 32, 32, 16) > 0.7).long()
    DeepSupervisionLoss(DiceCELoss(softmax=True, include_background=False))(outs, label).backward()
    assert all(p.grad is not None for p in net.parameters())
    grads = [float(h.weight.grad.abs().sum()) for h in net.ds_heads]  # nnU-Net weights 4/14, 2/14, then 0
    assert grads[0] > 0 and grads[1] > 0 and grads[2] == 0.0


def test_spleen_checkpoint_with_heads_predicts_as_the_net_without_them():
    """``predict`` rebuilds the model from the checkpoint's recipe (``deep_supervision: true``), so the
    state loads strictly, as for the classic layout; the heads never touch the full-resolution logits,
    so dropping them gives the same prediction."""
    kw = {"filters": (4, 8, 16, 32, 64)}
    torch.manual_seed(0)
    trained = create_model("unet3d-spleen", deep_supervision=True, **kw)
    trained(torch.randn(2, 1, 32, 32, 16))  # one training forward moves the BatchNorm statistics
    state = trained.state_dict()
    assert any(k.startswith("ds_heads.") for k in state)
    again = create_model("unet3d-spleen", deep_supervision=True, **kw)
    again.load_state_dict(state)  # strict
    plain = create_model("unet3d-spleen", **kw)
    plain.load_state_dict({k: v for k, v in state.items() if not k.startswith("ds_heads.")})
    x = torch.randn(1, 1, 32, 32, 32)
    want = plain.eval()(x)
    assert torch.equal(again.eval()(x), want) and torch.equal(trained.eval()(x), want)


@pytest.mark.parametrize("build", [
    lambda: UNet(3, 1, 2, (4, 8), strides=(2, 1), residual=True, deep_supervision=True),
    lambda: create_model("unet3d-spleen", filters=(4, 8), deep_supervision=True),
])
def test_one_decoder_scale_is_one_line_naming_the_key(build):
    with pytest.raises(ConfigError, match=r"model\.args\.deep_supervision.*two decoder scales") as e:
        build()
    assert "\n" not in str(e.value)
