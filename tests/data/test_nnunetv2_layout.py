"""nnU-Net v2's raw layout (``channel_names``, ``file_ending``, no ``training`` list, one file per channel) read
wherever a Decathlon folder is: the same cases written in both layouts load, train, configure, evaluate and
predict alike; bad folders stop with one line naming the file (exit 2, no run folder). Before, a v2
dataset.json was "not a Decathlon dataset.json ('training')"."""
from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from fastvision.cli import main
from fastvision.data.formats.dataset_labels import task01_label_map
from fastvision.data.synth import load_all
from fastvision.errors import DataError
from fastvision.inference.nifti import prediction_cases
from fastvision.registry import DATASETS

pytestmark = pytest.mark.usefixtures("fresh_logging")

TINY = ["--epochs", "1", "--device", "cpu", "--amp", "off", "--set", "data.args.patch_size=[16,16,16]",
        "--set", "task.args.sliding_window.roi_size=[16,16,16]", "--set", "model.args.filters=[4,8,16]",
        "--set", "data.num_workers=0", "--set", "data.cache=ram", "--set", "data.args.num_folds=2",
        "--set", "examples=0"]


def _save(array: np.ndarray, path: Path, affine: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(array, affine), str(path))


def _two_layouts(root: Path, ending: str = ".nii.gz", cases: int = 3) -> tuple[Path, Path]:
    """The same 2-channel (T2, ADC) cases by hand: an MSD folder (4-D images, training list) and an nnU-Net v2
    folder (``{case}_0000``/``_0001`` files, labels ``{"background": 0, "PZ": 1, "TZ": 2}``)."""
    rng = np.random.default_rng(0)
    msd, v2 = root / "Task05_Prostate", root / "Dataset005_Prostate"
    affine = np.diag([0.8, 0.8, 2.5, 1.0])
    training = []
    for n in range(cases):
        case = f"prostate_{n:02d}"
        image = rng.normal(100, 20, (12, 10, 8, 2)).astype(np.float32)
        label = rng.integers(0, 3, (12, 10, 8)).astype(np.uint8)
        _save(image, msd / f"imagesTr/{case}.nii.gz", affine)
        _save(label, msd / f"labelsTr/{case}.nii.gz", affine)
        training.append({"image": f"./imagesTr/{case}.nii.gz", "label": f"./labelsTr/{case}.nii.gz"})
        for c in range(2):
            _save(image[..., c], v2 / f"imagesTr/{case}_{c:04d}{ending}", affine)
        _save(label, v2 / f"labelsTr/{case}{ending}", affine)
    (msd / "dataset.json").write_text(json.dumps({"modality": {"0": "T2", "1": "ADC"}, "training": training,
                                                  "labels": {"0": "background", "1": "PZ", "2": "TZ"}}))
    (v2 / "dataset.json").write_text(json.dumps({"channel_names": {"0": "T2", "1": "ADC"}, "numTraining": cases,
                                                 "labels": {"background": 0, "PZ": 1, "TZ": 2},
                                                 "file_ending": ending}))
    return msd, v2


@pytest.mark.parametrize("ending", [".nii.gz", ".nii"])
def test_a_v2_folder_loads_the_cases_of_its_msd_copy(tmp_path, ending):
    msd, v2 = _two_layouts(tmp_path, ending)
    args = {"num_folds": 3, "intensity": "zscore", "crop_foreground": False}
    a, b = (DATASETS.build("decathlon", {"path": str(p), **args}) for p in (msd, v2))
    assert [c["id"] for c in b.train.cases] == [c["id"] for c in a.train.cases] == ["prostate_00", "prostate_01"]
    first = [Path(p).name for p in b.train.cases[0]["image"]]
    assert first == [f"prostate_00_0000{ending}", f"prostate_00_0001{ending}"]
    for i in range(2):
        x, y = a.train[i], b.train[i]
        assert x["image"].shape == (2, 12, 10, 8) and torch.equal(x["image"], y["image"])
        assert torch.equal(x["label"], y["label"])
    assert b.info["class_names"] == a.info["class_names"] == ["background", "pz", "tz"]
    assert b.info["channels"] == ["T2", "ADC"] and b.info["in_channels"] == 2
    assert b.info["label_convention"]["layout"] == "nnunetv2"
    assert b.info["label_convention"]["file_ending"] == ending


def test_the_same_cases_train_to_the_same_loss_and_configure_to_the_same_plan(tmp_path, capsys):
    synth = load_all().get("spleen")
    msd = synth(tmp_path / "Task09", seed=3, cases=4, test_cases=1, size=16)
    assert main(["data", "synth", "spleen", str(tmp_path / "v2"), "--seed", "3", "--cases", "4",
                 "--test-cases", "1", "--size", "16", "--layout", "nnunetv2"]) == 0
    v2 = tmp_path / "v2"
    assert sorted(p.name for p in (v2 / "imagesTr").iterdir())[:2] == ["spleen_1_0000.nii.gz", "spleen_2_0000.nii.gz"]
    assert "training" not in json.loads((v2 / "dataset.json").read_text())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the staging folder is gone
    for name, data in (("a", msd), ("b", v2)):
        assert main(["train", "unet3d-spleen-baseline", "--data", str(data), "--out", str(tmp_path / name),
                     *TINY]) == 0
        assert main(["configure", str(data), "--out", str(tmp_path / f"{name}.yaml")]) == 0
    capsys.readouterr()
    a, b = (json.loads((tmp_path / n / "summary.json").read_text()) for n in "ab")
    assert a["train_loss"] == b["train_loss"] and a["val_loss"] == b["val_loss"] and a["dice"] == b["dice"]
    plans = [(tmp_path / f"{n}.yaml").read_text().replace(str(d), "DATA") for n, d in (("a", msd), ("b", v2))]
    assert plans[0].split("\n", 1)[1] == plans[1].split("\n", 1)[1]  # all but the command line it was planned by

    # predict of the v2 imagesTs: the channel files grouped by case, one {case}.nii.gz, as the MSD run's
    assert main(["predict", str(tmp_path / "a"), str(msd / "imagesTs"), "--out", str(tmp_path / "pa"),
                 "--device", "cpu"]) == 0
    assert main(["predict", str(tmp_path / "b"), str(v2 / "imagesTs"), "--out", str(tmp_path / "pb"),
                 "--device", "cpu"]) == 0
    assert sorted(p.name for p in (tmp_path / "pb").iterdir() if not p.name.startswith(".")) == ["spleen_5.nii.gz"]
    assert (tmp_path / "pa/spleen_5.nii.gz").read_bytes() == (tmp_path / "pb/spleen_5.nii.gz").read_bytes()


def test_task01_in_v2_labels_maps_to_the_brats_classes_as_the_msd_copy(tmp_path):
    synth = load_all().get("brats")
    msd = synth(tmp_path / "Task01", seed=2, cases=3, test_cases=0, size=16)
    v2 = synth(tmp_path / "Dataset001", seed=2, cases=3, test_cases=0, size=16, layout="nnunetv2")
    meta = json.loads((v2 / "dataset.json").read_text())
    assert meta["labels"] == {"background": 0, "edema": 1, "non-enhancing tumor": 2, "enhancing tumour": 3}
    args = {"num_folds": 3, "crop_foreground": False}
    a, b = (DATASETS.build("decathlon", {"path": str(p), **args}) for p in (msd, v2))
    assert b.info["label_convention"]["layout"] == "nnunetv2-task01"
    assert b.info["class_names"] == a.info["class_names"] and b.info["regions"] == ["wt", "tc", "et"]
    raw = np.asarray(nib.load(str(v2 / "labelsTr/BRATS_001.nii.gz")).dataobj)
    x, y = a.train[0], b.train[0]
    assert torch.equal(x["image"], y["image"]) and torch.equal(x["label"], y["label"])
    # hand mapping of the file ids: 1 edema -> 2, 2 non-enhancing -> 1, 3 enhancing -> 3
    assert torch.equal(y["label"], torch.from_numpy(np.array([0, 2, 1, 3])[raw]))


def test_task01_map_reads_each_form_of_labels():
    msd = {"labels": {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"}}
    v2 = {"labels": {"background": 0, "edema": 1, "non-enhancing tumor": 2, "enhancing tumour": 3}}
    regions = {"labels": {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": [3]}}
    want = {(1, 2), (2, 1), (3, 3)}
    assert set(task01_label_map(msd)) == set(task01_label_map(v2)) == set(task01_label_map(regions)) == want
    assert task01_label_map({"labels": {"background": 0, "spleen": 1}}) == ()


def _broken(v2: Path, what: str) -> str:
    """Break ``v2`` one way; the file the error must name."""
    meta = json.loads((v2 / "dataset.json").read_text())
    if what == "missing channel":
        (v2 / "imagesTr/prostate_01_0001.nii.gz").unlink()
        return str(v2 / "imagesTr/prostate_01_0001.nii.gz")
    if what == "channel too many":
        (v2 / "imagesTr/prostate_01_0002.nii.gz").write_bytes((v2 / "imagesTr/prostate_01_0001.nii.gz").read_bytes())
        return str(v2 / "imagesTr/prostate_01_0002.nii.gz")
    if what == "no channel number":
        (v2 / "imagesTr/prostate_01_0001.nii.gz").rename(v2 / "imagesTr/prostate_01_adc.nii.gz")
        return str(v2 / "imagesTr/prostate_01_adc.nii.gz")
    if what == "missing label":
        (v2 / "labelsTr/prostate_02.nii.gz").unlink()
        return str(v2 / "labelsTr/prostate_02.nii.gz")
    meta.update({"not nifti": {"file_ending": ".mha"}, "no file_ending": {"file_ending": None},
                 "channel_names keys": {"channel_names": {"1": "T2", "2": "ADC"}}}[what])
    (v2 / "dataset.json").write_text(json.dumps({k: v for k, v in meta.items() if v is not None}))
    return str(v2 / "dataset.json")


@pytest.mark.parametrize("what", ["missing channel", "channel too many", "no channel number", "missing label",
                                  "not nifti", "no file_ending", "channel_names keys"])
def test_a_broken_v2_folder_is_one_line_naming_the_file_and_no_run_folder(tmp_path, capsys, what):
    _, v2 = _two_layouts(tmp_path)
    named = _broken(v2, what)
    with pytest.raises(DataError, match="^" + named.replace(".", r"\.")) as e:  # the library: the file first
        DATASETS.build("decathlon", {"path": str(v2), "num_folds": 2})
    why = {"missing channel": "channel 1, ADC, of case prostate_01", "channel too many": "channel 2, but",
           "no channel number": "not named {case}_XXXX", "missing label": "does not exist",
           "not nifti": "file_ending '.mha'", "no file_ending": "no 'file_ending'", "channel_names keys": "0..1"}
    assert why[what] in str(e.value)
    capsys.readouterr()
    assert main(["train", "unet3d-spleen-baseline", "--data", str(v2), "--out", str(tmp_path / "run"), *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastvision: error: ") and named in err and "\n" not in err
    assert not (tmp_path / "run").exists()
    if what in ("missing channel", "channel too many", "no channel number", "missing label"):
        assert main(["data", "inspect", str(v2)]) == 2  # listed, not a traceback
        assert Path(named).name in capsys.readouterr().out


def test_predict_groups_channel_files_by_case_and_names_a_missing_one(tmp_path):
    files = [tmp_path / n for n in ("b_0001.nii", "b_0000.nii", "a_0000.nii", "a_0001.nii", "whole.nii.gz")]
    cases = prediction_cases(files, ".nii")
    assert [(c["id"], [p.name for p in c["image"]], c.get("out_name")) for c in cases] == [
        ("b", ["b_0000.nii", "b_0001.nii"], "b.nii"), ("a", ["a_0000.nii", "a_0001.nii"], "a.nii"),
        ("whole", ["whole.nii.gz"], None)]
    assert [c["id"] for c in prediction_cases(files[:2])] == ["b_0001", "b_0000"]  # an MSD run: one file, one case
    with pytest.raises(DataError, match=r"c_0001\.nii: not among the inputs \(channel 1 of case c"):
        prediction_cases([tmp_path / "c_0000.nii", tmp_path / "c_0002.nii"], ".nii")


def test_a_4d_channel_file_is_named_and_a_refused_cases_label_is_not_without_images(tmp_path, capsys):
    _, v2 = _two_layouts(tmp_path)
    two = np.zeros((12, 10, 8, 2), np.float32)  # a 4-D file as channel 1: the case holds 3 channels
    _save(two, v2 / "imagesTr/prostate_01_0001.nii.gz", np.diag([0.8, 0.8, 2.5, 1.0]))
    with pytest.raises(DataError, match=r"prostate_01_0001\.nii\.gz: 3 channel\(s\) in its case, but .* names 2"):
        DATASETS.build("decathlon", {"path": str(v2), "num_folds": 2})
    (v2 / "imagesTr/prostate_02_0002.nii.gz").write_bytes((v2 / "imagesTr/prostate_02_0001.nii.gz").read_bytes())
    (v2 / "imagesTr/prostate_00_0000.nii.gz").unlink()
    (v2 / "imagesTr/prostate_00_0001.nii.gz").unlink()
    assert main(["data", "inspect", str(v2)]) == 2
    out = capsys.readouterr().out
    # prostate_00 has no images left; prostate_02 has (it is refused for its channel 2): only 00 is "without"
    assert "labelsTr/prostate_00.nii.gz" in out and "labelsTr/prostate_02.nii.gz" not in out


def test_v2s_dataset_entry_lists_the_files(tmp_path):
    _, v2 = _two_layouts(tmp_path, cases=2)
    (v2 / "imagesTr/prostate_00_0001.nii.gz").rename(v2 / "adc_of_00.nii.gz")
    meta = json.loads((v2 / "dataset.json").read_text())
    meta["dataset"] = {"prostate_00": {"images": ["imagesTr/prostate_00_0000.nii.gz", "adc_of_00.nii.gz"],
                                       "label": "labelsTr/prostate_00.nii.gz"}}
    (v2 / "dataset.json").write_text(json.dumps(meta))
    from fastvision.data.formats.decathlon import read_dataset_json

    found = read_dataset_json(v2)
    assert [(c["id"], [p.name for p in c["image"]]) for c in found["training"]] == [
        ("prostate_00", ["prostate_00_0000.nii.gz", "adc_of_00.nii.gz"])]
    meta["dataset"]["prostate_00"]["images"][1] = "gone.nii.gz"
    (v2 / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"gone\.nii\.gz: does not exist"):
        read_dataset_json(v2)


def test_nifti_files_of_another_ending_are_an_anomaly_not_a_case(tmp_path):
    _, v2 = _two_layouts(tmp_path, ".nii")
    _save(np.zeros((12, 10, 8), np.float32), v2 / "imagesTr/prostate_09_0000.nii.gz", np.eye(4))
    from fastvision.data.formats.decathlon import read_dataset_json

    found = read_dataset_json(v2)
    assert [c["id"] for c in found["training"]] == ["prostate_00", "prostate_01", "prostate_02"]
    kind = "NIfTI files not ending in file_ending .nii (ignored)"
    assert found["anomalies"] == {kind: ["imagesTr/prostate_09_0000.nii.gz"]}


@pytest.mark.parametrize("given", ["nnUNet_raw", "nnUNet_raw/Dataset005_Prostate/imagesTr"])
def test_the_raw_folder_or_an_imagesTr_given_for_the_dataset_names_the_dataset_folder(tmp_path, capsys, given):
    _two_layouts(tmp_path / "nnUNet_raw")  # nnUNet_raw/Dataset005_Prostate and .../Task05_Prostate
    assert main(["train", "unet3d-spleen-baseline", "--data", str(tmp_path / given), "--out", str(tmp_path / "run"),
                 *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"--data {tmp_path / 'nnUNet_raw' / 'Dataset005_Prostate'}") and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_a_multichannel_msd_run_groups_channel_files_from_0000_and_leaves_other_names_alone(tmp_path):
    files = [tmp_path / n for n in ("x_0000.nii.gz", "x_0001.nii.gz", "case_0001.nii.gz", "case_0002.nii.gz",
                                    "solo_0000.nii.gz", "BRATS_001.nii.gz")]
    cases = prediction_cases(files, None, 2)  # no file_ending: an MSD run of a 2-channel model
    assert sorted((c["id"], len(c["image"]), c.get("out_name")) for c in cases) == [
        ("BRATS_001", 1, None), ("case_0001", 1, None), ("case_0002", 1, None), ("solo_0000", 1, None), ("x", 2, None)]
    assert [c["id"] for c in prediction_cases(files[:2], None, 1)] == ["x_0000", "x_0001"]  # one channel: as before
    with pytest.raises(DataError, match=r"y_0001\.nii\.gz: not among the inputs"):
        prediction_cases([tmp_path / "y_0000.nii.gz", tmp_path / "y_0002.nii.gz"], None, 3)


def test_configure_of_v2_brats_regions_writes_them_in_the_ids_the_reader_trains_on(tmp_path, capsys):
    import yaml

    v2 = load_all().get("brats")(tmp_path / "Dataset137", seed=4, cases=3, test_cases=0, size=16, layout="nnunetv2")
    meta = json.loads((v2 / "dataset.json").read_text())
    meta["labels"] = {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": 3}
    (v2 / "dataset.json").write_text(json.dumps(meta))
    assert main(["configure", str(v2), "--out", str(tmp_path / "plan.yaml")]) == 0
    capsys.readouterr()
    task = yaml.safe_load((tmp_path / "plan.yaml").read_text())["task"]["args"]
    assert task["mode"] == "regions" and task["region_names"] == ["whole tumor", "tumor core", "enhancing tumor"]
    splits = DATASETS.build("decathlon", {"path": str(v2), "num_folds": 3, "crop_foreground": False})
    item, case = splits.train[0], splits.train.cases[0]
    raw = np.asarray(nib.load(str(case["label"])).dataobj)
    # each region of the plan, on the label training reads, is dataset.json's region of the file's ids
    for region, file_ids in zip(task["regions"], ([1, 2, 3], [2, 3], [3]), strict=True):
        assert np.isin(raw, file_ids).any()
        assert np.array_equal(np.isin(item["label"].numpy(), region), np.isin(raw, file_ids)), region


@pytest.mark.parametrize("text, why", [(b"", "not valid JSON"), ("{\"name\": \"Milz \xe9\"}".encode("latin-1"),
                                                                    "not UTF-8 text")])
def test_a_dataset_json_that_is_not_utf8_json_is_one_line_naming_it_and_a_bom_reads(tmp_path, capsys, text, why):
    msd, v2 = _two_layouts(tmp_path)
    (v2 / "dataset.json").write_bytes(b"\xef\xbb\xbf" + (v2 / "dataset.json").read_bytes())  # Windows' BOM: read
    assert len(DATASETS.build("decathlon", {"path": str(v2), "num_folds": 3}).train) == 2
    (msd / "dataset.json").write_bytes(text)  # an empty file of a stopped copy, a latin-1 name
    assert main(["train", "unet3d-spleen-baseline", "--data", str(msd), "--out", str(tmp_path / "run"), *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fastvision: error: {msd / 'dataset.json'}: {why}") and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_v2s_ignore_label_is_refused_not_trained_as_a_class(tmp_path, capsys):
    _, v2 = _two_layouts(tmp_path)
    meta = json.loads((v2 / "dataset.json").read_text())
    meta["labels"] = {"background": 0, "PZ": 1, "ignore": 2}
    (v2 / "dataset.json").write_text(json.dumps(meta))
    for argv in (["train", "unet3d-spleen-baseline", "--data", str(v2), "--out", str(tmp_path / "run"), *TINY],
                 ["configure", str(v2), "--out", str(tmp_path / "plan.yaml")], ["data", "inspect", str(v2)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"fastvision: error: {v2 / 'dataset.json'}: labels.ignore") and "\n" not in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "plan.yaml").exists()


def test_label_values_with_a_gap_are_refused_before_any_file_is_read(tmp_path, capsys):
    _, v2 = _two_layouts(tmp_path)
    meta = json.loads((v2 / "dataset.json").read_text())
    meta["labels"] = {"background": 0, "PZ": 1, "TZ": 3}
    (v2 / "dataset.json").write_text(json.dumps(meta))
    assert main(["configure", str(v2), "--out", str(tmp_path / "plan.yaml")]) == 2  # it wrote a 3-class plan
    err = capsys.readouterr().err.strip()
    assert err == f"fastvision: error: {v2 / 'dataset.json'}: labels 0, 1, 3 are not consecutive from 0 (nnU-Net v2: " \
                  "0, 1, 2, ...); renumber the label files and dataset.json's labels"
    assert not (tmp_path / "plan.yaml").exists()
