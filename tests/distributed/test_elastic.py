"""Elastic restarts under the real torchrun: a worker killed with SIGKILL, torchrun restarts both
workers (``--max-restarts 2``), ``--resume auto`` continues by itself, and the job ends exactly as
the uninterrupted 2-rank job does. And a checkpoint continues on another world size with the
global batch and the sample order kept.

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
from tests.distributed.conftest import last_model, torchrun_train
from tests.distributed.test_dist_train import _worker_pid

pytestmark = pytest.mark.dist

def _steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return path.read_text().count('"step": [') if path.exists() else 0  # step and epoch events alike


def _start_job(data: Path, out: Path, tag: str) -> subprocess.Popen:
    """The uninterrupted job's command in the background, its workers tagged ``tag``, stderr piped."""
    return subprocess.Popen(torchrun_train(data, out, 3, "--set", "train.checkpoint_every=5"), cwd=ROOT,
                            env=clean_env(FV_TEST_TAG=tag), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.parametrize("when", ["after a step checkpoint", "before the first checkpoint"])
def test_torchrun_restarts_a_killed_worker_and_ends_as_the_uninterrupted_job(when, data, uninterrupted, tmp_path):
    out, tag = tmp_path / "run", uuid.uuid4().hex
    last = out / "checkpoints" / "last.pt"
    proc = _start_job(data, out, tag)
    try:
        deadline = time.monotonic() + 120
        ready = (lambda: last.exists()) if when == "after a step checkpoint" else (lambda: _steps(out) >= 1)
        while proc.poll() is None and not ready() and time.monotonic() < deadline:
            time.sleep(0.005)
        victim = _worker_pid(tag, 1)
        assert victim is not None and proc.poll() is None, "no worker to kill"
        had_checkpoint = last.exists()
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]  # torchrun restarted the workers and the job finished by itself
    assert "exitcode: -9" in err or "exitcode  : -9" in err, err[-2000:]
    if when == "after a step checkpoint":
        assert had_checkpoint and "resumed from" in err
    else:
        assert not had_checkpoint and "starting from scratch" in err
    weights = last_model(out)
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


def test_a_signal_to_one_rank_stops_both_at_one_step_and_the_restart_continues(data, uninterrupted, tmp_path):
    """SIGTERM to rank 1 alone: the ranks agree, rank 0 (never signalled) stops at the same step and
    writes its checkpoint, both exit 143; torchrun restarts them and they end as the uninterrupted job."""
    out, tag = tmp_path / "run", uuid.uuid4().hex
    proc = _start_job(data, out, tag)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and _steps(out) < 12 and time.monotonic() < deadline:
            time.sleep(0.005)
        victim = _worker_pid(tag, 1)
        assert victim is not None and proc.poll() is None, "no worker to signal"
        os.kill(victim, signal.SIGTERM)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert err.count("stopped by SIGTERM") == 2, err[-3000:]  # rank 0 stopped too, told by the agreement
    assert "exitcode: 143" in err or "exitcode  : 143" in err, err[-2000:]
    weights = last_model(out)
    assert all(torch.equal(weights[k], uninterrupted[k]) for k in uninterrupted)
