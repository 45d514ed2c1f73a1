"""Benchmark mode: the precisions a device runs, the measured steps really train (or do not), every
recipe builds without its dataset, and the CLI writes JSON + Markdown reports (the report's
figures: tests/benchmark/test_report.py)."""
from __future__ import annotations

import json

import pytest
import torch

from fastvision import engine
from fastvision.benchmark import modes as benchmark
from fastvision.cli import main
from fastvision.config import list_recipes, load, parse_override

TINY_UNET = ["--set", "task.args.sample_shape=[1,32,32]", "--set", "model.args.filters=[4,8,16]"]


@pytest.mark.parametrize("precisions, runs, skipped", [
    (["fp32", "tf32", "fp16", "bf16"], ["fp32", "bf16"], ["tf32", "fp16"]),
    (["bf16"], ["bf16"], []),
])
def test_runnable_precisions_on_cpu_skip_cuda_only_ones(precisions, runs, skipped):
    todo, notes = benchmark.runnable_precisions(precisions, torch.device("cpu"))
    assert todo == runs
    assert [n.split()[0] for n in notes] == skipped


def test_runnable_precisions_reject_unknown_precision():
    from fastvision.errors import ConfigError

    with pytest.raises(ConfigError, match="fp8"):
        benchmark.runnable_precisions(["fp8"], torch.device("cpu"))


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_measured_steps_update_weights_only_in_train_mode(mode):
    cfg = load("unet2d-microscopy", [parse_override(s) for s in TINY_UNET[1::2]])
    run = engine.build(benchmark.setting_config(cfg, 2, "fp32"), data_info={}, train=mode == "train")
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    times, memory = benchmark._measure(run, mode, steps=2, warmup=1)
    assert len(times) == 2 and all(t > 0 for t in times) and memory == {}  # no CUDA: no memory figures
    changed = any(not torch.equal(before[k], v) for k, v in run.model.state_dict().items())
    assert changed == (mode == "train")


@pytest.mark.parametrize("recipe", list_recipes())
def test_every_recipe_builds_without_its_dataset(recipe):
    cfg = load(recipe)
    if cfg.model.args.get("pretrained") == "imagenet":  # no weights file here: tests/models/test_resnet.py loads one
        cfg.model.args["pretrained"] = None
    run = engine.build(benchmark.setting_config(cfg, 1, "fp32", augment=True), data_info={}, train=True)
    batch = run.task.synthetic_batch(1, torch.device("cpu"))
    assert batch[run.task.input_key].shape[0] == 1
    assert sum(p.numel() for p in run.model.parameters()) > 0 and run.step.optimizer is not None


def test_detection_inference_step_runs_without_dataset_info():
    cfg = load("ssd320-small-shapes", [parse_override("task.args.image_size=64")])
    report = benchmark.run_benchmark(cfg, "inference", [2], ["fp32"], steps=1, warmup=0)
    assert report["results"][0]["items_per_s"] > 0


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_cli_writes_json_and_markdown(mode, tmp_path, capsys):
    rc = main(["benchmark", "unet2d-microscopy", "--mode", mode, "--batch-sizes", "1,2", "--precision",
               "fp32,fp16,bf16", "--steps", "2", "--warmup", "1", "--device", "cpu", "--out", str(tmp_path),
               *TINY_UNET])
    assert rc == 0
    report = json.loads((tmp_path / f"unet2d-microscopy-{mode}.json").read_text())
    assert report["mode"] == mode and report["device"] == "cpu" and report["steps"] == 2
    assert report["notes"] == ["fp16 skipped: needs a CUDA device"]
    rows = report["results"]
    assert [(r["batch_size"], r["precision"]) for r in rows] == [(1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16")]
    for r in rows:
        for key in ("items_per_s", "items_per_s_overall", "latency_mean_ms", "latency_p50_ms", "latency_p90_ms",
                    "latency_p95_ms", "latency_p99_ms"):
            assert r[key] > 0, key
        assert r["latency_p90_ms"] <= r["latency_p95_ms"] <= r["latency_p99_ms"]
    assert all(r["speedup_vs_fp32"] > 0 for r in rows if r["precision"] == "bf16")
    md = (tmp_path / f"unet2d-microscopy-{mode}.md").read_text()
    assert "| batch | precision | items/s | median ms | p90 ms | p95 ms | p99 ms | x fp32 |" in md
    assert md.count("| bf16 |") == 2 and "fp16 skipped" in md
    assert "items/s" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value", [("--batch-sizes", "1,x"), ("--batch-sizes", "0"), ("--precision", "fp8"),
                                         ("--steps", "0")])
def test_cli_bad_flag_values_are_one_line_errors_before_the_outputs_check(flag, value, tmp_path, capsys):
    """A bad value is named even where the outputs of an earlier run are there (it said "file exists")."""
    (tmp_path / "unet2d-microscopy-train.json").write_text("{}")
    rc = main(["benchmark", "unet2d-microscopy", flag, value, "--device", "cpu", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and flag in err and "file exists" not in err, err
    assert (tmp_path / "unet2d-microscopy-train.json").read_text() == "{}"


@pytest.mark.parametrize("mode, recipe, sets, needle", [
    # 20 px is no multiple of the 4-level U-Net's 2**3 (8): the model's own check
    ("inference", "unet2d-microscopy", ["task.args.sample_shape=[1,20,20]", "model.args.filters=[4,8,16,32]"],
     "task.args.sample_shape [1, 20, 20]"),
    # 8 px through ResNet-18's 32x reduction at batch 1: BatchNorm sees one value per channel in training
    ("train", "resnet18-imagefolder", ["task.args.image_size=8"], "task.args.image_size 8, batch 1"),
])
def test_a_synthetic_batch_the_model_cannot_take_is_one_line_naming_its_key(mode, recipe, sets, needle, tmp_path,
                                                                             capsys):
    """Before, the model's error was a traceback (exit 1) from inside the timing loop."""
    from tests.cli.input_checks import one_line_error, run_cli

    code, _, err = run_cli(capsys, "benchmark", recipe, "--mode", mode, "--batch-sizes", "1", "--steps", "1",
                           "--warmup", "0", "--device", "cpu", "--out", tmp_path,
                           *[a for s in sets for a in ("--set", s)])
    one_line_error(code, err, f"the first {'training' if mode == 'train' else 'inference'} step failed", needle)
    assert not list(tmp_path.iterdir())  # no report of a benchmark that did not run
