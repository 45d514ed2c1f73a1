"""A NIfTI file cut short (a truncated download) is found from its last bytes: data inspect lists it
(exit 2) where it printed 'none found' (integer-stored) or a gzip EOFError traceback (float-stored), and
data.args.skip_unreadable skips its case (the header read, not the data, decided before)."""
from __future__ import annotations

import gzip
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from fastvision.cli import main
from fastvision.data.formats.anomalies import nifti_header
from fastvision.data.inspect import inspect_path
from fastvision.registry import DATASETS
from tests.data.test_real_medical import make_brats, make_task01

pytestmark = pytest.mark.usefixtures("fresh_logging")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "cache"))


def _cut(path: Path, as_float: bool = False) -> Path:
    if as_float:
        img = nib.load(str(path))
        nib.save(nib.Nifti1Image(np.asarray(img.dataobj).astype(np.float32), img.affine), str(path))
    data = path.read_bytes()
    path.write_bytes(data[: max(len(data) * 2 // 3, 400)])  # the header stays readable
    nib.load(str(path))
    return path


@pytest.mark.parametrize("year,as_float", [("2021", False), ("2021", True), ("2020", False)])
def test_inspect_lists_a_truncated_brats_file(tmp_path, capsys, year, as_float):
    base = make_brats(tmp_path, year, n=3)
    bad = _cut(sorted(p for p in base.rglob("*_t1.nii*"))[1], as_float)
    assert main(["data", "inspect", str(base)]) == 2
    assert "unreadable NIfTI files" in capsys.readouterr().err
    row = next(v for k, v in inspect_path(base)["anomalies"].items() if "unreadable" in k)
    assert row.startswith("1 (") and str(bad.relative_to(base)) in row and "ends early" in row


def test_inspect_lists_a_truncated_decathlon_image(tmp_path, capsys):
    root = make_task01(tmp_path, n=3)
    _cut(root / "imagesTr" / "BRATS_002.nii.gz")
    assert main(["data", "inspect", str(root)]) == 2
    assert "unreadable NIfTI files" in capsys.readouterr().err


def test_skip_unreadable_skips_the_truncated_case(tmp_path):
    base = make_brats(tmp_path, "2021", n=4)
    _cut(base / "BraTS2021_00002" / "BraTS2021_00002_t2.nii.gz")
    splits = DATASETS.build("brats", {"path": str(base), "num_folds": 2, "skip_unreadable": True})
    ids = {ds[i]["id"] for ds in (splits.train, splits.val) for i in range(len(ds))}
    assert ids == {"BraTS2021_00000", "BraTS2021_00001", "BraTS2021_00003"}


def test_whole_files_pass_also_as_two_gzip_members(tmp_path):
    """A multi-member gzip (its trailer gives the last member's size) decompresses in full: not refused."""
    src = make_brats(tmp_path, "2021", n=1) / "BraTS2021_00000" / "BraTS2021_00000_t1.nii.gz"
    raw = gzip.decompress(src.read_bytes())
    two = tmp_path / "two.nii.gz"
    two.write_bytes(gzip.compress(raw[:1000]) + gzip.compress(raw[1000:]))
    nifti_header(two)
    nifti_header(src)
