"""Medical archives as users download them: MSD Task01/Task09 tarballs and BraTS 2020 / 2021 / 2023 GLI.

Each replica copies the release's file names, folder nesting, dataset.json text and label ids at
16^3 voxels; what the readers load is checked against the labels written (hand-mapped).
"""
from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from fastvision.cli import main
from fastvision.data.formats.brats import BRATS_REGIONS, find_cases
from fastvision.data.formats.brats_layouts import detect
from fastvision.data.inspect import inspect_path
from fastvision.ops.regions import region_lut, region_masks
from fastvision.registry import DATASETS

S = 16
APPLEDOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(64)  # a "._" companion's header


pytestmark = pytest.mark.usefixtures("fresh_logging")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "cache"))


def _regions(label: torch.Tensor) -> torch.Tensor:
    """(*S) class ids -> (3, *S) WT, TC, ET masks, as the regions task builds its target."""
    return region_masks(label[None], region_lut(BRATS_REGIONS))[0]


def _label(seed: int, ids: tuple[int, int, int]) -> np.ndarray:
    """Nested blobs: ids[0] (outer, edema-like), ids[1] (core), ids[2] (enhancing) in a 16^3 grid."""
    lab = np.zeros((S, S, S), np.uint8)
    c = 6 + seed % 4
    lab[c - 4:c + 5, 4:13, 4:13] = ids[0]
    lab[c - 2:c + 3, 6:11, 6:11] = ids[1]
    lab[c - 1:c + 1, 7:9, 7:9] = ids[2]
    return lab


def _image(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (100 + 20 * rng.standard_normal((S, S, S))).astype(np.int16)


def _save(arr: np.ndarray, path: Path, companion: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(arr, np.eye(4)), str(path))
    if companion:
        (path.parent / f"._{path.name}").write_bytes(APPLEDOUBLE)


def make_task01(root: Path, n: int = 4) -> Path:
    """Task01_BrainTumour as untarred on a Mac: 4-D images (modalities last), MSD label ids."""
    root = root / "Task01_BrainTumour"
    training = []
    for k in range(n):
        name = f"BRATS_{k + 1:03d}.nii.gz"
        img = np.stack([_image(10 * k + c) for c in range(4)], axis=-1)
        _save(img, root / "imagesTr" / name, companion=True)
        _save(_label(k, (1, 2, 3)), root / "labelsTr" / name, companion=True)  # 1 edema, 2 non-enh, 3 enh
        training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
    _save(np.stack([_image(99)] * 4, axis=-1), root / "imagesTs" / "BRATS_485.nii.gz", companion=True)
    meta = {"name": "BRATS", "description": "Gliomas segmentation tumour and oedema in on brain images",
            "reference": "https://www.med.upenn.edu/sbia/brats2017.html",
            "licence": "CC-BY-SA 4.0", "release": "2.0 04/05/2018", "tensorImageSize": "4D",
            "modality": {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"},
            "labels": {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"},
            "numTraining": n, "numTest": 1, "training": training, "test": ["./imagesTs/BRATS_485.nii.gz"]}
    (root / "dataset.json").write_text(json.dumps(meta, indent=4))
    (root / "._dataset.json").write_bytes(APPLEDOUBLE)
    return root


def make_brats(root: Path, year: str, n: int = 4) -> Path:
    """A BraTS challenge training folder of ``year`` (2020, 2021 or 2023), as unzipped."""
    if year == "2020":
        top, case_of, mods, ext = "MICCAI_BraTS2020_TrainingData", "BraTS20_Training_{:03d}", \
            ("flair", "t1", "t1ce", "t2"), ".nii"
        ids, sep = (2, 1, 4), "_"
    elif year == "2021":
        top, case_of = "BraTS2021_Training_Data", "BraTS2021_{:05d}"
        mods, ext = ("flair", "t1", "t1ce", "t2"), ".nii.gz"
        ids, sep = (2, 1, 4), "_"
    else:
        top, case_of, mods, ext = "ASNR-MICCAI-BraTS2023-GLI-Challenge-TrainingData", "BraTS-GLI-{:05d}-000", \
            ("t1c", "t1n", "t2f", "t2w"), ".nii.gz"
        ids, sep = (2, 1, 3), "-"
    base = root / top
    for k in range(n):
        case = case_of.format(k + (354 if year == "2020" else 0))
        for c, m in enumerate(mods):
            _save(_image(10 * k + c), base / case / f"{case}{sep}{m}{ext}")
        seg = f"{case}{sep}seg{ext}"
        if year == "2020" and case == "BraTS20_Training_355":
            seg = "W39_1998.09.19_Segm.nii"  # the 2020 release's one oddly named segmentation
        _save(_label(k, ids), base / case / seg)
    if year == "2020":
        (base / "name_mapping.csv").write_text("Grade,BraTS_2017_subject_ID,BraTS_2018_subject_ID,...\n")
        (base / "survival_info.csv").write_text("Brats20ID,Age,Survival_days,Extent_of_Resection\n")
    return base


def _expected(file_label: np.ndarray, mapping: dict[int, int]) -> torch.Tensor:
    out = np.zeros_like(file_label, dtype=np.int64)
    for a, b in mapping.items():
        out[file_label == a] = b
    return torch.from_numpy(out)


def test_task01_tarball_layout_loads_with_brats_ids(tmp_path):
    root = make_task01(tmp_path)
    splits = DATASETS.build("decathlon", {"path": str(root), "num_folds": 2,
                                          "crop_foreground": False})
    assert splits.info["in_channels"] == 4 and splits.info["channels"] == ["FLAIR", "T1w", "t1gd", "T2w"]
    assert splits.info["label_convention"]["layout"] == "msd-task01"
    assert splits.info["test_images"] == [str(root / "imagesTs/BRATS_485.nii.gz")]
    item = splits.train[0]
    assert item["image"].shape == (4, S, S, S) and item["image"].dtype == torch.float32
    msd = np.asarray(nib.load(str(root / f"labelsTr/{item['id']}.nii.gz")).dataobj)
    # MSD 1 edema -> 2, 2 non-enhancing -> 1, 3 enhancing -> 3 (fastvision's BraTS ids)
    assert torch.equal(item["label"], _expected(msd, {1: 2, 2: 1, 3: 3}))
    wt, tc, et = _regions(item["label"])
    assert torch.equal(wt, torch.from_numpy(msd > 0)) and torch.equal(et, torch.from_numpy(msd == 3))
    assert torch.equal(tc, torch.from_numpy((msd == 2) | (msd == 3)))
    report = inspect_path(root)
    assert report["layout"] == "decathlon"
    assert report["anomalies"]["macOS ._ companion files (ignored)"].startswith("9 (imagesTr/._BRATS_001.nii.gz")
    assert report["label values (first 10)"] == [0, 1, 2, 3]


@pytest.mark.parametrize("year,layout,file_ids", [
    ("2020", "brats2017-2021", {1: 1, 2: 2, 4: 3}),
    ("2021", "brats2017-2021", {1: 1, 2: 2, 4: 3}),
    ("2023", "brats2023-gli", {1: 1, 2: 2, 3: 3}),
])
def test_brats_release_layouts(tmp_path, year, layout, file_ids):
    base = make_brats(tmp_path, year)
    found = detect(tmp_path)
    assert found.name == layout and len(found.cases) == 4
    first = found.cases[0]
    # channels FLAIR, T1, T1ce, T2 whatever the release calls them
    suffixes = ("t2f", "t1n", "t1c", "t2w") if year == "2023" else ("flair", "t1", "t1ce", "t2")
    assert [p.name.split("_" if year != "2023" else "-")[-1].split(".")[0] for p in first["image"]] == list(suffixes)
    if year == "2020":
        odd = next(c for c in found.cases if c["id"] == "BraTS20_Training_355")
        assert odd["label"].name == "W39_1998.09.19_Segm.nii"
        assert found.anomalies["segmentation under another name (used)"] == \
            ["MICCAI_BraTS2020_TrainingData/BraTS20_Training_355/W39_1998.09.19_Segm.nii"]
    splits = DATASETS.build("brats", {"path": str(base), "num_folds": 2,
                                      "crop_foreground": False})
    assert splits.info["label_convention"]["layout"] == layout
    for ds in (splits.train, splits.val):
        for i in range(len(ds)):
            item = ds[i]
            case = next(c for c in found.cases if c["id"] == item["id"])
            raw = np.asarray(nib.load(str(case["label"])).dataobj)
            assert set(np.unique(raw).tolist()) == {0, *file_ids}
            assert item["image"].shape == (4, S, S, S)
            assert torch.equal(item["label"], _expected(raw, file_ids))
            et_id = 4 if year != "2023" else 3
            assert torch.equal(_regions(item["label"])[2], torch.from_numpy(raw == et_id))
    report = inspect_path(tmp_path)
    assert report["layout"] == "brats" and report["cases"] == 4
    assert report["label convention"]["layout"] == layout
    assert report["label values (first 10)"] == sorted({0, *file_ids})


def test_brats_mixed_or_incomplete_cases_fail_with_one_line(tmp_path, capsys):
    base = make_brats(tmp_path, "2021", n=2)
    (base / "BraTS2021_00001" / "BraTS2021_00001_t1ce.nii.gz").unlink()
    assert main(["data", "inspect", str(base)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "BraTS2021_00001_t1ce.nii.gz" in err[0]


def test_find_cases_ignores_macos_companions(tmp_path):
    base = make_brats(tmp_path, "2021", n=2)
    for p in list(base.rglob("*.nii.gz")):
        (p.parent / f"._{p.name}").write_bytes(APPLEDOUBLE)
    cases = find_cases(base)
    assert [c["id"] for c in cases] == ["BraTS2021_00000", "BraTS2021_00001"]
    assert all(not p.name.startswith("._") for c in cases for p in c["image"])


@pytest.mark.parametrize("year,writes_4", [("2020", True), ("2023", False)])
def test_predictions_use_the_training_release_ids(tmp_path, year, writes_4):
    from fastvision.inference.nifti import prediction_preprocessing

    base = make_brats(tmp_path, year, n=2)
    _, ids = prediction_preprocessing(None, "brats", {"path": str(base)})
    assert ids == ({3: 4} if writes_4 else None)


def test_wrong_reader_names_the_right_one(tmp_path, capsys):
    base = make_brats(tmp_path, "2023", n=2)
    task = make_task01(tmp_path / "msd", n=2)
    with pytest.raises(Exception, match=r"dataset.json not found.*looks like a BraTS challenge folder"):
        DATASETS.build("decathlon", {"path": str(base), "num_folds": 2})
    with pytest.raises(Exception, match=r"no BraTS cases under .*use data.name=decathlon"):
        DATASETS.build("brats", {"path": str(task), "num_folds": 2})


def test_inspect_lists_every_missing_and_corrupt_decathlon_file(tmp_path, capsys):
    """A Decathlon folder with one listed image gone and one label not a NIfTI: both rows in the
    report, one summary line naming both kinds, exit 2 (it used to stop at the first missing file)."""
    from fastvision.data.synth import load_all

    root = load_all().get("spleen")(tmp_path / "Task09", seed=0, cases=4, test_cases=0, size=20)
    gone = sorted((root / "imagesTr").glob("*.nii.gz"))[0]
    bad = sorted((root / "labelsTr").glob("*.nii.gz"))[-1]
    gone.unlink()
    bad.write_bytes(b"not a nifti")
    assert main(["data", "inspect", str(root)]) == 2
    out, err = capsys.readouterr()
    assert gone.name in out and bad.stem.split(".")[0] in out and "unreadable NIfTI" in out
    assert "training cases" in out and "volumes not in dataset.json" not in out  # the dropped case's label is listed
    assert err.strip().splitlines() == [f"fastvision: error: {root}: 2 file(s) would stop training (files "
                                        "dataset.json lists that do not exist; unreadable NIfTI files): listed above"]
