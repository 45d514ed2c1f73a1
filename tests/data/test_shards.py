"""Shard sets: the writer's bytes, webdataset reading them, items as from files, the shard-aware
order under the sampler (any world size, mid-epoch starts), and each kind of bad shard."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from fastvision.data.formats.coco import build as coco_folder
from fastvision.data.formats.imagefolder import ImageFolderDataset, RandomResizedCrop, list_samples
from fastvision.data.formats.shard_sets import build_shards
from fastvision.data.shards import tario
from fastvision.data.shards.reader import shard_order
from fastvision.data.shards.writer import write_shards
from fastvision.data.synth import load_all
from fastvision.distributed.samplers import TrainSampler
from fastvision.errors import DataError
from fastvision.registry import DATASETS
from tests.conftest import ROOT, clean_env

SIZE = "12KB"  # 3 tiny JPEG samples a shard


@pytest.fixture(scope="module")
def inet(tmp_path_factory) -> Path:
    return load_all().get("imagenet")(tmp_path_factory.mktemp("inet") / "src", seed=0, classes=3, per_class=6,
                                      val_per_class=2, size=32)


@pytest.fixture(scope="module")
def shards(inet, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "out"
    write_shards(inet, out, SIZE)
    return out


def _index(out: Path) -> dict:
    return json.loads((out / "shards.json").read_text())


def test_the_writer_is_deterministic_and_webdataset_reads_the_files_as_they_are(inet, shards, tmp_path):
    again = write_shards(inet, tmp_path / "again", SIZE)
    files = sorted(p.name for p in shards.iterdir() if p.suffix == ".tar")
    assert len(files) > 3 and files == sorted(p.name for p in (tmp_path / "again").iterdir() if p.suffix == ".tar")
    assert all((shards / f).read_bytes() == (tmp_path / "again" / f).read_bytes() for f in files)
    assert (shards / "shards.json").read_bytes() == (tmp_path / "again" / "shards.json").read_bytes()
    wds = pytest.importorskip("webdataset")

    urls = [str(shards / s.url) for s in again.splits["train"]]
    got = {s["id"].decode(): (s["jpeg"], int(s["cls"])) for s in wds.WebDataset(urls, shardshuffle=False)}
    classes = sorted(p.name for p in (inet / "train").iterdir())
    expect = {os.path.relpath(p, inet): (Path(p).read_bytes(), c) for p, c in list_samples(inet / "train", classes)}
    assert got == expect  # every file once, byte for byte, with its class
    with tarfile.open(shards / files[0]) as tf:  # the member table against Python's tar reader
        assert tario.scan(shards / files[0], files[0], True)[0] == {m.name: (m.offset_data, m.size) for m in tf}


def test_an_interrupted_write_continues_and_never_rewrites_a_finished_shard(inet, shards, tmp_path):
    out = tmp_path / "cut"
    write_shards(inet, out, SIZE)
    kept = out / "train-000000.tar"
    stat = kept.stat()
    (out / "train-000002.tar").unlink()  # killed before it was renamed into place ...
    (out / ".train-000002.tar.tmp999").write_bytes(b"partial")  # ... leaving its partial temporary file
    (out / "shards.json").unlink()
    write_shards(inet, out, SIZE)
    assert kept.stat().st_ino == stat.st_ino and kept.stat().st_mtime_ns == stat.st_mtime_ns
    assert not list(out.glob(".*tmp*"))
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in shards.iterdir() if p.is_file())
    with open(out / "train-000001.tar", "ab") as f:  # a shard that is not what this input makes: refused
        f.write(b"\0" * 512)
    with pytest.raises(DataError, match="train-000001.tar.*source or --shard-size changed"):
        write_shards(inet, out, SIZE)


def test_shard_order_is_a_permutation_in_windows_of_shards_from_the_generator():
    counts = [3, 4, 2, 5, 3]
    starts = [0, 3, 7, 9, 14]
    shard_of = lambda i: max(k for k, s in enumerate(starts) if s <= i)  # noqa: E731
    g = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731
    order = shard_order(counts, 2, g(1))
    assert sorted(order) == list(range(17)) and order == shard_order(counts, 2, g(1)) != shard_order(counts, 2, g(2))
    # the windows: the shards of each window are read together, each shard in exactly one window
    seen, pos = [], 0
    while pos < 17:
        first = {shard_of(order[pos])}
        window = set()
        for i in order[pos:]:
            window.add(shard_of(i))
            if len(window) > 2:
                window.discard(shard_of(i))
                break
        n = sum(counts[s] for s in window)
        assert {shard_of(i) for i in order[pos:pos + n]} == window and first <= window
        seen += sorted(window)
        pos += n
    assert sorted(seen) == list(range(5))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_mid_epoch_start_continues_the_shard_order_at_any_world_size(world):
    """Ranks stride the dataset's order as they stride a uniform one: started at sample 7, rank r
    reads the positions >= 7 that are r modulo the world size, of one order whatever the world size."""
    order = lambda g: shard_order([4, 4, 4, 4, 3], 2, g)  # noqa: E731
    one = TrainSampler(19, num_replicas=1, rank=0, seed=5, order=order)
    one.set_epoch(3)
    full = list(one)
    assert sorted(full) == list(range(19)) and full == order(torch.Generator().manual_seed(_seed(5, 3)))
    for r in range(world):
        s = TrainSampler(19, num_replicas=world, rank=r, seed=5, order=order)
        s.set_epoch(3, start=7)
        padded = s.permutation()
        assert padded[:19] == full
        assert list(s) == [padded[p] for p in range(7, len(padded)) if p % world == r]


def _seed(seed: int, epoch: int) -> int:
    from fastvision.distributed.samplers import _mix_seed

    return _mix_seed(seed, epoch)


def test_items_and_augmentation_are_the_folders(inet, shards):
    kw = dict(image_size=24, resize_size=28)
    folder = DATASETS.build("imagefolder", {"path": str(inet), **kw})
    sharded = DATASETS.build("imagefolder", {"path": str(shards), **kw})
    assert sharded.info["train_images"] == len(folder.train) and sharded.info["classes"] == folder.info["classes"]
    by_id = {os.path.relpath(p, inet): i for i, (p, _) in enumerate(folder.val.samples)}
    for i in range(len(sharded.val)):
        a = sharded.val[i]
        b = folder.val[by_id[a["id"]]]
        assert torch.equal(a["image"], b["image"]) and a["label"] == b["label"]
    base, (read, crop) = sharded.train.cache_pipeline()
    assert isinstance(crop, RandomResizedCrop)
    item = read(base[5])
    j = next(k for k, (p, _) in enumerate(folder.train.samples) if os.path.relpath(p, inet) == item["id"])
    fbase, (fread, fcrop) = folder.train.cache_pipeline()
    theirs = fread(fbase[j])
    assert torch.equal(item["data"], theirs["data"]) and item["label"] == theirs["label"]
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert torch.equal(crop(item, g1)["image"], fcrop(theirs, g2)["image"])
    assert isinstance(folder.train, ImageFolderDataset)


def test_an_epoch_in_the_shard_order_opens_each_shard_once(shards):
    ds = DATASETS.build("imagefolder", {"path": str(shards), "image_size": 24, "resize_size": 28}).train
    _, (read, _) = ds.cache_pipeline()
    labels = [read({"index": i})["label"] for i in ds.epoch_order(torch.Generator().manual_seed(0))]
    assert ds.reader.opens == len(ds.reader.shards) > 3 and sorted(labels) == [0] * 6 + [1] * 6 + [2] * 6


def test_coco_items_are_the_folders(tmp_path):
    src = load_all().get("coco")(tmp_path / "coco", seed=0, train=4, val=3)
    write_shards(src, tmp_path / "out", "64KB")
    folder = coco_folder(path=str(src), image_size=48)
    sharded = DATASETS.build("coco", {"path": str(tmp_path / "out"), "image_size": 48})
    assert sharded.info["cat_ids"] == folder.info["cat_ids"] and Path(sharded.info["val_ann_file"]).is_file()
    assert sharded.info["classes"] == folder.info["classes"]  # evaluate --data / a resume compare them
    pos = {image_id: i for i, image_id in enumerate(folder.val.ids)}
    for i in range(len(sharded.val)):
        a = sharded.val[i]
        b = folder.val[pos[a["image_id"]]]
        assert all(torch.equal(a[k], b[k]) for k in ("image", "boxes", "labels", "iscrowd"))
        d, e = sharded.val.decode(i), folder.val.decode(pos[a["image_id"]])
        assert torch.equal(d["image"], e["image"]) and torch.equal(d["boxes"], e["boxes"])


def _copy(shards: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in shards.iterdir():
        if p.is_file():
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _train_split(path: Path, **kw):
    return build_shards(str(path), "imagefolder", {"image_size": 24, "resize_size": 28}, **kw).train


def test_each_bad_shard_is_one_line_naming_it(shards, tmp_path, caplog, fresh_logging):
    bad = _copy(shards, tmp_path / "bad")
    name = "train-000001.tar"
    data = (bad / name).read_bytes()
    (bad / name).write_bytes(data[:-700])  # truncated: refused when the dataset is built
    with pytest.raises(DataError, match=f"{name}: .* bytes, the index says"):
        _train_split(bad)
    flipped = bytearray(data)
    flipped[600] ^= 0xFF  # inside the first image: same size, other bytes
    (bad / name).write_bytes(bytes(flipped))
    ds = _train_split(bad)
    with pytest.raises(DataError, match=f"{name}: checksum mismatch"):
        ds[ds.reader.starts[1]]
    header = bytearray(data)
    header[100] ^= 0xFF  # the first member's header: caught without the checksum too
    (bad / name).write_bytes(bytes(header))
    with pytest.raises(DataError, match=f"{name}: corrupt tar header at byte 0"):
        _train_split(bad, shard_verify=False)[ds.reader.starts[1]]
    (bad / name).write_bytes(data)
    doc = _index(bad)
    doc["splits"]["train"]["shardlist"][1]["nsamples"] += 1
    (bad / "shards.json").write_text(json.dumps(doc))
    n = doc["splits"]["train"]["shardlist"][1]["nsamples"]
    with pytest.raises(DataError, match=f"{name}: {n - 1} samples, the index says {n}"):
        ds = _train_split(bad)
        ds[ds.reader.starts[1]]
    caplog.set_level(logging.WARNING)
    kept = _train_split(bad, skip_unreadable=True)
    assert len(kept) == 18 - (n - 1) and f"skipped 1 unreadable shard(s), {n} samples" in caplog.text


def test_the_cli_exits_2_with_the_shard_named(shards, tmp_path):
    bad = _copy(shards, tmp_path / "bad")
    (bad / "val-000000.tar").write_bytes((bad / "val-000000.tar").read_bytes()[:1000])
    cmd = [sys.executable, "-m", "fastvision", "data", "inspect", str(bad)]
    res = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "val-000000.tar" in res.stderr.strip().splitlines()[-1]
    assert "imagefolder" in res.stdout and "train" in res.stdout


def test_a_folder_that_is_not_this_sources_shard_set_is_refused(inet, shards, tmp_path, capsys):
    """`data shard SRC OUT` writes into OUT only when it is new, empty or a shard set of SRC (rerun:
    checked, completed); a dataset folder, a file or another dataset's shard set is one line naming it."""
    from fastvision.cli import main

    mic = load_all().get("microscopy")(tmp_path / "mic", count=2, size=32)
    before = sorted(p.relative_to(mic) for p in mic.rglob("*"))
    (tmp_path / "a-file").write_text("mine")
    other = load_all().get("imagenet")(tmp_path / "other", classes=2, per_class=2, val_per_class=1, size=32)
    for out, why in ((mic, "exists and is not a shard set (holds images, masks); choose a new output folder, or "
                           "pass --force to write the shards beside them"),
                     (tmp_path / "a-file", "exists and is not a folder; choose a new output folder"),
                     (shards, f"a shard set of another dataset than {other} (imagefolder, 3 classes); choose a new "
                              "output folder")):
        assert main(["data", "shard", str(other if out == shards else inet), str(out), "--shard-size", SIZE]) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines() == [f"fastvision: error: {out}: {why}"], err
    assert sorted(p.relative_to(mic) for p in mic.rglob("*")) == before and (tmp_path / "a-file").read_text() == "mine"
    again = _copy(shards, tmp_path / "again")  # a rerun into its own (finished, then unfinished) set still works
    assert main(["data", "shard", str(inet), str(again), "--shard-size", SIZE]) == 0
    (again / "shards.json").unlink()
    (again / "val-000000.tar").unlink()
    assert main(["data", "shard", str(inet), str(again), "--shard-size", SIZE]) == 0
    assert all((again / p.name).read_bytes() == p.read_bytes() for p in shards.iterdir() if p.is_file())
    (tmp_path / "empty").mkdir()
    assert main(["data", "shard", str(inet), str(tmp_path / "empty"), "--shard-size", SIZE]) == 0
    assert main(["data", "shard", str(inet), str(mic), "--shard-size", SIZE, "--force"]) == 0  # beside the files
    assert main(["data", "shard", str(other), str(mic), "--shard-size", SIZE, "--force"]) == 2  # not into another's
    assert "a shard set of another dataset" in capsys.readouterr().err
    assert (mic / "shards.json").is_file() and all((mic / p).exists() for p in before)


def test_images_that_do_not_decode_stop_the_writer_before_it_writes(inet, tmp_path, capsys, fresh_logging):
    """A text file named .JPEG and a truncated JPEG: one line naming them, nothing written (they were
    packed, and training from the shards stopped on them); --skip-unreadable leaves them out."""
    import shutil

    from fastvision.cli import main

    src = tmp_path / "src"
    shutil.copytree(inet, src)
    (src / "train/class001/notes.JPEG").write_text("not an image")
    whole = (src / "train/class000/00000.JPEG").read_bytes()
    (src / "val/class002/cut.JPEG").write_bytes(whole[: len(whole) // 2])
    out = tmp_path / "out"
    assert main(["data", "shard", str(src), str(out), "--shard-size", SIZE]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2 image file(s) that do not decode" in err[0], err
    assert "train/class001/notes.JPEG" in err[0] and "val/class002/cut.JPEG" in err[0] and not out.exists()
    assert main(["data", "shard", str(src), str(out), "--shard-size", SIZE, "--skip-unreadable"]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 unreadable" in err and "notes.JPEG" in err and "cut.JPEG" in err
    index = _index(out)
    assert [sum(s["nsamples"] for s in index["splits"][k]["shardlist"]) for k in ("train", "val")] == [18, 6]
    splits = DATASETS.build("imagefolder", {"path": str(out), "image_size": 16, "resize_size": 16})
    assert len(splits.train) == 18 and splits.train[0]["image"].shape == (3, 16, 16)


def test_an_out_inside_a_folder_the_source_is_read_from_is_refused_and_the_source_kept(inet, tmp_path, capsys):
    """OUT under SRC/train (or a class folder, or COCO's image folder) made the shards a class of no
    images: the source stopped reading. One line, nothing written; SRC/shards beside the splits is fine."""
    import shutil

    from fastvision.cli import main

    src = tmp_path / "src"
    shutil.copytree(inet, src)
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    for out in (src / "train" / "shards", src / "val" / "class001" / "x"):
        assert main(["data", "shard", str(src), str(out), "--shard-size", SIZE]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"fastvision: error: {out}: inside ") and "read from" in err[0]
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before
    assert main(["data", "shard", str(src), str(src / "shards"), "--shard-size", SIZE]) == 0
    assert len(DATASETS.build("imagefolder", {"path": str(src), "image_size": 16, "resize_size": 16}).train) == 18
    coco = load_all().get("coco")(tmp_path / "coco", train=3, val=2)
    assert main(["data", "shard", str(coco), str(coco / "train2017" / "s"), "--shard-size", "1MB"]) == 2
    assert "read from" in capsys.readouterr().err and not (coco / "train2017" / "s").exists()


def test_coco_images_missing_or_undecodable_name_the_commands_flag_not_trainings_key(tmp_path, capsys):
    """`data shard` of a COCO set with a listed image missing said 'data.args.skip_unreadable=true skips
    them', a key this command does not take; it is --skip-unreadable here."""
    from fastvision.cli import main

    coco = load_all().get("coco")(tmp_path / "coco", train=3, val=2)
    first = sorted((coco / "train2017").iterdir())[0]
    first.unlink()
    assert main(["data", "shard", str(coco), str(tmp_path / "out"), "--shard-size", "1MB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and first.name in err[0] and "--skip-unreadable" in err[0], err
    assert "data.args" not in err[0] and not (tmp_path / "out").exists()
    assert main(["data", "shard", str(coco), str(tmp_path / "out"), "--shard-size", "1MB", "--skip-unreadable"]) == 0
    assert main(["data", "shard", str(coco), str(tmp_path / "o2"), "--format", "imagefolder"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no train/ folder: SRC is the folder holding" in err and "data.args" not in err, err


def test_only_the_writers_own_temporary_files_are_taken_for_its_and_removed(inet, tmp_path, capsys):
    """Any dot-file with '.tmp' in its name passed for a killed writer's partial shard: an OUT holding only
    a user's '.notes.tmp' was taken for a shard set and the file deleted (and so with --force)."""
    from fastvision.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / ".notes.tmp").write_text("mine")
    assert main(["data", "shard", str(inet), str(out), "--shard-size", SIZE]) == 2
    assert "not a shard set (holds .notes.tmp)" in capsys.readouterr().err
    (out / ".train-000001.tar.k3j4h5.tmp").write_bytes(b"partial")  # a killed writer's
    assert main(["data", "shard", str(inet), str(out), "--shard-size", SIZE, "--force"]) == 0
    assert (out / ".notes.tmp").read_text() == "mine" and not (out / ".train-000001.tar.k3j4h5.tmp").exists()
    (out / ".notes.tmp").unlink()
    (out / ".val-000000.tar.abc123.tmp").write_bytes(b"partial")
    assert main(["data", "shard", str(inet), str(out), "--shard-size", SIZE]) == 0  # its own set: completed
    assert not (out / ".val-000000.tar.abc123.tmp").exists()


def test_a_rerun_on_a_finished_set_without_shard_size_checks_it_at_its_own_size(inet, shards, tmp_path, capsys):
    """Rerunning `data shard SRC OUT` on a finished set written with --shard-size X, without the flag,
    stopped on the first shard ('N bytes where this input makes M'): 256MB was planned, not X."""
    from fastvision.cli import main

    again = _copy(shards, tmp_path / "again")
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in again.iterdir() if p.suffix == ".tar"}
    assert main(["data", "shard", str(inet), str(again)]) == 0, capsys.readouterr().err
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in again.iterdir() if p.suffix == ".tar"} == before
    assert _index(again) == _index(shards)
    assert main(["data", "shard", str(inet), str(again), "--shard-size", "64KB"]) == 2  # another size: still refused
    assert "--shard-size changed" in capsys.readouterr().err


def test_an_unfinished_set_is_named_as_one_by_training_and_inspect(shards, tmp_path, capsys):
    """A `data shard` stopped before its index: training said 'no train/ folder', `data inspect`
    'unrecognised dataset layout'; both now name the unfinished set and the rerun that finishes it."""
    from fastvision.cli import main

    cut = _copy(shards, tmp_path / "cut")
    (cut / "shards.json").unlink()
    n = len(list(cut.glob("*.tar")))
    said = rf"cut: an unfinished shard set \({n} shard\(s\), no shards.json.*rerun `fastvision data shard SRC .*cut` "
    for read in (lambda: DATASETS.build("imagefolder", {"path": str(cut)}),
                 lambda: DATASETS.build("coco", {"path": str(cut)})):
        with pytest.raises(DataError, match=said + "with the same --shard-size"):
            read()
    assert main(["data", "inspect", str(cut)]) == 2
    assert re.search(said, capsys.readouterr().err)


@pytest.mark.parametrize("url", ["../../escaped.tar", "/abs/train-000000.tar", "sub/train-000000.tar", ".hidden.tar"])
def test_an_index_naming_a_file_outside_the_set_is_refused(shards, tmp_path, url):
    """A shards.json whose url was '../../x.tar' read a tar outside the set's folder (and over HTTP wrote
    the cached copy, or failed with a FileNotFoundError traceback, outside the shard cache)."""
    bad = _copy(shards, tmp_path / "set")
    (tmp_path / "escaped.tar").write_bytes((bad / "train-000000.tar").read_bytes())
    doc = _index(bad)
    doc["splits"]["train"]["shardlist"][0]["url"] = url
    (bad / "shards.json").write_text(json.dumps(doc))
    with pytest.raises(DataError, match=rf"shards.json: not a fastvision shard index .*{re.escape(repr(url))} is not "
                                        r"a file of the set"):
        _train_split(bad)


def test_a_resume_after_the_source_changed_is_refused_even_where_every_size_is_the_same(tmp_path):
    """A file moved to another class between the killed run and the rerun, every image the same bytes:
    each finished shard had the planned size and count, so it was kept with its old label (the set mixed
    the two sources). The writer's own members (labels, ids) are compared byte for byte now."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, format="JPEG")
    src = tmp_path / "src"
    for split in ("train", "val"):
        for c in ("class000", "class001"):
            (src / split / c).mkdir(parents=True)
            for i in range(3 if split == "train" else 1):
                (src / split / c / f"{i:05d}.JPEG").write_bytes(buf.getvalue())
    out = tmp_path / "out"
    write_shards(src, out, "3KB")  # about one sample a shard
    shards = sorted(out.glob("train-*.tar"))
    assert len(shards) >= 4
    (out / "shards.json").unlink()
    shards[-1].unlink()  # killed before its last shard
    (src / "train/class000/00002.JPEG").rename(src / "train/class001/00003.JPEG")  # same name length, new label
    with pytest.raises(DataError, match=r"train-\d{6}.tar: member \d{8}\.(cls|id) is not what this input makes"):
        write_shards(src, out, "3KB")
