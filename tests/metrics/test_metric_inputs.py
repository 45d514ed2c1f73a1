"""``fastvision froc`` and ``fastvision cv``: settings out of range, an empty mask folder, runs of different
training, and a --json that is a folder or an existing file are one line (exit 2); one run's std is left out."""
from __future__ import annotations

import json

import numpy as np
import pytest
import tifffile

from tests.cli.input_checks import guarded_json, one_line_error, run_cli


def _slides(tmp_path, lesion=True):
    """Two 16x16 heat maps (as predict names them: a hit on slide a, false positives on b) and a mask 2x larger."""
    hd, md = tmp_path / "heat", tmp_path / "masks"
    hd.mkdir()
    md.mkdir()
    for name, peaks in (("a", [(3, 3, 0.9)]), ("b", [(10, 10, 0.6), (2, 12, 0.55)])):
        heat = np.zeros((16, 16), np.float32)
        for y, x, prob in peaks:
            heat[y, x] = prob
        tifffile.imwrite(hd / f"{name}_heatmap.tif", heat)
    mask = np.zeros((32, 32), np.uint8)
    if lesion:
        mask[4:10, 4:10] = 1
    tifffile.imwrite(md / "a.tif", mask)
    return hd, md


@pytest.mark.parametrize("flag,value", [
    ("--mask-downsample", "0"), ("--um-per-px", "0"), ("--stride", "0"), ("--nms-radius", "-1"),
    ("--threshold", "2"), ("--threshold", "-0.1"), ("--dilation-px", "-1"), ("--itc-max-px", "-1"),
])
def test_froc_refuses_settings_out_of_range(flag, value, tmp_path, capsys):
    hd, md = _slides(tmp_path)
    code, _, err = run_cli(capsys, "froc", hd, md, flag, value)
    one_line_error(code, err, f"{flag} {value}")


@pytest.mark.parametrize("lesion", [None, False])
def test_froc_without_any_lesion_names_the_mask_folder(lesion, tmp_path, capsys):
    hd, md = _slides(tmp_path, lesion=bool(lesion))
    if lesion is None:  # an empty mask folder
        (md / "a.tif").unlink()
    code, out, err = run_cli(capsys, "froc", hd, md)
    one_line_error(code, err, str(md), "no masks" if lesion is None else "no lesion")
    assert "FROC" not in out


def test_froc_json_is_not_replaced_without_force_nor_a_folder(tmp_path, capsys):
    hd, md = _slides(tmp_path)
    assert json.loads(guarded_json(capsys, ["froc", hd, md], tmp_path).read_text())["froc"] == 1.0


def _run(path, recipe="spleen", data=("decathlon", "sp"), fold=0, dice=0.8):
    path.mkdir(parents=True)
    cfg = {"recipe": recipe, "data": {"name": data[0], "args": {"path": data[1], "fold": fold}}}
    lines = [{"type": "LOG", "step": "PARAMETER", "data": {"config": cfg}},
             {"type": "LOG", "step": [0], "data": {"dice": dice}}, {"type": "LOG", "step": [], "data": {"dice": dice}}]
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


@pytest.mark.parametrize("other,needle", [
    ({"recipe": "unet2d-microscopy", "data": ("microscopy", "mic")}, "recipe"),
    ({"data": ("decathlon", "liver")}, "data"),
])
def test_cv_refuses_runs_of_different_training(other, needle, tmp_path, capsys):
    a = _run(tmp_path / "fold-0-of-spleen")
    b = _run(tmp_path / "other-run", fold=1, **other)
    code, out, err = run_cli(capsys, "cv", a, b)
    one_line_error(code, err, str(a), str(b), needle)
    assert "cross-validation over" not in out
    c = _run(tmp_path / "f1", data=("decathlon", "/elsewhere/sp"), fold=1, dice=0.6)  # the same folder's name
    code, out, _ = run_cli(capsys, "cv", a, c)
    assert code == 0 and "0.7000" in out and "0.1000" in out  # folds of one training still average


def test_cv_one_run_leaves_std_out_and_warns(tmp_path, capsys):
    a = _run(tmp_path / "f0", dice=0.6)
    code, out, err = run_cli(capsys, "cv", a, "--json", tmp_path / "cv.json")
    assert code == 0 and "0.6000" in out and "0.0000" not in out
    assert "one run" in err and "std" in err
    assert json.loads((tmp_path / "cv.json").read_text())["std"] == {"dice": None}


def test_cv_json_is_not_replaced_without_force_nor_a_folder(tmp_path, capsys):
    a, b = _run(tmp_path / "f0"), _run(tmp_path / "f1", fold=1)
    assert json.loads(guarded_json(capsys, ["cv", a, b], tmp_path).read_text())["mean"]["dice"] == pytest.approx(0.8)


def test_froc_refuses_a_picture_as_mask_and_reads_a_grey_mask_saved_as_rgb(tmp_path, capsys):
    """The slide folder given for the masks (RGB, channels differ) is one line naming the file (its red
    channel was read as the mask: every tissue pixel a lesion); a grey mask stored as RGB scores as
    the grey one."""
    from PIL import Image

    hd, md = _slides(tmp_path)
    code, _, _ = run_cli(capsys, "froc", hd, md, "--json", tmp_path / "grey.json")
    want = json.loads((tmp_path / "grey.json").read_text())
    mask = tifffile.imread(md / "a.tif")
    (md / "a.tif").unlink()
    Image.fromarray(np.repeat(mask[..., None] * 255, 3, axis=2)).save(md / "a.png")  # grey as RGB
    code, out, _ = run_cli(capsys, "froc", hd, md, "--json", tmp_path / "rgb.json")
    assert code == 0 and json.loads((tmp_path / "rgb.json").read_text()) == want
    rng = np.random.default_rng(0)
    tifffile.imwrite(md / "b.tif", rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))  # a slide's pixels
    code, out, err = run_cli(capsys, "froc", hd, md)
    one_line_error(code, err, str(md / "b.tif"), "channels that differ")


def test_froc_places_cells_at_the_stride_predict_recorded(tmp_path):
    """A 1000 px slide cut into 64 px patches gives a 15-row heat map: mask height // heat height is
    66, not 64, and a lesion at the last cell was scored as missed (FROC 0.75 instead of 1.0 on a
    480 px generated set); predict records its stride in the heat map and froc uses it."""
    from fastvision.data.formats.heatmap import heatmap_stride, write_heatmap
    from fastvision.metrics.froc import froc_files

    hd, md = tmp_path / "heat", tmp_path / "masks"
    md.mkdir()
    heat = np.zeros((15, 15), np.float32)
    heat[14, 14] = 0.9  # the cell of the patch at (896, 896): centre 928
    heat[2, 2] = 0.6  # a false positive (the challenge's curve drops the lowest probability: keep one below)
    mask = np.zeros((1000, 1000), np.uint8)
    mask[920:937, 920:937] = 1
    tifffile.imwrite(md / "s.tif", mask, tile=(256, 256))
    tif, png = write_heatmap(heat, hd / "s_heatmap", stride=64)
    assert heatmap_stride(tif) == 64 and heatmap_stride(png) == 64
    assert froc_files(hd, md)["froc"] == 1.0
    tif.unlink()  # the PNG alone carries it too
    assert froc_files(hd, md)["froc"] == 1.0
    write_heatmap(heat, tmp_path / "other" / "s_heatmap")  # another tool's map: no record, the old default
    assert heatmap_stride(tmp_path / "other" / "s_heatmap.tif") is None
    assert froc_files(tmp_path / "other", md)["froc"] == 0.0
    assert froc_files(tmp_path / "other", md, stride=64)["froc"] == 1.0


def test_froc_looks_cells_up_at_their_overlapping_patch_centre(tmp_path):
    """With ``heatmap_stride`` 32 under 64 px patches, cell 10 scored the patch at 320-384 (centre
    352) but froc looked it up at 10.5 * 32 = 336, a quarter patch off, and a 13 px lesion at the
    patch centre counted as missed; predict records the patch and froc looks up its centre."""
    from fastvision.data.formats.heatmap import heatmap_patch, write_heatmap
    from fastvision.metrics.froc import froc_files

    hd, md = tmp_path / "heat", tmp_path / "masks"
    md.mkdir()
    heat = np.zeros((31, 31), np.float32)  # 1000 // 32 rows; (1000 - 64) // 32 + 1 = 30 of them scored
    heat[10, 10] = 0.9
    heat[25, 3] = 0.6  # a false positive below it
    mask = np.zeros((1000, 1000), np.uint8)
    mask[346:359, 346:359] = 1  # around (352, 352)
    tifffile.imwrite(md / "s.tif", mask, tile=(256, 256))
    tif, _ = write_heatmap(heat, hd / "s_heatmap", stride=32, patch=64)
    assert heatmap_patch(tif) == 64
    assert froc_files(hd, md)["froc"] == 1.0
    assert froc_files(hd, md, patch=32)["froc"] == 0.0  # the stride's own centre: the old lookup
    assert froc_files(hd, md, stride=32, patch=64, mask_downsample=2)["froc"] == 1.0
    write_heatmap(heat, tmp_path / "old" / "s_heatmap", stride=32)  # a map recorded before the patch was
    assert heatmap_patch(tmp_path / "old" / "s_heatmap.tif") is None
    assert froc_files(tmp_path / "old", md)["froc"] == 0.0
    assert froc_files(tmp_path / "old", md, patch=64)["froc"] == 1.0
