"""Model and optimizer wrapping: DDP (bucket size, static graph, comm hooks), Horovod, no_sync."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from fastvision.distributed.comm import _active, _hvd
from fastvision.errors import ConfigError

log = logging.getLogger(__name__)


def wrap_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module,
                   backward_passes_per_step: int = 1) -> torch.optim.Optimizer:
    """Horovod: ``hvd.DistributedOptimizer`` averaging gradients over ranks; otherwise ``optimizer``.

    Call it before building the LR scheduler: horovod returns a new optimizer object (same
    parameter groups). Gradients are all-reduced once per ``backward_passes_per_step`` backward
    passes (the accumulation micro-steps), as DDP does under :func:`no_sync`.

    Args:
        optimizer: the torch optimizer over ``model``'s parameters.
        model: the bare model (its parameter names name the all-reduces).
        backward_passes_per_step: micro-batches per optimizer step.
    """
    hvd = _hvd()
    if hvd is None:
        return optimizer
    return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                    backward_passes_per_step=backward_passes_per_step, op=hvd.Average)


def broadcast_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Horovod: copy rank 0's weights, buffers and (non-empty) optimizer state to every rank.

    DDP does the same when it wraps the model; call this after a resume has loaded a checkpoint.
    A fresh optimizer is not broadcast: horovod would first take a zero-gradient step to create its
    state, which moves weights under weight decay and counts a step in Adam's bias correction.
    """
    hvd = _hvd()
    if hvd is None or hvd.size() == 1:
        return
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if optimizer.state_dict()["state"]:
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)


def broadcast_buffers(model: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s buffers of ``model`` (BatchNorm's running statistics) to every rank; no-op in one
    process or for a model without buffers.

    Call it before validating: each rank's last training forward updated its running statistics from its
    own batch (DDP puts rank 0's back only at the start of the next training forward; horovod never), so a
    rank validating its shard with its own statistics scored another model than the checkpoint (rank 0's
    buffers) holds, and the logged metric differed from ``fastvision evaluate`` of that checkpoint. One
    broadcast per buffer dtype (horovod: one per buffer).
    """
    bufs = list(unwrap(model).buffers())
    if not bufs or not _active():
        return
    hvd = _hvd()
    if hvd is not None:
        for i, b in enumerate(bufs):
            hvd.broadcast_(b, root_rank=src, name=f"fastvision.buffer.{i}")
        return
    import torch.distributed as dist

    for dtype in sorted({b.dtype for b in bufs}, key=str):
        mine = [b for b in bufs if b.dtype == dtype]
        flat = torch.cat([b.detach().reshape(-1) for b in mine])
        dist.broadcast(flat, src=src)
        for b, v in zip(mine, flat.split([b.numel() for b in mine]), strict=True):
            b.data.copy_(v.view_as(b))


@contextlib.contextmanager
def synchronized(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Finish the gradient all-reduce now, then step without a second one (horovod); no-op for DDP.

    Wrap everything between the last backward and ``zero_grad`` in it, so that clipping, the AMP
    scaler's unscale and finiteness checks see the averaged gradients (horovod reduces them in the
    background until ``synchronize()``; DDP has finished by the end of ``backward``).
    """
    if _hvd() is None or not hasattr(optimizer, "skip_synchronize"):
        yield
        return
    optimizer.synchronize()
    with optimizer.skip_synchronize():
        yield


# --------------------------------------------------------------------------- model wrapping


def wrap_model(model: nn.Module, device: torch.device, *, sync_bn: bool = False, bucket_cap_mb: float = 25.0,
               static_graph: bool = False, find_unused_parameters: bool = False,
               comm_hook: str = "none") -> nn.Module:
    """Move ``model`` to ``device`` and wrap it in DDP when there is more than one process.

    Args:
        model: the bare model; call this before ``torch.compile``.
        device: this process's device.
        sync_bn: convert BatchNorm layers to SyncBatchNorm (statistics over the global batch).
        bucket_cap_mb: gradient bucket size in MiB; smaller buckets start communication earlier.
        static_graph: the set of used parameters never changes between steps (enables extra overlap).
        find_unused_parameters: some parameters get no gradient in some steps (costs a graph walk).
        comm_hook: ``none``, or ``bf16`` / ``fp16``: gradients are all-reduced in that precision
            (half the bytes; torch's ``default_hooks`` compress hooks), then cast back. ``bf16``
            needs NCCL (CUDA; torch refuses it on gloo: ``ConfigError``), fp16 runs on gloo too.

    Returns:
        The model itself in one process, else a ``DistributedDataParallel`` wrapper.
    """
    model = model.to(device)
    horovod = _hvd() is not None
    if horovod and sync_bn:
        raise ConfigError("train.sync_bn is not supported with --backend horovod; use ddp")
    if horovod or not _active():
        return model  # horovod reduces in its optimizer (wrap_optimizer)
    if sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if device.type != "cuda" and any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
            raise ConfigError(f"train.sync_bn: torch's SyncBatchNorm runs on CUDA devices only, this rank trains on "
                              f"{device}; set train.sync_bn=false (each rank normalises its own batch)")
    if comm_hook not in ("none", "bf16", "fp16"):
        raise ConfigError(f"train.ddp_comm_hook: expected none, bf16 or fp16, got {comm_hook!r}")
    ddp = nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=True,  # gradients alias the buckets: one copy fewer per step
    )
    if comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.bf16_compress_hook if comm_hook == "bf16" else default_hooks.fp16_compress_hook
        try:
            ddp.register_comm_hook(None, hook)  # state None: the default process group
        except TypeError as e:  # torch refuses bf16 without NCCL (CUDA) or XCCL
            raise ConfigError(f"train.ddp_comm_hook: {comm_hook} is not available here ({e}); use fp16") from None
    return ddp


def _layers(model: nn.Module) -> Iterator[nn.Module]:
    """``model``, then each module it wraps (DDP's ``module``, ``torch.compile``'s ``_orig_mod``)."""
    while True:
        yield model
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module under any DDP and ``torch.compile`` wrappers (for eval and checkpoints)."""
    *_, bare = _layers(model)
    return bare


def no_sync(model: nn.Module, skip: bool = True) -> contextlib.AbstractContextManager:
    """Context that skips the gradient all-reduce (accumulation micro-steps) when ``skip``.

    A plain ``nullcontext`` for a bare model or when ``skip`` is false, so the engine writes
    ``with distributed.no_sync(model, not last_micro_step):`` without branching.
    """
    ddp = next((m for m in _layers(model) if isinstance(m, nn.parallel.DistributedDataParallel)), None)
    return ddp.no_sync() if skip and ddp is not None else contextlib.nullcontext()
