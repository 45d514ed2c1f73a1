"""DLE ImageNet TFRecords read without TensorFlow: files written by the ``tfrecord`` package (an
independent writer and reader) give the ImageFolder items of the JPEGs they hold; a corrupt
record is one line naming the file and the byte."""
from __future__ import annotations

import pytest
import torch

from fastvision.data.formats.imagefolder import ImageFolderDataset, list_samples
from fastvision.data.inspect import inspect_path
from fastvision.data.shards.tfrecord import parse_example, scan
from fastvision.data.synth import load_all
from fastvision.errors import DataError
from fastvision.registry import DATASETS

tfrecord = pytest.importorskip("tfrecord")


def write_tfrecord_set(root):
    """DLE-style ImageNet TFRecords (2 train files, 1 validation file) of a generated JPEG set,
    written by the ``tfrecord`` package: ``(folder, {file name: [(jpeg path, class)]})``."""
    from tfrecord.writer import TFRecordWriter

    src = load_all().get("imagenet")(root / "src", seed=0, classes=2, per_class=3, val_per_class=1, size=32)
    classes = ["class000", "class001"]
    samples = {"train": list_samples(src / "train", classes), "val": list_samples(src / "val", classes)}
    out = root / "tfr"
    out.mkdir()
    files = {"train": ["train-00000-of-00002", "train-00001-of-00002"], "val": ["validation-00000-of-00001"]}
    written = {}
    for split, names in files.items():
        for k, name in enumerate(names):
            writer = TFRecordWriter(str(out / name))
            part = samples[split][k::len(names)]
            for path, label in part:
                writer.write({"image/encoded": (open(path, "rb").read(), "byte"),
                              "image/class/label": (label + 1, "int"), "image/format": (b"JPEG", "byte")})
            writer.close()
            written[name] = part
    return out, written


@pytest.fixture(scope="module")
def tf_set(tmp_path_factory):
    return write_tfrecord_set(tmp_path_factory.mktemp("tfr"))


def test_records_parse_as_the_tfrecord_package_reads_them(tf_set):
    from tfrecord.reader import tfrecord_loader

    out, written = tf_set
    f = out / "train-00000-of-00002"
    theirs = list(tfrecord_loader(str(f), None, {"image/encoded": "byte", "image/class/label": "int"}))
    records, _ = scan(f, f.name, True)
    data = f.read_bytes()
    mine = [parse_example(data[off:off + n]) for _, m in records for off, n in [m["rec"]]]
    assert len(mine) == len(theirs) == len(written[f.name])
    for a, b in zip(mine, theirs, strict=True):
        assert a["image/encoded"][0] == bytes(b["image/encoded"]) and a["image/class/label"] == list(
            b["image/class/label"])


def test_items_from_tfrecords_are_the_jpeg_folders(tf_set):
    out, written = tf_set
    splits = DATASETS.build("imagefolder", {"path": str(out), "image_size": 24, "resize_size": 28})
    assert len(splits.train) == 6 and len(splits.val) == 2
    reference = ImageFolderDataset(written["validation-00000-of-00001"], False, image_size=24, resize_size=28)
    for i in range(2):
        a, b = splits.val[i], reference[i]
        assert torch.equal(a["image"], b["image"]) and int(a["label"]) == int(b["label"])
    order = splits.train.epoch_order(torch.Generator().manual_seed(0))
    assert sorted(order) == list(range(6))
    assert inspect_path(out)["layout"] == "tfrecords"


def test_a_corrupt_record_header_names_the_file_and_byte(tf_set, tmp_path):
    out, _ = tf_set
    data = bytearray((out / "train-00001-of-00002").read_bytes())
    first = int.from_bytes(data[:8], "little")
    data[16 + first + 2] ^= 0xFF  # the second record's length
    bad = tmp_path / "train-00001-of-00002"
    bad.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"train-00001-of-00002: corrupt record header at byte {16 + first}"):
        scan(bad, bad.name, False)
