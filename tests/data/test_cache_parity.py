"""``data.cache`` is a speed switch: every tier serves the same samples, in the same order, with the
same values, on one process and on two ranks.

The recipe ``unet3d-spleen-fast`` (shipped with ``data.cache: gpu``) is built by ``engine.build``, the
build every command uses, on generated spleen CT, once per tier; the first two batches of epochs 0
and 1 are compared. The reference is computed by hand, not by another tier: the epoch's order is
``torch.randperm`` under the generator of ``(seed, epoch)`` (rank r taking every second position on
two ranks), and an item is the dataset's own ``cache_pipeline`` run on the case files with the
generator of ``(seed, epoch, index)``. A gpu cache that served its own seeded partition order gave
``spleen_6, spleen_1`` where the others gave ``spleen_5, spleen_1`` (first step loss 0.871826 vs
0.873683), and ``ram`` under DDP held a fixed partition per rank.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import torch

from tests.conftest import run_gloo_ranks

RECIPE = "unet3d-spleen-fast"
SEED, BATCH, EPOCHS, BATCHES = 5, 2, (0, 1), 2
SETS = {"train.device": "cpu", "train.amp": "off", "train.seed": SEED, "train.batch_size": BATCH,
        "data.args.patch_size": [16, 16, 16], "task.args.sample_shape": [1, 16, 16, 16],
        "task.args.sliding_window.roi_size": [16, 16, 16], "data.args.target_spacing": None,
        "model.args.filters": [4, 8, 16], "examples": 0}
# every tier, the smart cache at its default window (the whole set): the only smart setting that
# is a speed switch
TIERS = ("none", "ram", "disk", "shared", "smart", "gpu")
# ``spleen``: the generated set of tests/data/conftest.py
pytestmark = pytest.mark.usefixtures("private_cache")


def _cfg(data: Path, cache: str):
    from fastvision import config

    over: dict = {}
    for key, value in {**SETS, "data.args.path": str(data), "data.cache": cache}.items():
        over = config.merge(over, config.nested(key, value))
    return config.load(RECIPE, [over])


def _digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(str((t.dtype, tuple(t.shape))).encode() + t.numpy().tobytes()).hexdigest()[:20]


def _served(data: Path, cache: str) -> dict:
    """The first batches of each epoch as the recipe's training loader serves them with ``cache``."""
    from fastvision import engine

    run = engine.build(_cfg(data, cache), train=True)
    out = {"cache": type(run.train_set).__name__, "epochs": []}
    try:
        for epoch in EPOCHS:
            run.train_loader.set_epoch(epoch)
            batches = []
            for k, batch in enumerate(run.train_loader):
                batches.append({"id": list(batch["id"]), "image": _digest(batch["image"]),
                                "label": _digest(batch["label"].long()), "images": batch["image"].clone(),
                                "labels": batch["label"].long().clone()})
                if k + 1 == BATCHES:
                    break
            out["epochs"].append(batches)
    finally:
        if hasattr(run.train_set, "shutdown"):
            run.train_set.shutdown()
    return out


def _expected(data: Path, world: int, rank: int) -> list[list[dict]]:
    """By hand: the ids and tensors of the first batches of each epoch on ``rank`` of ``world``."""
    import fastvision.data.formats  # noqa: F401  (registers the readers)
    from fastvision.data import transforms as T
    from fastvision.distributed.samplers import _mix_seed
    from fastvision.registry import DATASETS

    cfg = _cfg(data, "none")
    train = DATASETS.build(cfg.data.name, cfg.data.args, where="data.args").train
    base, pipeline = train.cache_pipeline()
    prefix, suffix = T.split(pipeline)
    n = len(train)
    assert n % world == 0  # no padding to think about
    out = []
    for epoch in EPOCHS:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(_mix_seed(SEED, epoch))).tolist()
        mine = perm[rank::world]
        batches = []
        for k in range(BATCHES):
            idx = mine[k * BATCH:(k + 1) * BATCH]
            items = [T.apply_random(suffix, T.apply(prefix, base[i]), T.item_generator(SEED, epoch, i)) for i in idx]
            batches.append({"id": [it["id"] for it in items],
                            "image": _digest(torch.stack([it["image"] for it in items])),
                            "label": _digest(torch.stack([it["label"].long() for it in items]))})
        out.append(batches)
    return out


def _strip(epochs: list[list[dict]]) -> list[list[dict]]:
    return [[{k: b[k] for k in ("id", "image", "label")} for b in batches] for batches in epochs]


def test_every_cache_tier_serves_the_samplers_items_in_one_process(spleen):
    want = _expected(spleen, 1, 0)
    assert want[0][0]["id"] != want[1][0]["id"]  # the epochs differ: the check sees the epoch's order
    served = {cache: _served(spleen, cache) for cache in TIERS}
    assert [cache for cache, got in served.items() if _strip(got["epochs"]) != want] == []
    assert served["gpu"]["cache"] == "DeviceCacheDataset" and served["ram"]["cache"] == "CacheDataset"
    # and the tensors really are the same values (not only equal digests of one constant)
    first = served["none"]["epochs"][0][0]["images"]
    assert first.std() > 0 and not torch.equal(first, served["none"]["epochs"][1][0]["images"])
    for cache in TIERS:
        for e in range(len(EPOCHS)):
            for a, b in zip(served["none"]["epochs"][e], served[cache]["epochs"][e], strict=True):
                assert torch.equal(a["images"], b["images"]) and torch.equal(a["labels"], b["labels"]), cache


def test_a_smart_window_smaller_than_the_set_says_it_is_not_a_speed_switch(spleen, caplog, fresh_logging):
    """The one tier that cannot match: a smaller window trains each epoch on part of the set."""
    import fastvision.data.formats  # noqa: F401
    from fastvision.data.cache.select import wrap_train_set
    from fastvision.registry import DATASETS

    cfg = _cfg(spleen, "smart")
    train = DATASETS.build(cfg.data.name, cfg.data.args, where="data.args").train
    with caplog.at_level(logging.WARNING, logger="fastvision"):
        smart = wrap_train_set(train, cache="smart", cache_num=3, seed=SEED)
    smart.shutdown()
    assert len(smart) == 3 and "not a speed switch" in caplog.text


CHILD = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.data.test_cache_parity import TIERS, _served
data, out = Path(sys.argv[1]), Path(sys.argv[2])
res = {{}}
for cache in (*TIERS, "auto"):  # auto: both ranks take one tier (shared here: /dev/shm holds the set)
    got = _served(data, cache)
    res[cache] = [[{{k: b[k] for k in ("id", "image", "label")}} for b in e] for e in got["epochs"]]
out.write_text(json.dumps(res))
"""


@pytest.mark.dist
@pytest.mark.slow
def test_every_cache_tier_serves_the_samplers_items_on_two_ranks(spleen, tmp_path):
    """Two gloo ranks on one node (so ``gpu`` fills from the node-shared host copy): each rank's
    batches are its share of the global permutation, whatever the tier."""
    for r, got in enumerate(run_gloo_ranks(tmp_path, CHILD, [str(spleen)])):
        want = _expected(spleen, 2, r)
        assert [cache for cache in (*TIERS, "auto") if got[cache] != want] == [], f"rank {r}"
