"""fastvision plan: traced memory vs hand-computed bytes, ResNet-50 FLOPs vs the published count,
--batch-size auto under an artificial memory cap, the GPU table and the CLI."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fastvision import config
from fastvision.engine import runtime
from fastvision.engine.step import StepState
from fastvision.errors import ConfigError, DataError
from fastvision.planning import autobatch
from fastvision.planning import estimate as est
from fastvision.planning.devices import GPUS, get_gpu
from fastvision.planning.trace import trace_step
from fastvision.tasks.base import Task

F32 = 4  # bytes

pytestmark = pytest.mark.usefixtures("traced_once")  # tests/planning/conftest.py


class SquareTask(Task):
    """A task as the engine sees one: the input is a flat or image tensor, the loss mean(out^2)."""

    input_key = "image"

    def __init__(self, shape):
        self.shape = shape

    def synthetic_batch(self, b, device):
        return {"image": torch.randn(b, *self.shape, device=device)}

    def to_device(self, batch, device, channels_last=False):
        return batch

    def forward(self, model, batch):
        return model(batch["image"])

    def loss(self, out, batch):
        return out.square().mean()


def mlp(d, h, c):
    return nn.Sequential(nn.Linear(d, h, bias=False), nn.ReLU(), nn.Linear(h, c, bias=False))


def convnet(cin, k, side, c):
    return nn.Sequential(nn.Conv2d(cin, k, 3, padding=1, bias=False), nn.ReLU(), nn.Flatten(),
                         nn.Linear(k * side * side, c, bias=False))


def builder(make, device="meta"):
    def build():
        with torch.device(device):
            model = make()
        return model, SquareTask(make.shape), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return build


def _mlp_make(d, h, c):
    def make():
        return mlp(d, h, c)
    make.shape = (d,)
    return make


def _conv_make(cin, k, side, c):
    def make():
        return convnet(cin, k, side, c)
    make.shape = (cin, side, side)
    return make


# Hand count of the steady-state step (second step; SGD momentum buffers exist), fp32. The peak is
# in the ReLU backward: the ReLU output r (saved), the gradient reaching it and the gradient it
# produces are three (b, H) tensors; the input x is live, the second layer's weight gradient
# (H x C) has been made, the first layer's not yet. Parameters P and momentum buffers P are live.
@pytest.mark.parametrize("make, b, d, hidden, c, params", [
    (_mlp_make(64, 512, 4), 256, 64, 512, 4, 64 * 512 + 512 * 4),
    (_conv_make(3, 16, 8, 4), 64, 3 * 8 * 8, 16 * 8 * 8, 4, 16 * 3 * 9 + 16 * 8 * 8 * 4),
], ids=["mlp", "convnet"])
def test_memory_matches_hand_count(make, b, d, hidden, c, params):
    t = trace_step(builder(make), b)
    assert t.parameters == params * F32
    assert t.optimizer_state == params * F32  # one momentum buffer per parameter
    assert t.inputs == b * d * F32
    assert t.gradients == hidden * c * F32  # second layer only
    three = 3 * b * hidden * F32
    assert three <= t.activations <= three + 4 * b * c * F32 + 64  # + the small (b, C) loss tensors
    hand = 2 * params * F32 + b * d * F32 + hidden * c * F32 + three
    assert abs(t.peak_bytes - hand) / hand < 0.01


@pytest.mark.slow
def test_resnet50_forward_flops_match_published_macs():
    """torchvision lists ResNet-50 at 4.09 G multiply-adds per 224 px image: 8.18 GFLOPs."""
    cfg = config.load("resnet50-imagenet", [{"train": {"amp": "off", "channels_last": False}}])
    t = est.trace(cfg, 1)
    assert abs(t.forward_flops / 8.18e9 - 1) < 0.02
    assert 2.8 < t.flops / t.forward_flops < 3.2  # backward about twice the forward


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_half_precision_trace_runs_the_step_and_halves_activations(amp):
    """fp16 too (the trace has no loss scaler; the engine's step must not look for one): autocast
    stores the convolutions' outputs in 2 bytes instead of 4."""
    make = _conv_make(3, 16, 8, 4)
    fp32, half = trace_step(builder(make), 32), trace_step(builder(make), 32, amp=amp)
    assert half.flops == fp32.flops
    assert half.activations < 0.75 * fp32.activations


def test_checkpointing_and_compile_lower_activation_memory():
    make = _conv_make(3, 16, 8, 4)
    plain = trace_step(builder(make), 32)
    assert est.memory(plain, compile=True).activations < est.memory(plain).activations  # ReLU output recomputed


# Under a cap on the bytes a try creates (parameters excluded), the steady-state peak is
# P (momentum) + x + W2 grad + three (b, H) tensors (see the hand count above), so the largest
# batch under a cap halfway between batch 37 and 38 is 37.
@pytest.mark.slow
def test_batch_size_auto_finds_known_largest_batch_under_cap():
    d, h, c = 64, 1024, 4
    make = _mlp_make(d, h, c)
    params = d * h + h * c

    def needed(b):
        return (params + h * c + b * (d + 3 * h)) * F32

    cap = (needed(37) + needed(38)) // 2
    model, task, make_optimizer = builder(make, "cpu")()
    cpu = torch.device("cpu")
    state = StepState(task, model, None, None, runtime.Precision("off", cpu), cpu, torch.Generator())
    fits = autobatch.step_fits(state, make_optimizer, cap=cap)
    calls = []

    def counted(b):
        calls.append(b)
        return fits(b)

    assert autobatch.search(counted, start=2, limit=4096) == 37
    assert len(calls) <= 12  # bounded: doubling then bisection


@pytest.mark.parametrize("limit, answer", [(4096, 37), (20, 20), (1, 1)])
def test_search_is_bounded_and_monotone(limit, answer):
    assert autobatch.search(lambda b: b <= 37, start=2, limit=limit) == answer
    assert autobatch.search(lambda b: False, start=8) == 0


def test_gpu_table_names_and_aliases():
    assert get_gpu("h100-80gb") is GPUS["H100-80GB"]
    assert get_gpu("NVIDIA A100-SXM4-40GB").name == "A100-40GB"
    assert get_gpu("Tesla V100-SXM2-16GB").peak_tflops("bf16") == (15.7, "fp32")  # no bf16 tensor cores
    # "b200" is inside "gb200": torch's device names must still find each
    assert get_gpu("NVIDIA GB200").name == "GB200" and get_gpu("NVIDIA B200").name == "B200"
    with pytest.raises(ConfigError):
        get_gpu("H900")


def test_every_simulator_hardware_preset_names_a_gpu_in_the_table():
    from fastvision.scaling.simulator import hardware_presets, load_hardware

    for name in hardware_presets():
        assert get_gpu(load_hardware(name).gpu).name in GPUS


def test_plan_with_a_hardware_preset_uses_its_node_shape():
    from fastvision.planning.plan import Cluster, make_plan

    cfg = config.load("unet2d-microscopy")
    plan = make_plan(cfg, Cluster(gpus=16, hardware="dgx-h100"), switches=False)
    assert plan["gpu"] == "H100-80GB" and plan["gpus_per_node"] == 8
    assert all(0 < e <= 1 for e in plan["estimate"]["efficiency"])


@pytest.mark.slow
def test_plan_cli_table_json_png(tmp_path, capsys):
    from fastvision.cli import main

    out = tmp_path / "plan.json"
    rc = main(["plan", "unet2d-microscopy", "--gpu", "T4", "--gpus", "16", "--nodes", "2", "--no-switches",
               "--price-per-gpu-hour", "0.5", "--json", str(out), "--png", str(tmp_path / "plan.png")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "largest batch that fits" in text and "time to train 20 epochs" in text
    plan = json.loads(out.read_text())
    e = plan["estimate"]
    assert plan["gpus_per_node"] == 8 and e["fits"]
    # epoch time: the batches a GPU steps (896 // 16 = 56 items, 3 batches of 16, the last 8 dropped as the
    # loader drops them) x the step at scale (step / efficiency), both ends of the range
    for step, eff, epoch in zip(e["step_s"], e["efficiency"], e["epoch_s"], strict=True):
        assert epoch == pytest.approx(3 * step / eff)
    assert e["cost"][0] == pytest.approx(e["gpu_hours"][0] * 0.5)
    assert (tmp_path / "plan.png").stat().st_size > 0
    assert main(["plan", "unet2d-microscopy", "--gpu", "H900"]) == 2
    # an existing --json is not overwritten without --force (refused before the trace), and is with it
    before = out.read_text()
    capsys.readouterr()
    assert main(["plan", "unet2d-microscopy", "--gpus", "8", "--no-switches", "--json", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and out.read_text() == before
    assert main(["plan", "unet2d-microscopy", "--gpus", "8", "--no-switches", "--json", str(out), "--force"]) == 0
    assert json.loads(out.read_text())["gpus"] == 8


@pytest.mark.slow
def test_train_batch_size_auto_resolves_before_fit(tmp_path, monkeypatch):
    """`train --batch-size auto` on CPU with a cap: the run trains at the batch the search found
    and logs the LR the recipe's rule gives for it (Adam 3e-3 per 16 images)."""
    import logging

    import yaml

    from fastvision.api import run_training

    monkeypatch.setenv("FASTVISION_MEMORY_CAP_MB", "60")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # the CLI's logging setup may stop propagation to caplog
    logger = logging.getLogger("fastvision.planning.autobatch")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        run_training("unet2d-microscopy", out=str(tmp_path / "run"), progress=False,
                     overrides={"batch_size": "auto", "epochs": 1, "device": "cpu",
                                "train.steps_per_epoch": 1, "examples": 0})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]["batch_size"]
    assert isinstance(saved, int) and 1 <= saved < 4096
    msg = next(r.getMessage() for r in records if "per device on" in r.getMessage())
    assert f"auto: {saved} per device" in msg and f"lr {3e-3 * saved / 16:.4g}" in msg


def test_batch_size_auto_on_cpu_without_cap_is_a_config_error(monkeypatch):
    monkeypatch.delenv("FASTVISION_MEMORY_CAP_MB", raising=False)
    cfg = config.load("unet2d-microscopy", [{"train": {"batch_size": "auto"}}])
    with pytest.raises(ConfigError, match="FASTVISION_MEMORY_CAP_MB"):
        autobatch.resolve_auto_batch(cfg, torch.device("cpu"))


def test_planning_builds_on_meta_without_reading_weights():
    """ssd320-coco names ImageNet backbone weights; the planner's model is shapes only (no download)."""
    cfg = config.load("ssd320-coco")
    assert cfg.model.args.get("pretrained") == "imagenet"
    model, _, _ = est.build_for(cfg)()
    assert all(p.is_meta for p in model.parameters())


def test_smaller_input_switch_keeps_the_recipes_divisibility():
    """0.75 of spleen-fast's 96^3 patch is 72, which its 5-level U-Net (divisor 16) refuses: the
    switch rounds to a multiple of 32 (the largest power of two dividing 96) -> 64; BraTS 128 -> 96."""
    spleen, what, _ = est.with_input_scale(config.load("unet3d-spleen-fast"), 0.75)
    assert spleen.task.args["sample_shape"] == [1, 64, 64, 64] and what == "patch 64x64x64"
    brats, _, _ = est.with_input_scale(config.load("unet3d-brats"), 0.75)
    assert brats.task.args["sample_shape"][1:] == [96, 96, 96]


def test_scaling_efficiency_reads_the_hardware_profile_once(monkeypatch):
    from fastvision.scaling import simulator

    reads = []
    real = simulator.load_hardware
    monkeypatch.setattr(simulator, "load_hardware", lambda name: reads.append(name) or real(name))
    est._hardware.cache_clear()
    try:
        runs = [est.scaling_efficiency(0.1, 32, 100e6, g, 8, "infiniband", "dgx-h100") for g in (1, 8, 16)]
    finally:
        est._hardware.cache_clear()  # no profile read through the patched loader outlives the test
    assert reads == ["dgx-h100"] and runs[0]["efficiency"] == pytest.approx(1.0)


def _wanted(cfg, gpu: str) -> str:
    """The precision whose benchmark rows calibrate ``cfg`` planned for ``gpu`` (amp auto resolved there)."""
    return est.amp_for("auto", get_gpu(gpu)) if cfg.train.amp == "auto" else est.precision_of(cfg)


def _bench(tmp_path, rows, gpu="A100-80GB"):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"mode": "train", "gpu": gpu, "results": [
        {"precision": p, "batch_size": b, "items_per_s": ips} for p, b, ips in rows]}))
    return str(path)


@pytest.mark.parametrize("rows,fixed_ms,given,expect_fixed,expect_item", [
    # the line t(b) = b x 2 ms + 10 ms measured at batch 8 and 32: the intercept is the fixed cost
    ([(8, 8 / 0.026), (32, 32 / 0.074)], None, None, 10.0, 2.0),
    # three points on the same line, one measured twice (averaged): the same answer
    ([(8, 8 / 0.026), (16, 16 / 0.042), (32, 32 / 0.074), (32, 32 / 0.074)], None, None, 10.0, 2.0),
    # --fixed-ms wins over the intercept: the compute per item is the rest of the largest batch's step
    ([(8, 8 / 0.026), (32, 32 / 0.074)], 4.0, 4.0, 4.0, (74 - 4) / 32),
    # one batch size: the fitted default splits it (74 ms at 32 -> compute (74 - F) / 32 per item)
    ([(32, 32 / 0.074)], None, "fitted", "fitted", None),
    # per-item time grows with the batch: no intercept to measure, the larger batch's step per item
    ([(8, 8 / 0.016), (32, 32 / 0.080)], None, None, 0.0, 80 / 32),
    # a --fixed-ms larger than half the measured step is capped there: 37 of the 74 ms at batch 32
    ([(32, 32 / 0.074)], 50.0, 50.0, 37.0, 37 / 32),
    # points off one line: the least-squares slope and intercept, not the largest batch's remainder
    # through (8, 26), (16, 30), (32, 74) ms: mean batch 56/3, mean step 130/3 ms, slope 59/28 ms per
    # item, intercept 130/3 - 59/28 x 56/3 = 4 ms
    ([(8, 8 / 0.026), (16, 16 / 0.030), (32, 32 / 0.074)], None, None, 4.0, 59 / 28),
])
def test_calibrate_fits_the_step_line_over_the_benchmarks_batch_sizes(tmp_path, rows, fixed_ms, given,
                                                                       expect_fixed, expect_item):
    from fastvision.planning import scale as sc
    from fastvision.planning.plan import Cluster, Workload, make_plan

    cfg = config.load("unet2d-microscopy")
    want = _wanted(cfg, "A100-80GB")
    path = _bench(tmp_path, [(want, b, ips) for b, ips in rows] + [("fp32", 8, 1.0)])  # other precision: ignored
    plan = make_plan(cfg, Cluster(gpu="A100-80GB"), Workload(batch=16, calibrate=path, fixed_ms=fixed_ms),
                     switches=False)
    if expect_fixed == "fitted":
        expect_fixed = sc.fixed_step_ms(None)[0]
        expect_item = (74 - expect_fixed) / 32
    assert plan["fixed_ms"] == pytest.approx(expect_fixed, abs=1e-6)
    fast, slow = plan["estimate"]["step_s"]
    # the calibrated share is +-15 % on the compute part; the fixed cost is added whole at any batch
    assert fast * 1e3 == pytest.approx(16 * expect_item / 1.15 + expect_fixed, rel=1e-6)
    assert slow * 1e3 == pytest.approx(16 * expect_item / 0.85 + expect_fixed, rel=1e-6)
    assert plan["fixed_source"].startswith("measured:") == (given is None and expect_fixed > 0)


def test_calibrate_refuses_a_step_that_does_not_grow_with_the_batch(tmp_path):
    from fastvision.planning.plan import Cluster, Workload, make_plan

    cfg = config.load("unet2d-microscopy")
    want = _wanted(cfg, "A100-80GB")
    path = _bench(tmp_path, [(want, 8, 8 / 0.020), (want, 32, 32 / 0.018)])
    with pytest.raises(DataError, match="does not grow with the batch"):
        make_plan(cfg, Cluster(gpu="A100-80GB"), Workload(batch=16, calibrate=path), switches=False)


def test_calibrate_falls_back_to_the_other_half_precision_before_fp32(tmp_path):
    from fastvision.planning.plan import Cluster, Workload, make_plan

    cfg = config.load("unet2d-microscopy")
    cfg.train.amp = "bf16"  # the target's precision; the benchmark GPU (a V100) measured fp16 and fp32
    path = _bench(tmp_path, [("fp32", 8, 8 / 0.100), ("fp32", 32, 32 / 0.400),
                             ("fp16", 8, 8 / 0.026), ("fp16", 32, 32 / 0.074)], gpu="V100-16GB")
    plan = make_plan(cfg, Cluster(gpu="A100-80GB"), Workload(batch=16, calibrate=path), switches=False)
    assert plan["fixed_ms"] == pytest.approx(10.0) and "fp16" in plan["achieved_source"]


def test_a_calibrated_fixed_cost_reaches_the_at_scale_model(tmp_path):
    from fastvision.planning.plan import Cluster, Workload, make_plan

    cfg = config.load("unet2d-microscopy")
    want = _wanted(cfg, "H100-80GB")
    # 10 ms fixed + 2 ms per item: at 2 items per GPU the fixed cost is most of the step
    path = _bench(tmp_path, [(want, 8, 8 / 0.026), (want, 32, 32 / 0.074)], gpu="H100-80GB")
    plan = make_plan(cfg, Cluster(gpus=64, hardware="dgx-h100"), Workload(batch=2, calibrate=path),
                     switches=False, min_efficiency=0.5)
    fast, slow = plan["estimate"]["step_s"]
    assert fast * 1e3 == pytest.approx(2 * 2 / 1.15 + 10) and slow * 1e3 == pytest.approx(2 * 2 / 0.85 + 10)
    for s in plan["estimate"]["scale"]:
        assert s["limit"] == "fixed per-step cost"
        assert s["step_s"] > plan["fixed_ms"] / 1e3  # the fixed cost is inside the step at scale too


def test_plan_uses_the_shipped_measurement_on_the_gpu_it_was_measured_on():
    """On an H200 at bf16, resnet50-imagenet's step comes from the shipped H200 benchmark JSON: the fixed
    cost is the least-squares intercept of its bf16 rows (numpy's polyfit here) and the measured batch-256
    step lies inside the +-15 % range. Elsewhere (an A100, fp32, or a given --achieved) it is not used."""
    import numpy as np

    from fastvision.planning import estimate as est
    from fastvision.planning.plan import Cluster, Workload, make_plan

    shipped = json.loads((est.MEASURED_DIR / "resnet50-imagenet-train.json").read_text())
    assert shipped["gpu"] == "NVIDIA H200" and shipped["mode"] == "train"
    rows = [(r["batch_size"], r["batch_size"] / r["items_per_s"]) for r in shipped["results"]
            if r["precision"] == "bf16"]
    slope, intercept = np.polyfit([b for b, _ in rows], [s for _, s in rows], 1)
    cfg = config.load("resnet50-imagenet")  # amp auto: bf16 on an H200
    plan = make_plan(cfg, Cluster(gpu="H200"), Workload(batch=256), switches=False)
    assert plan["achieved_source"].startswith("shipped measurement, H200 bf16")
    assert plan["fixed_ms"] == pytest.approx(intercept * 1e3, rel=1e-6)
    fast, slow = plan["estimate"]["step_s"]
    measured = dict(rows)[256]
    assert fast < measured < slow and slow / fast < 1.4
    assert make_plan(cfg, Cluster(gpu="A100-80GB"), Workload(batch=256), switches=False)["achieved_source"] \
        == "default range"
    assert make_plan(cfg, Cluster(gpu="H200"), Workload(batch=256, achieved=(0.2, 0.4)),
                     switches=False)["achieved_source"] == "given (--achieved)"  # a given range wins
    h200 = est.get_gpu("H200")
    cfg.train.amp = "off"  # no fp32 rows were measured
    assert est.shipped_measurement("resnet50-imagenet", h200, est.precision_of(cfg), True) is None
    assert est.shipped_measurement("resnet50-imagenet", h200, "fp16", True) is not None
    assert est.shipped_measurement("resnet50-imagenet", h200, "bf16", False) is None  # measured in NHWC
    assert est.shipped_measurement("unet2d-microscopy", h200, "bf16", False) is None
