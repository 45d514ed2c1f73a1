"""What ``data inspect`` reads from a microscopy pair (``formats/microscopy_check.py``): the rule it
checks with, why a pair is unusable, and the counts of the usable ones, worked out by hand."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tifffile
from PIL import Image

from fastvision.data.formats.microscopy_check import MaskTally, microscopy_rule, read_pair
from fastvision.data.nonfinite import NONFINITE_FILES
from fastvision.errors import ConfigError


@pytest.mark.parametrize("settings, rule, row", [
    ({}, {"channels": 1, "num_classes": 2, "binarize": False, "nonfinite": "error"},
     "files training stops on (as data.args channels=1, num_classes=2, binarize=false, nonfinite=error)"),
    ({"channels": 3, "binarize": True}, {"channels": 3, "num_classes": 2, "binarize": True, "nonfinite": "error"},
     "files training stops on (as data.args channels=3, num_classes=2, binarize=true, nonfinite=error)"),
])
def test_rule_is_the_builders_defaults_under_the_settings(settings, rule, row):
    assert microscopy_rule(settings) == (rule, row)


def test_rule_refuses_an_unknown_setting():
    with pytest.raises(ConfigError, match="data inspect --set size: valid for microscopy: channels, num_classes"):
        microscopy_rule({"size": 3})


def _pair(root: Path, image: np.ndarray, mask: np.ndarray, mask_name: str = "a.png") -> tuple[Path, Path]:
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(exist_ok=True)
    img_path, mask_path = root / "images/a.tif", root / "masks" / mask_name
    tifffile.imwrite(img_path, image)
    Image.fromarray(mask).save(mask_path)
    return img_path, mask_path


@pytest.mark.parametrize("image, mask, row, entry", [
    (np.full((4, 4), np.nan, np.float32), np.zeros((4, 4), np.uint8), NONFINITE_FILES, "a.tif (16)"),
    (np.zeros((4, 5), np.uint8), np.zeros((4, 4), np.uint8), "image and mask of different sizes",
     "a.tif (4, 5) vs a.png (4, 4)"),
])
def test_an_unusable_pair_is_listed_with_its_reason(tmp_path, image, mask, row, entry):
    unusable: dict[str, list[str]] = {}
    assert read_pair(*_pair(tmp_path, image, mask), tmp_path, unusable) is None
    assert unusable == {row: [entry]}


def test_an_unreadable_file_is_named_relative_to_the_folder(tmp_path):
    img_path, mask_path = _pair(tmp_path, np.zeros((4, 4), np.uint8), np.zeros((4, 4), np.uint8))
    img_path.write_bytes(b"not a tiff")
    unusable: dict[str, list[str]] = {}
    assert read_pair(img_path, mask_path, tmp_path, unusable) is None
    [(row, [entry])] = unusable.items()
    assert row.startswith("unreadable files") and entry.startswith("images/a.tif: cannot read image")


def test_the_tally_counts_values_encodings_and_anomalies():
    tally = MaskTally()
    img = np.array([[0, 7], [3, 200]], np.uint8)
    masks = {"m1.png": np.array([[0, 1], [1, 1]], np.uint8), "m2.png": np.array([[0, 0], [0, 1]], np.uint8),
             "m3.tif": np.array([[0, 255], [0, 0]], np.uint8), "m4.png": np.array([[0, 1], [2, 3]], np.uint8)}
    for name, mask in masks.items():
        tally.add(img, mask, Path("i.png"), Path(name))
    tally.flag_mixed_binary_encodings()
    assert tally.ranges == {"uint8": (0.0, 200.0)} and tally.shapes == {"(2, 2)": 4}
    assert tally.dtypes == {"uint8 / mask uint8": 4}
    assert tally.classes == {0: 1 + 3 + 3 + 1, 1: 3 + 1 + 1, 255: 1, 2: 1, 3: 1}
    assert tally.encodings == {"0/1": 2, "0/255": 1, "4 values": 1}
    assert tally.anomalies == {
        "masks with another extension than their image (paired by stem)": ["i.png+m3.tif"],
        "masks with more than 3 values (instance ids? data.args.binarize)": ["m4.png"],
        "binary masks encoded differently from most (each read as 0/1)": ["m3.tif (0/255)"]}


def test_one_binary_encoding_is_no_anomaly():
    tally = MaskTally()
    for _ in range(2):
        tally.add(np.zeros((2, 2)), np.array([[0, 255], [0, 0]], np.uint8), Path("i.png"), Path("m.png"))
    tally.flag_mixed_binary_encodings()
    assert tally.anomalies == {}


@pytest.mark.parametrize("setting, line", [
    ("channels=abc", "data inspect --set channels=abc: expected int (data.args.channels)"),
    ("num_classes=2.5", "data inspect --set num_classes=2.5: expected int (data.args.num_classes)"),
    ("binarize=maybe", "data inspect --set binarize=maybe: expected bool (data.args.binarize)"),
])
def test_a_setting_of_the_wrong_type_is_one_line_naming_it(setting, line, tmp_path, capsys):
    """Not every file reported as one training stops on: the value is wrong, whatever the files."""
    from fastvision.cli import main

    assert main(["data", "synth", "microscopy", str(tmp_path / "mic"), "--count", "3", "--size", "32"]) == 0
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path / "mic"), "--set", setting]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"fastvision: error: {line}"] and "would stop training" not in out + err


def test_inspect_with_nonfinite_zero_reads_them_as_training_would(tmp_path, capsys):
    """``data inspect --set nonfinite=zero`` was refused (valid: channels, num_classes, binarize), so inspect
    exited 2 on a folder training with that setting takes: the files are listed as read as 0, the pair
    counts, and the exit is 0; without it they still stop (exit 2)."""
    from PIL import Image

    from fastvision.cli import main
    from fastvision.data.inspect import inspect_path

    (tmp_path / "images").mkdir()
    (tmp_path / "masks").mkdir()
    for name in ("a", "b"):
        img = np.full((8, 8), 0.5, np.float32)
        img[0, 0] = np.nan if name == "a" else 0.25
        tifffile.imwrite(tmp_path / f"images/{name}.tif", img)
        Image.fromarray(np.eye(8, dtype=np.uint8) * 255).save(tmp_path / f"masks/{name}.png")
    report = inspect_path(tmp_path, {"nonfinite": "zero"})
    assert report["pairs"] == 2 and not report["unusable"]
    assert report["anomalies"]["files with NaN/Inf values, read as 0 (nonfinite=zero)"] == "1 (a.tif (1))"
    assert report["intensity range"] == "0 .. 0.5 (float32)"
    assert main(["data", "inspect", str(tmp_path), "--set", "nonfinite=zero"]) == 0
    assert main(["data", "inspect", str(tmp_path)]) == 2
    capsys.readouterr()
