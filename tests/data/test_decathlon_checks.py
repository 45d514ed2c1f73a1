"""A Decathlon folder whose files disagree with dataset.json, or with the recipe, is named in one line
before anything trains (nnU-Net's ``verify_dataset_integrity`` refuses the same folders), and
``data inspect`` lists it: generated spleen CT (1 channel) and prostate MR (2 channels) at a few
voxels, each edited the way a user's folder goes wrong."""
from __future__ import annotations

import json
import shutil

import nibabel as nib
import numpy as np
import pytest

from fastvision.cli import main
from fastvision.data.inspect import inspect_path
from fastvision.data.synth import load_all

pytestmark = pytest.mark.usefixtures("fresh_logging")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sets")
    synth = load_all()
    return {"spleen": synth.get("spleen")(root / "spleen", seed=0, cases=4, test_cases=1, size=16),
            "prostate": synth.get("prostate")(root / "prostate", seed=0, cases=4, size=16, slices=8)}


def _copy(src, dst, modality=None):
    shutil.copytree(src, dst)
    if modality is not None:
        meta = json.loads((dst / "dataset.json").read_text())
        meta["modality"] = modality
        (dst / "dataset.json").write_text(json.dumps(meta))
    return dst


def _one_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("fastvision: error")]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("kind, modality, have, names", [
    ("spleen", {"0": "CT", "1": "PET"}, 1, "2 modalities (CT, PET)"),  # dataset.json names a channel too many
    ("prostate", {"0": "T2"}, 2, "1 modality (T2)"),                     # one too few
])
@pytest.mark.parametrize("argv", [["data", "inspect", "{d}", "--fingerprint"], ["configure", "{d}", "--memory", "8GiB"],
                                  ["train", "unet3d-spleen-fast", "--data", "{d}", "--epochs", "1", "--device", "cpu",
                                   "--out", "{d}-run"]])
def test_modality_count_other_than_the_images_is_one_line(sets, tmp_path, capsys, kind, modality, have, names, argv):
    d = _copy(sets[kind], tmp_path / "bad", modality)
    assert main([a.format(d=d) for a in argv]) == 2
    line = _one_line(capsys)
    assert f"imagesTr/{kind}" in line and f"{have} channel(s)" in line and f"bad/dataset.json names {names}" in line
    assert not (tmp_path / "bad-run").exists()  # nothing written


def test_inspect_lists_images_of_another_channel_count_and_exits_2(sets, tmp_path, capsys):
    d = _copy(sets["spleen"], tmp_path / "bad", {"0": "CT", "1": "PET"})
    rows = inspect_path(d)["anomalies"]
    assert rows["images whose channel count is not dataset.json's modality count (2)"].startswith(
        "4 (imagesTr/spleen_1.nii.gz (1), ")
    assert main(["data", "inspect", str(d)]) == 2
    assert "would stop training (images whose channel count" in _one_line(capsys)


def test_inspect_lists_labels_on_another_grid(sets, tmp_path, capsys):
    """A label two slices short (same origin) and one shifted 5 mm: listed, exit 0 (training resamples
    them onto the image grid, with a warning); the same grid stored in another orientation is not listed."""
    d = _copy(sets["spleen"], tmp_path / "grid")
    f = d / "labelsTr" / "spleen_2.nii.gz"
    img = nib.load(f)
    nib.save(nib.Nifti1Image(np.asarray(img.dataobj)[:, :, :-2], img.affine, img.header), f)
    f = d / "labelsTr" / "spleen_3.nii.gz"
    img = nib.load(f)
    shifted = img.affine.copy()
    shifted[0, 3] += 5
    nib.save(nib.Nifti1Image(np.asarray(img.dataobj), shifted, img.header), f)
    f = d / "labelsTr" / "spleen_4.nii.gz"  # flipped voxel order, flipped affine: the same world grid
    img = nib.load(f)
    n = img.shape[0]
    flip = np.diag([-1.0, 1, 1, 1])
    flip[0, 3] = n - 1
    nib.save(nib.Nifti1Image(np.asarray(img.dataobj)[::-1].copy(), img.affine @ flip), f)
    rows = inspect_path(d)["anomalies"]
    assert rows == {"labels on another grid than their image (resampled onto it by world position when read)":
                    "2 (labelsTr/spleen_2.nii.gz, labelsTr/spleen_3.nii.gz)"}
    assert main(["data", "inspect", str(d)]) == 0
    assert "labels on another grid" in capsys.readouterr().out
    assert main(["data", "inspect", str(d), "--fingerprint"]) == 0
    err = capsys.readouterr().err
    assert "spleen_2.nii.gz: label grid (16, 16, " in err and "(same origin and axes)" in err
    assert "spleen_3.nii.gz" in err and "voxels apart" in err and "spleen_4" not in err
    # the fingerprint lists them as an anomaly from its records: again when every case comes from its cache
    # (the reader's per-file warning does not fire then; the cached run named nothing before)
    for run in ("read", "cached"):
        assert main(["data", "inspect", str(d), "--fingerprint", "--json", str(tmp_path / f"{run}.json")]) == 0, run
        err = capsys.readouterr().err
        assert "2 cases whose label is on another grid than its image" in err and "spleen_2, spleen_3" in err, run
        listed = json.loads((tmp_path / f"{run}.json").read_text())["anomalies"]
        assert listed["cases whose label is on another grid than its image (resampled onto it, nearest)"] == [
            "spleen_2", "spleen_3"], run


def test_recipe_for_another_channel_count_is_one_line(sets, tmp_path, capsys):
    """A recipe planned for 1-channel CT trained or evaluated on 2-channel MR: one line naming both counts
    before any step (not the convolution's error after the run folder is written)."""
    assert main(["configure", str(sets["spleen"]), "--memory", "8GiB", "--trainer", "fast",
                 "--out", str(tmp_path / "ct.yaml")]) == 0
    capsys.readouterr()
    small = ["--set", "data.args.num_folds=2", "--set", "model.args.filters=[4,8,16]", "--device", "cpu"]
    assert main(["train", str(tmp_path / "ct.yaml"), "--data", str(sets["prostate"]), "--epochs", "1",
                 "--out", str(tmp_path / "mr-run"), *small]) == 2
    line = _one_line(capsys)
    assert "2 channel(s) (T2, ADC), the model takes 1 (model.args.in_channels)" in line
    assert not (tmp_path / "mr-run").exists()
    assert main(["train", str(tmp_path / "ct.yaml"), "--epochs", "1", "--out", str(tmp_path / "ct-run"),
                 "--set", "data.cache=ram", *small]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "ct-run"), "--data", str(sets["prostate"]), "--device", "cpu"]) == 2
    assert "the model takes 1 (model.args.in_channels)" in _one_line(capsys)


@pytest.mark.parametrize("patch, norm, needle", [
    ("[4,4,4]", "instance", "one voxel at its bottleneck (divisor [4, 4, 4])"),  # 4 / 4: a norm of one voxel
    ("[8,8,6]", "batch", "multiple of the model's divisor [4, 4, 4]"),
])
def test_a_patch_the_network_cannot_take_is_one_line_before_training(sets, tmp_path, capsys, patch, norm, needle):
    """unet3d-brats' CPU smoke line (patch 32^3 through five halvings, instance norm) stopped at the first
    step with torch's "Expected more than 1 spatial element"; a patch the model cannot take is now named
    before the run folder is made, and what it can take trains: a one-voxel bottleneck under batch norm
    (batch 2 has two values to normalise), a larger patch under instance norm."""
    small = ["--epochs", "1", "--device", "cpu", "--amp", "off", "--set", "data.args.num_folds=2",
             "--set", "model.args.filters=[4,8,16]", "--set", f"model.args.norm={norm}"]
    argv = ["train", "unet3d-spleen-fast", "--data", str(sets["spleen"]), *small]
    assert main([*argv, "--out", str(tmp_path / "bad"), "--set", f"data.args.patch_size={patch}"]) == 2
    line = _one_line(capsys)
    assert f"data.args.patch_size={patch.replace(',', ', ')}" in line and needle in line
    assert not (tmp_path / "bad").exists()
    good = "[8,8,8]" if norm == "instance" else "[4,4,4]"
    assert main([*argv, "--out", str(tmp_path / "good"), "--set", f"data.args.patch_size={good}",
                 "--set", f"task.args.sliding_window.roi_size={good}"]) == 0


def test_the_patch_the_affine_cuts_is_the_one_checked(sets, tmp_path, capsys):
    """nnU-Net's training loads a larger patch (any side) and the batched affine cuts the network's patch
    from it: the cut size is what must fit the divisor, and the error names that key."""
    argv = ["train", "unet3d-spleen-fast", "--data", str(sets["spleen"]), "--epochs", "1", "--device", "cpu",
            "--amp", "off", "--set", "data.args.num_folds=2", "--set", "model.args.filters=[4,8,16]",
            "--set", "data.args.patch_size=[10,10,9]"]
    assert main([*argv, "--out", str(tmp_path / "bad"), "--set", "data.augment.affine={size: [8, 8, 6]}"]) == 2
    line = _one_line(capsys)
    assert "data.augment.affine.size=[8, 8, 6]" in line and "divisor [4, 4, 4]" in line
    assert main([*argv, "--out", str(tmp_path / "good"), "--set", "data.augment.affine={size: [8, 8, 8]}",
                 "--set", "task.args.sliding_window.roi_size=[8,8,8]"]) == 0


@pytest.mark.parametrize("setting, needle", [
    ("task.args.sliding_window.overlap=1.5", "task.args.sliding_window.overlap: a fraction in [0, 1), got 1.5"),
    ("task.args.sliding_window.mode=gauss", "task.args.sliding_window.mode: gaussian or constant, got 'gauss'"),
    ("task.args.sliding_window.overlapp=0.5", "unknown key task.args.sliding_window.overlapp; valid keys: roi_size"),
    ("task.args.sliding_window.sw_batch_size=0", "task.args.sliding_window.sw_batch_size: an integer >= 1, got 0"),
    ("task.args.sliding_window.roi_size=[8,8,6]",
     "task.args.sliding_window.roi_size=[8, 8, 6]: each side must be a multiple of the model's divisor [4, 4, 4]"),
    ("task.args.sliding_window.roi_size=[8,8]", "task.args.sliding_window.roi_size=[8, 8]: 2 sides for a model of 3"),
    ("task.args.eval=crop --set task.args.eval_crop=[8,8,6]",
     "task.args.eval_crop=[8, 8, 6]: each side must be a multiple of the model's divisor [4, 4, 4]"),
])
def test_a_validation_window_the_run_cannot_use_is_one_line_before_training(sets, tmp_path, capsys, setting, needle):
    """A bad sliding window (an overlap of 1.5, a mode ``gauss``, a ROI the network cannot take) trained the first
    epoch, then stopped the first validation with a traceback (exit 1) in a run folder; now one line naming the
    key, exit 2, no run folder."""
    argv = ["train", "unet3d-spleen-fast", "--data", str(sets["spleen"]), "--epochs", "1", "--device", "cpu",
            "--amp", "off", "--set", "data.args.num_folds=2", "--set", "model.args.filters=[4,8,16]",
            "--set", "data.args.patch_size=[8,8,8]", "--set", "task.args.sliding_window.roi_size=[8,8,8]"]
    sets = [x for part in setting.split(" --set ") for x in ("--set", part)]
    assert main([*argv, "--out", str(tmp_path / "bad"), *sets]) == 2
    assert needle in _one_line(capsys)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("setting, needle", [
    ("task.args.num_classes=3", "model.args.out_channels=2 but task.args.num_classes=3 (mode softmax) reads 3"),
    ("model.args.out_channels=3", "model.args.out_channels=3 but task.args.num_classes=2 (mode softmax) reads 2"),
])
def test_a_model_of_other_outputs_than_the_task_is_one_line_before_training(sets, tmp_path, capsys, setting,
                                                                            needle):
    """``task.args.num_classes`` beside a model of another number of logits trained and scored without a word
    (classes past the task's never scored); now one line naming both keys, exit 2, no run folder."""
    argv = ["train", "unet3d-spleen-fast", "--data", str(sets["spleen"]), "--epochs", "1", "--device", "cpu",
            "--set", "data.args.num_folds=2", "--set", "model.args.filters=[4,8,16]", "--set", setting]
    assert main([*argv, "--out", str(tmp_path / "bad")]) == 2
    assert needle in _one_line(capsys)
    assert not (tmp_path / "bad").exists()


def _as_brats2023(raw, out):
    """A 2017-2021 raw BraTS folder renamed to 2023-2024's names (t2f, t1n, t1c, t2w; labels as they are)."""
    names = {"flair": "t2f", "t1": "t1n", "t1ce": "t1c", "t2": "t2w", "seg": "seg"}
    for f in sorted(raw.rglob("*_*.nii.gz")):
        case, mod = f.name[: -len(".nii.gz")].rsplit("_", 1)
        new = f"BraTS-GLI-{case.replace('_', '')[-6:]}"
        (out / new).mkdir(parents=True, exist_ok=True)
        shutil.copy(f, out / new / f"{new}-{names[mod]}.nii.gz")
    return out


def test_a_label_value_past_the_classes_stops_the_case(tmp_path, capsys):
    """BraTS 2024's post-treatment label 4 (resection cavity) in a 2023-2024 folder, whose labels load as they
    are (0..3): the case trained with that region as no class at all, silently; now the cache fill stops with
    one line naming the label file and the value. The same files with 4 remapped to 3 load."""
    from fastvision.data.formats import DATASETS
    from fastvision.errors import DataError

    raw = load_all().get("brats")(tmp_path / "raw", seed=1, cases=4, size=12, layout="brats")
    new = _as_brats2023(raw, tmp_path / "gli")
    segs = sorted(new.rglob("*-seg.nii.gz"))
    assert len(segs) == 4 and any(4 in np.unique(np.asarray(nib.load(str(s)).dataobj)) for s in segs)
    assert main(["data", "inspect", str(new)]) == 2  # it lists the files training stops on
    assert "label values past the classes 0..3" in _one_line(capsys)
    splits = DATASETS.build("brats", {"path": str(new), "num_folds": 2, "crop_foreground": False})
    with pytest.raises(DataError, match=r"-seg\.nii\.gz: label value 4 is not a class of this dataset \(0\.\.3"):
        for part in (splits.train, splits.val):
            for i in range(len(part)):
                part[i]
    for s in segs:  # what the docs tell the user to do: remap it
        img = nib.load(str(s))
        lab = np.asarray(img.dataobj).copy()
        lab[lab == 4] = 3
        nib.save(nib.Nifti1Image(lab, img.affine, img.header), str(s))
    splits = DATASETS.build("brats", {"path": str(new), "num_folds": 2, "crop_foreground": False})
    assert max(int(splits.train[i]["label"].max()) for i in range(len(splits.train))) == 3
    assert main(["data", "inspect", str(new)]) == 0


def test_nnunet_v2_labels_read_as_msd_labels(sets, tmp_path):
    """dataset.json's labels in nnU-Net v2's form ({name: value}, channel_names) train as MSD's form: data inspect
    and configure read them so, training stopped with "invalid literal for int() with base 10: 'background'"."""
    from fastvision.data.formats.decathlon import build_decathlon

    v2 = _copy(sets["prostate"], tmp_path / "v2")
    meta = json.loads((v2 / "dataset.json").read_text())
    msd_labels = meta["labels"]
    meta["labels"] = {name: int(value) for value, name in reversed(list(msd_labels.items()))}  # order need not be
    meta["channel_names"] = meta.pop("modality")
    (v2 / "dataset.json").write_text(json.dumps(meta))
    want = [msd_labels[str(k)].lower() for k in sorted(map(int, msd_labels))]
    for folder in (sets["prostate"], v2):
        splits = build_decathlon(path=str(folder), num_folds=2, crop_foreground="nonzero", patch_size=(8, 8, 4))
        assert splits.info["class_names"] == want and splits.info["num_classes"] == 3
        assert splits.info["channels"] == ["T2", "ADC"]
