"""data.cache through the engine: cached training is bit-identical to uncached, the disk cache's
second run reads its entries, random datasets are refused, the gpu cache holds every item (under
DDP too) and refuses worker processes."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import fastvision
from fastvision.data.cache.select import (
    cache_source,
    dataset_signature,
    item_identity,
    wrap_train_set,
)
from fastvision.data.loader import build_loader
from fastvision.distributed import DistEnv
from fastvision.errors import ConfigError
from tests.conftest import tiny_overrides


class Counted(Dataset):
    """Deterministic items; ``reads`` counts ``__getitem__`` calls, ``scale`` is a setting."""

    def __init__(self, n: int = 6, scale: float = 1.0):
        self.n, self.scale, self.reads = n, scale, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        g = torch.Generator().manual_seed(i)
        return {"image": torch.rand(1, 4, 4, generator=g) * self.scale, "label": torch.full((4, 4), i % 2),
                "id": f"item{i}"}

    def identity(self, i):
        return f"item{i}"


class Noisy(Counted):
    def __getitem__(self, i):
        return {"image": torch.rand(1, 4, 4), "label": torch.zeros(4, 4, dtype=torch.long), "id": str(i)}


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def test_cached_training_is_bit_identical_and_disk_rerun_reads_entries(tiny_microscopy, tmp_path):
    runs = {}
    cache_dir = tmp_path / "cache"
    for name, cache in [("none", "none"), ("ram", "ram"), ("disk1", "disk"), ("disk2", "disk")]:
        if name == "disk2":  # entries written by the first disk run, with their times
            before = {p.name: p.stat().st_mtime_ns for p in cache_dir.glob("*.fvc")}
        fastvision.train("unet2d-microscopy", out=str(tmp_path / name),
                         **tiny_overrides(tiny_microscopy, **{"data.cache": cache, "data.cache_dir": str(cache_dir)}))
        runs[name] = _weights(tmp_path / name)
    after = {p.name: p.stat().st_mtime_ns for p in cache_dir.glob("*.fvc")}
    assert len(before) == 16  # 13 training + 3 validation items (val_fraction 0.2): both cached on disk
    assert after == before  # the second run hit every entry: nothing recomputed or rewritten
    for name in ("ram", "disk1", "disk2"):
        assert runs[name].keys() == runs["none"].keys()
        for k, v in runs["none"].items():
            assert torch.equal(runs[name][k], v), (name, k)


def test_disk_cache_second_wrap_reads_no_item_and_a_setting_invalidates(tmp_path):
    first = Counted()
    a = wrap_train_set(first, cache="disk", cache_dir=str(tmp_path))
    items = [a[i] for i in range(len(a))]
    base_reads = first.reads
    second = Counted()
    b = wrap_train_set(second, cache="disk", cache_dir=str(tmp_path))
    again = [b[i] for i in range(len(b))]
    assert second.reads == 0 and base_reads == 6 + 2  # + the determinism check
    assert all(torch.equal(x["image"], y["image"]) and x["id"] == y["id"] for x, y in zip(items, again, strict=True))
    changed = Counted(scale=2.0)  # a different setting: new signature, new entries
    c = wrap_train_set(changed, cache="disk", cache_dir=str(tmp_path))
    assert torch.equal(c[3]["image"], items[3]["image"] * 2) and changed.reads == 2 + 1  # check + miss
    assert dataset_signature(Counted()) != dataset_signature(changed)


def test_ram_cache_reports_prefix_and_reads_once():
    ds = Counted()
    cached = wrap_train_set(ds, cache="ram")
    ds.reads = 0
    out = [cached[i] for i in range(6)]
    assert ds.reads == 0 and cached.num_cached == 6
    assert torch.equal(out[2]["image"], Counted()[2]["image"])
    assert "6/6 items cached" in cached.report() and "Counted.__getitem__" in cached.report()


@pytest.mark.parametrize("cache, kw, said", [
    ("gpu", {"cache_rate": 0.5}, "data.cache_rate 0.5: not read by data.cache gpu, which holds every item"),
    ("none", {"cache_rate": 0.5, "cache_num": 2},
     "data.cache_rate 0.5 and data.cache_num 2: not read by data.cache none"),
    ("ram", {"cache_num": 2}, "data.cache_num 2: not read by data.cache ram"),
    ("ram", {"cache_rate": 0.5}, None),  # ram holds that share
    ("smart", {"cache_rate": 0.5, "cache_num": 2}, None),  # the window
])
def test_cache_rate_or_num_a_tier_does_not_read_is_one_warning(cache, kw, said, caplog):
    caplog.set_level("WARNING", logger="fastvision.data.cache.select")
    out = wrap_train_set(Counted(), cache=cache, **kw)
    lines = [r.getMessage() for r in caplog.records if "not read by data.cache" in r.getMessage()]
    assert lines == ([] if said is None else [lines[0]]) and (said is None or lines[0].startswith(said))
    if cache == "ram":  # what ram holds: that share of the items
        assert out.num_cached == int(6 * kw.get("cache_rate", 1.0))


def test_random_dataset_is_refused_not_frozen():
    with pytest.raises(ConfigError, match="different item on every read"):
        wrap_train_set(Noisy(), cache="ram")


def test_disk_without_identity_and_unknown_cache_are_config_errors(tmp_path):
    class NoId(Counted):
        identity = None

    with pytest.raises(ConfigError, match="identity"):
        wrap_train_set(NoId(), cache="disk", cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="data.cache must be one of"):
        wrap_train_set(Counted(), cache="lmdb")


@pytest.mark.parametrize("options", [{}, {"cache_rate": 0.5}, {"cache_num": 4}, {"cache_num": 4, "cache_rate": 0.5},
                                     {"cache_num": 10}])
def test_smart_cache_defaults_are_monais(options):
    """``data.cache: smart`` alone works: MONAI SmartCacheDataset's defaults (cache_num unlimited, so
    cache_rate 1.0 of the items; replace_rate 0.1), and the window it would hold."""
    from monai.data import SmartCacheDataset as MonaiSmartCache

    ref = MonaiSmartCache(list(range(6)), transform=None, progress=False, **options)
    smart = wrap_train_set(Counted(n=6), cache="smart", **options)
    try:
        assert smart.cache_num == ref.cache_num
    finally:
        smart.shutdown()


def test_smart_cache_window_moves_with_set_epoch():
    smart = wrap_train_set(Counted(n=5), cache="smart", cache_num=2, replace_rate=0.5, seed=0)
    loader = build_loader(smart, batch_size=2, loader="threads", num_workers=1)
    ids = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        ids.append([i for b in loader for i in b["id"]])
    order = smart.order
    # seed 003 schedule: window e starts at e * ceil(2 * 0.5) in the (seeded) order; positions
    # hold the window in index order
    assert ids == [[f"item{i}" for i in sorted(order[(e + j) % 5] for j in range(2))] for e in range(3)]
    smart.shutdown()


@pytest.mark.parametrize("cache", ["gpu", "ram"])
def test_ddp_memory_caches_hold_every_item_indexed_as_the_dataset(cache):
    """Under DDP a rank reads a different share of the items every epoch (the sampler's global
    permutation), so its cache holds all of them, item i at index i: no per-rank partition and no
    order of its own (which changed the samples of every step)."""
    n, world = 7, 2
    for rank in range(world):
        base = Counted(n=n)
        env = DistEnv(rank=rank, local_rank=0, world_size=world, local_world_size=1)
        ds = wrap_train_set(base, cache=cache, env=env, device="cpu", seed=3)
        reads = base.reads
        assert len(ds) == n and not getattr(ds, "rank_local", False)
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            assert [ds[i]["id"] for i in range(n)] == [f"item{i}" for i in range(n)]
            assert all(torch.equal(ds[i]["image"], Counted()[i]["image"]) for i in range(n))
        assert base.reads == reads  # served from the cache


def test_gpu_cache_refuses_worker_processes():
    ds = wrap_train_set(Counted(n=7), cache="gpu", device="cpu", seed=3)
    with pytest.raises(ConfigError, match="data.loader: threads"):
        build_loader(ds, batch_size=2, loader="processes", num_workers=2)
    assert len(build_loader(ds, batch_size=2, loader="processes", num_workers=0)) == 4


def test_cpu_partition_over_budget_holds_only_what_fits():
    """A CPU cache over its memory budget keeps the items that fit and reads the rest from the
    source on each access (holding them anyway would use the memory the guard refused)."""
    from fastvision.data.cache.device import DeviceCacheDataset

    src = Counted(n=5)
    per_item = 4 * 4 * 4 + 4 * 4 * 8  # float32 image + int64 label
    with pytest.warns(ResourceWarning, match="caching 2 items"):
        ds = DeviceCacheDataset(src, "cpu", budget_bytes=2 * per_item + 1)
    assert ds.num_cached == 2 and sum(x is not None for x in ds.host) == 2 and src.reads == 2
    got = {ds[j]["id"]: ds[j] for j in range(len(ds))}
    for i in range(5):
        assert torch.equal(got[f"item{i}"]["image"], Counted()[i]["image"])
    assert src.reads == 2 + 2 * 3  # the three that did not fit: read at each of the two accesses


def test_microscopy_items_are_named_by_their_files(tiny_microscopy):
    import fastvision.data.formats  # noqa: F401, E401  (register)
    from fastvision.registry import DATASETS
    train = DATASETS.build("microscopy", {"path": str(tiny_microscopy), "image_size": [32, 32]}, where="t").train
    base, pipeline, identity = cache_source(train)
    assert len(base) == len(train) and identity is not None and item_identity(train) is not None
    name = identity(0)
    img = Path(train.pairs[0][0])
    st = img.stat()
    os.utime(img, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # file replaced in place
    try:
        assert identity(0) != name and identity(1) == item_identity(train)(1)
    finally:
        os.utime(img, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert pipeline[0](base[2])["id"] == train[2]["id"]


def test_volume_dataset_has_a_disk_cache_identity(tmp_path, monkeypatch):
    """3-D datasets cache through cache_pipeline(); their file identity must still reach the disk cache."""
    import fastvision.data.formats  # noqa: F401, E401  (register)
    from fastvision.data.cache.select import cache_source
    from fastvision.data.synth.medical import synth_spleen
    from fastvision.registry import DATASETS
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "cache"))
    root = synth_spleen(tmp_path / "spleen", cases=5, test_cases=0, size=24)
    splits = DATASETS.build("decathlon", {"path": str(root), "patch_size": None})
    _, _, identity = cache_source(splits.train)
    assert identity is not None and str(root) in identity(0)


@pytest.mark.parametrize("cache", ["ram", "disk"])
def test_cached_validation_items_are_the_evaluation_view(tmp_path, cache):
    """A cached validation set returns ``dataset[i]`` (resize + centre crop), never the training
    view of ``cache_pipeline`` (ImageFolder's is a random-resized crop)."""
    from fastvision.data.cache.select import wrap_val_set
    from fastvision.data.formats.imagefolder import (
        ImageFolderDataset,
        find_classes,
        list_samples,
    )
    from fastvision.data.synth.imagenet import synth

    synth(tmp_path / "inet", classes=2, per_class=1, val_per_class=2, size=48)
    val = tmp_path / "inet" / "val"
    ds = ImageFolderDataset(list_samples(val, find_classes(val)), False, image_size=32, resize_size=40)
    wrapped = wrap_val_set(ds, cache=cache, cache_dir=str(tmp_path / "cache"))
    assert len(wrapped) == len(ds) == 4
    for i in range(len(ds)):
        for _ in range(2):  # first read fills, second reads the cache
            assert torch.equal(wrapped[i]["image"], ds[i]["image"])
            assert int(wrapped[i]["label"]) == int(ds[i]["label"])


def _read_only(monkeypatch, folder: Path) -> None:
    """``folder`` refuses new files, as a read-only mount or another user's folder does (root ignores
    chmod, so the refusal is made where files are created when the test runs as root)."""
    if os.geteuid() != 0:
        folder.chmod(0o500)
        return
    import tempfile

    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):  # noqa: A002 - tempfile's own keyword
        if dir is not None and Path(dir) == folder:
            raise PermissionError(13, "Permission denied", str(folder))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


@pytest.mark.parametrize("cache", ["disk", "ram", "gpu"])
@pytest.mark.parametrize("place", ["under a file", "read-only"])
def test_a_cache_dir_that_takes_no_entries_is_one_config_error_at_build(tmp_path, monkeypatch, cache, place):
    """Before, the build passed and the first entry written (mid-epoch, after the run folder was made) raised
    an OSError naming a temp file, or a traceback; now the wrap names data.cache_dir before any entry."""
    if place == "under a file":
        (tmp_path / "f").write_text("x")
        folder = tmp_path / "f" / "cache"
    else:
        folder = tmp_path / "ro"
        folder.mkdir()
        _read_only(monkeypatch, folder)
    with pytest.raises(ConfigError, match=r"data\.cache_dir: cannot write cache entries in .*(ro|cache)"):
        wrap_train_set(Counted(), cache=cache, cache_dir=str(folder))
    writable = tmp_path / "ok"
    a = wrap_train_set(Counted(), cache=cache, cache_dir=str(writable))
    assert torch.equal(a[1]["image"], Counted()[1]["image"]) and not list(writable.glob(".write-probe.*"))


@pytest.mark.parametrize("cache", ["disk", "ram"])
def test_a_read_only_cache_dir_that_holds_every_entry_is_read(tmp_path, monkeypatch, cache):
    """A cache prepared once and shared read-only: nothing to write, so it serves its entries (no item
    preprocessed again) instead of being refused."""
    folder = tmp_path / "shared"
    first = wrap_train_set(Counted(), cache=cache, cache_dir=str(folder))
    want = [first[i]["image"] for i in range(6)]  # every entry written
    entries = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.fvc")}
    _read_only(monkeypatch, folder)
    again = Counted()
    b = wrap_train_set(again, cache=cache, cache_dir=str(folder))
    reads = again.reads  # the determinism check's, where the cache makes one
    assert all(torch.equal(b[i]["image"], want[i]) for i in range(6)) and again.reads == reads
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("*.fvc")} == entries
