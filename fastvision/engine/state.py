"""What a training run carries between epochs and across a restart: the checkpoint's contents and
their restore, the EMA weights, the best-metric / target bookkeeping, and what
the run records about itself (resolved config, environment)."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import platform
import unicodedata
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastvision import __version__, distributed
from fastvision.config import RunConfig, to_dict
from fastvision.engine import checkpoint, runtime
from fastvision.errors import ConfigError
from fastvision.registry import DATASETS, LOSSES, MODELS, TASKS
from fastvision.tasks.base import Task

log = logging.getLogger(__name__)

# Keys of the loop state saved in every checkpoint (and restored by ``--resume``). ``position`` is
# None at an epoch's end, else a :class:`Position` (saved as its plain dict).
# nonfinite_streak: consecutive skipped steps up to the checkpoint (the guard's count goes on after a resume)
STATE_KEYS = ("epoch", "step", "best", "train_time", "wall_time", "history", "data_info", "position",
              "nonfinite_streak")


@dataclass
class Position:
    """Where a mid-epoch checkpoint stands, shared by the loop (which makes and continues it), the
    checkpoint (a plain dict: ``weights_only``) and the loader (which starts at ``samples``).

    Attributes:
        epoch: the epoch (0-based) the checkpoint was taken in.
        step: optimizer steps of that epoch done, at the saving run's global batch (what was logged).
        samples: items of the epoch's permutation consumed by all ranks together (repeats counted):
            ``step`` x the global batch. Any world size continues from this sample.
        meter: the epoch's running counters (``EpochMeter.state()``), so the resumed epoch reports
            what the uninterrupted one would.
    """

    epoch: int
    step: int
    samples: int
    meter: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "samples": self.samples, **self.meter}

    @classmethod
    def from_dict(cls, saved: dict[str, Any] | None, global_batch: int) -> Position | None:
        """A checkpoint's position; one written before ``samples`` was kept counts ``step`` x its
        ``global_batch``."""
        if not saved:
            return None
        meter = {k: v for k, v in saved.items() if k not in ("epoch", "step", "samples")}
        return cls(saved["epoch"], saved["step"], saved.get("samples", saved["step"] * global_batch), meter)

    def first_step(self, global_batch: int) -> int:
        """Steps of the epoch counted done at this run's ``global_batch``: the loop continues at the
        next one, reading from sample ``samples`` (a partial step's worth, where the global batches
        do not divide, shortens the epoch's end instead of repeating items)."""
        return math.ceil(self.samples / global_batch)


def initial_state(info: dict) -> dict[str, Any]:
    """The loop state before the first epoch (``epoch`` -1: nothing trained yet)."""
    return {"epoch": -1, "step": 0, "best": None, "train_time": 0.0, "wall_time": 0.0, "history": [],
            "data_info": plain(info), "position": None, "nonfinite_streak": 0.0}


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


def set_bn_momentum(model: nn.Module, momentum: float) -> int:
    """Set the momentum of every batch norm's running statistics (``train.bn_momentum``).

    A running statistic moves by ``momentum`` of the way to each batch's value (torch's default 0.1:
    it averages about the last ten batches). At a high learning rate and a few steps per epoch the
    weights move faster than that, so validation normalises with statistics of older weights; a larger
    momentum follows them. Training outputs do not change, only what eval mode divides by. It overrides
    a momentum the model set itself (``ssd320``'s ``model.args.bn_momentum``, which sets only its FPN and
    head) on every batch norm, an unfrozen backbone's too; frozen ones (``FrozenBatchNorm2d``) keep no
    statistics and are left alone. Returns the number of norms set; raises :class:`ConfigError` for a
    momentum outside (0, 1] or a model without batch norm (the key would do nothing).
    """
    if not 0.0 < momentum <= 1.0:
        raise ConfigError(f"train.bn_momentum must be in (0, 1], got {momentum}")
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        raise ConfigError(f"train.bn_momentum: {type(model).__name__} has no batch norm to set")
    for m in norms:
        m.momentum = momentum
    return len(norms)


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
        keep = (torch.ones((), device=self.n_averaged.device) if found_inf is None
                else (found_inf.reshape(()) == 0).float())
        # weight of the new weights: 1 on the first update (a copy), 1 - decay after, 0 when skipped
        w = torch.where(self.n_averaged == 0, 1.0, 1.0 - self.decay) * keep
        # parameters: one foreach lerp (they stay finite: a non-finite update is never applied)
        e_p = [e for e in self.module.parameters()]
        if e_p:
            diff = torch._foreach_sub([p.detach() for p in model.parameters()], e_p)
            torch._foreach_mul_(diff, w.to(e_p[0].dtype))
            torch._foreach_add_(e_p, diff)
        # buffers: selected, not weighted (few tensors): the step puts a skipped forward's
        # BatchNorm statistics back, but a NaN that reached them any other way stays out (NaN * 0 is NaN)
        skip = keep == 0
        for e, c in zip(self.module.buffers(), model.buffers(), strict=True):
            if e.is_floating_point():
                e.copy_(torch.where(skip, e, torch.lerp(e, c, w.to(e.dtype))))
            else:  # counters (num_batches_tracked): copied
                e.copy_(torch.where(skip, e, c))
        self.n_averaged += keep.long()


def eval_model(model: nn.Module, ema) -> nn.Module:
    """The weights that are validated and that ``predict`` uses: the EMA when there is one."""
    return ema.module if ema is not None else model


def checkpoint_state(run, state: dict, resolved: dict, rng_ranks: list[dict]) -> dict[str, Any]:
    """Everything ``--resume`` needs, referencing the live tensors (snapshot before training on).

    Args:
        run: the :class:`fastvision.engine.Run` (model, precision, its step state).
        state: the loop state (:data:`STATE_KEYS`).
        resolved: the resolved config, saved so a checkpoint rebuilds its run alone.
        rng_ranks: every rank's :func:`runtime.rng_state`, in rank order (each rank's augmentation
            generator has its own stream).
    """
    step = run.step
    extra = {"ema": step.ema.state_dict(), "eval_model": step.ema.module.state_dict()} if step.ema is not None else {}
    return {**extra, "model": checkpoint.strip_prefixes(run.model.state_dict()),
            "optimizer": step.optimizer.state_dict(), "scheduler": step.scheduler.state_dict(),
            "scaler": run.precision.scaler.state_dict(), **{k: state[k] for k in STATE_KEYS},
            "position": state["position"].to_dict() if isinstance(state["position"], Position) else state["position"],
            "rng": rng_ranks[0], "rng_ranks": rng_ranks, "world_size": len(rng_ranks),  # rng: rank 0's, as before
            "global_batch": run.global_batch, "lr": run.lr, "config": resolved, "fastvision": __version__}


def check_resumable(ckpt: dict[str, Any], cfg: RunConfig, path) -> None:
    """Before any build: ``ckpt`` (read from ``path``) is a training checkpoint of this recipe's model and task.

    Raises:
        DataError: no optimizer / schedule / step state (weights only, or not fastvision's);
        ConfigError: the checkpoint trained another model or task (another recipe's run folder), naming both.
    """
    from fastvision.errors import DataError

    missing = [k for k in ("optimizer", "scheduler", "scaler", "epoch", "step", "config") if k not in ckpt]
    if missing:
        raise DataError(f"{path}: not a training checkpoint to resume (no {', '.join(missing)} in it)")
    saved = ckpt["config"] if isinstance(ckpt["config"], dict) else {}
    theirs = {k: (saved.get(k) or {}).get("name") for k in ("model", "task")}
    ours = {"model": cfg.model.name, "task": cfg.task.name}
    differ = [k for k in ours if theirs[k] is not None and theirs[k] != ours[k]]
    if differ:
        what = ", ".join(f"{k} {theirs[k]!r}" for k in differ)
        mine = ", ".join(f"{k} {ours[k]!r}" for k in differ)
        raise ConfigError(f"{path}: a checkpoint of recipe {saved.get('recipe')!r} ({what}); this run is "
                          f"{cfg.recipe!r} ({mine}): resume it with its own recipe, or choose another --out")


def _class_list(info: dict | None) -> list | None:
    """``info["classes"]``; a COCO dataset's ``class_names`` in a checkpoint written before its info carried them
    as ``classes`` (a detection run's categories in class order)."""
    info = info or {}
    return info.get("classes") or (info.get("class_names") if "cat_ids" in info else None)


def classes_differ(trained: dict, given: dict) -> str | None:
    """Where dataset info ``given``'s class list (``info["classes"]``) is not ``trained``'s, as
    "(N classes there, M in training; class i is 'b' there, 'a' in training)", else None: labels are
    class indices, so another list (a class fewer, another order, other names) would make each
    image another class; the first classes of the training list alone keep their indices and pass.
    Datasets without a class list pass."""
    old, new = (_class_list(trained), _class_list(given))
    if not old or not new:
        return None
    # compared in NFC: macOS writes names decomposed ('cafe' + U+0301), other systems composed
    old, new = ([unicodedata.normalize("NFC", str(c)) for c in names] for names in (old, new))
    if old[:len(new)] == new:
        return None
    i = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
    at = lambda names: repr(names[i]) if i < len(names) else "none"  # noqa: E731
    return f"({len(new)} classes there, {len(old)} in training; class {i} is {at(new)} there, {at(old)} in training)"


def restore(ckpt: dict[str, Any], run, path=None) -> dict[str, Any]:
    """Load a checkpoint into ``run``'s parts; returns the loop state it was saved with.

    Each rank continues its own random streams when the world size is the one saved; on another
    world size the ranks' augmentation generators start from (seed, rank, step) instead (said in
    one line), and a changed global batch rescales the learning rate by the recipe's rule.
    """
    step = run.step
    checkpoint.load_model_weights(run.model, ckpt["model"], path or "the checkpoint", run.cfg.model.name)
    if step.ema is not None:
        if "ema" not in ckpt:
            raise ConfigError("train.ema_decay is set but the checkpoint has no EMA weights to resume")
        step.ema.load_state_dict(ckpt["ema"])
    step.optimizer.load_state_dict(ckpt["optimizer"])
    step.scheduler.load_state_dict(ckpt["scheduler"])
    run.precision.scaler.load_state_dict(ckpt["scaler"])
    ranks = ckpt.get("rng_ranks") or [ckpt["rng"]]  # before rng_ranks: rank 0's alone
    same_world = len(ranks) == run.env.world_size
    runtime.set_rng_state(ranks[run.env.rank] if same_world else ranks[0], step.generator)
    state = {"wall_time": 0.0, "position": None, "nonfinite_streak": 0.0,
             **{k: ckpt[k] for k in STATE_KEYS if k in ckpt}}
    state["position"] = Position.from_dict(state["position"], ckpt.get("global_batch", run.global_batch))
    if not same_world and "rng_ranks" in ckpt:
        step.generator.manual_seed(runtime.augment_seed(run.cfg.train.seed, run.env.rank, state["step"]))
        if run.env.is_main and run.cfg.train.augment_rng == "sample":
            log.info("resuming a %d-rank checkpoint on %d rank(s): the sample order and each sample's augmentation "
                     "(train.augment_rng: sample) continue as they were", len(ranks), run.env.world_size)
        elif run.env.is_main:
            log.warning("resuming a %d-rank checkpoint on %d rank(s): each rank's augmentation stream "
                        "restarts from (seed, rank, step); the sample order is kept", len(ranks), run.env.world_size)
    old_lr = ckpt.get("lr", run.lr)
    if old_lr and run.lr != old_lr:
        _rescale_lr(step, run.lr / old_lr)
    return state


def load_weights(ckpt: dict[str, Any], run, lr_factor: float = 1.0) -> None:
    """A rollback: model, EMA, optimizer and loss-scaler state from ``ckpt``; the schedule, the step
    count, the data position and the random streams stay where the run is. The learning rates
    are the run's current ones, times ``lr_factor`` (the schedule's base too, from now on)."""
    step = run.step
    lrs = [(g["lr"], g.get("initial_lr")) for g in step.optimizer.param_groups]
    run.model.load_state_dict(ckpt["model"])
    if step.ema is not None:
        step.ema.load_state_dict(ckpt["ema"])
    step.optimizer.load_state_dict(ckpt["optimizer"])  # its param groups carry the saved lr: put back
    for group, (lr, initial) in zip(step.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
        if initial is not None:
            group["initial_lr"] = initial
    run.precision.scaler.load_state_dict(ckpt["scaler"])
    if lr_factor != 1.0:
        _rescale_lr(step, lr_factor)


def _rescale_lr(step, factor: float) -> None:
    """Multiply the resumed learning rates (optimizer groups and the schedule's base) by ``factor``."""
    for group in step.optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    if hasattr(step.scheduler, "base_lrs"):
        step.scheduler.base_lrs = [lr * factor for lr in step.scheduler.base_lrs]


def keep_global_batch(cfg: RunConfig, ckpt: dict[str, Any], world_size: int, is_main: bool = True) -> RunConfig:
    """On another world size, the config whose accumulation keeps the checkpoint's global batch
    (a new config: ``cfg`` is not changed).

    Global batch = per-rank batch x accumulation x emulated workers x world size, where
    ``world_size`` is the size of the group this process joined (``distributed.init``'s: Horovod's
    launcher, for one, sets no variable ``distributed.detect_env`` reads). Where the saved global batch
    divides by this run's batch x world size, ``train.accum_steps`` is set to keep it (the sample
    order is then the same: step k reads positions [k*G, (k+1)*G) of the epoch's permutation);
    where not, one line says so and the learning rate follows the recipe's rule
    (``optim.ref_batch``) for the new global batch (the resume still continues at the saved sample:
    :class:`Position`).
    """
    old, tc = ckpt.get("global_batch"), cfg.train
    saved = ckpt.get("world_size")
    if not old or saved is None or saved == world_size:
        return cfg
    per_step = tc.batch_size * tc.emulate_workers * world_size
    if old % per_step == 0:
        if old // per_step != tc.accum_steps:
            (log.info if is_main else log.debug)(  # one line per job, not per rank
                "resuming a %d-rank run on %d rank(s): train.accum_steps %d -> %d keeps the global batch %d",
                saved, world_size, tc.accum_steps, old // per_step, old)
            return dataclasses.replace(cfg, train=dataclasses.replace(tc, accum_steps=old // per_step))
    else:
        (log.warning if is_main else log.debug)(
            "resuming a %d-rank run on %d rank(s): its global batch %d is not a multiple of %d (batch x workers x "
            "ranks); training on at global batch %d, learning rate by the recipe's rule", saved, world_size, old,
            per_step, per_step * tc.accum_steps)
    return cfg


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


def environment(env: distributed.DistEnv, device: torch.device) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"fastvision": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "device": str(device), "gpu": gpu, "world_size": env.world_size,
            "launcher": env.launcher, "host": platform.node(), "cpu_threads": torch.get_num_threads()}
