"""NaN / Inf in input files (``data.args.nonfinite``): a float TIFF of a microscopy folder and a
NIfTI volume of a Decathlon folder, written with tifffile / nibabel (the real formats).

``error`` (default): `fastvision train` exits 2 with one line naming the file, as nnU-Net's dataset
integrity check refuses NaN images; ``zero``: the run trains, its weights are finite, and one
warning names the file. `fastvision data inspect` lists the file and exits 2. On the code before
this check the microscopy run exited 0 with "1 step(s) skipped" and a NaN validation loss.
"""
from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from fastvision.cli import main
from fastvision.data.nonfinite import NonFinite, count_nonfinite
from fastvision.errors import ConfigError, DataError

TINY_2D = ["--epochs", "1", "--batch-size", "4", "--device", "cpu", "--set", "data.args.image_size=[32,32]",
           "--set", "model.args.filters=[4,8,16]", "--set", "data.num_workers=0", "--set", "examples=0"]
TINY_3D = ["--set", "data.args.patch_size=[32,32,32]", "--set", "task.args.sliding_window.roi_size=[32,32,32]",
           "--set", "train.epochs=1", "--set", "train.steps_per_epoch=2", "--set", "train.batch_size=1",
           "--set", "data.num_workers=0", "--set", "examples=0", "--set", "train.target=null",
           "--set", "train.amp=off", "--set", "train.device=cpu"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """3-D datasets cache preprocessed cases under FASTVISION_CACHE: keep them in the test's folder."""
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "fastvision-cache"))


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("values,dtype,expected", [
    ([1.0, 2.0, 3.0], np.float32, 0),
    ([1.0, NAN, 3.0, NAN], np.float32, 2),
    ([INF, 1.0], np.float32, 1),
    ([INF, -INF, 0.0], np.float32, 2),      # their sum is NaN
    ([1e308, 1e308, -1e308], np.float64, 0),  # the float64 sum overflows, every value is finite
    ([3e38, 3e38], np.float32, 0),          # so does the float32 sum
    ([60000.0, 60000.0, NAN], np.float16, 1),
    ([1e308, 1e308, NAN], np.float64, 1),
    ([1, 2, 3], np.int16, 0),
    ([], np.float32, 0),
])
def test_count_nonfinite_equals_numpy_elementwise(values, dtype, expected):
    a = np.array(values, dtype=dtype).reshape(-1)
    assert count_nonfinite(a) == expected == int((~np.isfinite(a.astype(np.float64))).sum())


def test_policy_checked_and_zero_replaces_with_one_warning_per_file(caplog, fresh_logging):
    with pytest.raises(ConfigError, match="data.args.nonfinite must be one of error, zero"):
        NonFinite("skip")
    a = np.array([[1.0, NAN], [-INF, 4.0]], np.float32)
    with pytest.raises(DataError, match=r"^f\.tif: 2 NaN/Inf value\(s\)"):
        NonFinite("error")(a, "f.tif")
    zero = NonFinite("zero")
    with caplog.at_level(logging.WARNING):
        out = [zero(a, "f.tif") for _ in range(3)]
    want = "f.tif: 2 NaN/Inf value(s) read as 0 (data.args.nonfinite=zero)"
    assert [r.getMessage() for r in caplog.records] == [want]
    np.testing.assert_array_equal(out[-1], [[1.0, 0.0], [0.0, 4.0]])
    assert np.isnan(a[0, 1])  # the decoded array is not modified in place


def _microscopy_with_nan(tiny_microscopy, tmp_path):
    """The 16-pair folder with one image replaced by a float32 TIFF holding a 6x6 NaN patch."""
    data = shutil.copytree(tiny_microscopy, tmp_path / "data")
    png = data / "images" / "img_0005.png"
    img = np.asarray(Image.open(png)).astype(np.float32) / 255
    img[10:16, 10:16] = np.nan
    png.unlink()
    tifffile.imwrite(data / "images" / "img_0005.tif", img)
    return data, data / "images" / "img_0005.tif"


def _spleen_with_nan(tmp_path):
    """Five synthetic spleen CT cases; case 2's image rewritten as float32 NIfTI with NaN voxels."""
    import nibabel as nib

    from fastvision.data.synth import load_all

    data = load_all().get("spleen")(tmp_path / "data", seed=0, cases=5, test_cases=0, size=24)
    path = data / "imagesTr" / "spleen_2.nii.gz"
    im = nib.load(str(path))
    arr = np.asarray(im.dataobj).astype(np.float32)
    arr[5:9, 5:9, 2:4] = np.nan
    nib.save(nib.Nifti1Image(arr, im.affine), str(path))
    return data, path


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("fastvision: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _finite_weights(run) -> None:
    state = torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    bad = [k for k, v in state["model"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
    assert not bad, bad


def _train(kind, data, tmp_path, *extra):
    if kind == "microscopy":
        return main(["train", "unet2d-microscopy", "--data", str(data), "--out", str(tmp_path / "run"), *TINY_2D,
                     *extra])
    return main(["train", "unet3d-spleen-fast", "--data", str(data), "--out", str(tmp_path / "run"), *TINY_3D,
                 *extra])


@pytest.mark.parametrize("kind", ["microscopy", "nifti"])
def test_nan_file_stops_training_naming_it(kind, tiny_microscopy, tmp_path, capsys):
    data, bad = _microscopy_with_nan(tiny_microscopy, tmp_path) if kind == "microscopy" else _spleen_with_nan(tmp_path)
    code = _train(kind, data, tmp_path)
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and str(bad) in line and "NaN/Inf" in line and "data.args.nonfinite=zero" in line


@pytest.mark.parametrize("kind", ["microscopy", "nifti"])
def test_nonfinite_zero_trains_finite_and_warns_naming_the_file(kind, tiny_microscopy, tmp_path, capsys,
                                                                fresh_logging):
    data, bad = _microscopy_with_nan(tiny_microscopy, tmp_path) if kind == "microscopy" else _spleen_with_nan(tmp_path)
    code = _train(kind, data, tmp_path, "--set", "data.args.nonfinite=zero")
    err = capsys.readouterr().err
    assert code == 0, err
    warned = [ln for ln in err.splitlines() if "NaN/Inf" in ln]
    assert len(warned) == 1 and str(bad) in warned[0] and "read as 0" in warned[0], warned
    assert "skipped" not in err  # no step met a NaN
    _finite_weights(tmp_path / "run")
    metrics = [ln for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"val_loss"' in ln]
    assert metrics and all("NaN" not in ln for ln in metrics)


@pytest.mark.parametrize("kind", ["microscopy", "nifti"])
def test_data_inspect_lists_the_nan_file_and_exits_2(kind, tiny_microscopy, tmp_path, capsys):
    data, bad = _microscopy_with_nan(tiny_microscopy, tmp_path) if kind == "microscopy" else _spleen_with_nan(tmp_path)
    code = main(["data", "inspect", str(data)])
    out, err = capsys.readouterr()
    assert code == 2 and "NaN/Inf" in _one_error_line(err)
    assert bad.name in out and "NaN/Inf" in out
