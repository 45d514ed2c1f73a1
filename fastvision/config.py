"""Typed run configuration: code defaults, then a YAML recipe, then ``--set a.b=c`` overrides.

The tree is plain dataclasses. Pluggable parts (task, model, loss, dataset) are a ``name`` plus an
``args`` mapping that the registry checks against the builder's signature, so every key anywhere
in a recipe is validated. Unknown keys and wrong types raise :class:`ConfigError` listing the
valid keys. The resolved tree (with builder defaults filled in) is saved as ``config.yaml`` in
every run directory.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from fastvision.errors import ConfigError, did_you_mean
from fastvision.registry import type_name, type_ok


@dataclass
class Component:
    """A registered builder and its keyword arguments."""

    name: str = ""
    args: dict = field(default_factory=dict)


@dataclass
class DataConfig:
    name: str = "microscopy"
    args: dict = field(default_factory=dict)  # dataset builder arguments (path, image_size, ...)
    loader: Literal["threads", "processes"] = "threads"
    num_workers: int | Literal["auto"] = 2  # per rank; auto: from its share of the cores (data/workers.py)
    augment: dict = field(default_factory=dict)  # batched on-device augmentation spec
    val_batch_size: int | None = None
    repeats: int = 1  # yield each training batch this many times (data echoing)
    # training-set cache; auto: the fastest memory tier it fits in (data/cache/auto.py)
    cache: Literal["none", "ram", "disk", "shared", "smart", "gpu", "auto"] = "none"
    cache_rate: float = 1.0  # share of items cached (ram, smart)
    cache_dir: str | None = None  # disk cache folder (default: under FASTVISION_CACHE)
    cache_num: int | None = None  # smart cache: items resident per epoch; None: cache_rate of them (MONAI)
    replace_rate: float = 0.1  # smart cache: share replaced per epoch


@dataclass
class OptimConfig:
    name: Literal["sgd", "adam", "adamw", "novograd"] = "adam"
    lr: float = 1e-3  # learning rate at ``ref_batch`` images per step
    ref_batch: int | None = None  # linear scaling: lr * global_batch / ref_batch; None: no scaling
    weight_decay: float = 0.0
    momentum: float = 0.9
    nesterov: bool = False
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    no_decay_norm_bias: bool = True  # no weight decay on norm weights and biases
    no_decay_bias: bool = True  # with no_decay_norm_bias: every bias too; false: the norms alone (seed 004)
    impl: Literal["auto", "fused", "foreach", "loop"] = "auto"  # sgd/adam/adamw kernel; auto: fused on CUDA, CPU


@dataclass
class SchedConfig:
    name: Literal["constant", "cosine", "step", "poly", "piecewise"] = "cosine"
    warmup_epochs: float = 0.0
    warmup_start_factor: float = 0.0  # lr multiplier at the first warm-up step
    min_lr_factor: float = 0.0  # cosine / poly floor as a fraction of the peak lr
    milestones: list[float] = field(default_factory=list)  # epochs, for step / piecewise
    gamma: float = 0.1  # step decay factor
    factors: list[float] = field(default_factory=list)  # piecewise multipliers, len(milestones)+1
    power: float = 0.9  # poly exponent


AmpMode = Literal["off", "fp16", "bf16", "auto"]
AMP_MODES: tuple[str, ...] = typing.get_args(AmpMode)  # train.amp, --amp of train / profile, runtime.Precision


@dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int | Literal["auto"] = 16  # per worker; "auto": largest that fits (fastvision.planning.autobatch)
    accum_steps: int = 1
    clip_grad: float | None = None  # max global grad norm
    amp: AmpMode = "off"  # auto: bf16 if native (GPU sm80+), else fp16 + scaling; CPU fp32
    # fp16's loss scale: "dynamic" (torch's GradScaler: from 65536, x2 after 2000 clean steps) or a number, DLE's
    # --static-loss-scale (never grows; an overflowed step is still skipped and halves it). Unused by bf16, fp32
    loss_scale: float | Literal["dynamic"] = "dynamic"
    tf32: bool = True
    # true == default; auto: compiled, eager after a compile error or when the first steps are slower
    compile: bool | Literal["default", "reduce-overhead", "max-autotune", "auto"] = False
    cpu_threads: int | None = None  # CPU intra-op threads (torch.set_num_threads); None: OMP_NUM_THREADS
    # host memory freed by large tensors: "keep" it in the process for the next one (glibc malloc: no
    # mmap per tensor, no trim; fastvision.engine.runtime.set_heap), or "system": the C library's defaults
    cpu_heap: Literal["keep", "system"] = "keep"
    channels_last: bool = False
    # recompute named blocks in the backward instead of keeping their activations: true (the model
    # family's blocks), false, or a list of block names (fastvision.models.checkpointing)
    activation_checkpointing: bool | list[str] = False
    device: str = "auto"
    seed: int = 0
    # the batched augmentation's draws: "rank", one generator per rank (a sample's draws depend on its place in
    # its rank's batch), or "sample", each sample's from (seed, epoch, dataset index): the same at any batch and
    # world size, so a resume on another world size continues them exactly (fastvision.data.augment.keyed)
    augment_rng: Literal["rank", "sample"] = "rank"
    deterministic: bool = False
    val_every: int = 1
    log_every: int = 10
    target: str | None = None  # "iou=0.9": stop once reached and record the time to target
    check_finite: bool = True  # skip steps with non-finite gradients (decided on the device, no host sync)
    max_nonfinite: int = 20  # consecutive skipped steps that trigger on_nonfinite (checked at log intervals)
    # then: roll back to the last healthy checkpoint (rollback.pt) and go on with the next batches,
    # the learning rate halved (rollback_lower_lr), kept (rollback), or stop (docs/distributed.md)
    on_nonfinite: Literal["stop", "rollback", "rollback_lower_lr"] = "rollback_lower_lr"
    steps_per_epoch: int | None = None  # cap on steps per epoch (smoke tests, benchmarks)
    ema_decay: float | None = None  # exponential moving average of the weights, used for validation
    # every batch norm's running-statistics momentum, over what the model set (None: as built, torch's 0.1)
    bn_momentum: float | None = None
    emulate_workers: int = 1  # one process trains as N data-parallel workers would (same global batch)
    backend: Literal["ddp", "horovod"] = "ddp"
    sync_bn: bool = False  # SyncBatchNorm across ranks
    ddp_bucket_mb: float = 25.0
    ddp_static_graph: bool = False
    # DDP gradient all-reduce in bf16 / fp16 (half the bytes; autocast alone keeps fp32 gradients)
    ddp_comm_hook: Literal["none", "bf16", "fp16"] = "none"
    # preemptible and elastic jobs (docs/distributed.md): a checkpoint every N steps ("500"), every
    # period ("20min", "90s", "2h") or whichever comes first ("500,20min"), beside the epoch's
    checkpoint_every: int | str | None = None
    keep_checkpoints: int = 0  # older step checkpoints kept as checkpoints/step-N.pt (0: only last.pt)
    # on these signals (names or numbers) the ranks agree on a step (in a multi-rank run at the next
    # log interval), rank 0 writes a checkpoint, all exit 128 + signal; [] for none
    stop_signals: list[str | int] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    requeue: bool = False  # under SLURM: `scontrol requeue $SLURM_JOB_ID` after a signal's checkpoint
    dist_timeout_s: float = 300.0  # a collective waiting longer on a lost peer fails the job
    # a multi-rank run without progress this long (no step, no validation batch) is hung: every live
    # rank writes its stacks to RUN/hang/, rank 0 names the missing ranks, exit 124 (distributed/watchdog.py);
    # below dist_timeout_s; 0 or null: off
    hang_timeout_s: float | None = 240.0


@dataclass
class RunConfig:
    recipe: str = ""
    task: Component = field(default_factory=lambda: Component("segmentation"))
    model: Component = field(default_factory=lambda: Component("unet2d-seed001"))
    loss: Component = field(default_factory=lambda: Component("dice_ce"))
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tensorboard: bool = False
    examples: int = 4  # prediction overlays written at the end of a run


# ---------------------------------------------------------------------------- building
# numeric keys with a range, checked with their type (a bad value is one line naming the key, before any build):
# (lowest, highest, lowest allowed, highest allowed); None where open; null values pass (their own meaning)
RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    **{f"train.{k}": (1, None, True, True) for k in ("epochs", "batch_size", "accum_steps", "val_every", "log_every",
                                                     "max_nonfinite", "steps_per_epoch", "cpu_threads",
                                                     "emulate_workers")},
    "train.keep_checkpoints": (0, None, True, True), "train.clip_grad": (0, None, False, True),
    "train.ema_decay": (0, 1, False, False),
    "train.ddp_bucket_mb": (0, None, False, True), "train.dist_timeout_s": (0, None, False, True),
    "train.hang_timeout_s": (0, None, True, True),
    "optim.lr": (0, None, False, True), "optim.ref_batch": (1, None, True, True),
    "optim.weight_decay": (0, None, True, True), "optim.momentum": (0, 1, True, False),
    "optim.eps": (0, None, False, True),
    "sched.warmup_epochs": (0, None, True, True), "sched.warmup_start_factor": (0, 1, True, True),
    "sched.min_lr_factor": (0, 1, True, True), "sched.gamma": (0, None, False, True),
    "sched.power": (0, None, False, True),
    "data.num_workers": (0, None, True, True), "data.val_batch_size": (1, None, True, True),
    "data.repeats": (1, None, True, True), "data.cache_rate": (0, 1, False, True),
    "data.cache_num": (1, None, True, True), "data.replace_rate": (0, 1, True, True),
    "examples": (0, None, True, True),
}


def check_range(path: str, value: Any) -> None:
    """``value`` of key ``path`` inside :data:`RANGES`' bounds (a number; other values are the type check's)."""
    bounds = RANGES.get(path)
    if bounds is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    lo, hi, lo_in, hi_in = bounds
    if not math.isfinite(value):  # NaN passes every comparison; an infinite rate or size is no setting either
        raise ConfigError(f"{path} must be a finite number, got {value!r}")
    if (lo is not None and (value < lo or (value == lo and not lo_in))) or (
            hi is not None and (value > hi or (value == hi and not hi_in))):
        left = "" if lo is None else ("[" if lo_in else "(") + f"{lo:g}"
        right = "" if hi is None else f"{hi:g}" + ("]" if hi_in else ")")
        want = (f"in {left}, {right}" if lo is not None and hi is not None
                else f">= {lo:g}" if lo_in else f"> {lo:g}")
        raise ConfigError(f"{path} must be {want}, got {value!r}")


def from_dict(data: dict[str, Any], cls: type = RunConfig, where: str = "") -> Any:
    """Build dataclass ``cls`` from a nested mapping, strictly."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            # the whole dotted key the user wrote (no.such=1 arrives as {"no": {"such": 1}}) and its section
            full = _first_leaf(value, path)
            section = f"section {where}" if where else "the top level of the config"
            raise ConfigError(f"unknown key {full}: {section} has no {key!r}{did_you_mean(key, names, where)}; "
                              f"valid keys there: {', '.join(sorted(names))}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(value, hint, path)
        else:
            value = _coerce(value, hint)
            if not type_ok(value, hint):  # DLE's --data-backend dali-gpu is a decoder here, not a loader
                dali = path == "data.loader" and "dali" in str(value)
                raise ConfigError(f"{path}: expected {type_name(hint)}, got {value!r}"
                                  + ("; DALI decodes with data.args.backend: dali" if dali else ""))
            check_range(path, value)
            kwargs[key] = value
    return cls(**kwargs)


def _first_leaf(value: Any, path: str) -> str:
    """``({"such": 1}, "no")`` -> ``"no.such"``: the dotted key down to the first non-mapping value."""
    while isinstance(value, dict) and len(value) == 1:
        key, value = next(iter(value.items()))
        path = f"{path}.{key}"
    return path


def _coerce(value: Any, hint: Any) -> Any:
    """YAML reads 1e-3 as a string and ``off`` as False; accept what the field means."""
    if isinstance(value, bool) and typing.get_origin(hint) is typing.Literal:
        word = {False: "off", True: "on"}[value]
        return word if word in typing.get_args(hint) else value
    if isinstance(value, str) and _wants_float(hint):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _wants_float(hint: Any) -> bool:
    return hint is float or float in typing.get_args(hint)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``over`` wins. Lists, scalars and an empty mapping (``augment={}``) replace."""
    out = dict(base)
    for k, v in over.items():  # before, {} merged into the base's mapping and left it as it was
        out[k] = merge(out[k], v) if isinstance(v, dict) and v and isinstance(out.get(k), dict) else v
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``"a.b.c=1e-3"`` -> ``{"a": {"b": {"c": 0.001}}}``; the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. train.epochs=5")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and value == raw.strip():  # YAML 1.1 reads 1e-3 as a string; a quoted "500" stays one
        try:
            value = float(value)
        except ValueError:
            pass
    return nested(key, value)


def nested(dotted: str, value: Any) -> dict[str, Any]:
    """``nested("a.b.c", 1)`` -> ``{"a": {"b": {"c": 1}}}``."""
    node: dict[str, Any] = {}
    cur = node
    parts = dotted.split(".")
    for p in parts[:-1]:
        cur[p] = {}
        cur = cur[p]
    cur[parts[-1]] = value
    return node


# ---------------------------------------------------------------------------- recipes
def recipe_dir() -> Path:
    return Path(str(resources.files("fastvision") / "recipes"))


def list_recipes() -> list[str]:
    return sorted(p.stem for p in recipe_dir().glob("*.yaml"))


def _header(path: Path) -> list[str]:
    """The comment lines a recipe file starts with, without the ``#``."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return lines


def recipe_summary(name: str) -> dict[str, str]:
    """One row of ``fastvision recipes``: name, task, model, data (format and where to get it), the
    reference seed it follows, and its purpose. ``purpose`` and ``data`` are the recipe's
    ``# purpose:`` / ``# data:`` header lines; the seed is the first "seed 00N" its header names;
    a recipe that ``extends`` another and lacks one takes its base's."""
    import re

    cfg = load(name)
    found: dict[str, str] = {}
    path: Path | None = recipe_path(name)
    while path is not None and len(found) < 3:
        for line in _header(path):
            for key in ("purpose", "data"):
                if line.startswith(f"{key}:"):
                    found.setdefault(key, line[len(key) + 1:].strip())
            seed = re.search(r"\bseed[ -](\d{3})\b", line, re.IGNORECASE)
            if seed:
                found.setdefault("seed", seed.group(1))
        base = read_yaml(path).get("extends")
        path = recipe_path(str(base)) if base else None
    return {"name": name, "task": cfg.task.name, "model": cfg.model.name,
            "data": f"{cfg.data.name}: {found.get('data', '-')}", "seed": found.get("seed", "-"),
            "purpose": found.get("purpose", "-")}


def recipe_path(name_or_path: str) -> Path:
    """A shipped recipe name (``unet2d-microscopy``) or a path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"recipe file not found: {p}")
        return p
    shipped = recipe_dir() / f"{name_or_path}.yaml"
    if not shipped.is_file():
        names = list_recipes()
        close = [n for n in names if name_or_path in n] or difflib.get_close_matches(name_or_path, names, 3, 0.6)
        hint = f"; did you mean {' or '.join(close[:3])}?" if close else ""
        raise ConfigError(f"unknown recipe {name_or_path!r}{hint} (valid: {', '.join(names)})")
    return shipped


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read YAML ({str(e).splitlines()[0]})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections")
    return data


def read_recipe(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe's mapping; ``extends: NAME_OR_PATH`` layers it on top of another recipe."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: recipes extend each other in a cycle")
    data = read_yaml(path)
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: extends must name one recipe")
    try:
        base_path = recipe_path(base)
    except ConfigError as e:
        raise ConfigError(f"{path}: extends: {e}") from None
    return merge(read_recipe(base_path, (*seen, path.resolve())), data)


def load(recipe: str, overrides: list[dict[str, Any]] = ()) -> RunConfig:
    """Defaults <- recipe YAML (and the recipes it extends) <- each override mapping, in order."""
    path = recipe_path(recipe)
    data = read_recipe(path)
    data["recipe"] = path.stem
    try:  # the file's own keys first, so an error in them names the file (an override's names the override)
        cfg = from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if not overrides:
        return cfg
    for over in overrides:
        data = merge(data, over)
    return from_dict(data)


def save(cfg: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
