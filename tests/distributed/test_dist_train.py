"""End-to-end data-parallel training through the real CLI: 2 gloo ranks against 1 process.

Every run here is ``fastvision train unet2d-microscopy`` (``cli.main`` in the test process when one
process trains or ``--nproc`` starts torchrun, also where a worker is killed; ``python -m fastvision.cli``
under srun's variables) on a tiny generated PNG data set (16 training, 5 validation images: an odd
validation set that splits 2 + 3 over two ranks), with random augmentation off so that the only
randomness is the sampler's permutation.

What must hold, and why:

* A U-Net without normalisation layers: 2 ranks at per-rank batch ``b`` == 1 rank at batch ``2b``
  (DDP averages the ranks' mean-loss gradients = the gradient of the mean over the global batch;
  ``TrainSampler`` makes the ranks' k-th batches the one-process k-th batch). Instance norm is
  batch-independent too, but on these 8x8 bottleneck maps training is so ill-conditioned that the
  ~1e-6 float32 difference between one batch-4 and two batch-2 gradients grows to 1e-3..1e-2 in
  eight SGD steps even in one process (measured), so it cannot show a 1e-5 agreement. The logged
  validation metric is the same, and equals a single-process evaluation of the 2-rank checkpoint
  bit for bit: the sharded confusion counts were summed, not averaged, and nothing was padded.
* BatchNorm normalises each rank's ``b`` images on their own, so 2 ranks != 1 rank at batch ``2b``;
  ``--emulate-workers 2`` reproduces the 2-rank parameters in one process.
* SLURM: two processes started with the variables srun sets rendezvous on their own and train.
* A worker killed mid-run stops the job (non-zero, rank named) instead of hanging; ``--resume auto``
  continues from the last checkpoint, here in one process emulating the 2 workers (a checkpoint is
  loadable at another world size).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, clean_env, cli_here, free_port, sigterm_after_steps  # noqa: E402

pytestmark = pytest.mark.dist

TINY = ["--device", "cpu", "--lr", "0.05",
        "--set", "data.args.image_size=[32,32]", "--set", "model.args.filters=[4,8,16]",
        "--set", "data.args.val_fraction=0.24", "--set", "data.num_workers=0", "--set", "examples=0",
        "--set", "data.augment.flip=null", "--set", "data.augment.rot90=null"]
# No normalisation layer: nothing depends on the per-rank batch (see the module docstring on instance norm).
NO_NORM = ["--set", "model.name=unet2d", "--set", "model.args.norm=none"]
STATS = ("running_mean", "running_var", "num_batches_tracked")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from fastvision.data.formats.microscopy import microscopy
    from fastvision.data.synth.microscopy import synth

    path = synth(tmp_path_factory.mktemp("dist_train") / "data", seed=3, count=21, size=32)
    splits = microscopy(path=str(path), image_size=[32, 32], val_fraction=0.24)
    assert (len(splits.train), len(splits.val)) == (16, 5)  # divisible train set, odd validation set
    return path



def _cmd(data: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "fastvision.cli", "train", "unet2d-microscopy", "--data", str(data),
            "--out", str(out), *TINY, *args]


@pytest.fixture
def train_here(monkeypatch):
    """``train(data, out, *args)``: the command of :func:`_cmd` through ``fastvision.cli.main`` in this
    process (a process of its own would cost seconds of torch import and prove nothing more: with
    ``--nproc`` this process starts torchrun as the CLI's does), in the environment :func:`clean_env`
    gives the subprocesses (no launcher variables, one torch thread); returns ``out``."""
    from tests.distributed.test_dist import time_limit

    clean = clean_env()
    for key in set(os.environ) - set(clean):
        monkeypatch.delenv(key)
    for key, value in clean.items():
        monkeypatch.setenv(key, value)

    def train(data: Path, out: Path, *args: str) -> Path:
        with time_limit(120):
            assert cli_here(_cmd(data, out, *args)[3:], threads=1) == 0  # one thread: OMP_NUM_THREADS=1 of clean_env
        return out

    return train


def _weights(run: Path, params_only: bool = False) -> dict[str, torch.Tensor]:
    state = torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["model"]
    return {k: v.double() for k, v in state.items() if not (params_only and k.endswith(STATS))}


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)).item() for k in a)


def _events(run: Path) -> tuple[dict, list[dict]]:
    """The run's PARAMETER event data and its per-epoch events, from metrics.jsonl."""
    params, epochs = {}, []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev["step"] == "PARAMETER":
            params.update(ev["data"]["environment"])
        elif isinstance(ev["step"], list) and len(ev["step"]) == 1:
            epochs.append(ev["data"])
    return params, epochs



def _srun_train(data: Path, out: Path, job_id: str, *args: str, timeout: float,
                rank_env=lambda r: {}) -> list[str]:
    """Two tasks of :func:`_cmd` under srun's variables (job ``job_id``, one node, no launcher), ``rank_env(r)``
    added to task r's environment; both must exit 0. Returns their stderr."""
    port, procs = free_port(), []
    for r in range(2):
        env = clean_env(SLURM_JOB_ID=job_id, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS="2",
                        SLURM_STEP_ID="0", SLURM_NODEID="0", SLURM_TASKS_PER_NODE="2", SLURM_NODELIST="localhost",
                        MASTER_PORT=str(port), **rank_env(r))
        procs.append(subprocess.Popen(_cmd(data, out, *args), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    errs = []
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for e in errs)
    return errs


def test_two_ranks_equal_one_rank_with_twice_the_batch(data, tmp_path, train_here):
    one = train_here(data, tmp_path / "one", "--epochs", "3", "--batch-size", "4", *NO_NORM)
    two = train_here(data, tmp_path / "two", "--epochs", "3", "--batch-size", "2", "--nproc", "2", *NO_NORM)
    p1, e1 = _events(one)
    p2, e2 = _events(two)
    assert (p1["world_size"], p2["world_size"]) == (1, 2) and p2["launcher"] == "torchrun"
    assert p1["global_batch"] == p2["global_batch"] == 4 and p1["effective_lr"] == p2["effective_lr"]
    assert _max_rel(_weights(two), _weights(one)) <= 1e-5
    assert len(e1) == len(e2) == 3
    for a, b in zip(e1, e2, strict=True):
        assert (a["iou"], a["dice"]) == (b["iou"], b["dice"])
    assert 0 < e2[-1]["iou"] < 1

    # The 2-rank metric (shards of 2 and 3 images, counts summed) is the whole-set metric exactly.
    from fastvision.api import evaluate_path

    whole = evaluate_path(two / "checkpoints" / "last.pt", device="cpu")
    assert (whole["iou"], whole["dice"]) == (e2[-1]["iou"], e2[-1]["dice"])


def test_batchnorm_two_ranks_validate_their_checkpoint_and_resume_mid_epoch_with_its_loss(data, tmp_path, train_here,
                                                                                          capfd):
    """With BatchNorm each rank's last training forward moves its running statistics by its own batch; the
    validation of a 2-rank job scores rank 0's statistics on every shard (before, rank 1 scored its shard with
    its own, and the logged IoU was not the one ``evaluate`` gives the checkpoint, which holds rank 0's)."""
    from fastvision.api import evaluate_path

    two = train_here(data, tmp_path / "two", "--epochs", "2", "--batch-size", "2", "--nproc", "2",
                     "--set", "train.checkpoint_every=6", "--set", "train.keep_checkpoints=4")
    assert capfd.readouterr().out.count("run directory:") == 1  # rank 0's result alone (rank 1 printed it too)
    logged = _events(two)[1][-1]
    whole = evaluate_path(two / "checkpoints" / "last.pt", device="cpu")
    assert 0 < logged["iou"] < 1
    assert (whole["iou"], whole["dice"]) == (logged["iou"], logged["dice"])
    assert whole["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-5)

    # Resumed on 2 ranks from step 6 (mid-epoch 2 of 4 steps): the epoch's train_loss counts both ranks'
    # steps before the checkpoint (before, each rank restored rank 0's partial loss sum).
    step = two / "checkpoints" / "step-00000006.pt"
    resumed = train_here(data, tmp_path / "resumed", "--epochs", "2", "--batch-size", "2", "--nproc", "2",
                         "--resume", str(step))
    assert capfd.readouterr().err.count("resumed from") == 1  # the job's line, not one per rank
    ends = _events(resumed)[1]
    assert len(ends) == 1 and ends[0]["train_loss"] == pytest.approx(logged["train_loss"], rel=1e-6, abs=0)
    assert all(torch.equal(a, b) for a, b in zip(_weights(resumed).values(), _weights(two).values(), strict=True))


def test_keyed_augmentation_two_ranks_equal_one_rank_with_twice_the_batch(data, tmp_path, train_here):
    """With the recipe's flips and rotations on and ``train.augment_rng: sample`` each sample is augmented
    by its own (seed, epoch, index) draws, so 2 ranks x batch 2 train the weights of 1 rank x batch 4, and
    the 2-rank job's step-6 checkpoint resumed on 1 rank (2 micro-batches a step) ends as the 2-rank job;
    with the per-rank generator (the control) the weights differ."""
    aug = ["--set", "data.augment.flip={axes: [0, 1]}", "--set", "data.augment.rot90={}"]
    keyed = ["--set", "train.augment_rng=sample"]
    one = train_here(data, tmp_path / "one", "--epochs", "2", "--batch-size", "4", *NO_NORM, *aug, *keyed)
    two = train_here(data, tmp_path / "two", "--epochs", "2", "--batch-size", "2", "--nproc", "2", *NO_NORM, *aug,
                     *keyed, "--set", "train.checkpoint_every=6", "--set", "train.keep_checkpoints=4")
    assert _max_rel(_weights(two), _weights(one)) <= 1e-5
    step = two / "checkpoints" / "step-00000006.pt"  # mid-epoch 2 (4 steps an epoch)
    moved = train_here(data, tmp_path / "moved", "--epochs", "2", "--batch-size", "2", "--resume", str(step),
                       *NO_NORM, *aug, *keyed)
    params = _events(moved)[0]  # resumed on 1 rank at the checkpoint's global batch: 2 micro-batches of 2
    assert (params["world_size"], params["global_batch"]) == (1, 4)
    steps = [json.loads(x)["step"] for x in (moved / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if isinstance(s, list) and len(s) == 2][0][0] == 1  # it began in epoch 2 (0-based 1)
    assert _max_rel(_weights(moved), _weights(two)) <= 1e-5
    rank = train_here(data, tmp_path / "rank", "--epochs", "2", "--batch-size", "4", *NO_NORM, *aug)
    assert _max_rel(_weights(rank), _weights(one)) > 1e-3  # the augmentation did change the weights


def test_batchnorm_two_srun_tasks_equal_emulated_workers(data, tmp_path, train_here):
    """Two tasks with srun's variables (no launcher) == ``--emulate-workers 2``; != batch 4 in one BN."""
    out = tmp_path / "srun"
    _srun_train(data, out, "31337", "--epochs", "2", "--batch-size", "2", timeout=120)
    params, _ = _events(out)
    assert (params["launcher"], params["world_size"], params["global_batch"]) == ("slurm", 2, 4)

    emu = train_here(data, tmp_path / "emu", "--epochs", "2", "--batch-size", "2", "--emulate-workers", "2")
    big = train_here(data, tmp_path / "big", "--epochs", "2", "--batch-size", "4")
    assert _events(emu)[0]["global_batch"] == 4
    srun_w = _weights(out, params_only=True)
    assert _max_rel(_weights(emu, params_only=True), srun_w) <= 1e-5
    # One BatchNorm over 4 images is a different model: emulation is doing real work.
    assert _max_rel(_weights(big, params_only=True), srun_w) > 1e-3


def test_batch_size_auto_two_ranks_train_at_the_smallest_batch_any_rank_found(data, tmp_path):
    """``--batch-size auto`` under srun's variables, each task's device given its own memory (a cap of
    16 and of 32 MiB, as two GPUs of different size): each searches alone (before, rank 0 searched
    inside the job's DDP build while rank 1 waited in a broadcast: gloo's timeout, the job failed),
    and both train at the smaller of the two batches the one-process search finds for each cap."""
    from fastvision import config
    from fastvision.planning.autobatch import resolve_auto_batch

    caps = (16, 32)

    def recipe():  # what TINY sets that can change a step's memory
        return config.load("unet2d-microscopy", [{
            "data": {"args": {"image_size": [32, 32]}, "augment": {"flip": None, "rot90": None}},
            "model": {"args": {"filters": [4, 8, 16]}}, "train": {"batch_size": "auto", "device": "cpu"}}])

    alone = [resolve_auto_batch(recipe(), torch.device("cpu"), cap=mb * 2**20) for mb in caps]
    assert alone[0] < alone[1] and 2 * alone[0] <= 16, alone  # distinct answers, a batch the 16 items allow
    out = tmp_path / "auto"
    errs = _srun_train(data, out, "4343", "--epochs", "1", "--batch-size", "auto", timeout=150,
                       rank_env=lambda r: {"FASTVISION_MEMORY_CAP_MB": str(caps[r])})
    params, epochs = _events(out)
    assert (params["world_size"], params["global_batch"]) == (2, 2 * alone[0]) and len(epochs) == 1
    import yaml

    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["batch_size"] == alone[0]
    assert f"the ranks found [{alone[0]}, {alone[1]}]" in errs[0]


def _worker_pid(tag: str, rank: int) -> int | None:
    """PID of the worker process with ``RANK=rank`` whose environment carries ``tag``."""
    want = {f"FV_TEST_TAG={tag}".encode(), f"RANK={rank}".encode()}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = set((d / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= env:
            return int(d.name)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker through /proc")
def test_killed_worker_fails_the_job_then_resume_finishes(data, tmp_path, train_here, capfd, monkeypatch):
    """``--nproc 2`` through ``fastvision.cli.main`` in this process (as ``train_here``: it starts the
    real torchrun and its workers, whose stderr ``capfd`` reads), rank 1 killed from a thread once the
    first epoch's checkpoint is written; 6 epochs: 5 left when the kill is due, 4 or more of them
    for the one-process resume to train."""
    from tests.distributed.test_dist import time_limit

    out, tag, epochs = tmp_path / "run", uuid.uuid4().hex, 6
    last, seen = out / "checkpoints" / "last.pt", {}
    monkeypatch.setenv("FV_TEST_TAG", tag)  # in the workers' environment: _worker_pid finds them by it

    def kill_rank_1() -> None:
        deadline = time.monotonic() + 90
        while not last.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        seen["victim"] = victim = _worker_pid(tag, 1)
        seen["checkpoint"] = last.exists()
        if victim is not None:
            os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    capfd.readouterr()
    killer.start()
    with time_limit(150):  # the wait for the checkpoint, then a hang after the kill, fails the test here
        rc = cli_here(_cmd(data, out, "--epochs", str(epochs), "--batch-size", "2", "--nproc", "2")[3:], threads=1)
    killer.join(timeout=5)
    err = capfd.readouterr().err
    assert seen.get("checkpoint") and seen.get("victim") is not None, "no checkpoint / worker to kill\n" + err[-3000:]
    # one line names rank 1 killed by SIGKILL: first (the exit status 128 + 9), or after rank 0 when rank 0
    # died of the broken all-reduce in the same instant and torch recorded it first (its status then)
    line = [x for x in err.splitlines() if x.startswith("fastvision: rank ")]
    assert len(line) == 1 and "rank 1 was stopped by SIGKILL" in line[0], err[-3000:]
    assert rc == (137 if line[0].startswith("fastvision: rank 1 ") else 1)
    done = torch.load(last, map_location="cpu", weights_only=True)["epoch"]
    assert done < epochs - 1, "the run finished before the kill: nothing was interrupted"

    # Continue in one process as 2 emulated workers (same global batch, another world size).
    train_here(data, out, "--epochs", str(epochs), "--batch-size", "2", "--emulate-workers", "2", "--resume", "auto")
    assert f"at epoch {done + 1}" in capfd.readouterr().err  # picked up after the last completed epoch
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == epochs
    assert torch.load(last, map_location="cpu", weights_only=True)["epoch"] == epochs - 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the processes through /proc")
def test_sigterm_to_the_nproc_launcher_stops_its_workers_with_a_checkpoint(data, tmp_path):
    """``kill PID`` of ``fastvision train --nproc 2`` (what a Kubernetes pod's PID 1 or a user gets): the
    workers get the signal, checkpoint the step they are on and the command exits 143 with nothing of the job
    left running (before, the launcher died alone and torchrun's workers trained on without a parent)."""
    out, tag = tmp_path / "run", uuid.uuid4().hex
    proc = subprocess.Popen(_cmd(data, out, "--epochs", "50", "--batch-size", "2", "--nproc", "2",
                                 "--set", "train.log_every=1"),
                            cwd=ROOT, env=clean_env(FV_TEST_TAG=tag), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    err, left = sigterm_after_steps(proc, out / "metrics.jsonl", 3, tag)  # the launcher alone, as `kill PID`
    assert proc.returncode == 143 and not left, (proc.returncode, left, err[-3000:])
    assert err.count("stopped by SIGTERM") == 1 and "Traceback" not in err, err[-3000:]  # one line a job
    step = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["step"]
    assert 0 < step < 50 * 4


def test_nproc_refusals_are_one_line_without_a_traceback(data, tmp_path, capfd, monkeypatch):
    """``--nproc 2`` into a run folder that exists: rank 0's refusal is the one error line (rank 1 used to
    print gloo's "Connection closed by peer" traceback from the broadcast it waited in), exit 2. A mask of
    values 0/128/255 that only one rank's shard reads: that rank's line names the file, the rank whose
    all-reduce broke says so in one line, no traceback, and the job exits 2 (the cause's code, not 1)."""
    from PIL import Image

    from tests.distributed.test_dist import time_limit

    for key, value in clean_env().items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    capfd.readouterr()
    with time_limit(120):
        rc = cli_here(_cmd(data, out, "--epochs", "1", "--batch-size", "2", "--nproc", "2")[3:], threads=1)
    err = capfd.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("fastvision: error:")]
    assert rc == 2 and len(errors) == 1 and "run directory already exists" in errors[0], err[-3000:]
    assert "Traceback" not in err and (out / "notes.txt").read_text() == "mine"

    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(data, bad)
    mask = sorted((bad / "masks").iterdir())[0]
    values = np.zeros((32, 32), np.uint8)
    values[:8], values[8:16] = 128, 255
    Image.fromarray(values).save(mask)
    with time_limit(120):
        rc = cli_here(_cmd(bad, tmp_path / "run", "--epochs", "1", "--batch-size", "2", "--nproc", "2")[3:],
                      threads=1)
    err = capfd.readouterr().err
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    assert sum(mask.name in x for x in err.splitlines() if x.startswith("fastvision: error:")) == 1, err[-3000:]


def test_nproc_the_same_bad_file_on_every_rank_is_one_line(data, tmp_path, capfd, monkeypatch):
    """A mask whose size differs from its image stops every rank as it builds the data set: ``--nproc 2``
    prints the line naming it once (each worker printed it), exit 2."""
    import shutil

    from PIL import Image

    from tests.distributed.test_dist import time_limit

    for key, value in clean_env().items():
        monkeypatch.setenv(key, value)
    bad = tmp_path / "bad"
    shutil.copytree(data, bad)
    mask = sorted((bad / "masks").iterdir())[3]
    Image.fromarray(np.zeros((16, 24), np.uint8)).save(mask)
    capfd.readouterr()
    with time_limit(120):
        rc = cli_here(_cmd(bad, tmp_path / "run", "--epochs", "1", "--batch-size", "2", "--nproc", "2")[3:], threads=1)
    err = capfd.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("fastvision: error:")]
    assert rc == 2 and len(errors) == 1 and mask.name in errors[0] and "Traceback" not in err, err[-3000:]
