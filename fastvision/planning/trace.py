"""Trace one training step without the device: live tensor memory by part, and FLOPs.

The recipe's model is built on the ``meta`` device and its weights become fake tensors of a
``FakeTensorMode`` (shape, dtype, strides and a storage size, no data), so a ResNet-50 step at batch 256 or a 3-D U-Net
at 128^3 traces in a second or two on any CPU. A ``TorchDispatchMode`` sees every aten op of the
step (forward, loss, backward, optimizer step) and keeps the bytes of every live storage: a
storage counts from the op that creates it until its last reference dies (a weak-reference
callback), which is how the CUDA caching allocator's ``memory_allocated`` moves, without the
rounding. FLOPs come from the same trace through torch's FLOP formulas
(``torch.utils.flop_counter.flop_registry``, what ``FlopCounterMode`` uses; the mode itself adds
module hooks that keep tensors alive and defeat activation checkpointing).

The optimizer state is made first (one optimizer step on zero gradients), so the traced step is
the steady-state one, as on step two and later of a run. Parts at the peak: parameters (and
buffers), gradients, optimizer state, the input batch, and activations (everything else: tensors
saved for backward and temporaries).

Mixed precision is emulated with CPU autocast at the recipe's dtype; CPU and CUDA autocast cast the
same op families (convolutions and matmuls low, reductions and losses fp32). Memory a kernel
allocates internally (cuDNN workspace, allocator rounding, CUDA context) is outside the trace: the
planner adds a workspace margin for it.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from fastvision.models.checkpointing import apply_activation_checkpointing

log = logging.getLogger(__name__)

# Ops whose saved outputs torch.compile (inductor's min-cut partitioner) usually recomputes in the
# backward instead of keeping: elementwise and normalisation outputs. Matmul/conv outputs stay.
_RECOMPUTABLE = ("relu", "gelu", "silu", "sigmoid", "tanh", "leaky_relu", "hardtanh", "elu", "add", "mul", "sub",
                 "div", "native_batch_norm", "_native_batch_norm_legit", "native_group_norm", "native_layer_norm",
                 "clamp", "_to_copy", "clone", "exp", "log", "neg", "pow", "where", "threshold", "dropout",
                 "native_dropout", "bernoulli", "rsqrt", "sqrt", "abs", "cat")


class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storages created under this mode, with the peak and what was live then.

    A storage is known by a serial number (addresses are reused once a storage dies).
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # storage address -> serial of the live storage there
        self.info: dict[int, tuple[int, str]] = {}  # serial -> (bytes, producing op)
        self._refs: dict[int, Any] = {}
        self.current = 0
        self.peak = 0
        self.peak_serials: list[int] = []
        self.allocated = 0  # bytes created over the trace (a proxy for memory traffic)
        self.saved: set[int] = set()  # serials of storages saved for backward
        self.flops = 0  # torch's FLOP formulas (matmul / conv family), as FlopCounterMode counts

    def track(self, t: torch.Tensor, op: str) -> int:
        st = t.untyped_storage()
        key = st._cdata  # one Python storage object per StorageImpl (PyObject preservation)
        if key in self.live:
            return self.live[key]
        n = st.nbytes()
        serial = len(self.info)
        self.info[serial] = (n, op)
        self.live[key] = serial
        self._refs[serial] = weakref.ref(st, functools.partial(self._free, key, serial))
        self.current += n
        self.allocated += n
        if self.current > self.peak:
            self.peak, self.peak_serials = self.current, list(self.live.values())
        return serial

    def _free(self, key: int, serial: int, _ref) -> None:
        if self.live.get(key) == serial:
            del self.live[key]
            self.current -= self.info[serial][0]
        self._refs.pop(serial, None)

    def serials(self, tensors) -> set[int]:
        """Serials of the (live) storages behind ``tensors``; untracked ones are skipped."""
        keys = (t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor))
        return {self.live[k] for k in keys if k in self.live}

    def reset_peak(self) -> None:
        self.peak, self.peak_serials = self.current, list(self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        name = func.overloadpacket.__name__
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t, name)
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks pack hook: remember which storages autograd keeps for backward."""
        self.saved |= self.serials([t])
        return t


@dataclass
class StepTrace:
    """One traced training step at a per-device batch (bytes and FLOPs per step)."""

    batch: int
    peak_bytes: int
    parameters: int
    gradients: int
    optimizer_state: int
    inputs: int
    activations: int
    recomputable: int  # activation bytes at the peak that torch.compile would likely recompute
    flops: int  # forward + backward + optimizer FLOPs of one step (matmul/conv family)
    forward_flops: int
    traffic_bytes: int  # bytes created by the step's ops (each written once, read at least once)
    grad_bytes: int  # bytes all-reduced per step by data parallelism
    param_count: int
    notes: list[str] = field(default_factory=list)


def autocast_ctx(amp: str | None) -> contextlib.AbstractContextManager:
    """CPU autocast at the recipe's dtype: the trace's stand-in for CUDA autocast.

    ``amp`` is the precision resolved for the planned GPU (``plan`` turns ``auto`` into fp16 or
    bf16 by the GPU's spec); its dtype comes from the runtime's one rule
    (:func:`fastvision.engine.runtime.autocast_dtype`) on the device the trace runs on, so an
    unresolved ``auto`` is fp32 as on any CPU. "fp32" / "tf32" (plan's precision names) and None
    are fp32.
    """
    from fastvision.engine.runtime import autocast_dtype

    dtype = None if amp in (None, "fp32", "tf32") else autocast_dtype(amp, torch.device("cpu"))
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


class _TracePrecision:
    """The trace's precision: CPU autocast at the recipe's dtype, no loss scaling (the fp16 scale is
    a scalar multiply and an in-place unscale, which move no memory)."""

    def __init__(self, amp: str):
        self.mode = "off"  # what the engine's step reads: no GradScaler to unscale or update
        self.amp = amp
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast_ctx(self.amp)


def traced_step(model: nn.Module, task, batch: dict, optimizer: torch.optim.Optimizer, amp: str,
                after_forward: Callable[[], None] = lambda: None,
                after_backward: Callable[[], None] = lambda: None) -> None:
    """One ``engine.train_step`` (the step ``train`` runs) on the traced model, on a step state
    made here; its phase clock calls the hooks between forward, backward and the optimizer step.
    The non-finite check is off: it reads a value back, which fake tensors do not have, and holds
    no memory."""
    from fastvision.engine.step import StepState, train_step

    state = StepState(task, model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                      _TracePrecision(amp), torch.device("cpu"), torch.Generator(), check_finite=False)
    hooks = {"backward": after_forward, "optimizer": after_backward}
    train_step(state, iter([batch]), lambda phase: hooks.get(phase, lambda: None)())


def trace_step(build: Callable[[], tuple[nn.Module, Any, Callable[[nn.Module], torch.optim.Optimizer]]],
               batch_size: int, amp: str = "off", channels_last: bool = False,
               activation_checkpointing: bool | list[str] = False) -> StepTrace:
    """Trace two training steps on fake tensors; returns memory parts at the peak and FLOPs.

    Args:
        build: returns ``(model, task, make_optimizer)``, the model on the ``meta`` device; its
            weights become fake CPU tensors here.
        batch_size: per-device batch.
        amp: "off", "fp16" or "bf16".
        channels_last: NHWC / NDHWC weights and input (the recipe's switch).
        activation_checkpointing: ``train.activation_checkpointing`` (false, true or block names),
            applied by the function the training build applies it with.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracker = LiveBytes()
    model, task, make_optimizer = build()  # parameters on the meta device: no memory, no init time
    if channels_last:
        from fastvision.engine.runtime import _memory_format

        model = model.to(memory_format=_memory_format(model))
    apply_activation_checkpointing(model, activation_checkpointing)
    model.train()
    with FakeTensorMode(allow_non_fake_inputs=True):  # real host constants (loss weights) are allowed
        fakeify(model)
        with tracker, torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
            return _trace(model, task, make_optimizer, tracker, batch_size, amp, channels_last)


def _trace(model, task, make_optimizer, tracker: LiveBytes, batch_size: int, amp: str,
           channels_last: bool) -> StepTrace:
    params = list(model.parameters()) + list(model.buffers())
    for t in params:
        tracker.track(t, "parameter")
    optimizer = make_optimizer(model)
    # the optimizer state of the steady-state step, made by one step on zero gradients (cheaper
    # to trace than a first forward and backward, and the same tensors)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    cpu = torch.device("cpu")
    batch = task.to_device(task.synthetic_batch(batch_size, cpu), cpu, channels_last)
    tracker.reset_peak()
    tracker.saved.clear()
    allocated_before, flops_before = tracker.allocated, tracker.flops
    seen: dict[str, Any] = {}

    def after_forward():
        seen["fwd_flops"] = tracker.flops - flops_before

    def after_backward():
        with_grad = [p for p in model.parameters() if p.grad is not None]
        seen["grads"] = tracker.serials(p.grad for p in with_grad)
        seen["grad_bytes"] = sum(p.grad.numel() * p.grad.element_size() for p in with_grad)

    traced_step(model, task, batch, optimizer, amp, after_forward, after_backward)
    flops = tracker.flops - flops_before
    fwd_flops, grads, grad_bytes = seen["fwd_flops"], seen["grads"], seen["grad_bytes"]
    traffic = tracker.allocated - allocated_before
    opt_keys = tracker.serials(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    param_keys, input_keys = tracker.serials(params), tracker.serials(batch.values())
    parts = {"parameters": 0, "gradients": 0, "optimizer_state": 0, "inputs": 0, "activations": 0}
    recomputable = 0
    for key in tracker.peak_serials:
        n, op = tracker.info[key]
        part = ("parameters" if key in param_keys else "gradients" if key in grads else
                "optimizer_state" if key in opt_keys else "inputs" if key in input_keys else "activations")
        parts[part] += n
        if part == "activations" and key in tracker.saved and op in _RECOMPUTABLE:
            recomputable += n
    return StepTrace(batch=batch_size, peak_bytes=tracker.peak, recomputable=recomputable, flops=flops,
                     forward_flops=fwd_flops, traffic_bytes=traffic, grad_bytes=grad_bytes,
                     param_count=sum(p.numel() for p in model.parameters()), **parts)


def fakeify(model: nn.Module) -> None:
    """Replace meta parameters and buffers by fake CPU tensors of the same shape, dtype and strides
    (in place: ``Module.to`` would swap tensors, which fake tensors' weak references forbid)."""
    done: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            done[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return done[id(t)]

    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = fake(t)

