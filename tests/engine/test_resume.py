"""Resume defects a review found (engine/state.py, engine/policy.py, engine/log.py, the loader's start).

- the accumulation that keeps a checkpoint's global batch is decided from the world this process
  joined (Horovod's launcher sets no variable ``detect_env`` reads), and leaves the caller's config;
- a mid-epoch position is kept in samples, so any world size continues at the same sample;
- pruning step checkpoints never deletes the one being written (resume from an older step-N.pt);
- after a mid-epoch resume, metrics.jsonl holds one record per step.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from fastvision import config, distributed
from fastvision.data.loader import ThreadLoader
from fastvision.distributed.env import DistEnv
from fastvision.distributed.samplers import TrainSampler
from fastvision.engine.state import Position, keep_global_batch
from tests.conftest import cli_here

HOROVODRUN = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "4",
              "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1", "HOROVOD_HOSTNAME": "localhost",
              "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234",
              "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}  # what horovodrun -np 4 sets


def test_a_horovod_checkpoint_resumed_on_as_many_horovod_ranks_keeps_its_batch(monkeypatch):
    """The launch variables alone say one process; the joined world (what ``distributed.init`` returns under
    horovodrun: ``DistEnv(world_size=hvd.size(), launcher="horovod")``) says 4, and decides."""
    for k, v in HOROVODRUN.items():
        monkeypatch.setenv(k, v)
    assert distributed.detect_env().world_size == 1  # why fit must not ask the launch variables
    cfg = config.load("unet2d-microscopy", [{"train": {"batch_size": 4}}])
    saved = {"global_batch": 16, "world_size": 4}  # 4 ranks x batch 4
    joined = DistEnv(rank=0, world_size=4, local_world_size=4, launcher="horovod")
    assert keep_global_batch(cfg, saved, joined.world_size, joined.is_main).train.accum_steps == 1
    alone = keep_global_batch(cfg, saved, 1)  # one process really joined: accumulation 4 keeps the batch
    assert alone.train.accum_steps == 4 and cfg.train.accum_steps == 1  # the caller's config is untouched


def _first_global_batch(n: int, world: int, batch: int, epoch: int, start_sample: int) -> tuple[set[int], int]:
    """The permutation positions the ranks' first batches read after ``set_epoch(epoch, start_sample)``,
    and the fewest batches any rank still has."""
    positions, left = set(), []
    for r in range(world):
        sampler = TrainSampler(n, num_replicas=world, rank=r, seed=7)
        loader = ThreadLoader(list(range(n)), batch_size=batch, sampler=sampler, num_workers=0, drop_last=True,
                              collate_fn=lambda items: items)
        loader.set_epoch(epoch, start_sample=start_sample)
        batches = list(loader)
        order = sampler.permutation()
        positions |= {order.index(i) for i in batches[0]}  # the permutation holds each index once (n = total)
        left.append(len(batches))
    return positions, min(left)


def test_a_mid_epoch_position_continues_at_the_same_sample_on_any_world_size():
    """A 2-rank run at batch 3 (global batch 6) checkpoints after step 5 of epoch 2: 30 samples read.
    Resumed on 4 ranks at batch 3 (global 12: 6 is no multiple, the accumulation stays 1), the ranks
    read positions 30..41 next, not 60..71 (step 5 x the new global batch)."""
    n, epoch = 96, 2
    saved = {"epoch": epoch, "step": 5, "samples": 30, "loss_sum": 1.0, "applied": 5.0, "skipped": 0.0,
             "streak": 0.0, "images": 15, "time_s": 1.0}
    pos = Position.from_dict(saved, global_batch=6)
    positions, left = _first_global_batch(n, 4, 3, epoch, pos.samples)
    assert positions == set(range(30, 42))
    steps_per_epoch = n // 4 // 3
    assert left >= steps_per_epoch - pos.first_step(12)  # every remaining step of the epoch has its batch
    same, _ = _first_global_batch(n, 2, 3, epoch, pos.samples)  # the same world: exactly as before
    assert same == set(range(30, 36)) and pos.first_step(6) == 5
    old = Position.from_dict({k: v for k, v in saved.items() if k != "samples"}, global_batch=6)
    assert old.samples == 30  # a checkpoint written before positions were kept in samples


TINY = ["--device", "cpu", "--batch-size", "2", "--set", "data.args.image_size=[32,32]", "--set",
        "model.args.filters=[4,8,16]", "--set", "data.num_workers=0", "--set", "examples=0", "--set",
        "train.log_every=1", "--set", "train.checkpoint_every=5"]


def _train(data: Path, out: Path, keep: int, *more: str) -> None:
    """``fastvision train`` in this process (what is tested is the files a resume writes, not a process)."""
    argv = ["train", "unet2d-microscopy", "--data", str(data), "--out", str(out), "--epochs", "3", *TINY,
            "--set", f"train.keep_checkpoints={keep}", *more]
    assert cli_here(argv) == 0


def test_resume_from_an_older_step_checkpoint_keeps_what_it_writes_and_logs_each_step_once(tiny_microscopy, tmp_path):
    """3 epochs of 6 steps, a checkpoint every 5 steps (step-5, -10, -15 kept); then ``--resume
    step-5.pt`` keeping 2: the rewritten step-10.pt must survive its own pruning, and metrics.jsonl
    ends with one record per step and per epoch."""
    out = tmp_path / "run"
    _train(tiny_microscopy, out, 3)
    folder = out / "checkpoints"
    assert sorted(p.name for p in folder.glob("step-*.pt")) == [f"step-{n:08d}.pt" for n in (5, 10, 15)]
    _train(tiny_microscopy, out, 2, "--resume", str(folder / "step-00000005.pt"))
    kept = sorted(p.name for p in folder.glob("step-*.pt"))
    assert kept == ["step-00000010.pt", "step-00000015.pt"], kept
    assert torch.load(folder / "step-00000010.pt", weights_only=True)["step"] == 10
    events = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [tuple(s) for s in events if isinstance(s, list) and len(s) == 2]
    assert sorted(steps) == [(e, i) for e in range(3) for i in range(1, 7)]  # each once
    assert [s for s in events if isinstance(s, list) and len(s) == 1] == [[0], [1], [2]]


def test_a_resume_with_other_settings_names_them_and_saves_the_new_config(tiny_microscopy, tmp_path, capsys):
    """A resume continues with the settings it is given; the ones that differ from the run's config.yaml
    are logged (key, old -> new), and config.yaml then holds the new ones."""
    out = tmp_path / "run"
    argv = ["train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(out), *TINY]
    assert cli_here([*argv, "--epochs", "1"]) == 0
    capsys.readouterr()
    assert cli_here([*argv, "--epochs", "2", "--resume", "auto", "--set", "train.log_every=3"]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "setting(s) changed" in x)
    assert "resumed with 2 setting(s) changed from" in line and str(out / "config.yaml") in line, line
    assert "train.epochs: 1 -> 2" in line and "train.log_every: 1 -> 3" in line, line
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["train"]["epochs"] == 2 and saved["train"]["log_every"] == 3
    assert cli_here([*argv, "--epochs", "2", "--resume", "auto", "--set", "train.log_every=3"]) == 0
    assert "setting(s) changed" not in capsys.readouterr().err  # the same settings again: nothing to say


def test_a_resume_beside_a_config_yaml_that_is_no_mapping_rewrites_it(tiny_microscopy, tmp_path, capsys):
    """A hand-edited config.yaml holding a list (or a number) stopped the resume with an AttributeError
    traceback, exit 1, in the comparison that only logs what changed; it is rewritten with the run's config."""
    out = tmp_path / "run"
    argv = ["train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(out), *TINY]
    assert cli_here([*argv, "--epochs", "1"]) == 0
    for text in ("- a list\n", "3\n"):
        (out / "config.yaml").write_text(text)
        assert cli_here([*argv, "--epochs", "2", "--resume", "auto"]) == 0, capsys.readouterr().err[-2000:]
        assert yaml.safe_load((out / "config.yaml").read_text())["train"]["epochs"] == 2


def test_a_last_checkpoint_that_does_not_load_names_the_others_to_resume_from(tiny_microscopy, tmp_path, capsys):
    """A truncated last.pt: one line, exit 2, as before, now naming the run's other checkpoints, newest first,
    without last.pt's hard links (rollback.pt of the same write holds the same damaged bytes)."""
    out = tmp_path / "run"
    argv = ["train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(out), *TINY,
            "--set", "train.checkpoint_every=2", "--set", "train.keep_checkpoints=2"]
    assert cli_here([*argv, "--epochs", "1"]) == 0
    folder = out / "checkpoints"
    last = folder / "last.pt"
    assert (folder / "rollback.pt").samefile(last) and (folder / "best.pt").samefile(last)  # epoch 0's write
    kept = [p.name for p in sorted(folder.glob("step-*.pt"))]
    assert len(kept) == 2 and not any((folder / n).samefile(last) for n in kept)
    with open(last, "r+b") as f:
        f.truncate(1000)
    capsys.readouterr()
    assert cli_here([*argv, "--epochs", "2", "--resume", "auto"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"fastvision: error: {last}: not a loadable fastvision checkpoint"), line
    others = line.split("other checkpoints of this run, newest first: ")[1]
    assert "rollback.pt" not in others and "best.pt" not in others, others  # the same damaged bytes
    assert others.startswith(f"{folder / kept[1]}, {folder / kept[0]} ("), others
    assert others.endswith("(--resume PATH continues one)")
