"""Activation checkpointing (fastvision.models.checkpointing) on every model family.

Reference: the same model without checkpointing, from the same weights and RNG state: the loss,
every gradient and the BatchNorm running statistics after one step must be equal (fp32, atol
1e-6), while the bytes autograd keeps for the backward (counted by a saved-tensors hook, each
storage once) must drop.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from fastvision.errors import ConfigError
from fastvision.models import create_model
from fastvision.models.checkpointing import (
    apply_activation_checkpointing,
    default_blocks,
    is_checkpointed,
)
from fastvision.models.resnet import BasicBlock, ResNet
from fastvision.models.ssd import SSD
from tests.conftest import free_port

# builder, kwargs, input shape: tiny members of each family (BN, dropout, PReLU, instance and
# group norm, residual and classic U-Net layouts, SSD holding a ResNet backbone)
FAMILIES = {
    "unet2d": ("unet2d-seed001", dict(filters=(4, 8, 16), dropout=0.1), (2, 1, 16, 16)),
    "unet3d-residual": ("unet3d-spleen", dict(filters=(4, 8, 16)), (2, 1, 8, 8, 8)),
    "unet3d-classic": ("unet3d-nonewnet", dict(filters=(4, 8, 16), in_channels=2, out_channels=3), (1, 2, 8, 8, 8)),
    "segresnet": ("segresnet", dict(init_filters=8, blocks_down=(1, 2, 2), blocks_up=(1, 1), in_channels=2),
                  (2, 2, 8, 8, 8)),
    "resnet": (lambda: _resnet(3), {}, (2, 3, 32, 32)),
    "ssd": (lambda: SSD(_resnet(0), num_classes=2, depth=8, head_layers=1), {}, (2, 3, 64, 64)),
}


def _resnet(num_classes: int) -> ResNet:
    """The ResNet family at one block per stage (the registered depths only add blocks)."""
    return ResNet(BasicBlock, (1, 1, 1, 1), num_classes=num_classes, zero_init_residual=False)

def _loss(out) -> torch.Tensor:
    """A scalar that weighs every output element differently (gradients differ per element)."""
    outs = [out["cls_logits"], out["box_codes"]] if isinstance(out, dict) else [out]
    total = 0
    for o in outs:
        w = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape)
        total = total + (o * w).sum() + 0.1 * o.square().mean()
    return total


class SavedBytes:
    """Bytes of distinct storages autograd saves for the backward (saved_tensors_hooks), weights
    excluded: activation memory."""

    def __init__(self, model: nn.Module):
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in self.weights:
            self.storages[st.data_ptr()] = st.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _step(model: nn.Module, x: torch.Tensor, seed: int = 7, count: bool = True):
    """Forward (under the counting hook, unless ``count`` is False) and backward from a fixed RNG state
    (dropout). A compiled model runs without the hook: torch < 2.5 traces into it (``data_ptr`` of a fake
    tensor)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    saved = SavedBytes(model)
    with (torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t) if count else contextlib.nullcontext()):
        loss = _loss(model(x))
    loss.backward()
    return loss.detach(), saved.total


def _pair(name, kwargs: dict, spec=True) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = (create_model(name, **kwargs) if isinstance(name, str) else name()).train()
    ckpt = copy.deepcopy(plain)
    assert apply_activation_checkpointing(ckpt, spec)
    return plain, ckpt


@pytest.mark.parametrize("family", list(FAMILIES))
def test_same_loss_gradients_and_running_stats_with_less_saved_memory(family):
    name, kwargs, shape = FAMILIES[family]
    plain, ckpt = _pair(name, kwargs)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    loss_a, saved_a = _step(plain, x)
    loss_b, saved_b = _step(ckpt, x)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=0)
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for n, p in ckpt.named_parameters():
        assert (p.grad is None) == (grads[n] is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[n], atol=1e-6, rtol=0, msg=n)
    # the recompute must not move BatchNorm statistics a second time
    for (n, a), b in zip(plain.named_buffers(), ckpt.buffers(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=n)
    assert saved_b < 0.75 * saved_a, (saved_b, saved_a)


def test_the_state_dict_and_evaluation_are_unchanged():
    plain, ckpt = _pair(*FAMILIES["resnet"][:2])
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ckpt.eval()(x), plain.eval()(x), atol=0, rtol=0)


def test_deepcopy_binds_the_copy_and_reapplying_unwraps():
    _, ckpt = _pair(*FAMILIES["resnet"][:2])
    twin = copy.deepcopy(ckpt)  # what an EMA copy does
    assert twin.layer1[0].forward.__self__ is twin.layer1[0]
    assert apply_activation_checkpointing(ckpt, ["layer4", "layer2.0"]) == ["layer4.0", "layer2.0"]
    assert [n for n, m in ckpt.named_modules() if is_checkpointed(m)] == ["layer2.0", "layer4.0"]
    assert apply_activation_checkpointing(ckpt, False) == []
    assert not any(is_checkpointed(m) for m in ckpt.modules())


def test_names_select_blocks_or_groups_and_unknown_names_list_the_valid_ones():
    model = SSD(ResNet(BasicBlock, (1, 2, 2, 1), num_classes=0), num_classes=2, depth=8, head_layers=1)
    assert default_blocks(model)[:2] == ["backbone.layer1.0", "backbone.layer2.0"]
    assert apply_activation_checkpointing(model, ["backbone.layer3", "backbone.layer2.1"]) == \
        ["backbone.layer3.0", "backbone.layer3.1", "backbone.layer2.1"]
    with pytest.raises(ConfigError, match=r"train.activation_checkpointing: unknown block 'layer3'.*backbone.layer3"):
        apply_activation_checkpointing(model, ["layer3"])
    with pytest.raises(ConfigError, match="declares no checkpointable blocks"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), True)


@pytest.mark.parametrize("amp", ["bf16"])
def test_autocast_recompute_matches(amp):
    """The recompute runs under the forward's autocast state: same low-precision loss and grads."""
    plain, ckpt = _pair("unet2d-seed001", dict(filters=(4, 8, 16)))
    x = torch.randn(2, 1, 16, 16)
    out = []
    for m in (plain, ckpt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out.append(_step(m, x)[0])
    torch.testing.assert_close(out[1], out[0], atol=0, rtol=0)
    for a, b in zip(plain.parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=0)


def test_under_ddp_gradients_match():
    """One-process gloo DDP over the checkpointed model: the reducer's hooks see every gradient."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    plain, ckpt = _pair(*FAMILIES["unet2d"][:2])
    x = torch.randn(2, 1, 16, 16)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        _step(plain, x)
        _step(DDP(ckpt), x)
    finally:
        if started:
            dist.destroy_process_group()
    for a, b in zip(plain.parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_under_torch_compile_gradients_match():
    """torch.compile traces the checkpoint (aot_eager: dynamo + AOT autograd, no C++ compiler). Before torch 2.5
    the compiled recompute moves BatchNorm's statistics twice (checked on 2.4.1): train.compile refuses it there."""
    from fastvision.optim.torch_private import torch_version

    if torch_version() < (2, 5):
        pytest.skip(f"torch {torch.__version__}: refused by train.compile (test_compile_refuses_..._before_2_5)")
    plain, ckpt = _pair("unet2d-seed001", dict(filters=(4, 8, 16)))
    x = torch.randn(2, 1, 16, 16)
    _step(plain, x)
    compiled = torch.compile(ckpt, backend="aot_eager", fullgraph=True)
    _step(compiled, x, count=False)
    for a, b in zip(plain.parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5)
    for a, b in zip(plain.buffers(), ckpt.buffers(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


def test_compile_refuses_checkpointed_batchnorm_before_2_5():
    """What maybe_compile checks (compile_conflict), by version: the U-Net's checkpointed blocks hold BatchNorm."""
    from fastvision.engine.runtime import maybe_compile
    from fastvision.models.checkpointing import compile_conflict
    from fastvision.optim.torch_private import torch_version

    plain, ckpt = _pair("unet2d-seed001", dict(filters=(4, 8, 16)))
    why = compile_conflict(ckpt, (2, 4))
    assert why.startswith("train.compile with train.activation_checkpointing on torch 2.4: before 2.5")
    assert compile_conflict(ckpt, (2, 5)) is None and compile_conflict(plain, (2, 4)) is None
    if torch_version() < (2, 5):  # the running torch: true refuses with that line, auto stays eager
        with pytest.raises(ConfigError, match="before 2.5"):
            maybe_compile(ckpt, True)
        assert maybe_compile(ckpt, "auto") is ckpt
