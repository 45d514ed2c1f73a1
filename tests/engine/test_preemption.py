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
from tests.conftest import ROOT, clean_env, cli_here

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


def _main(argv: list[str]) -> int:
    """``_cmd``'s command (without ``python -m fastvision``) in this process, on one thread as the
    subprocesses: the runs that are not about the process itself."""
    return cli_here(argv[3:], threads=1)


def _interrupt(cmd: list[str], out: Path, sig: int, env: dict,
               after_steps: int) -> tuple[subprocess.CompletedProcess, float]:
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


EPOCHS, ONE = 3, ["--batch-size", "1"]


@pytest.fixture(scope="module")
def whole(tiny_microscopy, tmp_path_factory) -> Path:
    """The uninterrupted run both signals' resumes must match bit for bit (the same command, one thread,
    in this process: what is tested is the interrupted process and its resume, not this one)."""
    run = tmp_path_factory.mktemp("preempt") / "whole"
    assert _main(_cmd(tiny_microscopy, run, EPOCHS, *ONE)) == 0
    return run


@pytest.mark.parametrize("sig, slurm", [(signal.SIGTERM, False), (signal.SIGUSR1, True)])
def test_a_stop_signal_mid_epoch_checkpoints_and_resume_is_bit_identical(sig, slurm, tiny_microscopy, tmp_path,
                                                                         whole, capfd):
    """Batch 1: 13 steps an epoch; the signal comes a few steps into the second epoch. The interrupted
    run is a real process (the signal, its exit status); the resume runs in this process."""
    epochs, one = EPOCHS, ONE

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

    capfd.readouterr()
    rc = _main(_cmd(tiny_microscopy, cut, epochs, *one, "--resume", "auto"))
    done_err = capfd.readouterr().err
    assert rc == 0, done_err[-2000:]
    assert f"step {ckpt['position']['step']}" in done_err  # resumed inside the epoch
    assert _identical(_model(whole), _model(cut))
    hist = lambda run: torch.load(run / "checkpoints" / "last.pt", weights_only=True)["history"]  # noqa: E731
    assert [h["train_loss"] for h in hist(whole)] == [h["train_loss"] for h in hist(cut)]


def test_step_checkpoints_every_n_steps_and_kept_ones(tiny_microscopy, tmp_path):
    out = tmp_path / "run"
    assert _main(_cmd(tiny_microscopy, out, 3, "--set", "train.checkpoint_every=5", "--set",
                      "train.keep_checkpoints=2")) == 0
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


def test_a_bad_stop_signal_is_one_line(tiny_microscopy, tmp_path, capfd):
    capfd.readouterr()
    assert _main(_cmd(tiny_microscopy, tmp_path / "r", 1, "--set", "train.stop_signals=[SIGKILL]")) == 2
    assert capfd.readouterr().err.strip().splitlines()[-1].startswith("fastvision: error: train.stop_signals")


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


@pytest.fixture
def signal_in_validation(monkeypatch) -> list[int]:
    """SIGTERM to this process from inside the first validation forward (a real signal, at a known
    moment); returns the list the forwards are counted in."""
    from fastvision.tasks.segment import SegmentationTask

    calls, forward = [], SegmentationTask.eval_forward

    def counted(self, model, batch):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, model, batch)

    monkeypatch.setattr(SegmentationTask, "eval_forward", counted)
    return calls


def test_a_signal_during_validation_stops_before_the_next_batch(tiny_microscopy, tmp_path, signal_in_validation):
    """3 validation items at batch 1: the signal in the first batch ends validation there, without the
    epoch's checkpoint; the checkpoint is the epoch's last step, so the resume validates the epoch and
    ends as the uninterrupted run does."""
    import fastvision
    from fastvision.errors import Preempted
    from tests.conftest import tiny_overrides

    kw = tiny_overrides(tiny_microscopy, epochs=2, **{"data.val_batch_size": 1, "examples": 0})
    cut = tmp_path / "cut"
    with pytest.raises(Preempted) as stop:
        fastvision.train("unet2d-microscopy", out=str(cut), **kw)
    assert stop.value.exit_code == 128 + signal.SIGTERM
    assert len(signal_in_validation) == 1  # not the other two validation batches
    ckpt = checkpoint.load(cut / "checkpoints" / "last.pt")
    assert ckpt["history"] == [] and ckpt["position"]["epoch"] == 0 and ckpt["step"] == ckpt["position"]["step"] > 0
    resumed = fastvision.train("unet2d-microscopy", out=str(cut), resume="auto", **kw)
    whole = fastvision.train("unet2d-microscopy", out=str(tmp_path / "whole"), **kw)
    assert resumed["epochs"] == whole["epochs"] == 2
    assert _identical(_model(tmp_path / "whole"), _model(cut))
    assert len(signal_in_validation) == 1 + 3 + 3 + 6  # the resume validated epoch 0 again and epoch 1; whole: 6


def test_a_requeue_that_times_out_still_exits_128_plus_the_signal(tiny_microscopy, tmp_path, signal_in_validation,
                                                                   monkeypatch, capfd, fresh_logging):
    from fastvision.cli import main
    from fastvision.distributed import preempt

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nexec sleep 120\n")  # a controller that does not answer
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setattr(preempt, "REQUEUE_TIMEOUT_S", 0.5, raising=False)  # (today: 60 s, then a traceback)
    rc = main(["train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(tmp_path / "r"),
               "--epochs", "1", *TINY, "--set", "train.requeue=true"])
    err = capfd.readouterr().err
    assert rc == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err
    assert len([x for x in err.splitlines() if "scontrol requeue 4242 did not finish" in x]) == 1, err[-2000:]
    assert "stopped by SIGTERM" in err


@pytest.mark.parametrize("names, numbers", [(["SIGTERM", "usr1", 12, "15"], [15, 10, 12, 15]), ([], [])])
def test_stop_signals_by_name_or_number(names, numbers):
    from fastvision.distributed.preempt import signal_numbers

    assert signal_numbers(names) == numbers


@pytest.mark.parametrize("bad", [999, 0, -3, 9, "9", 19, "SIGSTOP", "NOPE"])
def test_a_stop_signal_that_cannot_be_caught_is_refused_up_front(bad):
    """Numbers too: 999 is no signal, 9 and 19 are SIGKILL and SIGSTOP (no handler can be installed)."""
    from fastvision.config import load
    from fastvision.engine.loop import fit

    cfg = load("unet2d-microscopy", [{"train": {"stop_signals": [bad]}}])  # a number is a valid config value
    with pytest.raises(ConfigError, match="^train.stop_signals: "):
        fit(cfg, Path("/nonexistent/never-written"))  # refused before anything is built or written


@pytest.mark.parametrize("train, message", [
    ({"max_nonfinite": 0}, "^train.max_nonfinite must be >= 1, got 0"),
    ({"keep_checkpoints": -1}, "^train.keep_checkpoints must be >= 0"),
    ({"checkpoint_every": "soon"}, "^train.checkpoint_every: 'soon'"),
])
def test_bad_checkpoint_and_guard_settings_are_refused_before_anything_is_written(train, message):
    """``fit`` on a folder that cannot exist: reaching the build or a write would fail otherwise."""
    from fastvision.config import load
    from fastvision.engine.loop import fit

    with pytest.raises(ConfigError, match=message):
        fit(load("unet2d-microscopy", [{"train": train}]), Path("/nonexistent/never-written"))
