"""One step for every caller: fit, profile and benchmark run ``engine.train_step``; accumulation and
clipping match a plain-torch reference; checkpoints are written in the background from a snapshot
and survive kill -9; ``benchmark --mode data`` runs a 2-D and a 3-D recipe's input path."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fastvision
from fastvision import config, engine
from fastvision.api import overrides_to_dicts
from fastvision.cli import main
from fastvision.engine import checkpoint
from fastvision.profiling import profile_run
from tests.conftest import clean_env, tiny_overrides

ACCUM_CLIP = {"batch_size": 2, "train.accum_steps": 2, "train.clip_grad": 0.05, "train.steps_per_epoch": 3, "epochs": 1,
              "examples": 0}


def _cfg(data, **more):
    return config.load("unet2d-microscopy", overrides_to_dicts(tiny_overrides(data, **{**ACCUM_CLIP, **more})))


def test_profile_trains_exactly_like_fit(tiny_microscopy, tmp_path):
    """Same config, same batches: 3 profiled steps (accumulation 2, clipping) end with the weights of
    fit's one epoch of 3 steps (12 training items in micro-batches of 2)."""
    fastvision.train("unet2d-microscopy", out=str(tmp_path / "fit"), **tiny_overrides(tiny_microscopy, **ACCUM_CLIP))
    fit_weights = checkpoint.load(tmp_path / "fit" / "checkpoints" / "last.pt")["model"]
    run = engine.build(_cfg(tiny_microscopy), train=True)
    report = profile_run(run, steps=3, warmup=0)
    assert report["global_batch"] == 2 * 2  # batch x accumulation steps (x world size 1)
    got = checkpoint.strip_prefixes(run.model.state_dict())
    assert got.keys() == fit_weights.keys()
    for k in got:
        assert torch.equal(got[k], fit_weights[k]), k
    # and clipping is part of that step: without it the weights differ
    free = engine.build(_cfg(tiny_microscopy, **{"train.clip_grad": None}), train=True)
    profile_run(free, steps=3, warmup=0)
    assert any(not torch.equal(v, got[k]) for k, v in free.model.state_dict().items())


def test_train_step_matches_a_plain_torch_reference(tiny_microscopy):
    """Two accumulated half-batches + global-norm clipping + SGD, written out by hand."""
    cfg = _cfg(tiny_microscopy, **{"optim.name": "sgd", "optim.momentum": 0.0, "optim.weight_decay": 0.0,
                                   "data.augment": {"flip": None, "rot90": None}, "optim.lr": 0.5,
                                   "sched.warmup_epochs": 0})
    run = engine.build(cfg, train=True, loaders=False, data_info={})
    g = torch.Generator().manual_seed(3)
    micro = [{"image": torch.rand(4, 1, 32, 32, generator=g),
              "label": (torch.rand(4, 32, 32, generator=g) > 0.5).long()} for _ in range(2)]
    ref = {k: v.clone() for k, v in run.model.state_dict().items()}
    lr = run.step.optimizer.param_groups[0]["lr"]
    model = engine.build(cfg, loaders=False, data_info={}).model  # same seed: same initial weights
    model.load_state_dict(ref)
    model.train()
    for b in micro:
        (run.task.loss(model(b["image"]), b) / 2).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in params))
    coef = min(1.0, 0.05 / (float(norm) + 1e-6))
    assert coef < 1  # the clip is active
    with torch.no_grad():
        for p in params:
            p -= lr * coef * p.grad
    out = engine.train_step(run.step, iter(micro))
    assert float(out.skipped) == 0 and out.images == 8
    for (k, a), b in zip(run.model.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), k


def test_only_the_engine_runs_a_backward_pass():
    """profile, benchmark and export reach training only through engine.train_step."""
    root = Path(fastvision.__file__).parent
    callers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if ".backward(" in p.read_text())
    assert callers == ["engine/step.py"]
    for module in ("profiling/profiler.py", "benchmark/modes.py"):
        assert "engine.train_step(" in (root / module).read_text()


# ------------------------------------------------------------------------------ checkpoints
def test_background_writer_keeps_the_snapshot_not_the_live_tensors(tmp_path):
    w = torch.arange(6, dtype=torch.float32)
    state = {"model": {"w": w}, "history": [{"epoch": 0}], "step": 1}
    writer = checkpoint.BackgroundWriter()
    writer.write(state, [tmp_path / "last.pt", tmp_path / "best.pt"])
    w.add_(100)  # training goes on while the thread writes
    state["history"].append({"epoch": 1})
    writer.join()
    for name in ("last.pt", "best.pt"):
        got = checkpoint.load(tmp_path / name)
        assert torch.equal(got["model"]["w"], torch.arange(6, dtype=torch.float32))
        assert got["history"] == [{"epoch": 0}] and got["step"] == 1
    writer.write({"model": {"w": w}}, [tmp_path / "last.pt"])  # best.pt untouched when not improved
    writer.join()
    assert torch.equal(checkpoint.load(tmp_path / "last.pt")["model"]["w"], w)
    assert torch.equal(checkpoint.load(tmp_path / "best.pt")["model"]["w"], torch.arange(6, dtype=torch.float32))


def test_background_write_error_is_raised_by_join(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    writer = checkpoint.BackgroundWriter()
    writer.write({"model": {}}, [tmp_path / "file" / "last.pt"])
    with pytest.raises(OSError):
        writer.join()
    writer.join()  # reported once


def test_summary_has_both_clocks(tiny_microscopy, tmp_path):
    summary = fastvision.train("unet2d-microscopy", out=str(tmp_path / "run"),
                               **tiny_overrides(tiny_microscopy, epochs=2, target="iou=0.0"))
    assert summary["target_reached"] and 0 < summary["time_to_target_s"] <= summary["time_to_target_wall_s"]
    assert summary["time_to_target_wall_s"] <= summary["wall_time_s"]
    assert summary["train_time_s"] < summary["wall_time_s"]
    ckpt = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.pt")
    assert ckpt["wall_time"] == pytest.approx(summary["time_to_target_wall_s"])


@pytest.mark.slow
def test_kill_9_during_training_leaves_a_loadable_last_checkpoint(tiny_microscopy, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "fastvision.cli", "train", "unet2d-microscopy", "--out", str(run), "--data",
           str(tiny_microscopy), "--epochs", "500", "--batch-size", "4", "--device", "cpu",
           "--set", "data.args.image_size=[32,32]", "--set", "model.args.filters=[4,8,16]",
           "--set", "data.num_workers=0", "--set", "examples=0"]
    proc = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = run / "checkpoints" / "last.pt"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (last.is_file() and checkpoint.load(last)["epoch"] >= 2):
            time.sleep(0.05)  # a few epochs in: later writes are in flight while we kill
        time.sleep(0.13)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    ckpt = checkpoint.load(last)
    assert ckpt["epoch"] >= 2 and ckpt["model"]


# ------------------------------------------------------------------------------ --mode data
def _data_benchmark(capsys, recipe, out, *extra):
    assert main(["benchmark", recipe, "--mode", "data", "--steps", "4", "--rounds", "2", "--device", "cpu",
                 "--out", str(out), *extra]) == 0
    text = capsys.readouterr().out
    report = json.loads(next(out.glob("*-data.json")).read_text())
    return text, report


def test_data_mode_compares_cache_modes_of_a_2d_recipe(tiny_microscopy, tmp_path, capsys):
    text, report = _data_benchmark(capsys, "unet2d-microscopy", tmp_path, "--cache", "none,ram",
                                   "--batch-sizes", "4", "--set", f"data.args.path={tiny_microscopy}",
                                   "--set", "data.args.image_size=[32,32]")
    assert [r["cache"] for r in report["results"]] == ["none", "ram"]
    assert all(r["items"] == 2 * 2 * 4 and r["items_per_s"] > 0 for r in report["results"])
    assert re.search(r"ms/item", text) and "CacheDataset" in report["results"][1]["pipeline"]


def test_data_mode_runs_a_3d_recipe(tmp_path, capsys, monkeypatch):
    from fastvision.data.synth import load_all

    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "cache"))
    data = load_all().get("spleen")(tmp_path / "data", seed=0, cases=5, test_cases=0, size=24)
    text, report = _data_benchmark(capsys, "unet3d-spleen-fast", tmp_path / "out", "--cache", "none,ram",
                                   "--batch-sizes", "1", "--set", f"data.args.path={data}",
                                   "--set", "data.args.patch_size=[16,16,16]", "--set", "data.num_workers=0")
    assert [r["cache"] for r in report["results"]] == ["none", "ram"]
    assert all(r["items"] == 2 * 2 and r["ms_per_item"] > 0 for r in report["results"])


def test_logged_lr_is_the_rate_each_step_applied(tiny_microscopy, tmp_path):
    """metrics.jsonl's lr at global step k is the rate step k trained with: a linear warm-up over the
    first 4 steps from 0.1 x the peak gives 0.1, 0.325, 0.55, 0.775, then the peak (constant), by hand.
    (Read after the schedule advanced, the first step logged the second step's 0.325.)"""
    peak = 0.01
    fastvision.train("unet2d-microscopy", out=str(tmp_path / "run"), **tiny_overrides(
        tiny_microscopy, epochs=2, **{"train.steps_per_epoch": 3, "optim.lr": peak, "optim.ref_batch": None,
                                      "sched.name": "constant", "sched.warmup_epochs": 4 / 3,
                                      "sched.warmup_start_factor": 0.1}))
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [e["data"]["lr"] for e in events if isinstance(e["step"], list) and len(e["step"]) == 2]
    epochs = [e["data"]["lr"] for e in events if isinstance(e["step"], list) and len(e["step"]) == 1]
    want = [peak * (0.1 + 0.9 * s / 4) if s < 4 else peak for s in range(6)]
    assert steps == pytest.approx(want, rel=1e-9)
    assert epochs == pytest.approx([want[2], want[5]], rel=1e-9)  # each epoch's last step
