"""Tests for fastvision.scaling.simulator (hand-computed cases), hardware profiles, and the published-table check."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastvision.errors import ConfigError  # noqa: E402
from fastvision.scaling import simulator  # noqa: E402
from fastvision.scaling import validation as sim_validation
from fastvision.scaling.simulator import (  # noqa: E402
    Backend,
    Hardware,
    InputPipeline,
    Link,
    StepProfile,
)


def node(gpus=4, cores=8, threads=16, intra=(100.0, 0.0), nic=(1.0, 0.0)) -> Hardware:
    return Hardware("t", "X", gpus, cores, Link("intra", *intra), Link("nic", *nic), cpu_threads=threads)


@pytest.mark.parametrize("nbytes,n,bw,lat,expected", [
    (1e9, 1, 10.0, 10.0, 0.0),
    (1e9, 2, 10.0, 10.0, 1.0 * 1e9 / 1e10 + 2 * 1e-5),  # 2(N-1)/N = 1
    (1e9, 4, 10.0, 10.0, 1.5 * 1e9 / 1e10 + 6 * 1e-5),
    (8e6, 8, 2.0, 50.0, 1.75 * 8e6 / 2e9 + 14 * 5e-5),
])
def test_ring_allreduce(nbytes, n, bw, lat, expected):
    assert simulator.ring_allreduce_s(nbytes, n, Link("x", bw, lat)) == pytest.approx(expected, rel=1e-12)


LINK = Link("test", 1.0, 0.0)  # 1 GB/s, no latency: 2 workers move 1e6 bytes in exactly 1 ms


@pytest.mark.parametrize("name,profile,step_ms,exposed_ms", [
    # one bucket: all of its communication waits for the end of backward
    ("one-bucket", StepProfile(compute_s=0.3, batch=8, grad_bytes=40e6, buckets=1), 300 + 40, 40),
    # 4 buckets of 10 ms each, backward 200 ms (50 ms per bucket): only the last bucket is exposed
    ("overlapped", StepProfile(compute_s=0.3, batch=8, grad_bytes=40e6, buckets=4), 300 + 10, 10),
    # 4 buckets of 100 ms, 50 ms apart: comm-bound, t_f + t_b/K + K*c = 100 + 50 + 400
    ("comm-bound", StepProfile(compute_s=0.3, batch=8, grad_bytes=400e6, buckets=4), 550, 250),
    # optimizer and overhead add after the last reduction
    ("optimizer", StepProfile(compute_s=0.3, batch=8, grad_bytes=40e6, buckets=4, optimizer_s=0.02,
                              overhead_s=0.005), 335, 10),
    # backward half the compute: 150 ms fwd, 4 buckets 37.5 ms apart, 30 ms comm each -> last exposed
    ("half-backward", StepProfile(compute_s=0.3, batch=8, grad_bytes=120e6, buckets=4, backward_fraction=0.5),
     330, 30),
])
def test_predict_step_time_hand_cases(name, profile, step_ms, exposed_ms):
    # one GPU per node: 2 GPUs are 2 nodes, bus bandwidth = 1 NIC = 1 GB/s; ring (1x S/bw) beats tree (2x)
    p = simulator.predict_step_time(profile, 2, LINK, gpus_per_node=1)
    assert p["step_s"] * 1e3 == pytest.approx(step_ms)
    assert p["exposed_comm_s"] * 1e3 == pytest.approx(exposed_ms)
    assert p["images_per_s"] == pytest.approx(16 / p["step_s"])
    assert p["algo"] == "ring"
    assert p["limit"] == ("communication" if name == "comm-bound" or exposed_ms >= 0.05 * step_ms else "compute")


def test_one_worker_has_no_communication():
    prof = StepProfile(compute_s=0.1, batch=4, grad_bytes=1e9, buckets=3, optimizer_s=0.01)
    p = simulator.predict_step_time(prof, 1, simulator.LINKS["ethernet"])
    assert p["step_s"] == pytest.approx(0.11) and p["comm_s"] == 0.0 and p["limit"] == "compute"


def test_across_nodes_the_bus_bandwidth_is_the_nic_rails():
    prof = StepProfile(compute_s=0.1, batch=4, grad_bytes=100e6, buckets=1)
    hw = node(gpus=4, intra=(100.0, 0.0), nic=(1.0, 0.0))
    inside = simulator.predict_step_time(prof, 4, hw)
    outside = simulator.predict_step_time(prof, 8, hw)
    assert inside["comm_s"] == pytest.approx(1.5 * 100e6 / 100e9)
    assert outside["comm_s"] == pytest.approx(1.75 * 100e6 / 4e9)  # min(100, 4 NICs x 1 GB/s) = 4 GB/s
    # a fast NIC is capped by the intra-node link
    assert simulator.inter_busbw_gbps(node(gpus=4, intra=(10.0, 0.0), nic=(50.0, 0.0))) == 10.0


def test_tree_beats_ring_on_latency_at_many_nodes_and_loses_on_bandwidth_at_two():
    hw = Hardware("t", "X", 8, 64, Link("intra", 200.0, 3.0), Link("nic", 25.0, 5.0))  # busbw min(200, 200)
    t, algo = simulator.allreduce_s(1e6, 1024, hw)  # 128 nodes
    assert algo == "tree"
    assert t == pytest.approx(2 * 1e6 / 200e9 + 2 * (7 * 5 + 7 * 3) * 1e-6)
    ring, _ = simulator.allreduce_s(1e6, 1024, hw, "ring")
    assert ring == pytest.approx(2 * 1023 / 1024 * 1e6 / 200e9 + 2 * 1023 * 5e-6)
    t, algo = simulator.allreduce_s(1e9, 16, hw)  # 2 nodes, 1 GB
    assert algo == "ring" and t == pytest.approx(2 * 15 / 16 * 1e9 / 200e9 + 30 * 5e-6)
    with pytest.raises(ValueError, match="algo"):
        simulator.allreduce_s(1e6, 16, hw, "butterfly")


def test_input_pipeline_limit_by_workers_threads_or_cores():
    prof = StepProfile(compute_s=0.1, batch=100, grad_bytes=0.0)
    hw = node(gpus=4, cores=8, threads=16)
    pipe = InputPipeline("cpu", "cpu", per_core_items_s=100.0, workers_per_gpu=2)
    # 4 GPUs x 2 workers = 8 processes (<= 16 threads) x 100/s = 800/s for 4 GPUs: 0.5 s per 100 images
    p = simulator.predict_step_time(prof, 4, hw, pipeline=pipe)
    assert p["input_s"] == pytest.approx(0.5) and p["step_s"] == pytest.approx(0.5)
    assert p["limit"] == "input pipeline" and p["images_per_s"] == pytest.approx(800)
    # 8 workers per GPU: 32 processes share 16 threads -> 1600/s
    many = InputPipeline("cpu", "cpu", 100.0, 8)
    assert simulator.input_limit_items_s(many, hw, 4) == pytest.approx(1600 / 4)
    # a pool without a worker count runs on the 8 physical cores
    assert simulator.input_limit_items_s(InputPipeline("pool", "cpu", 100.0), hw, 4) == pytest.approx(200)
    # GPU decode, unknown rate and the single-GPU measurement have no host limit
    assert simulator.input_limit_items_s(InputPipeline("dali", "gpu", 100.0), hw, 4) == math.inf
    assert simulator.input_limit_items_s(InputPipeline("cpu", "cpu", None), hw, 4) == math.inf
    assert simulator.predict_step_time(prof, 1, hw, pipeline=pipe)["step_s"] == pytest.approx(0.1)


def test_horovod_cycle_per_fusion_buffer():
    prof = StepProfile(compute_s=0.3, batch=8, grad_bytes=100e6)
    hw = node(gpus=8, intra=(1000.0, 0.0))
    p = simulator.predict_step_time(prof, 8, hw, backend=Backend("h", cycle_ms=5.0, fusion_mb=64.0))
    # ceil(100e6 / 64 MiB) = 2 buffers: 10 ms of cycles; each 50e6-byte ring takes 1.75*50e6/1e12 s,
    # the last one after backward ends
    assert p["sync_s"] == pytest.approx(0.010)
    assert p["step_s"] == pytest.approx(0.3 + 1.75 * 50e6 / 1e12 + 0.010)
    assert p["limit"] == "compute"  # 10 ms of 310 ms: under 5 %
    assert simulator.predict_step_time(prof, 8, hw, backend="ddp")["sync_s"] == 0.0


def test_strong_scaling_is_stopped_by_the_fixed_overhead():
    prof = StepProfile(compute_s=0.8, batch=16, grad_bytes=0.0, overhead_s=0.1)
    rows = simulator.simulate(prof, node(gpus=1), [1, 2, 8, 16, 32], mode="strong")
    assert [r["workers"] for r in rows] == [1, 2, 8, 16]  # 32 workers would get half an image
    # step(N) = 0.8 / N + 0.1
    assert [r["speedup"] for r in rows] == pytest.approx([1, 0.9 / 0.5, 0.9 / 0.2, 0.9 / 0.15])
    assert rows[2]["per_worker_batch"] == 2


def test_presets_load_and_rank():
    assert {"dgx-a100", "dgx-h100", "dgx1-v100", "pcie-node"} <= set(simulator.hardware_presets())
    a100, h100, pcie = (simulator.load_hardware(n) for n in ("dgx-a100", "dgx-h100", "pcie-node"))
    assert (a100.gpus_per_node, a100.cpu_cores, a100.cpu_threads, a100.gpu) == (8, 128, 256, "A100-SXM4-80GB")
    prof = StepProfile(compute_s=0.05, batch=16, grad_bytes=124e6, buckets=5)
    at = {hw.name: {r["workers"]: r for r in simulator.simulate(prof, hw)} for hw in (a100, h100, pcie)}
    assert list(at["dgx-a100"]) == [2**i for i in range(11)]
    for rows in at.values():
        assert rows[1]["speedup"] == pytest.approx(1.0)
        assert all(r["efficiency"] <= 1.0 + 1e-12 for r in rows.values())
    assert at["dgx-h100"][64]["speedup"] > at["dgx-a100"][64]["speedup"] > at["pcie-node"][64]["speedup"]
    table = simulator.simulation_markdown([r for rows in at.values() for r in rows.values()])
    assert table.count("\n") == 2 + 3 * 11 and "| binding limit |" in table


def test_hardware_yaml_errors_name_file_and_key(tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text("gpu: X\nnode: {gpus: 8, cpu_cores: 64, intra: {bandwidth_gbps: 100, latency_us: 2}}\n")
    with pytest.raises(ConfigError, match=r"mine.yaml.*'nic'"):
        simulator.load_hardware(bad)
    with pytest.raises(ConfigError, match="unknown preset 'dgx-z'"):
        simulator.load_hardware("dgx-z")
    good = tmp_path / "ok.yaml"
    good.write_text("gpu: X\nnode: {gpus: 4, cpu_cores: 32, intra: {bandwidth_gbps: 100, latency_us: 2},"
                    " nic: {bandwidth_gbps: 10, latency_us: 5}}\n")
    hw = simulator.load_hardware(good)
    assert (hw.name, hw.gpus_per_node, hw.cpu_threads, hw.nic.bandwidth_gbps) == ("ok", 4, 32, 10.0)


# --------------------------------------------------------------------------- published tables

def test_input_rate_is_calibrated_from_one_named_row_only():
    anchors = sim_validation.load_anchors()
    rates = sim_validation.input_rates(anchors)
    assert rates["dle-pytorch-loader"] == pytest.approx(8322 / (8 * 8))  # the DGX-1 V100 AMP row
    named = {p["calibrate_from"] for p in anchors["input_paths"].values() if "calibrate_from" in p}
    named |= set(anchors["fit"]["overhead_ms"].values()) | {anchors["fit"]["jitter_ms"]}
    # a row is calibration exactly when a constant is solved on it; every other row is held out
    assert {r["id"] for r in anchors["rows"] if r["role"] == "calibration"} == named
    assert {r["role"] for r in anchors["rows"]} == {"calibration", "held-out"}
    assert all(r.get("source") and r.get("hardware") for r in anchors["rows"])


def test_every_8gpu_resnet50_row_within_5_points_of_efficiency():
    rows = [r for r in sim_validation.validate() if r["workload"] == "resnet50" and r["role"] == "held-out"]
    at8 = [r for r in rows if r["gpus"] == 8]
    assert len(at8) == 9
    worst = max(at8, key=lambda r: abs(r["error_points"]))
    assert abs(worst["error_points"]) <= 5.0, sim_validation.validation_markdown(at8)
    # the headline row is explained by the input pipeline, not the interconnect
    amp = next(r for r in at8 if r["id"] == "dle-pt-a100-amp")
    assert amp["limit"] == "input pipeline" and amp["exposed_comm_ms"] < 1.0


def test_the_check_can_fail_without_the_input_model():
    anchors = sim_validation.load_anchors()
    row = next(r for r in anchors["rows"] if r["id"] == "dle-pt-a100-amp")
    blind = sim_validation.predict_row(row, anchors, {k: None for k in anchors["input_paths"]})
    assert blind["error_points"] > 5.0  # compute + NVLink alone predict ~99.9 % against 84 %
