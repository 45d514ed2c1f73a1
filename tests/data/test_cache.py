"""Caches: equal to uncached outputs (and MONAI's CacheDataset), invalidation, corruption, the smart
cache schedule of seed 003 (and MONAI's SmartCacheDataset), node-shared PSS, the device cache."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from fastvision.data import transforms as T
from fastvision.data.cache.datasets import CacheDataset, PersistentDataset, ordered_map
from fastvision.data.cache.device import DeviceCacheDataset, fill_order
from fastvision.data.cache.smart import SmartCacheDataset


class Volumes(Dataset):
    """Deterministic synthetic items; ``loads`` counts base reads."""

    def __init__(self, n: int = 6, size: int = 8):
        self.n, self.size, self.loads = n, size, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loads += 1
        g = torch.Generator().manual_seed(i)
        return {"image": torch.rand(1, self.size, self.size, self.size, generator=g),
                "label": torch.randint(0, 3, (self.size,) * 3, generator=g), "id": f"case{i}"}

    def identity(self, i):
        return f"case{i}"


@dataclass
class Scale(T.Transform):
    factor: float = 2.0

    def __call__(self, item):
        return {**item, "image": item["image"] * self.factor}


def clip_label(item):
    return {**item, "label": item["label"].clamp(max=1)}


class Noise(T.RandomTransform):
    def __call__(self, item, generator):
        return {**item, "image": item["image"] + 0.001 * torch.randn(item["image"].shape, generator=generator)}


class Shift(T.Transform):  # deterministic, placed after the random one: must not be cached
    def __call__(self, item):
        return {**item, "image": item["image"] - 1}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                                        for k in a)


def _plain(t):
    """A MONAI MetaTensor as a plain tensor (a plain tensor as it is)."""
    return t.as_tensor() if hasattr(t, "as_tensor") else t


@pytest.mark.parametrize("cache_rate, budget", [(1.0, None), (0.5, None), (1.0, 3 * 8**3 * 12)])
def test_ram_cache_equals_uncached(cache_rate, budget):
    base = Volumes()
    pipe = [Scale(3.0), clip_label]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ds = CacheDataset(base, pipe, cache_rate=cache_rate, num_workers=2, progress=False, budget_bytes=budget)
    expected = 3 if budget else math.ceil(cache_rate * 6)
    assert ds.num_cached == expected and (len(w) > 0) == (budget is not None)
    assert base.loads == expected
    for i in range(6):
        assert same(ds[i], T.apply(pipe, Volumes()[i]))
    assert base.loads == expected + (6 - expected)  # cached items are not reloaded


def test_ram_cache_matches_monai_and_reports_prefix():
    pytest.importorskip("monai")
    from monai.data import CacheDataset as MonaiCache
    from monai.transforms import Lambda

    base = Volumes(4)
    ds = CacheDataset(base, [Scale(0.5), clip_label, Noise(), Shift()], progress=False)
    ref = MonaiCache([base[i] for i in range(4)], Lambda(lambda d: clip_label(Scale(0.5)(d))), progress=False)
    for i in range(4):
        got = ds[i]
        want = Shift()(Noise()(ref[i], T.item_generator(0, 0, i)))  # the draws of (seed 0, epoch 0, item i)
        assert torch.equal(got["image"], _plain(want["image"]))
    epoch0 = ds[0]["image"]
    ds.set_epoch(1)  # the next epoch draws again, from (seed 0, epoch 1, item 0)
    assert not torch.equal(ds[0]["image"], epoch0)
    assert torch.equal(ds[0]["image"], _plain(Shift()(Noise()(dict(ref[0]), T.item_generator(0, 1, 0)))["image"]))
    rep = ds.report()
    assert "4/4 items cached" in rep and "2/4 transforms" in rep and "clip_label" in rep and "Noise" in rep


def test_persistent_invalidation_and_reuse(tmp_path):
    base = Volumes(3)
    ds = PersistentDataset(base, [Scale(2.0)], tmp_path)
    first = [ds[i] for i in range(3)]
    assert base.loads == 3 and len(list(tmp_path.glob("*.fvc"))) == 3
    again = PersistentDataset(base, [Scale(2.0)], tmp_path)
    assert all(same(again[i], first[i]) for i in range(3)) and base.loads == 3  # read from disk
    changed = PersistentDataset(base, [Scale(2.5)], tmp_path)  # a changed parameter: new keys
    assert torch.equal(changed[0]["image"], Volumes()[0]["image"] * 2.5) and base.loads == 4
    assert changed.path(0) != ds.path(0) and changed.path(0).read_bytes()[:4] == b"FVC1"


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_persistent_corrupt_entry_is_recomputed(tmp_path, damage):
    base = Volumes(2)
    ds = PersistentDataset(base, [Scale(2.0)], tmp_path)
    good = ds[1]
    p = ds.path(1)
    data = bytearray(p.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip":
        data[-5] ^= 0xFF
    else:
        data = bytearray(b"not a cache entry")
    p.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="corrupt"):
        again = ds[1]
    assert same(again, good) and ds.recomputed == 1
    assert same(PersistentDataset(base, [Scale(2.0)], tmp_path)[1], good)  # rewritten intact


class Named(Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return {"name": f"image{i + 1}"}


SEED_003 = [["image1", "image2", "image3", "image4"], ["image2", "image3", "image4", "image5"],
            ["image3", "image4", "image5", "image1"], ["image4", "image5", "image1", "image2"]]


def test_smart_cache_schedule_matches_seed_and_monai():
    """The windows are seed 003's and MONAI's; positions hold them in index order (MONAI's in its
    cache order: the sampler shuffles positions, so only the membership is the schedule)."""
    pytest.importorskip("monai")
    from monai.data import SmartCacheDataset as MonaiSmart

    ds = SmartCacheDataset(Named(), [], cache_num=4, replace_rate=0.25, progress=False)
    ref = MonaiSmart([{"name": f"image{i + 1}"} for i in range(5)], transform=None, cache_num=4,
                     replace_rate=0.25, shuffle=False, progress=False)
    ref.start()
    got, want = [], []
    for epoch in range(7):
        ds.set_epoch(epoch)
        got.append([ds[j]["name"] for j in range(len(ds))])
        want.append(sorted(ref[j]["name"] for j in range(len(ref))))  # image1..image5: name order is index order
        ref.update_cache()
    ref.shutdown()
    ds.shutdown()
    assert got[:4] == [sorted(w) for w in SEED_003] and got == want
    assert got[5] == got[0]  # period 5: epoch N starts at image[N % 5 + 1]


def test_a_smart_window_of_the_whole_set_serves_item_j_at_position_j():
    """With every item in the window (MONAI's default) the smart cache is indexed as the dataset,
    every epoch, so it serves what no cache serves (docs/CONTRACTS.md: caches are speed switches)."""
    ds = SmartCacheDataset(Volumes(5, size=2), [], cache_num=5, replace_rate=0.4, shuffle=True, seed=3,
                           progress=False)
    assert ds.order != sorted(ds.order)  # the seeded order is shuffled; the positions are not
    for epoch in (0, 1, 3):
        ds.set_epoch(epoch)
        assert [ds[j]["id"] for j in range(5)] == [f"case{i}" for i in range(5)]
    ds.shutdown()


def test_smart_cache_jumps_and_counts_prefix_runs():
    base = Volumes(7)
    ds = SmartCacheDataset(base, [Scale(2.0)], cache_num=3, replace_rate=0.4, progress=False)
    ds.set_epoch(5)  # jump: window computed directly
    assert [ds[j]["id"] for j in range(3)] == [f"case{(5 * 2 + j) % 7}" for j in range(3)]
    assert torch.equal(ds[0]["image"], Volumes()[3]["image"] * 2)
    ds.shutdown()


class Reads(Volumes):
    """Volumes that record the order of their reads."""

    def __init__(self, n: int, size: int = 2):
        super().__init__(n, size)
        self.order: list[int] = []

    def __getitem__(self, i):
        self.order.append(i)
        return super().__getitem__(i)


@pytest.mark.parametrize("n, world, rank, order", [(5, 1, 0, [0, 1, 2, 3, 4]), (7, 3, 1, [1, 4, 0, 2, 3, 5, 6]),
                                                   (4, 2, 0, [0, 2, 1, 3])])
def test_device_cache_is_indexed_as_its_source_whatever_the_fill_order(n, world, rank, order):
    """Item i of the cache is item i of the source on every rank; a rank only reads its own stripe
    first (ranks filling through one disk cache then read each other's entries)."""
    base = Reads(n)
    ds = DeviceCacheDataset(base, "cpu", order=fill_order(n, rank, world))
    assert base.order == order and len(ds) == n and ds.num_cached == n
    for epoch in (0, 2):
        ds.set_epoch(epoch)
        for i in range(n):
            assert ds[i]["id"] == f"case{i}" and torch.equal(ds[i]["image"], Volumes(n, 2)[i]["image"])
    assert base.order == order  # served from the cache


def test_ordered_map_keeps_order_bounds_look_ahead_and_stops_at_an_error():
    """Results come in the order asked whatever thread finishes first; no more than 2 x workers are
    computed ahead of the consumer; an error is raised at its item and unstarted items never run."""
    import threading
    import time

    lock, started, consumed, ahead = threading.Lock(), [], [0], []

    def slow(i):  # the early items take longest, so later ones finish first
        with lock:
            started.append(i)
            ahead.append(len(started) - consumed[0])
        time.sleep(0.002 * (12 - i))
        return i * i

    for r in ordered_map(slow, range(12), workers=3):
        assert r == consumed[0] ** 2
        consumed[0] += 1
    assert consumed[0] == 12 and sorted(started) == list(range(12)) and max(ahead) <= 6

    calls = []

    def fails(i):
        calls.append(i)
        if i == 3:
            raise ValueError("item 3")
        time.sleep(0.01)
        return i

    got = []
    with pytest.raises(ValueError, match="item 3"):
        for r in ordered_map(fails, range(40), workers=2):
            got.append(r)
    assert got == [0, 1, 2] and len(calls) <= 3 + 1 + 2 * 2  # at most the window past item 3
    assert list(ordered_map(lambda i: -i, [4, 1, 7], workers=1)) == [-4, -1, -7]


@pytest.mark.parametrize("budget", [None, 2 * (6**3 * 4 + 6**3 * 8) + 10])
def test_device_cache_filled_by_threads_equals_one_thread(budget):
    """Threads only read the source: the items, what is held and what overflows are one thread's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        one = DeviceCacheDataset(Volumes(7, size=6), "cpu", order=fill_order(7, 1, 2), budget_bytes=budget)
        base = Reads(7, size=6)
        many = DeviceCacheDataset(base, "cpu", order=fill_order(7, 1, 2), budget_bytes=budget, threads=3)
    held = 7 if budget is None else 2
    assert sorted(base.order) == sorted(fill_order(7, 1, 2)[:held]) and many.num_cached == one.num_cached == held
    assert [i for i in range(7) if many.host[i] is not None] == [i for i in range(7) if one.host[i] is not None]
    for i in range(7):
        assert same(many[i], one[i])


def test_gpu_cache_memory_guard_falls_back():
    base = Volumes(4, size=4)
    with pytest.warns(ResourceWarning, match="caching 2 items"):
        ds = DeviceCacheDataset(base, "cpu", budget_bytes=2 * (4**3 * 4 + 4**3 * 8) + 10)
    assert ds.num_cached == 2 and [ds[j]["id"] for j in range(4)] == [f"case{i}" for i in range(4)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cache_on_cuda():
    ds = DeviceCacheDataset(Volumes(4, size=4), "cuda")
    assert ds[0]["image"].is_cuda and ds.num_cached == 4


CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
from torch.utils.data import Dataset
from fastvision.data.cache.datasets import SharedCacheDataset, CacheDataset

class Big(Dataset):
    def __len__(self): return 16
    def __getitem__(self, i): return {"image": torch.full((1024, 1024), float(i))}  # 4 MiB each

def pss():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Pss:"):
            return int(line.split()[1])

def wait_for(*paths):
    deadline = time.monotonic() + 300
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"waited 300 s for {paths}"
        time.sleep(0.05)

rank, sync, shm = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
held, out = [], {}  # every phase's cache stays mapped to the end: later phases' deltas exclude it
for phase, mode, ranks in (("one", "shared", (0,)), ("two", "shared", (0, 1)), ("private", "private", (0, 1))):
    (sync / f"{phase}-start{rank}").touch()  # the phase before it has ended on both ranks
    wait_for(*(sync / f"{phase}-start{r}" for r in (0, 1)))
    if rank not in ranks:
        continue
    before = pss()
    if mode == "shared":
        ds = SharedCacheDataset(Big(), [], "pss", local_rank=rank, local_world_size=len(ranks), root=shm / phase,
                                progress=False)
    else:
        ds = CacheDataset(Big(), [], progress=False)
    held.append(ds)
    total = sum(float(ds[i]["image"].sum()) for i in range(16))  # touch every page
    assert total == sum(i * 1024 * 1024 for i in range(16))
    (sync / f"{phase}-ready{rank}").touch()
    wait_for(*(sync / f"{phase}-ready{r}" for r in ranks))
    time.sleep(0.3)
    out[phase] = pss() - before  # measured while every rank of the phase still maps its cache
    (sync / f"{phase}-measured{rank}").touch()
    wait_for(*(sync / f"{phase}-measured{r}" for r in ranks))
print(json.dumps(out), flush=True)
"""


def run_phases(shm: Path, sync: Path) -> list[dict[str, int]]:
    """Two processes, three phases one after the other (each phase's caches stay mapped, so a later
    phase's PSS growth is its own): rank 0 alone with a shared cache ("one"), both ranks sharing one
    cache ("two"), both with a private RAM cache ("private"). One process per rank for all three
    phases, not one per phase: each costs seconds of torch import."""
    sync.mkdir()
    try:
        # A fixed mmap threshold makes glibc return freed item buffers, so PSS measures the cache,
        # not allocator retention from computing the items.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), str(sync), str(shm)], stdout=subprocess.PIPE,
                                  text=True, env=env) for r in range(2)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        return [json.loads(o.strip().splitlines()[-1]) for o in outs]
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_shared_cache_pss_two_ranks(tmp_path):
    """Summed PSS growth of two ranks sharing the cache <= 1.2x one rank's; private copies ~2x."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    ranks = run_phases(shm / f"fvtest-{os.getpid()}", tmp_path / "sync")
    one, two, private = [ranks[0]["one"]], [r["two"] for r in ranks], [r["private"] for r in ranks]
    assert "one" not in ranks[1]
    cache_kib = 16 * 4096
    assert one[0] >= 0.9 * cache_kib
    print(f"PSS growth KiB: one rank {one}, two shared ranks {two}, two private {private}")
    assert sum(two) <= 1.2 * one[0], (one, two)
    assert sum(private) > 1.2 * one[0]  # the check can fail: per-rank copies double it
