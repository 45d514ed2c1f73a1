"""The tiny 2-rank microscopy job that the elastic and watchdog tests share: its flags, its data
(21 generated 32x32 microscopy PNG pairs) and the uninterrupted job's final weights."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, clean_env

TINY = ["--device", "cpu", "--batch-size", "1", "--set", "data.args.image_size=[32,32]",
        "--set", "model.args.filters=[4,8,16]", "--set", "data.args.val_fraction=0.24", "--set", "data.num_workers=0",
        "--set", "examples=0", "--set", "train.log_every=1"]
# the shared job's length: 8 steps an epoch (16 training items, 2 ranks of batch 1, 15-40 ms a step here), 91
# metrics records. The restarting job's freeze (test_elastic) comes at 16 records, which leaves the poller about 66
# steps, one to two seconds, to stop the frozen worker before the job ends (9 steps with 3 epochs, a race one loaded
# run on torch 2.14 lost; 34 with 6, which a CI run lost once the CPU's fused optimizer had made the steps faster)
EPOCHS = 10


def torchrun_train(data: Path, out: Path, epochs: int, *more: str) -> list[str]:
    """``torchrun`` (2 workers, up to 2 restarts) of ``fastvision train`` on ``data``, resuming from ``out``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "2", "-m", "fastvision.cli", "train", "unet2d-microscopy", "--data", str(data),
            "--out", str(out), "--epochs", str(epochs), "--resume", "auto", *TINY, *more]


def last_model(run: Path) -> dict[str, torch.Tensor]:
    """The model weights of ``run``'s ``last.pt``."""
    return torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from fastvision.data.synth.microscopy import synth

    return synth(tmp_path_factory.mktemp("elastic") / "data", seed=3, count=21, size=32)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("whole") / "run"
    res = subprocess.run(torchrun_train(data, out, EPOCHS, "--set", "train.checkpoint_every=5"), cwd=ROOT,
                         env=clean_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return last_model(out)
