"""What ``fastvision predict`` makes of its NIfTI inputs before it writes anything: BraTS case files grouped
into cases (both releases' names), and the header checks that stop a bad case before ``--out`` is made."""
from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from torch import nn

from fastvision.config import RunConfig
from fastvision.errors import DataError
from fastvision.inference.nifti import predict_nifti_files, prediction_cases
from fastvision.tasks.segment import SegmentationTask

OLD = ("flair", "t1", "t1ce", "t2")  # BraTS 2017-2021, channel order
NEW = ("t2f", "t1n", "t1c", "t2w")  # BraTS 2023-2024, the same channels


def _write(path: Path, shape=(6, 5, 4), affine=None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = np.random.default_rng(len(path.name)).random(shape).astype(np.float32)
    nib.save(nib.Nifti1Image(data, np.eye(4) if affine is None else affine), str(path))
    return path


def _case(root: Path, case: str, sep: str, mods, skip=()) -> Path:
    folder = root / case
    for m in (*mods, "seg"):
        if m not in skip:
            _write(folder / f"{case}{sep}{m}.nii.gz")
    return folder


@pytest.mark.parametrize("case,sep,mods", [("BraTS20_Training_001", "_", OLD), ("BraTS-GLI-00001-000", "-", NEW)])
def test_case_files_group_into_their_case(tmp_path, case, sep, mods):
    """A case folder expanded into its files (as predict expands a folder given on the command line), in
    any order, is one case: its four modalities in FLAIR, T1, T1ce, T2 order, the segmentation left out.
    2023-2024 names were each a one-channel case of their own ("has 1 channel(s), the model expects 4")."""
    folder = _case(tmp_path, case, sep, mods)
    files = sorted(folder.iterdir(), reverse=True)
    want = [folder / f"{case}{sep}{m}.nii.gz" for m in mods]
    assert prediction_cases(files) == [{"id": case, "image": want}]
    assert prediction_cases([folder]) == [{"id": case, "image": want}]  # the folder itself, as before


def _predict(files, out: Path):
    task = SegmentationTask(num_classes=4, mode="softmax", sample_shape=[4, 8, 8, 8], loss=nn.MSELoss())
    cfg = RunConfig()
    cfg.data.name, cfg.data.args = "brats", {}
    return predict_nifti_files(task, nn.Conv3d(4, 4, 1), files, out, cfg, torch.device("cpu"))


def test_bad_cases_stop_before_the_output_folder(tmp_path):
    """From the headers, before anything is written: a case missing a modality names the missing file; a
    modality on another grid, or a 5-D file, names that file (both used to stop only after ``--out`` held
    the predict's record)."""
    folder = _case(tmp_path / "in", "BraTS20_Training_002", "_", OLD, skip=("t1ce",))
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"lacks BraTS20_Training_002_t1ce\.nii\.gz"):
        _predict(sorted(folder.iterdir()), out)
    grid = _case(tmp_path / "in", "BraTS20_Training_003", "_", OLD)
    _write(grid / "BraTS20_Training_003_t2.nii.gz", shape=(6, 5, 3))
    with pytest.raises(DataError, match=r"_t2\.nii\.gz: grid \(shape/affine\) differs from .*_flair\.nii\.gz"):
        _predict([grid], out)
    moved = np.eye(4)
    moved[0, 3] = 2.0  # same shape, another origin
    _write(grid / "BraTS20_Training_003_t2.nii.gz", affine=moved)
    with pytest.raises(DataError, match="grid"):
        _predict([grid], out)
    five = _write(tmp_path / "in" / "five.nii.gz", shape=(6, 5, 4, 4, 1))
    with pytest.raises(DataError, match=r"five\.nii\.gz: expected a 3-D or 4-D NIfTI image, got shape \(6, 5, 4, 4, 1"):
        _predict([five], out)
    assert not out.exists()


def test_written_labels_drop_the_images_intensity_header_fields(tmp_path):
    """The label map keeps the image's geometry and descriptive header, not its intensity meaning: a scaled
    int16 MR (``scl_slope`` 0.01, ``cal_max`` 300, its display range) gave labels a display window of 0..300
    (FSLeyes shows 0..3 as black); now unset (0), and read back as the label values themselves."""
    from fastvision.inference.nifti import write_nifti

    affine = np.diag([1.2, 0.9, 2.0, 1.0])
    img = nib.Nifti1Image(np.arange(120, dtype=np.int16).reshape(6, 5, 4), affine)
    img.header.set_slope_inter(0.01, 5.0)
    img.header["cal_min"], img.header["cal_max"], img.header["descrip"] = 5.0, 300.0, b"scanner T1"
    nib.save(img, str(tmp_path / "t1.nii.gz"))
    labels = (np.arange(120).reshape(6, 5, 4) % 4).astype(np.uint8)
    back = nib.load(str(write_nifti(labels, tmp_path / "t1.nii.gz", tmp_path / "seg.nii.gz")))
    assert float(back.header["cal_min"]) == float(back.header["cal_max"]) == 0.0
    assert back.header.get_slope_inter() == (None, None) and back.get_data_dtype() == np.uint8
    np.testing.assert_array_equal(back.get_fdata(), labels)
    assert bytes(back.header["descrip"]).rstrip(b"\0") == b"scanner T1"
    np.testing.assert_allclose(back.affine, affine)
