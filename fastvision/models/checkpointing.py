"""Activation checkpointing of named blocks: ``train.activation_checkpointing``.

A checkpointed block keeps only its inputs for the backward pass and runs its forward again
there (``torch.utils.checkpoint`` with ``use_reentrant=False``, the variant that works under DDP,
``torch.compile`` and autocast). Memory for activations drops to the block inputs plus one
block's activations during its recompute; the step does about one extra forward of those blocks.

Each model family names its default blocks in a class attribute ``checkpoint_blocks``: module-name
patterns relative to an instance of the class, ``*`` standing for one name component (ResNet:
``layer1.*`` ... ``layer4.*``, its residual blocks). A model that holds such a module gets its
blocks under the module's name: SSD's defaults are its ResNet backbone's (``backbone.layer1.0``).

The spec (``train.activation_checkpointing``): ``false`` none; ``true`` the family's default
blocks; a list of names, each a default block (``layer3.1``) or a module holding default blocks
(``layer3``: each block of layer3, one checkpoint per block). An unknown name is a ConfigError
listing the valid ones.

BatchNorm inside a block: the recompute would update its running statistics a second time, so
the recompute restores the block's buffers as they were; running statistics move once per step,
as without checkpointing. (Under ``torch.compile`` the recompute is the partitioner's and mutates
nothing: the forward's single update is the only one. Not before torch 2.5, whose compiled recompute
updates them again: :func:`compile_conflict` names the case, and ``train.compile`` refuses it there.)
The block's state dict is unchanged: checkpoints written with and without the switch are interchangeable.
"""
from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Sequence

import torch
from torch import nn

from fastvision.errors import ConfigError

Spec = bool | None | Sequence[str]
KEY = "train.activation_checkpointing"


def _matches(pattern: str, name: str) -> bool:
    """``layer1.*`` matches ``layer1.0``, not ``layer1.0.conv1``: ``*`` is one name component."""
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have, strict=True))


def default_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the blocks the model's family checkpoints by default, in module order.

    A block inside another selected block is left out (the outer checkpoint already covers it).
    """
    names: list[str] = []
    for prefix, owner in model.named_modules():
        patterns = getattr(type(owner), "checkpoint_blocks", ())
        for rel, _ in owner.named_modules():
            if rel and any(_matches(p, rel) for p in patterns):
                names.append(f"{prefix}.{rel}" if prefix else rel)
    chosen: list[str] = []
    for n in dict.fromkeys(names):
        if not any(n.startswith(c + ".") for c in chosen):
            chosen.append(n)
    return chosen


def valid_names(model: nn.Module) -> list[str]:
    """Names a spec list may hold: the default blocks and every module that contains some."""
    blocks = default_blocks(model)
    groups = {".".join(b.split(".")[:i]) for b in blocks for i in range(1, b.count(".") + 1)}
    return sorted(groups | set(blocks), key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])


def resolve(model: nn.Module, spec: Spec) -> list[str]:
    """The block names ``spec`` selects on ``model`` (see the module docstring)."""
    if spec is None or spec is False:
        return []
    blocks = default_blocks(model)
    family = type(model).__name__
    if not blocks:
        raise ConfigError(f"{KEY}: {family} declares no checkpointable blocks (class attribute "
                          "checkpoint_blocks); set it to false")
    if spec is True:
        return blocks
    if isinstance(spec, str) or not all(isinstance(n, str) for n in spec):
        raise ConfigError(f"{KEY}: expected true, false or a list of block names, got {spec!r}")
    chosen: list[str] = []
    for name in spec:
        hits = [b for b in blocks if b == name or b.startswith(name + ".")]
        if not hits:
            raise ConfigError(f"{KEY}: unknown block {name!r} for {family}; valid: {', '.join(valid_names(model))}")
        chosen += hits
    return list(dict.fromkeys(chosen))


def apply_activation_checkpointing(model: nn.Module, spec: Spec) -> list[str]:
    """Checkpoint the blocks ``spec`` selects on ``model`` (in place); returns their names.

    Idempotent: blocks wrapped by an earlier call and not selected now are unwrapped, so the
    model runs exactly what ``spec`` says. Apply it to the bare model, before DDP and compile.
    """
    names = resolve(model, spec)
    modules = dict(model.named_modules())
    for m in modules.values():
        if is_checkpointed(m):
            del m.forward  # the class's forward again
    for name in names:
        modules[name].forward = types.MethodType(_checkpointed_forward, modules[name])
    return names


def is_checkpointed(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is _checkpointed_forward


def compile_conflict(model: nn.Module, version: tuple[int, int]) -> str | None:
    """Why ``torch.compile`` of ``model`` on torch ``version`` would train it otherwise than eagerly, or None:
    before 2.5 a checkpointed block's BatchNorm running statistics move twice a step when compiled."""
    if version >= (2, 5):
        return None
    blocks = [n for n, m in model.named_modules() if is_checkpointed(m)
              and any(isinstance(c, nn.modules.batchnorm._BatchNorm) for c in m.modules())]
    if not blocks:
        return None
    return (f"train.compile with train.activation_checkpointing on torch {version[0]}.{version[1]}: before 2.5 "
            f"the compiled recompute of {blocks[0]}{' ...' if len(blocks) > 1 else ''} updates BatchNorm's "
            "running statistics a second time each step; turn one of them off or use torch >= 2.5")


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    """A block's forward under ``torch.utils.checkpoint``, when a backward will follow.

    Bound to the instance with ``types.MethodType`` (not a closure), so ``copy.deepcopy`` of the
    model (EMA) binds the copy to the copied block.
    """
    from torch.utils.checkpoint import checkpoint

    forward = functools.partial(type(self).forward, self)
    if not (self.training and torch.is_grad_enabled()):  # evaluation: nothing is saved anyway
        return forward(*args, **kwargs)
    if _compiling():  # the partitioner recomputes; dynamo takes no custom context here
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=functools.partial(_contexts, self), **kwargs)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def _contexts(block: nn.Module):
    """(forward context, recompute context) for ``checkpoint``'s ``context_fn``."""
    return contextlib.nullcontext(), _KeepBuffers(block)


class _KeepBuffers:
    """Restore a block's buffers (BatchNorm running statistics, counters) after its recompute."""

    def __init__(self, block: nn.Module):
        self.block = block
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self):
        self.saved = [(b, b.detach().clone()) for b in self.block.buffers()]
        return self

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for b, value in self.saved:
                b.copy_(value)
        self.saved = []
