"""``task.args.sliding_window.style: nnunet``: nnU-Net v2's window steps and Gaussian (hand cases, and nnU-Net's
own functions where nnunetv2 is installed), logits resampled for the export, and ``predict``'s windows on the
arrays as training saw them."""
from __future__ import annotations

import math
from types import SimpleNamespace

import nibabel as nib
import numpy as np
import pytest
import torch
from torch import nn

from fastvision.data.preprocess3d import PreprocessParams, preprocess_case
from fastvision.errors import ConfigError
from fastvision.inference.nifti import labels_on_input, predict_nifti_files
from fastvision.inference.window import importance_map, sliding_window, window_starts
from tests.inference.conftest import resampled_case, scipy_restore


@pytest.mark.parametrize("size,roi,overlap,want", [
    (110, 64, 0.5, [0, 23, 46]),  # the example in nnU-Net's compute_steps_for_sliding_window
    (100, 32, 0.5, [0, 14, 27, 41, 54, 68]),  # 6 windows, 68 / 5 = 13.6 apart
    (10, 5, 0.5, [0, 2, 5]),  # 2.5 rounds half to even, as np.round
    (33, 32, 0.5, [0, 1]),
    (32, 32, 0.5, [0]),
    (20, 32, 0.5, [0]),
])
def test_nnunet_window_starts_hand_cases(size, roi, overlap, want):
    assert window_starts(size, roi, overlap, "nnunet") == want


def test_monai_window_starts_unchanged():
    assert window_starts(100, 32, 0.5) == window_starts(100, 32, 0.5, "monai") == [0, 16, 32, 48, 64, 68]


def test_nnunet_gaussian_hand_values():
    roi = (5, 4, 6)
    w = importance_map(roi, style="nnunet").double()
    c = (2, 2, 3)  # edge // 2, not the window's centre (1.5 on the even axes)
    assert w[c] == w.max() and w.argmax() == np.ravel_multi_index(c, roi)
    sig = [n / 8 for n in roi]
    for v in [(0, 0, 0), (4, 1, 5), (3, 3, 1)]:
        want = math.prod(math.exp(-((a - b) ** 2) / (2 * s * s)) for a, b, s in zip(v, c, sig, strict=True))
        assert float(w[v] / w[c]) == pytest.approx(want, rel=1e-6)


def test_nnunet_gaussian_cut_at_scipys_radius():
    # sigma 2 on a 40-voxel edge: scipy's gaussian_filter reaches int(4 * 2 + 0.5) = 8 voxels from the centre 20
    w = importance_map((40, 3, 3), sigma_scale=0.05, style="nnunet")
    inside = w[12:29]
    assert (inside > 0).all() and torch.equal(w[:12], torch.full_like(w[:12], inside.min().item()))
    assert torch.equal(w[29:], torch.full_like(w[29:], inside.min().item()))


def test_against_nnunets_own_functions():
    sw = pytest.importorskip("nnunetv2.inference.sliding_window_prediction")
    for roi in ([32, 32, 24], [25, 33, 7], [5, 6, 9]):
        g = sw.compute_gaussian(tuple(roi), 1 / 8, 10, dtype=torch.float32, device=torch.device("cpu"))
        torch.testing.assert_close(importance_map(roi, style="nnunet"), g / g.max(), atol=1e-7, rtol=0)
    for size in range(24, 140, 7):
        for roi, step in ((24, 0.5), (25, 0.5), (32, 0.75), (7, 0.9)):
            if size >= roi:
                assert window_starts(size, roi, 1 - step, "nnunet") == sw.compute_steps_for_sliding_window(
                    (size,), (roi,), step)[0]


def test_unknown_style_is_refused():
    with pytest.raises(ValueError, match="style"):
        sliding_window(lambda x: x, torch.zeros(1, 1, 8, 8), (4, 4), style="grid")
    from fastvision.tasks.segment import SegmentationTask

    with pytest.raises(ConfigError, match=r"task.args.sliding_window.style: monai or nnunet, got 'grid'"):
        SegmentationTask(sliding_window={"roi_size": [4, 4, 4], "style": "grid"}, loss=nn.Identity())


def test_exported_logits_are_the_resampled_log_probabilities(tmp_path):
    """logits=True: each class's log-probability resampled linearly (the crop's outside: log 1 for the background,
    the floor for the others), then the argmax; scipy's interpolation as the reference. Not the probabilities'."""
    shape = (13, 11, 7)
    affine = np.array([[-1.2, 0, 0, 14.0], [0, -1.3, 0, 9.0], [0, 0, 2.5, -3.0], [0, 0, 0, 1]])
    pre = resampled_case(tmp_path, affine, shape, (1.5, 1.5, 2.0))
    meta = pre["meta"]
    probs = torch.softmax(3 * torch.randn(3, *pre["image"].shape[1:], generator=torch.Generator().manual_seed(0)), 0)
    got = labels_on_input(probs, meta, lambda p: p.argmax(0), softmax=True, logits=True)
    want = scipy_restore(probs.double().log(), meta, shape, background=0,
                         fill=np.log(np.finfo(np.float32).tiny), background_fill=0.0)
    np.testing.assert_array_equal(got, want.argmax(0))
    assert (got != labels_on_input(probs, meta, lambda p: p.argmax(0), softmax=True)).any()


class _Ramp(nn.Module):
    """Logits that depend on where a voxel sits in its window: class 1 wins past the window's middle on axis 0."""

    def forward(self, x):
        r = torch.arange(x.shape[2], dtype=x.dtype) - (x.shape[2] - 1) / 2
        one = r.view(1, 1, -1, 1, 1).expand(x.shape[0], 1, *x.shape[2:])
        return torch.cat([torch.zeros_like(one), one], 1)


@pytest.mark.parametrize("style", ["nnunet", "monai"])
def test_predict_windows_the_arrays_as_training_saw_them(tmp_path, style):
    """A file whose first axis RAS mirrors, 7 voxels under an 8-voxel window: training saw RAS arrays, so the
    window pads the odd voxel after the volume in RAS order, before it in the file's: file voxel i sits at window
    position 7 - i, class 1 up to i = 2, whatever the style (nnU-Net's pads in the files' order, its network
    trained on them: ``nnunet_parity.py --score`` flips around the whole prediction for that)."""
    from fastvision.tasks.segment import SegmentationTask

    affine = np.diag([-1.5, 1.5, 1.5, 1.0])
    nib.save(nib.Nifti1Image(np.ones((7, 4, 4), np.float32), affine), str(tmp_path / "img.nii.gz"))
    task = SegmentationTask(num_classes=2, sample_shape=[1, 8, 4, 4], loss=nn.Identity(),
                            sliding_window={"roi_size": [8, 4, 4], "overlap": 0.5, "mode": "gaussian",
                                            "style": style})
    cfg = SimpleNamespace(data=SimpleNamespace(name="decathlon", args={
        "intensity": "none", "crop_foreground": False, "target_spacing": None}))
    predict_nifti_files(task, _Ramp(), [tmp_path / "img.nii.gz"], tmp_path / "out", cfg, torch.device("cpu"))
    got = np.asarray(nib.load(str(tmp_path / "out" / "img.nii.gz")).dataobj)[:, 0, 0]
    np.testing.assert_array_equal(got, (np.arange(7) <= 2).astype(np.uint8))


def _conv(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.LeakyReLU(0.01), nn.Conv3d(4, 2, 3, padding=1)).eval()


def test_mirrored_is_mirror_equivariant_and_the_net_where_the_net_is():
    from fastvision.inference.volumes import Mirrored

    x = torch.randn(2, 1, 6, 5, 4, generator=torch.Generator().manual_seed(0))
    m = Mirrored(_conv(), [2, 3, 4])
    with torch.no_grad():
        y = m(x)
        assert not torch.allclose(_conv()(x), y, atol=1e-3)  # a 3x3x3 net is not mirror-invariant
        for d in ([2], [3], [4], [2, 4]):
            torch.testing.assert_close(m(torch.flip(x, d)), torch.flip(y, d), atol=1e-5, rtol=0)
        pointwise = nn.Conv3d(1, 2, 1).eval()  # mirror-equivariant already: its mirrored mean is itself
        torch.testing.assert_close(Mirrored(pointwise, [2, 3])(x), pointwise(x), atol=1e-6, rtol=0)


def test_nnunet_style_ensemble_averages_logits_not_probabilities():
    """Two weight sets: softmax of the mean of the blended logits (nnU-Net's predictor), which differs from the mean
    of the two softmaxes that ``style: monai`` keeps."""
    from fastvision.inference.volumes import Ensemble
    from fastvision.tasks.segment import SegmentationTask

    x = torch.randn(1, 9, 8, 7, generator=torch.Generator().manual_seed(1))
    states = [_conv(s).state_dict() for s in (0, 1)]
    window = {"roi_size": [6, 6, 6], "overlap": 0.5, "mode": "gaussian"}
    got = {}
    for style in ("nnunet", "monai"):
        task = SegmentationTask(num_classes=2, sample_shape=[1, 6, 6, 6], loss=nn.Identity(),
                                sliding_window={**window, "style": style})
        got[style] = Ensemble(task, _conv(), states, torch.device("cpu")).probabilities(x)
    z = []
    for s in (0, 1):
        z.append(sliding_window(_conv(s), x[None], [6, 6, 6], overlap=0.5, style="nnunet")[0])
    torch.testing.assert_close(got["nnunet"], torch.softmax((z[0] + z[1]) / 2, 0), atol=1e-5, rtol=0)
    assert (got["nnunet"] - got["monai"]).abs().max() > 1e-3


def _anisotropic_case(tmp_path, flipped: bool):
    """0.8 x 0.8 x 4 mm (5x coarser along z: nnU-Net resamples it apart) to 1.0 x 1.0 x 2.5 mm, nnU-Net's order."""
    shape = (15, 13, 6)
    affine = np.diag([0.8, 0.8, 4.0, 1.0])
    if flipped:
        affine = np.array([[-0.8, 0, 0, 14.0], [0, -0.8, 0, 9.0], [0, 0, 4.0, -3.0], [0, 0, 0, 1]])
    data = np.zeros(shape, np.float32)
    data[1:-1, 2:-1, :] = 1.0
    nib.save(nib.Nifti1Image(data, affine), str(tmp_path / "img.nii.gz"))
    pre = preprocess_case({"image": [tmp_path / "img.nii.gz"], "label": None},
                          PreprocessParams(target_spacing=(1.0, 1.0, 2.5), intensity="none", crop_foreground=True,
                                           resample="nnunet"))
    return pre, shape


def test_nnunet_export_takes_the_coarse_axis_by_nearest(tmp_path):
    """Slices of constant value v_k on the preprocessed grid: back on the file's grid every slice of the crop holds
    one of the v_k (nearest along z, nnU-Net's order_z 0); the trilinear restore blends neighbours."""
    from fastvision.data.spatial3d import restore_to_input

    pre, _ = _anisotropic_case(tmp_path, flipped=False)
    n = pre["image"].shape[-1]
    v = torch.arange(1, n + 1, dtype=torch.float32) * 10
    x = v.view(1, 1, 1, n).expand(1, *pre["image"].shape[1:]).contiguous()
    (a0, a1), (b0, b1), (c0, c1) = pre["meta"]["crop_box"]
    ours = restore_to_input(x, pre["meta"], "linear", nnunet=True)[a0:a1, b0:b1, c0:c1, 0]
    assert np.isin(ours, v.numpy()).all() and len(np.unique(ours)) > 1
    linear = restore_to_input(x, pre["meta"], "linear")[a0:a1, b0:b1, c0:c1, 0]
    assert not np.isin(linear, v.numpy()).all()


@pytest.mark.parametrize("flipped", [False, True])
def test_nnunet_export_against_nnunets_resampling(tmp_path, flipped):
    """restore_to_input(nnunet=True) on the crop equals nnU-Net's ``resample_data_or_seg_to_shape(is_seg=False,
    order=1, order_z=0)`` from the plan's spacing to the file's, on the files' axis order."""
    rs = pytest.importorskip("nnunetv2.preprocessing.resampling.default_resampling")
    from fastvision.data.spatial3d import mirrored_axes, restore_to_input

    pre, _ = _anisotropic_case(tmp_path, flipped)
    meta = pre["meta"]
    x = torch.randn(2, *pre["image"].shape[1:], generator=torch.Generator().manual_seed(0))
    box = meta["crop_box"]
    crop = tuple(slice(a, b) for a, b in box)
    ours = np.moveaxis(restore_to_input(x, meta, "linear", nnunet=True), -1, 0)
    flips = [1 + a for a in mirrored_axes(np.asarray(meta["input_affine"], np.float64))]
    filed = np.flip(x.double().numpy(), flips) if flips else x.double().numpy()
    want = rs.resample_data_or_seg_to_shape(filed, meta["cropped_shape"], meta["spacing"], [0.8, 0.8, 4.0],
                                            is_seg=False, order=1, order_z=0, force_separate_z=None)
    want = np.flip(want, flips) if flips else want
    # the file's grid in RAS order is the crop padded: compare the crop, mirrored back where the file was
    ras = ours if not flips else np.flip(ours, [1 + a for a in (0, 1)])
    np.testing.assert_allclose(ras[(slice(None),) + crop], want, atol=1e-5)
