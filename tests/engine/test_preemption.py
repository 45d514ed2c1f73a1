"""Preemptible training through the real CLI: step checkpoints, a stop signal mid-epoch, the SLURM
requeue, and the resume that continues the interrupted epoch bit for bit.

Each run is ``python -m fastvision train unet2d-microscopy`` on 16 generated 32x32 PNG pairs (13 to
train on), with its random flips on: the batched augmentation's generator is part of what a
mid-epoch resume must restore.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastvision.engine import checkpoint, policy
from fastvision.errors import ConfigError
from tests.conftest import ROOT, clean_env

TINY = ["--device", "cpu", "--batch-size", "2", "--set", "data.args.image_size=[32,32]",
        "--set", "model.args.filters=[4,8,16]", "--set", "data.num_workers=0", "--set", "examples=0",
        "--set", "sched.name=cosine", "--set", "train.log_every=1"]


def _cmd(data: Path, out: Path, epochs: int, *more: str) -> list[str]:
    return [sys.executable, "-m", "fastvision", "train", "unet2d-microscopy", "--data", str(data), "--out", str(out),
            "--epochs", str(epochs), *TINY, *more]


def _model(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]


def _identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _steps_logged(run: Path) -> int:
    """Training-step events in ``metrics.jsonl`` so far (``step`` is ``[epoch, iteration]``)."""
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(1 for line in lines[:-1] if len(json.loads(line)["step"]) == 2)  # the last may be half written


def _interrupt(cmd: list[str], out: Path, sig: int, env: dict, after_steps: int) -> tuple[subprocess.CompletedProcess, float]:
    """Start ``cmd``, send ``sig`` once ``after_steps`` steps are logged; returns the finished process
    and the seconds from the signal to its exit."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and _steps_logged(out) < after_steps and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(cmd, proc.returncode, "", err), time.monotonic() - sent


@pytest.mark.parametrize("sig, slurm", [(signal.SIGTERM, False), (signal.SIGUSR1, True)])
def test_a_stop_signal_mid_epoch_checkpoints_and_resume_is_bit_identical(sig, slurm, tiny_microscopy, tmp_path):
    """Batch 1: 13 steps an epoch; the signal comes a few steps into the second epoch."""
    epochs, one = 3, ["--batch-size", "1"]
    whole = tmp_path / "whole"
    subprocess.run(_cmd(tiny_microscopy, whole, epochs, *one), env=clean_env(), cwd=ROOT, check=True,
                   capture_output=True)

    env, more = clean_env(), [*one]
    if slurm:  # a SLURM job with requeue on: a stub scontrol on PATH records its call
        bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
        bin_dir.mkdir()
        (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
        (bin_dir / "scontrol").chmod(0o755)
        env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_ID="4242")
        more += ["--set", "train.requeue=true"]
    cut = tmp_path / "cut"
    res, seconds = _interrupt(_cmd(tiny_microscopy, cut, epochs, *more), cut, sig, env, after_steps=20)
    assert res.returncode == 128 + sig, res.stderr[-2000:]
    assert seconds < 30
    assert f"stopped by {signal.Signals(sig).name}" in res.stderr and "--resume auto" in res.stderr
    ckpt = checkpoint.load(cut / "checkpoints" / "last.pt")
    assert ckpt["position"] is not None, "the signal's checkpoint is a mid-epoch one"
    assert 20 <= ckpt["step"] < epochs * 13  # written after the signal, before the end
    if slurm:
        assert calls.read_text().split() == ["requeue", "4242"]

    done = subprocess.run(_cmd(tiny_microscopy, cut, epochs, *one, "--resume", "auto"), env=clean_env(), cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"step {ckpt['position']['step']}" in done.stderr  # resumed inside the epoch
    assert _identical(_model(whole), _model(cut))
    hist = lambda run: torch.load(run / "checkpoints" / "last.pt", weights_only=True)["history"]  # noqa: E731
    assert [h["train_loss"] for h in hist(whole)] == [h["train_loss"] for h in hist(cut)]


def test_step_checkpoints_every_n_steps_and_kept_ones(tiny_microscopy, tmp_path):
    out = tmp_path / "run"
    subprocess.run(_cmd(tiny_microscopy, out, 3, "--set", "train.checkpoint_every=5", "--set",
                        "train.keep_checkpoints=2"), env=clean_env(), cwd=ROOT, check=True, capture_output=True)
    kept = sorted(p.name for p in (out / "checkpoints").glob("step-*.pt"))
    assert kept == ["step-00000010.pt", "step-00000015.pt"]  # 5, 10, 15 written; the newest two kept
    assert checkpoint.load(out / "checkpoints" / "last.pt")["step"] == 18  # 6 steps an epoch (13 items, batch 2)
    ck = checkpoint.load(out / "checkpoints" / "step-00000010.pt")
    assert ck["step"] == 10 and ck["position"] == {**ck["position"], "epoch": 1, "step": 4}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checkpoints_written"] == 6  # 3 step + 3 epoch checkpoints
    assert 0 < summary["checkpoint_durable_max_s"] < 30


@pytest.mark.parametrize("spec, steps, seconds", [(500, 500, None), ("500", 500, None), ("20min", None, 1200.0),
                                                  ("90s", None, 90.0), ("2h", None, 7200.0),
                                                  ("500,20min", 500, 1200.0), (None, None, None)])
def test_checkpoint_every_parses_steps_and_periods(spec, steps, seconds):
    every = policy.Every(spec)
    assert (every.steps, every.seconds) == (steps, seconds)


@pytest.mark.parametrize("spec", ["0", "-5", "5.5", "20 fortnights", "min"])
def test_checkpoint_every_rejects_bad_specs(spec):
    with pytest.raises(ConfigError, match="train.checkpoint_every"):
        policy.Every(spec)


def test_a_bad_stop_signal_is_one_line(tiny_microscopy, tmp_path):
    res = subprocess.run(_cmd(tiny_microscopy, tmp_path / "r", 1, "--set", "train.stop_signals=[SIGKILL]"),
                         env=clean_env(), cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("fastvision: error: train.stop_signals")


def test_checkpoints_by_time_are_mid_epoch_positions(tiny_microscopy, tmp_path):
    import fastvision
    from tests.conftest import tiny_overrides

    out = tmp_path / "run"
    summary = fastvision.train("unet2d-microscopy", out=str(out), **tiny_overrides(
        tiny_microscopy, epochs=2, **{"train.checkpoint_every": "0.01s", "train.keep_checkpoints": 100}))
    kept = policy.step_checkpoints(out / "checkpoints")
    assert len(kept) >= 2 and summary["checkpoints_written"] == len(kept) + 2  # + the two epoch checkpoints
    for path in kept:
        ck = checkpoint.load(path)
        assert path.name == policy.STEP_NAME.format(ck["step"]) and ck["position"]["step"] >= 1
