"""The cluster-scale terms on hand-computed cases, the fit of their constants, and the held-out rows."""
from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest

from fastvision.scaling import terms
from fastvision.scaling import validation as sv
from fastvision.scaling.simulator import Hardware, Link, StepProfile, allreduce_s, predict_step_time

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "RESULTS.md"


def node(gpus=8, intra=(100.0, 0.0), nic=(10.0, 0.0)) -> Hardware:
    return Hardware("t", "X", gpus, 64, Link("intra", *intra), Link("nic", *nic))


@pytest.mark.parametrize("n,expected", [(1, 0.0), (2, math.sqrt(2 * math.log(2))), (8, 2.0393)])
def test_expected_max_of_n_normals(n, expected):
    assert terms.expected_max_normal(n) == pytest.approx(expected, abs=1e-4)


def test_straggler_is_the_jitter_times_sqrt_2_ln_n():
    assert terms.straggler_s(0.001, 1) == 0.0
    assert terms.straggler_s(0.001, 4096) == pytest.approx(1e-3 * math.sqrt(2 * math.log(4096)))
    with pytest.raises(ValueError, match="jitter"):
        terms.straggler_s(-1e-3, 8)


def test_straggler_adds_to_the_step_and_can_bind():
    # 10 ms compute, no gradients, 1 ms jitter: 4 ranks wait sqrt(2 ln 4) = 1.665 ms for the slowest
    prof = StepProfile(compute_s=0.010, batch=10, grad_bytes=0.0, jitter_s=0.001)
    p = predict_step_time(prof, 4, node(gpus=4))
    assert p["straggler_s"] == pytest.approx(0.001 * math.sqrt(2 * math.log(4)))
    assert p["step_s"] == pytest.approx(0.010 + p["straggler_s"])
    assert p["limit"] == "stragglers"  # 1.67 ms of 11.67 ms > 5 %
    assert predict_step_time(prof, 1, node(gpus=4))["step_s"] == pytest.approx(0.010)


def test_fixed_per_step_cost_binds_at_a_small_per_gpu_batch():
    # 400 images in 50 ms of compute + 5 ms fixed; at 16 per GPU: 2 ms compute + 5 ms fixed
    prof = StepProfile(compute_s=0.050, batch=400, grad_bytes=0.0, overhead_s=0.005)
    big = predict_step_time(prof, 8, node(), per_worker_batch=400)
    small = predict_step_time(prof, 8, node(), per_worker_batch=16)
    assert big["step_s"] == pytest.approx(0.055) and big["limit"] == "compute"
    assert small["step_s"] == pytest.approx(0.007) and small["limit"] == "fixed per-step cost"
    # per-GPU rate falls from 400/55 ms to 16/7 ms: 31.4 % efficiency, from the fixed cost alone
    assert (16 / small["step_s"]) / (400 / big["step_s"]) == pytest.approx(16 * 0.055 / (400 * 0.007))


@pytest.mark.parametrize("workers,expected", [
    # one node: reduce-scatter + all-gather over NVLink, 2 x 7/8 x 8e6 / 100e9
    (8, 2 * 7 / 8 * 8e6 / 100e9),
    # two nodes: + each GPU's 1e6-byte shard up and down the switch once over its 10 GB/s rail, + 2 x 5 us
    (16, 2 * 7 / 8 * 8e6 / 100e9 + 1e6 / 10e9 + 2 * 5e-6),
    # 64 nodes > 32 per leaf: two switch levels, 4 hops of 5 us
    (512, 2 * 7 / 8 * 8e6 / 100e9 + 1e6 / 10e9 + 4 * 5e-6),
])
def test_sharp_two_level_allreduce(workers, expected):
    hw = node(nic=(10.0, 5.0))
    t, algo = allreduce_s(8e6, workers, hw, "sharp")
    assert algo == "sharp" and t == pytest.approx(expected)
    # across nodes the switch reduction moves half of what a ring moves per NIC
    ring, _ = allreduce_s(8e6, 16, hw, "ring")
    assert t < ring or workers == 8


def test_implied_fixed_cost_from_two_batch_sizes():
    # 2 items at 20/s = 100 ms, 4 items at 32/s = 125 ms: 12.5 ms per item, 75 ms fixed
    assert sv.implied_fixed_ms([[2, 20.0], [4, 32.0]]) == pytest.approx((75.0, 12.5))
    # linear scaling in the batch (rate independent of it) implies no fixed cost
    assert sv.implied_fixed_ms([[16, 100.0], [64, 100.0]]) == pytest.approx((0.0, 10.0))


def test_fit_solves_each_constant_on_its_named_row_and_is_reproducible():
    anchors = sv.load_anchors()
    rates = sv.input_rates(anchors)
    consts = sv.fit(anchors, rates)
    assert consts == sv.fit(copy.deepcopy(anchors), rates)  # deterministic from the table
    assert 0 < consts["jitter_ms"] < 1 and 0 < consts["overhead_ms"]["mlperf-resnet-mxnet"] < 10
    # two implementations, two fixed costs: PyTorch DDP (RetinaNet) carries more than MXNet's bulk execution
    assert consts["overhead_ms"]["mlperf-resnet-mxnet"] < consts["overhead_ms"]["mlperf-retinanet-pytorch"] < 10
    rows = {r["id"]: r for r in anchors["rows"]}
    for rid in (anchors["fit"]["jitter_ms"], *anchors["fit"]["overhead_ms"].values()):
        assert abs(sv.predict_row(rows[rid], anchors, rates, consts)["error_points"]) < 0.05
    # the table in RESULTS states the same constants (to its printed precision)
    text = RESULTS.read_text()
    fixed = re.findall(r"fixed per-step cost \*\*([0-9.]+) ms\*\* "
                       r"\(`overhead_ms`, implementation group `([a-z-]+)`", text)
    jitter = float(re.search(r"jitter \*\*([0-9.]+) ms\*\*", text).group(1))
    assert {g for _, g in fixed} == set(consts["overhead_ms"])
    for ms, group in fixed:
        assert float(ms) == pytest.approx(consts["overhead_ms"][group], abs=0.006)
    assert jitter == pytest.approx(consts["jitter_ms"], abs=0.0006)


def test_held_out_cluster_rows_on_measured_fabric_within_10_points_and_resnet_8gpu_within_5():
    rows = sv.validate()
    # dgx-h100's links are measured (nccl-tests); the L40S row is the documented miss (its compute is
    # not linear in the batch: RESULTS, docs/plan.md), so it is reported, not asserted
    big = [r for r in rows if r["role"] == "held-out" and r["gpus"] > 8 and r["hardware"] == "dgx-h100"]
    # MXNet ResNet-50 and PyTorch RetinaNet, MLPerf v3.0 to v4.1, 64 to 3,584 GPUs
    assert len(big) >= 10 and len({r["workload"] for r in big}) == 2 and max(r["gpus"] for r in big) >= 2048
    assert all(abs(r["error_points"]) <= 10 for r in big), sv.validation_markdown(big)
    # every held-out row beyond one node, on any cluster, but the one documented miss (RESULTS, docs/plan.md)
    multi = [r for r in rows if r["role"] == "held-out" and r["gpus"] > 8 and r["id"] != "mlperf-v4.0-l40s-64"]
    assert len({r["impl"].split()[2] for r in multi}) >= 3  # NVIDIA, Dell, HPE
    assert all(abs(r["error_points"]) <= 10 for r in multi), sv.validation_markdown(multi)
    rn8 = [r for r in rows if r["workload"] == "resnet50" and r["gpus"] == 8]
    assert all(abs(r["error_points"]) <= 5 for r in rn8), sv.validation_markdown(rn8)
    # PyTorch DDP, the path fastvision trains on: every 8-GPU row of every workload
    ddp8 = [r for r in rows if r["backend"] == "ddp" and r["gpus"] == 8 and r["role"] == "held-out"]
    assert len({r["workload"] for r in ddp8}) >= 4
    assert all(abs(r["error_points"]) <= 5 for r in ddp8), sv.validation_markdown(ddp8)


def test_a_second_implementation_held_out_at_2528_h100_and_on_l40s_nodes():
    # MLPerf RetinaNet (PyTorch DDP): its fixed cost solved on 64 H100, the jitter carried over from ResNet
    rows = {r["id"]: r for r in sv.validate()}
    held = [rows["mlperf-v4.0-retinanet-h100-2528"], rows["mlperf-v4.0-retinanet-l40s-64"]]
    assert all(r["role"] == "held-out" for r in held)
    assert all(abs(r["error_points"]) <= 10 for r in held), sv.validation_markdown(held)
    # at 1 image per GPU the fixed cost, not the compute, sets the step
    assert rows["mlperf-v4.0-retinanet-h100-2528"]["limit"] == "fixed per-step cost"


def test_missed_time_is_the_published_step_minus_the_predicted_one():
    anchors = sv.load_anchors()
    rates = sv.input_rates(anchors)
    row = next(r for r in anchors["rows"] if r["id"] == "dle-tf1-ssd320-amp")
    p = sv.predict_row(row, anchors, rates)
    # published: 1,008.46 img/s on 8 GPUs at 32 per GPU -> 253.85 ms per step; a 1-GPU reference row's
    # predicted step at 1 GPU is the published one, so the predicted step at 8 is step_ms itself
    assert p["missing_ms"] == pytest.approx(1e3 * 32 / (1008.46 / 8) - p["step_ms"], rel=1e-9)
    assert 50 < p["missing_ms"] < 80


@pytest.mark.parametrize("rid", ["mlperf-v4.0-h100-2528", "mlperf-v4.0-retinanet-h100-2528"])
def test_without_the_at_scale_terms_the_2528_gpu_rows_are_far_off(rid):
    anchors = sv.load_anchors()
    rates = sv.input_rates(anchors)
    row = next(r for r in anchors["rows"] if r["id"] == rid)
    assert sv.predict_row(row, anchors, rates)["error_points"] > 40  # compute + fabric only: +50 to +57 points


@pytest.mark.parametrize("workers,expected", [
    # one node: 2 x 7/8 x 8e6 / 400e9 at the NVLS busbw + 2 switch hops of 3 us
    (8, 2 * 7 / 8 * 8e6 / 400e9 + 2 * 3e-6),
    # four nodes: + a tree of each GPU's 1e6-byte shard over its 10 GB/s rail, 2 x log2(4) hops of 5 us
    (32, 2 * 7 / 8 * 8e6 / 400e9 + 2 * 3e-6 + 2 * 1e6 / 10e9 + 4 * 5e-6),
])
def test_nvls_allreduce(workers, expected):
    hw = Hardware("t", "X", 8, 64, Link("intra", 300.0, 3.0), Link("nic", 10.0, 5.0), nvls_gbps=400.0)
    t, algo = allreduce_s(8e6, workers, hw, "nvls")
    assert algo == "nvls" and t == pytest.approx(expected)
    # inside a node it beats the 300 GB/s ring; a node without NVLS refuses the algorithm
    assert t < allreduce_s(8e6, 8, hw, "ring")[0] or workers > 8
    with pytest.raises(ValueError, match="nvls"):
        allreduce_s(8e6, 8, node(), "nvls")


def test_gb200_nvl72_the_rack_is_the_node_and_its_rows_are_held_out_with_the_h100_constants():
    from fastvision.scaling.simulator import load_hardware

    hw = load_hardware("gb200-nvl72")
    # one rack (72 GPUs, 18 trays) all-reduces over NVLink alone: ring at 840 GB/s, 3 us per hop
    t, algo = allreduce_s(25e6, 72, hw)
    assert algo == "ring" and t == pytest.approx(2 * 71 / 72 * 25e6 / 840e9 + 2 * 71 * 3e-6)
    # 8 racks: NCCL's tree across the racks' InfiniBand rails (bus bandwidth min(840, 72 x 41.4))
    t, algo = allreduce_s(25e6, 512, hw)
    assert algo == "tree" and t == pytest.approx(2 * 25e6 / 840e9 + 2 * (3 * 5e-6 + 71 * 3e-6))
    rows = {r["id"]: r for r in sv.validate()}
    gb = [rows["mlperf-v5.0-retinanet-gb200-72"], rows["mlperf-v5.0-retinanet-gb200-512"]]
    assert all(r["role"] == "held-out" and r["ref_gpus"] == 8 for r in gb)
    assert all(abs(r["error_points"]) <= 10 for r in gb), sv.validation_markdown(gb)


def test_without_a_host_rate_the_prediction_is_an_upper_bound():
    # rows whose host pipeline has no known rate (TensorFlow's tf.data on the host) get the fabric-only
    # bound, which `plan` reports as an upper bound when the recipe's input rate is not known: every
    # such published row reads at or below it
    rows = [r for r in sv.validate() if r["input"] == "unknown-cpu"]
    assert len(rows) >= 14 and {r["workload"] for r in rows} >= {"ssd320", "unet3d-brats", "unet2d-em"}
    assert all(r["error_points"] >= 0 for r in rows), sv.validation_markdown(rows)
