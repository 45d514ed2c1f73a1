"""Loaders: batch order equals torch DataLoader's for the same sampler, independent of workers."""
from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from fastvision.data.loader import DevicePrefetcher, build_loader, epoch_sampler
from fastvision.errors import ConfigError


class Items(Dataset):
    """Dict items whose content is a function of the index; counts concurrent fetching threads."""

    def __init__(self, n: int, fail_at: int | None = None):
        self.n, self.fail_at = n, fail_at
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise ValueError(f"bad item {i}")
        with self.lock:
            self.threads.add(threading.current_thread().name)
        return {"image": torch.full((1, 2, 2), float(i)), "label": torch.tensor(i), "id": f"item{i}"}


def ids(batches) -> list[list[int]]:
    return [b["label"].tolist() for b in batches]


@pytest.mark.parametrize("kind, workers", [("threads", 0), ("threads", 1), ("threads", 3), ("processes", 0),
                                           ("processes", 2)])
@pytest.mark.parametrize("shuffle, drop_last", [(True, False), (True, True), (False, False)])
def test_order_matches_dataloader(kind, workers, shuffle, drop_last):
    ds = Items(23)
    ours = build_loader(ds, batch_size=4, shuffle=shuffle, loader=kind, num_workers=workers,
                        drop_last=drop_last, seed=7)
    for epoch in (0, 1):
        ours.set_epoch(epoch)
        ref_sampler = epoch_sampler(23, shuffle, seed=7)
        ref_sampler.set_epoch(epoch)
        ref = DataLoader(ds, batch_size=4, sampler=list(ref_sampler), drop_last=drop_last)
        got = list(ours)
        assert ids(got) == ids(ref) and len(got) == len(ours) == len(ref)
        assert got[0]["id"] == [f"item{i}" for i in ids(ref)[0]]


def test_epochs_differ_and_repeat():
    ld = build_loader(Items(16), batch_size=4, shuffle=True, seed=1)
    ld.set_epoch(0)
    a = ids(ld)
    ld.set_epoch(1)
    b = ids(ld)
    ld.set_epoch(0)
    assert ids(ld) == a != b
    assert sorted(sum(a, [])) == sorted(sum(b, [])) == list(range(16))


def test_repeats_and_external_sampler():
    sampler = [5, 3, 1, 0, 2]
    ld = build_loader(Items(8), batch_size=2, sampler=sampler, repeats=2)
    assert len(ld) == 6
    assert ids(ld) == [[5, 3], [5, 3], [1, 0], [1, 0], [2], [2]]
    assert ld.sampler is sampler


def test_threads_really_used_and_errors_propagate():
    ds = Items(40)
    list(build_loader(ds, batch_size=2, num_workers=3))
    assert ds.threads and all(t.startswith("fastvision-loader") for t in ds.threads)
    with pytest.raises(ValueError, match="bad item 9"):
        list(build_loader(Items(20, fail_at=9), batch_size=2, num_workers=2))


def test_early_break_then_restart():
    ld = build_loader(Items(100), batch_size=2, num_workers=2)
    for i, _ in enumerate(ld):
        if i == 3:
            break
    assert len(list(ld)) == 50


@pytest.mark.parametrize("kw, match", [({"loader": "fork"}, "data.loader"), ({"batch_size": 0}, "batch_size")])
def test_bad_options(kw, match):
    with pytest.raises(ConfigError, match=match):
        build_loader(Items(4), **{"batch_size": 2, **kw})


def test_prefetcher_cpu_passthrough():
    ld = build_loader(Items(6), batch_size=4)
    pf = DevicePrefetcher(ld, torch.device("cpu"))
    assert ids(pf) == [[0, 1, 2, 3], [4, 5]] and len(pf) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefetcher_cuda_pinned():
    ld = build_loader(Items(9), batch_size=4, shuffle=True, pin_memory=True)
    out = list(DevicePrefetcher(ld, torch.device("cuda")))
    assert all(b["image"].is_cuda for b in out)
    ref = [b["image"] for b in build_loader(Items(9), batch_size=4, shuffle=True)]
    assert all(torch.equal(o["image"].cpu(), r) for o, r in zip(out, ref, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefetcher_orders_batches_already_on_the_gpu():
    """GPU-cache batches are written by kernels on the current stream; the side stream waits for them.

    A long matmul chain delays each write on the current stream; a prefetcher that read without
    waiting would copy (``to_device`` makes a new tensor here) stale zeros.
    """
    dev = torch.device("cuda")
    big = torch.randn(2048, 2048, device=dev)

    def batches():
        for i in range(4):
            x = torch.zeros(64, device=dev)
            y = big
            for _ in range(20):  # keep the current stream busy before the write
                y = y @ big / 2048 ** 0.5
            x.add_(i + 1 + 0 * y[0, :64])  # the value only exists once the chain has run
            yield {"image": x}

    class Loader:
        def __iter__(self):
            return batches()

        def __len__(self):
            return 4

    copy = lambda b, d: {"image": b["image"].clone()}  # noqa: E731  (a new tensor made on the side stream)
    out = [b["image"] for b in DevicePrefetcher(Loader(), dev, copy)]
    assert [float(o.mean()) for o in out] == [1.0, 2.0, 3.0, 4.0]
