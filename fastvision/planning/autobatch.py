"""``--batch-size auto``: the largest per-device batch that trains on the real device.

A bounded search with real training steps: double the batch from a start until a step runs out of
memory (or a limit), then bisect between the last batch that ran and the first that did not.
Memory is released between tries (the failed step's tensors dropped, ``gc.collect`` and
``torch.cuda.empty_cache``), and a try that raises ``torch.OutOfMemoryError`` counts as "does not
fit". On CPU there is no out-of-memory error worth waiting for, so tests and CPU runs pass a
:class:`MemoryCap` (``FASTVISION_MEMORY_CAP_MB``): live tensor bytes are counted and
``OutOfMemoryError`` raised above the cap.

The learning rate then follows the recipe's rule (``optim.ref_batch`` linear scaling in
:func:`fastvision.optim.effective_lr`), which ``fit`` applies to the resolved batch; the choice is
logged.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import logging
from collections.abc import Callable

import torch

from fastvision.config import RunConfig
from fastvision.errors import ConfigError
from fastvision.planning.trace import LiveBytes

log = logging.getLogger(__name__)

MAX_BATCH = 4096  # upper bound of the search


class MemoryCap(LiveBytes):
    """Live tensor bytes under this mode; ``torch.OutOfMemoryError`` once they pass ``cap_bytes``."""

    def __init__(self, cap_bytes: int):
        super().__init__()
        self.cap = cap_bytes

    def ignore(self, tensors) -> None:
        """Storages that exist before the try (weights): known, so views of them count nothing."""
        for t in tensors:
            LiveBytes.track(self, t, "ignored")  # not the capped track: weights may exceed the cap
            self.current -= t.untyped_storage().nbytes()
        self.reset_peak()

    def track(self, t: torch.Tensor, op: str) -> int:
        serial = super().track(t, op)
        if self.current > self.cap:
            raise torch.OutOfMemoryError(f"artificial cap: {self.current} bytes live > {self.cap}")
        return serial


def release_memory() -> None:
    """Drop what a failed try left behind before the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def search(fits: Callable[[int], bool], start: int = 1, limit: int = MAX_BATCH) -> int:
    """Largest ``b`` in ``[1, limit]`` with ``fits(b)``, assuming fitting is monotone in ``b``.

    Doubling from ``start`` (halving if ``start`` does not fit), then bisection: at most about
    ``2 log2(limit)`` calls. Returns 0 if batch 1 does not fit.
    """
    start = max(1, min(start, limit))
    if fits(start):
        good, bad = start, None
        while bad is None and good < limit:
            b = min(good * 2, limit)
            if fits(b):
                good = b
            else:
                bad = b
        if bad is None:
            return good
    else:
        bad, good = start, 0
        while good == 0 and bad > 1:
            b = bad // 2
            if fits(b):
                good = b
            else:
                bad = b
        if good == 0:
            return 0
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def recipe_run(cfg: RunConfig, device: torch.device):
    """The recipe's run built by the engine's one build without a dataset (the task supplies
    synthetic batches), and an optimizer factory: what :func:`step_fits` trains with."""
    from fastvision import engine, optim

    c = copy.deepcopy(cfg)
    c.train.device, c.train.batch_size = str(device), 1  # batch_size may still read "auto"
    run = engine.build(c, data_info={}, train=True)
    return run, lambda model: optim.build_optimizer(model, c.optim, run.lr)


def step_fits(state, make_optimizer: Callable, steps: int = 2, cap: int | None = None) -> Callable[[int], bool]:
    """A ``fits(batch)`` that runs ``steps`` real training steps, each one ``engine.train_step``
    (accumulation, clipping, the non-finite check and EMA included: the step ``train`` runs).

    Args:
        state: the step state of the recipe's training build (``engine.build(..., train=True).step``);
            its optimizer and schedule are replaced per try.
        make_optimizer: ``model -> optimizer``; a fresh one per try (its state is the try's).
        steps: steps per try (the second one holds the optimizer state).
        cap: artificial memory cap in bytes (CPU tests): tensor bytes created by a try and live
            at once (parameters excluded) above it count as out of memory.
    """
    from fastvision import engine

    device, model = state.device, state.bare if state.bare is not None else state.model
    initial = copy.deepcopy(model.state_dict())
    kept = [*model.parameters(), *model.buffers(),
            *([] if state.ema is None else [*state.ema.parameters(), *state.ema.buffers()])]

    def fits(b: int) -> bool:
        model.load_state_dict(initial)
        batch = None
        guard = contextlib.nullcontext()
        if cap is not None:
            guard = MemoryCap(cap)
            guard.ignore(kept)
        try:
            with guard:
                state.optimizer = make_optimizer(model)
                # memory does not depend on the learning rate: a constant schedule for the search
                state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda _: 1.0)
                batch = state.task.synthetic_batch(b, device)
                for _ in range(steps):
                    engine.train_step(state, itertools.repeat(batch))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # deliberate: an OOM must surface inside this try
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        finally:
            model.zero_grad(set_to_none=True)
            state.optimizer = state.scheduler = batch = None
            release_memory()
        log.info("batch-size auto: %sbatch %d %s", _who(), b, "fits" if ok else "out of memory")
        return ok

    return fits


def resolve_auto_batch(cfg: RunConfig, device: torch.device, cap: int | None = None,
                       limit: int = MAX_BATCH) -> int:
    """Replace ``cfg.train.batch_size == "auto"`` by the largest batch that trains on ``device``.

    Off CUDA there is no out-of-memory error to catch before the host swaps, so a cap is needed:
    ``cap`` bytes or the environment variable ``FASTVISION_MEMORY_CAP_MB``. Returns the batch; the
    LR scaled by the recipe's rule is logged (``fit`` applies it).

    In a job of several processes each calls it for its own device: the tries run unwrapped
    (``distributed.alone``: no DDP, no collective, so ranks may try different batches), and
    :func:`agree_auto_batch` then takes the smallest answer.
    """
    import os

    if cap is None and os.environ.get("FASTVISION_MEMORY_CAP_MB"):
        cap = int(float(os.environ["FASTVISION_MEMORY_CAP_MB"]) * 2**20)
    if cap is None and device.type != "cuda":
        raise ConfigError(f"train.batch_size=auto on {device}: needs a CUDA device, or a memory cap in "
                          "FASTVISION_MEMORY_CAP_MB (see `fastvision plan` for an estimate without a device)")
    from fastvision import distributed

    with distributed.alone():  # this device's own search: its tries make no collective call
        run, make_optimizer = recipe_run(cfg, device)
        fits = step_fits(run.step, make_optimizer, cap=cap)
        b = search(fits, start=2, limit=limit)
        del run, make_optimizer, fits
        release_memory()
    if b == 0:
        raise ConfigError(f"train.batch_size=auto: not even batch 1 of {cfg.recipe} fits on {device}")
    cfg.train.batch_size = b
    if distributed.world_size() == 1:
        _log_choice(cfg, b, device)
    return b


def _who() -> str:
    """``"rank R: "`` in a job of several processes (each searches), else nothing."""
    from fastvision import distributed

    return f"rank {distributed.rank()}: " if distributed.world_size() > 1 else ""


def _log_choice(cfg: RunConfig, b: int, device: torch.device) -> None:
    """The batch chosen and the LR the recipe's rule gives for the global batch it makes."""
    from fastvision import distributed
    from fastvision.optim import effective_lr

    tc = cfg.train
    world, micro = distributed.world_size(), tc.accum_steps * tc.emulate_workers
    glob = b * micro * world
    lr = effective_lr(cfg.optim, glob)
    how = (f"x {glob}/{cfg.optim.ref_batch}" if cfg.optim.ref_batch else "unscaled: no optim.ref_batch")
    parts = [f"{world} ranks"] * (world > 1) + [f"{micro} micro-batches"] * (micro > 1)
    where = f"; global batch {glob} ({' x '.join(parts)})" if parts else ""
    log.info("batch-size auto: %d per device on %s%s; lr %.4g (optim.lr %.4g %s)", b, device.type, where, lr,
             cfg.optim.lr, how)


def agree_auto_batch(cfg: RunConfig, device: torch.device) -> int:
    """``train.batch_size: auto`` in a job: every rank searches its own device
    (:func:`resolve_auto_batch`), and all train at the smallest batch any rank found (devices may
    differ in memory, or hold other tensors). A rank whose search failed fails every rank with its
    message. One process: :func:`resolve_auto_batch` itself.
    """
    from fastvision import distributed

    if distributed.world_size() == 1:
        return resolve_auto_batch(cfg, device)
    try:
        mine: int | str = resolve_auto_batch(cfg, device)
    except ConfigError as e:
        mine = str(e)
    found = distributed.gather_objects(mine)
    failed = [(r, m) for r, m in enumerate(found) if isinstance(m, str)]
    if failed:
        r, m = failed[0]
        raise ConfigError(f"rank {r}: {m}")
    b = min(found)
    cfg.train.batch_size = b
    if distributed.is_main():
        if len(set(found)) > 1:
            log.info("batch-size auto: the ranks found %s; every rank trains at the smallest", found)
        _log_choice(cfg, b, device)
    return b
