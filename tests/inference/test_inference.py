"""Sliding window vs MONAI's sliding_window_inference, flip TTA, and NIfTI writers."""
from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
import torch
from torch import nn

from fastvision.data.preprocess3d import PreprocessParams, preprocess_case
from fastvision.inference.nifti import labels_on_input, save_segmentation, write_nifti
from fastvision.inference.window import flip_tta, sliding_window, sliding_window_inference, window_starts
from tests.inference.conftest import resampled_case, scipy_restore

monai_inferers = pytest.importorskip("monai.inferers")


def _net(dims: int, cin: int = 2, cout: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    conv = nn.Conv2d if dims == 2 else nn.Conv3d
    return nn.Sequential(conv(cin, 4, 3, padding=1), nn.LeakyReLU(0.01), conv(4, cout, 3, padding=1)).eval()


CASES = [  # dims, input spatial shape, roi, sw_batch_size
    (2, (23, 17), (8, 6), 3),
    (2, (10, 5), (8, 8), 2),  # second axis smaller than the roi: padded
    (3, (11, 9, 13), (6, 4, 5), 4),
    (3, (7, 12, 6), (8, 5, 6), 1),  # padding on one axis, roi == size on another
]


@pytest.mark.parametrize("mode", ["gaussian", "constant"])
@pytest.mark.parametrize("dims,shape,roi,swb", CASES)
def test_matches_monai(dims, shape, roi, swb, mode):
    net = _net(dims)
    x = torch.randn(2, 2, *shape, generator=torch.Generator().manual_seed(1))
    ours = sliding_window(net, x, roi, overlap=0.5, mode=mode, sw_batch_size=swb)
    with torch.no_grad():
        ref = monai_inferers.sliding_window_inference(x, roi, swb, net, overlap=0.5, mode=mode, sigma_scale=0.125)
    assert ours.shape == ref.shape == (2, 3, *shape)
    torch.testing.assert_close(ours, torch.as_tensor(ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("roi", [(9, 7, 5), (-1, -1, -1), (9, 0, 5)])
def test_roi_covering_volume_is_full_forward(roi):
    net = _net(3)
    x = torch.randn(1, 2, 9, 7, 5)
    with torch.no_grad():
        full = net(x)
    torch.testing.assert_close(sliding_window(net, x, roi, overlap=0.5, mode="gaussian"), full, atol=1e-6, rtol=0)


def test_roi_larger_than_volume_pads_with_zeros():
    net = _net(3)
    x = torch.randn(1, 2, 9, 7, 5)
    with torch.no_grad():  # 3 voxels of padding on the first axis: 1 before, 2 after
        want = net(torch.nn.functional.pad(x, (0, 0, 0, 0, 1, 2)))[:, :, 1:10]
    torch.testing.assert_close(sliding_window(net, x, (12, 7, 5), overlap=0.5), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("size,roi,overlap,expected", [
    (10, 4, 0.5, [0, 2, 4, 6]),
    (11, 4, 0.5, [0, 2, 4, 6, 7]),
    (10, 4, 0.0, [0, 4, 6]),
    (4, 4, 0.5, [0]),
    (9, 4, 0.9, [0, 1, 2, 3, 4, 5]),  # step int(0.4) = 0 -> 1
])
def test_window_starts(size, roi, overlap, expected):
    assert window_starts(size, roi, overlap) == expected


def test_output_device_and_padding_crop():
    x = torch.randn(1, 2, 5, 6)
    out = sliding_window(lambda w: w[:, :1] * 2, x, (8, 8), overlap=0.5, device="cpu")
    torch.testing.assert_close(out, x[:, :1] * 2)


def test_flip_tta_averages_mirrored_predictions():
    net = _net(2, cout=2)
    x = torch.randn(1, 2, 6, 5)
    with torch.no_grad():
        got = flip_tta(net, x, dims=(2, 3))
        # By hand: the four mirrorings of a 2-D image, each flipped back.
        want = (net(x) + net(x.flip(2)).flip(2) + net(x.flip(3)).flip(3) + net(x.flip(2, 3)).flip(2, 3)) / 4
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, net(x).detach(), atol=1e-4)  # the net is not mirror-symmetric
    torch.testing.assert_close(flip_tta(lambda t: t * 3, x, dims=(2, 3)), x * 3)  # equivariant -> unchanged


def _reference_image(path, shape=(7, 6, 5)):
    rot = np.array([[0.0, -1.2, 0.0], [0.9, 0.0, 0.0], [0.0, 0.0, 2.5]])  # a permuted, flipped grid
    affine = np.eye(4)
    affine[:3, :3] = rot
    affine[:3, 3] = [10.0, -20.0, 30.0]
    data = np.arange(1, np.prod(shape) + 1, dtype=np.int16).reshape(shape)
    data[0], data[:, :, -1] = 0, 0  # background border for crop-to-foreground
    img = nib.Nifti1Image(data, affine)
    img.set_qform(affine, code=1)
    img.set_sform(affine, code=2)
    nib.save(img, str(path))
    return affine, data


def test_write_nifti_keeps_affine_and_header(tmp_path):
    affine, data = _reference_image(tmp_path / "ref.nii.gz")
    pred = (data % 3).astype(np.uint8)
    write_nifti(pred, tmp_path / "ref.nii.gz", tmp_path / "out" / "pred.nii.gz")
    back = nib.load(str(tmp_path / "out" / "pred.nii.gz"))
    np.testing.assert_allclose(back.affine, affine, atol=1e-6)
    assert int(back.header["qform_code"]) == 1 and int(back.header["sform_code"]) == 2
    np.testing.assert_allclose(back.header.get_zooms(), (0.9, 1.2, 2.5), atol=1e-6)
    assert back.get_data_dtype() == np.uint8
    np.testing.assert_array_equal(np.asarray(back.dataobj), pred)


def test_save_segmentation_returns_to_input_space(tmp_path):
    affine, data = _reference_image(tmp_path / "img.nii.gz", shape=(8, 9, 6))
    label = np.zeros((8, 9, 6), np.uint8)
    label[2:6, 3:8, 1:4] = 1
    label[3:5, 4:6, 2:3] = 3
    nib.save(nib.Nifti1Image(label, affine), str(tmp_path / "lab.nii.gz"))
    item = preprocess_case({"image": [tmp_path / "img.nii.gz"], "label": tmp_path / "lab.nii.gz"},
                           PreprocessParams(intensity="none", crop_foreground=True, crop_margin=1))
    # The preprocessed label, one-hot, is the prediction; written back it must equal the input label file.
    probs = torch.nn.functional.one_hot(item["label"].long(), 4).movedim(-1, 0).float()
    on_input = labels_on_input(probs, item["meta"], lambda p: p.argmax(0), softmax=True)
    save_segmentation(on_input, tmp_path / "img.nii.gz", tmp_path / "pred.nii.gz", ids={3: 4})  # a BraTS release
    back = nib.load(str(tmp_path / "pred.nii.gz"))
    want = np.where(label == 3, 4, label)
    np.testing.assert_array_equal(np.asarray(back.dataobj), want)
    np.testing.assert_allclose(back.affine, affine, atol=1e-6)


@pytest.mark.parametrize("flipped", [False, True])
def test_labels_on_input_are_the_argmax_of_linearly_resampled_probabilities(tmp_path, flipped):
    shape = (13, 11, 7)
    affine = np.diag([1.2, 1.3, 2.5, 1.0])
    if flipped:  # an LPS-like file: the restore must undo the reorientation too
        affine = np.array([[-1.2, 0, 0, 14.0], [0, -1.3, 0, 9.0], [0, 0, 2.5, -3.0], [0, 0, 0, 1]])
    pre = resampled_case(tmp_path, affine, shape, (1.5, 1.5, 2.0))
    assert pre["image"].shape[1:] != shape  # resampled and cropped
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(3, *pre["image"].shape[1:], generator=g), 0)
    got = labels_on_input(probs, pre["meta"], lambda p: p.argmax(0), softmax=True)
    want = scipy_restore(probs, pre["meta"], shape, background=0).argmax(0)  # the crop's outside: background
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.uint8 and len(np.unique(got)) == 3


def test_labels_on_input_beat_nearest_labels_on_a_ball(tmp_path):
    """Probabilities of a ball of radius 6 mm sampled on a 1.47 mm grid, written back to a 1.2 mm file: the
    linearly resampled probabilities draw its boundary closer than the nearest-resampled labels (Dice
    against the ball drawn on the file's own grid)."""
    from fastvision.data.preprocess3d import restore_to_input

    shape, spacing = (21, 21, 21), 1.2
    affine = np.diag([spacing, spacing, spacing, 1.0])
    nib.save(nib.Nifti1Image(np.ones(shape, np.float32), affine), str(tmp_path / "img.nii.gz"))
    pre = preprocess_case({"image": [tmp_path / "img.nii.gz"], "label": None},
                          PreprocessParams(target_spacing=(1.47, 1.47, 1.47), intensity="none", crop_foreground=False))
    centre = 10 * spacing + 0.3

    def dist(grid_shape, step):
        axes = [np.arange(n) * step - centre for n in grid_shape]
        return np.sqrt(sum(a ** 2 for a in np.meshgrid(*axes, indexing="ij")))

    step = float(pre["meta"]["spacing"][0])
    p1 = torch.from_numpy(1 / (1 + np.exp(-(6.0 - dist(pre["image"].shape[1:], step)) / 0.5))).float()
    probs = torch.stack([1 - p1, p1])
    truth = dist(shape, spacing) <= 6.0

    def dice(label):
        return 2 * (label.astype(bool) & truth).sum() / (label.astype(bool).sum() + truth.sum())

    linear = dice(labels_on_input(probs, pre["meta"], lambda p: p.argmax(0), softmax=True))
    nearest = dice(restore_to_input(probs.argmax(0).to(torch.uint8), pre["meta"]))
    assert linear > nearest + 0.01, (linear, nearest)


def test_labels_on_input_of_regions_threshold_the_resampled_probabilities(tmp_path):
    from fastvision.ops.regions import regions_to_classes

    shape = (12, 10, 8)
    pre = resampled_case(tmp_path, np.diag([1.1, 1.4, 2.2, 1.0]), shape, (1.5, 1.5, 2.0))
    regions = [[1, 2, 3], [2, 3], [3]]
    g = torch.Generator().manual_seed(1)
    probs = torch.sigmoid(2 * torch.randn(3, *pre["image"].shape[1:], generator=g))

    def to_labels(p):
        return regions_to_classes((p > 0.5)[None], regions)[0]

    got = labels_on_input(probs, pre["meta"], to_labels, softmax=False)
    want = to_labels(torch.from_numpy(scipy_restore(probs, pre["meta"], shape)))
    np.testing.assert_array_equal(got, want.numpy())
    assert set(np.unique(got)) == {0, 1, 2, 3}


def test_keyword_form_with_tta_matches_monai_average():
    net = _net(3)
    x = torch.randn(1, 2, 9, 8, 7)
    got = sliding_window_inference(x, net, (5, 5, 5), overlap=0.5, mode="gaussian", sw_batch_size=2, tta_flips=(0,))
    with torch.no_grad():
        a = monai_inferers.sliding_window_inference(x, (5, 5, 5), 2, net, overlap=0.5, mode="gaussian")
        b = monai_inferers.sliding_window_inference(x.flip(2), (5, 5, 5), 2, net, overlap=0.5, mode="gaussian").flip(2)
    torch.testing.assert_close(got, torch.as_tensor((a + b) / 2), atol=1e-5, rtol=0)


# ------------------------------------------------------------------ NIfTI prediction (fastvision predict)
from fastvision.config import RunConfig  # noqa: E402
from fastvision.data.synth import load_all  # noqa: E402
from fastvision.errors import ConfigError  # noqa: E402
from fastvision.inference.nifti import (  # noqa: E402
    predict_nifti_files,
    prediction_cases,
    prediction_preprocessing,
)
from fastvision.ops.regions import regions_to_classes  # noqa: E402
from fastvision.tasks.segment import SegmentationTask  # noqa: E402

BRATS_REGIONS = [[1, 2, 3], [1, 3], [3]]


class _CTThreshold(nn.Module):
    """Class 1 where the windowed CT value exceeds 0.05 (HU > -57 + 0.05 * 221 = -45.95: the body), with
    logits steep enough to be near 0 / 1 away from the boundary, as a trained network's (the probabilities are
    what predict resamples)."""

    def forward(self, x):
        return torch.cat([torch.zeros_like(x), 20 * (x - 0.05)], 1)


class _FirstChannels(nn.Module):
    """Region logits = the first three z-scored channels: region r is on where channel r > its mean."""

    def forward(self, x):
        return x[:, :3]


def _cfg(name: str, **args) -> RunConfig:
    cfg = RunConfig()
    cfg.data.name, cfg.data.args = name, args
    return cfg


def _brats_post_processing(regions: torch.Tensor) -> torch.Tensor:
    """MONAI / nnU-Net BraTS post-processing by hand: WT -> 2, then TC -> 1, then ET -> 3 on top."""
    wt, tc, et = regions.bool()
    label = torch.zeros(wt.shape, dtype=torch.long)
    label[wt], label[tc], label[et] = 2, 1, 3
    return label


def test_regions_to_classes_matches_brats_post_processing():
    g = torch.Generator().manual_seed(0)
    masks = torch.rand(2, 3, 5, 6, 4, generator=g) > 0.5
    want = torch.stack([_brats_post_processing(m) for m in masks])
    assert torch.equal(regions_to_classes(masks, BRATS_REGIONS), want)
    with pytest.raises(ConfigError):
        regions_to_classes(masks[:, :2], [[1, 2], [2, 3]])  # overlapping, not nested


@pytest.mark.parametrize("spacing", [None, [6.0, 6.0, 7.0]])
def test_predict_nifti_ct_keeps_input_grid_and_affine(tmp_path, spacing):
    data = load_all().get("spleen")(tmp_path / "Task09", seed=1, cases=2, test_cases=1, size=20, zoom=3.0)
    image = sorted((data / "imagesTs").glob("*.nii.gz"))[0]
    task = SegmentationTask(num_classes=2, sample_shape=[1, 12, 12, 12], loss=nn.MSELoss(),
                            sliding_window={"roi_size": [12, 12, 12], "overlap": 0.5, "mode": "gaussian"})
    cfg = _cfg("decathlon", path=str(data), intensity="auto", target_spacing=spacing, crop_foreground=True)
    task.sliding_window["roi_size"] = [12, 12, 12] if spacing is None else [8, 8, 8]
    (out,) = predict_nifti_files(task, _CTThreshold(), [image], tmp_path / "pred", cfg, torch.device("cpu"))
    assert out.name == image.name
    ref, got = nib.load(str(image)), nib.load(str(out))
    np.testing.assert_allclose(got.affine, ref.affine, atol=1e-6)
    np.testing.assert_allclose(got.header.get_zooms(), ref.header.get_zooms(), atol=1e-6)
    pred, want = np.asarray(got.dataobj), (np.asarray(ref.dataobj) > -45.95).astype(np.uint8)
    assert pred.shape == want.shape and 0.2 < want.mean() < 0.8  # the body boundary is in view
    if spacing is None:  # no resampling: the threshold is exact, voxel for voxel
        np.testing.assert_array_equal(pred, want)
    else:  # resampled there and back: only the boundary may move
        assert 2 * (pred & want).sum() / (pred.sum() + want.sum()) > 0.95


def test_predict_raw_brats_folder_regions_to_brats_ids(tmp_path):
    root = load_all().get("brats")(tmp_path / "raw", seed=2, cases=1, size=16, layout="brats")
    folder = next(p for p in root.rglob("*") if p.is_dir() and list(p.glob("*_flair.nii.gz")))
    task = SegmentationTask(num_classes=4, mode="regions", regions=BRATS_REGIONS, sample_shape=[4, 8, 8, 8],
                            loss=nn.MSELoss(),
                            sliding_window={"roi_size": [8, 8, 8], "overlap": 0.25, "mode": "constant"})
    cfg = _cfg("brats", path=str(root))
    (out,) = predict_nifti_files(task, _FirstChannels(), [folder], tmp_path / "a", cfg, torch.device("cpu"))
    assert out.name == f"{folder.name}.nii.gz"
    # By hand, on the stored (LPS) arrays: z-score > 0 <=> value above the mean of the non-zero voxels.
    on = []
    for mod in ("flair", "t1", "t1ce"):
        v = np.asarray(nib.load(str(folder / f"{folder.name}_{mod}.nii.gz")).dataobj).astype(np.float64)
        on.append((v != 0) & (v > v[v != 0].mean()))
    want = np.where(on[2], 4, np.where(on[1], 1, np.where(on[0], 2, 0)))
    got = nib.load(str(out))
    np.testing.assert_array_equal(np.asarray(got.dataobj), want)
    np.testing.assert_allclose(got.affine, nib.load(str(folder / f"{folder.name}_flair.nii.gz")).affine, atol=1e-6)
    assert {0, 2, 4} <= set(np.unique(want).tolist())
    # The folder expanded into its files (as `fastvision predict` expands folders) is the same one case.
    (again,) = predict_nifti_files(task, _FirstChannels(), sorted(folder.iterdir()), tmp_path / "b", cfg,
                                   torch.device("cpu"))
    np.testing.assert_array_equal(np.asarray(nib.load(str(again)).dataobj), want)


def test_prediction_preprocessing_from_run_args(tmp_path):
    task = SegmentationTask(num_classes=4, sample_shape=[4, 8, 8, 8], loss=nn.MSELoss())
    dec = load_all().get("brats")(tmp_path / "Task01", seed=0, cases=1, test_cases=1, size=12)
    params, ids = prediction_preprocessing(task, "decathlon",
                                           {"path": str(dec), "intensity": "auto", "crop_margin": 2})
    assert (params.intensity, params.crop_margin) == ("mri", 2)
    assert ids == {1: 2, 2: 1, 3: 3}  # BraTS classes back to Task01's MSD ids (1 edema, 2 non-enhancing)
    spl = load_all().get("spleen")(tmp_path / "Task09", seed=0, cases=1, test_cases=0, size=12)
    params, ids = prediction_preprocessing(task, "decathlon", {"path": str(spl), "target_spacing": [1.5, 1.5, 2]})
    assert (params.intensity, params.target_spacing, ids) == ("ct", (1.5, 1.5, 2.0), None)
    # nnU-Net v2's dataset.json names channels in channel_names: CT there too, as training reads it (predict
    # read only MSD's modality, so it z-scored a CT the training had windowed)
    meta = json.loads((spl / "dataset.json").read_text())
    meta["channel_names"] = meta.pop("modality")
    (spl / "dataset.json").write_text(json.dumps(meta))
    assert prediction_preprocessing(task, "decathlon", {"path": str(spl)})[0].intensity == "ct"
    with pytest.raises(ConfigError, match="dataset.json"):
        prediction_preprocessing(task, "decathlon", {"path": str(tmp_path / "moved")})
    assert [c["id"] for c in prediction_cases(sorted((dec / "imagesTs").iterdir()))] == ["BRATS_002"]


def test_task01_predictions_are_written_in_its_own_label_ids(tmp_path):
    """A Task01 run's label, loaded as training loads it (MSD ids renumbered to BraTS classes) and predicted
    perfectly, is written back equal to the case's labelsTr file: MSD ids, not BraTS's 0/1/2/4 (which a user
    comparing with labelsTr read as edema and core swapped). Also with dataset.json gone (MSD's standard ids)."""
    from fastvision.data.formats import DATASETS

    dec = load_all().get("brats")(tmp_path / "Task01", seed=0, cases=2, test_cases=0, size=16)
    splits = DATASETS.build("decathlon", {"path": str(dec), "num_folds": 2, "crop_foreground": False})
    label_map = tuple((int(a), b) for a, b in splits.info["label_convention"]["label_map"].items())
    case = {"image": [dec / "imagesTr" / "BRATS_001.nii.gz"], "label": dec / "labelsTr" / "BRATS_001.nii.gz"}
    item = preprocess_case(case, PreprocessParams(intensity="mri", crop_foreground=False, label_map=label_map))
    msd = np.asarray(nib.load(str(case["label"])).dataobj)
    assert {1, 2, 3} <= set(np.unique(msd).tolist()) and not torch.equal(item["label"], torch.from_numpy(msd))
    task = SegmentationTask(num_classes=4, sample_shape=[4, 8, 8, 8], loss=nn.MSELoss())
    probs = torch.nn.functional.one_hot(item["label"].long(), 4).movedim(-1, 0).float()
    on_input = labels_on_input(probs, item["meta"], lambda p: p.argmax(0), softmax=True)
    for where in (dec, tmp_path / "moved"):  # dataset.json read / gone
        _, ids = prediction_preprocessing(task, "decathlon", {"path": str(where), "intensity": "mri"})
        out = save_segmentation(on_input, case["image"][0], tmp_path / f"{where.name}.nii.gz", ids=ids)
        np.testing.assert_array_equal(np.asarray(nib.load(str(out)).dataobj), msd)



class _AutocastRecorder(nn.Module):
    """Records the CPU autocast state its forward runs under; predicts background everywhere."""

    def __init__(self):
        super().__init__()
        self.seen: list[torch.dtype | None] = []

    def forward(self, x):
        self.seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return torch.cat([torch.ones_like(x), torch.zeros_like(x)], 1)


def _fake_loaded_run(monkeypatch, task, model, cfg, device):
    """``api.load_run`` returning a run as ``build`` makes it (its ``runtime.Precision`` from
    ``train.amp`` and the device), without a checkpoint."""
    from types import SimpleNamespace

    from fastvision import api
    from fastvision.engine import runtime

    run = SimpleNamespace(task=task, model=model, cfg=cfg, device=device,
                          precision=runtime.Precision(cfg.train.amp, device))
    monkeypatch.setattr(api, "load_run", lambda *a, **k: (run, None))
    return run


@pytest.mark.parametrize("amp", ["off", "bf16", "auto"])
def test_predict_precision_is_the_runtime_rule(tmp_path, monkeypatch, amp):
    """Issue 19: predict had its own amp -> dtype table (fp32 off CUDA, ``auto`` ignored); it now
    autocasts with the run's ``runtime.Precision``, exactly as training and ``evaluate`` do."""
    from fastvision import api
    from fastvision.engine import runtime

    data = load_all().get("spleen")(tmp_path / "Task09", seed=1, cases=1, test_cases=1, size=12, zoom=3.0)
    image = sorted((data / "imagesTs").glob("*.nii.gz"))[0]
    task = SegmentationTask(num_classes=2, sample_shape=[1, 8, 8, 8], loss=nn.MSELoss(),
                            sliding_window={"roi_size": [8, 8, 8], "overlap": 0.0, "mode": "constant"})
    cfg = _cfg("decathlon", path=str(data), intensity="auto", crop_foreground=False)
    cfg.train.amp = amp
    model = _AutocastRecorder()
    _fake_loaded_run(monkeypatch, task, model, cfg, torch.device("cpu"))
    (out,) = api.predict("run", [str(image)], tmp_path / "pred", device="cpu")
    assert out.is_file()
    want = runtime.Precision(amp, torch.device("cpu")).dtype  # what evaluate on this device uses
    assert model.seen and set(model.seen) == {want}


@pytest.mark.parametrize("capability,bf16,want", [((9, 0), True, torch.bfloat16), ((8, 0), True, torch.bfloat16),
                                                  ((7, 0), False, torch.float16)])
def test_predict_auto_on_cuda_autocasts_like_training(tmp_path, monkeypatch, capability, bf16, want):
    """``amp: auto`` (unet3d-brats, segresnet-brats) on a GPU: predict autocasts in bf16 on A100/H100,
    fp16 on V100, as training resolves it; the old prediction table ran it in fp32. The device
    queries and ``torch.autocast`` are replaced: no GPU is needed."""
    import contextlib

    from fastvision import api

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    entered = []

    def autocast(device_type, dtype=None, enabled=True):
        entered.append((device_type, dtype if enabled else None))
        return contextlib.nullcontext()

    class _Task:
        def predict_files(self, model, files, out_dir, cfg, device):
            assert entered, "the task predicts outside the run's autocast"
            return []

    cfg = _cfg("decathlon", path="unused")
    cfg.train.amp = "auto"
    _fake_loaded_run(monkeypatch, _Task(), nn.Identity(), cfg, torch.device("cuda"))
    monkeypatch.setattr(torch, "autocast", autocast)
    api.predict("run", [], tmp_path / "pred", device="cuda")
    assert entered == [("cuda", want)]
