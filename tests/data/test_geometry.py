"""3-D geometry against MONAI: LoadImaged + EnsureChannelFirstd + Orientationd("RAS") + Spacingd,
voxel for voxel, on NIfTI files with flipped, permuted, oblique, sheared and anisotropic affines;
predictions written back into the input's geometry; a label on another grid than its image."""
from __future__ import annotations

import warnings

import nibabel as nib
import numpy as np
import pytest
import torch
from torch import nn

from fastvision.config import RunConfig
from fastvision.data.preprocess3d import (
    PreprocessParams,
    preprocess_case,
    restore_to_input,
)
from fastvision.errors import DataError
from fastvision.inference.nifti import predict_nifti_files
from fastvision.tasks.segment import SegmentationTask

mt = pytest.importorskip("monai.transforms")

SHAPE = (17, 14, 11)
TARGET = (1.5, 1.5, 2.0)
# Image tolerance: MONAI interpolates with grid_sample in float64, fastvision separably in float32;
# both are trilinear at the same points, so they differ by float32 rounding only.
IMAGE_ATOL = 1e-5  # relative to the image's value range


def _rot(axis: int, deg: float) -> np.ndarray:
    t = np.deg2rad(deg)
    i, j = [k for k in range(3) if k != axis]
    r = np.eye(3)
    r[i, i], r[i, j], r[j, i], r[j, j] = np.cos(t), -np.sin(t), np.sin(t), np.cos(t)
    return r


def _affine(block, origin=(5.0, -3.0, 7.0)) -> np.ndarray:
    a = np.eye(4)
    a[:3, :3], a[:3, 3] = block, origin
    return a


AFFINES = {
    "anisotropic": _affine(np.diag([0.8, 1.3, 2.7])),
    "flipped": _affine(np.diag([-0.9, 1.1, -2.3])),
    "permuted": _affine([[0, -1.2, 0], [0, 0, 2.1], [0.7, 0, 0]]),
    "oblique": _affine(_rot(2, 20) @ _rot(0, -12) @ np.diag([0.9, 1.2, 2.2])),
    "sheared": _affine([[0.9, 0.3, 0], [0, 1.2, 0.2], [0, 0, 2.2]]),
}


def _volumes() -> tuple[np.ndarray, np.ndarray]:
    """A smooth image (so trilinear is well conditioned) and a two-class ellipsoid label."""
    idx = np.stack(np.meshgrid(*[np.arange(n) for n in SHAPE], indexing="ij"), -1).astype(np.float64)
    image = 100 * (np.sin(idx[..., 0] / 3) + np.cos(idx[..., 1] / 2) + idx[..., 2] / 5)
    c = np.array(SHAPE) / 2
    inside = (((idx - c) / [5, 4, 3]) ** 2).sum(-1) < 1
    label = inside.astype(np.uint8) + (inside & (idx[..., 0] > c[0] + 2))
    return image.astype(np.float32), label.astype(np.uint8)


def _write(tmp_path, name: str, affine: np.ndarray, label_affine: np.ndarray | None = None):
    image, label = _volumes()
    ip, lp = tmp_path / f"{name}_img.nii.gz", tmp_path / f"{name}_lab.nii.gz"
    nib.save(nib.Nifti1Image(image, affine), str(ip))
    nib.save(nib.Nifti1Image(label, affine if label_affine is None else label_affine), str(lp))
    return ip, lp


def _monai(ip, lp, target=TARGET) -> tuple[dict, object]:
    """MONAI's output and the Compose that made it (its inverse checks it is the same instance)."""
    keys = ["image", "label"]
    t = mt.Compose([mt.LoadImaged(keys), mt.EnsureChannelFirstd(keys), mt.Orientationd(keys, axcodes="RAS"),
                    mt.Spacingd(keys, pixdim=target, mode=("bilinear", "nearest"))])
    return t({"image": str(ip), "label": str(lp)}), t


def _ours(ip, lp, target=TARGET, finite=None) -> dict:
    params = PreprocessParams(target_spacing=target, intensity="none", crop_foreground=False)
    return preprocess_case({"image": [ip], "label": lp}, params, finite)


def _dice(a: np.ndarray, b: np.ndarray) -> float:
    """Mean Dice over the foreground classes present in either."""
    classes = sorted(set(np.unique(a).tolist()) | set(np.unique(b).tolist()) - {0})
    return float(np.mean([2 * ((a == c) & (b == c)).sum() / ((a == c).sum() + (b == c).sum()) for c in classes]))


@pytest.mark.parametrize("name", list(AFFINES))
def test_preprocess_matches_monai_orientation_and_spacing(tmp_path, name):
    ip, lp = _write(tmp_path, name, AFFINES[name])
    (ref, _), got = _monai(ip, lp), _ours(ip, lp)
    want_img, want_lab = ref["image"][0].numpy(), ref["label"][0].numpy()
    assert tuple(got["image"].shape[1:]) == want_img.shape == tuple(got["meta"]["resampled_shape"])
    np.testing.assert_allclose(got["meta"]["affine"].numpy(), ref["image"].affine.numpy(), atol=1e-6)
    np.testing.assert_allclose(got["meta"]["spacing"], TARGET, rtol=1e-9)  # exactly the target
    assert nib.aff2axcodes(got["meta"]["affine"].numpy()) == ("R", "A", "S") or name in ("oblique", "sheared")
    np.testing.assert_allclose(got["image"][0].numpy(), want_img, atol=IMAGE_ATOL * np.ptp(want_img), rtol=0)
    assert _dice(got["label"].numpy(), want_lab) >= 0.98
    assert (got["label"].numpy() != want_lab).mean() <= 0.005  # in practice 0: the same voxels


def test_output_spacing_is_target_not_rounded_extent(tmp_path):
    # 17 voxels of 0.8 mm at 1.5 mm: the old grid kept the 13.6 mm extent in round(9.07) = 9 voxels
    # of 1.511 mm, centred; MONAI (and now fastvision) puts round(16 * 0.8 / 1.5) + 1 = 10 voxels of
    # exactly 1.5 mm with voxel 0 on input voxel 0.
    affine = _affine(np.diag([0.8, 1.3, 2.7]))
    ip, lp = _write(tmp_path, "a", affine)
    meta = _ours(ip, lp)["meta"]
    assert meta["resampled_shape"] == [10, 12, 15]
    np.testing.assert_allclose(meta["affine"].numpy()[:3, 3], affine[:3, 3])
    np.testing.assert_allclose(meta["affine"].numpy()[:3, :3], np.diag(TARGET))


def _inverse_monai(ref: dict, t) -> np.ndarray:
    """MONAI's own inverse of its label (what ``Invertd`` runs), at the input file's indices."""
    return t.inverse(ref)["label"][0].numpy()


@pytest.mark.parametrize("name", list(AFFINES))
def test_restore_to_input_matches_monai_inverse(tmp_path, name):
    ip, lp = _write(tmp_path, name, AFFINES[name])
    ref, t = _monai(ip, lp)
    params = PreprocessParams(target_spacing=TARGET, intensity="none", crop_foreground=True, crop_margin=1)
    got = preprocess_case({"image": [ip], "label": lp}, params)
    back = restore_to_input(got["label"], got["meta"])
    want = _inverse_monai(ref, t)
    assert back.shape == want.shape == SHAPE
    assert _dice(back, want) >= 0.98


class _Threshold(nn.Module):
    """Class 1 where the (unnormalised) image exceeds 50."""

    def forward(self, x):
        return torch.cat([torch.zeros_like(x), x - 50.0], 1)


@pytest.mark.parametrize("name", list(AFFINES))
def test_predict_writes_back_into_input_geometry(tmp_path, name):
    ip, lp = _write(tmp_path, name, AFFINES[name])
    task = SegmentationTask(num_classes=2, sample_shape=[1, 8, 8, 8], loss=nn.MSELoss(),
                            sliding_window={"roi_size": [8, 8, 8], "overlap": 0.5, "mode": "gaussian"})
    cfg = RunConfig()
    cfg.data.name = "decathlon"
    cfg.data.args = {"intensity": "none", "target_spacing": list(TARGET), "crop_foreground": False}
    (out,) = predict_nifti_files(task, _Threshold(), [ip], tmp_path / "pred", cfg, torch.device("cpu"))
    src, got = nib.load(str(ip)), nib.load(str(out))
    assert got.shape == src.shape
    np.testing.assert_allclose(got.affine, src.affine, atol=1e-6)
    # What MONAI's inverse makes of the same probabilities (the threshold's class-1 softmax on its forward
    # grid, inverted bilinearly as the image they sit on), thresholded at 0.5 at the input's indices.
    ref, t = _monai(ip, lp)
    ref["image"].copy_(torch.sigmoid(ref["image"].as_tensor() - 50.0))  # in place: keeps the transform trace
    want = (t.inverse(ref)["image"][0].numpy() > 0.5).astype(np.uint8)
    assert _dice(np.asarray(got.dataobj), want) >= 0.995


def test_label_on_another_grid_is_resampled_with_a_warning(tmp_path):
    # The label file holds the same segmentation on a grid shifted by 2 voxels along i and stored
    # flipped along j: by world position it is the image's label; by index it is not.
    affine = AFFINES["anisotropic"]
    _, label = _volumes()
    shifted = np.zeros_like(label)
    shifted[:-2] = label[2:]  # label voxel i is image voxel i + 2
    lab_affine = affine.copy()
    lab_affine[:3, 3] += affine[:3, 0] * 2
    stored = shifted[:, ::-1].copy()
    lab_affine = lab_affine @ nib.orientations.inv_ornt_aff([[0, 1], [1, -1], [2, 1]], shifted.shape)
    ip, lp = _write(tmp_path, "moved", affine)
    nib.save(nib.Nifti1Image(stored, lab_affine), str(lp))
    params = PreprocessParams(intensity="none", crop_foreground=False)
    with pytest.warns(RuntimeWarning, match="moved_lab.nii.gz.*resampled onto the image grid"):
        got = preprocess_case({"image": [ip], "label": lp}, params)["label"].numpy()
    want = label.copy()
    want[-2:] = 0  # beyond the label file's extent: background
    np.testing.assert_array_equal(got, want)


def test_label_on_the_same_grid_gives_no_warning(tmp_path):
    ip, lp = _write(tmp_path, "same", AFFINES["oblique"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = preprocess_case({"image": [ip], "label": lp}, PreprocessParams(intensity="none", crop_foreground=False))
    np.testing.assert_array_equal(got["label"].numpy(), _ours(ip, lp, target=None)["label"].numpy())


def test_cache_signature_covers_the_resampling_module(monkeypatch):
    import inspect

    from fastvision.data import spatial3d
    from fastvision.data.formats.decathlon import VolumeDataset

    ds = VolumeDataset([], PreprocessParams())
    before = ds.cache_signature()
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda m: real(m) + ("#changed" if m is spatial3d else ""))
    assert ds.cache_signature() != before


def test_a_nan_voxel_stays_local_as_in_monai(tmp_path):
    # The innermost axis is resampled as a product with a weight matrix; a NaN must not take that
    # path (0 * NaN would spread it along the whole line).
    image, label = _volumes()
    image[8, 7, 5] = np.nan
    ip, lp = tmp_path / "nan_img.nii.gz", tmp_path / "nan_lab.nii.gz"
    nib.save(nib.Nifti1Image(image, AFFINES["anisotropic"]), str(ip))
    nib.save(nib.Nifti1Image(label, AFFINES["anisotropic"]), str(lp))
    with pytest.raises(DataError, match=f"{ip}: 1 NaN/Inf"):  # the reader refuses it (data.args.nonfinite)
        _ours(ip, lp)
    # the resampling's own NaN handling (what predict would do with the check bypassed)
    (ref, _), got = _monai(ip, lp), _ours(ip, lp, finite=lambda arr, path: arr)
    want, have = ref["image"][0].numpy(), got["image"][0].numpy()
    np.testing.assert_array_equal(np.isnan(have), np.isnan(want))
    assert 0 < np.isnan(want).sum() <= 8
    ok = ~np.isnan(want)
    np.testing.assert_allclose(have[ok], want[ok], atol=IMAGE_ATOL * np.ptp(want[ok]), rtol=0)
