"""Microscopy folders as labs save them: ImageJ and multi-page TIFF, 16-bit masks, masks with
another extension than their image, and 0/255, 0/1 and 0/65535 masks mixed in one folder."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from fastvision.cli import main
from fastvision.data.formats.microscopy import MicroscopyDataset, pair_files, read_array
from fastvision.data.inspect import inspect_path
from fastvision.errors import DataError
from fastvision.registry import DATASETS

H = W = 32


pytestmark = pytest.mark.usefixtures("fresh_logging")


def _blob(k: int) -> np.ndarray:
    m = np.zeros((H, W), bool)
    m[4 + k:16 + k, 6:20 + k] = True
    return m


def make_folder(root: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Four pairs, each a different real-world encoding; returns stem -> (image (C, H, W) in [0, 1], fg)."""
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    rng = np.random.default_rng(0)
    out = {}
    # 1. ImageJ hyperstack, 3 channels (axes CYX), 16-bit; mask 8-bit PNG 0/255
    img = rng.integers(0, 65535, (3, H, W), dtype=np.uint16)
    tifffile.imwrite(root / "images/cell_001.tif", img, imagej=True, metadata={"axes": "CYX"})
    Image.fromarray((_blob(0) * 255).astype(np.uint8)).save(root / "masks/cell_001.png")
    out["cell_001"] = (img / 65535.0, _blob(0))
    # 2. plain multi-page TIFF, one channel per page, 8-bit; mask 16-bit TIFF 0/1
    img = rng.integers(0, 255, (3, H, W), dtype=np.uint8)
    with tifffile.TiffWriter(root / "images/cell_002.tif") as tw:
        for page in img:
            tw.write(page, photometric="minisblack", contiguous=False)
    tifffile.imwrite(root / "masks/cell_002.tif", _blob(1).astype(np.uint16))
    out["cell_002"] = (img / 255.0, _blob(1))
    # 3. 16-bit grey PNG; mask 16-bit TIFF 0/65535
    img = rng.integers(0, 65535, (H, W), dtype=np.uint16)
    Image.fromarray(img).save(root / "images/cell_003.png")
    tifffile.imwrite(root / "masks/cell_003.tif", (_blob(2) * 65535).astype(np.uint16))
    out["cell_003"] = (np.repeat(img[None] / 65535.0, 3, 0), _blob(2))
    # 4. RGB PNG; mask 8-bit PNG 0/1
    img = rng.integers(0, 255, (H, W, 3), dtype=np.uint8)
    Image.fromarray(img).save(root / "images/cell_004.png")
    Image.fromarray(_blob(3).astype(np.uint8)).save(root / "masks/cell_004.png")
    (root / "masks/._cell_004.png").write_bytes(b"\x00\x05\x16\x07" + bytes(60))  # macOS companion
    out["cell_004"] = (img.transpose(2, 0, 1) / 255.0, _blob(3))
    return out


def test_every_encoding_reads_as_image_and_binary_label(tmp_path):
    expected = make_folder(tmp_path / "cells")
    assert read_array(tmp_path / "cells/images/cell_001.tif").shape == (H, W, 3)  # CYX -> HWC
    assert read_array(tmp_path / "cells/images/cell_002.tif").shape == (H, W, 3)  # pages -> channels
    pairs = pair_files(tmp_path / "cells")
    assert [(a.name, b.name) for a, b in pairs] == [
        ("cell_001.tif", "cell_001.png"), ("cell_002.tif", "cell_002.tif"),
        ("cell_003.png", "cell_003.tif"), ("cell_004.png", "cell_004.png")]
    ds = MicroscopyDataset(pairs, (H, W), "resize", channels=3, num_classes=2)
    for i in range(len(ds)):
        item = ds[i]
        image, fg = expected[item["id"]]
        assert item["image"].shape == (3, H, W) and item["label"].dtype == torch.int64
        torch.testing.assert_close(item["image"], torch.from_numpy(image).float(), atol=1e-6, rtol=0)
        assert torch.equal(item["label"], torch.from_numpy(fg.astype(np.int64)))
    splits = DATASETS.build("microscopy", {"path": str(tmp_path / "cells"), "image_size": [H, W],
                                           "channels": 3, "val_fraction": 0.25})
    assert len(splits.train) == 3 and len(splits.val) == 1


def test_class_index_masks_beyond_num_classes_name_the_count_that_reads_them(tmp_path):
    """Masks of classes 0..3 read as the binary default: the line offers num_classes=4 (the README's
    multi-class settings) before binarize, and with it they read as they are."""
    root = tmp_path / "mc"
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    Image.fromarray(np.full((H, W), 9, np.uint8)).save(root / "images/a.png")
    mask = (np.arange(H * W).reshape(H, W) % 4).astype(np.uint8)
    Image.fromarray(mask).save(root / "masks/a.png")
    with pytest.raises(DataError, match=r"a.png: mask values \[0, 1, 2, 3\] outside 0..1 \(class indices 0..3\? "
                                        r"set data.args.num_classes=4.*binarize=true"):
        MicroscopyDataset(pair_files(root), (H, W), "resize", channels=1, num_classes=2)[0]
    got = MicroscopyDataset(pair_files(root), (H, W), "resize", channels=1, num_classes=4)[0]["label"]
    assert torch.equal(got, torch.from_numpy(mask.astype(np.int64)))


def test_instance_masks_need_binarize_and_stacks_are_refused(tmp_path, capsys):
    root = tmp_path / "inst"
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    Image.fromarray(np.full((H, W), 9, np.uint8)).save(root / "images/a.png")
    inst = np.zeros((H, W), np.uint16)
    inst[2:8, 2:8], inst[10:20, 10:20], inst[22:30, 3:9] = 1, 2, 300  # three cells, three ids
    tifffile.imwrite(root / "masks/a.tif", inst)
    ds = MicroscopyDataset(pair_files(root), (H, W), "resize", channels=1, num_classes=2)
    with pytest.raises(DataError, match=r"a.tif: mask values \[0, 1, 2, 300\].*binarize=true"):
        ds[0]
    ds = MicroscopyDataset(pair_files(root), (H, W), "resize", channels=1, num_classes=2, binarize=True)
    assert torch.equal(ds[0]["label"], torch.from_numpy((inst > 0).astype(np.int64)))
    tifffile.imwrite(root / "images/b.tif", np.zeros((5, H, W), np.uint8), imagej=True, metadata={"axes": "ZYX"})
    Image.fromarray(np.zeros((H, W), np.uint8)).save(root / "masks/b.png")
    with pytest.raises(DataError, match=r"b.tif: a Z stack of 5 planes"):
        read_array(root / "images/b.tif")
    Image.fromarray(np.zeros((H, W), np.uint8)).save(root / "masks/a.png")  # a second mask for stem a
    assert main(["data", "inspect", str(root)]) == 2  # every problem listed, then exit 2
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert len(err) == 1 and "2 file(s) would stop training" in err[0]
    assert "stems with two masks" in out
    an = inspect_path(root)["anomalies"]
    assert an["stems with two masks (keep one)"] == "1 (a.png+a.tif)"
    assert "b.tif: a Z stack of 5 planes" in an["unreadable files, or Z / T stacks (items are 2-D)"]


def test_inspect_reports_mixed_encodings_and_extensions(tmp_path):
    make_folder(tmp_path / "cells")
    report = inspect_path(tmp_path / "cells")
    assert report["pairs"] == 4
    assert report["mask encodings (files)"] == {"0/255": 1, "0/1": 2, "0/65535": 1}
    an = report["anomalies"]
    assert an["masks with another extension than their image (paired by stem)"] == \
        "2 (cell_001.tif+cell_001.png, cell_003.png+cell_003.tif)"
    assert an["binary masks encoded differently from most (each read as 0/1)"] == \
        "2 (cell_001.png (0/255), cell_003.tif (0/65535))"


def test_inspect_lists_every_file_training_stops_on(tmp_path, capsys):
    """Untagged multi-page TIFFs (5 pages written one by one: read as 5 channels) beside 1- and
    3-channel images: inspect names each of the three TIFFs, and they are exactly the items the
    training dataset (the recipe's channels=1) stops on."""
    root = tmp_path / "mixed"
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    rng = np.random.default_rng(0)
    for name in ("p1", "p2", "p3"):
        for k in range(5):
            tifffile.imwrite(root / f"images/{name}.tif", rng.integers(0, 255, (H, W), np.uint8), append=k > 0)
    Image.fromarray(rng.integers(0, 255, (H, W), np.uint8)).save(root / "images/grey.png")
    Image.fromarray(rng.integers(0, 255, (H, W, 3), np.uint8)).save(root / "images/rgb.png")
    for name in ("p1", "p2", "p3", "grey", "rgb"):
        Image.fromarray((rng.random((H, W)) > 0.5).astype(np.uint8) * 255).save(root / f"masks/{name}.png")
    pairs = pair_files(root)
    ds = MicroscopyDataset(pairs, (H, W), "resize", channels=1, num_classes=2)
    stops = set()
    for i, (img, _) in enumerate(pairs):
        try:
            ds[i]
        except DataError as e:
            assert "has 5 channels, recipe expects 1" in str(e)
            stops.add(img.name)
    assert stops == {"p1.tif", "p2.tif", "p3.tif"}
    assert main(["data", "inspect", str(root)]) == 2
    out, err = capsys.readouterr()
    assert "3 file(s) would stop training" in err.strip().splitlines()[-1]
    [(kind, text)] = [(k, v) for k, v in inspect_path(root)["anomalies"].items() if "training stops on" in k]
    assert "channels=1" in kind and text.startswith("3 (") and all(n in text for n in stops)
    # with channels=3 training takes none of them either (5 is neither 1 nor 3): the same three
    assert main(["data", "inspect", str(root), "--set", "channels=3"]) == 2
    assert "3 file(s) would stop training" in capsys.readouterr().err
