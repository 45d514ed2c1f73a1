"""Shipping a 2-D segmentation run (the formats walk of 2026-12-07): predict on float TIFFs and OME-TIFF
names, and export at the input the run predicts with (its channels and image size)."""
from __future__ import annotations

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from tests.cli.input_checks import one_line_error, run_cli
from tests.conftest import cli_here

# an RGB run (channels 3) at 32 x 32, where the recipe's task.args.sample_shape is [1, 128, 128]
RGB = ["--epochs", "1", "--batch-size", "4", "--device", "cpu", "--set", "data.args.image_size=[32,32]",
       "--set", "data.args.channels=3", "--set", "model.args.in_channels=3", "--set", "model.args.filters=[4,8,16]",
       "--set", "data.num_workers=0", "--set", "examples=0"]


@pytest.fixture(scope="module")
def rgb_run(tiny_microscopy, tmp_path_factory):
    out = tmp_path_factory.mktemp("rgb") / "run"
    assert cli_here(["train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(out), *RGB]) == 0
    return out


def _float_tiff(path, nan: bool):
    img = np.random.default_rng(0).random((32, 32)).astype(np.float32)
    if nan:
        img[3, 4] = np.nan
    path.parent.mkdir(parents=True, exist_ok=True)
    tifffile.imwrite(path, img)
    return path


def test_a_float_tiff_with_nan_is_one_line_not_an_all_background_mask(rgb_run, tmp_path, capsys):
    """One NaN pixel spread through the convolutions to every logit, and predict wrote an empty mask, exit 0;
    now the run's data.args.nonfinite (error) names the file and nothing is written. A finite float TIFF
    predicts as before."""
    bad = _float_tiff(tmp_path / "in" / "bad.tif", nan=True)
    code, _, err = run_cli(capsys, "predict", rgb_run, bad, "--out", tmp_path / "o", "--device", "cpu")
    one_line_error(code, err, str(bad), "1 NaN/Inf value(s)", "nonfinite",
                   "predict and evaluate follow the run's setting")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
    good = _float_tiff(tmp_path / "in2" / "good.tif", nan=False)
    code, _, err = run_cli(capsys, "predict", rgb_run, good, "--out", tmp_path / "o2", "--device", "cpu")
    assert code == 0, err
    assert tifffile.imread(tmp_path / "o2" / "good_mask.tif").shape == (32, 32)


def test_ome_tiff_outputs_are_named_after_the_stem_and_collide_with_its_plain_twin(rgb_run, tmp_path, capsys,
                                                                                   tiny_microscopy):
    """``a.ome.tif`` writes ``a_mask.tif`` (not ``a.ome_mask.tif``); beside ``a.tif`` both would write it, which
    is refused before anything is written."""
    png = np.asarray(Image.open(next((tiny_microscopy / "images").iterdir())))
    (tmp_path / "in").mkdir()
    tifffile.imwrite(tmp_path / "in" / "a.ome.tif", png)
    code, _, err = run_cli(capsys, "predict", rgb_run, tmp_path / "in", "--out", tmp_path / "o", "--device", "cpu")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["a_mask.tif", "a_overlay.png"]
    tifffile.imwrite(tmp_path / "in" / "a.tif", png)
    code, _, err = run_cli(capsys, "predict", rgb_run, tmp_path / "in", "--out", tmp_path / "o3", "--device", "cpu")
    one_line_error(code, err, "a.tif", "a.ome.tif", "a_mask.*")
    assert not (tmp_path / "o3").exists() or not any((tmp_path / "o3").iterdir())


def test_a_jpeg_among_the_inputs_is_refused_before_any_mask_is_written(rgb_run, tmp_path, capsys, tiny_microscopy):
    """``a.png`` then ``b.jpg``: a.png's mask was written, then b.jpg stopped the command (rerun needs
    --force); now b.jpg is named before anything is written."""
    src = next((tiny_microscopy / "images").iterdir())
    (tmp_path / "in").mkdir()
    Image.open(src).save(tmp_path / "in" / "a.png")
    Image.open(src).save(tmp_path / "in" / "b.jpg")
    code, _, err = run_cli(capsys, "predict", rgb_run, tmp_path / "in", "--out", tmp_path / "o", "--device", "cpu")
    one_line_error(code, err, str(tmp_path / "in" / "b.jpg"), "expected a PNG or TIFF image")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_coco_ids_on_a_segmentation_run_is_one_line(rgb_run, tmp_path, capsys, tiny_microscopy):
    """``--coco-ids`` gives a detection run's detections.json its image ids; a segmentation run writes none."""
    src = next((tiny_microscopy / "images").iterdir())
    code, _, err = run_cli(capsys, "predict", rgb_run, src, "--out", tmp_path / "o", "--device", "cpu",
                           "--coco-ids", "none")
    one_line_error(code, err, "--coco-ids applies to detection runs", "segmentation run")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_export_takes_the_runs_channels_and_image_size(rgb_run, tmp_path, capsys, fmt):
    """An RGB run exported at the recipe's sample_shape (1 channel, 128 x 128) was a conv traceback; it is
    exported at 3 x 32 x 32, what predict feeds it, and the file gives the model's logits on that input."""
    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
    out = tmp_path / f"m.{fmt}"
    code, stdout, err = run_cli(capsys, "export", rgb_run, "--format", fmt, "--out", out)
    assert code == 0, err
    assert "input batchx3x32x32" in stdout
    from fastvision.inference.export import load_model

    model, _, _ = load_model(rgb_run)
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x).numpy()
    if fmt == "onnx":
        import onnxruntime as ort

        sess = ort.InferenceSession(str(out))
        assert sess.get_inputs()[0].shape[1:] == [3, 32, 32]
        got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    else:
        got = torch.jit.load(str(out))(x).detach().numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
