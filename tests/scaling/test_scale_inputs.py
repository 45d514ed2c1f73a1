"""``fastvision scale``: bad numbers, no work and an unreadable hardware profile are one line naming the option
or file (exit 2), through the real CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.input_checks import one_line_error, run_cli

SIM = ["scale", "--simulate", "--compute-ms", "100", "--batch", "32", "--grad-mb", "10", "--hardware", "dgx-a100"]


@pytest.mark.parametrize("flag,value", [
    ("--bucket-mb", "0"), ("--batch", "0"), ("--batch", "-3"), ("--grad-mb", "-1"), ("--input-rate", "0"),
    ("--compute-ms", "-5"), ("--compute-ms", "0"), ("--input-workers", "0"), ("--gpus-per-node", "0"),
    ("--epochs", "0"),
    ("--compute-ms", "inf"), ("--grad-mb", "inf"),  # inf: a ZeroDivisionError traceback (exit 1)
])
def test_scale_refuses_numbers_out_of_range(flag, value, tmp_path, capsys):
    code, _, err = run_cli(capsys, *SIM, flag, value, "--out", tmp_path / "o")
    one_line_error(code, err, f"{flag} {value}")
    assert not (tmp_path / "o").exists()


def test_scale_input_rate_zero_is_refused_and_a_positive_one_used(tmp_path, capsys):
    code, _, err = run_cli(capsys, *SIM, "--input-rate", "0", "--out", tmp_path / "zero")
    one_line_error(code, err, "--input-rate 0")
    code, out, _ = run_cli(capsys, *SIM, "--input-rate", "500", "--out", tmp_path)
    assert code == 0 and "| dgx-a100 |" in out
    assert json.loads((tmp_path / "simulation.json").read_text())["pipeline"]["per_core_items_s"] == 500


@pytest.mark.parametrize("argv", [["scale"], ["scale", "--workers", "1"]])
def test_scale_without_recipe_or_simulate_is_an_error(argv, capsys):
    code, out, err = run_cli(capsys, *argv)
    one_line_error(code, err, "recipe", "--simulate")
    assert out == ""


def test_scale_hardware_yaml_syntax_error_is_one_line(tmp_path, capsys):
    hw = tmp_path / "hw2.yaml"
    hw.write_text("gpu: A100-80GB\nnode: [1,2\n")
    code, _, err = run_cli(capsys, *SIM[:-1], hw, "--out", tmp_path / "o")
    one_line_error(code, err, str(hw), "line 3, column 1")
    assert len(err.strip().splitlines()) == 1


class FakeTrain:
    """``subprocess.run`` of the sweep's ``fastvision train`` runs: writes the run folder a finished run leaves
    (epoch events, ``summary.json``) at ``rate[nproc]`` images/s, or stops like Ctrl-C at the run ``stop_at``."""

    def __init__(self, rate, stop_at=None):
        self.rate, self.stop_at, self.calls = rate, stop_at, []

    def __call__(self, cmd, *a, **k):
        import subprocess

        opt = dict(zip(cmd, cmd[1:], strict=False))  # each option with the word after it
        out, n, epochs = Path(opt["--out"]), int(opt["--nproc"]), int(opt["--epochs"])
        self.calls.append(out.name)
        out.mkdir(parents=True)
        # an epoch of 100 items at the given rate: the speed-up (epoch times) is the rates' ratio
        events = [{"step": [e], "data": {"epoch_time_s": 100.0 / self.rate[n], "images_per_s": self.rate[n],
                                         "iou": 0.5}}
                  for e in range(epochs)]
        (out / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        if out.name == self.stop_at:
            raise KeyboardInterrupt
        (out / "summary.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, 0)


SWEEP = ["scale", "unet2d-microscopy", "--workers", "1,2", "--epochs", "2"]


def fake_runs(monkeypatch, fake: FakeTrain) -> None:
    """The sweep's runs (started through ``launch.run_forwarding``) made by ``fake`` instead."""
    from fastvision.distributed import launch

    monkeypatch.setattr(launch, "run_forwarding", lambda args, env: fake(list(args)).returncode)


def test_scale_flags_efficiency_above_ideal_and_few_timed_epochs(tmp_path, capsys, monkeypatch):

    fake_runs(monkeypatch, FakeTrain({1: 10.0, 2: 253.0}))  # speed-up 25.3 on 2 workers
    code, out, err = run_cli(capsys, *SWEEP, "--out", tmp_path)
    assert code == 0
    assert "1265.0% (noisy)" in out and "implausible efficiency" in out and "--repeats" in out
    assert "--epochs 2 times 1 epoch after the warm-up" in err and "implausible" in err
    assert "implausible" in (tmp_path / "scaling.md").read_text()
    fake_runs(monkeypatch, FakeTrain({1: 10.0, 2: 19.0}))  # 95%, 2 epochs timed: no flag
    code, out, err = run_cli(capsys, *SWEEP[:-1], "3", "--out", tmp_path / "plausible")
    assert code == 0 and "95.0%" in out and "noisy" not in out + err and "warm-up" not in err


def test_scale_rerun_reuses_a_finished_run_and_retrains_an_interrupted_one(tiny_microscopy, tmp_path, capfd,
                                                                           fresh_logging):
    """Real runs (one worker, tiny): a rerun reads the finished run back; a run left without its summary (as
    Ctrl-C leaves one) is trained again; other settings are refused without --force; --force retrains."""
    from fastvision.cli import main

    argv = ["scale", "unet2d-microscopy", "--workers", "1", "--epochs", "3", "--data", str(tiny_microscopy),
            "--out", str(tmp_path), "--set", "data.args.image_size=[32,32]", "--set", "model.args.filters=[4,8,16]",
            "--set", "data.num_workers=0", "--set", "examples=0", "--set", "train.device=\"cpu\""]
    summary = tmp_path / "ddp-1-r0" / "summary.json"
    assert main(argv) == 0 and summary.is_file() and (tmp_path / "scaling.md").is_file()
    first = summary.stat().st_mtime_ns
    capfd.readouterr()
    assert main(argv) == 0
    assert summary.stat().st_mtime_ns == first and "reused" in capfd.readouterr().err  # not trained again
    summary.unlink()  # a run stopped before its end
    assert main(argv) == 0 and summary.is_file()  # trained again, from scratch
    again = summary.stat().st_mtime_ns
    assert main([*argv, "--seed", "7"]) == 2 and summary.stat().st_mtime_ns == again  # other settings: refused
    assert main([*argv, "--seed", "7", "--force"]) == 0 and summary.stat().st_mtime_ns != again


def test_scale_refuses_a_run_folder_it_did_not_start(tmp_path, capsys):
    (tmp_path / "ddp-1-r0").mkdir()
    (tmp_path / "ddp-1-r0" / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, *SWEEP, "--out", tmp_path)
    one_line_error(code, err, "ddp-1-r0", "--force")
    assert (tmp_path / "ddp-1-r0" / "notes.txt").read_text() == "mine"


def test_scale_checks_backends_and_world_sizes_before_any_run(tmp_path, capsys, monkeypatch):
    """An unknown backend, horovod without horovod, a world size this machine cannot start: one line naming
    the option before any run trains (before, the ddp runs trained first, then the sweep stopped)."""
    import importlib.util
    import os

    fake = FakeTrain({1: 10.0, 2: 19.0})
    fake_runs(monkeypatch, fake)
    code, _, err = run_cli(capsys, *SWEEP, "--backends", "ddp,foo", "--out", tmp_path / "a")
    one_line_error(code, err, "--backends", "'foo'", "ddp, horovod")
    cores = len(os.sched_getaffinity(0))
    code, _, err = run_cli(capsys, *SWEEP[:3], f"1,{cores + 1}", "--out", tmp_path / "b", "--device", "cpu")
    one_line_error(code, err, f"--workers {cores + 1}", f"CPU cores ({cores})")
    if importlib.util.find_spec("horovod") is None:
        code, _, err = run_cli(capsys, *SWEEP, "--backends", "ddp,horovod", "--out", tmp_path / "c")
        one_line_error(code, err, "--backends horovod", "make horovod")
    assert fake.calls == [] and not any((tmp_path / d).exists() for d in "abc")


def test_scale_simulate_without_a_step_or_a_one_worker_run_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """``--simulate`` measures its step from the sweep's 1-worker runs: a sweep without them (or --compute-ms
    without --grad-mb) is one line before any run trains (before: after every run had trained)."""

    fake = FakeTrain({2: 19.0})
    fake_runs(monkeypatch, fake)
    code, _, err = run_cli(capsys, "scale", "unet2d-microscopy", "--workers", "2", "--simulate",
                           "--out", tmp_path / "a")
    one_line_error(code, err, "--simulate", "1 worker", "--workers 2")
    code, _, err = run_cli(capsys, "scale", "unet2d-microscopy", "--simulate", "--compute-ms", "50", "--out", tmp_path)
    one_line_error(code, err, "--grad-mb")
    assert fake.calls == []


def test_sigterm_to_scale_stops_its_run_and_nothing_trains_on(tiny_microscopy, tmp_path):
    """``kill PID`` of ``fastvision scale``: the run it is training gets the signal (checkpoint, exit 143) and
    scale exits 143 in one line saying how to continue; before, scale died alone and its run trained on."""
    import subprocess
    import sys
    import uuid

    from tests.conftest import ROOT, clean_env, sigterm_after_steps

    tag, out = uuid.uuid4().hex, tmp_path / "sweep"
    cmd = [sys.executable, "-m", "fastvision.cli", "scale", "unet2d-microscopy", "--workers", "1", "--epochs", "50",
           "--data", str(tiny_microscopy), "--out", str(out), "--device", "cpu",
           "--set", "data.args.image_size=[32,32]", "--set", "model.args.filters=[4,8,16]",
           "--set", "data.num_workers=0", "--set", "examples=0",
           "--set", "train.log_every=1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(FV_TEST_TAG=tag), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    err, left = sigterm_after_steps(proc, out / "ddp-1-r0" / "metrics.jsonl", 2, tag, timeout=60)
    assert proc.returncode == 143 and not left, (proc.returncode, left, err[-3000:])
    assert "Traceback" not in err and "scale: stopped during ddp-1-r0" in err, err[-3000:]
