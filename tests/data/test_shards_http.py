"""Shard sets over HTTP, from a ``http.server`` on 127.0.0.1 started by the test: items as from the
folder, one download per shard for all readers of a node, LRU eviction under the size limit, and
HTTP errors, timeouts, checksum mismatches and a full cache as one line naming the URL; a folder of
TFRecords (no index: found by the server's directory listing) read through the same cache, and
``data inspect`` of both kinds from a URL."""
from __future__ import annotations

import collections
import contextlib
import functools
import http.server
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from fastvision.data.formats.shard_sets import build_shards
from fastvision.data.inspect import inspect_path
from fastvision.data.shards.writer import write_shards
from fastvision.data.synth import load_all
from fastvision.errors import DataError
from fastvision.registry import DATASETS

ITEM = {"image_size": 24, "resize_size": 28}


class _Handler(http.server.SimpleHTTPRequestHandler):
    gets: collections.Counter = collections.Counter()
    delay = 0.0
    fail: dict[str, int] = {}  # path -> HTTP status to answer

    def do_GET(self):
        type(self).gets[self.path] += 1
        if self.path in self.fail:
            self.send_error(self.fail[self.path])
            return
        time.sleep(self.delay)
        super().do_GET()

    def copyfile(self, source, outputfile):
        try:
            super().copyfile(source, outputfile)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            pass

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("http")
    src = load_all().get("imagenet")(root / "src", seed=0, classes=2, per_class=6, val_per_class=1, size=32)
    write_shards(src, root / "out", "14KB")
    return root / "out"


@contextlib.contextmanager
def serve(directory: Path, port: int = 0):
    """``http://127.0.0.1:PORT`` serving ``directory`` (GETs counted in ``_Handler.gets``)."""
    _Handler.gets.clear()
    _Handler.delay, _Handler.fail = 0.0, {}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(_Handler, directory=str(directory)))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@pytest.fixture
def server(shard_dir):
    with serve(shard_dir) as url:
        yield url


def _split(url: str, cache: Path, **kw):
    return build_shards(url, "imagefolder", ITEM, shard_cache_dir=str(cache), **kw)


def test_items_over_http_are_the_folders_and_each_shard_is_downloaded_once(server, shard_dir, tmp_path):
    local = build_shards(str(shard_dir), "imagefolder", ITEM)
    a, b = _split(server, tmp_path / "c"), _split(server, tmp_path / "c")  # two ranks of one node
    n = len(local.train)
    threads = [threading.Thread(target=lambda d=d: [d.train[i] for i in range(n)]) for d in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tars = {p: c for p, c in _Handler.gets.items() if p.endswith(".tar")}
    assert len(tars) == len(local.train.reader.shards) > 3 and set(tars.values()) == {1}
    assert a.train.reader.store.downloads + b.train.reader.store.downloads == len(tars)
    for i in (0, n // 2, n - 1):
        assert torch.equal(a.train[i]["image"], local.train[i]["image"]) and a.train[i]["id"] == local.train[i]["id"]


def test_the_cache_keeps_its_limit_by_evicting_the_least_recently_used(server, shard_dir, tmp_path):
    sizes = [s["filesize"] for s in json.loads((shard_dir / "shards.json").read_text())["splits"]["train"]["shardlist"]]
    limit = 2 * max(sizes) + min(sizes) // 2  # room for two shards
    ds = _split(server, tmp_path / "c", shard_cache_gb=limit / 1e9).train
    ds.reader.keep_open = 1
    for i in range(len(ds)):
        ds[i]
    cached = sorted(p.name for p in ds.reader.store.cache.glob("*.tar"))
    last_two = sorted(s.url for s in ds.reader.shards[-2:])
    assert cached == last_two and sum((ds.reader.store.cache / c).stat().st_size for c in cached) <= limit
    ds[0]  # evicted: fetched again
    assert _Handler.gets[f"/{ds.reader.shards[0].url}"] == 2


def test_http_errors_are_retried_a_bounded_number_of_times_then_named(server, tmp_path):
    _Handler.fail = {"/train-000001.tar": 503}
    ds = _split(server, tmp_path / "c", shard_retries=2).train
    with pytest.raises(DataError, match=r"train-000001.tar: HTTP error after 3 tries"):
        ds[ds.reader.starts[1]]
    assert _Handler.gets["/train-000001.tar"] == 3
    _Handler.fail = {"/shards.json": 404}  # missing stays missing: not retried
    with pytest.raises(DataError, match=r"shards.json: HTTP error after 1 tries"):
        _split(server, tmp_path / "c")


def test_a_timeout_is_retried_then_named(server, tmp_path):
    ds = _split(server, tmp_path / "c", shard_retries=1, shard_timeout_s=0.3).train
    _Handler.delay = 1.0
    with pytest.raises(DataError, match=r"train-000000.tar: HTTP error after 2 tries \(.*timed out"):
        ds[0]
    assert not [p for p in ds.reader.store.cache.iterdir() if not p.name.endswith(".lock")]


def test_a_checksum_mismatch_or_a_full_cache_is_named_and_nothing_is_kept(server, shard_dir, tmp_path):
    full = _split(server, tmp_path / "c", shard_cache_gb=1e-6).train  # 1 kB: no shard fits
    with pytest.raises(DataError, match=r"train-000000.tar: shard cache .* full: the shard needs"):
        full[0]
    ds = _split(server, tmp_path / "d").train
    path = shard_dir / ds.reader.shards[0].url
    good = path.read_bytes()
    try:
        path.write_bytes(good[:600] + bytes([good[600] ^ 0xFF]) + good[601:])
        with pytest.raises(DataError, match=r"train-000000.tar: checksum mismatch"):
            ds[0]
        assert not [p for p in ds.reader.store.cache.iterdir() if not p.name.endswith(".lock")]
        path.write_bytes(good[:-1024])  # truncated on the server: its size is named, not a checksum
        with pytest.raises(DataError, match=rf"train-000000.tar: {len(good) - 1024} bytes arrived, expected "
                                            rf"{len(good)}: a truncated transfer"):
            ds[0]
        assert not [p for p in ds.reader.store.cache.iterdir() if not p.name.endswith(".lock")]
    finally:
        path.write_bytes(good)


def test_tfrecords_over_http_are_the_local_folders_items_through_the_cache(tmp_path, monkeypatch):
    pytest.importorskip("tfrecord")
    from tests.data.test_shards_tfrecord import write_tfrecord_set

    out, _ = write_tfrecord_set(tmp_path)
    args = {"image_size": 24, "resize_size": 28, "shard_cache_dir": str(tmp_path / "cache")}
    local = DATASETS.build("imagefolder", {"path": str(out), **args})
    with serve(out) as url:
        remote = DATASETS.build("imagefolder", {"path": url, **args})  # no shards.json: the listing's TFRecords
        files = {p: c for p, c in _Handler.gets.items() if "-of-" in p}
        again = DATASETS.build("imagefolder", {"path": url, **args})  # another rank of the node: the cache
        assert sorted(files) == sorted(f"/{p.name}" for p in out.iterdir()) and set(files.values()) == {1}
        assert {p: c for p, c in _Handler.gets.items() if "-of-" in p} == files
        monkeypatch.setenv("HOME", str(tmp_path / "home"))  # inspect's default cache
        assert inspect_path(url)["val"] == "2 records in 1 readable file(s)"
    for split in ("train", "val"):
        a, b, c = getattr(remote, split), getattr(local, split), getattr(again, split)
        assert len(a) == len(b) == len(c) > 0
        for i in range(len(a)):
            assert torch.equal(a[i]["image"], b[i]["image"]) and int(a[i]["label"]) == int(b[i]["label"])
            assert torch.equal(c[i]["image"], b[i]["image"])


def test_a_url_with_neither_an_index_nor_tfrecords_is_one_line(tmp_path):
    (tmp_path / "x.txt").write_text("not a dataset")
    with serve(tmp_path) as url, pytest.raises(DataError) as e:
        DATASETS.build("imagefolder", {"path": url, "shard_cache_dir": str(tmp_path / "c")})
    assert str(e.value) == (f"{url}/shards.json: HTTP error after 1 tries (File not found); not a TFRecord folder "
                            f"either: {url}/ lists no TFRecord files (train-*-of-*, validation-*-of-*)")


def test_data_inspect_reports_a_shard_set_from_its_url(server, shard_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    remote, local = inspect_path(server), inspect_path(shard_dir)
    assert remote["layout"] == local["layout"] == "shards" and remote["path"] == server
    assert {k: v for k, v in remote.items() if k != "path"} == {k: v for k, v in local.items() if k != "path"}


def test_a_set_rewritten_at_the_same_url_is_fetched_again_not_read_from_the_stale_cache(tmp_path):
    site, port, make = tmp_path / "site", 0, load_all().get("imagenet")
    for seed in (0, 1):  # the same URL and names (train-000000.tar, ...), other images: not seed 0's from the cache
        src = make(tmp_path / f"src{seed}", seed=seed, classes=2, per_class=6, val_per_class=1, size=32)
        for old in site.glob("*"):
            old.unlink()
        write_shards(src, site, "14KB")
        with serve(site, port) as url:
            port = int(url.rsplit(":", 1)[1])
            remote, local = _split(url, tmp_path / "c"), build_shards(str(site), "imagefolder", ITEM)
            items = [(remote.train[i], local.train[i]) for i in range(len(local.train))]
        assert all(torch.equal(a["image"], b["image"]) and a["label"] == b["label"] for a, b in items)
        assert remote.train.reader.store.downloads == len(local.train.reader.shards)


@pytest.mark.parametrize("args, message", [
    ({"shard_cache_gb": -1}, "data.args.shard_cache_gb: a positive number of GB, got -1"),
    ({"shard_retries": -1}, "data.args.shard_retries: 0 or more, got -1"),  # was an AssertionError traceback
    ({"shard_timeout_s": 0}, "data.args.shard_timeout_s: a positive number of seconds, got 0"),
    ({"shard_window": 0}, "data.args.shard_window: at least 1, got 0"),
    ({"shard_cache_dir": "FILE/x"}, "data.args.shard_cache_dir: cannot make the shard cache"),
])
def test_shard_arguments_out_of_range_are_one_line_when_the_set_is_built(server, tmp_path, args, message):
    """Before, these failed only at the first shard fetched (the run folder made, a step begun): a cache
    limit below 0 as 'cache full', a file as the cache as 'Not a directory', 0 s as an EINPROGRESS error."""
    from fastvision.errors import ConfigError

    (tmp_path / "FILE").write_text("a file")
    args = {"shard_cache_dir": str(tmp_path / "c"), **args}
    args["shard_cache_dir"] = args["shard_cache_dir"].replace("FILE", str(tmp_path / "FILE"))
    _Handler.gets.clear()
    with pytest.raises(ConfigError) as e:
        DATASETS.build("imagefolder", {"path": server, **ITEM, **args})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert not [p for p in _Handler.gets if p.endswith(".tar")]


def test_the_cache_limit_holds_for_every_set_in_the_cache_together(shard_dir, tmp_path):
    """Each set (URL) evicted only its own copies, so two sets in one shard_cache_dir held twice the limit."""
    sizes = [s["filesize"] for s in json.loads((shard_dir / "shards.json").read_text())["splits"]["train"]["shardlist"]]
    limit = 2 * max(sizes) + min(sizes) // 2  # room for two shards in all
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "mine.bin").write_bytes(b"\0" * 4096)  # a user's file beside: not the cache's to evict
    with serve(shard_dir) as one, serve(shard_dir) as two:  # two URLs of the set: two sets to the cache
        for url in (one, two):
            ds = _split(url, tmp_path / "c", shard_cache_gb=limit / 1e9).train
            ds.reader.keep_open = 1
            for i in range(len(ds)):
                ds[i]
    cached = [p for p in (tmp_path / "c").rglob("*.tar")]
    assert len({p.parent for p in cached}) == 1 and sum(p.stat().st_size for p in cached) <= limit
    assert (tmp_path / "c" / "mine.bin").stat().st_size == 4096
