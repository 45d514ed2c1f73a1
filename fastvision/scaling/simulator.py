"""Data-parallel step-time model: compute, host input pipeline, NCCL all-reduce and framework sync.

Predicts the throughput of synchronous data parallelism on ``N`` GPUs from one measured
single-GPU step (:class:`StepProfile`), a node description (:class:`Hardware`, YAML presets in
``fastvision/scaling/hardware/``), the recipe's input path (:class:`InputPipeline`) and the gradient
synchroniser (:class:`Backend`). Every row of :func:`simulate` names the limit that binds.

Model (times in seconds, sizes in bytes; ``docs/distributed.md`` states where it is known to be off):

1. **Compute.** The measured step at per-GPU batch ``b`` is ``compute_s`` (forward + backward, linear
   in the batch) plus ``optimizer_s`` and ``overhead_s`` (per step, independent of the batch: launch
   latency, Python, the optimizer). Weak scaling keeps ``b``; strong scaling uses ``b / N``, so the
   fixed part is what stops strong scaling.
2. **Communication.** Gradients travel in ``K`` buckets, bucket ``i`` ready at ``t_f + (i+1) t_b / K``
   during backward and all-reduced one after another on one stream. Within a node: NCCL ring over
   the intra-node link, ``2 (N-1)/N * S / busbw + 2 (N-1) * latency``. Across nodes NCCL picks the
   faster of ring (latency ``2 (N-1)`` hops) and double binary tree (latency
   ``2 (log2(nodes) * inter + (g-1) * intra)``, bandwidth ``2 S / busbw``); the bus bandwidth across
   nodes is ``min(intra busbw, g * NIC bandwidth per GPU)`` (every GPU has its own NIC rail).
3. **Framework sync.** Horovod reduces fused buffers on a background cycle: each of the
   ``ceil(G / fusion)`` buffers waits up to one cycle, ``cycle * ceil(G / fusion)`` exposed per step.
   DDP launches its bucket all-reduces from autograd hooks: no cycle.
4. **Host input pipeline.** A CPU input path with ``workers_per_gpu`` loader processes delivers
   ``per_core_items_s`` per process, ``min(cpu_threads, workers_per_gpu * gpus on the node)`` at once
   per node; a pool without a worker count (tf.data) gets ``per_core_items_s`` per physical core.
   The GPUs of a node share that. A GPU-side decoder (DALI "mixed") has no host limit: its cost
   is inside the measured step. The rate is the one with every worker of a node busy; the
   single-GPU measurement already holds its own input pipeline, so the limit applies from 2 GPUs
   on.
5. **Cluster scale** (:mod:`fastvision.scaling.terms`): the slowest of ``N`` ranks sets the step,
   ``+ jitter_s * sqrt(2 ln N)`` (expected maximum of N normal jitters); ``algo="sharp"``
   reduces across nodes in the switches (NCCL CollNet / SHARP: ``S/g / NIC bw`` once). The fixed
   per-step cost (``overhead_s``: launches, optimizer such as LARS, host) is what a small per-GPU
   batch cannot hide; it and ``jitter_s`` are fitted in :mod:`fastvision.scaling.validation`.
6. ``step = max(compute + exposed communication + sync + optimizer + overhead + stragglers, input)``;
   ``speedup(N) = throughput(N) / throughput(1)``. The binding limit is ``input pipeline`` when the
   input time is the larger; ``communication`` when the buckets' all-reduces outlast backward or the
   exposed communication and sync exceed 5 % of the step; else ``compute``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastvision.scaling.presets import HARDWARE_DIR, Hardware, Link, hardware_presets, load_hardware  # noqa: F401
from fastvision.scaling.report import simulation_markdown  # re-exported: the table of simulate() rows
from fastvision.scaling.terms import nvls_allreduce_s, sharp_allreduce_s, straggler_s

DEFAULT_WORKERS = tuple(2**i for i in range(11))


# Legacy link presets (``scale --links``): NVLink 3 with NVSwitch (NCCL busbw about 200-230 GB/s on
# 8xA100), HDR InfiniBand 200 Gb/s per GPU (about 23 GB/s achieved), 25 Gb Ethernet with TCP.
LINKS: dict[str, Link] = {
    "nvlink": Link("nvlink", 230.0, 3.0),
    "infiniband": Link("infiniband", 23.0, 6.0),
    "ethernet": Link("ethernet", 2.8, 35.0),
}


@dataclass(frozen=True)
class StepProfile:
    """One measured single-GPU training step.

    Attributes:
        compute_s: forward + backward time at per-GPU batch ``batch`` (scales with the batch).
        batch: per-GPU batch of the measurement.
        grad_bytes: bytes of gradients all-reduced per step (trainable parameters x element size).
        buckets: number of DDP gradient buckets (about ``ceil(grad_bytes / bucket_cap)``).
        backward_fraction: share of ``compute_s`` spent in backward.
        optimizer_s: optimizer step time (independent of the batch).
        overhead_s: other per-step time independent of the batch (launch latency, Python).
        jitter_s: standard deviation of one rank's step time in seconds (stragglers).
    """

    compute_s: float
    batch: int
    grad_bytes: float
    buckets: int = 1
    backward_fraction: float = 2 / 3
    optimizer_s: float = 0.0
    overhead_s: float = 0.0
    jitter_s: float = 0.0


@dataclass(frozen=True)
class InputPipeline:
    """A recipe's host input path (decode, crop, augment) as a throughput per CPU core.

    Attributes:
        name: label.
        device: ``"cpu"`` (host cores decode) or ``"gpu"`` (DALI-like GPU decode: no host limit).
        per_core_items_s: items/s one loader process (or, without ``workers_per_gpu``, one physical
            core) delivers; ``None``: unknown, no limit modelled.
        workers_per_gpu: loader processes per GPU; ``None``: a pool over every core of the node.
    """

    name: str = "none"
    device: str = "cpu"
    per_core_items_s: float | None = None
    workers_per_gpu: int | None = None


@dataclass(frozen=True)
class Backend:
    """How gradients are synchronised: DDP hooks (no cycle) or Horovod's fusion cycle.

    Attributes:
        name: label.
        cycle_ms: Horovod background cycle (HOROVOD_CYCLE_TIME); 0 for DDP.
        fusion_mb: Horovod fusion buffer in MiB (HOROVOD_FUSION_THRESHOLD); 0 for DDP.
    """

    name: str = "ddp"
    cycle_ms: float = 0.0
    fusion_mb: float = 0.0


# Horovod's defaults: 5 ms / 64 MB up to 0.20, 1 ms / 128 MB from 0.21.0 (its changelog, #2468).
# MLPerf v4.0 NVIDIA ResNet sets HOROVOD_CYCLE_TIME=0.1 and HOROVOD_FUSION_THRESHOLD=67108864
# (training_results_v4.0:NVIDIA/benchmarks/resnet/implementations/eos_n316_ngc24.04_mxnet/config_*.sh).
BACKENDS: dict[str, Backend] = {
    "ddp": Backend("ddp"),
    "horovod-mlperf": Backend("horovod-mlperf", 0.1, 64.0),
    "horovod": Backend("horovod", 1.0, 128.0),
    "horovod-0.20": Backend("horovod-0.20", 5.0, 64.0),
}


def bucket_count(grad_bytes: float, bucket_cap_mb: float = 25.0) -> int:
    """DDP-like bucket count for ``grad_bytes`` with buckets of ``bucket_cap_mb`` MiB."""
    return max(1, math.ceil(grad_bytes / (bucket_cap_mb * 2**20)))


def ring_allreduce_s(nbytes: float, workers: int, link: Link) -> float:
    """Ring all-reduce time: ``2 (N-1)/N * bytes / bw + 2 (N-1) * latency`` (0 for one worker)."""
    if workers <= 1:
        return 0.0
    steps = 2 * (workers - 1)
    return steps / workers * nbytes / (link.bandwidth_gbps * 1e9) + steps * link.latency_us * 1e-6


def tree_allreduce_s(nbytes: float, workers: int, hw: Hardware) -> float:
    """NCCL double binary tree across nodes (a chain inside each): ``2 S / busbw`` + log-depth latency."""
    nodes = math.ceil(workers / hw.gpus_per_node)
    if nodes <= 1:
        return ring_allreduce_s(nbytes, workers, hw.intra)
    lat = 2 * (math.ceil(math.log2(nodes)) * hw.nic.latency_us + (hw.gpus_per_node - 1) * hw.intra.latency_us)
    return 2 * nbytes / (inter_busbw_gbps(hw) * 1e9) + lat * 1e-6


def inter_busbw_gbps(hw: Hardware) -> float:
    """All-reduce bus bandwidth across nodes: the NIC rails of a node, capped by the intra-node link."""
    return min(hw.intra.bandwidth_gbps, hw.gpus_per_node * hw.nic.bandwidth_gbps)


def allreduce_s(nbytes: float, workers: int, hw: Hardware, algo: str = "auto") -> tuple[float, str]:
    """All-reduce time of ``nbytes`` over ``workers`` GPUs and the algorithm used.

    Args:
        nbytes: bytes per GPU.
        workers: GPUs.
        hw: node description.
        algo: ``"ring"``, ``"tree"``, ``"sharp"`` (in-network reduction across nodes, where the
            fabric has it), ``"nvls"`` (NVLink SHARP inside the node, tree across) or ``"auto"``
            (the faster of ring and tree, as NCCL's tuner picks).
    """
    if algo not in ("auto", "ring", "tree", "sharp", "nvls"):
        raise ValueError(f"algo must be auto, ring, tree, sharp or nvls, got {algo!r}")
    if workers <= 1:
        return 0.0, "none"
    if algo == "nvls":
        if not hw.nvls_gbps:
            raise ValueError(f"algo nvls: hardware {hw.name!r} states no node.intra.nvls_gbps")
        return nvls_allreduce_s(nbytes, workers, hw.gpus_per_node, hw.nvls_gbps, hw.intra.latency_us,
                                hw.nic.bandwidth_gbps, hw.nic.latency_us), "nvls"
    if algo == "sharp":
        return sharp_allreduce_s(nbytes, workers, hw.gpus_per_node, hw.intra.bandwidth_gbps, hw.intra.latency_us,
                                 hw.nic.bandwidth_gbps, hw.nic.latency_us), "sharp"
    if workers <= hw.gpus_per_node:
        return ring_allreduce_s(nbytes, workers, hw.intra), "ring"
    ring = ring_allreduce_s(nbytes, workers, Link("inter", inter_busbw_gbps(hw), hw.nic.latency_us))
    tree = tree_allreduce_s(nbytes, workers, hw)
    if algo == "ring" or (algo == "auto" and ring <= tree):
        return ring, "ring"
    return tree, "tree"


def input_limit_items_s(pipe: InputPipeline | None, hw: Hardware, workers: int) -> float:
    """Items/s the host input pipeline delivers per GPU at ``workers`` GPUs (inf: no host limit)."""
    if pipe is None or pipe.device != "cpu" or not pipe.per_core_items_s or workers <= 1:
        return math.inf
    on_node = min(workers, hw.gpus_per_node)
    threads = hw.cpu_threads or hw.cpu_cores
    cores = hw.cpu_cores if pipe.workers_per_gpu is None else min(threads, pipe.workers_per_gpu * on_node)
    return cores * pipe.per_core_items_s / on_node


def legacy_hardware(link: Link, gpus_per_node: int = 8, intra: Link = LINKS["nvlink"]) -> Hardware:
    """A :class:`Hardware` from the old (inter-node link, intra link, GPUs per node) arguments."""
    return Hardware(name=link.name, gpu="unknown", gpus_per_node=gpus_per_node, cpu_cores=0, intra=intra, nic=link)


def _overlapped_backward_end(compute: float, backward_fraction: float, buckets: int, bucket_s: float) -> float:
    """Seconds until forward, backward and every bucket's all-reduce are done (term 2's overlap).

    Bucket ``i`` of ``buckets`` is ready when its share of backward is, and the all-reduces of
    ``bucket_s`` each run one after another on one stream, so only the tail past backward shows.
    """
    t_b = compute * backward_fraction
    t_f = compute - t_b
    done = t_f  # end of the previous bucket's all-reduce
    for i in range(buckets):
        done = max(t_f + (i + 1) * t_b / buckets, done) + bucket_s
    return max(compute, done)


def _binding_limit(*, workers: int, compute: float, backward: float, comm: float, exposed: float, straggle: float,
                   fixed: float, gpu_step: float, input_s: float, step: float) -> str:
    """Which term sets a predicted step (all times in seconds): ``input pipeline`` when the host is
    slower than the GPU, then ``communication``, ``stragglers``, ``fixed per-step cost`` or ``compute``."""
    if input_s > gpu_step:
        return "input pipeline"
    if workers > 1 and (comm > backward or exposed > 0.05 * step) and exposed >= max(straggle, fixed):
        return "communication"
    if workers > 1 and straggle > 0.05 * step and straggle >= fixed:
        return "stragglers"
    if fixed > compute:
        return "fixed per-step cost"
    return "compute"


def predict_step_time(profile: StepProfile, workers: int, hardware: Hardware | Link | str, *, mode: str = "weak",
                      gpus_per_node: int = 8, intra: Link = LINKS["nvlink"], pipeline: InputPipeline | None = None,
                      backend: Backend | str = "ddp", algo: str = "auto",
                      per_worker_batch: float | None = None) -> dict[str, Any]:
    """Predicted step of ``workers`` synchronous data-parallel GPUs.

    Args:
        profile: the measured single-GPU step.
        workers: number of GPUs ``N``.
        hardware: a :class:`Hardware`, a preset name, or (old form) the inter-node :class:`Link`,
            then with ``gpus_per_node`` and ``intra``.
        mode: ``"weak"`` (per-GPU batch fixed) or ``"strong"`` (global batch = ``profile.batch``).
        gpus_per_node: GPUs per node of the old form (ignored with a :class:`Hardware`).
        intra: intra-node link of the old form.
        pipeline: host input path; ``None``: no input limit.
        backend: gradient synchroniser (:data:`BACKENDS` name or :class:`Backend`).
        algo: all-reduce algorithm beyond one node (``auto``, ``ring``, ``tree``).
        per_worker_batch: explicit per-GPU batch (overrides ``mode``).

    Returns:
        ``step_s``, ``gpu_step_s`` (without the input limit), ``input_s``, ``comm_s`` (all buckets),
        ``exposed_comm_s`` (communication and sync not hidden behind backward), ``sync_s``,
        ``straggler_s`` (waiting for the slowest rank), ``fixed_s`` (optimizer + overhead), ``algo``,
        ``per_worker_batch``, ``images_per_s`` (all GPUs), ``limit`` (``compute``, ``input pipeline``,
        ``communication``, ``stragglers`` or ``fixed per-step cost``).
    """
    if mode not in ("weak", "strong"):
        raise ValueError(f"mode must be 'weak' or 'strong', got {mode!r}")
    hw = _hardware(hardware, gpus_per_node, intra)
    be = BACKENDS[backend] if isinstance(backend, str) else backend
    per_worker = per_worker_batch or (profile.batch if mode == "weak" else profile.batch / workers)
    compute = profile.compute_s * per_worker / profile.batch
    k = bucket_count(profile.grad_bytes, be.fusion_mb) if be.fusion_mb else max(1, profile.buckets)
    c, used = allreduce_s(profile.grad_bytes / k, workers, hw, algo)
    end = _overlapped_backward_end(compute, profile.backward_fraction, k, c) if workers > 1 else compute
    sync = be.cycle_ms * 1e-3 * k if workers > 1 else 0.0
    gpu_step = end + sync + profile.optimizer_s + profile.overhead_s
    straggle = straggler_s(profile.jitter_s, workers)
    gpu_step += straggle
    per_gpu_input = input_limit_items_s(pipeline, hw, workers)
    input_s = per_worker / per_gpu_input if math.isfinite(per_gpu_input) else 0.0
    step = max(gpu_step, input_s)
    exposed = end - compute + sync
    fixed = profile.optimizer_s + profile.overhead_s
    limit = _binding_limit(workers=workers, compute=compute, backward=compute * profile.backward_fraction,
                           comm=k * c, exposed=exposed, straggle=straggle, fixed=fixed, gpu_step=gpu_step,
                           input_s=input_s, step=step)
    return {"step_s": step, "gpu_step_s": gpu_step, "input_s": input_s, "comm_s": k * c if workers > 1 else 0.0,
            "exposed_comm_s": exposed, "sync_s": sync, "straggler_s": straggle, "fixed_s": fixed, "algo": used,
            "per_worker_batch": per_worker,
            "images_per_s": per_worker * workers / step, "limit": limit}


def simulate(profile: StepProfile, hardware: Hardware | Link | str, workers: Sequence[int] = DEFAULT_WORKERS, *,
             mode: str = "weak", gpus_per_node: int = 8, intra: Link = LINKS["nvlink"],
             pipeline: InputPipeline | None = None, backend: Backend | str = "ddp",
             algo: str = "auto") -> list[dict[str, Any]]:
    """Predicted speed-up, efficiency and binding limit for each GPU count (default 1, 2, 4, ..., 1024).

    Args:
        profile, hardware, mode, gpus_per_node, intra, pipeline, backend, algo: as
            :func:`predict_step_time`.
        workers: GPU counts. In strong mode counts above the global batch are skipped.

    Returns:
        One dict per GPU count: the keys of :func:`predict_step_time` plus ``hardware``, ``link``
        (same name, for the old callers), ``workers``, ``mode``, ``speedup``, ``efficiency``.
    """
    hw = _hardware(hardware, gpus_per_node, intra)
    kw = dict(mode=mode, pipeline=pipeline, backend=backend, algo=algo)
    base = predict_step_time(profile, 1, hw, **kw)
    rows = []
    for n in workers:
        if mode == "strong" and n > profile.batch:
            continue
        p = predict_step_time(profile, n, hw, **kw)
        speedup = p["images_per_s"] / base["images_per_s"]
        rows.append({"hardware": hw.name, "link": hw.name, "workers": n, "mode": mode, **p,
                     "speedup": speedup, "efficiency": speedup / n})
    return rows


def with_link(link: Link, bandwidth_gbps: float | None = None, latency_us: float | None = None) -> Link:
    """``link`` with measured bandwidth / latency substituted where given."""
    changes = {k: v for k, v in (("bandwidth_gbps", bandwidth_gbps), ("latency_us", latency_us)) if v is not None}
    return replace(link, name=link.name + ("*" if changes else ""), **changes)


def _hardware(hardware: Hardware | Link | str, gpus_per_node: int, intra: Link) -> Hardware:
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, Link):
        return legacy_hardware(hardware, gpus_per_node, intra)
    return load_hardware(hardware)


__all__ = ["BACKENDS", "Backend", "DEFAULT_WORKERS", "Hardware", "InputPipeline", "LINKS", "Link", "StepProfile",
           "allreduce_s", "bucket_count", "hardware_presets", "input_limit_items_s", "load_hardware",
           "predict_step_time", "ring_allreduce_s", "simulate", "simulation_markdown", "tree_allreduce_s",
           "with_link"]
