"""``data.cache: gpu`` holds on the device only the share a rank reads this epoch.

Under DDP rank r reads positions ``r, r + world, ...`` of the ``(seed, epoch)`` permutation, a
different ``1/world`` of the items every epoch. The device cache holds exactly that share (not every
item on every rank, which crowded out training memory), swaps it at ``set_epoch``, and still serves
item ``i`` as ``data.cache: none`` does. The expected shares are computed by hand here
(``torch.randperm`` under the generator of ``(seed, epoch)``), not by asking the sampler.
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from fastvision.data.cache.datasets import CacheDataset
from fastvision.data.cache.device import DeviceCacheDataset
from fastvision.distributed.samplers import TrainSampler, _mix_seed
from tests.conftest import run_gloo_ranks
from tests.data.test_cache_parity import SEED, _expected
from tests.data.test_cache_select import Counted

pytestmark = pytest.mark.usefixtures("private_cache")  # ``spleen``: tests/data/conftest.py


def _share(n: int, seed: int, epoch: int, world: int, rank: int) -> list[int]:
    """By hand: the indices rank ``rank`` of ``world`` reads in ``epoch`` (``n % world == 0``)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(_mix_seed(seed, epoch))).tolist()
    return sorted(perm[rank::world])


def _on_device(ds) -> list[int]:
    return [i for i, held in enumerate(ds.on_device) if held]


@pytest.mark.parametrize("holds", [False, True], ids=["own-host-copy", "held-source"])
@pytest.mark.parametrize("rank", [0, 1])
def test_the_device_holds_this_epochs_share_and_swaps_it_at_set_epoch(rank, holds):
    n, world, seed = 8, 2, 4
    base = Counted(n=n)
    # held-source: the source already holds every item in host memory (as the node-shared cache)
    source = CacheDataset(base, [], progress=False) if holds else base
    reads = base.reads
    sampler = TrainSampler(n, num_replicas=world, rank=rank, seed=seed)
    ds = DeviceCacheDataset(source, "cpu", seed=seed, share=sampler.indices, source_holds=holds)
    assert _share(n, seed, 0, world, rank) != _share(n, seed, 1, world, rank)  # the check sees the swap
    for epoch in (0, 1, 2, 1):
        ds.set_epoch(epoch)
        assert _on_device(ds) == _share(n, seed, epoch, world, rank), epoch
        assert ds.num_cached == n // world
        for i in range(n):  # every item, on the device or not, is the source's
            assert ds[i]["id"] == f"item{i}" and torch.equal(ds[i]["image"], Counted()[i]["image"])
    assert base.reads == reads + (0 if holds else n)  # each item read once (held: by its cache)
    assert "this epoch's share: 4" in ds.report()


def test_a_share_over_the_budget_warns_once_and_serves_the_rest_from_host():
    n, world, seed = 8, 2, 4
    per_item = 4 * 4 * 4 + 4 * 4 * 8  # float32 image + int64 label
    src = CacheDataset(Counted(n=n), [], progress=False)
    sampler = TrainSampler(n, num_replicas=world, rank=0, seed=seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = DeviceCacheDataset(src, "cpu", share=sampler.indices, source_holds=True, budget_bytes=3 * per_item)
        for epoch in (1, 2):
            ds.set_epoch(epoch)
            assert ds.num_cached == 3 and set(_on_device(ds)) < set(_share(n, seed, epoch, world, 0))
            assert [ds[i]["id"] for i in range(n)] == [f"item{i}" for i in range(n)]
    said = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert len(said) == 1 and "does not fit" in str(said[0].message)


def test_emulated_workers_hold_what_the_emulated_micro_batches_read(spleen):
    """One process emulating 2 workers whose partial last batches are dropped: the device holds the
    items the emulated micro-batches read, and they are served as uncached."""
    from fastvision import engine
    from tests.data.test_cache_parity import _cfg

    served = {}
    for cache in ("none", "gpu"):
        cfg = _cfg(spleen, cache)
        # 8 items: 2 emulated workers x 1 batch of 3, the other 2 items dropped
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, emulate_workers=2, batch_size=3))
        run = engine.build(cfg, train=True)
        run.train_loader.set_epoch(1)
        served[cache] = [(b["id"], b["image"].clone()) for b in run.train_loader]
        if cache == "gpu":
            perm = torch.randperm(8, generator=torch.Generator().manual_seed(_mix_seed(SEED, 1))).tolist()
            assert _on_device(run.train_set) == sorted(perm[0:6:2] + perm[1:6:2])  # the dropped 2 are not held
    assert [ids for ids, _ in served["gpu"]] == [ids for ids, _ in served["none"]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(served["gpu"], served["none"], strict=True))


CHILD = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from fastvision import engine
from tests.data.test_cache_parity import BATCH, _cfg, _digest, _served
data, out = Path(sys.argv[1]), Path(sys.argv[2])

def batches(loader, k):
    got = []
    for b in loader:
        got.append({{"id": list(b["id"]), "image": _digest(b["image"]), "label": _digest(b["label"].long())}})
        if len(got) == k:
            return got

run = engine.build(_cfg(data, "gpu"), train=True)
ds, loader = run.train_set, run.train_loader
res = {{"epochs": [], "sampler": []}}
for epoch in (0, 1):
    loader.set_epoch(epoch)
    res["sampler"].append(sorted(set(loader.sampler)))  # what the rank reads this epoch
    res["epochs"].append({{"device": [i for i, h in enumerate(ds.on_device) if h], "batches": batches(loader, 2)}})
loader.set_epoch(1, start_sample=2 * BATCH)  # a resume one global step into epoch 1
res["resumed"] = {{"device": [i for i, h in enumerate(ds.on_device) if h], "batches": batches(loader, 1)}}
res["none"] = [[{{k: b[k] for k in ("id", "image", "label")}} for b in e] for e in _served(data, "none")["epochs"]]
out.write_text(json.dumps(res))
"""


@pytest.mark.dist
@pytest.mark.slow
def test_each_rank_holds_only_its_epoch_share_on_two_ranks(spleen, tmp_path):
    """Two gloo ranks on one node (CPU device, filled from the node-shared host copy): each rank's
    device holds its epoch share (4 of the 8 items), the next epoch's after ``set_epoch``, the same
    epoch's after a mid-epoch resume, and its batches are those of ``data.cache: none``."""
    for r, got in enumerate(run_gloo_ranks(tmp_path, CHILD, [str(spleen)])):
        want = _expected(spleen, 2, r)
        shares = [_share(8, SEED, e, 2, r) for e in (0, 1)]
        assert shares[0] != shares[1]
        assert [e["device"] for e in got["epochs"]] == shares == got["sampler"], f"rank {r}"
        assert got["resumed"]["device"] == shares[1], f"rank {r}"
        assert [e["batches"] for e in got["epochs"]] == want == got["none"], f"rank {r}"
        assert got["resumed"]["batches"] == want[1][1:2], f"rank {r}"
    assert set(_share(8, SEED, 0, 2, 0)) | set(_share(8, SEED, 0, 2, 1)) == set(range(8))  # together: the set


class _Slices(torch.utils.data.Dataset):
    """8 items of one 64 KiB float32 image each (a whole number of the CUDA allocator's blocks)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"image": torch.full((128, 128), float(i)), "id": f"item{i}"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_device_memory_is_the_share_and_each_item_is_held_once():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    sampler = TrainSampler(8, num_replicas=2, rank=1, seed=4)
    ds = DeviceCacheDataset(_Slices(), "cuda", share=sampler.indices)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        share = _share(8, 4, epoch, 2, 1)
        assert _on_device(ds) == share and torch.cuda.memory_allocated() - before == 4 * 128 * 128 * 4
        # one copy: the share on the device only, the rest (moved back at the swap) on the host only
        assert [i for i, h in enumerate(ds.host) if h is not None] == sorted(set(range(8)) - set(share))
        assert all(ds.dev[i]["image"].is_cuda for i in share)
        for i in range(8):
            assert ds[i]["image"].is_cuda and torch.equal(ds[i]["image"].cpu(), torch.full((128, 128), float(i)))
