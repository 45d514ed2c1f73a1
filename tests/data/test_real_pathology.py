"""Camelyon16 as released: pyramidal TIFF slides (read by level), ASAP XML lesion polygons with an
exclusion group, tumor/ + normal/ + lesion_annotations/ folders. Labels are checked against the
geometry written (hand-counted grid cells)."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch

from fastvision.data.formats.asap import mask_downsample_for, rasterize, read_polygons
from fastvision.data.formats.pathology import TiledTiff
from fastvision.data.inspect import inspect_path
from fastvision.errors import DataError
from fastvision.registry import DATASETS

SIDE = 256  # level-0 slide side; levels 128 and 64 follow


pytestmark = pytest.mark.usefixtures("fresh_logging")


def write_pyramid(path: Path, seed: int) -> np.ndarray:
    """A tiled RGB pyramid (levels 1 and 2 as reduced-image pages, as scanners write) plus a small
    non-tiled label image page; returns level 0."""
    rng = np.random.default_rng(seed)
    level0 = rng.integers(0, 255, (SIDE, SIDE, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tifffile.TiffWriter(path) as tw:
        tw.write(level0, tile=(64, 64), photometric="rgb")
        tw.write(level0[::2, ::2], tile=(64, 64), photometric="rgb", subfiletype=1)
        tw.write(level0[::4, ::4], tile=(64, 64), photometric="rgb", subfiletype=1)
        tw.write(np.zeros((20, 60, 3), np.uint8), photometric="rgb")  # the slide label photo
    return level0


def asap_xml(polygons: list[tuple[str, list[tuple[float, float]]]]) -> str:
    """An ASAP annotation file as Camelyon16 ships them."""
    anns = []
    for k, (group, pts) in enumerate(polygons):
        coords = "\n".join(f'\t\t\t\t<Coordinate Order="{i}" X="{x:.4f}" Y="{y:.4f}" />'
                           for i, (x, y) in enumerate(pts))
        anns.append(f'\t\t<Annotation Name="Annotation {k}" Type="Polygon" PartOfGroup="{group}" Color="#F4FA58">\n'
                    f'\t\t\t<Coordinates>\n{coords}\n\t\t\t</Coordinates>\n\t\t</Annotation>')
    groups = "\n".join(f'\t\t<Group Name="{g}" PartOfGroup="None" Color="#64FE2E">\n\t\t\t<Attributes />\n\t\t</Group>'
                       for g in ("_0", "_1", "_2"))
    return ('<?xml version="1.0"?>\n<ASAP_Annotations>\n\t<Annotations>\n' + "\n".join(anns) +
            f'\n\t</Annotations>\n\t<AnnotationGroups>\n{groups}\n\t</AnnotationGroups>\n</ASAP_Annotations>\n')


def square(x0, y0, x1, y1):
    return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]


def make_camelyon16(root: Path) -> dict[str, np.ndarray]:
    """training/{tumor,normal}/*.tif + lesion_annotations/*.xml, testing/images + lesion_annotations."""
    slides = {"tumor_001": write_pyramid(root / "training/tumor/tumor_001.tif", 1),
              "tumor_002": write_pyramid(root / "training/tumor/tumor_002.tif", 2),  # its XML is missing
              "normal_001": write_pyramid(root / "training/normal/normal_001.tif", 3),
              "test_001": write_pyramid(root / "testing/images/test_001.tif", 4)}
    (root / "training/tumor/._tumor_001.tif").write_bytes(b"\x00\x05\x16\x07" + bytes(60))
    (root / "training/lesion_annotations").mkdir(parents=True)
    (root / "training/lesion_annotations/tumor_001.xml").write_text(asap_xml(
        [("_2", square(96, 96, 128, 128)), ("_0", square(64, 64, 192, 192))]))  # exclusion listed first
    (root / "testing/lesion_annotations").mkdir(parents=True)
    (root / "testing/lesion_annotations/test_001.xml").write_text(asap_xml([("Tumor", square(0, 0, 96, 64))]))
    return slides


def test_pyramid_levels_are_read_by_level(tmp_path):
    level0 = write_pyramid(tmp_path / "s.tif", 0)
    for level, side in enumerate((256, 128, 64)):
        t = TiledTiff(tmp_path / "s.tif", level)
        assert t.shape == (side, side, 3) and t.downsample == SIDE / side
        assert t.level_shapes == [(256, 256), (128, 128), (64, 64)]
        assert np.array_equal(t.read_region(10, 20, 30, 40), level0[::2 ** level, ::2 ** level][10:40, 20:60])
        t.close()
    with pytest.raises(DataError, match=r"s.tif: has 3 pyramid level\(s\); level 3 requested"):
        TiledTiff(tmp_path / "s.tif", 3)


def test_asap_polygons_rasterise_with_exclusions(tmp_path):
    make_camelyon16(tmp_path)
    polys = read_polygons(tmp_path / "training/lesion_annotations/tumor_001.xml")
    assert [g for g, _ in polys] == ["_2", "_0"]
    assert polys[1][1].tolist() == [[64, 64], [192, 64], [192, 192], [64, 192]]
    assert mask_downsample_for(32) == 8 and mask_downsample_for(224) == 8 and mask_downsample_for(256) == 64
    mask = rasterize(polys, SIDE, SIDE, 8)
    expected = np.zeros((32, 32), bool)
    expected[8:24, 8:24] = True  # pixel centres 68..188 inside the lesion
    expected[12:16, 12:16] = False  # the exclusion 96..128
    assert np.array_equal(mask, expected)


@pytest.mark.parametrize("level,tumour,normal", [(0, 15, 49 + 64), (1, 4, 12 + 16)])
def test_camelyon16_training_layout(tmp_path, caplog, level, tumour, normal):
    slides = make_camelyon16(tmp_path)
    with caplog.at_level(logging.WARNING):
        splits = DATASETS.build("pathology", {"path": str(tmp_path), "train_dir": "training", "val_dir": "testing",
                                              "patch_size": 32, "normal_per_tumor": 0, "level": level})
    assert splits.info["train_tumor"] == tumour and splits.info["train_patches"] == tumour + normal
    assert splits.info["val_tumor"] == (6 if level == 0 else 2)
    msg = [r.getMessage() for r in caplog.records if "slide problems" in r.getMessage()]
    assert len(msg) == 1 and "tumour slides without lesion annotations (skipped) (tumor_002.tif)" in msg[0]
    assert not any("tumor_002" in s[0] for s in splits.train.samples)
    cells = {(s[1] // 32, s[2] // 32) for s in splits.train.samples if s[3] == 1}
    if level == 0:
        assert cells == {(r, c) for r in range(2, 6) for c in range(2, 6)} - {(3, 3)}
    else:
        assert cells == {(1, 1), (1, 2), (2, 1), (2, 2)}
    i = next(k for k, s in enumerate(splits.train.samples) if s[3] == 1)
    item, (_, y, x, _) = splits.train[i], splits.train.samples[i]
    page = slides["tumor_001"][::2 ** level, ::2 ** level]
    assert item["image"].shape == (3, 32, 32) and int(item["label"]) == 1
    assert torch.equal(item["image"], torch.from_numpy(page[y:y + 32, x:x + 32]).permute(2, 0, 1))


def test_missing_annotation_is_an_error_when_asked(tmp_path):
    make_camelyon16(tmp_path)
    with pytest.raises(DataError, match=r"training: 2 slide problems: 1 tumour slides without lesion"):
        DATASETS.build("pathology", {"path": str(tmp_path), "train_dir": "training", "val_dir": "testing",
                                     "patch_size": 32, "invalid": "error"})
    (tmp_path / "training/lesion_annotations/tumor_001.xml").write_text("<ASAP_Annotations><Annot")
    with pytest.raises(DataError, match=r"tumor_001.xml: not a readable ASAP XML file"):
        DATASETS.build("pathology", {"path": str(tmp_path), "train_dir": "training", "val_dir": "testing",
                                     "patch_size": 32})


def test_inspect_camelyon16(tmp_path):
    make_camelyon16(tmp_path)
    report = inspect_path(tmp_path)
    assert report["layout"] == "pathology" and "Camelyon16" in report["detected"]
    assert report["training slides (with a mask or annotation)"] == "2 (1)"  # tumor_002 is skipped: listed below
    assert report["training levels (first slide)"] == "256x256, 128x128, 64x64"
    assert report["training lesion polygons (exclusions)"] == "2 (1)"
    assert report["anomalies"]["training: tumour slides without lesion annotations (skipped)"] == "1 (tumor_002.tif)"


def test_inspect_detects_the_synthesized_slides_and_masks_layout(tmp_path, capsys):
    """``data synth pathology`` writes ``<split>/images/`` + ``<split>/masks/``: pathology, not an
    ImageFolder whose classes are "images" and "masks" with every mask an anomaly."""
    from PIL import Image

    from fastvision.cli import main

    out = tmp_path / "p"
    assert main(["data", "synth", "pathology", str(out), "--slides", "2", "--val-slides", "1", "--size", "256",
                 "--tile", "64"]) == 0
    capsys.readouterr()
    assert main(["data", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pathology dataset" in text and "slides (images/ + masks/" in text, text
    assert "ImageFolder" not in text and "anomaly" not in text
    report = inspect_path(out)
    assert report["layout"] == "pathology" and report["train levels (first slide)"] == "256x256"
    assert report["train slides (with a mask or annotation)"] == "2 (2)"  # the normal slide has an all-zero mask
    assert report["val slides (with a mask or annotation)"].startswith("1 ")
    patches = tmp_path / "patches"  # train/normal + train/tumor patch folders are an ImageFolder too: kept as one
    for split in ("train", "val"):
        for c in ("normal", "tumor"):
            (patches / split / c).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(patches / split / c / "a.png")
    assert inspect_path(patches)["layout"] == "imagefolder"


def test_inspect_exits_2_on_a_slide_or_mask_that_does_not_open(tmp_path, capsys):
    """A slide (or mask) that is not a TIFF stops training with one line naming it; inspect lists it
    in the report and exits 2 (it read only the first slide and said 'none found')."""
    from fastvision.cli import main

    out = tmp_path / "p"
    assert main(["data", "synth", "pathology", str(out), "--slides", "2", "--val-slides", "1", "--size", "256",
                 "--tile", "64"]) == 0
    (out / "train/images/slide_009.tif").write_bytes(b"junk, a failed download")
    (out / "val/masks/slide_000.tif").write_bytes(b"II*\x00 cut short")
    capsys.readouterr()
    report = inspect_path(out)
    assert report["unusable"] == {"train: TIFFs that do not open": 1, "val: TIFFs that do not open": 1}
    assert report["anomalies"]["train: TIFFs that do not open"] == "1 (train/images/slide_009.tif)"
    assert report["anomalies"]["val: TIFFs that do not open"] == "1 (val/masks/slide_000.tif)"
    assert main(["data", "inspect", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2 file(s) would stop training" in err[0]
    with pytest.raises(DataError, match="slide_009.tif"):  # what training says
        DATASETS.build("pathology", {"path": str(out), "patch_size": 64})


def test_a_slide_in_masks_is_one_line_and_a_grey_mask_as_rgb_reads_as_grey(tmp_path):
    """``masks/NAME.tif`` holding the slide itself (channels differ) stops the build naming it (its
    red channel was read as the lesion mask: every tissue patch 'tumour'); a grey mask stored with
    three equal channels gives the grey mask's patch labels."""
    from fastvision.data.formats.pathology import grid_labels
    from fastvision.data.synth.pathology import synth

    out = synth(tmp_path / "p", slides=2, val_slides=1, size=256, tile=64)
    grey = tifffile.imread(out / "train/masks/slide_000.tif")
    rgb = tmp_path / "rgb_mask.tif"
    tifffile.imwrite(rgb, np.repeat(grey.reshape(256, 256, 1), 3, axis=2), tile=(64, 64), photometric="rgb")
    want = grid_labels(TiledTiff(out / "train/masks/slide_000.tif"), 256, 256, 32)
    assert grid_labels(TiledTiff(rgb), 256, 256, 32) == want and any(label == 1 for *_, label in want)
    (out / "train/masks/slide_000.tif").write_bytes((out / "train/images/slide_000.tif").read_bytes())
    with pytest.raises(DataError, match=r"masks/slide_000\.tif: 3 channels that differ"):
        DATASETS.build("pathology", {"path": str(out), "patch_size": 32})


@pytest.mark.parametrize("key,value", [("patch_size", 0), ("level", -1)])
def test_a_patch_size_or_level_no_slide_has_is_one_line(tmp_path, key, value):
    """patch_size=0 stopped the first step ('height and width must be > 0'), after the run folder."""
    from fastvision.data.synth.pathology import synth
    from fastvision.errors import ConfigError

    out = synth(tmp_path / "p", slides=1, val_slides=1, size=128, tile=64)
    with pytest.raises(ConfigError, match=rf"^data\.args\.{key}={value}: "):
        DATASETS.build("pathology", {"path": str(out), "patch_size": 32, key: value})
