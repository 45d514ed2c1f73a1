"""A raw BraTS case whose modality files are not one 4-channel image: found from the headers by
``data inspect`` (exit 2, every case listed) and by ``train`` before its run folder is made (one line
naming the file). Training used to stop in the cache fill after the run folder was made (a modality on
another grid), or with a torch.stack traceback in the first batch (a 4-D modality file of two volumes)."""
from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest

from fastvision.cli import main
from fastvision.data.inspect import inspect_path
from tests.data.test_real_medical import make_brats

pytestmark = pytest.mark.usefixtures("fresh_logging")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "cache"))


def _rewrite(path, fn) -> None:
    img = nib.load(str(path))
    nib.save(nib.Nifti1Image(fn(np.asarray(img.dataobj)), img.affine), str(path))


def _cropped(base):
    bad = base / "BraTS2021_00001" / "BraTS2021_00001_t2.nii.gz"
    _rewrite(bad, lambda a: a[:, :, :-3])  # shape (16, 16, 13) beside the flair's (16, 16, 16)
    return bad


def _two_volumes(base):
    bad = base / "BraTS2021_00002" / "BraTS2021_00002_t1.nii.gz"
    _rewrite(bad, lambda a: np.stack([a, a], axis=-1))  # 4-D, two volumes: 5 channels in the case
    return bad


@pytest.mark.parametrize("damage,says", [(_cropped, "grid (shape/affine) differs from"),
                                         (_two_volumes, "2 volume(s); case BraTS2021_00002 holds 5 channels")])
def test_train_refuses_the_case_before_the_run_folder(tmp_path, capsys, damage, says):
    base = make_brats(tmp_path, "2021", n=3)
    bad = damage(base)
    out = tmp_path / "run"
    rc = main(["train", "unet3d-brats", "--data", str(base), "--out", str(out), "--epochs", "1", "--device", "cpu",
               "--set", "data.name=brats", "--set", "data.args.num_folds=3", "--set", "data.num_workers=0",
               "--set", "data.args.patch_size=[16,16,16]", "--set", "model.args.filters=[4,8,16]",
               "--set", "task.args.sliding_window.roi_size=[16,16,16]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and str(bad) in err[0] and says in err[0], err
    assert not out.exists()


def test_inspect_lists_every_such_case(tmp_path, capsys):
    base = make_brats(tmp_path, "2021", n=4)
    cropped, doubled = _cropped(base), _two_volumes(base)
    assert main(["data", "inspect", str(base)]) == 2
    err = capsys.readouterr().err
    assert "2 file(s) would stop training" in err and "not one 4-channel image" in err
    row = next(v for k, v in inspect_path(base)["anomalies"].items() if "not one 4-channel image" in k)
    assert row.startswith("2 (") and str(cropped.relative_to(base)) in row and str(doubled.relative_to(base)) in row
    assert "holds 5 channels" in row and str(base) not in row


def test_missing_modality_is_named_with_the_case_files_extension(tmp_path, capsys):
    """BraTS 2020 as on Kaggle holds .nii files: the missing modality is named as .nii (it said .nii.gz)."""
    base = make_brats(tmp_path, "2020", n=2)
    (base / "BraTS20_Training_354" / "BraTS20_Training_354_t1ce.nii").unlink()
    assert main(["data", "inspect", str(base)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("lacks BraTS20_Training_354_t1ce.nii"), err


def _float_labels(base, fn) -> list:
    segs = sorted(base.rglob("*_seg.nii.gz"))
    for p in segs:
        _rewrite(p, lambda a: fn(a.astype(np.float32)))
    return segs


def test_float_label_files_round_to_their_classes(tmp_path):
    """A float label file with rounding noise (1.99999 for edema) reads as its classes; the int16 cast
    truncated 1.99999 to 1 (edema trained as core) and 0.99999 to background."""
    import torch

    from fastvision.registry import DATASETS

    base = make_brats(tmp_path, "2021", n=2)
    truth = {p.parent.name: np.asarray(nib.load(str(p)).dataobj).copy() for p in base.rglob("*_seg.nii.gz")}
    _float_labels(base, lambda a: np.where(a > 0, a - 1e-5, a))
    splits = DATASETS.build("brats", {"path": str(base), "num_folds": 2, "crop_foreground": False})
    for ds in (splits.train, splits.val):
        item = ds[0]
        want = np.where(truth[item["id"]] == 4, 3, truth[item["id"]])  # the release's 4 -> class 3
        assert set(np.unique(want).tolist()) == {0, 1, 2, 3}
        assert torch.equal(item["label"].reshape(want.shape).long(), torch.from_numpy(want).long())


def test_interpolated_label_file_is_one_line(tmp_path, capsys):
    base = make_brats(tmp_path, "2021", n=3)
    seg = _float_labels(base, lambda a: np.where(a == 2, 1.5, a))[1]
    assert main(["data", "inspect", str(base)]) == 2
    assert "not whole numbers" in capsys.readouterr().err
    row = next(v for k, v in inspect_path(base)["anomalies"].items() if "not whole numbers" in k)
    assert row.startswith("3 (") and str(seg.relative_to(base)) in row
    out = tmp_path / "run"
    rc = main(["train", "unet3d-brats", "--data", str(base), "--out", str(out), "--epochs", "1", "--device", "cpu",
               "--set", "data.name=brats", "--set", "data.args.num_folds=3", "--set", "data.num_workers=0",
               "--set", "data.args.patch_size=[16,16,16]", "--set", "model.args.filters=[4,8,16]",
               "--set", "task.args.sliding_window.roi_size=[16,16,16]", "--set", "data.cache=none"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fastvision: error")]
    assert rc == 2 and len(err) == 1 and "_seg.nii.gz: label value 1.5 is not a whole number" in err[0], err


def test_inspect_names_a_3_in_a_2017_2021_release(tmp_path, capsys):
    """2017-2021 files mark ET as 4; a file holding 3 (converted by hand?) trains as ET while predict
    writes 4: inspect says so (exit 0, it trains); a 2023 folder's 3 is its own ET, no anomaly."""
    base = make_brats(tmp_path / "a", "2021", n=2)
    seg = sorted(base.rglob("*_seg.nii.gz"))[0]
    _rewrite(seg, lambda a: np.where(a == 4, 3, a))
    assert main(["data", "inspect", str(base)]) == 0
    rows = inspect_path(base)["anomalies"]
    assert any("holding 3" in k and str(seg.relative_to(base)) in v for k, v in rows.items()), rows
    assert not any("holding 3" in k for k in inspect_path(make_brats(tmp_path / "b", "2023", n=2))["anomalies"])
