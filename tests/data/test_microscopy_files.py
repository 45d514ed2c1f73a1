"""Microscopy folders in the shapes labs save them (the formats walk of 2026-12-07): planar RGB TIFFs,
OME-TIFF names in split lists, masks saved with a ``_mask`` suffix, plates in sub-folders."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import tifffile
from PIL import Image

from fastvision.data.formats.microscopy import header_shape, pair_files
from fastvision.data.inspect import inspect_path
from fastvision.errors import DataError
from fastvision.registry import DATASETS

H, W = 24, 40
pytestmark = pytest.mark.usefixtures("fresh_logging")


def _folder(root: Path, stems=("a", "b", "c", "d")) -> Path:
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    rng = np.random.default_rng(0)
    for s in stems:
        Image.fromarray(rng.integers(0, 255, (H, W), np.uint8)).save(root / f"images/{s}.png")
        Image.fromarray((rng.random((H, W)) > 0.5).astype(np.uint8) * 255).save(root / f"masks/{s}.png")
    return root


def test_a_planar_rgb_tiff_is_its_height_and_width_not_a_size_mismatch(tmp_path):
    """tifffile writes a (3, H, W) array as one planar RGB page (axes SYX): its header is (H, W), so the
    builder's up-front check no longer stops on 'image is (3, H) but mask is (H, W)', and the item is RGB."""
    root = _folder(tmp_path / "d")
    rgb = np.random.default_rng(1).integers(0, 255, (3, H, W), np.uint8)
    (root / "images/a.png").unlink()
    tifffile.imwrite(root / "images/a.tif", rgb, photometric="rgb", planarconfig="separate")
    assert tifffile.TiffFile(root / "images/a.tif").pages[0].axes == "SYX"
    assert header_shape(root / "images/a.tif") == (H, W)
    (root / "tr.txt").write_text("a\nb\nc\n")
    (root / "va.txt").write_text("d\n")
    splits = DATASETS.build("microscopy", {"path": str(root), "image_size": [H, W], "channels": 3,
                                           "train_list": "tr.txt", "val_list": "va.txt"})
    item = splits.train[0]
    assert item["id"] == "a" and item["image"].shape == (3, H, W)
    np.testing.assert_allclose(item["image"].numpy(), rgb / 255.0, atol=1e-6)


def test_ome_tiff_stems_name_split_lists_and_items(tmp_path):
    """``a.ome.tif`` pairs with ``a.png`` by the stem ``a``: a split list naming ``a`` finds it (it was
    'unknown image stem') and the item's id (overlay names) is ``a``, not ``a.ome``."""
    root = _folder(tmp_path / "d")
    (root / "images/a.png").unlink()
    tifffile.imwrite(root / "images/a.ome.tif", np.full((H, W), 7, np.uint8))
    (root / "tr.txt").write_text("b\nc\nd\n")
    (root / "va.txt").write_text("a\n")
    splits = DATASETS.build("microscopy", {"path": str(root), "image_size": [H, W],
                                           "train_list": "tr.txt", "val_list": "va.txt"})
    assert [splits.val[i]["id"] for i in range(len(splits.val))] == ["a"]
    assert float(splits.val[0]["image"].max()) == pytest.approx(7 / 255)


def test_a_mask_saved_with_a_suffix_is_named_in_the_line(tmp_path, capsys):
    """``a.png`` + ``a_mask.png`` (or ``_label``): the one line names the suffixed mask and the name it
    needs; inspect's row says the same; a mask of another image (``ab.png`` for ``a``) is no hint."""
    root = _folder(tmp_path / "d", stems=("a", "ab", "b"))
    (root / "masks/a.png").rename(root / "masks/a_mask.png")
    with pytest.raises(DataError, match=r"images/a.png: no mask with the same stem .*masks/a_mask.png has the "
                                        r"stem plus '_mask'.* rename it a.png\)$"):
        pair_files(root)
    (root / "masks/b.png").rename(root / "masks/b_label.tif")
    rows = inspect_path(root)["anomalies"]
    [text] = [v for k, v in rows.items() if "without a mask" in k]
    assert "a_mask.png" in text and "b_label.tif" in text and "rename it b.tif" in text
    (root / "masks/a_mask.png").rename(root / "masks/x.png")
    with pytest.raises(DataError, match=r"images/a.png: no mask with the same stem in \S+$"):  # ab.png: no hint
        pair_files(root)


def test_plates_in_sub_folders_are_said_once_not_dropped_silently(tmp_path, caplog):
    """``images/plate1/`` and ``masks/plate1/``: training warns once naming both and the file counts
    (pairs are the files directly in images/ and masks/), and inspect lists them as an anomaly."""
    root = _folder(tmp_path / "d")
    for sub in ("images", "masks"):
        (root / sub / "plate1").mkdir()
        for s in ("c", "d"):
            (root / sub / f"{s}.png").rename(root / sub / "plate1" / f"{s}.png")
    with caplog.at_level(logging.WARNING, logger="fastvision"):
        splits = DATASETS.build("microscopy", {"path": str(root), "image_size": [H, W], "val_fraction": 0.5})
    assert len(splits.train) + len(splits.val) == 2
    [msg] = [r.getMessage() for r in caplog.records if "sub-folder" in r.getMessage()]
    assert "images/plate1 (2)" in msg and "masks/plate1 (2)" in msg
    rows = inspect_path(root)["anomalies"]
    [text] = [v for k, v in rows.items() if "sub-folders not read" in k]
    assert text.startswith("2 (") and "images/plate1 (2)" in text


def test_a_two_valued_mask_offers_binarize_first(tmp_path):
    """A 0/128 mask was told 'class indices 0..128? set data.args.num_classes=129'; it is a binary mask, so
    the line offers binarize first, and with it the mask reads as background / foreground."""
    root = _folder(tmp_path / "d", stems=("a",))
    m = np.zeros((H, W), np.uint8)
    m[2:9, 3:20] = 128
    Image.fromarray(m).save(root / "masks/a.png")
    from fastvision.data.formats.microscopy import MicroscopyDataset

    with pytest.raises(DataError, match=r"masks/a.png: mask values \[0, 128\] outside 0..1 \(binary 0/128\? set "
                                        r"data.args.binarize=true.*; class indices 0..128\?"):
        MicroscopyDataset(pair_files(root), (H, W), "resize", 1, 2)[0]
    label = MicroscopyDataset(pair_files(root), (H, W), "resize", 1, 2, binarize=True)[0]["label"]
    assert label.numpy().tolist() == (m > 0).astype(np.int64).tolist()


def test_skip_unreadable_skips_truncated_files_whose_header_decodes(tmp_path, caplog):
    """A TIFF and a PNG cut short keep a readable header: skip_unreadable kept them and the run stopped on
    them when read ('image file is truncated'); now the pairs are dropped up front in its one warning, as
    inspect lists them, and an empty file is dropped as before."""
    root = _folder(tmp_path / "d", stems=("a", "b", "c", "d", "e"))
    (root / "images/a.png").unlink()
    tifffile.imwrite(root / "images/a.tif", np.random.default_rng(2).integers(0, 65535, (H, W), np.uint16))
    data = (root / "images/a.tif").read_bytes()
    (root / "images/a.tif").write_bytes(data[: len(data) // 2])
    data = (root / "masks/b.png").read_bytes()
    (root / "masks/b.png").write_bytes(data[: len(data) // 2])
    (root / "images/c.png").write_bytes(b"")
    assert header_shape(root / "images/a.tif") == (H, W) and header_shape(root / "masks/b.png") == (H, W)
    with caplog.at_level(logging.WARNING, logger="fastvision"):
        splits = DATASETS.build("microscopy", {"path": str(root), "image_size": [H, W], "val_fraction": 0.5,
                                               "skip_unreadable": True})
    ids = {s[i]["id"] for s in (splits.train, splits.val) for i in range(len(s))}  # every kept item reads
    assert ids == {"d", "e"}
    [msg] = [r.getMessage() for r in caplog.records if "skip_unreadable" in r.getMessage()]
    assert "skipped 3 unreadable file(s)" in msg
    rows = inspect_path(root)["anomalies"]
    assert [v for k, v in rows.items() if "unreadable" in k][0].startswith("3 (")


def test_a_four_channel_stack_keeps_its_fourth_channel_and_only_alpha_is_dropped(tmp_path):
    """Every 4-channel image was taken for RGBA: a 4-channel ImageJ stack (DAPI, GFP, RFP, Cy5) lost its
    fourth channel silently (channels 1 averaged the other three). Now it stops naming the file, while a
    real alpha (RGBA PNG, grey + alpha PNG, an RGBA TIFF's extra sample) is dropped where it is read."""
    from fastvision.data.formats.microscopy import MicroscopyDataset, read_array

    root = _folder(tmp_path / "d", stems=("a",))
    (root / "images/a.png").unlink()
    stack = np.stack([np.zeros((H, W), np.uint16)] * 3 + [np.full((H, W), 65535, np.uint16)])
    tifffile.imwrite(root / "images/a.tif", stack, imagej=True, metadata={"axes": "CYX"})
    for channels in (1, 3):
        with pytest.raises(DataError, match=rf"images/a.tif: has 4 channels, recipe expects {channels}"):
            MicroscopyDataset(pair_files(root), (H, W), "resize", channels, 2)[0]
    rgba = np.random.default_rng(3).integers(0, 255, (H, W, 4), np.uint8)
    tifffile.imwrite(tmp_path / "rgba.tif", rgba, photometric="rgb", extrasamples=["unassalpha"])
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    Image.fromarray(rgba[..., :2], "LA").save(tmp_path / "la.png")
    for name in ("rgba.tif", "rgba.png"):
        np.testing.assert_array_equal(read_array(tmp_path / name), rgba[..., :3])
    np.testing.assert_array_equal(read_array(tmp_path / "la.png"), rgba[..., 0])


def test_a_palette_mask_is_its_class_ids(tmp_path):
    """A label PNG in palette mode (labelme, VOC: index 1 drawn red) was converted to its colours and
    refused as a 'colour mask'; as a mask its indices are the classes (an image in palette mode is still
    its colours)."""
    from fastvision.data.formats.microscopy import MicroscopyDataset

    root = _folder(tmp_path / "d", stems=("a",))
    ids = np.zeros((H, W), np.uint8)
    ids[5:15, 4:30] = 1
    m = Image.fromarray(ids, "P")
    m.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    m.save(root / "masks/a.png")
    label = MicroscopyDataset(pair_files(root), (H, W), "resize", 1, 2)[0]["label"]
    np.testing.assert_array_equal(label.numpy(), ids.astype(np.int64))
    assert inspect_path(root)["mask encodings (files)"] == {"0/1": 1}


def test_inspect_gives_a_range_per_dtype_and_names_12_bit_images_in_16_bits(tmp_path):
    """One range over 8- and 16-bit images ('0 .. 64953') mixed scales that training divides by different
    maxima; the range is per image dtype, and 16-bit images that use 0..4095 (a 12-bit camera), which
    training reads as 0..0.06, are named with their maximum (they still train: the row is no stop)."""
    root = _folder(tmp_path / "d", stems=("a", "b", "c"))
    (root / "images/a.png").unlink()
    tifffile.imwrite(root / "images/a.tif", np.full((H, W), 4095, np.uint16))
    (root / "images/b.png").unlink()
    tifffile.imwrite(root / "images/b.tif", np.full((H, W), 60000, np.uint16))
    Image.fromarray(np.full((H, W), 200, np.uint8)).save(root / "images/c.png")
    report = inspect_path(root)
    assert report["intensity range"] == "uint16 4095 .. 60000, uint8 200 .. 200"
    [(kind, text)] = [(k, v) for k, v in report["anomalies"].items() if "12-bit" in k]
    assert text == "1 (a.tif (max 4095 of 65535))"
    assert report["pairs"] == 3 and not report["unusable"]


def test_a_z_or_t_stack_stops_the_build_not_the_first_epoch(tmp_path):
    """A Z stack was refused only when read, inside the first epoch, after the run folder was made; its
    series axes are in the header, so the build refuses it naming the file. A hyperstack whose Z and T
    are 1 (axes TZCYX, three channels) is no stack and builds."""
    root = _folder(tmp_path / "d", stems=("a", "b", "c"))
    (root / "images/a.png").unlink()
    tifffile.imwrite(root / "images/a.tif", np.zeros((5, H, W), np.uint16), imagej=True, metadata={"axes": "ZYX"})
    args = {"path": str(root), "image_size": [H, W], "channels": 3}
    with pytest.raises(DataError, match=r"images/a.tif: a Z stack of 5 planes"):
        DATASETS.build("microscopy", args)
    tifffile.imwrite(root / "images/a.tif", np.zeros((1, 1, 3, H, W), np.uint16), imagej=True,
                     metadata={"axes": "TZCYX"})
    splits = DATASETS.build("microscopy", args)
    assert len(splits.train) + len(splits.val) == 3


def test_tif_and_tiff_in_any_case_are_one_extension_for_inspect():
    """``a.TIF`` + ``a.tiff`` was an anomaly 'masks with another extension than their image'; only a PNG
    beside a TIFF is."""
    from fastvision.data.formats.microscopy_check import MaskTally

    tally = MaskTally()
    img, mask = np.zeros((2, 2), np.uint8), np.array([[0, 1], [1, 0]], np.uint8)
    tally.add(img, mask, Path("a.TIF"), Path("a.tiff"))
    tally.add(img, mask, Path("b.Tif"), Path("b.TIF"))
    tally.add(img, mask, Path("c.png"), Path("c.tif"))
    assert tally.anomalies == {"masks with another extension than their image (paired by stem)": ["c.png+c.tif"]}


@pytest.mark.parametrize(("size", "needle"), [
    ("[40,40]", "data.args.image_size=[40, 40]: each side must be a multiple of the model's divisor [16, 16]"),
    ("[64,0]", "data.args.image_size must be [H, W] with sides >= 1, got [64, 0]"),
    ("[64,64,64]", "data.args.image_size must be [H, W] with sides >= 1, got [64, 64, 64]")])
def test_an_image_size_the_unet_cannot_take_is_one_line_before_the_run_folder(tmp_path, capsys, size, needle):
    """image_size [40, 40] (not a multiple of 16) stopped the first step ('U-Net input sizes ... must be
    divisible', naming no key) after the run folder was made; [64, 0] was torch's interpolate error. Both
    are one line naming data.args.image_size now, and no run folder is left."""
    from fastvision.cli import main

    root = _folder(tmp_path / "d")
    code = main(["train", "unet2d-microscopy", "--data", str(root), "--out", str(tmp_path / "run"), "--epochs", "1",
                 "--device", "cpu", "--set", f"data.args.image_size={size}", "--set", "data.num_workers=0"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert needle in err.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()


def test_lzw_tiffs_read_without_imagecodecs(tmp_path):
    """LZW (what Fiji, ZEN and Photoshop write) needs the optional imagecodecs for tifffile: such an image
    passed the header checks and stopped the first epoch ('requires the imagecodecs package'); Pillow
    decodes it now, a 16-bit grey page, an RGB page and a 3-page stack (channels) alike, and so does the
    skip_unreadable probe, which dropped every such file as unreadable."""
    pytest.importorskip("PIL.TiffImagePlugin")
    from fastvision.data.formats.microscopy import MicroscopyDataset, read_array
    from fastvision.data.formats.microscopy_files import decodes

    rng = np.random.default_rng(4)
    grey, rgb = rng.integers(0, 65535, (H, W), np.uint16), rng.integers(0, 255, (H, W, 3), np.uint8)
    Image.fromarray(grey).save(tmp_path / "g.tif", compression="tiff_lzw")
    Image.fromarray(rgb).save(tmp_path / "rgb.tif", compression="tiff_lzw")
    Image.fromarray(rgb[..., 0]).save(tmp_path / "p3.tif", compression="tiff_lzw", save_all=True,
                                      append_images=[Image.fromarray(rgb[..., 1]), Image.fromarray(rgb[..., 2])])
    for name, want in (("g.tif", grey), ("rgb.tif", rgb), ("p3.tif", rgb)):
        np.testing.assert_array_equal(read_array(tmp_path / name), want)
        decodes(tmp_path / name)
    root = _folder(tmp_path / "d", stems=("a",))
    (root / "images/a.png").unlink()
    Image.fromarray(grey).save(root / "images/a.tif", compression="tiff_lzw")
    item = MicroscopyDataset(pair_files(root), (H, W), "resize", 1, 2)[0]
    np.testing.assert_allclose(item["image"][0].numpy(), grey / 65535.0, atol=1e-6)
