"""``fastvision predict`` on a folder without images: one line naming the folder and what was looked
for, exit 2 (it printed "wrote 0 files" and exited 0)."""
from __future__ import annotations

import pytest

from fastvision.errors import DataError
from fastvision.inference.inputs import folder_inputs


def test_folder_inputs_lists_images_and_case_folders(tmp_path):
    (tmp_path / "b.nii.gz").write_bytes(b"")
    (tmp_path / "a.PNG").write_bytes(b"")
    (tmp_path / "case1").mkdir()
    (tmp_path / "._b.nii.gz").write_bytes(b"")  # macOS companion: not an input
    assert [p.name for p in folder_inputs(tmp_path)] == ["a.PNG", "b.nii.gz", "case1"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "README.txt").write_text("x")
    with pytest.raises(DataError, match=r"notes: no images to predict \(looked for \*\.nii\.gz.*found 1 other"):
        folder_inputs(other)


@pytest.mark.parametrize("which", ["folds", "run"])
def test_predict_on_an_empty_folder_is_one_line(spleen_folds, tmp_path, capsys, which):
    from fastvision.cli import main

    _, folds, _ = spleen_folds
    ckpt = folds if which == "folds" else folds / "fold-0"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["predict", str(ckpt), str(empty), "--out", str(tmp_path / "pred"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(empty) in err[0] and "*.nii.gz" in err[0] and "wrote" not in err[0]
