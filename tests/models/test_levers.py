"""The GPU levers built into the layer factories (issue 40), each against the stock op it replaces.

- ``norm: instance_cl`` (:class:`InstanceNormCL`) against ``nn.InstanceNorm{2,3}d``: outputs and
  gradients in fp32 (atol 1e-5, rtol 1e-5: the reductions differ only in summation order), the
  activation fused inside it, fp16 statistics that do not overflow, and a channels-last layout kept
  forward and backward: the real engine step of an NDHWC 3-D U-Net, profiled on this CPU, copies
  no activation where the stock norm copies every one.
- ``up: shuffle`` (:class:`ShuffleUp`) against ``nn.ConvTranspose{2,3}d`` with the same weights:
  outputs and gradients (atol 1e-5), the same initial draws, state dicts interchangeable, other
  kernels refused in one line naming the key.
- ``drop_bias_before_norm``: bias-free conv + norm against conv with bias + norm.
- ``pad_in``: the model whose first convs read the image zero-padded to 4 / 8 channels against the same
  model without (same draws, same state-dict keys, outputs and every gradient), in either layout.
- ``torch.compile`` (aot_eager_default_partitioner: dynamo + AOT autograd, no C++ compiler) traces all
  of them without a graph break and gives the eager gradients.
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from fastvision import config, engine
from fastvision.errors import ConfigError
from fastvision.models import create_model, layers, levers
from fastvision.models.pad_in import PadInConv2d, PadInConv3d, pad_input_convs
from fastvision.registry import MODELS

TOL = dict(atol=1e-5, rtol=1e-5)
CL = {2: torch.channels_last, 3: torch.channels_last_3d}


def _grads(module: nn.Module, x: torch.Tensor, g: torch.Tensor, act=lambda y: y):
    x = x.detach().clone().requires_grad_()
    y = act(module(x))
    y.backward(g)
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def _assert_same_forward_backward(ref: nn.Module, ours: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """Outputs, input gradients and every parameter's gradient of ``ours`` equal ``ref``'s (TOL);
    returns ``(y_ref, y_ours, input gradient of ours)``."""
    y0, gx0, gp0 = _grads(ref, x, g)
    y1, gx1, gp1 = _grads(ours, x, g)
    torch.testing.assert_close(y1, y0, **TOL)
    torch.testing.assert_close(gx1, gx0, **TOL)
    for name in gp0:
        torch.testing.assert_close(gp1[name], gp0[name], **TOL)
    return y0, y1, gx1


# ---------------------------------------------------------------------------------- instance_cl
@pytest.mark.parametrize("dims,affine,channels_last", [(3, True, True), (3, False, True), (2, True, False),
                                                        (2, False, True), (3, True, False)])
def test_instance_cl_matches_stock_instance_norm_forward_and_backward(dims, affine, channels_last):
    torch.manual_seed(0)
    ref = (nn.InstanceNorm2d, nn.InstanceNorm3d)[dims - 2](6, affine=affine)
    ours = layers.norm("instance_cl", dims, 6)
    if affine:  # random affine parameters; without: ours keeps its initial weight 1, bias 0
        with torch.no_grad():
            ref.weight.normal_(), ref.bias.normal_()
        ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 6, *(5, 6, 7)[:dims]) * 3 + 1.5
    g = torch.randn_like(x)
    if channels_last:
        x, g = x.to(memory_format=CL[dims]), g.to(memory_format=CL[dims])
    y0, y1, gx1 = _assert_same_forward_backward(ref, ours, x, g)
    if channels_last:  # the layout is kept both ways; the stock norm returns a contiguous tensor
        assert y1.is_contiguous(memory_format=CL[dims]) and not y1.is_contiguous()
        assert gx1.is_contiguous(memory_format=CL[dims])
        assert y0.is_contiguous() and not y0.is_contiguous(memory_format=CL[dims])


@pytest.mark.parametrize("act,fn", [("leakyrelu", lambda y: nn.functional.leaky_relu(y, 0.01)),
                                    ("relu", torch.relu)])
def test_conv_norm_act_fuses_the_activation_into_instance_cl(act, fn):
    torch.manual_seed(0)
    stock = layers.ConvNormAct(3, 3, 5, norm="instance", act=act)
    fused = layers.ConvNormAct(3, 3, 5, norm="instance_cl", act=act)
    assert not hasattr(fused, "act") and fused.norm.act == act  # the activation runs inside the norm
    assert fused.load_state_dict(stock.state_dict()) is not None  # same keys: checkpoints load either way
    x = torch.randn(2, 3, 6, 6, 6).to(memory_format=torch.channels_last_3d)
    g = torch.randn(2, 5, 6, 6, 6)
    y0, _, _ = _assert_same_forward_backward(stock, fused, x, g)
    torch.testing.assert_close(y0, fn(stock.norm(stock.conv(x))))  # the reference is conv -> norm -> act


def test_instance_cl_fp16_statistics_do_not_overflow():
    """Activations of std 1,000 have a variance of 1e6, above fp16's 65,504: the statistics come
    from fp32 reductions, so the fp16 output matches the fp32 reference to fp16 rounding."""
    x = torch.randn(2, 4, 6, 6, 6) * 1000
    x[0, 1] = 0.0  # a channel of zeros: variance 0, the gradient must stay finite
    g = torch.randn_like(x)
    xr, xh = x.clone().requires_grad_(), x.half().requires_grad_()
    ref = nn.functional.instance_norm(xr)
    y = layers.InstanceNormCL(4)(xh)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=1e-2)
    ref.backward(g), y.backward(g.half())
    assert torch.isfinite(xh.grad).all()
    torch.testing.assert_close(xh.grad.float() * 1000, xr.grad * 1000, atol=3e-2, rtol=2e-2)  # grads ~ 1e-3


def test_instance_cl_backward_against_finite_differences():
    """The norm's own backward (not autograd's) against torch's numerical Jacobian in float64, for the
    input, the weight and the bias, in both layouts, 2-D and 3-D."""
    from fastvision.models.instance_norm import _InstanceNorm

    torch.manual_seed(0)
    for shape, fmt in (((2, 3, 4, 5, 3), torch.channels_last_3d), ((2, 3, 4, 5, 3), torch.contiguous_format),
                       ((2, 3, 5, 4), torch.channels_last)):
        x = (torch.randn(*shape, dtype=torch.float64) * 2 + 1).to(memory_format=fmt).requires_grad_()
        w = torch.randn(3, dtype=torch.float64, requires_grad=True)
        b = torch.randn(3, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, w, b: _InstanceNorm.apply(x, w, b, 1e-5), (x, w, b))


def test_instance_cl_statistics_hold_for_a_large_mean():
    """Activations of mean 1,000 and std 1 (a one-pass E[x^2] - E[x]^2 in fp32 would lose the variance to
    cancellation): output and gradients match the float64 stock norm on the same fp32 values to fp32
    rounding, in NDHWC."""
    torch.manual_seed(0)
    x = (torch.randn(2, 4, 6, 7, 5) + 1000).to(memory_format=torch.channels_last_3d)
    g = torch.randn_like(x)
    ref = nn.InstanceNorm3d(4, affine=True).double()
    with torch.no_grad():
        ref.weight.normal_(), ref.bias.normal_()
    ours = layers.InstanceNormCL(4)
    ours.load_state_dict(ref.state_dict())
    y0, gx0, gp0 = _grads(ref, x.double(), g.double())  # the same fp32 values, computed in float64
    y1, gx1, gp1 = _grads(ours, x, g)
    # fp32's own rounding of a mean of 1,000 is 3e-5 of the std; a cancelled variance is off by O(1)
    torch.testing.assert_close(y1.double(), y0, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(gx1.double(), gx0, atol=1e-3, rtol=1e-3)
    for name in gp0:
        torch.testing.assert_close(gp1[name].double(), gp0[name].double(), atol=5e-3, rtol=1e-3)


def test_instance_cl_bf16_against_the_float64_norm():
    """A bf16 NDHWC input (as under ``train.amp: bf16``): output and input gradient in bf16, within
    bf16's rounding of the float64 stock norm's (statistics and gradient sums accumulate in fp32)."""
    torch.manual_seed(0)
    x = (torch.randn(2, 8, 12, 16, 16, dtype=torch.float64) * 3 + 2).to(memory_format=torch.channels_last_3d)
    g = torch.randn_like(x)
    ref = nn.InstanceNorm3d(8, affine=True).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5), ref.bias.normal_()
    ours = layers.InstanceNormCL(8)
    ours.load_state_dict(ref.state_dict())
    y0, gx0, gp0 = _grads(ref, x, g)
    y1, gx1, gp1 = _grads(ours, x.bfloat16(), g.bfloat16())
    assert y1.dtype == gx1.dtype == torch.bfloat16 and gx1.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(y1.double(), y0, atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(gx1.double(), gx0, atol=3e-2, rtol=2e-2)
    for name in gp0:  # sums of 3,072 voxels x 2 samples: fp32 accumulation of bf16 products
        torch.testing.assert_close(gp1[name].double(), gp0[name].double(), atol=1.0, rtol=1e-2)


def _activation_copies(norm: str) -> collections.Counter:
    """Copies of hidden activations (batch 2; 6, 12, 24 or 48 channels) in one profiled engine step
    of an NDHWC 3-D U-Net (unet3d-brats, filters 6-12-24 so the 4-channel input and logits are told
    apart), counted by where they come from: ``conv`` when a convolution op (forward or backward)
    made them, else ``other`` (the norm: ``aten::instance_norm`` and its backward)."""
    from torch.profiler import ProfilerActivity, profile

    sets = ["task.args.sample_shape=[4,16,16,16]", "model.args.filters=[6,12,24]", f"model.args.norm={norm}",
            "model.args.up=shuffle", "train.channels_last=true", "train.device=cpu", "train.amp=off",
            "train.batch_size=2", "data.augment={}"]
    run = engine.build(config.load("unet3d-brats", [config.parse_override(s) for s in sets]), {}, train=True,
                       loaders=False)
    batch = run.task.synthetic_batch(2, run.device)
    batches = iter(lambda: batch, None)
    engine.train_step(run.step, batches)  # warm-up
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        engine.train_step(run.step, batches)
    copies = collections.Counter()
    for e in prof.events():
        shape = tuple(e.input_shapes[0]) if e.input_shapes and e.input_shapes[0] else ()
        if e.name in ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy") and len(shape) == 5 \
                and shape[0] == 2 and shape[1] in (6, 12, 24, 48):
            parents, p = [], e.cpu_parent
            while p is not None:
                parents.append(p.name)
                p = p.cpu_parent
            conv = any(n in ("aten::_convolution", "aten::convolution_backward") for n in parents)
            copies["conv" if conv else "other"] += 1
            copies["norm forward"] += "aten::instance_norm" in parents
    return copies


@pytest.mark.slow
def test_an_ndhwc_engine_step_with_instance_cl_copies_no_activation_in_the_norm():
    stock, kept = _activation_copies("instance"), _activation_copies("instance_cl")
    # the stock norm copies each of the 10 normalised activations to contiguous (forward and backward); the
    # convolutions then copy its contiguous outputs back to channels-last
    assert stock["norm forward"] >= 10 and stock["other"] >= 2 * stock["norm forward"]
    assert kept["other"] == 0 and kept["norm forward"] == 0  # forward and backward: the norm copies nothing
    # what is left comes from this CPU's convolution kernels (the 1x1 convs of up: shuffle on one
    # thread), far fewer than the stock norm makes them do
    assert kept["conv"] * 3 < stock["conv"]


# ---------------------------------------------------------------------------------- up: shuffle
@pytest.mark.parametrize("dims,stride,channels_last,bias", [(2, 2, False, True), (2, 2, True, True),
                                                             (3, 2, False, True), (3, 2, True, False),
                                                             (3, (2, 2, 1), True, True)])
def test_shuffle_up_equals_the_transposed_conv(dims, stride, channels_last, bias):
    torch.manual_seed(0)
    ref = layers.conv_transpose(dims)(6, 5, stride, stride, bias=bias)
    torch.manual_seed(0)
    ours = layers.ShuffleUp(dims, 6, 5, stride, stride, bias=bias)
    for a, b in zip(ref.state_dict().items(), ours.state_dict().items(), strict=True):
        assert a[0] == b[0] and torch.equal(a[1], b[1])  # same keys, shapes and initial draws
    x = torch.randn(2, 6, *(3, 4, 5)[:dims])
    f = layers.per_axis(stride, dims)
    g = torch.randn(2, 5, *(s * k for s, k in zip((3, 4, 5)[:dims], f, strict=True)))
    if channels_last:
        x, g = x.to(memory_format=CL[dims]), g.to(memory_format=CL[dims])
    _, y1, _ = _assert_same_forward_backward(ref, ours, x, g)
    assert y1.is_contiguous(memory_format=CL[dims]) if channels_last else y1.is_contiguous()


def test_shuffle_2d_is_a_1x1_conv_and_pixel_shuffle():
    """The 2-D case spelled out with torch's own pixel_shuffle: weight (C_in, C_out, 2, 2) -> a 1x1
    conv to C_out * 4 channels ordered (o, i, j), each bias repeated 4 times."""
    up = layers.ShuffleUp(2, 3, 4, 2, 2)
    x = torch.randn(2, 3, 5, 6)
    w = up.weight.permute(1, 2, 3, 0).reshape(16, 3, 1, 1)
    expected = nn.functional.pixel_shuffle(nn.functional.conv2d(x, w, up.bias.repeat_interleave(4)), 2)
    torch.testing.assert_close(up(x), expected, **TOL)


@pytest.mark.parametrize("name,kw,shape", [("unet2d-seed001", dict(filters=(4, 8, 16)), (2, 1, 16, 16)),
                                           ("unet3d-nonewnet", dict(filters=(4, 8, 16), in_channels=2,
                                                                    out_channels=3), (2, 2, 8, 8, 8))])
def test_unet_up_shuffle_is_the_transposed_model(name, kw, shape):
    """Same seed, same initial weights (xavier for nonewnet included); outputs and gradients equal."""
    torch.manual_seed(0)
    ref = create_model(name, **kw)
    torch.manual_seed(0)
    ours = create_model(name, up="shuffle", **kw)
    assert any(isinstance(m, layers.ShuffleUp) for m in ours.modules())
    for (k0, v0), (k1, v1) in zip(ref.state_dict().items(), ours.state_dict().items(), strict=True):
        assert k0 == k1 and torch.equal(v0, v1), k0
    x, g = torch.randn(shape), torch.randn(shape[0], kw.get("out_channels", 1), *shape[2:])
    y0, gx0, gp0 = _grads(ref, x, g)
    y1, gx1, gp1 = _grads(ours, x, g)
    torch.testing.assert_close(y1, y0, **TOL)
    for n in gp0:
        torch.testing.assert_close(gp1[n], gp0[n], atol=1e-4, rtol=1e-4)


def test_up_shuffle_refuses_other_kernels_in_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"model\.args.*up='shuffle' needs the up-convolution's kernel") as e:
        MODELS.build("unet", {"spatial_dims": 2, "filters": [4, 8], "up": "shuffle", "up_kernel": 3},
                     where="model.args")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------- drop_bias
@pytest.mark.parametrize("norm", ["batch", "instance", "instance_cl"])
def test_bias_free_conv_and_norm_equal_conv_with_bias_and_norm(norm):
    """The norm subtracts each channel's mean, so a bias before it cancels (training mode; a large
    bias makes the test meaningful)."""
    torch.manual_seed(0)
    with_bias = layers.ConvNormAct(3, 3, 5, norm=norm, act="relu", bias=True)
    with torch.no_grad():
        with_bias.conv.bias.uniform_(-3, 3)
    without = layers.ConvNormAct(3, 3, 5, norm=norm, act="relu", bias=True)
    without.load_state_dict(with_bias.state_dict())
    assert layers.drop_bias_before_norm(without) == 1 and without.conv.bias is None
    x, g = torch.randn(2, 3, 6, 6, 6), torch.randn(2, 5, 6, 6, 6)
    y0, gx0, gp0 = _grads(with_bias, x, g)
    y1, gx1, gp1 = _grads(without, x, g)
    torch.testing.assert_close(y1, y0, **TOL)
    torch.testing.assert_close(gx1, gx0, **TOL)
    torch.testing.assert_close(gp1["conv.weight"], gp0["conv.weight"], **TOL)
    assert gp0["conv.bias"].abs().max() < 1e-4  # the bias had (up to rounding) no gradient to give


def test_drop_bias_leaves_group_norm_and_bare_convs_and_keeps_the_other_weights():
    torch.manual_seed(0)
    ref = create_model("unet2d-seed001", filters=(4, 8, 16))
    torch.manual_seed(0)
    ours = create_model("unet2d-seed001", filters=(4, 8, 16), drop_bias=True)
    dropped = set(ref.state_dict()) - set(ours.state_dict())
    assert dropped and all(k.endswith("conv.bias") for k in dropped)
    assert "head.bias" in ours.state_dict() and "ups.0.conv.bias" in ours.state_dict()  # no norm follows these
    for k, v in ours.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k  # the same draws as the model with biases
    assert layers.drop_bias_before_norm(layers.ConvNormAct(2, 8, 8, norm="group", bias=True)) == 0


# ---------------------------------------------------------------------------------- pad_in
@pytest.mark.parametrize("name,kw,shape,multiple,n_padded", [
    ("unet2d-seed001", dict(filters=(4, 8, 16)), (2, 1, 16, 16), 8, 1),      # 1 -> 8, the seed's first conv
    ("unet3d-nonewnet", dict(filters=(4, 8, 16), out_channels=3), (2, 4, 8, 8, 8), 8, 1),  # BraTS' 4 -> 8
    ("unet3d-spleen", dict(filters=(4, 8, 16), dropout=0.0), (2, 1, 8, 8, 8), 4, 2),  # main + skip conv
    ("resnet18", dict(num_classes=5), (2, 3, 32, 32), 4, 1),                 # MLPerf's RGB -> 4
])
@pytest.mark.parametrize("channels_last", [False, True])
def test_pad_in_is_the_same_model_up_to_rounding(name, kw, shape, multiple, n_padded, channels_last):
    """Zero channels against zero weights add nothing: the same outputs, input gradients and parameter
    gradients as the stock model, from the same draws and state-dict keys (checkpoints load either way).
    A residual first stage has two convs reading the image (its main path and its 1x1 skip): both pad."""
    torch.manual_seed(0)
    ref = create_model(name, **kw)
    torch.manual_seed(0)
    ours = create_model(name, pad_in=multiple, **kw)
    padded = [m for m in ours.modules() if isinstance(m, (PadInConv2d, PadInConv3d))]
    assert len(padded) == n_padded and all(m.padded == -(-shape[1] // multiple) * multiple for m in padded)
    assert all(m.weight.shape[1] == shape[1] for m in padded)  # the parameters keep their shapes
    for (k0, v0), (k1, v1) in zip(ref.state_dict().items(), ours.state_dict().items(), strict=True):
        assert k0 == k1 and torch.equal(v0, v1), k0
    x = torch.randn(shape)
    if channels_last:
        fmt = CL[len(shape) - 2]
        ref, ours, x = ref.to(memory_format=fmt), ours.to(memory_format=fmt), x.to(memory_format=fmt)
    ref.train(), ours.train()
    y = ref(x)
    g = torch.randn(y.shape)
    y0, gx0, gp0 = _grads(ref, x, g)
    y1, gx1, gp1 = _grads(ours, x, g)
    torch.testing.assert_close(y1, y0, **TOL)
    torch.testing.assert_close(gx1, gx0, **TOL)
    for n in gp0:
        torch.testing.assert_close(gp1[n], gp0[n], atol=1e-4, rtol=1e-4)
    if channels_last and len(shape) == 5:
        assert y1.is_contiguous(memory_format=torch.channels_last_3d)


def test_pad_in_pads_the_convolution_and_not_the_result(monkeypatch):
    """The padded conv's kernel really reads the padded channel count, and its output is the stock
    conv's on the real channels; a second call leaves an already padded conv alone."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, padding=1)
    model = nn.Sequential(conv)
    assert pad_input_convs(model, "0", 4) == 1 and pad_input_convs(model, "0", 4) == 0
    seen, stock = [], torch.nn.functional.conv2d
    monkeypatch.setattr(torch.nn.functional, "conv2d",
                        lambda x, w, *a: (seen.append((x.shape[1], w.shape[1])), stock(x, w, *a))[1])
    x = torch.randn(2, 3, 5, 5)
    y = model(x)
    assert seen == [(4, 4)]
    torch.testing.assert_close(y, stock(x, conv.weight, conv.bias, 1, 1), **TOL)


@pytest.mark.parametrize("bad", [-8, "8", True, 2.5])
def test_pad_in_refuses_a_bad_value_in_one_line_naming_the_key(bad):
    # the registry's type check (a str, bool or float) or pad_in's own (a negative int)
    bad_value = r"^model\.args\.pad_in: expected (int \| None|null or a channel multiple)"
    with pytest.raises(ConfigError, match=bad_value) as e:
        MODELS.build("unet2d-seed001", {"filters": [4, 8], "pad_in": bad}, where="model.args")
    assert "\n" not in str(e.value)


def test_pad_in_is_offered_where_the_image_channels_are_not_a_multiple():
    assert levers.levers("unet2d-seed001", {})["model.args.pad_in"] == (4, 8)
    assert levers.levers("unet3d-nonewnet", {"in_channels": 4})["model.args.pad_in"] == (8,)
    assert "model.args.pad_in" not in levers.levers("unet3d-nonewnet", {"in_channels": 8})
    assert "model.args.pad_in" not in levers.levers("unet2d-seed001", {"pad_in": 8})  # set already
    assert "model.args.pad_in" not in levers.levers("ssd320-small", {})  # its builder does not take it
    assert levers.current("resnet50", {}) == {"model.args.pad_in": None}


# ---------------------------------------------------------------------------------- compile
@pytest.mark.slow
def test_compile_traces_the_levers_without_a_graph_break():
    torch.manual_seed(0)
    eager = create_model("unet3d-nonewnet", filters=(4, 8), in_channels=1, out_channels=2, norm="instance_cl",
                         up="shuffle", pad_in=8).to(memory_format=torch.channels_last_3d)
    compiled_model = create_model("unet3d-nonewnet", filters=(4, 8), in_channels=1, out_channels=2,
                                  norm="instance_cl", up="shuffle", pad_in=8).to(memory_format=torch.channels_last_3d)
    compiled_model.load_state_dict(eager.state_dict())
    # dynamo + AOT autograd (the joint forward-backward graph), no C++ compiler; split by the default
    # partitioner rather than aot_eager's min-cut one, which imports Inductor's pattern matcher (2 s of
    # CPU) to choose what the backward recomputes: the same traced graph, the same gradients
    compiled = torch.compile(compiled_model, backend="aot_eager_default_partitioner", fullgraph=True)
    x = torch.randn(2, 1, 8, 8, 8).to(memory_format=torch.channels_last_3d)
    for m in (eager, compiled):
        m(x).square().mean().backward()
    torch.testing.assert_close(compiled(x), eager(x), **TOL)
    for a, b in zip(eager.parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, **TOL)


# ---------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_levers_on_cuda_match_the_stock_layers_under_autocast(dtype):
    """On the GPU the stock layers run cuDNN kernels: instance_cl and the shuffle up-conv against them
    under autocast, channels_last_3d in and out (tolerances of the low-precision output: 2e-2 fp16,
    6e-2 bf16, relative to values of order 1)."""
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.float16 else dict(atol=6e-2, rtol=6e-2)
    torch.manual_seed(0)
    stock = layers.ConvNormAct(3, 8, 16, norm="instance", act="leakyrelu").cuda()
    ours = layers.ConvNormAct(3, 8, 16, norm="instance_cl", act="leakyrelu").cuda()
    ours.load_state_dict(stock.state_dict())
    ref_up = layers.conv_transpose(3)(16, 8, 2, 2).cuda()
    up = layers.ShuffleUp(3, 16, 8, 2, 2).cuda()
    up.load_state_dict(ref_up.state_dict())
    x = (torch.randn(2, 8, 16, 16, 16, device="cuda") * 4).to(memory_format=torch.channels_last_3d)
    with torch.autocast("cuda", dtype=dtype):
        y0, y1 = stock(x), ours(x)
        z0, z1 = ref_up(y0), up(y1)
    assert y1.dtype == dtype and y1.is_contiguous(memory_format=torch.channels_last_3d)
    assert z1.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(y1.float(), y0.float(), **tol)
    torch.testing.assert_close(z1.float(), z0.float(), **tol)
    z1.float().square().mean().backward()
    assert torch.isfinite(ours.conv.weight.grad).all() and torch.isfinite(up.weight.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pad_in_on_cuda_matches_the_stock_first_conv_under_autocast(dtype):
    """The seed-001 first conv (1 -> 8 channels, NHWC) and ResNet's stem (3 -> 4) under autocast: the padded
    cuDNN kernel's output against the stock one's, and the real weights' gradient."""
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.float16 else dict(atol=6e-2, rtol=6e-2)
    for cin, cout, k, stride, multiple in ((1, 8, 3, 1, 8), (3, 64, 7, 2, 4)):
        torch.manual_seed(0)
        stock = nn.Conv2d(cin, cout, k, stride, k // 2).cuda().to(memory_format=torch.channels_last)
        ours = nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2)).cuda().to(memory_format=torch.channels_last)
        ours[0].load_state_dict(stock.state_dict())
        assert pad_input_convs(ours, "0", multiple) == 1
        x = torch.randn(4, cin, 96, 128, device="cuda").to(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=dtype):
            y0, y1 = stock(x), ours(x)
        assert y1.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(y1.float(), y0.float(), **tol)
        y0.float().square().mean().backward()
        y1.float().square().mean().backward()
        torch.testing.assert_close(ours[0].weight.grad, stock.weight.grad, atol=1e-2, rtol=5e-2)
