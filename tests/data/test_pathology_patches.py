"""Patch folders (``{split}/normal``, ``{split}/tumor``) as a download or a scanner export leaves them:
macOS ``._`` companions beside the patches, 16-bit grey and CMYK patches (read as ImageFolder reads them)."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from fastvision.data.formats import pathology  # noqa: F401  (registers the dataset)
from fastvision.errors import ConfigError
from fastvision.registry import DATASETS


def test_patch_folders_skip_companions_and_read_16_bit_and_cmyk_as_imagefolder(tmp_path):
    ramp = (np.arange(16 * 16).reshape(16, 16) * 256).astype(np.uint16)  # 0 .. 65280
    for split in ("train", "val"):
        for name, value in (("normal", 40), ("tumor", 200)):
            d = tmp_path / split / name
            d.mkdir(parents=True)
            Image.fromarray(np.full((16, 16, 3), value, np.uint8)).save(d / "a.png")
            (d / "._a.png").write_bytes(b"\x00\x05\x16\x07" + bytes(60))  # AppleDouble, no image
    Image.fromarray(ramp).save(tmp_path / "train/tumor/g16.png")
    Image.fromarray(np.full((16, 16, 3), 200, np.uint8)).convert("CMYK").save(tmp_path / "train/tumor/c.jpg")
    splits = DATASETS.build("pathology", {"path": str(tmp_path), "patch_size": 16})
    names = [s[0].rsplit("/", 1)[-1] for s in splits.train.samples]
    assert names == ["a.png", "a.png", "c.jpg", "g16.png"] and len(splits.val) == 2
    grey = splits.train[3]["image"].numpy()
    expected = np.round(ramp.astype(np.float64) * 255 / 65535)  # 16 bits scaled to 8, not clipped at 255
    assert grey.shape == (3, 16, 16) and np.abs(grey[0] - expected).max() <= 1 and grey.mean() < 130
    cmyk = splits.train[2]["image"].numpy()
    assert np.abs(cmyk.astype(int) - 200).max() < 12  # CMYK back to its RGB grey


def test_a_negative_subsampling_seed_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.args.seed=-1: the seed of the normal-patch subsampling"):
        DATASETS.build("pathology", {"path": str(tmp_path), "seed": -1})  # was numpy's message, no key


def test_a_patch_folder_spelt_otherwise_is_named_with_the_folders_there(tmp_path):
    from fastvision.errors import DataError

    for name in ("normal", "Tumour"):
        (tmp_path / "train" / name).mkdir(parents=True)
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "train" / name / "a.png")
    with pytest.raises(DataError, match=r"train/tumor: missing .*US spelling; there: Tumour, normal\)"):
        DATASETS.build("pathology", {"path": str(tmp_path), "patch_size": 8})
