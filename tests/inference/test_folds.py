"""``train --folds``: folds trained one after another, resumed, cross-validated; bad fold folders."""
from __future__ import annotations

import json
import shutil

import nibabel as nib
import numpy as np
import pytest
import torch

from fastvision import cli
from fastvision.data.formats.decathlon import kfold_split
from tests.inference.conftest import FOLD_FLAGS


def test_train_folds_writes_cross_validation(spleen_folds):
    data, out, printed = spleen_folds
    assert json.loads((out / "folds.json").read_text())["folds"] == [0, 1]
    res = json.loads((out / "crossval.json").read_text())
    training = json.loads((data / "dataset.json").read_text())["training"]
    ids = sorted(e["image"].split("/")[-1][: -len(".nii.gz")] for e in training)
    for k in (0, 1):
        # each fold's validation cases are the reader's split of data.args.fold = k ...
        assert sorted(c["id"] for c in res["cases"] if c["fold"] == k) == kfold_split(ids, k, 2)[1]
        # ... scored by this runner as the training loop's own evaluator scored them (another code path)
        summary = json.loads((out / f"fold-{k}" / "summary.json").read_text())
        mine = [c["mean_dice"] for c in res["cases"] if c["fold"] == k and c["mean_dice"] is not None]
        assert np.mean(mine) == pytest.approx(summary["dice"], abs=1e-6)
    # pooled Dice by hand from the per-case counts is in the table, the mean over cases too
    assert res["dice"] == pytest.approx(np.mean([c["mean_dice"] for c in res["cases"] if c["mean_dice"] is not None]))
    assert "out-of-fold" in printed and "pooled" in printed and "mean over cases" in printed
    pp = json.loads((out / "postprocessing.json").read_text())
    assert pp["folds"] == [0, 1] and isinstance(pp["steps"], list) and pp["trials"][0]["target"] == "foreground"


def test_cv_prints_the_folds_table(spleen_folds, capsys):
    _, out, _ = spleen_folds
    assert cli.main(["cv", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Dice per case" in text and "pooled" in text


def test_finished_folds_skipped_and_unfinished_resumed(spleen_folds, tmp_path, capsys):
    data, out, _ = spleen_folds
    copy = tmp_path / "cv"
    shutil.copytree(out, copy)
    (copy / "fold-1" / "summary.json").unlink()  # fold 1 stopped after its checkpoint, before the end
    stamp = (copy / "fold-0" / "checkpoints" / "last.pt").stat().st_mtime_ns
    assert cli.main(["train", "unet3d-spleen-baseline", "--data", str(data), "--folds", "all",
                     "--out", str(copy), "--postprocess", "lcc", *FOLD_FLAGS]) == 0
    assert (copy / "fold-0" / "checkpoints" / "last.pt").stat().st_mtime_ns == stamp  # not retrained
    log = capsys.readouterr().err
    assert "fold 0: finished already" in log and "resumed from" in log
    assert (copy / "fold-1" / "summary.json").is_file()
    assert json.loads((copy / "postprocessing.json").read_text())["steps"] == [[1]]  # --postprocess lcc


def _error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _test_image(data):
    return sorted((data / "imagesTs").glob("*.nii.gz"))[0]


@pytest.mark.parametrize("damage,words", [
    ("missing", "fold-1: missing"),
    ("unfinished", "fold-1: unfinished"),
    ("recipe", "another recipe"),
    ("labels", "another label set"),
    ("resample", "another preprocessing"),  # nnU-Net's order: other arrays than MONAI's (was ensembled)
    ("weights", "last.pt: missing (fold 1 finished"),  # was "unfinished (no summary.json)": it has one
    ("epochs", "another training length"),  # fold 1 trained for other epochs: another trainer (was ensembled)
])
def test_bad_folds_folder(spleen_folds, tmp_path, capsys, damage, words):
    data, out, _ = spleen_folds
    bad = tmp_path / "cv"
    shutil.copytree(out, bad)
    ckpt = bad / "fold-1" / "checkpoints" / "last.pt"
    if damage == "missing":
        shutil.rmtree(bad / "fold-1")
    elif damage == "unfinished":
        (bad / "fold-1" / "summary.json").unlink()
    elif damage == "weights":
        ckpt.unlink()
    else:  # fold 1 as if trained with another recipe / label set (a real checkpoint file, rewritten)
        state = torch.load(ckpt, weights_only=True)
        if damage == "recipe":
            state["config"]["recipe"] = "unet3d-spleen-fast"
        elif damage == "resample":
            state["config"]["data"]["args"]["resample"] = "nnunet"
        elif damage == "epochs":
            state["config"]["train"]["epochs"] = 2
        else:
            state["config"]["task"]["args"]["num_classes"] = 3
            state["data_info"]["class_names"] = ["background", "spleen", "tumour"]
        torch.save(state, ckpt)
    pred = tmp_path / "pred"
    err = _error(capsys, ["predict", str(bad), str(_test_image(data)), "--out", str(pred), "--device", "cpu"])
    assert words in err and str(bad / "fold-1") in err
    assert not pred.exists()  # nothing written


def test_input_channels_must_match(spleen_folds, tmp_path, capsys):
    data, out, _ = spleen_folds
    src = nib.load(str(_test_image(data)))
    two = np.stack([np.asarray(src.dataobj)] * 2, -1)
    bad = tmp_path / "in" / "two_channels.nii.gz"
    bad.parent.mkdir()
    nib.save(nib.Nifti1Image(two, src.affine), str(bad))
    good = _test_image(data)
    pred = tmp_path / "pred"
    err = _error(capsys, ["predict", str(out), str(good), str(bad), "--out", str(pred), "--device", "cpu"])
    assert str(bad) in err and "2 channel" in err and "expects 1" in err
    assert not pred.exists()  # checked before the first case: the good one is not written either


def test_folds_of_another_recipe_refused(spleen_folds, tmp_path, capsys):
    data, out, _ = spleen_folds
    other = tmp_path / "cv"
    other.mkdir()
    (other / "folds.json").write_text(json.dumps({"recipe_name": "unet3d-spleen-fast", "num_folds": 2,
                                                  "split_seed": 0, "folds": [0]}))
    err = _error(capsys, ["train", "unet3d-spleen-baseline", "--data", str(data), "--folds", "0",
                          "--out", str(other), *FOLD_FLAGS])
    assert "folds.json" in err and "unet3d-spleen-fast" in err
    assert sorted(p.name for p in other.iterdir()) == ["folds.json"]


@pytest.mark.parametrize("spec,error", [("5", "folds are 0..1"), ("a,b", "give all")])
def test_bad_folds_spec(spleen_folds, tmp_path, capsys, spec, error):
    data, _, _ = spleen_folds
    err = _error(capsys, ["train", "unet3d-spleen-baseline", "--data", str(data), "--folds", spec,
                          "--out", str(tmp_path / "x"), *FOLD_FLAGS])
    assert error in err and not (tmp_path / "x").exists()


def test_reader_without_folds_refused(tmp_path, capsys):
    err = _error(capsys, ["train", "resnet18-imagefolder", "--folds", "all", "--out", str(tmp_path / "x"),
                          "--device", "cpu"])
    assert "data.name=imagefolder" in err and "no folds" in err and not (tmp_path / "x").exists()
    assert all(name in err for name in ("decathlon", "brats", "microscopy"))  # the readers that have them


def test_out_that_is_another_folder_refused(spleen_folds, tmp_path, capsys):
    data, _, _ = spleen_folds
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("recipe: x\n")
    err = _error(capsys, ["train", "unet3d-spleen-baseline", "--data", str(data), "--folds", "all",
                          "--out", str(run), *FOLD_FLAGS])
    assert "not a train --folds folder" in err and sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def _last_error(capsys, argv) -> str:
    """The error line of a command that logged the fold it started first (one error line, the last)."""
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [x for x in lines if x.startswith("fastvision: error:")] == lines[-1:], lines
    return lines[-1]


@pytest.mark.parametrize("num_folds,fold,words", [
    (5, "4", "4 cases cannot be split into 5 folds"),  # the reader refuses: folds.json was left behind
    (0, "all", "num_folds must be >= 2"),              # "all" of 0 folds: nothing trained, no cross-validation
    (1, "all", "num_folds must be >= 2"),
])
def test_folds_refused_before_training_leave_no_folder(spleen_folds, tmp_path, capsys, num_folds, fold, words):
    data, _, _ = spleen_folds
    out = tmp_path / "cv"
    err = _last_error(capsys, ["train", "unet3d-spleen-baseline", "--data", str(data), "--folds", fold, "--out",
                               str(out), *FOLD_FLAGS, "--set", f"data.args.num_folds={num_folds}"])
    assert words in err and not out.exists()  # so the corrected command is not refused as another split's folder


def test_folds_folder_of_earlier_folds_kept_when_a_new_fold_is_refused(spleen_folds, tmp_path, capsys):
    data, done, _ = spleen_folds
    out = tmp_path / "cv"
    shutil.copytree(done, out)
    before = (out / "folds.json").read_text()
    (out / "folds.json").write_text(before.replace('"num_folds": 2', '"num_folds": 5'))
    err = _last_error(capsys, ["train", "unet3d-spleen-baseline", "--data", str(data), "--folds", "4", "--out",
                               str(out), *FOLD_FLAGS, "--set", "data.args.num_folds=5"])
    assert "cannot be split" in err and (out / "folds.json").is_file() and (out / "fold-0" / "summary.json").is_file()


def test_evaluate_of_a_folds_folder_names_a_fold_and_cv(spleen_folds, capsys):
    _, out, _ = spleen_folds
    err = _error(capsys, ["evaluate", str(out), "--device", "cpu"])  # was: no checkpoints/best.pt or last.pt
    assert "train --folds folder" in err and str(out / "fold-0") in err and f"fastvision cv {out}" in err


def test_folds_of_another_data_set_refused(spleen_folds, tmp_path, capsys):
    data, out, _ = spleen_folds
    other = tmp_path / "Task09_other"
    shutil.copytree(data, other)
    copy = tmp_path / "cv"
    shutil.copytree(out, copy)
    before = (copy / "folds.json").read_text()
    # the next folds on another data set into the same folder: they were trained and mixed in
    err = _error(capsys, ["train", "unet3d-spleen-baseline", "--data", str(other), "--folds", "all",
                          "--out", str(copy), *FOLD_FLAGS])
    assert "folds.json" in err and "Task09_other" in err and (copy / "folds.json").read_text() == before
    # the same data set moved elsewhere (same folder name) is the same data set
    moved = tmp_path / "moved" / data.name
    shutil.copytree(data, moved)
    assert cli.main(["train", "unet3d-spleen-baseline", "--data", str(moved), "--folds", "all",
                     "--out", str(copy), *FOLD_FLAGS, "--postprocess", "none"]) == 0
    assert "fold 0: finished already" in capsys.readouterr().err


@pytest.mark.parametrize("record", ["folds.json", "older folds.json"])
def test_folds_of_other_epochs_refused(spleen_folds, tmp_path, capsys, record):
    # the finished folds (1 epoch) were skipped and the command's new folds trained for 2 epochs: one ensemble
    # of two trainers; nnU-Net keeps another epoch count in another folder (nnUNetTrainer_<N>epochs)
    data, out, _ = spleen_folds
    copy = tmp_path / "cv"
    shutil.copytree(out, copy)
    listed = json.loads((copy / "folds.json").read_text())
    assert (listed["epochs"], listed["steps_per_epoch"]) == (1, None)
    if record == "older folds.json":  # written before the training length was: the folds' configs say it
        (copy / "folds.json").write_text(json.dumps({k: v for k, v in listed.items()
                                                     if k not in ("epochs", "steps_per_epoch")}))
    before = {p: p.stat().st_mtime_ns for p in copy.rglob("*")}
    err = _error(capsys, ["train", "unet3d-spleen-baseline", "--data", str(data), "--folds", "all",
                          "--out", str(copy), *FOLD_FLAGS, "--epochs", "2"])
    assert "folds.json: folds of epochs 1, this command trains 2" in err and "another --out" in err
    assert {p: p.stat().st_mtime_ns for p in copy.rglob("*")} == before  # nothing trained or rewritten
