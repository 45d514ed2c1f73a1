"""Estimates for ``fastvision plan``: memory by part, largest batch, step time, scaling, time and cost.

Everything starts from :func:`fastvision.planning.trace.trace_step` (one fake-tensor training step of
the recipe). Units: bytes, seconds, FLOPs; GiB only in reports.

* Memory: the traced peak of live tensors plus a workspace margin (``WORKSPACE_FRACTION`` of the
  peak for allocator rounding and fragmentation, plus ``WORKSPACE_FIXED`` for the CUDA context and
  the cuBLAS / cuDNN workspaces, which no tensor trace sees). ``torch.compile`` is modelled by
  dropping the saved elementwise and normalisation outputs that inductor recomputes.
* Largest batch: activations and inputs grow linearly with the batch, parameters, gradients and
  optimizer state do not; the line is solved for the device's memory and the answer is checked
  with one more trace.
* Step time: a roofline range, ``max(FLOPs / (peak x f_hi), traffic / bandwidth)`` to
  ``FLOPs / (peak x f_lo) + traffic / bandwidth``, with the achieved fraction ``f`` of peak dense
  math either the default range or calibrated from a measured ``fastvision benchmark`` JSON.
* Scaling: the at-scale step model of :mod:`fastvision.scaling.simulator`, called through
  :mod:`fastvision.planning.scale` only.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fastvision import optim
from fastvision.config import RunConfig
from fastvision.errors import ConfigError, DataError
from fastvision.planning.devices import GPU, get_gpu, training_precision
from fastvision.planning.scale import _hardware, at_scale, epoch_seconds, step_line  # noqa: F401 (_hardware: cache)
from fastvision.planning.trace import StepTrace, trace_step

WORKSPACE_FRACTION = 0.05  # allocator block rounding and fragmentation, share of the tensor peak
WORKSPACE_FIXED = 0.75 * 2**30  # CUDA context (~0.3-0.5 GiB) + cuBLAS/cuDNN workspaces
# Achieved share of peak dense math, with the bandwidth term counted separately. Chosen so that
# the default range holds the published anchors (perf_anchors.md): ResNet-50 A100 AMP 2,470
# (DLE PyTorch) and 3,411 img/s (MXNet), H100 7,160 img/s (MLPerf), 3-D U-Net A100 AMP bs 2
# 17.9 vol/s (seed 000); docs/plan.md lists the check.
DEFAULT_ACHIEVED = (0.15, 0.5)
BANDWIDTH_EFFICIENCY = 0.8  # achievable share of spec memory bandwidth (HBM copy test: 87 %)

# Training-set sizes the recipes state or imply (items per epoch before sharding).
DATASET_FACTS: dict[str, tuple[int, str]] = {
    "resnet50-imagenet": (1_281_167, "ImageNet-1k train"),
    "resnet50-imagenet-250ep": (1_281_167, "ImageNet-1k train"),
    "ssd320-coco": (118_287, "COCO train2017"),
    "unet3d-brats": (268, "BraTS 2019, 335 cases (seed 000), 4 of 5 folds"),
    "segresnet-brats": (388, "MSD Task01 BrainTumour, 484 cases, MONAI's 388/96 split"),
    "unet3d-spleen-fast": (32, "MSD Task09 Spleen, 41 cases, MONAI's 32/9 split"),
    "unet3d-spleen-baseline": (32, "MSD Task09 Spleen, 41 cases, MONAI's 32/9 split"),
    "unet2d-microscopy": (896, "seed 001: 1,120 images, 80 % train"),
}


# ------------------------------------------------------------------------------ building
def build_for(cfg: RunConfig):
    """The recipe's model (on the meta device), task and optimizer factory, for :func:`trace_step`:
    the engine's component build (shapes only: no weights files read)."""
    from fastvision.engine.build import build_components

    def build():
        task, model = build_components(cfg, {}, "meta", weights=False)
        return model, task, lambda m: optim.build_optimizer(m, cfg.optim, cfg.optim.lr)

    return build


def trace(cfg: RunConfig, batch: int, *, amp: str | None = None, channels_last: bool | None = None,
          checkpointing: bool | list[str] | None = None) -> StepTrace:
    """One traced step of ``cfg`` at per-device ``batch`` (the recipe's switches unless given:
    ``checkpointing`` is ``train.activation_checkpointing``).

    ``amp: auto`` left unresolved means what it means on the CPU the trace runs on (fp32);
    :func:`fastvision.planning.plan.make_plan` resolves it for the target GPU first.
    """
    from fastvision.engine.runtime import resolve_amp
    from fastvision.engine.step import step_failure, synthetic_source

    amp = resolve_amp(cfg.train.amp if amp is None else amp, torch.device("cpu"))[0]
    try:
        return trace_step(build_for(cfg), batch, amp=amp,
                          channels_last=cfg.train.channels_last if channels_last is None else channels_last,
                          activation_checkpointing=(cfg.train.activation_checkpointing if checkpointing is None
                                                    else checkpointing))
    except (RuntimeError, ValueError, IndexError) as e:  # a model that cannot take the batch: one line
        raise step_failure(e, cfg, "the traced training step", synthetic_source(cfg, batch)) from e


# ------------------------------------------------------------------------------ memory
@dataclass
class Memory:
    """Peak device memory of a training step, in bytes, by part."""

    batch: int
    parameters: int
    gradients: int
    optimizer_state: int
    inputs: int
    activations: int
    workspace: int
    total: int

    def gib(self) -> dict[str, float]:
        return {k: (v / 2**30 if k != "batch" else v) for k, v in asdict(self).items()}


def memory(t: StepTrace, compile: bool = False) -> Memory:
    """Peak memory by part from a trace; ``compile`` drops the activations inductor recomputes."""
    act = t.activations - (t.recomputable if compile else 0)
    peak = t.peak_bytes - (t.recomputable if compile else 0)
    work = int(WORKSPACE_FRACTION * peak + WORKSPACE_FIXED)
    return Memory(t.batch, t.parameters, t.gradients, t.optimizer_state, t.inputs, act, work, peak + work)


def fits(total: float, gpu: GPU) -> bool:
    return total <= gpu.memory_gib * 2**30


def linear_batch(t: StepTrace, gpu: GPU, compile: bool = False) -> int:
    """Largest batch from one trace: activations and inputs scale with the batch, the rest is fixed."""
    m = memory(t, compile)
    per_item = (m.activations + m.inputs) / t.batch
    peak = m.total - m.workspace
    fixed = peak - m.activations - m.inputs
    room = (gpu.memory_gib * 2**30 - WORKSPACE_FIXED) / (1 + WORKSPACE_FRACTION) - fixed
    return max(0, int(room / per_item)) if per_item > 0 else 0


def largest_batch(cfg: RunConfig, gpu: GPU, first: StepTrace, compile: bool = False, max_traces: int = 3) -> int:
    """Largest per-device batch that fits ``gpu``: the linear rule of one trace, then checked.

    A trace at the predicted batch confirms it; if it does not fit, the line through the two
    traces gives the next guess (at most ``max_traces`` extra traces).

    Args:
        cfg: the recipe.
        gpu: target device.
        first: a trace at any batch (the recipe's).
        compile: plan for ``torch.compile``.
        max_traces: extra traces allowed.
    """
    cap = gpu.memory_gib * 2**30
    best = first.batch if memory(first, compile).total <= cap else 0
    guess = linear_batch(first, gpu, compile)
    for _ in range(max_traces):
        if guess < 1 or guess == best:
            return max(best, guess) if guess >= 1 else best
        t = trace(cfg, guess)
        over = memory(t, compile).total - cap
        if over <= 0:
            return max(best, guess)
        slope = (memory(t, compile).total - memory(first, compile).total) / max(1, guess - first.batch)
        guess = int(guess - over / slope) - 1 if slope > 0 else guess // 2
    return best


# ------------------------------------------------------------------------------ time
HALF_PRECISIONS = ("bf16", "fp16")


MEASURED_DIR = Path(__file__).with_name("measured")  # benchmark JSONs measured on a GPU (benchmarks/RESULTS.md)


def shipped_measurement(recipe: str, gpu: GPU, precision: str, channels_last: bool,
                        input_size: dict[str, Any] | None = None) -> Path | None:
    """The ``fastvision benchmark --mode train`` JSON shipped for a recipe (``measured/<recipe>-train.json``)
    when it was measured on this GPU model at this precision, memory layout and ``input_size``, else None.

    Only on the GPU it was measured on: the achieved share of peak does not carry across models. On an
    H200 eager bf16 ResNet-50 ran at 4,567 img/s x 24.3 GFLOP = 11 % of its dense peak, where DLE's
    A100 figure (2,470 img/s) is 19 % of the A100's; the default range holds the A100 anchors.
    """
    path = MEASURED_DIR / f"{recipe}-train.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    if get_gpu(report["gpu"]).name != gpu.name or bool(report.get("channels_last")) != bool(channels_last):
        return None  # another GPU model, or NHWC against NCHW (SSD320: 1,053 against 910 img/s on the H200)
    if _other_input(report, input_size):
        return None
    return path if precision in {r["precision"] for r in report["results"]} else None


def calibration_from_benchmark(path: Path, t: StepTrace, amp: str, tf32: bool, fixed: tuple[float, str],
                               given: bool = False, model: str | None = None,
                               input_size: dict[str, Any] | None = None) -> tuple[float, float, str, str]:
    """``(achieved share, fixed seconds per step, source, fixed source)`` from a measured
    ``fastvision benchmark --mode train`` JSON.

    The rows with the recipe's precision give a step time per batch size, ``t(b) = b / items_per_s``
    (a half precision the benchmark's GPU lacks falls back to the other one: fp16 <-> bf16; else the
    first row's). Measured at two or more batch sizes, the least-squares line ``t(b) = b x t_item +
    fixed`` splits the step: the intercept is this recipe's own fixed per-step cost (launches,
    optimizer, host), which does not shrink with the batch, and the slope its compute per item. A
    negative intercept (per-item time grows with the batch) leaves no fixed cost and the largest
    batch's time per item; a step that does not grow with the batch says nothing about compute and
    is refused. With one batch size, or with ``given`` (``fixed`` came from ``--fixed-ms``), ``fixed``
    (``(seconds, source)``: ``--fixed-ms`` or the fitted default) splits the largest batch's step,
    capped at half of it. The achieved share is the traced FLOPs per item over peak x ``t_item`` on
    the benchmark's GPU (its ``gpu`` field). One of another ``model`` or (recorded) ``input_size`` is
    refused: its step time per item says nothing about this step.
    """
    gpu, rows = _read_train_benchmark(path, model, input_size)
    precision, points = _step_points(rows, amp if amp != "off" else ("tf32" if tf32 else "fp32"))
    where = f"{gpu.name} {precision} " + ", ".join(f"batch {b}: {b / s:.0f} items/s" for b, s in points)
    fixed_s, per_item, fixed_source = _split_step(points, path, precision, fixed, given)
    peak, _ = gpu.peak_tflops(precision)
    frac = t.flops / t.batch / per_item / (peak * 1e12)
    return frac, fixed_s, where, fixed_source


def _read_train_benchmark(path: Path, model: str | None = None,
                          input_size: dict[str, Any] | None = None) -> tuple[GPU, list[dict[str, Any]]]:
    """``(the GPU it was measured on, measured rows)`` of a train-mode benchmark JSON; only rows
    with a positive rate and batch size.

    Raises:
        DataError: naming the file: unreadable, not a GPU train-mode benchmark (of ``model``, at
            ``input_size``), a GPU the table lacks, or no measured row.
    """
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable benchmark JSON ({e})") from None
    if not isinstance(report, dict) or report.get("mode") != "train" or not report.get("gpu"):
        raise DataError(f"{path}: needs a train-mode benchmark measured on a GPU (its 'gpu' field names it)")
    if model is not None and report.get("model") not in (None, model):
        raise DataError(f"{path}: a benchmark of model {report['model']} (recipe {report.get('recipe')}); this plan's "
                        f"model is {model}: calibrate with `fastvision benchmark` of this recipe")
    if k := _other_input(report, input_size):
        raise DataError(f"{path}: measured at task.args.{k}={_listed(report['input'][k])}, this plan's is "
                        f"{_listed(input_size[k])}: benchmark with --set task.args.{k}=... as the plan has it")
    try:
        gpu = get_gpu(str(report["gpu"]))
    except ConfigError as e:
        raise DataError(f"{path}: its 'gpu' field: {str(e).removeprefix('--gpu: ')}") from None
    rows = [r for r in (report["results"] if isinstance(report.get("results"), list) else []) if isinstance(r, dict)
            and _positive(r.get("items_per_s")) and _positive(r.get("batch_size")) and "precision" in r]
    if not rows:
        raise DataError(f"{path}: no measured rows")
    return gpu, rows


def _listed(v: Any) -> Any:  # a size as JSON gives it back (a tuple is a list there)
    return list(v) if isinstance(v, list | tuple) else v


def _other_input(report: dict[str, Any], input_size: dict[str, Any] | None) -> str | None:
    """The first ``task.args`` size key the benchmark (its ``input``, where recorded) measured otherwise."""
    measured = report.get("input")
    if not input_size or not isinstance(measured, dict):
        return None
    return next((k for k, v in input_size.items() if k in measured and _listed(measured[k]) != _listed(v)), None)


def _positive(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _step_points(rows: list[dict[str, Any]], want: str) -> tuple[str, list[tuple[int, float]]]:
    """``(precision, [(batch, step seconds)] by batch)`` of the rows at precision ``want`` (a half
    precision the benchmark lacks falls back to the other one, else the first row's); rows at the
    same batch size are averaged."""
    have = {r["precision"] for r in rows}
    order = [want] + [h for h in HALF_PRECISIONS if want in HALF_PRECISIONS and h != want]
    precision = next((p for p in order if p in have), rows[0]["precision"])
    by_batch: dict[int, list[float]] = {}
    for r in rows:
        if r["precision"] == precision:
            by_batch.setdefault(int(r["batch_size"]), []).append(r["batch_size"] / r["items_per_s"])
    return precision, sorted((b, sum(v) / len(v)) for b, v in by_batch.items())


def _split_step(points: list[tuple[int, float]], path: Path, precision: str, fixed: tuple[float, str],
                given: bool) -> tuple[float, float, str]:
    """``(fixed seconds per step, seconds per item, fixed source)``: the line through two or more
    batch sizes, else ``fixed`` taken off the largest batch's step (see
    :func:`calibration_from_benchmark`)."""
    name = Path(path).name
    b_ref, s_ref = points[-1]
    if len(points) >= 2 and not given:
        intercept, slope = step_line(points)
        if slope <= 0:
            raise DataError(f"{path}: the {precision} step does not grow with the batch ("
                            + ", ".join(f"batch {b}: {1e3 * s:.2f} ms" for b, s in points)
                            + "): it says nothing about compute per item; measure larger batch sizes")
        if intercept < 0:  # larger batches ran less efficiently per item: no fixed cost to measure
            return 0.0, s_ref / b_ref, f"none measurable in {name} (per-item time grows with the batch)"
        return intercept, slope, f"measured: intercept over {len(points)} batch sizes in {name}"
    fixed_s, fixed_source = fixed
    if not given:
        fixed_source += f" ({name} has one batch size: benchmark --batch-sizes A,B measures your own)"
    if fixed_s > 0.5 * s_ref:
        fixed_s, fixed_source = 0.5 * s_ref, fixed_source + ", capped at half the measured step"
    return fixed_s, (s_ref - fixed_s) / b_ref, fixed_source


def step_time(t: StepTrace, gpu: GPU, precision: str, achieved: tuple[float, float] = DEFAULT_ACHIEVED,
              calibrated: bool = False, traffic_scale: float = 1.0) -> tuple[float, float]:
    """(fast, slow) seconds per step on ``gpu`` for the traced FLOPs and memory traffic.

    Args:
        t: the traced step.
        gpu: target device.
        precision: fp32, tf32, fp16 or bf16 (the step's math).
        achieved: (low, high) fraction of peak dense math.
        calibrated: ``achieved`` came from a measured step that already includes memory traffic.
        traffic_scale: share of the traced traffic that remains (compile fuses elementwise ops).
    """
    peak, _ = gpu.peak_tflops(precision)
    lo, hi = achieved
    compute = [t.flops / (peak * 1e12 * f) for f in (hi, lo)]
    if calibrated:
        return compute[0], compute[1]
    # each created byte is written once and read at least once
    mem = 2 * t.traffic_bytes * traffic_scale / (gpu.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY)
    return max(compute[0], mem), compute[1] + mem


def scaling_efficiency(step_s: float, batch: int, grad_bytes: float, gpus: int, gpus_per_node: int,
                       link: str, hardware: str | None = None, input_rate: float | None = None) -> dict[str, Any]:
    """Data-parallel efficiency at ``gpus`` from the scaling simulator (weak scaling):
    :func:`fastvision.planning.scale.at_scale`."""
    return at_scale(step_s, batch, grad_bytes, gpus, gpus_per_node, link, hardware, input_rate)


def train_time(step_s: float, batch: int, gpus: int, efficiency: float, items: int, epochs: int) -> float:
    """Seconds to train ``epochs`` over ``items`` at ``batch`` per GPU on ``gpus`` (the batches a GPU steps)."""
    return epochs * epoch_seconds(items, gpus, batch, batch * gpus * efficiency / step_s)


# ------------------------------------------------------------------------------ recipe facts
def dataset_items(cfg: RunConfig, data: str | None = None, size: int | None = None) -> tuple[int | None, str]:
    """Training items per epoch: ``size``, else the dataset at ``data``, else the recipe's fact."""
    if size is not None:
        return size, "--dataset-size"
    if data:
        from fastvision import engine  # noqa: F401  (importing the engine registers every component)
        from fastvision.registry import DATASETS

        args = {**cfg.data.args, "path": data}
        splits = DATASETS.build(cfg.data.name, args, where="data.args")
        return len(splits.train), f"{data} (train split)"
    fact = DATASET_FACTS.get(cfg.recipe)
    return (fact[0], fact[1]) if fact else (None, "unknown: pass --data DIR or --dataset-size N")


def with_input_scale(cfg: RunConfig, scale: float) -> tuple[RunConfig, str, list[str]] | None:
    """``cfg`` with the input side (image size or patch size) scaled, a label, and the ``--set``
    overrides that make the same change to the recipe; None if the task has no input side.

    The task's size (what the trace feeds) and the dataset's (what training reads:
    ``data.args.patch_size`` or ``image_size``, where the recipe sets one) change together.
    A patch side stays a multiple of the largest power of two (up to 32) that divides the recipe's
    own side, so a network that needs the recipe's divisibility (a U-Net's 2**depth) still accepts it.
    """
    out = copy.deepcopy(cfg)
    args = out.task.args
    if "sample_shape" in args:
        c, *spatial = args["sample_shape"]
        steps = [min(32, s & -s) for s in spatial]
        new = [max(k, int(round(s * scale / k)) * k) for s, k in zip(spatial, steps, strict=True)]
        args["sample_shape"] = [c, *new]
        sets, what = [f"task.args.sample_shape={_flow([c, *new])}"], "patch " + "x".join(map(str, new))
    elif "image_size" in args:
        args["image_size"] = max(32, int(round(args["image_size"] * scale / 32)) * 32)
        new = [args["image_size"]] * 2
        sets, what = [f"task.args.image_size={args['image_size']}"], f"image {args['image_size']} px"
    else:
        return None
    for key in ("patch_size", "image_size"):
        if key in out.data.args:  # an int side or a list of sides, as the recipe writes it
            old = out.data.args[key]
            value = list(new[-len(old):]) if isinstance(old, (list, tuple)) else new[-1]
            out.data.args[key] = value
            sets.append(f"data.args.{key}={_flow(value)}")
            break
    return out, what, sets


def _flow(value) -> str:
    """A ``--set`` value without spaces: ``[1,64,64,64]``."""
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, (list, tuple)) else str(value)


def amp_for(amp: str, gpu: GPU) -> str:
    """``train.amp`` on ``gpu``: ``auto`` is bf16 where the GPU has bf16 tensor cores, else fp16
    (as :func:`fastvision.engine.runtime.resolve_amp` decides on a real device)."""
    if amp != "auto":
        return amp
    return "bf16" if gpu.bf16 else "fp16"


def precision_of(cfg: RunConfig) -> str:
    return training_precision(cfg.train.amp, cfg.train.tf32)
