"""Linked folders inside an ImageFolder class (os.walk follows links): a link back up (``loop -> ..``)
read each image again, 40 levels deep, and the other classes' images under this class's label."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from PIL import Image

from fastvision.data.formats.imagefolder import build


@pytest.mark.usefixtures("fresh_logging")
def test_a_link_loop_in_a_class_folder_is_read_once_with_one_warning(tmp_path, caplog):
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(2):
                Image.fromarray(np.full((8, 8, 3), 50 * i, np.uint8)).save(tmp_path / split / c / f"{i}.png")
    os.symlink("..", tmp_path / "train/cat/loop")  # back to train/: both classes again, under 'cat'
    (tmp_path / "train/dog/real").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "train/dog/real/2.png")
    os.symlink("real", tmp_path / "train/dog/again")  # the same sub-folder twice: its image once
    os.symlink(tmp_path / "val/cat", tmp_path / "train/cat/extra")  # a linked folder elsewhere: read
    with caplog.at_level(logging.WARNING):
        splits = build(path=str(tmp_path), image_size=8, resize_size=8)
    names = sorted((os.path.relpath(p, tmp_path), label) for p, label in splits.train.samples)
    dog_sub = [n for n, _ in names if n.endswith("/2.png")]  # os.walk's order picks which of the two links
    assert len(dog_sub) == 1 and dog_sub[0] in ("train/dog/real/2.png", "train/dog/again/2.png")
    assert [x for x in names if x[0] != dog_sub[0]] == [
        ("train/cat/0.png", 0), ("train/cat/1.png", 0), ("train/cat/extra/0.png", 0), ("train/cat/extra/1.png", 0),
        ("train/dog/0.png", 1), ("train/dog/1.png", 1)]
    warned = [r.getMessage() for r in caplog.records if "read already" in r.getMessage()]
    assert len(warned) == 2 and any("train/cat/loop" in w for w in warned)
