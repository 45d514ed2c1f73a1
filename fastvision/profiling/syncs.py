"""Find hidden host syncs on any device, the CPU included.

On CUDA a host sync stalls the CPU until the GPU has caught up, so the next kernels are not queued
in time; ``torch.cuda.set_sync_debug_mode("error")`` catches them, but only on a GPU. The ops
that cause them are known: reading a value back (``.item()``, ``bool(t)``, ``float(t)``:
``aten._local_scalar_dense``) and ops whose output size depends on the data (``nonzero``,
``torch.where(mask)``, boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave``
without ``output_size``, ``equal``). :class:`HostSyncDetector` records every call of them while it
is active, with the fastvision line that made it, so a test on a CPU-only machine can prove that a
training step queues its work without waiting (ARCHITECTURE style rule 6).

Not seen on the CPU: an explicit ``.cpu()`` / ``.tolist()`` of a CPU tensor (no op runs) and
copies from pageable host memory; those need the GPU test.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# Ops whose result the host must wait for (a value read back or a data-dependent output shape).
SYNC_OPS = {
    _aten._local_scalar_dense.default, _aten.nonzero.default, _aten.masked_select.default,
    _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
    _aten.repeat_interleave.Tensor, _aten.equal.default, _aten.is_nonzero.default,
}


def _bool_index(func: Any, args: tuple) -> bool:
    """``x[mask]``: aten.index with a boolean index tensor has a data-dependent output shape."""
    if func is not _aten.index.Tensor or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)


@dataclass
class SyncEvent:
    """One host sync: the op and the innermost fastvision source line that called it."""

    op: str
    where: str


class HostSyncDetector(TorchDispatchMode):
    """Record (or refuse) host-syncing ops while active: ``with HostSyncDetector() as d: step()``.

    Args:
        error: raise ``RuntimeError`` at the first sync instead of recording it.
        allow: op names (e.g. ``"aten.nonzero.default"``) not to count.
    """

    def __init__(self, error: bool = False, allow: frozenset[str] = frozenset()):
        super().__init__()
        self.error, self.allow = error, frozenset(allow)
        self.events: list[SyncEvent] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if (func in SYNC_OPS or _bool_index(func, args)) and str(func) not in self.allow:
            event = SyncEvent(str(func), _caller())
            if self.error:
                raise RuntimeError(f"host sync: {event.op} at {event.where}")
            self.events.append(event)
        return func(*args, **(kwargs or {}))

    def report(self) -> str:
        """One line per distinct (op, line) with its count; empty when there was none."""
        counts: dict[tuple[str, str], int] = {}
        for e in self.events:
            counts[(e.op, e.where)] = counts.get((e.op, e.where), 0) + 1
        return "\n".join(f"{n} x {op} at {where}" for (op, where), n in counts.items())


def _caller() -> str:
    """The innermost frame inside fastvision (else the innermost outside torch)."""
    frames = traceback.extract_stack()[:-3]
    for f in reversed(frames):
        if "/fastvision/" in f.filename and not f.filename.endswith("syncs.py"):
            return f"{f.filename.split('/fastvision/')[-1]}:{f.lineno} ({f.name})"
    for f in reversed(frames):
        if "/torch/" not in f.filename:
            return f"{f.filename}:{f.lineno} ({f.name})"
    return "?"
