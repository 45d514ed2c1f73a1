"""What a training run carries between epochs and across a restart: the checkpoint's contents and
their restore, the EMA weights, the best-metric / target bookkeeping, and what
the run records about itself (resolved config, environment)."""
from __future__ import annotations

import json
import platform
from typing import Any

import torch
from torch import nn

from fastvision import __version__, dist
from fastvision.config import RunConfig, to_dict
from fastvision.engine import checkpoint, runtime
from fastvision.errors import ConfigError
from fastvision.registry import DATASETS, LOSSES, MODELS, TASKS
from fastvision.tasks.base import Task

# Keys of the loop state saved in every checkpoint (and restored by ``--resume``).
STATE_KEYS = ("epoch", "step", "best", "train_time", "wall_time", "history", "data_info")


def initial_state(info: dict) -> dict[str, Any]:
    """The loop state before the first epoch (``epoch`` -1: nothing trained yet)."""
    return {"epoch": -1, "step": 0, "best": None, "train_time": 0.0, "wall_time": 0.0, "history": [],
            "data_info": plain(info)}


def plain(info: dict) -> dict:
    """Dataset facts as JSON-able plain types (checkpoints must load with ``weights_only``)."""
    return json.loads(json.dumps(info, default=str))


def parse_target(target: str | None) -> tuple[str, float] | None:
    if not target:
        return None
    name, sep, value = target.partition("=")
    try:
        return name.strip(), float(value)
    except ValueError:
        raise ConfigError(f"--target {target!r}: expected METRIC=VALUE, e.g. iou=0.9") from None


def improved(task: Task, row: dict, best: float | None) -> bool:
    value = row.get(task.primary_metric)
    if value is None or value != value:  # missing or NaN
        return False
    return best is None or (value > best if task.higher_is_better else value < best)


def reached(task: Task, name: str, value: float, goal: float) -> bool:
    """Losses are reached from above; task metrics in the task's direction."""
    higher = task.higher_is_better if name == task.primary_metric else "loss" not in name
    return value >= goal if higher else value <= goal


def make_ema(model: nn.Module, decay: float | None):
    """An exponential moving average of the weights (and buffers), or None."""
    if decay is None:
        return None
    if not 0.0 < decay < 1.0:
        raise ConfigError(f"train.ema_decay must be in (0, 1), got {decay}")
    return Ema(model, decay)


class Ema(nn.Module):
    """EMA of a model's parameters and buffers, updated on the device without a host read.

    The state dict matches ``torch.optim.swa_utils.AveragedModel(..., use_buffers=True)``
    (``module.*`` and ``n_averaged``), so checkpoints of either load into the other. As there, the
    first update copies the weights and later ones lerp by ``1 - decay``; an update whose
    ``found_inf`` is set (a skipped step) changes nothing.

    Args:
        model: the bare model (copied).
        decay: weight of the old average, in (0, 1).
    """

    def __init__(self, model: nn.Module, decay: float):
        super().__init__()
        import copy

        self.module = copy.deepcopy(model)
        self.decay = decay
        first = next(iter(model.parameters()), None)
        self.register_buffer("n_averaged", torch.tensor(0, dtype=torch.long,
                                                        device=first.device if first is not None else None))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def update_parameters(self, model: nn.Module, found_inf: torch.Tensor | None = None) -> None:
        """Fold ``model``'s current weights in, unless ``found_inf`` (0-d float) is non-zero."""
        keep = torch.ones((), device=self.n_averaged.device) if found_inf is None else (found_inf.reshape(()) == 0).float()
        # weight of the new weights: 1 on the first update (a copy), 1 - decay after, 0 when skipped
        w = torch.where(self.n_averaged == 0, 1.0, 1.0 - self.decay) * keep
        # parameters: one foreach lerp (they stay finite: a non-finite update is never applied)
        e_p = [e for e in self.module.parameters()]
        if e_p:
            diff = torch._foreach_sub([p.detach() for p in model.parameters()], e_p)
            torch._foreach_mul_(diff, w.to(e_p[0].dtype))
            torch._foreach_add_(e_p, diff)
        # buffers: a skipped step's forward may have put NaN in BatchNorm's running statistics,
        # and NaN * 0 is NaN, so they are selected, not weighted (few tensors)
        skip = keep == 0
        for e, c in zip(self.module.buffers(), model.buffers()):
            if e.is_floating_point():
                e.copy_(torch.where(skip, e, torch.lerp(e, c, w.to(e.dtype))))
            else:  # counters (num_batches_tracked): copied
                e.copy_(torch.where(skip, e, c))
        self.n_averaged += keep.long()


def eval_model(model: nn.Module, ema) -> nn.Module:
    """The weights that are validated and that ``predict`` uses: the EMA when there is one."""
    return ema.module if ema is not None else model


def checkpoint_state(run, state: dict, resolved: dict) -> dict[str, Any]:
    """Everything ``--resume`` needs, referencing the live tensors (snapshot before training on).

    Args:
        run: the :class:`fastvision.engine.Run` (model, optimizer, scheduler, precision, generator, ema).
        state: the loop state (:data:`STATE_KEYS`).
        resolved: the resolved config, saved so a checkpoint rebuilds its run alone.
    """
    ema = run.ema
    extra = {"ema": ema.state_dict(), "eval_model": ema.module.state_dict()} if ema is not None else {}
    return {**extra, "model": checkpoint.strip_prefixes(run.model.state_dict()),
            "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
            "scaler": run.precision.scaler.state_dict(), **{k: state[k] for k in STATE_KEYS},
            "rng": runtime.rng_state(run.generator), "config": resolved, "fastvision": __version__}


def restore(ckpt: dict[str, Any], run) -> dict[str, Any]:
    """Load a checkpoint into ``run``'s parts; returns the loop state it was saved with."""
    run.model.load_state_dict(ckpt["model"])
    if run.ema is not None:
        if "ema" not in ckpt:
            raise ConfigError("train.ema_decay is set but the checkpoint has no EMA weights to resume")
        run.ema.load_state_dict(ckpt["ema"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    run.scheduler.load_state_dict(ckpt["scheduler"])
    run.precision.scaler.load_state_dict(ckpt["scaler"])
    runtime.set_rng_state(ckpt["rng"], run.generator)
    return {"wall_time": 0.0, **{k: ckpt[k] for k in STATE_KEYS if k in ckpt}}  # older checkpoints: no wall_time


def resolved_config(cfg: RunConfig) -> dict[str, Any]:
    """The config with every builder default filled in (what gets saved and logged)."""
    out = to_dict(cfg)
    for section, reg in (("model", MODELS), ("loss", LOSSES), ("task", TASKS)):
        out[section]["args"] = {**_public_defaults(reg, out[section]["name"]), **out[section]["args"]}
    out["data"]["args"] = {**_public_defaults(DATASETS, cfg.data.name), **out["data"]["args"]}
    return out


def _public_defaults(reg, name: str) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in reg.defaults(name).items()
            if k not in ("loss", "augment", "info")}


def environment(env: dist.DistEnv, device: torch.device) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"fastvision": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "device": str(device), "gpu": gpu, "world_size": env.world_size,
            "launcher": env.launcher, "host": platform.node(), "cpu_threads": torch.get_num_threads()}
