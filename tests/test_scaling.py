"""Tests for fastvision.scaling: LR rule, simulator against hand-computed cases, report files."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastvision import scaling  # noqa: E402
from fastvision.scaling import LINKS, Link, StepProfile  # noqa: E402


@pytest.mark.parametrize("base,glob,ref,expected", [
    (1e-3, 16, 16, 1e-3), (1e-3, 128, 16, 8e-3), (0.1, 64, 256, 0.025), (2e-4, 224, 16, 2.8e-3)])
def test_scaled_lr(base, glob, ref, expected):
    assert scaling.scaled_lr(base, glob, ref) == pytest.approx(expected, rel=1e-12)


def test_scaled_lr_rejects_nonpositive():
    with pytest.raises(ValueError):
        scaling.scaled_lr(1e-3, 0, 16)


@pytest.mark.parametrize("step,expected", [(0, 0.1), (5, 0.55), (10, 1.0), (50, 1.0)])
def test_warmup_lr(step, expected):
    assert scaling.warmup_lr(step, 10, 0.1, 1.0) == pytest.approx(expected)


@pytest.mark.parametrize("nbytes,n,bw,lat,expected", [
    (1e9, 1, 10.0, 10.0, 0.0),
    (1e9, 2, 10.0, 10.0, 1.0 * 1e9 / 1e10 + 2 * 1e-5),  # 2(N-1)/N = 1
    (1e9, 4, 10.0, 10.0, 1.5 * 1e9 / 1e10 + 6 * 1e-5),
    (8e6, 8, 2.0, 50.0, 1.75 * 8e6 / 2e9 + 14 * 5e-5),
])
def test_ring_allreduce(nbytes, n, bw, lat, expected):
    assert scaling.ring_allreduce_s(nbytes, n, Link("x", bw, lat)) == pytest.approx(expected, rel=1e-12)


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
    p = scaling.predict_step_time(profile, 2, LINK, gpus_per_node=1)
    assert p["step_s"] * 1e3 == pytest.approx(step_ms)
    assert p["exposed_comm_s"] * 1e3 == pytest.approx(exposed_ms)
    assert p["images_per_s"] == pytest.approx(16 / p["step_s"])


def test_one_worker_has_no_communication():
    prof = StepProfile(compute_s=0.1, batch=4, grad_bytes=1e9, buckets=3, optimizer_s=0.01)
    p = scaling.predict_step_time(prof, 1, LINKS["ethernet"])
    assert p["step_s"] == pytest.approx(0.11) and p["comm_s"] == 0.0


def test_intra_node_link_used_up_to_gpus_per_node():
    prof = StepProfile(compute_s=0.1, batch=4, grad_bytes=100e6, buckets=1)
    slow, fast = Link("slow", 1.0, 0.0), Link("fast", 100.0, 0.0)
    inside = scaling.predict_step_time(prof, 4, slow, gpus_per_node=4, intra=fast)
    outside = scaling.predict_step_time(prof, 8, slow, gpus_per_node=4, intra=fast)
    assert inside["comm_s"] == pytest.approx(1.5 * 100e6 / 100e9)
    assert outside["comm_s"] == pytest.approx(1.75 * 100e6 / 1e9)


def test_strong_scaling_divides_the_batch():
    prof = StepProfile(compute_s=0.8, batch=16, grad_bytes=0.0, buckets=1)
    rows = scaling.simulate(prof, LINK, [1, 2, 4, 8, 16, 32], mode="strong", gpus_per_node=1)
    assert [r["workers"] for r in rows] == [1, 2, 4, 8, 16]  # 32 workers would get half an image
    # no gradient bytes and no latency: perfect strong scaling
    assert [r["speedup"] for r in rows] == pytest.approx([1, 2, 4, 8, 16])
    assert rows[2]["per_worker_batch"] == 4 and rows[2]["step_s"] == pytest.approx(0.2)


def test_simulate_presets_rank_as_expected():
    prof = StepProfile(compute_s=0.05, batch=16, grad_bytes=124e6, buckets=5)  # ~31M fp32 params
    at = {name: {r["workers"]: r for r in scaling.simulate(prof, link)} for name, link in LINKS.items()}
    assert list(at["nvlink"]) == [2**i for i in range(11)]
    for name in LINKS:
        assert at[name][1]["speedup"] == pytest.approx(1.0)
        assert all(r["efficiency"] <= 1.0 + 1e-12 for r in at[name].values())
    # within a node (<= 8) every preset uses NVLink; across nodes the slower link costs speed-up
    assert at["ethernet"][8]["speedup"] == pytest.approx(at["nvlink"][8]["speedup"])
    assert at["nvlink"][64]["speedup"] > at["infiniband"][64]["speedup"] > at["ethernet"][64]["speedup"]
    table = scaling.simulation_markdown([r for name in at for r in at[name].values()])
    assert table.count("\n") == 2 + 3 * 11


def test_simulation_plot(tmp_path):
    prof = StepProfile(compute_s=0.05, batch=16, grad_bytes=124e6, buckets=5)
    rows = [r for link in LINKS.values() for r in scaling.simulate(prof, link)]
    path = scaling.plot_simulation(rows, tmp_path / "sim.png", measured=[{"workers": 2, "speedup": 1.7}])
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 100


RUNS = [
    {"workers": 1, "images_per_s": 10.0, "time_per_epoch_s": 20.0, "metric_name": "iou", "metric": 0.90,
     "global_batch": 4},
    {"workers": 1, "images_per_s": 12.0, "time_per_epoch_s": 18.0, "metric_name": "iou", "metric": 0.92,
     "global_batch": 4},
    {"workers": 1, "images_per_s": 11.0, "time_per_epoch_s": 19.0, "metric_name": "iou", "metric": 0.91,
     "global_batch": 4},
    {"workers": 2, "images_per_s": 19.8, "time_per_epoch_s": 10.0, "metric_name": "iou", "metric": 0.89,
     "global_batch": 8, "predicted_speedup": 1.9},
    {"workers": 4, "images_per_s": 33.0, "time_per_epoch_s": 6.0, "metric_name": "iou", "metric": 0.85,
     "global_batch": 16},
    {"workers": 2, "backend": "horovod", "images_per_s": 16.5, "metric_name": "iou", "metric": 0.88},
    {"workers": 1, "backend": "horovod", "images_per_s": 11.0, "metric_name": "iou", "metric": 0.9},
]


def test_summarize_medians_speedup_efficiency():
    rows = scaling.summarize(RUNS)
    by = {(r["backend"], r["workers"]): r for r in rows}
    assert [(r["backend"], r["workers"]) for r in rows] == [("ddp", 1), ("ddp", 2), ("ddp", 4),
                                                            ("horovod", 1), ("horovod", 2)]
    one = by[("ddp", 1)]
    assert one["repeats"] == 3 and one["images_per_s"] == 11.0 and one["metric"] == 0.91  # medians
    assert by[("ddp", 2)]["speedup"] == pytest.approx(1.8) and by[("ddp", 2)]["efficiency"] == pytest.approx(0.9)
    assert by[("ddp", 4)]["speedup"] == pytest.approx(3.0) and by[("ddp", 4)]["efficiency"] == pytest.approx(0.75)
    assert by[("horovod", 2)]["speedup"] == pytest.approx(1.5)
    assert by[("ddp", 2)]["predicted_speedup"] == 1.9 and by[("ddp", 4)]["predicted_speedup"] is None


def test_write_report_files(tmp_path):
    paths = scaling.write_report(RUNS, tmp_path / "out", title="unet2d-microscopy weak scaling")
    assert sorted(p.name for p in paths.values()) == ["scaling.csv", "scaling.json", "scaling.md", "scaling.png"]
    with open(paths["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5 and list(rows[0]) == scaling.FIELDS
    assert float(rows[1]["speedup"]) == pytest.approx(1.8) and rows[2]["predicted_speedup"] == ""
    data = json.loads(paths["json"].read_text())
    assert len(data["runs"]) == len(RUNS) and data["rows"][2]["efficiency"] == pytest.approx(0.75)
    md = paths["md"].read_text().splitlines()
    assert md[0] == "## unet2d-microscopy weak scaling" and "| iou |" in md[2]
    assert md[6].startswith("| ddp | 4 | 16 | 6.00 | 33.0 | 3.00 | 75.0% | 0.8500 |")
    with Image.open(paths["png"]) as im:
        assert im.format == "PNG" and im.size == (1200, 480)


def test_summarize_rejects_incomplete_results():
    with pytest.raises(ValueError, match="images_per_s"):
        scaling.summarize([{"workers": 1}])


def test_read_run_parses_dllogger_events_and_checkpoint(tmp_path):
    import torch

    events = [{"step": "PARAMETER", "data": {}},
              {"step": [0, 1], "data": {"loss": 1.0}},
              {"step": [0], "data": {"epoch_time_s": 9.0, "images_per_s": 5.0, "iou": 0.5}},
              {"step": [1], "data": {"epoch_time_s": 4.0, "images_per_s": 11.0, "iou": 0.7}},
              {"step": [2], "data": {"epoch_time_s": 6.0, "images_per_s": 9.0, "iou": 0.8}},
              {"step": [], "data": {"best_iou": 0.8, "epochs": 3}}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({"type": "LOG", **e}) for e in events) + "\n")
    (tmp_path / "checkpoints").mkdir()
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    torch.save({"model": model.state_dict()}, tmp_path / "checkpoints" / "last.pt")
    r = scaling.read_run(tmp_path)
    # epoch 0 is warm-up: medians of epochs 1-2
    assert r == {"time_per_epoch_s": 5.0, "images_per_s": 10.0, "metric_name": "iou", "metric": 0.8,
                 "grad_bytes": 4 * (4 * 9 + 4 + 4 + 4)}  # conv w+b, bn w+b; running stats excluded


def test_cli_simulate_from_numbers(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    scaling.add_cli(parser.add_subparsers())
    args = parser.parse_args(["scale", "--simulate", "--compute-ms", "100", "--grad-mb", "100", "--batch", "8",
                              "--links", "infiniband,ethernet", "--out", str(tmp_path)])
    assert args.func(args) == 0
    data = json.loads((tmp_path / "simulation.json").read_text())
    assert data["profile"]["buckets"] == 4  # ceil(100e6 / 25 MiB)
    assert [r["link"] for r in data["rows"]] == ["infiniband"] * 11 + ["ethernet"] * 11
    assert (tmp_path / "simulation.md").exists() and (tmp_path / "simulation.png").exists()


def test_scale_cli_passes_train_options_through():
    import argparse

    parser = argparse.ArgumentParser()
    scaling.add_cli(parser.add_subparsers())
    args = parser.parse_args(["scale", "r", "--data", "d", "--set", "a.b=1", "--set", "c=[2,3]"])
    assert scaling.train_args(args) == ["--data", "d", "--set", "a.b=1", "--set", "c=[2,3]"]


@pytest.mark.dist
def test_scale_sweep_end_to_end(tmp_path, tiny_microscopy):
    """`fastvision scale --workers 1,2 --mode strong --simulate` on tiny data: real runs, every report file."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    sets = ["data.args.image_size=[32,32]", "model.args.filters=[4,8,16]", "data.num_workers=0", "examples=0",
            "train.batch_size=4"]
    cmd = [sys.executable, "-m", "fastvision.cli", "scale", "unet2d-microscopy", "--workers", "1,2",
           "--mode", "strong", "--epochs", "2", "--simulate", "--links", "ethernet", "--device", "cpu",
           "--data", str(tiny_microscopy), "--out", str(tmp_path), *[a for s in sets for a in ("--set", s)]]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=root, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("scaling.csv", "scaling.json", "scaling.md", "scaling.png", "simulation.json"):
        assert (tmp_path / name).is_file(), name
    with open(tmp_path / "scaling.csv", newline="") as f:
        rows = {int(r["workers"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == [1, 2]
    # strong scaling of the overridden batch: 4 images per step either way
    assert float(rows[1]["global_batch"]) == float(rows[2]["global_batch"]) == 4
    assert float(rows[2]["predicted_speedup"]) > 0 and rows[2]["metric"] != ""
    for n, per_worker in ((1, 4), (2, 2)):
        import yaml

        cfg = yaml.safe_load((tmp_path / f"ddp-{n}-r0" / "config.yaml").read_text())
        assert cfg["data"]["args"]["image_size"] == [32, 32] and cfg["model"]["args"]["filters"] == [4, 8, 16]
        assert cfg["train"]["batch_size"] == per_worker and cfg["data"]["args"]["path"] == str(tiny_microscopy)


@pytest.mark.parametrize("workers", ["1,x", "0,2"])
def test_scale_rejects_bad_worker_lists(workers, capsys):
    from fastvision.cli import main

    assert main(["scale", "unet2d-microscopy", "--workers", workers]) == 2
    assert "--workers" in capsys.readouterr().err
