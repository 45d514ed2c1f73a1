"""The private torch API fastvision relies on, in one place, checked against the torch it runs on.

Three internals make the skip-on-non-finite step free of host syncs, and a fourth keeps its skipped
first step quiet; torch has no public form of them (pytorch#76710 asks for one):

* ``GradScaler._per_optimizer_states``: the found-inf tensors its ``unscale_`` produced;
* the ``found_inf`` / ``grad_scale`` attributes a fused optimizer reads in ``step`` (how GradScaler
  tells fused Adam / AdamW / SGD to skip an update on the device);
* ``torch._amp_foreach_non_finite_check_and_unscale_``: the on-device finiteness check;
* ``Optimizer._opt_called``: what torch's LR schedulers read to warn "lr_scheduler.step() before
  optimizer.step()".

:func:`check` says, once, when the running torch is outside the versions these were verified
against (:data:`VERIFIED`); each accessor raises a one-line error naming the missing internal, so a
torch that changed them fails loudly instead of silently never skipping.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch.optim import Optimizer

from fastvision.errors import FastvisionError

log = logging.getLogger(__name__)

VERIFIED = ((2, 4), (2, 14))  # oldest and newest torch (major, minor) these internals were checked on
_warned: list[bool] = []


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the running torch), local suffixes dropped."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check(version: str | None = None) -> bool:
    """True when ``version`` (default: the running torch) is within :data:`VERIFIED`; else warn once."""
    ok = VERIFIED[0] <= torch_version(version) <= VERIFIED[1]
    if not ok and not _warned:
        _warned.append(True)
        log.warning("torch %s is outside the versions fastvision's non-finite step was verified on "
                    "(%d.%d to %d.%d): fastvision.optim.torch_private names what it uses",
                    version or torch.__version__, *VERIFIED[0], *VERIFIED[1])
    return ok


def _missing(what: str) -> FastvisionError:
    return FastvisionError(f"torch {torch.__version__} has no {what}: fastvision's skip-on-non-finite step "
                           "needs it (see fastvision/optim/torch_private.py); set train.check_finite=false "
                           "and --amp bf16/off to run without it")


def scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: Optimizer) -> torch.Tensor:
    """0-d float32 on the device: the sum of the found-inf flags ``scaler.unscale_(optimizer)`` set."""
    check()
    states = getattr(scaler, "_per_optimizer_states", None)
    try:
        found = list(states[id(optimizer)]["found_inf_per_device"].values())
        first = found[0]
    except (TypeError, KeyError, IndexError):
        raise _missing("GradScaler._per_optimizer_states[...]['found_inf_per_device'] (call unscale_ first)") from None
    return sum(found[1:], first).reshape(())


@contextlib.contextmanager
def fused_skip(optimizer: Optimizer, found_inf: torch.Tensor) -> Iterator[None]:
    """While open, a fused optimizer's ``step`` skips its update on the device where ``found_inf``
    is non-zero (the attribute GradScaler sets for the same purpose)."""
    check()
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        raise _missing(f"fused-step support in {type(optimizer).__name__} (_step_supports_amp_scaling)")
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del optimizer.found_inf


def non_finite_check_(tensors: list[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Set ``found`` (0-d float32) to 1 where any of ``tensors`` (one dtype and device) is not
    finite, and multiply them by ``inv_scale``: on the device, no host read."""
    fn = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if fn is None:
        raise _missing("torch._amp_foreach_non_finite_check_and_unscale_")
    fn(tensors, found, inv_scale)


def mark_stepped(optimizer: Optimizer) -> None:
    """Tell torch's LR scheduler that ``optimizer`` took its step, where a skipped step did not call
    ``optimizer.step()`` on purpose: the schedule advances on skipped steps (deciding otherwise
    needs a host read), so its warning about a schedule stepped before the optimizer (meant for
    swapped calls) would be about fastvision's design, not the user's code."""
    optimizer._opt_called = True  # type: ignore[attr-defined]  # set by the scheduler's step wrapper
