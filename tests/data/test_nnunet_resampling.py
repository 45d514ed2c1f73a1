"""``data.args.resample: nnunet``: nnU-Net v2's crop -> normalise -> resample, its grid, its spline and label rules.

References: hand-computed cases, scipy's ``map_coordinates`` at the sample points nnU-Net's resize uses (another
code path than the ``zoom`` the module calls), and, where installed (nnU-Net's own environment), scikit-image's
``resize`` and batchgenerators' ``resize_segmentation``, the calls nnU-Net makes.
"""
from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch

from fastvision.data import nnunet_resampling as nr
from fastvision.data.preprocess3d import PreprocessParams, preprocess_case, restore_to_input
from fastvision.errors import ConfigError

ndimage = pytest.importorskip("scipy.ndimage")


def _smooth(shape, seed=0) -> np.ndarray:
    g = np.meshgrid(*[np.arange(n, dtype=float) for n in shape], indexing="ij")
    rng = np.random.default_rng(seed)
    a, b, c = rng.uniform(0.2, 0.6, 3)
    return 50 * np.sin(a * g[0]) * np.cos(b * g[1]) + 20 * np.sin(c * g[2]) + 10 * rng.standard_normal(shape)


def test_shape_and_coarse_axis_follow_nnunet_rules():
    # compute_new_shape: round(spacing / target * shape)
    assert nr.new_shape((17, 14, 11), (0.8, 1.3, 2.7), (1.5, 1.5, 2.0)) == (9, 12, 15)
    assert nr.coarse_axis((0.8, 0.8, 3.0), (1.0, 1.0, 1.0)) == 2  # 3.75x: the input decides
    assert nr.coarse_axis((1.0, 1.0, 1.0), (1.0, 4.0, 1.0)) == 1  # isotropic input: the target decides
    assert nr.coarse_axis((3.0, 3.0, 0.5), (3.0, 3.0, 0.5)) is None  # two coarsest axes: together
    assert nr.coarse_axis((1.0, 1.2, 2.9), (1.0, 1.2, 2.9)) is None  # 2.9x: below the threshold


def test_image_samples_at_the_pixel_area_centres():
    x = _smooth((13, 10, 7))
    shape = (17, 6, 7)
    got = nr.resize_image(x[None], shape)[0]
    coords = np.meshgrid(*[(np.arange(m) + 0.5) * n / m - 0.5 for n, m in zip(x.shape, shape, strict=True)],
                         indexing="ij")
    want = np.clip(ndimage.map_coordinates(x, np.stack(coords), order=3, mode="nearest"), x.min(), x.max())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    # the affine puts output voxel o where input index (o + 0.5) * n_in / n_out - 0.5 is
    affine = nr.resize_affine(np.diag([2.0, 3.0, 1.5, 1.0]), x.shape, shape)
    o = np.array([4.0, 2.0, 3.0, 1.0])
    idx = (o[:3] + 0.5) * np.array(x.shape) / np.array(shape) - 0.5
    np.testing.assert_allclose((affine @ o)[:3], np.array([2.0, 3.0, 1.5]) * idx)


def test_cubic_spline_reproduces_a_ramp_away_from_the_edges():
    # a B-spline interpolant of a linear function is that function (edge effects decay by 0.27 per voxel)
    x = np.broadcast_to(3.0 * np.arange(40, dtype=float)[:, None, None], (40, 3, 3)).copy()
    got = nr.resize_image(x[None], (70, 3, 3))[0][:, 1, 1]
    idx = (np.arange(70) + 0.5) * 40 / 70 - 0.5
    inner = (idx > 12) & (idx < 27)
    np.testing.assert_allclose(got[inner], 3.0 * idx[inner], atol=1e-4)


def test_label_indicators_linear_then_argmax():
    y = np.zeros((4, 2, 2), np.uint8)
    y[2:] = 1
    # 4 -> 8 along the first axis: samples at -0.25, 0.25, ..., 3.25; voxel 1.25 scores 0.75 / 0.25, 1.75 0.25 / 0.75
    got = nr.resize_label(y, (8, 2, 2))
    np.testing.assert_array_equal(got[:, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1])
    # values between labels never appear (a linear resize of the values would make 1s between 0 and 2)
    z = np.zeros((5, 3, 3), np.uint8)
    z[3:] = 2
    out = nr.resize_label(z, (11, 3, 3))
    assert set(np.unique(out)) == {0, 2} and (np.diff(out[:, 1, 1].astype(int)) >= 0).all()


def test_anisotropic_case_is_nearest_along_its_coarse_axis():
    x = _smooth((9, 9, 4))
    got = nr.resize_image(x[None], (9, 9, 10), axis=2)[0]
    # along the coarse axis each output slice is one input slice: nearest at (o + 0.5) * 4 / 10 - 0.5, a half
    # rounded up (map_coordinates' order 0, what nnU-Net calls): o = 2 samples 0.5 and takes slice 1
    src = np.clip(np.floor((np.arange(10) + 0.5) * 0.4 - 0.5 + 0.5), 0, 3).astype(int)
    assert src.tolist() == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]  # o = 7 samples 2.5: slice 3
    np.testing.assert_allclose(got, x[:, :, src], atol=1e-4)


def _ct_step(tmp_path):
    """8 x 4 x 4 voxels of 1 mm, -1000 HU below x = 4 and 100 HU from there (no zero voxel: no crop)."""
    img = np.full((8, 4, 4), 100.0, np.float32)
    img[:4] = -1000.0
    lab = np.zeros((8, 4, 4), np.uint8)
    lab[5:] = 1
    ip, lp = tmp_path / "ct.nii.gz", tmp_path / "ct_lab.nii.gz"
    nib.save(nib.Nifti1Image(img, np.eye(4)), str(ip))
    nib.save(nib.Nifti1Image(lab, np.eye(4)), str(lp))
    return ip, lp


@pytest.mark.parametrize("resample", ["monai", "nnunet"])
def test_the_window_comes_before_the_resampling_only_for_nnunet(tmp_path, resample):
    ip, lp = _ct_step(tmp_path)
    params = PreprocessParams(target_spacing=(0.5, 1.0, 1.0), intensity="ct", window=(0.0, 100.0, -1.0, 1.0),
                              crop_foreground="nonzero", resample=resample)
    out = preprocess_case({"image": [ip], "label": lp}, params)
    line = out["image"][0, :, 1, 1].numpy()
    if resample == "nnunet":
        assert len(line) == 16  # round(1 / 0.5 * 8)
        # clipped to [-1, 1] first, the step is antisymmetric about x = 3.5: its two neighbours (3.25, 3.75) sum to 0
        assert line[7] + line[8] == pytest.approx(0.0, abs=1e-5)
        assert -1.0 < line[7] < line[8] < 1.0
    else:
        assert len(line) == 15  # MONAI's round((8 - 1) * 1 / 0.5) + 1
        # trilinear in HU first: -1000 + 0.5 * 1100 = -450 at x = 3.5, clipped to -1
        assert line[7] == pytest.approx(-1.0)


def test_crop_comes_before_the_resampling_and_restore_inverts_it(tmp_path):
    img = np.zeros((20, 16, 12), np.float32)
    img[3:17, 2:14, 1:11] = _smooth((14, 12, 10)).astype(np.float32) + 200
    lab = np.zeros(img.shape, np.uint8)
    lab[6:14, 5:11, 3:9] = 1
    affine = np.diag([-0.9, 1.1, 2.3, 1.0])  # flipped along x: RAS mirrors it
    ip, lp = tmp_path / "mr.nii.gz", tmp_path / "mr_lab.nii.gz"
    nib.save(nib.Nifti1Image(img, affine), str(ip))
    nib.save(nib.Nifti1Image(lab, affine), str(lp))
    params = PreprocessParams(target_spacing=(1.5, 1.5, 1.5), intensity="mri", crop_foreground="nonzero",
                              resample="nnunet")
    out = preprocess_case({"image": [ip], "label": lp}, params)
    meta = out["meta"]
    assert meta["cropped_shape"] == [14, 12, 10]
    assert list(out["image"].shape[1:]) == list(nr.new_shape((14, 12, 10), (0.9, 1.1, 2.3), (1.5, 1.5, 1.5)))
    # the voxel size is the crop's extent over the new shape (nnU-Net's target only up to the rounding)
    extent = np.array([0.9, 1.1, 2.3]) * [14, 12, 10]
    np.testing.assert_allclose(meta["spacing"], extent / np.array(out["image"].shape[1:]))
    back = restore_to_input(out["label"], meta)
    assert back.shape == lab.shape
    dice = 2 * ((back == 1) & (lab == 1)).sum() / ((back == 1).sum() + (lab == 1).sum())
    assert dice > 0.9
    probs = torch.stack([1 - out["label"].float(), out["label"].float()])
    p = restore_to_input(probs[0], meta, mode="linear", fill=1.0)
    assert (p[img == 0] == 1.0).all()  # outside the crop: the fill


def test_an_unknown_resample_names_the_key():
    with pytest.raises(ConfigError, match="data.args.resample"):
        PreprocessParams(resample="spline")


def test_against_nnunets_own_calls():
    transform = pytest.importorskip("skimage.transform")
    bg = pytest.importorskip("batchgenerators.augmentations.utils")
    x = _smooth((13, 10, 7), seed=3)
    np.testing.assert_allclose(nr.resize_image(x[None], (17, 6, 9))[0],
                               transform.resize(x, (17, 6, 9), 3, mode="edge", anti_aliasing=False), atol=1e-4)
    rng = np.random.default_rng(1)
    y = (ndimage.gaussian_filter(rng.standard_normal((13, 10, 7)), 1.5) > 0.2).astype(np.int16)
    y[ndimage.gaussian_filter(rng.standard_normal((13, 10, 7)), 1.5) > 0.4] = 2
    for shape in [(17, 6, 9), (26, 20, 14), (7, 5, 7)]:  # the doubled grid ties at every boundary
        np.testing.assert_array_equal(nr.resize_label(y, shape), bg.resize_segmentation(y, shape, 1))
