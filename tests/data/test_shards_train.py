"""Training from a shard set keeps the data contract: two runs with one seed end with identical
weights (with or without a cache, threads or worker processes), and a mid-epoch step checkpoint
continued in another run ends bit-identically with the uninterrupted run. Tiny shards, a few steps."""
from __future__ import annotations

import json

import pytest
import torch

from fastvision import config
from fastvision.api import run_training
from fastvision.data.shards.writer import write_shards
from fastvision.data.synth import load_all

pytestmark = pytest.mark.slow
TINY = ["data.args.image_size=32", "data.args.resize_size=36", "task.args.num_classes=3", "model.args.num_classes=3",
        "train.batch_size=2", "train.target=null", "examples=0", "train.device=cpu", "train.epochs=2",
        "train.steps_per_epoch=3", "train.seed=3", "data.args.shard_window=2"]


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("shardtrain")
    src = load_all().get("imagenet")(root / "src", seed=0, classes=3, per_class=4, val_per_class=1, size=40)
    write_shards(src, root / "out", "16KB")
    return root / "out"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "fvcache"))


def _train(data, out, *sets, resume=None) -> dict:
    over = [config.parse_override(s) for s in [f"data.args.path={data}", *TINY, *sets]]
    run_training("resnet18-imagefolder", out=str(out), resume=resume, extra=over + [{"train": {"amp": "off"}}],
                 progress=False)
    return _load(out / "checkpoints" / "last.pt")


def _load(path) -> dict:
    """A checkpoint, memory-mapped: only what a test compares is read (not the optimizer state)."""
    return torch.load(path, weights_only=True, mmap=True)


def _identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_same_seed_same_weights_from_shards_whatever_the_cache_or_loader(shard_set, tmp_path):
    """The recipe's loader (threads, none: items read in the main thread), then a loader thread
    reading through the disk cache, then two worker processes: three runs, one set of weights.
    (One run changes the thread count and the cache: either changing the weights fails it.)"""
    first = _train(shard_set, tmp_path / "a")
    assert first["data_info"]["shards"]["train"] > 3
    cached = _train(shard_set, tmp_path / "c", "data.num_workers=1", "data.cache=disk")
    assert _identical(first["model"], cached["model"])
    processes = _train(shard_set, tmp_path / "p", "data.loader=processes", "data.num_workers=2")
    assert _identical(first["model"], processes["model"])


def test_a_step_checkpoint_from_shards_resumes_bit_identically(shard_set, tmp_path):
    sets = ["train.checkpoint_every=2", "train.keep_checkpoints=10"]  # steps 2, 4, 6: two of them mid-epoch
    whole = _train(shard_set, tmp_path / "whole", *sets)
    step = tmp_path / "whole" / "checkpoints" / "step-00000002.pt"
    assert _load(step)["position"]["step"] == 2  # mid-epoch: 3 steps an epoch
    resumed = _train(shard_set, tmp_path / "cut", *sets, resume=str(step))
    assert _identical(whole["model"], resumed["model"])
    assert [h["train_loss"] for h in whole["history"]] == [h["train_loss"] for h in resumed["history"]]


def test_the_training_sampler_reads_the_shard_order(shard_set):
    from fastvision.data.shards.reader import shard_order
    from fastvision.distributed.samplers import _mix_seed
    from fastvision.engine.build import build

    cfg = config.load("resnet18-imagefolder", [config.parse_override(s) for s in [f"data.args.path={shard_set}",
                                                                                 *TINY]])
    run = build(cfg, train=True)
    sampler = run.train_loader.sampler
    index = json.loads((shard_set / "shards.json").read_text())
    counts = [s["nsamples"] for s in index["splits"]["train"]["shardlist"]]
    assert sampler.permutation(1) == shard_order(counts, 2, torch.Generator().manual_seed(_mix_seed(3, 1)))
