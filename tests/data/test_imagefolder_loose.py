"""Images lying beside the class folders of an ImageFolder split (an ImageNet valprep.sh stopped
half-way leaves the rest of val so): no folder labels them, and they were dropped without a word."""
from __future__ import annotations

import logging

import numpy as np
import pytest
from PIL import Image

from fastvision.data.formats.imagefolder import build
from fastvision.data.inspect import inspect_path
from fastvision.errors import DataError


@pytest.mark.usefixtures("fresh_logging")
def test_images_beside_the_class_folders_are_one_warning_or_an_error(tmp_path, caplog):
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (tmp_path / split / c).mkdir(parents=True)
            Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / split / c / "0.png")
    for name in ("ILSVRC2012_val_00000003.JPEG", "ILSVRC2012_val_00000004.JPEG"):
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "val" / name, format="JPEG")
    (tmp_path / "val" / "README.txt").write_text("not an image")
    with caplog.at_level(logging.WARNING):
        splits = build(path=str(tmp_path), image_size=8, resize_size=8)
    assert len(splits.val) == 2 and splits.info["val_layout"] == "class folders"
    warned = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert len(warned) == 1 and "val: 2 images not read" in warned[0], warned
    assert "ILSVRC2012_val_00000003.JPEG" in warned[0] and "README" not in warned[0]
    with pytest.raises(DataError, match="2 images not read .*invalid=error"):
        build(path=str(tmp_path), image_size=8, resize_size=8, invalid="error")
    report = inspect_path(tmp_path)
    row = report["anomalies"]["val: image files beside the class folders (not read)"]
    assert row.startswith("2 (ILSVRC2012_val_00000003.JPEG")


@pytest.mark.usefixtures("fresh_logging")
def test_training_classes_without_a_val_folder_are_one_warning(tmp_path, caplog):
    for split, classes in (("train", ("ant", "bee", "cat")), ("val", ("bee",))):
        for c in classes:
            (tmp_path / split / c).mkdir(parents=True)
            Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / split / c / "0.png")
    with caplog.at_level(logging.WARNING):
        splits = build(path=str(tmp_path), image_size=8, resize_size=8)
    assert [label for _, label in splits.val.samples] == [1]  # bee keeps its training index
    warned = [r.getMessage() for r in caplog.records if "not validated" in r.getMessage()]
    assert len(warned) == 1 and "2 of the 3 train/ classes have no folder here" in warned[0] and "ant, cat" in warned[0]
