"""Tests for fastvision.scaling.sweep: the sweep report (mean +- std over seeds), the scale CLI."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastvision.scaling import sweep as scaling  # noqa: E402
from fastvision.scaling.sweep import LINKS, StepProfile  # noqa: E402


def test_simulation_plot(tmp_path):
    prof = StepProfile(compute_s=0.05, batch=16, grad_bytes=124e6, buckets=5)
    rows = [r for link in LINKS.values() for r in scaling.simulate(prof, link)]
    path = scaling.plot_simulation(rows, tmp_path / "sim.png", measured=[{"workers": 2, "speedup": 1.7}])
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 100


RUNS = [
    {"workers": 1, "seed": 0, "images_per_s": 10.0, "time_per_epoch_s": 20.0, "metric_name": "iou", "metric": 0.90,
     "global_batch": 4},
    {"workers": 1, "seed": 1, "images_per_s": 12.0, "time_per_epoch_s": 18.0, "metric_name": "iou", "metric": 0.92,
     "global_batch": 4},
    {"workers": 1, "seed": 2, "images_per_s": 11.0, "time_per_epoch_s": 19.0, "metric_name": "iou", "metric": 0.94,
     "global_batch": 4},
    {"workers": 2, "images_per_s": 19.8, "time_per_epoch_s": 10.0, "metric_name": "iou", "metric": 0.89,
     "global_batch": 8, "predicted_speedup": 1.9},
    {"workers": 4, "seed": 0, "images_per_s": 30.0, "time_per_epoch_s": 6.0, "metric_name": "iou", "metric": 0.84,
     "global_batch": 16},
    {"workers": 4, "seed": 1, "images_per_s": 36.0, "time_per_epoch_s": 6.0, "metric_name": "iou", "metric": 0.86,
     "global_batch": 16},
    {"workers": 2, "backend": "horovod", "images_per_s": 16.5, "metric_name": "iou", "metric": 0.88},
    {"workers": 1, "backend": "horovod", "images_per_s": 11.0, "metric_name": "iou", "metric": 0.9},
]


def test_summarize_mean_std_speedup_efficiency():
    rows = scaling.summarize(RUNS)
    by = {(r["backend"], r["workers"]): r for r in rows}
    assert [(r["backend"], r["workers"]) for r in rows] == [("ddp", 1), ("ddp", 2), ("ddp", 4),
                                                            ("horovod", 1), ("horovod", 2)]
    one, four = by[("ddp", 1)], by[("ddp", 4)]
    assert one["repeats"] == 3 and one["seeds"] == "0 1 2"
    # means and sample standard deviations, by hand: (10, 12, 11) -> 11 +- 1; (0.90, 0.92, 0.94) -> 0.92 +- 0.02
    assert one["images_per_s"] == pytest.approx(11.0) and one["images_per_s_std"] == pytest.approx(1.0)
    assert one["metric"] == pytest.approx(0.92) and one["metric_std"] == pytest.approx(0.02)
    assert four["images_per_s"] == pytest.approx(33.0) and four["images_per_s_std"] == pytest.approx(18**0.5)
    assert four["metric_std"] == pytest.approx(0.02**0.5 / 10)
    # seed 001's speed-up: mean epoch time at 1 worker (20, 18, 19 -> 19 +- 1) over that at N (10; 6, 6)
    assert by[("ddp", 2)]["speedup"] == pytest.approx(1.9) and by[("ddp", 2)]["efficiency"] == pytest.approx(0.95)
    assert four["speedup"] == pytest.approx(19 / 6) and four["efficiency"] == pytest.approx(19 / 24)
    # speed-up spread: relative spreads of both mean epoch times added in quadrature (1/19 and 0/6)
    assert four["speedup_std"] == pytest.approx(19 / 6 / 19)
    assert one["speedup_std"] == pytest.approx(1 / 19)
    two = by[("ddp", 2)]  # one run: no spread of its own, the reference's 1/19 carries over
    assert two["images_per_s_std"] is None and two["metric_std"] is None
    assert two["speedup_std"] == pytest.approx(1.9 / 19)
    # runs without epoch times (horovod here): the throughput's ratio, 16.5 / 11
    assert by[("horovod", 2)]["speedup"] == pytest.approx(1.5) and by[("horovod", 2)]["speedup_std"] is None
    assert by[("ddp", 2)]["predicted_speedup"] == 1.9 and four["predicted_speedup"] is None


def test_write_report_files(tmp_path):
    paths = scaling.write_report(RUNS, tmp_path / "out", title="unet2d-microscopy weak scaling")
    assert sorted(p.name for p in paths.values()) == ["scaling.csv", "scaling.json", "scaling.md", "scaling.png"]
    with open(paths["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5 and list(rows[0]) == scaling.FIELDS
    assert float(rows[1]["speedup"]) == pytest.approx(1.9) and rows[2]["predicted_speedup"] == ""
    assert float(rows[0]["images_per_s_std"]) == pytest.approx(1.0) and rows[1]["metric_std"] == ""
    data = json.loads(paths["json"].read_text())
    assert len(data["runs"]) == len(RUNS) and data["rows"][2]["efficiency"] == pytest.approx(19 / 24)
    md = paths["md"].read_text().splitlines()
    assert md[0] == "## unet2d-microscopy weak scaling" and "| iou |" in md[2]
    assert md[4].startswith("| ddp | 1 | 3 (0 1 2) | 4 | 19.00 | 11.0 ± 1.0 | 1.00 ± 0.05 | 100.0% | 0.9200 ± 0.0200 |")
    assert md[5].startswith("| ddp | 2 | 1 | 8 | 10.00 | 19.8 | 1.90 ± 0.10 | 95.0% | 0.8900 | 1.90 |")
    with Image.open(paths["png"]) as im:
        assert im.format == "PNG" and im.size == (1200, 480)


def test_speedup_is_the_epoch_time_ratio_where_epochs_hold_different_item_counts():
    """36 training items at batch 4: one worker's epoch trains all 36 in 10 s, two workers' (global batch 8) drop
    the partial global batch and train 32 in 5 s. Seed 001's speed-up is epoch time at 1 over at N, 10 / 5 =
    2.0; the throughput ratio (6.4 / 3.6 = 1.78) was reported before."""
    rows = scaling.summarize([{"workers": 1, "images_per_s": 36 / 10, "time_per_epoch_s": 10.0},
                              {"workers": 2, "images_per_s": 32 / 5, "time_per_epoch_s": 5.0}])
    assert rows[1]["speedup"] == pytest.approx(2.0) and rows[1]["efficiency"] == pytest.approx(1.0)
    assert rows[1]["images_per_s"] == pytest.approx(6.4)


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


def _scale_args(argv):
    import argparse

    parser = argparse.ArgumentParser()
    scaling.add_cli(parser.add_subparsers())
    return parser.parse_args(["scale", *argv])


def test_cli_simulate_from_numbers_old_links(tmp_path):
    args = _scale_args(["--simulate", "--compute-ms", "100", "--grad-mb", "100", "--batch", "8",
                        "--links", "infiniband,ethernet", "--out", str(tmp_path)])
    assert args.func(args) == 0
    data = json.loads((tmp_path / "simulation.json").read_text())
    assert data["profile"]["buckets"] == 4  # ceil(100e6 / 25 MiB)
    assert [r["link"] for r in data["rows"]] == ["infiniband"] * 11 + ["ethernet"] * 11
    assert (tmp_path / "simulation.md").exists() and (tmp_path / "simulation.png").exists()


def test_cli_simulate_names_the_binding_limit(tmp_path, capsys):
    """ResNet-50 on a DGX A100 (2,470 img/s at 256, 102 MB): the host input path binds from 8 GPUs."""
    report = tmp_path / "data.json"  # the shape of `fastvision benchmark RECIPE --mode data`
    report.write_text(json.dumps({"recipe": "r", "mode": "data", "results": [
        {"cache": "none", "num_workers": 4, "items_per_s": 520.0}]}))
    args = _scale_args(["--simulate", "--compute-ms", f"{256 / 2.470:.4f}", "--grad-mb", "102.4", "--batch", "256",
                        "--hardware", "dgx-a100", "--input-json", str(report), "--input-workers", "16",
                        "--out", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    rows = {r["workers"]: r for r in json.loads((tmp_path / "simulation.json").read_text())["rows"]}
    assert json.loads((tmp_path / "simulation.json").read_text())["pipeline"]["per_core_items_s"] == 130.0
    assert rows[1]["limit"] == "compute" and rows[8]["limit"] == "input pipeline"
    assert rows[8]["images_per_s"] == pytest.approx(128 * 130.0)  # 16 workers x 8 GPUs x 130/s
    assert "| dgx-a100 | 8 |" in out and "input pipeline |" in out
    dali = _scale_args(["--simulate", "--compute-ms", "103.6", "--grad-mb", "102.4", "--batch", "256",
                        "--hardware", "dgx-a100", "--input-rate", "130", "--input-workers", "16", "--dali",
                        "--out", str(tmp_path / "dali")])
    assert dali.func(dali) == 0
    rows = json.loads((tmp_path / "dali" / "simulation.json").read_text())["rows"]
    assert {r["limit"] for r in rows if r["workers"] <= 8} == {"compute"}


def test_cli_simulate_rejects_bad_profile_and_input(tmp_path):
    from fastvision.errors import ConfigError

    args = _scale_args(["--simulate", "--compute-ms", "100", "--grad-mb", "10", "--hardware", "nope",
                        "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        args.func(args)
    (tmp_path / "x.json").write_text("{}")
    args = _scale_args(["--simulate", "--compute-ms", "100", "--grad-mb", "10", "--input-json",
                        str(tmp_path / "x.json"), "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match="items_per_s"):
        args.func(args)


def test_scale_cli_passes_train_options_through():
    import argparse

    parser = argparse.ArgumentParser()
    scaling.add_cli(parser.add_subparsers())
    args = parser.parse_args(["scale", "r", "--data", "d", "--set", "a.b=1", "--set", "c=[2,3]"])
    assert scaling.train_args(args) == ["--data", "d", "--set", "a.b=1", "--set", "c=[2,3]"]


@pytest.mark.dist
def test_scale_sweep_end_to_end(tmp_path, tiny_microscopy, monkeypatch, capfd):
    """`scale --workers 1,2 --mode strong --repeats 2 --simulate` on tiny data: real runs with seeds 5 and 6.
    The sweep's training runs are real processes (as the command starts them); the `scale` command itself
    runs in this process, which only starts them and reads their results."""
    from tests.conftest import cli_here

    root = Path(__file__).resolve().parents[2]
    sets = ["data.args.image_size=[32,32]", "model.args.filters=[4,8,16]", "data.num_workers=0", "examples=0",
            "train.batch_size=4"]
    argv = ["scale", "unet2d-microscopy", "--workers", "1,2",
            "--mode", "strong", "--epochs", "1", "--repeats", "2", "--seed", "5", "--simulate", "--links", "ethernet",
            "--device", "cpu", "--data", str(tiny_microscopy), "--out", str(tmp_path),
            *[a for s in sets for a in ("--set", s)]]
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # the runs' environment: this process's, as the command's
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.chdir(root)
    rc = cli_here(argv)
    assert rc == 0, capfd.readouterr().err[-3000:]
    for name in ("scaling.csv", "scaling.json", "scaling.md", "scaling.png", "simulation.json"):
        assert (tmp_path / name).is_file(), name
    with open(tmp_path / "scaling.csv", newline="") as f:
        rows = {int(r["workers"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == [1, 2]
    assert [(rows[n]["repeats"], rows[n]["seeds"]) for n in (1, 2)] == [("2", "5 6")] * 2
    assert rows[2]["images_per_s_std"] != "" and rows[2]["metric_std"] != "" and rows[2]["speedup_std"] != ""
    # strong scaling of the overridden batch: 4 images per step either way
    assert float(rows[1]["global_batch"]) == float(rows[2]["global_batch"]) == 4
    assert float(rows[2]["predicted_speedup"]) > 0 and rows[2]["metric"] != ""
    for n, per_worker, rep in ((1, 4, 0), (2, 2, 1)):
        import yaml

        cfg = yaml.safe_load((tmp_path / f"ddp-{n}-r{rep}" / "config.yaml").read_text())
        assert cfg["train"]["seed"] == 5 + rep  # repeat r trains with --seed 5 + r
        assert cfg["data"]["args"]["image_size"] == [32, 32] and cfg["model"]["args"]["filters"] == [4, 8, 16]
        assert cfg["train"]["batch_size"] == per_worker and cfg["data"]["args"]["path"] == str(tiny_microscopy)


@pytest.mark.parametrize("workers", ["1,x", "0,2", "1,2,1"])  # 1,2,1: the second 1 counted as a repeat
def test_scale_rejects_bad_worker_lists(workers, capsys):
    from fastvision.cli import main

    assert main(["scale", "unet2d-microscopy", "--workers", workers]) == 2
    assert "--workers" in capsys.readouterr().err


def test_sweep_refuses_train_options_that_are_not_flag_value_pairs(tmp_path):
    """``extra`` is ``--flag value`` pairs: an odd list is refused before any run instead of losing its last item."""
    with pytest.raises(ValueError):
        scaling.sweep("unet2d-microscopy", [1], tmp_path, extra=["--set", "train.epochs=1", "--data"])
    assert not any(tmp_path.iterdir())


def test_efficiency_axis_shows_a_noisy_point_and_the_report_is_replaced_whole(tmp_path, monkeypatch):
    """The efficiency panel reaches past its highest point (a noisy 347 % was drawn off a 0-110 % axis), and a
    report whose writing fails part way (a kill, a full disk) leaves the files of the report before, no
    half-written PNG or temp file."""
    import matplotlib.figure

    from fastvision.scaling.report import sweep_figure

    noisy = [{"workers": 1, "images_per_s": 10.0, "metric_name": "iou", "metric": 0.5},
             {"workers": 2, "images_per_s": 69.4, "metric_name": "iou", "metric": 0.4}]
    fig = sweep_figure(scaling.summarize(noisy))
    eff = next(a for a in fig.axes if a.get_title() == "Efficiency")
    assert eff.get_ylim()[1] >= 3.47
    out = tmp_path / "out"
    scaling.write_report(RUNS, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def half(self, f, *a, **k):  # writes part of the image, then fails as a kill or a full disk would
        f.write(b"\x89PNG partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half)
    with pytest.raises(OSError):
        scaling.write_report(noisy, out)
    assert (out / "scaling.png").read_bytes() == before["scaling.png"]
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    with Image.open(out / "scaling.png") as im:
        assert im.format == "PNG"
