"""The step-time terms that only show at cluster scale: stragglers, in-network reduction (SHARP across
nodes, NVLS inside one).

Used by :func:`fastvision.scaling.simulator.predict_step_time`; each term states where its form
comes from. The free constants (the per-step fixed cost of an implementation and the step-time
jitter) are not set here: :mod:`fastvision.scaling.validation` fits them on the calibration rows
of ``anchors.yaml`` and every other row is held out.
"""
from __future__ import annotations

import math

# Quantum-2 NDR InfiniBand switches have 64 ports; in a two-level fat tree half face down, so one
# leaf serves 32 nodes' rails and one extra level multiplies that by 32 (NVIDIA Quantum-2 QM9700
# data sheet: 64 x 400 Gb/s ports). Used for the SHARP tree depth only.
SWITCH_RADIX_DOWN = 32


def expected_max_normal(workers: int) -> float:
    """``E[max of N standard normals]`` to leading order: ``sqrt(2 ln N)`` (0 for one worker).

    The extreme-value (Gumbel) asymptote of the maximum of ``N`` independent normals; it is an
    upper bound on the exact expectation and within 10-25 % of it for N = 8..4096, which is the
    precision the fitted jitter can carry anyway.
    """
    return math.sqrt(2 * math.log(workers)) if workers > 1 else 0.0


def straggler_s(jitter_s: float, workers: int) -> float:
    """Time the synchronous step waits for the slowest of ``workers`` ranks.

    Each rank's step time jitters independently with standard deviation ``jitter_s`` (OS noise,
    clocks, host-side launch and input variation: an absolute time per step, independent of the
    batch, which is why it matters at a few milliseconds per step and not at a hundred). The
    all-reduce cannot finish before the slowest rank arrives, so the step grows by the expected
    maximum of the jitter: ``jitter_s * sqrt(2 ln N)``.
    """
    if jitter_s < 0:
        raise ValueError(f"jitter must be >= 0, got {jitter_s}")
    return jitter_s * expected_max_normal(workers)


def sharp_levels(nodes: int) -> int:
    """Switch levels a SHARP aggregation tree climbs for ``nodes`` nodes (1 within one leaf)."""
    return max(1, math.ceil(math.log(max(nodes, 2)) / math.log(SWITCH_RADIX_DOWN)))


def sharp_allreduce_s(nbytes: float, workers: int, gpus_per_node: int, intra_bw_gbps: float, intra_lat_us: float,
                      nic_bw_gbps: float, nic_lat_us: float) -> float:
    """Two-level all-reduce with in-network reduction across nodes (NCCL CollNet / SHARP).

    Inside a node a reduce-scatter and, at the end, an all-gather over NVLink (each
    ``(g-1)/g * S / intra_bw`` plus ``(g-1)`` hops). Each GPU then owns ``S/g`` bytes, which its own
    NIC rail sends up the switch tree once and receives once reduced: ``S/g / nic_bw`` (the switch
    does the reduction, so no ``2 (n-1)/n`` factor), plus one hop up and down per switch level.
    Single node: the intra-node part only.
    """
    g = min(workers, gpus_per_node)
    nodes = math.ceil(workers / gpus_per_node)
    intra = 2 * ((g - 1) / g * nbytes / (intra_bw_gbps * 1e9) + (g - 1) * intra_lat_us * 1e-6) if g > 1 else 0.0
    if nodes <= 1:
        return intra
    inter = nbytes / g / (nic_bw_gbps * 1e9) + 2 * sharp_levels(nodes) * nic_lat_us * 1e-6
    return intra + inter


def nvls_allreduce_s(nbytes: float, workers: int, gpus_per_node: int, nvls_bw_gbps: float, intra_lat_us: float,
                     nic_bw_gbps: float, nic_lat_us: float) -> float:
    """NCCL's NVLS inside a node (the NVSwitch reduces: NVLink SHARP) and NVLSTree across nodes.

    Inside a node the all-reduce moves at the NVLS bus bandwidth, ``2 (g-1)/g * S / nvls_busbw`` plus
    one switch hop each way (nccl-tests report busbw with that ``2 (g-1)/g`` factor; about 480 GB/s
    on 8 H100 against ~370 for the ring, NVIDIA/nccl-tests#212). Across nodes each GPU's ``S/g``
    shard goes over a double binary tree of its own rail: ``2 S/g / nic_bw`` plus
    ``2 log2(nodes)`` NIC hops.
    """
    g = min(workers, gpus_per_node)
    nodes = math.ceil(workers / gpus_per_node)
    intra = 2 * (g - 1) / g * nbytes / (nvls_bw_gbps * 1e9) + 2 * intra_lat_us * 1e-6 if g > 1 else 0.0
    if nodes <= 1:
        return intra
    return intra + 2 * nbytes / g / (nic_bw_gbps * 1e9) + 2 * math.ceil(math.log2(nodes)) * nic_lat_us * 1e-6
