"""``plan --gpus N`` at cluster scale: the one adapter between planning and the scaling simulator.

:func:`at_scale` gives the step, throughput per GPU and in total, efficiency and the binding limit at
N GPUs; :func:`largest_gpus` the largest N above an efficiency; :func:`input_rate_of`,
:func:`host_cores_for` and :func:`fixed_step_ms` say where the input path's rate, the node's host
cores and the fixed per-step cost come from. The fitted constants (fixed cost, stragglers' jitter)
are :func:`fastvision.scaling.validation.fitted`.
"""
from __future__ import annotations

import functools
from typing import Any

from fastvision.config import RunConfig
from fastvision.errors import ConfigError
from fastvision.planning.devices import GPU, get_gpu
from fastvision.scaling.validation import fitted, step_line  # noqa: F401 (step_line: for estimate's --calibrate)


@functools.lru_cache(maxsize=16)
def _hardware(name_or_path: str):
    """The simulator's hardware profile, read once: a plan asks :func:`at_scale` for every
    option, switch and GPU count of its curve."""
    from fastvision.scaling.simulator import load_hardware

    return load_hardware(name_or_path)


def at_scale(step_s: float, batch: int, grad_bytes: float, gpus: int, gpus_per_node: int, link: str,
             hardware: str | None = None, input_rate: float | None = None, fixed_s: float = 0.0,
             host_cores: int | None = None) -> dict[str, Any]:
    """One data-parallel step at ``gpus``: the one adapter between planning and the simulator.

    The simulator adds the all-reduce (two-level fabric, overlap with backward by bucket) and the
    stragglers (``jitter_ms`` fitted on the MLPerf anchors, :func:`fastvision.scaling.validation.fitted`)
    to the single-GPU step; the per-GPU batch stays the recipe's (weak scaling), so the fixed
    per-step cost is already inside ``step_s``. The host input path caps the per-GPU rate at
    ``cores per node x input_rate / GPUs on the node`` (at one GPU too: the traced step holds no
    input pipeline); it binds when that is below the GPU-side rate.

    Args:
        step_s: single-GPU step time at ``batch``.
        batch: per-GPU batch.
        grad_bytes: gradient bytes all-reduced per step.
        gpus: GPU count.
        gpus_per_node, link: the node shape and inter-node link preset, when no ``hardware``.
        hardware: a hardware profile (preset name or YAML file, ``fastvision/scaling/hardware/``).
        input_rate: items/s one host core decodes and augments; ``None``: no host limit known.
        fixed_s: the part of ``step_s`` that does not shrink with the batch (names the limit).
        host_cores: CPU cores per node when no ``hardware`` says (:func:`host_cores_for`).

    Returns:
        ``efficiency`` (per-GPU rate at ``gpus`` over that at one GPU), ``step_s``, ``items_per_s_gpu``,
        ``items_per_s``, ``gpu_items_per_s_gpu`` (the GPU-side rate, host unlimited), ``exposed_comm_s``,
        ``straggler_s``, ``limit``, ``cores_per_gpu`` (host cores a GPU needs to be fed at its GPU-side
        rate; None without ``input_rate``) and ``cores_available_per_gpu``.
    """
    from fastvision.scaling.simulator import LINKS, StepProfile, bucket_count, predict_step_time

    if hardware is not None:
        where = _hardware(hardware)
        extra, cores = {}, where.cpu_cores
    else:
        if link not in LINKS:
            raise ConfigError(f"--link: unknown {link!r}; valid: {', '.join(LINKS)}")
        where, extra, cores = LINKS[link], {"gpus_per_node": gpus_per_node}, host_cores
    prof = StepProfile(compute_s=step_s - fixed_s, batch=batch, grad_bytes=grad_bytes,
                       buckets=bucket_count(grad_bytes), overhead_s=fixed_s, jitter_s=fitted()["jitter_ms"] * 1e-3)

    def per_gpu(n: int) -> tuple[float, dict[str, Any], float]:
        p = predict_step_time(prof, n, where, **extra)
        on_node = min(n, gpus_per_node if hardware is None else where.gpus_per_node)
        cap = cores * input_rate / on_node if input_rate and cores else float("inf")
        return min(batch / p["step_s"], cap), p, cap

    one, _, _ = per_gpu(1)
    rate, many, cap = per_gpu(gpus)
    gpu_rate = batch / many["step_s"]  # what the GPU would take if the host kept up
    on_node = min(gpus, gpus_per_node if hardware is None else where.gpus_per_node)
    return {"efficiency": rate / one, "step_s": batch / rate, "items_per_s_gpu": rate, "items_per_s": rate * gpus,
            "gpu_items_per_s_gpu": gpu_rate, "exposed_comm_s": many["exposed_comm_s"],
            "straggler_s": many["straggler_s"], "limit": "input pipeline" if cap < gpu_rate else many["limit"],
            "cores_per_gpu": gpu_rate / input_rate if input_rate else None,
            "cores_available_per_gpu": cores / on_node if cores else None}


def largest_gpus(step_s: float, batch: int, grad_bytes: float, gpus_per_node: int, link: str,
                 hardware: str | None, input_rate: float | None, min_efficiency: float,
                 limit: int = 65536, fixed_s: float = 0.0, host_cores: int | None = None) -> int:
    """The largest GPU count (1, 2, 4, then whole nodes doubling up to ``limit``) whose efficiency
    stays at or above ``min_efficiency``, scanning upward until the first count below it."""
    counts = [n for n in (1, 2, 4) if n < gpus_per_node]
    n = gpus_per_node
    while n <= limit:
        counts.append(n)
        n *= 2
    best = 1
    for n in counts:
        e = at_scale(step_s, batch, grad_bytes, n, gpus_per_node, link, hardware, input_rate, fixed_s,
                     host_cores)["efficiency"]
        if e < min_efficiency:
            break
        best = n
    return best


def host_cores_for(gpu: GPU, gpus_per_node: int) -> tuple[int | None, str]:
    """``(CPU cores per node, source)`` when no ``--hardware`` is given: the cores per GPU of the shipped
    node preset built around the same GPU (a DGX H100 for an H100: 112 / 8), times the GPUs per node."""
    from fastvision.scaling.simulator import hardware_presets, load_hardware

    for name in hardware_presets():
        hw = load_hardware(name)
        try:
            same = get_gpu(hw.gpu).name == gpu.name
        except ConfigError:
            same = False
        if same:
            cores = round(hw.cpu_cores / hw.gpus_per_node * gpus_per_node)
            return cores, f"the {name} preset's {hw.cpu_cores / hw.gpus_per_node:g} cores per GPU; --hardware for yours"
    return None, "no node preset for this GPU: give --hardware"


def check_given(fixed_ms: float | None, input_rate: float | str | None) -> None:
    """``--fixed-ms`` and a number given as ``--input-rate`` in range (a benchmark JSON is read later)."""
    if fixed_ms is not None:
        fixed_step_ms(fixed_ms)
    try:
        rate = float(input_rate) if input_rate is not None else None
    except ValueError:
        return
    if rate is not None and not 0 < rate < float("inf"):  # nan slipped through a `<= 0` check
        raise ConfigError(f"--input-rate {rate}: items/s per host core must be a finite number > 0")


def fixed_step_ms(given: float | None = None) -> tuple[float, str]:
    """``(ms, source)``: the per-step cost that does not shrink with the batch (launches, optimizer,
    host). Given, or the value fitted on the PyTorch DDP implementation among the anchors (MLPerf v4.0
    RetinaNet: CUDA graphs, fused Adam, DALI; 64 H100 at 4 per GPU, held out at 2,528 H100 and 64 L40S,
    :func:`fastvision.scaling.validation.fitted`): fastvision's step is PyTorch DDP too. It is a floor
    for an eager step, whose launches are not graphed (measure two batch sizes with ``fastvision
    benchmark``); MLPerf's MXNet ResNet-50 gets by with less (``--fixed-ms 2.97``)."""
    if given is not None:
        if not 0 <= given < float("inf"):  # nan or inf planned every time as nan
            raise ConfigError(f"--fixed-ms {given}: must be a finite number >= 0")
        return float(given), "--fixed-ms"
    return fitted()["overhead_ms"]["mlperf-retinanet-pytorch"], "fitted on MLPerf RetinaNet, PyTorch DDP"


def decodes_on_gpu(cfg: RunConfig) -> bool:
    """The recipe's images are decoded by nvJPEG on the GPU: DALI's ``mixed`` decoder (``data.args``
    ``backend: dali`` with ``dali_device`` other than ``cpu``; ``auto`` is the GPU on a CUDA device), or
    torchvision's (``backend: nvjpeg``, whose host side reads bytes and draws crops: about 12,900 items
    per CPU-second measured, benchmarks/RESULTS.md, so no host limit at any GPU rate)."""
    args = cfg.data.args or {}
    if args.get("backend") == "nvjpeg":
        return True
    return args.get("backend") == "dali" and args.get("dali_device", "auto") != "cpu"


def input_rate_of(cfg: RunConfig, given: float | str | None = None) -> tuple[float | None, str]:
    """``(items/s per host core, source)`` of the recipe's input path for the planner's input limit.

    A measured rate wins: ``--input-rate`` as a number, or the path of a ``fastvision benchmark RECIPE
    --mode data`` JSON (its ``items_per_cpu_s`` under the recipe's cache mode). A JPEG folder decoded
    on the host (Pillow, or DALI on the CPU) takes the published per-process rate of the DLE PyTorch
    ResNet-50 loader (JPEG decode +
    RandomResizedCrop), calibrated in ``fastvision/scaling/anchors.yaml`` (``dle-pytorch-loader``:
    8,322 img/s on 8 V100 x 8 loader processes). DALI on the GPU decodes inside the step: no host
    limit. Other formats (cached volumes, COCO) have no published per-core rate: no limit, said so.
    """
    if isinstance(given, str):
        try:
            given = float(given)
        except ValueError:
            from fastvision.benchmark.data import read_input_rate

            return read_input_rate(given, "--input-rate", cfg.data.cache, cfg.data.name)
    if given is not None:
        check_given(None, given)
        return float(given), "--input-rate (measured)"
    if cfg.data.name != "imagefolder":
        return None, (f"not known for {cfg.data.name!r}, so the efficiency is a bound that ignores the host "
                      f"(an unmodelled host pipeline cost held-out TensorFlow rows up to 30 points at 4-8 GPUs: "
                      f"benchmarks/RESULTS.md); "
                      f"measure it: fastvision benchmark {cfg.recipe} --mode data --data DIR, then --input-rate "
                      f"runs/benchmark/{cfg.recipe}-data.json")
    if decodes_on_gpu(cfg):
        decoder = "nvJPEG (torchvision)" if (cfg.data.args or {}).get("backend") == "nvjpeg" else "DALI"
        return None, f"{decoder} decodes on the GPU: no host limit"
    from fastvision.scaling.validation import input_rates, load_anchors

    rate = input_rates(load_anchors())["dle-pytorch-loader"]
    return rate, "published: DLE PyTorch ResNet-50 loader, 8,322 img/s / (8 V100 x 8 processes)"


def rank_batches(items: int, gpus: int, batch: int) -> int:
    """Batches one GPU steps through in an epoch of ``items``, as training's sampler counts them
    (``TrainSampler(full_batches=True)``): the whole global batches of ``gpus x batch`` items, the partial last
    one dropped; where the set holds none, one short batch."""
    return items // (gpus * batch) if items >= gpus * batch else 1


def epoch_seconds(items: int, gpus: int, batch: int, items_per_s: float) -> float:
    """Seconds of an epoch of ``items`` on ``gpus`` at ``items_per_s`` over all of them: the batches a GPU
    steps (:func:`rank_batches`) x the step, not ``items / items_per_s``."""
    return rank_batches(items, gpus, batch) * batch * gpus / items_per_s


def shard_note(items: int, gpus: int, batch: int) -> str | None:
    """The plan's note where the set holds no whole global batch, so an epoch is one short step per GPU
    (:func:`rank_batches`; None where it holds one)."""
    if items >= gpus * batch:
        return None
    shard = -(-items // gpus)  # under one global batch the sampler shares the set out: the largest shard
    return (f"{items} items over {gpus} GPUs: under one global batch of {gpus} x {batch}, so an epoch is one step "
            f"per GPU (a GPU's shard is at most {shard} items of its batch of {batch}; the epoch time is that of one "
            "step); fewer GPUs or a smaller batch use them better")


def check_split(gpus: int, nodes: int | None) -> None:
    """``--gpus`` at least 1, over ``--nodes`` (given) at least 1 that split them evenly; else one line."""
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: must be >= 1")
    if nodes is not None and (nodes < 1 or gpus % nodes):
        raise ConfigError(f"--gpus {gpus} / --nodes {nodes}: nodes must be >= 1 and split the GPUs evenly")


def check_whole_nodes(gpus: int, per_node: int, hardware: str | None) -> None:
    """More GPUs than a node holds fill whole nodes (12 on 8-GPU nodes was planned as 1.5 nodes); else one line."""
    if gpus > per_node and gpus % per_node:
        raise ConfigError(f"--gpus {gpus}: not whole nodes of {per_node} GPUs"
                          + (f" ({hardware})" if hardware else "; pass --nodes N to split them otherwise"))
