"""fastvision profile: input-bound with a deliberately slow dataset, compute-bound on in-memory and
synthetic data; report files; monitor CSV -> PNG on a hand-written CSV; NVML missing is one line."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset

from fastvision import cli
from fastvision.data.formats import DatasetSplits
from fastvision.profiling import percentiles_ms, plot_csv, read_csv
from fastvision.registry import DATASETS


class Blobs(Dataset):
    """In-memory segmentation items; ``delay`` seconds of sleep per read stands in for a slow transform."""

    def __init__(self, n: int, size: int, delay: float):
        g = torch.Generator().manual_seed(0)
        self.images = torch.rand(n, 1, size, size, generator=g)
        self.labels = (self.images[:, 0] > 0.5).long()
        self.delay = delay

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return {"image": self.images[i], "label": self.labels[i], "id": str(i)}


if "profile-blobs" not in DATASETS.names():
    @DATASETS.register("profile-blobs")
    def _blobs(*, image_size: list[int] = (32, 32), val_fraction: float = 0.2, split_seed: int = 0,
               delay: float = 0.0, count: int = 24) -> DatasetSplits:
        return DatasetSplits(Blobs(count, image_size[0], delay), Blobs(4, image_size[0], 0.0), {})


def _profile(tmp_path, name, *extra):
    out = tmp_path / name
    argv = ["profile", "unet2d-microscopy", "--steps", "6", "--warmup", "2", "--device", "cpu", "--batch-size", "4",
            "--out", str(out), "--set", "data.name=profile-blobs", "--set", "model.args.filters=[4,8,16]",
            "--set", "data.num_workers=2", *extra]
    assert cli.main(argv) == 0
    report = json.loads((out / "profile.json").read_text())
    assert "verdict:" in (out / "profile.txt").read_text()
    return report


def test_slow_transform_is_input_bound(tmp_path):
    report = _profile(tmp_path, "slow", "--set", "data.args.delay=0.25", "--set", "data.args.image_size=[16,16]",
                      "--set", "train.cpu_threads=1")
    assert report["verdict"] == "input-bound", report["shares"]
    assert report["advice"].startswith("set data.cache: ram and data.loader: threads")
    # two threads sleep 4 x 250 ms per batch (~500 ms per step) while compute takes ~15 ms on an
    # idle machine: a margin that survives a heavily loaded CI machine
    assert report["phases"]["data"]["mean"] > 200
    assert report["shares"]["input"] > 0.5 and report["phases"]["comm"]["p99"] == 0.0


def test_bursty_input_wait_counts_by_its_total():
    """A prefetching loader: three steps in four find a batch ready, the fourth waits 900 ms. The median
    wait is 0, but 900 of the 1,200 ms profiled are input: the verdict is input-bound (hand-computed shares)."""
    from fastvision import config
    from fastvision.profiling.profiler import PHASES, _report

    walls = [0.1, 0.1, 0.1, 0.9 + 0.1]
    per = {p: [0.0] * 4 for p in PHASES}
    per["data"] = [0.0, 0.0, 0.0, 0.9]
    per["forward"] = [0.1] * 4
    cfg = config.load("unet2d-microscopy")
    r = _report(cfg, per, [0.01] * 4, walls, 4, torch.device("cpu"), None, "test", "fp32")
    assert r["shares"]["input"] == pytest.approx(0.9 / 1.3) and r["verdict"] == "input-bound"
    assert r["shares"]["compute"] == pytest.approx(0.4 / 1.3)


@pytest.mark.parametrize("extra", [(), ("--synthetic", "--set", "task.args.sample_shape=[1,64,64]")])
def test_in_memory_data_is_compute_bound(tmp_path, extra):
    report = _profile(tmp_path, "fast", "--set", "data.args.image_size=[64,64]",
                      "--set", "model.args.filters=[8,16,32]", *extra)
    assert report["verdict"] == "compute-bound", report["shares"]
    ph = report["phases"]
    assert ph["forward"]["p50"] > 0 and ph["backward"]["p50"] > 0 and ph["optimizer"]["p50"] > 0
    assert ph["data"]["p50"] < 0.2 * report["step_ms"]["p50"]
    assert report["images_per_s"] == pytest.approx(4 / (report["step_ms"]["p50"] / 1e3), rel=1e-6)
    assert report["phases"]["data"]["p50"] <= report["phases"]["data"]["p90"] <= report["phases"]["data"]["p99"]


def test_percentiles_by_hand():
    out = percentiles_ms([0.001 * v for v in range(1, 101)])  # 1..100 ms
    assert out["p50"] == pytest.approx(50.5) and out["p90"] == pytest.approx(90.1)
    assert out["p99"] == pytest.approx(99.01) and out["mean"] == pytest.approx(50.5)


def test_monitor_plots_a_hand_written_seed_style_csv(tmp_path):
    csv = tmp_path / "nvidia_smi.csv"  # seed 003's tab-separated columns
    rows = ["time\tgpu_util\tused\ttotal\tratio"]
    for t in range(20):
        util = 0.0 if t % 5 == 4 else 95.0  # utilisation drops at every "epoch end"
        rows.append(f"{t:.6f}\t{util:.5f}\t{20000 + 100 * t:.5f}\t81920.00000\t{(20000 + 100 * t) / 819.2:.5f}")
    csv.write_text("\n".join(rows) + "\n")
    cols = read_csv(csv)
    assert cols["time_s"][:3] == [0.0, 1.0, 2.0] and cols["gpu_util"][4] == 0.0
    assert cols["mem_used_mib"][-1] == 21900.0 and cols["mem_total_mib"][0] == 81920.0
    png = plot_csv(csv, tmp_path / "gpu.png")
    img = np.asarray(Image.open(png).convert("L"))
    assert img.shape == (462, 770) and img.min() < 100 and img.max() == 255  # drawn lines on white
    assert cli.main(["monitor", "--replot", str(csv), "--plot", str(tmp_path / "b.png")]) == 0
    assert (tmp_path / "b.png").stat().st_size > 5000


def test_monitor_csv_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("time_s,gpu_util,mem_used_mib\n0,1\n")
    assert cli.main(["monitor", "--replot", str(bad)]) == 2


def test_monitor_without_nvml_is_one_line_error(tmp_path, capsys):
    try:
        import pynvml  # noqa: F401
        pytest.skip("NVML bindings installed here")
    except ImportError:
        pass
    assert cli.main(["monitor", "--out", str(tmp_path / "gpu.csv"), "--duration", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NVML is not available" in err[0]


def test_profile_takes_amp_auto_as_train_does(tmp_path):
    """``--amp auto`` resolves as in ``train``: on a CPU, fp32 (precision "off")."""
    report = _profile(tmp_path, "auto", "--amp", "auto", "--set", "data.args.image_size=[16,16]")
    assert report["config"]["train.amp"] == "auto" and report["config"]["precision"] == "off"


def test_synthetic_profile_needs_no_dataset(tmp_path):
    """--synthetic feeds device-resident batches: a recipe whose data folder does not exist still profiles
    (the dataset is never read), as `benchmark` does; without --synthetic the same call names the folder."""
    common = ["profile", "unet2d-seed001", "--steps", "2", "--warmup", "1", "--device", "cpu", "--batch-size", "2",
              "--data", str(tmp_path / "absent"), "--set", "task.args.sample_shape=[1,32,32]",
              "--set", "model.args.filters=[4,8]"]
    assert cli.main([*common, "--synthetic", "--out", str(tmp_path / "p")]) == 0
    report = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert report["pipeline"].startswith("synthetic batches") and report["step_ms"]["p50"] > 0
    assert cli.main([*common, "--out", str(tmp_path / "q")]) == 2


def test_compute_bound_advice_names_only_the_switches_still_off():
    """On CUDA the advice lists the speed switches the config has not set; with all of them on it names
    the levers left (batch, max-autotune, fp16: measured 1.28-1.30x bf16 for ResNet-50 on an H200)."""
    from fastvision import config
    from fastvision.profiling import advice

    cuda = torch.device("cuda")  # advice reads only the device type: no GPU needed
    cfg = config.load("unet2d-microscopy")
    cfg.train.amp, cfg.train.channels_last, cfg.train.compile = "off", False, False
    assert advice("compute", cfg, cuda) == \
        "set train.amp: bf16, train.channels_last: true and train.compile: true"
    cfg.train.amp, cfg.train.channels_last = "bf16", True
    assert advice("compute", cfg, cuda) == "set train.compile: true"
    cfg.train.compile = True
    on = advice("compute", cfg, cuda)
    assert "train.amp: fp16" in on and "max-autotune" in on and not on.startswith("set ")
    cfg.train.amp = "auto"  # on a GPU without bf16 (a V100) auto runs fp16: fp16 is not advised again
    assert "fp16" in advice("compute", cfg, cuda, "bf16") and "fp16" not in advice("compute", cfg, cuda, "fp16")
    cfg.train.amp, cfg.train.compile = "fp16", "max-autotune"
    assert advice("compute", cfg, cuda) == ("the model is the cost: raise train.batch_size; measure model.args "
                                            "up: shuffle, drop_bias: true and pad_in: 4 (the same model up to "
                                            "rounding: `fastvision tune` tries them)")
    cfg.model.args.update(up="shuffle", drop_bias=True, pad_in=8)  # the seed-001 model's levers, all set
    assert advice("compute", cfg, cuda) == "the model is the cost: raise train.batch_size"
    assert "run on a GPU" in advice("compute", cfg, torch.device("cpu"))


def test_compute_bound_advice_pairs_channels_last_with_the_layout_keeping_norm():
    """The 3-D U-Net's stock InstanceNorm copies channels-last activations (issue 40): the advice
    names channels-last together with ``norm: instance_cl``, or the norm alone once channels-last is on."""
    from fastvision import config
    from fastvision.profiling import advice

    cuda = torch.device("cuda")
    cfg = config.load("unet3d-brats")
    cfg.train.amp, cfg.train.channels_last, cfg.train.compile = "bf16", False, True
    assert advice("compute", cfg, cuda) == "set train.channels_last: true with model.args.norm: instance_cl"
    cfg.train.channels_last = True
    assert advice("compute", cfg, cuda) == "set model.args.norm: instance_cl"
    cfg.model.args["norm"] = "instance_cl"
    assert advice("compute", cfg, cuda, "bf16").endswith("measure model.args up: shuffle and pad_in: 8 (the same "
                                                         "model up to rounding: `fastvision tune` tries them)")


def test_cpu_compute_bound_advice_names_bf16_only_where_the_cpu_computes_it(monkeypatch):
    """On a CPU the advice names train.amp: bf16 only where the CPU has a native bf16 unit (emulated bf16
    is slower), and not when the run is bf16 already; the layout pair for a model with stock instance norm;
    compile when it is off; then the model's size or a GPU."""
    from fastvision import config
    from fastvision.engine import runtime
    from fastvision.profiling import advice

    cpu = torch.device("cpu")
    cfg = config.load("unet3d-brats")
    cfg.train.amp, cfg.train.channels_last, cfg.train.compile = "auto", False, False
    monkeypatch.setattr(runtime, "cpu_native_bf16", lambda: None)
    assert advice("compute", cfg, cpu, "off") == (
        "the model is the cost: set train.channels_last: true with model.args.norm: instance_cl and "
        "train.compile: true; or a smaller model or image size, or run on a GPU (--device cuda)")
    monkeypatch.setattr(runtime, "cpu_native_bf16", lambda: "AVX-512 BF16")
    assert advice("compute", cfg, cpu, "off").startswith(
        "the model is the cost: set train.amp: bf16 (this CPU has AVX-512 BF16), train.channels_last: true")
    cfg.train.amp, cfg.train.channels_last, cfg.train.compile = "bf16", True, True
    assert advice("compute", cfg, cpu, "bf16") == (
        "the model is the cost: set model.args.norm: instance_cl; or a smaller model or image size, or run on "
        "a GPU (--device cuda)")
    cfg.model.args["norm"], cfg.train.channels_last = "instance_cl", False
    assert advice("compute", cfg, cpu, "bf16").startswith("the model is the cost: set train.channels_last: true;")
    cfg.train.channels_last = True
    assert advice("compute", cfg, cpu, "bf16") == \
        "the model is the cost: a smaller model or image size, or run on a GPU (--device cuda)"
    resnet = config.load("resnet50-imagenet")  # batch norm: no layout advice on a CPU (not measured there)
    resnet.train.amp, resnet.train.compile = "off", True
    assert "channels_last" not in advice("compute", resnet, cpu, "off")


def test_trace_names_the_ops_that_take_the_step(tmp_path):
    """--trace adds the top operations by self time: on a CPU, a small U-Net's step is its convolutions
    (forward and backward), so a convolution op leads; shares are of the total self time, in order."""
    report = _profile(tmp_path, "traced", "--synthetic", "--set", "task.args.sample_shape=[1,64,64]",
                      "--set", "data.args.image_size=[64,64]", "--trace", str(tmp_path / "trace"))
    assert (tmp_path / "trace" / "trace_rank0.json").stat().st_size > 1000
    ops = report["top_ops"]
    assert 3 <= len(ops) <= 12
    shares = [o["share"] for o in ops]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    assert "conv" in ops[0]["name"], [o["name"] for o in ops[:5]]
    assert all(o["calls_per_step"] > 0 and o["ms_per_step"] > 0 for o in ops)
    # the per-step figures are per profiled step (6): a step's conv time is below the step's wall time
    assert ops[0]["ms_per_step"] < report["step_ms"]["mean"] * 1.5
    assert "top ops (self CPU time)" in (tmp_path / "traced" / "profile.txt").read_text()
    # a second profile into the same trace folder is refused (before profiling) unless --force
    before = (tmp_path / "trace" / "trace_rank0.json").stat().st_mtime_ns
    assert cli.main(["profile", "unet2d-microscopy", "--synthetic", "--device", "cpu", "--out", str(tmp_path / "again"),
                     "--trace", str(tmp_path / "trace")]) == 2
    assert (tmp_path / "trace" / "trace_rank0.json").stat().st_mtime_ns == before and not (tmp_path / "again").exists()


def test_profile_reports_the_number_workers_auto_resolved_to(tmp_path):
    report = _profile(tmp_path, "auto", "--set", "data.num_workers=auto")
    n = report["config"]["data.num_workers"]
    assert isinstance(n, int) and report["pipeline"].endswith(f"; loader threads x {n}")


def test_top_ops_count_calls_over_the_profiled_steps_as_whole_numbers():
    # an op of some steps only (7 calls in 2 steps) printed "3.5" calls per step
    from types import SimpleNamespace

    from rich.console import Console

    from fastvision.profiling import render
    from fastvision.profiling.profiler import top_ops

    events = [SimpleNamespace(key="aten::conv2d", count=7, self_cpu_time_total=3000.0),
              SimpleNamespace(key="aten::add_", count=3, self_cpu_time_total=1000.0)]
    ops = top_ops(SimpleNamespace(key_averages=lambda: events), torch.device("cpu"), steps=2)
    assert [(o["calls"], o["ms_per_step"], o["share"]) for o in ops] == [(7, 1.5, 0.75), (3, 0.5, 0.25)]
    phase = {"p50": 1.0, "p90": 1.0, "p99": 1.0, "mean": 1.0}
    report = {"config": {"recipe": "r"}, "device": "cpu", "steps": 2, "global_batch": 4,
              "phases": dict.fromkeys(("data", "h2d", "augment", "forward", "backward", "optimizer", "comm"), phase),
              "step_ms": phase, "images_per_s": 1.0, "pipeline": "p", "verdict": "v", "advice": "a", "top_ops": ops}
    console = Console(width=200, record=True)
    console.print(render(report))
    text = console.export_text()
    assert "calls in 2 steps" in text and "3.5" not in text
    row = next(line for line in text.splitlines() if "aten::conv2d" in line)
    assert [c.strip() for c in row.split("│")][1:4] == ["aten::conv2d", "7", "1.50"], row
