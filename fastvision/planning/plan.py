"""``fastvision plan RECIPE --gpu H100-80GB --gpus 64``: size a run before it is submitted.

Traces one training step of the recipe on fake tensors (no device needed) and reports: memory at
the recipe's batch by part, the largest per-GPU batch that fits, step time, epoch time, the
scaling simulator's efficiency at the GPU count, time to train the recipe's epochs, GPU-hours and
cost, and the switches that change the answer most (precision, compile, activation checkpointing,
input / patch size, GPU decode of a JPEG folder), each with the ``--set`` overrides that flip it.
Table on stdout, ``--json`` and ``--png`` (time and cost against GPU count;
:mod:`fastvision.planning.plan_report`).
Estimates are ranges; docs/plan.md says how each is made and how well memory matched on a CPU.
"""
from __future__ import annotations

import copy
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastvision.config import RunConfig
from fastvision.errors import ConfigError, check_low
from fastvision.planning import estimate as est
from fastvision.planning import forecast as fc
from fastvision.planning import scale as sc
from fastvision.planning.devices import GPU, GPUS, get_gpu

log = logging.getLogger(__name__)


def _gm(pair: tuple[float, float]) -> float:
    return math.sqrt(pair[0] * pair[1])


def _option(cfg: RunConfig, t, gpu: GPU, gpus: int, gpus_per_node: int, link: str, hardware: str | None,
            items: int | None, achieved, calibrated: bool, compile: bool, batch: int,
            precision: str, input_rate: float | None = None, fixed_s: float = 0.0,
            host_cores: int | None = None) -> dict[str, Any]:
    """Memory, step, epoch and train time of one configuration (one trace)."""
    mem = est.memory(t, compile)
    scale = 1 - t.recomputable / max(1, t.activations) if compile else 1.0
    fast, slow = est.step_time(t, gpu, precision, achieved, calibrated, traffic_scale=scale)
    fast, slow = fast + fixed_s, slow + fixed_s  # a calibrated share is of the compute alone (measured line)
    row: dict[str, Any] = {"batch": batch, "precision": gpu.peak_tflops(precision)[1], "compile": compile,
                           "memory_gib": mem.total / 2**30, "fits": est.fits(mem.total, gpu),
                           "memory_parts_gib": mem.gib(), "largest_batch": est.linear_batch(t, gpu, compile),
                           "step_s": [fast, slow], "flops_per_step": t.flops, "traffic_bytes": t.traffic_bytes}
    effs = [sc.at_scale(s, batch, t.grad_bytes, gpus, gpus_per_node, link, hardware, input_rate, fixed_s, host_cores)
            for s in (fast, slow)]
    row["efficiency"] = [e["efficiency"] for e in effs]
    row["scale"] = effs
    if items:
        ep = [sc.epoch_seconds(items, gpus, batch, e["items_per_s"]) for e in effs]
        row["epoch_s"] = ep
        row["train_s"] = [v * cfg.train.epochs for v in ep]
        row["gpu_hours"] = [v / 3600 * gpus for v in row["train_s"]]
    return row


@dataclass(frozen=True)
class Cluster:
    """Where the recipe would train.

    Attributes:
        gpu: a :data:`fastvision.planning.devices.GPUS` name; None: the hardware profile's GPU,
            else A100-80GB.
        gpus: total GPUs; ``nodes`` splits them (default: up to 8 per node).
        link: inter-node link preset of the scaling simulator.
        hardware: a node profile of the simulator (``dgx-h100``, ``pcie-node``, a YAML file); sets
            GPUs per node, links and, when ``gpu`` is None, the GPU.
        price: price per GPU-hour, for the cost.
    """

    gpu: str | None = None
    gpus: int = 1
    nodes: int | None = None
    link: str = "infiniband"
    hardware: str | None = None
    price: float | None = None


@dataclass(frozen=True)
class Workload:
    """What is trained where it differs from the recipe, and how close to peak the GPU runs.

    Attributes:
        data, dataset_size: the training set (else the recipe's stated size).
        batch: per-GPU batch (default: the recipe's).
        achieved: (low, high) share of peak dense math; ``calibrate``: a benchmark JSON instead.
        input_rate: items/s one host core delivers through the recipe's input path (measured), or
            the path of a ``benchmark --mode data`` JSON that holds it.
        fixed_ms: per-step time that does not shrink with the batch (launches, optimizer, host);
            ``None``: with ``calibrate``, the intercept of the benchmark's batch sizes, else the value
            fitted on the MLPerf anchors (small batches are slower per item). Given, it wins over both.
        epochs_from: a ``benchmark --mode target`` JSON: the seeds' epochs to the target, for the
            time-to-target forecast (:mod:`fastvision.planning.forecast`); its runs' epoch size is the
            dataset unless ``data`` / ``dataset_size`` is given.
    """

    data: str | None = None
    dataset_size: int | None = None
    batch: int | None = None
    achieved: tuple[float, float] | None = None
    calibrate: str | None = None
    input_rate: float | str | None = None
    fixed_ms: float | None = None
    epochs_from: str | None = None


def _place(cluster: Cluster) -> tuple[GPU, int, str]:
    """``(GPU spec, GPUs per node, link name)`` of a cluster."""
    hw = None
    if cluster.hardware is not None:
        from fastvision.scaling.simulator import load_hardware

        hw = load_hardware(cluster.hardware)
    gpus, nodes = cluster.gpus, cluster.nodes
    sc.check_split(gpus, nodes)
    spec = get_gpu(cluster.gpu or (hw.gpu if hw else "A100-80GB"))
    per_node = hw.gpus_per_node if hw else gpus // nodes if nodes else min(gpus, 8)
    sc.check_whole_nodes(gpus, per_node, hw.name if hw else None)
    return spec, per_node, hw.name if hw else cluster.link


def _achieved(work: Workload, cfg: RunConfig, t, spec: GPU,
              precision: str) -> tuple[tuple[float, float], bool, str, float, str]:
    """``(achieved range, calibrated, source, fixed ms, fixed source)``: from a benchmark JSON (its
    batch sizes give the fixed per-step cost as the intercept of step time against batch), else from
    the shipped measurement of this recipe on this GPU model (:func:`estimate.shipped_measurement`),
    else the given range or the default with ``--fixed-ms`` or the fitted fixed cost."""
    from fastvision.benchmark.modes import input_size

    fixed_ms, fixed_source = sc.fixed_step_ms(work.fixed_ms)
    measured = work.calibrate
    if not measured and not work.achieved:
        measured = est.shipped_measurement(cfg.recipe, spec, precision, cfg.train.channels_last, input_size(cfg))
    if measured:
        f, fixed_s, source, fixed_source = est.calibration_from_benchmark(
            Path(measured), t, cfg.train.amp, cfg.train.tf32, (fixed_ms / 1e3, fixed_source),
            given=work.fixed_ms is not None, model=cfg.model.name, input_size=input_size(cfg))
        if not work.calibrate:
            source = f"shipped measurement, {source} ({Path(measured).name}; --achieved or --calibrate to replace)"
        return (0.85 * f, 1.15 * f), True, source, fixed_s * 1e3, fixed_source
    if work.achieved:
        return work.achieved, False, "given (--achieved)", fixed_ms, fixed_source
    return est.DEFAULT_ACHIEVED, False, "default range", fixed_ms, fixed_source


def _dataset(cfg: RunConfig, work: Workload, target_runs: dict | None) -> tuple[int | None, str]:
    """Training items per epoch: ``--data`` / ``--dataset-size``, else the ``--epochs-from`` runs' epoch
    (the data their epochs were measured on), else the recipe's known size."""
    measured = fc.measured_items(target_runs) if target_runs else None
    if measured and work.data is None and work.dataset_size is None:
        return measured, f"the --epochs-from runs' epoch ({work.epochs_from})"
    return est.dataset_items(cfg, work.data, work.dataset_size)


def _check_numbers(cluster: Cluster, work: Workload, min_efficiency: float | None) -> None:
    """Refuse a batch, data set size, price or efficiency out of range, naming its option."""
    if min_efficiency is not None and not 0 < min_efficiency <= 1:
        raise ConfigError(f"--min-efficiency {min_efficiency}: must be in (0, 1], e.g. 0.8")
    if work.data is not None and work.dataset_size is not None:  # one would be dropped without a word
        raise ConfigError(f"--data {work.data} and --dataset-size {work.dataset_size}: give one "
                          "(both set the epoch size)")
    sc.check_given(work.fixed_ms, work.input_rate)  # before the trace
    for flag, value, low in (("--batch-size", work.batch, 1), ("--dataset-size", work.dataset_size, 1),
                             ("--price-per-gpu-hour", cluster.price, 0)):
        check_low(flag, value, low)


def make_plan(cfg: RunConfig, cluster: Cluster = Cluster(), work: Workload = Workload(),
              switches: bool = True, min_efficiency: float | None = None) -> dict[str, Any]:
    """The plan of ``cfg`` on ``cluster`` as a JSON-able dict (see the module docstring).

    Args:
        cfg: the loaded recipe (its batch, precision, channels_last, compile and epochs).
        cluster: GPU model and count, nodes, link or hardware profile, price.
        work: data set size, batch and achieved share of peak where they differ from the recipe.
        switches: also trace the what-if switches.
        min_efficiency: also report the largest GPU count whose efficiency stays at or above it.
    """
    _check_numbers(cluster, work, min_efficiency)
    spec, per_node, link = _place(cluster)
    gpus, price = cluster.gpus, cluster.price
    if cfg.train.amp == "auto":
        cfg = copy.deepcopy(cfg)
        cfg.train.amp = est.amp_for("auto", spec)
    b = cfg.train.batch_size if work.batch is None else work.batch
    precision = est.precision_of(cfg)
    notes = []
    if spec.peak_tflops(precision)[1] != precision:
        notes.append(f"{spec.name} has no {precision} tensor cores: timed at fp32 peak")
    target_runs = fc.load_report(work.epochs_from) if work.epochs_from else None  # checked before the trace
    input_rate, input_source = sc.input_rate_of(cfg, work.input_rate)  # a benchmark JSON too: read before it
    t = est.trace(cfg, b)
    achieved, calibrated, source, fixed_ms, fixed_source = _achieved(work, cfg, t, spec, precision)
    items, items_source = _dataset(cfg, work, target_runs)
    if items is None:
        notes.append(f"dataset size {items_source}; epoch and train time left out")
    elif note := sc.shard_note(items, gpus, b):
        notes.append(note)
    host_cores, host_source = (None, f"the {cluster.hardware} node") if cluster.hardware else \
        sc.host_cores_for(spec, per_node)
    args = dict(gpu=spec, gpus=gpus, gpus_per_node=per_node, link=link, hardware=cluster.hardware, items=items,
                achieved=achieved, calibrated=calibrated, input_rate=input_rate,
                fixed_s=fixed_ms / 1e3, host_cores=host_cores)
    base = _option(cfg, t, compile=cfg.train.compile, batch=b, precision=precision, **args)
    base["largest_batch"] = est.largest_batch(cfg, spec, t, cfg.train.compile)
    plan = {"recipe": cfg.recipe, "gpu": spec.name, "gpu_memory_gib": spec.memory_gib, "gpus": gpus,
            "gpus_per_node": per_node, "link": link, "hardware": cluster.hardware, "epochs": cfg.train.epochs,
            "dataset_items": items, "dataset_source": items_source, "achieved": list(achieved),
            "achieved_source": source, "price_per_gpu_hour": price, "params": t.param_count,
            "grad_bytes": t.grad_bytes, "channels_last": cfg.train.channels_last, "estimate": base, "notes": notes,
            "input_rate_per_core": input_rate, "input_source": input_source, "min_efficiency": min_efficiency,
            "host_source": host_source, "fixed_ms": fixed_ms, "fixed_source": fixed_source}
    if min_efficiency is not None:
        plan["largest_gpus"] = [sc.largest_gpus(s, b, t.grad_bytes, per_node, link, cluster.hardware, input_rate,
                                                 min_efficiency, fixed_s=args["fixed_s"], host_cores=host_cores)
                              for s in base["step_s"]]
    if price is not None and "gpu_hours" in base:
        base["cost"] = [h * price for h in base["gpu_hours"]]
    if target_runs:  # without an epoch size (no --data, an older report) the note says so
        plan["forecast"], more = fc.forecast(target_runs, str(work.epochs_from), base.get("epoch_s"), gpus, price,
                                             cfg.recipe, b * gpus * cfg.train.accum_steps, items)
        notes += more
    if switches:
        plan["switches"] = _switches(cfg, t, base, spec, b, precision, price, args)
    plan["curve"] = _curve(base, t, b, per_node, link, cluster.hardware, items, cfg.train.epochs, price, gpus,
                           input_rate, args["fixed_s"], host_cores, plan.get("forecast"))
    return plan


def _switches(cfg, t, base, spec: GPU, b: int, precision: str, price, args) -> list[dict[str, Any]]:
    """One row per switch, sorted by how much it changes the time to train (else memory). Each row
    names the ``--set`` overrides that make its change: a switch the user can flip."""
    rows = []
    other = "off" if cfg.train.amp != "off" else ("bf16" if spec.bf16 else "fp16")
    alt = est.trace(cfg, b, amp=other)
    rows.append(("amp " + other, [f"train.amp={other}"],
                 _option(cfg, alt, compile=cfg.train.compile, batch=b,
                         precision=est.training_precision(other, cfg.train.tf32), **args)))
    compile = not cfg.train.compile
    rows.append((f"compile {'on' if compile else 'off'}", [f"train.compile={str(compile).lower()}"],
                 _option(cfg, t, compile=compile, batch=b, precision=precision, **args)))
    ckpt = not cfg.train.activation_checkpointing
    try:
        ck = est.trace(cfg, b, checkpointing=ckpt)
        rows.append((f"activation checkpointing {'on' if ckpt else 'off'}",
                     [f"train.activation_checkpointing={str(ckpt).lower()}"],
                     _option(cfg, ck, compile=cfg.train.compile, batch=b, precision=precision, **args)))
    except ConfigError as e:  # a model that declares no checkpointable blocks
        log.info("no activation checkpointing row: %s", e)
    smaller = est.with_input_scale(cfg, 0.75)
    if smaller is not None:
        small_cfg, what, sets = smaller
        rows.append((what, sets, _option(small_cfg, est.trace(small_cfg, b), compile=cfg.train.compile, batch=b,
                                         precision=precision, **args)))
    gpu_input = _gpu_input_switch(cfg)
    if gpu_input is not None:
        # the same traced step, no host limit: DALI's "mixed" decoder runs nvJPEG on the GPU (the simulator's
        # dali-gpu path; its decode time is not in the roofline step, so this row is the bound it removes)
        name, sets, dali_cfg = gpu_input
        rows.append((name, sets, _option(dali_cfg, t, compile=cfg.train.compile, batch=b, precision=precision,
                                         **dict(args, input_rate=None))))
    out = []
    for name, sets, row in rows:
        row["switch"], row["set"] = name, sets
        if price is not None and "gpu_hours" in row:
            row["cost"] = [h * price for h in row["gpu_hours"]]
        key = "train_s" if "train_s" in row else "step_s"
        row["change"] = _gm(row[key]) / _gm(base[key]) - 1
        row["memory_change"] = row["memory_gib"] / base["memory_gib"] - 1
        out.append(row)
    # time to train first (to the percent printed), then memory: a switch that trains faster outranks
    # one that saves memory
    return sorted(out, key=lambda r: (-round(abs(r["change"]), 2), -abs(r["memory_change"])))


def _gpu_input_switch(cfg: RunConfig) -> tuple[str, list[str], RunConfig] | None:
    """``(name, --set overrides, config)`` that moves a JPEG folder's decode from host cores to the GPU
    (DALI ``mixed``: nvJPEG), or None where the recipe already decodes on the GPU or reads another format."""
    if cfg.data.name != "imagefolder" or sc.decodes_on_gpu(cfg):
        return None
    args = cfg.data.args or {}
    changes = {"backend": "dali"} if args.get("backend") != "dali" else {}
    if args.get("dali_device") == "cpu":  # auto (the default) is the GPU on a CUDA device
        changes["dali_device"] = "gpu"
    dali = copy.deepcopy(cfg)
    dali.data.args = {**args, **changes}
    return "decode on the GPU (DALI)", [f"data.args.{k}={v}" for k, v in changes.items()], dali


def _curve(base, t, b, per_node, link, hardware, items, epochs, price, gpus, input_rate,
           fixed_s, host_cores, forecast: dict | None = None) -> list[dict[str, Any]]:
    """Time to train and cost (middle of the range) against GPU count, for the PNG; with a forecast
    also the time to its target at the seeds' median epochs and at their fewest and most."""
    counts = [2**i for i in range(0, 11) if 2**i <= max(64, 4 * gpus)]
    step = _gm(base["step_s"])
    rows = []
    for n in counts:
        e = sc.at_scale(step, b, t.grad_bytes, n, min(n, per_node), link, hardware, input_rate, fixed_s,
                         host_cores)["efficiency"]
        row = {"gpus": n, "efficiency": e}
        if items:
            row["train_h"] = est.train_time(step, b, n, e, items, epochs) / 3600
            if price is not None:
                row["cost"] = row["train_h"] * n * price
            if forecast:
                row["target_h"] = [est.train_time(step, b, n, e, items, k) / 3600 for k in
                                   (forecast["epochs"][0], forecast["epochs_median"], forecast["epochs"][-1])]
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ CLI
def add_cli(subparsers) -> None:
    """``fastvision plan RECIPE``."""
    p = subparsers.add_parser("plan", help="memory, largest batch, step time, scaling, time and cost on GPUs "
                                           "you do not have (no device needed)",
                              description="Trace one training step of a recipe on fake tensors and size a run: "
                                          "memory by part, largest batch, step time, time to train and cost.")
    p.add_argument("recipe", help="shipped recipe name or YAML file")
    p.add_argument("--gpu", help=f"GPU model: {', '.join(GPUS)} (default: the --hardware node's, else A100-80GB)")
    p.add_argument("--gpus", type=int, default=1, help="total GPUs (default 1)")
    p.add_argument("--nodes", type=int, help="nodes the GPUs are spread over (default: 8 GPUs per node)")
    p.add_argument("--link", default="infiniband", help="inter-node link preset: nvlink, infiniband, ethernet")
    from fastvision.scaling.presets import hardware_presets

    p.add_argument("--hardware", help="node profile for the scaling simulator instead of --link: a preset "
                                      f"({', '.join(hardware_presets())}) or a YAML file (sets GPUs per node)")
    p.add_argument("--price-per-gpu-hour", type=float, help="price of one GPU-hour, for the cost")
    p.add_argument("--data", help="dataset folder: its training split sets the epoch size")
    p.add_argument("--dataset-size", type=int, help="training items per epoch (instead of --data)")
    p.add_argument("--batch-size", type=int, help="per-GPU batch (default: the recipe's)")
    p.add_argument("--achieved", help="LOW,HIGH share of peak dense math, e.g. 0.2,0.5 (default "
                                      f"{est.DEFAULT_ACHIEVED[0]},{est.DEFAULT_ACHIEVED[1]})")
    p.add_argument("--calibrate", help="a `fastvision benchmark --mode train` JSON measured on any GPU. Rows at two "
                                       "or more batch sizes (`benchmark --batch-sizes 8,32`): the intercept of step "
                                       "time against batch is the fixed per-step cost; one batch size: --fixed-ms "
                                       "or the fitted default splits it")
    p.add_argument("--min-efficiency", type=float, help="also report the largest GPU count whose scaling efficiency "
                                                        "stays at or above this share, e.g. 0.8")
    p.add_argument("--input-rate", metavar="RATE|JSON",
                   help="items/s per host core through the recipe's input path, or the JSON of `fastvision "
                        "benchmark RECIPE --mode data --data DIR` (its items/s per core); default: published for "
                        "JPEG folders, none for other formats (the efficiency is then an upper bound)")
    p.add_argument("--fixed-ms", type=float, help="per-step time that does not shrink with the batch (launches, "
                                                  "optimizer, host); default: the --calibrate JSON's intercept, "
                                                  "else fitted on MLPerf RetinaNet (PyTorch DDP, CUDA graphs), a "
                                                  "floor for an eager step. Given, it wins over both")
    p.add_argument("--epochs-from", metavar="JSON",
                   help="a `fastvision benchmark RECIPE --mode target` report: forecast the time to its target "
                        "as a distribution (its seeds' epochs x this plan's epoch time); its runs' epoch size is "
                        "the dataset unless --data / --dataset-size says otherwise")
    p.add_argument("--no-switches", action="store_true", help="skip the what-if switches (fewer traces)")
    p.add_argument("--json", type=Path, help="write the plan as JSON")
    p.add_argument("--png", type=Path, help="write time and cost against GPU count")
    p.add_argument("--force", action="store_true", help="replace an existing --json / --png file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (repeatable)")
    p.set_defaults(func=cmd_plan)


def _pair(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"--achieved {text!r}: expected LOW,HIGH, e.g. 0.2,0.5") from None
    if not 0 < lo <= hi <= 1:
        raise ConfigError(f"--achieved {text!r}: need 0 < LOW <= HIGH <= 1")
    return lo, hi


def cmd_plan(args) -> int:
    from fastvision.config import load, parse_override
    from fastvision.planning.plan_report import check_outputs, plot, text_report
    from fastvision.utils.files import atomic_text

    cfg = load(args.recipe, [parse_override(s) for s in args.set])
    # the plan traces the model and task but builds no dataset: check data.args as training's build will,
    # so a mistyped override (data.args.backnd=dali) is an error here, not a plan of the recipe as it was
    from fastvision.registry import DATASETS, check_kwargs

    check_kwargs(DATASETS.get(cfg.data.name), cfg.data.args or {}, "data.args")
    cluster = Cluster(gpu=args.gpu, gpus=args.gpus, nodes=args.nodes, link=args.link, hardware=args.hardware,
                      price=args.price_per_gpu_hour)
    work = Workload(data=args.data, dataset_size=args.dataset_size, batch=args.batch_size,
                    achieved=_pair(args.achieved) if args.achieved else None, calibrate=args.calibrate,
                    input_rate=args.input_rate, fixed_ms=args.fixed_ms, epochs_from=args.epochs_from)
    check_outputs(args.json, args.png, args.force)  # refused before the trace, not after it
    plan = make_plan(cfg, cluster, work, switches=not args.no_switches, min_efficiency=args.min_efficiency)
    print(text_report(plan))  # the CLI's output, not library logging
    if args.json:
        atomic_text(args.json, json.dumps(plan, indent=2) + "\n")  # whole, or the file before: never half
        print(f"wrote {args.json}")
    if args.png:
        print(f"wrote {plot(plan, args.png)}")
    return 0
