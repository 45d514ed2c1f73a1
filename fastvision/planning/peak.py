"""The measured peak memory of a recipe's real training steps: what ``plan``'s fake-tensor estimate
is checked against (``benchmarks/plan_memory.py``, ``benchmarks/activation_checkpointing.py`` and
the planning tests).

The window holds the engine's build and two real ``engine.train_step`` calls on a synthetic batch.
On a GPU the peak is ``torch.cuda.max_memory_allocated`` above what was allocated before; on the
CPU it is the running maximum of the CPU allocator's ``torch.profiler`` memory events (every
allocation and free in the window).
"""
from __future__ import annotations

import copy
import gc
import itertools
from collections.abc import Callable

import torch

from fastvision.config import RunConfig


def measured_peak(cfg: RunConfig, batch: int, device: torch.device) -> int:
    """Peak bytes of building the recipe and running two real training steps on ``device``."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        train_two_steps(cfg, batch, device)
        return torch.cuda.max_memory_allocated(device) - base
    return cpu_allocator_peak(lambda: train_two_steps(cfg, batch, device))


def cpu_allocator_peak(fn: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator holds while ``fn()`` runs, from ``torch.profiler`` memory
    events: the running sum of allocations (positive) and frees (negative), in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def train_two_steps(cfg: RunConfig, batch: int, device: torch.device) -> None:
    """The engine's build (which applies the recipe's switches) and two ``engine.train_step`` calls
    (the step ``train`` runs) on a synthetic batch; no weights file is read (they change values, not
    memory), as in the estimate."""
    from fastvision import engine
    from fastvision.models import without_weights
    from fastvision.planning.autobatch import recipe_run

    cfg = copy.deepcopy(cfg)
    cfg.model.args = without_weights(cfg.model.args)
    run, make_optimizer = recipe_run(cfg, device)
    run.step.optimizer = make_optimizer(run.model)
    run.step.scheduler = torch.optim.lr_scheduler.LambdaLR(run.step.optimizer, lambda _: 1.0)
    data = run.task.synthetic_batch(batch, device)
    for _ in range(2):
        engine.train_step(run.step, itertools.repeat(data))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
