"""Shard sets in S3, from a real local S3 server (moto's ``ThreadedMotoServer`` on 127.0.0.1, its
endpoint given by ``AWS_ENDPOINT_URL`` as a user would): the items are the local folder's, each
shard is fetched once into the node-local cache, a missing object and a missing s3fs are one line
naming the URL. Skipped when moto, boto3 or s3fs is not installed (``pip install -e ".[test]"``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fastvision.data.formats.shard_sets import build_shards
from fastvision.data.shards.writer import write_shards
from fastvision.data.synth import load_all
from fastvision.errors import DataError
from fastvision.registry import DATASETS

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")

ITEM = {"image_size": 24, "resize_size": 28}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """``(bucket client, local shard folder)``; the set is uploaded under ``s3://data/sets/out``."""
    root = tmp_path_factory.mktemp("s3")
    src = load_all().get("imagenet")(root / "src", seed=0, classes=2, per_class=6, val_per_class=1, size=32)
    write_shards(src, root / "out", "14KB")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.delenv("AWS_PROFILE", raising=False)
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
        client.create_bucket(Bucket="data")
        for p in sorted((root / "out").rglob("*")):
            if p.is_file():
                client.upload_file(str(p), "data", f"sets/out/{p.relative_to(root / 'out')}")
        yield client, root
    server.stop()


def test_items_from_s3_are_the_folders_and_each_shard_is_fetched_once(s3, tmp_path):
    _, root = s3
    local = build_shards(str(root / "out"), "imagefolder", ITEM)
    cache = {"shard_cache_dir": str(tmp_path / "cache")}
    remote = DATASETS.build("imagefolder", {"path": "s3://data/sets/out", **ITEM, **cache})  # --data s3://...
    for split in ("train", "val"):
        a, b = getattr(remote, split), getattr(local, split)
        assert len(a) == len(b) > 0
        for i in range(len(a)):
            assert torch.equal(a[i]["image"], b[i]["image"]) and int(a[i]["label"]) == int(b[i]["label"])
    fetched = remote.train.reader.store.downloads
    assert fetched == len(local.train.reader.shards) + len(local.val.reader.shards) > 3
    again = build_shards("s3://data/sets/out", "imagefolder", ITEM, **cache).train  # another rank: the cache
    again[0], again[len(again) - 1]
    assert again.reader.store.downloads == 0


def test_a_missing_object_is_one_line_naming_it(s3, tmp_path):
    client, root = s3
    ds = build_shards("s3://data/sets/out", "imagefolder", ITEM, shard_cache_dir=str(tmp_path / "c")).train
    body = (root / "out" / "train-000001.tar").read_bytes()
    client.delete_object(Bucket="data", Key="sets/out/train-000001.tar")
    try:
        with pytest.raises(DataError) as e:
            ds[ds.reader.starts[1]]
    finally:
        client.put_object(Bucket="data", Key="sets/out/train-000001.tar", Body=body)
    assert str(e.value) == "s3://data/sets/out/train-000001.tar: S3 error after 1 tries (no such object)"
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"^s3://data/nothing/shards.json: S3 error after 1 tries \(no such object\); "
                                        r"not a TFRecord folder either: s3://data/nothing/ lists no TFRecord files"):
        build_shards("s3://data/nothing", "imagefolder", ITEM, shard_cache_dir=str(tmp_path / "c"))


def test_without_s3fs_the_error_names_the_url_and_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs now raises ImportError
    with pytest.raises(DataError, match=r"^s3://data/sets/out: s3:// URLs need the s3fs package"):
        build_shards("s3://data/sets/out", "imagefolder", ITEM, shard_cache_dir=str(tmp_path / "c"))


def test_tfrecords_in_s3_are_the_local_folders_items(s3, tmp_path):
    pytest.importorskip("tfrecord")
    from tests.data.test_shards_tfrecord import write_tfrecord_set

    client, _ = s3
    out, _ = write_tfrecord_set(tmp_path)
    for p in sorted(Path(out).iterdir()):
        client.upload_file(str(p), "data", f"tfr/{p.name}")
    args = {"image_size": 24, "resize_size": 28, "shard_cache_dir": str(tmp_path / "cache")}
    local, remote = (DATASETS.build("imagefolder", {"path": path, **args}) for path in (str(out), "s3://data/tfr"))
    assert len(remote.train) == len(local.train) == 6 and len(remote.val) == len(local.val) == 2
    for i in range(6):
        assert torch.equal(remote.train[i]["image"], local.train[i]["image"])
        assert int(remote.train[i]["label"]) == int(local.train[i]["label"])
