"""3-D preprocessing, Decathlon and raw BraTS layouts, folds and the synthetic generators."""
from __future__ import annotations

import json
import os

import nibabel as nib
import numpy as np
import pytest
import torch

from fastvision.data.formats.brats import (
    BRATS_REGIONS,
    find_cases,
    from_brats_labels,
    to_brats_labels,
)
from fastvision.data.formats.decathlon import kfold_split, random_patch
from fastvision.data.preprocess3d import (
    PreprocessParams,
    foreground_box,
    orientation_to_ras,
    preprocess_case,
    reorient,
    resample_to,
    restore_to_input,
    spacing_grid,
    window,
    zscore_nonzero,
)
from fastvision.data.synth import load_all
from fastvision.errors import ConfigError, DataError
from fastvision.ops.regions import region_lut, region_masks, regions_to_classes
from fastvision.registry import DATASETS

SYNTH = load_all()


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Datasets cache preprocessed cases under FASTVISION_CACHE: keep them out of the user's cache."""
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "fastvision-cache"))


monai_transforms = pytest.importorskip("monai.transforms")


@pytest.fixture(scope="module")
def brats_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("brats")
    SYNTH.get("brats")(root / "dec", seed=3, cases=4, test_cases=1, size=24)
    SYNTH.get("brats")(root / "raw", seed=3, cases=4, size=24, layout="brats")
    return root / "dec", root / "raw"


def test_decathlon_and_raw_brats_load_identically(brats_pair):
    dec, raw = brats_pair
    a = DATASETS.build("decathlon", {"path": str(dec), "num_folds": 2})
    b = DATASETS.build("brats", {"path": str(raw), "num_folds": 2})
    assert a.info["class_names"] == b.info["class_names"] and a.info["in_channels"] == b.info["in_channels"] == 4
    for da, db in ((a.train, b.train), (a.val, b.val)):
        assert len(da) == len(db) == 2
        for i in range(len(da)):
            x, y = da[i], db[i]
            assert x["image"].dtype == torch.float32 and x["label"].dtype == torch.int64
            torch.testing.assert_close(x["image"], y["image"], atol=0, rtol=0)
            assert torch.equal(x["label"], y["label"])
            assert set(x["label"].unique().tolist()) == {0, 1, 2, 3}
            torch.testing.assert_close(a.train.meta(0)["affine"], b.train.meta(0)["affine"])
    # Task01's file stores MSD ids (1 edema, 2 non-enhancing, 3 enhancing); the item uses BraTS ids.
    raw_msd = np.asarray(nib.load(str(dec / "labelsTr/BRATS_001.nii.gz")).dataobj)
    case = find_cases(raw)[0]
    raw_brats = np.asarray(nib.load(str(case["label"])).dataobj)[::-1, ::-1]  # stored LPS
    assert np.array_equal(raw_msd == 1, raw_brats == 2) and np.array_equal(raw_msd == 2, raw_brats == 1)
    assert np.array_equal(raw_msd == 3, raw_brats == 4)


def test_brats_2023_names_load_as_the_2019_names(brats_pair, tmp_path):
    """``data synth brats --layout brats2023``: the same cases in BraTS 2023-24's folders (``-t2f``, ``-t1n``,
    ``-t1c``, ``-t2w``; enhancing tumour stored as 3) load item for item as the 2019 folders (4)."""
    _, raw = brats_pair
    new = SYNTH.get("brats")(tmp_path / "b23", seed=3, cases=4, size=24, layout="brats2023")
    case = sorted(new.iterdir())[0]
    assert sorted(p.name.split("-")[-1] for p in case.iterdir()) == [
        "seg.nii.gz", "t1c.nii.gz", "t1n.nii.gz", "t2f.nii.gz", "t2w.nii.gz"]
    assert 3 in np.unique(np.asarray(nib.load(str(case / f"{case.name}-seg.nii.gz")).dataobj))
    a = DATASETS.build("brats", {"path": str(raw), "num_folds": 2})
    b = DATASETS.build("brats", {"path": str(new), "num_folds": 2})
    for da, db in ((a.train, b.train), (a.val, b.val)):
        assert len(da) == len(db) == 2
        for i in range(len(da)):
            torch.testing.assert_close(da[i]["image"], db[i]["image"], atol=0, rtol=0)
            assert torch.equal(da[i]["label"], db[i]["label"])


def test_brats_label_remap_round_trip_and_regions():
    raw = torch.tensor([[0, 1, 2, 4], [4, 2, 1, 0]])
    lab = from_brats_labels(raw)
    assert lab.tolist() == [[0, 1, 2, 3], [3, 2, 1, 0]]
    assert torch.equal(to_brats_labels(lab), raw)
    regions = region_masks(lab[None], region_lut(BRATS_REGIONS))[0]  # WT, TC, ET
    # MONAI's converter works on BraTS ids and returns TC, WT, ET.
    ref = torch.as_tensor(monai_transforms.ConvertToMultiChannelBasedOnBratsClasses()(raw))
    assert torch.equal(regions, ref[[1, 0, 2]].bool())
    assert torch.equal(regions_to_classes(regions[None], BRATS_REGIONS)[0], lab)


@pytest.mark.parametrize("shape,spacing,target,expected", [
    # round((n - 1) * spacing / target) + 1 voxels of exactly ``target``, voxel 0 on input voxel 0
    ((10, 10, 8), (1.0, 1.0, 2.5), (2.0, 2.0, 2.0), (6, 6, 10)),
    ((12, 9, 7), (0.8, 1.5, 3.0), (1.5, 1.5, 2.0), (7, 9, 10)),
])
def test_resample_shape_and_affine(shape, spacing, target, expected):
    affine = np.diag([*spacing, 1.0])
    affine[:3, 3] = [-5.0, 3.0, 7.0]
    new_affine, new_shape = spacing_grid(affine, shape, target)
    assert new_shape == expected
    np.testing.assert_allclose(new_affine[:3, :3], np.diag(target))
    np.testing.assert_allclose(new_affine[:3, 3], affine[:3, 3])
    # A volume whose value is the world x coordinate: trilinear is exact on a linear field, so
    # every output voxel within the input's centres must hold the x of its centre (hand-computed:
    # origin + i * target).
    idx = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), -1)
    world_x = idx[..., 0] * spacing[0] + affine[0, 3]
    x = torch.from_numpy(world_x[None].astype(np.float32))
    y = resample_to(x, affine, new_affine, new_shape, "linear")
    assert tuple(y.shape[1:]) == expected
    want = affine[0, 3] + np.arange(expected[0]) * target[0]
    hi = (shape[0] - 1) * spacing[0] + affine[0, 3]  # beyond the last centre: the border value
    np.testing.assert_allclose(y[0, :, 0, 0].numpy(), np.minimum(want, hi), atol=1e-4)
    # Nearest for labels keeps the dtype and the value set.
    lab = torch.randint(0, 3, (1, *shape))
    z = resample_to(lab, affine, new_affine, new_shape, "nearest")
    assert z.dtype == lab.dtype and set(z.unique().tolist()) <= {0, 1, 2}


def test_reorient_to_ras_keeps_world_positions():
    affine = np.array([[0.0, -2.0, 0.0, 4.0], [-1.0, 0.0, 0.0, 6.0], [0.0, 0.0, 3.0, -1.0], [0, 0, 0, 1]])
    data = np.random.default_rng(0).random((4, 5, 3)).astype(np.float32)
    out, new_affine = reorient(data, affine, orientation_to_ras(affine))
    assert nib.aff2axcodes(new_affine) == ("R", "A", "S") and out.shape == (5, 4, 3)
    for ijk in [(0, 0, 0), (3, 1, 2), (2, 4, 1)]:
        world = affine @ [*ijk, 1]
        new_ijk = np.linalg.solve(new_affine, world)[:3].round().astype(int)
        assert out[tuple(new_ijk)] == data[ijk]


def test_window_hand_computed_and_monai():
    hu = torch.tensor([-1000.0, -57.0, 53.5, 164.0, 500.0])
    assert window(hu, -57, 164, 0, 1).tolist() == [0.0, 0.0, 0.5, 1.0, 1.0]
    ref = monai_transforms.ScaleIntensityRange(-57, 164, 0.0, 1.0, clip=True)(hu)
    torch.testing.assert_close(window(hu, -57, 164, 0, 1), torch.as_tensor(ref))


def test_zscore_foreground_hand_computed_and_monai():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 0.0, 5.0, 5.0]])
    out = zscore_nonzero(x)
    s = np.sqrt(2 / 3)  # population std of 1, 2, 3
    torch.testing.assert_close(out[0], torch.tensor([0.0, -1 / s, 0.0, 1 / s], dtype=torch.float32))
    assert out[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # constant foreground: mean-shift only
    r = torch.randn(3, 5, 6, 4) * torch.tensor([1.0, 10.0, 100.0])[:, None, None, None]
    r[:, :2] = 0
    ref = monai_transforms.NormalizeIntensity(nonzero=True, channel_wise=True)(r)
    torch.testing.assert_close(zscore_nonzero(r), torch.as_tensor(ref), atol=1e-5, rtol=1e-5)


def test_foreground_box_with_margin():
    m = torch.zeros(10, 8, 6, dtype=torch.bool)
    m[3:5, 2, 4] = True
    assert foreground_box(m) == [(3, 5), (2, 3), (4, 5)]
    assert foreground_box(m, margin=2) == [(1, 7), (0, 5), (2, 6)]
    assert foreground_box(torch.zeros(3, 4, 5, dtype=torch.bool)) == [(0, 3), (0, 4), (0, 5)]


@pytest.mark.parametrize("mode,box", [
    (True, [(2, 7), (1, 5), (1, 4)]),      # CT, MONAI-style: the voxels above the window's low end (the body)
    ("nonzero", [(0, 10), (0, 6), (0, 5)]),  # nnU-Net's crop_to_nonzero: CT is non-zero almost everywhere
    (False, [(0, 10), (0, 6), (0, 5)]),
])
def test_ct_crop_modes(tmp_path, mode, box):
    hu = np.full((10, 6, 5), -2048.0, np.float32)  # outside the scanner's field of view (padding value)
    hu[1:9, :, :] = -1000.0                        # air in the scanned slab
    hu[2:7, 1:5, 1:4] = 40.0                       # the body, soft tissue
    nib.save(nib.Nifti1Image(hu, np.eye(4)), str(tmp_path / "ct.nii.gz"))
    item = preprocess_case({"image": [tmp_path / "ct.nii.gz"], "label": None},
                           PreprocessParams(intensity="ct", window=(-57.0, 164.0, 0.0, 1.0), crop_foreground=mode))
    assert item["meta"]["crop_box"] == [list(b) for b in box]
    assert tuple(item["image"].shape[1:]) == tuple(b - a for a, b in box)
    with pytest.raises(ConfigError, match="crop_foreground"):
        PreprocessParams(crop_foreground="body")


def test_nonzero_crop_on_mri_matches_the_default(tmp_path):
    """MR: the default crop already is the non-zero one; "nonzero" gives the same box."""
    vol = np.zeros((9, 7, 6), np.float32)
    vol[2:6, 1:4, 3:5] = np.arange(1, 25, dtype=np.float32).reshape(4, 3, 2)
    nib.save(nib.Nifti1Image(vol, np.eye(4)), str(tmp_path / "mr.nii.gz"))
    boxes = [preprocess_case({"image": [tmp_path / "mr.nii.gz"], "label": None},
                             PreprocessParams(intensity="mri", crop_foreground=m))["meta"]["crop_box"]
             for m in (True, "nonzero")]
    assert boxes[0] == boxes[1] == [[2, 6], [1, 4], [3, 5]]


@pytest.mark.parametrize("n,k", [(10, 5), (11, 5), (7, 3), (41, 5)])
def test_kfold_deterministic_disjoint_covering(n, k):
    ids = [f"case_{i:03d}" for i in range(n)]
    vals = []
    for fold in range(k):
        tr, va = kfold_split(ids, fold, k, seed=0)
        assert (tr, va) == kfold_split(list(reversed(ids)), fold, k, seed=0)  # input order is irrelevant
        assert not set(tr) & set(va) and set(tr) | set(va) == set(ids)
        assert len(va) in (n // k, n // k + 1)
        vals += va
    assert sorted(vals) == sorted(ids)  # the validation folds partition the cases
    assert kfold_split(ids, 0, k, seed=1) != kfold_split(ids, 0, k, seed=0)
    with pytest.raises(ConfigError):
        kfold_split(ids, k, k)
    # fewer cases than folds names the key and the most folds there can be (the key was not named)
    with pytest.raises(DataError, match=rf"\(data\.args\.num_folds\): set data\.args\.num_folds to at most {n}$"):
        kfold_split(ids, 0, n + 1)


def test_spleen_resampling_and_restore(tmp_path):
    root = SYNTH.get("spleen")(tmp_path / "spleen", seed=1, cases=2, test_cases=1, size=32)
    meta = json.loads((root / "dataset.json").read_text())
    assert meta["numTraining"] == 2 and meta["modality"] == {"0": "CT"}
    zooms = {nib.load(str(root / e["image"])).header.get_zooms() for e in meta["training"]}
    assert len(zooms) == 2  # spacing differs per case
    e = meta["training"][0]
    paths = {"image": [root / e["image"]], "label": root / e["label"]}
    item = preprocess_case(paths, PreprocessParams(target_spacing=(1.5, 1.5, 2.0), intensity="ct", crop_margin=2))
    np.testing.assert_allclose(item["meta"]["spacing"], (1.5, 1.5, 2.0), rtol=1e-9)
    assert nib.aff2axcodes(item["meta"]["affine"].numpy()) == ("R", "A", "S")
    assert 0.0 <= float(item["image"].min()) and float(item["image"].max()) <= 1.0
    back = restore_to_input(item["label"], item["meta"])
    orig = np.asarray(nib.load(str(paths["label"])).dataobj)
    assert back.shape == orig.shape
    dice = 2 * ((back > 0) & (orig > 0)).sum() / ((back > 0).sum() + (orig > 0).sum())
    assert dice > 0.9  # two nearest-neighbour resamplings only move the boundary


def test_random_patch_foreground_bias():
    image = torch.randn(2, 20, 20, 20)
    label = torch.zeros(20, 20, 20, dtype=torch.long)
    label[15:17, 2:4, 10:12] = 1
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        im, lab = random_patch(image, label, (6, 6, 6), pos_fraction=1.0, generator=g)
        assert im.shape == (2, 6, 6, 6) and lab.shape == (6, 6, 6) and lab.sum() > 0
    im, lab = random_patch(image[:, :4], label[:4], (6, 6, 6), pos_fraction=0.0, generator=g)
    assert im.shape == (2, 6, 6, 6)  # padded when the volume is smaller


def test_negative_patches_centre_in_the_body_as_monai_pos_neg_crop_with_its_image():
    """seed 003's spleen tutorials crop with ``RandCropByPosNegLabeld(..., image_key="image", image_threshold=0)``
    (``FgBgToIndicesd(image_key="image")`` in the fast one): a negative centre is a background voxel of the
    body, not of the air the CT window maps to 0. fastvision's negatives drew any voxel: with 1-voxel patches
    (the patch is its centre) they reached the air; now their support is MONAI's background indices, each
    voxel about equally often, and a volume without such a voxel falls back to foreground centres."""
    from monai.transforms.utils import map_binary_to_indices

    n = (7, 6, 5)
    g = torch.Generator().manual_seed(1)
    image = torch.rand(2, *n, generator=g)
    image[:, :3] = 0.0  # air in both channels
    image[1, :3, 0] = 0.5  # ... except where the second channel sees something: body for MONAI (any channel)
    label = torch.zeros(n, dtype=torch.long)
    label[4:6, 2:4, 1:3] = 1
    image[:, 5, 3, 2] = 0.0  # a foreground voxel in air stays a positive centre
    where = -1.0 - torch.arange(float(np.prod(n))).reshape(1, *n)  # a third channel, never above 0: the voxel
    image = torch.cat([image, where])
    _, bg = map_binary_to_indices(label[None], image, image_threshold=0)
    theirs = {int(i) for i in np.asarray(bg)}
    counts: dict[int, int] = {}
    for _ in range(3000):
        im, lab = random_patch(image, label, (1, 1, 1), pos_fraction=0.0, generator=g)
        hit = int(-1.0 - im[2, 0, 0, 0])
        counts[hit] = counts.get(hit, 0) + 1
        assert int(lab) == 0
    assert set(counts) == theirs  # the same support as MONAI's background indices
    expected = 3000 / len(theirs)
    assert max(abs(c - expected) for c in counts.values()) < 5 * np.sqrt(expected)
    no_body = torch.zeros(1, *n)  # nothing above 0: the negative draw falls back to a foreground centre
    for _ in range(20):
        _, lab = random_patch(no_body, label, (1, 1, 1), pos_fraction=0.0, generator=g)
        assert int(lab) == 1


def test_uniform_placement_is_monai_random_spatial_crop():
    """``placement: uniform`` (both BraTS recipes): the start uniform over ``[0, n - s]`` per axis whatever
    the label, as MONAI's ``RandSpatialCrop(random_size=False)`` (seed 003) and seed 000's ``RandomCrop3D``;
    the foreground-biased ``monai`` placement puts most starts elsewhere for a corner tumour."""
    from monai.transforms import RandSpatialCrop

    from fastvision.data.formats.patches import RandPatch

    n, s, draws = (9, 7, 5), (4, 4, 5), 1400
    image = torch.arange(float(np.prod(n))).reshape(1, *n)  # a voxel's value is its flat index
    label = torch.zeros(n, dtype=torch.long)
    label[:2, :2, :] = 1  # a corner tumour: must not pull the crops
    crop, g = RandPatch(s, pos_fraction=1.0, placement="uniform"), torch.Generator().manual_seed(0)
    ours = np.zeros((len(n), max(n)), int)
    for _ in range(draws):
        patch = crop({"image": image, "label": label}, g)
        start = np.unravel_index(int(patch["image"][0, 0, 0, 0]), n)
        np.testing.assert_array_equal(patch["image"][0].numpy(), image[0].numpy()[tuple(
            slice(a, a + k) for a, k in zip(start, s, strict=True))])
        for axis, a in enumerate(start):
            ours[axis, a] += 1
    monai_crop, theirs = RandSpatialCrop(s, random_size=False), np.zeros_like(ours)
    monai_crop.set_random_state(0)
    for _ in range(draws):
        start = np.unravel_index(int(monai_crop(image)[0, 0, 0, 0]), n)
        for axis, a in enumerate(start):
            theirs[axis, a] += 1
    for axis in range(len(n)):
        positions = n[axis] - s[axis] + 1
        assert (ours[axis] > 0).sum() == (theirs[axis] > 0).sum() == positions  # the same support
        expected = draws / positions  # and both uniform on it (5 sigma of a binomial count)
        bound = 5 * np.sqrt(expected)
        assert np.abs(ours[axis, :positions] - expected).max() < bound
        assert np.abs(theirs[axis, :positions] - expected).max() < bound
    biased = RandPatch(s, pos_fraction=1.0, placement="monai")
    starts = [np.unravel_index(int(biased({"image": image, "label": label}, g)["image"][0, 0, 0, 0]), n)[0]
              for _ in range(200)]
    assert np.mean(np.array(starts) == 0) > 0.9  # what the recipes drew before: tumour-centred crops


def test_synth_is_deterministic(tmp_path):
    a = SYNTH.get("brats")(tmp_path / "a", seed=5, cases=1, test_cases=0, size=16)
    b = SYNTH.get("brats")(tmp_path / "b", seed=5, cases=1, test_cases=0, size=16)
    f = "imagesTr/BRATS_001.nii.gz"
    np.testing.assert_array_equal(nib.load(str(a / f)).get_fdata(), nib.load(str(b / f)).get_fdata())
    assert nib.load(str(a / f)).shape == (16, 16, 16, 4)


# ------------------------------------------------------------------ persistent cache of preprocessed cases
from fastvision.data.formats.decathlon import VolumeDataset, read_dataset_json  # noqa: E402


def _counting():
    calls = []

    def compute(paths, params):
        calls.append(params)
        return preprocess_case(paths, params)

    return compute, calls


def _same_items(a: VolumeDataset, b: VolumeDataset) -> None:
    for i in range(len(a)):
        assert torch.equal(a[i]["image"], b[i]["image"]) and torch.equal(a[i]["label"], b[i]["label"])
        ma, mb = a.meta(i), b.meta(i)
        assert ma.keys() == mb.keys() and ma["crop_box"] == mb["crop_box"]
        torch.testing.assert_close(ma["affine"], mb["affine"], atol=0, rtol=0)
        torch.testing.assert_close(ma["input_affine"], mb["input_affine"], atol=0, rtol=0)


def test_persistent_cache_reads_back_and_invalidates(tmp_path, brats_pair):
    """data.cache: disk holds preprocessed volumes keyed by files + preprocessing signature."""
    from fastvision.data.cache.select import wrap_train_set

    cases = read_dataset_json(brats_pair[0])["training"]
    params = PreprocessParams(intensity="mri", label_map=((1, 2), (2, 1)))
    compute, calls = _counting()

    def disk(p):
        ds = wrap_train_set(VolumeDataset(cases, p, compute=compute), cache="disk", cache_dir=str(tmp_path))
        return [ds[i] for i in range(len(ds))]

    first = disk(params)
    assert len(calls) == 4 and len(list(tmp_path.glob("*.fvc"))) == 4
    again = disk(params)
    assert len(calls) == 4  # every case read from disk
    plain = VolumeDataset(cases, params)  # equal to preprocessing without a cache
    for i in range(4):
        assert torch.equal(again[i]["image"], plain[i]["image"]) and torch.equal(again[i]["label"], plain[i]["label"])
        assert torch.equal(again[i]["image"], first[i]["image"])
    disk(PreprocessParams(intensity="mri", crop_margin=2))
    assert len(calls) == 8  # a changed parameter recomputes every case
    st = cases[1]["label"].stat()
    os.utime(cases[1]["label"], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a label file replaced in place
    disk(params)
    assert len(calls) == 9


def test_volume_items_are_deterministic_and_the_crop_draws_per_item(tmp_path, brats_pair):
    """No private cache: building reads nothing; the training crop follows (seed, epoch, index)."""
    from fastvision.data.cache.select import wrap_train_set

    compute, calls = _counting()
    cases = read_dataset_json(brats_pair[0])["training"]
    ds = VolumeDataset(cases, PreprocessParams(intensity="mri"), patch_size=(8, 8, 8), compute=compute)
    assert calls == [] and torch.equal(ds[0]["image"], ds[0]["image"]) and ds[0]["label"].dtype == torch.long
    a, b = (wrap_train_set(ds, cache=c, seed=5) for c in ("none", "ram"))
    for epoch in (0, 1):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        for i in range(len(ds)):
            x, y = a[i], b[i]
            assert x["image"].shape == (ds[i]["image"].shape[0], 8, 8, 8) and x["label"].dtype == torch.long
            assert torch.equal(x["image"], y["image"]) and torch.equal(x["label"], y["label"])
    a.set_epoch(0)
    first = [a[i]["image"] for i in range(len(ds))]
    a.set_epoch(1)
    assert any(not torch.equal(first[i], a[i]["image"]) for i in range(len(ds)))  # a new epoch, new crops


@pytest.mark.parametrize("cache", ["ram", "gpu", "smart"], ids=["ram", "device-cache", "smart"])
def test_memory_cache_fills_through_the_disk_cache(tmp_path, brats_pair, cache):
    """With data.cache_dir a memory cache reads the persistent entries: a second run preprocesses nothing."""
    from fastvision.data.cache.select import wrap_train_set

    cases = read_dataset_json(brats_pair[0])["training"]
    compute, calls = _counting()
    crops = []
    for _ in range(2):
        ds = VolumeDataset(cases, PreprocessParams(intensity="mri"), patch_size=(8, 8, 8), compute=compute)
        out = wrap_train_set(ds, cache=cache, cache_dir=str(tmp_path), cache_num=4, seed=1)
        crops.append([out[i]["image"] for i in range(len(out))])
        if hasattr(out, "shutdown"):
            out.shutdown()
    assert len(calls) == 4 and len(list(tmp_path.glob("*.fvc"))) == 4  # the second run read every case
    assert all(torch.equal(a, b) for a, b in zip(*crops, strict=True))
