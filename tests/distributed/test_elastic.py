"""Elastic restarts under the real torchrun: a worker killed with SIGKILL (or sent SIGTERM), torchrun
restarts both workers, ``--resume auto`` continues by itself, and the job ends exactly as the
uninterrupted 2-rank job does (the three interruptions are made to one job, in turn; a fourth, a
frozen worker the hang watchdog names, is test_watchdog's). And a checkpoint continues on another
world size with the global batch and the sample order kept.

Data: 21 generated 32x32 microscopy PNG pairs (16 to train on: 8 steps an epoch per rank at batch
1), random flips on, so each rank's augmentation stream must come back as it was.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

from fastvision import config
from fastvision.distributed.env import DistEnv
from fastvision.distributed.samplers import TrainSampler
from fastvision.engine.state import keep_global_batch
from tests.conftest import ROOT, clean_env
from tests.distributed.conftest import EPOCHS, last_model, torchrun_train
from tests.distributed.test_dist import run_once
from tests.distributed.test_dist_train import _worker_pid

pytestmark = pytest.mark.dist

def _steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return path.read_text().count('"step": [') if path.exists() else 0  # step and epoch events alike


def _wait(what, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while proc.poll() is None and not what() and time.monotonic() < deadline:
        time.sleep(0.005)


def shared_uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The ``uninterrupted`` fixture of tests/distributed/conftest.py (same data, same command), run
    once for this module and test_watchdog's, on every pytest-xdist worker: a torchrun job of its own."""
    from fastvision.data.synth.microscopy import synth

    def make(folder: Path) -> str:
        data = synth(folder / "data", seed=3, count=21, size=32)
        res = subprocess.run(torchrun_train(data, folder / "run", EPOCHS, "--set", "train.checkpoint_every=5"),
                             cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return str(folder / "run")

    return last_model(Path(run_once(tmp_path_factory, "uninterrupted", make)[1]))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    return shared_uninterrupted(tmp_path_factory)


def shared_interrupted(tmp_path_factory) -> dict:
    """The uninterrupted job's command (``--max-restarts 4``, through test_watchdog's wrapper of the CLI,
    its hang timeout set), its workers interrupted four times, each restart by torchrun continuing
    (``--resume auto``) on its own:

    0. rank 1 killed (SIGKILL) once the first step is logged, before the first checkpoint;
    1. rank 1 of the restarted workers killed once a step checkpoint is written;
    2. SIGTERM to rank 1 alone of the next workers, 12 steps in;
    3. rank 1 of the next workers frozen (SIGSTOP) once they have taken a step: test_watchdog's hang,
       which rank 0's watchdog reports, exiting 124 (:func:`tests.distributed.test_watchdog.freeze`);

    then the workers of the last restart finish. One job for the three cases of the tests below and
    test_watchdog's restarting one (10 worker processes and one torchrun, not 16 and four in four
    jobs), run once for all modules and pytest-xdist workers. Returns its exit code, its run folder
    (``out``), whether a checkpoint was there at each interruption, what :func:`freeze` saw
    (``frozen``), and its stderr (``err``), also cut at the interruptions: part ``i`` is what was
    written after interruption ``i`` (torchrun's report of it, the next workers' start) and before the
    next one."""
    def make(folder: Path) -> dict:
        from fastvision.data.synth.microscopy import synth

        return _interrupt(synth(folder / "data", seed=3, count=21, size=32), folder / "run")

    return run_once(tmp_path_factory, "interrupted", make)[1]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict:
    res = shared_interrupted(tmp_path_factory)
    return {**res, "weights": last_model(Path(res["out"]))}


def _interrupt(data: Path, out: Path) -> dict:
    """The job of :func:`shared_interrupted` on ``data``, into ``out``."""
    from tests.distributed.test_watchdog import freeze, job_command

    tag = uuid.uuid4().hex
    last, log = out / "checkpoints" / "last.pt", out.parent / "stderr.txt"
    cmd = job_command(data, out, out.parent / "train_job.py", 4)
    with log.open("w") as err_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(FV_TEST_TAG=tag), stdout=subprocess.DEVNULL,
                                stderr=err_file, text=True)
    cuts, had, victims = [], [], []

    def next_victim(ready) -> int:
        # rank 1 of the workers now running (not one interrupted before), once ``ready``
        _wait(lambda: ready() and _worker_pid(tag, 1) not in (None, *victims), proc)  # /proc read last
        victim = _worker_pid(tag, 1)
        assert victim not in (None, *victims) and proc.poll() is None, f"no worker to stop ({len(victims)})"
        had.append(last.exists())
        cuts.append(len(log.read_text()))
        victims.append(victim)
        return victim

    def resumed(records: int):  # these workers resumed (after the last interruption), ``records`` logged
        return lambda: "resumed from" in log.read_text()[cuts[-1]:] and _steps(out) >= records

    try:
        os.kill(next_victim(lambda: _steps(out) >= 1), signal.SIGKILL)
        os.kill(next_victim(last.exists), signal.SIGKILL)
        # resumed from the step checkpoint (its records after the checkpoint rewound), then 12 steps in
        os.kill(next_victim(resumed(12)), signal.SIGTERM)
        # resumed from the SIGTERM's checkpoint (12 to 14 records), then a step or more: the watchdog is
        # armed (by the first step), 75 records (about 66 steps) before the job's end
        frozen = freeze(proc, next_victim(resumed(16)), log, out / "hang")
        proc.wait(timeout=240)
    finally:
        proc.kill()
    err = log.read_text()
    parts = [err[a:b] for a, b in zip(cuts, [*cuts[1:], len(err)], strict=True)]
    return {"rc": proc.returncode, "out": str(out), "err": err, "parts": parts, "had_checkpoint": had,
            "frozen": frozen, "victims": victims[:-1]}  # the workers killed (the last one was frozen)


@pytest.mark.parametrize("when", ["before the first checkpoint", "after a step checkpoint"])
def test_torchrun_restarts_a_killed_worker_and_ends_as_the_uninterrupted_job(when, interrupted, uninterrupted):
    i = ["before the first checkpoint", "after a step checkpoint"].index(when)
    err, had_checkpoint = interrupted["parts"][i], interrupted["had_checkpoint"][i]
    assert interrupted["rc"] == 0, interrupted["err"][-3000:]  # torchrun restarted the workers, the job finished
    assert "exitcode: -9" in err or "exitcode  : -9" in err, err[-2000:]
    if when == "after a step checkpoint":
        assert had_checkpoint and "resumed from" in err
    else:
        assert not had_checkpoint and "starting from scratch" in err
    weights = interrupted["weights"]
    assert all(torch.equal(weights[k], uninterrupted[k]) for k in uninterrupted)


def test_another_world_size_keeps_the_global_batch_and_the_sample_order():
    """A 2-rank checkpoint (batch 4 per rank) resumed on 1 rank: accumulation 2 keeps the global
    batch 8, and step k reads the same items, from any step on."""
    cfg = config.load("unet2d-microscopy", [{"train": {"batch_size": 4}}])
    cfg = keep_global_batch(cfg, {"global_batch": 8, "world_size": 2}, DistEnv().world_size)
    assert cfg.train.accum_steps == 2
    n, b, epoch, start_step = 37, 4, 3, 2

    def global_batches(world: int, micro: int) -> list[set[int]]:
        per_rank = []
        for r in range(world):
            s = TrainSampler(n, num_replicas=world, rank=r, seed=5, drop_last=True)
            s.set_epoch(epoch, start=start_step * micro * b * world)  # the samples all ranks consumed by that step
            idx = list(s)
            per_rank.append([idx[i:i + b] for i in range(0, len(idx) - len(idx) % b, b)])
        steps = min(len(p) for p in per_rank) // micro
        return [set().union(*(set(p[k * micro + m]) for p in per_rank for m in range(micro))) for k in range(steps)]

    two, one = global_batches(2, 1), global_batches(1, 2)
    assert len(one) >= len(two) > 0 and one[:len(two)] == two
    uneven = config.load("unet2d-microscopy", [{"train": {"batch_size": 3}}])
    uneven = keep_global_batch(uneven, {"global_batch": 8, "world_size": 2}, 1)  # 8 is no multiple of 3
    assert uneven.train.accum_steps == 1


def test_a_signal_to_one_rank_stops_both_at_one_step_and_the_restart_continues(interrupted, uninterrupted):
    """SIGTERM to rank 1 alone: the ranks agree, rank 0 (never signalled) stops at the same step and
    writes its checkpoint, both exit 143; torchrun restarts them and they end as the uninterrupted job."""
    err = interrupted["parts"][2]
    assert interrupted["rc"] == 0, interrupted["err"][-3000:]
    assert err.count("stopped by SIGTERM") == 2, err[-3000:]  # rank 0 stopped too, told by the agreement
    assert "exitcode: 143" in err or "exitcode  : 143" in err, err[-2000:]
    weights = interrupted["weights"]
    assert all(torch.equal(weights[k], uninterrupted[k]) for k in uninterrupted)
