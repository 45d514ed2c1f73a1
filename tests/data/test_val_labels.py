"""A flat val folder's labels file (fastvision.data.formats.imagenet_val): the mistakes a hand-made
or spreadsheet-saved list holds: numbered class folders, a byte-order mark, a file listed twice."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastvision.cli import main
from fastvision.data.formats.imagefolder import build
from fastvision.errors import DataError


def _folder(root: Path, classes: list[str], val: list[str]) -> Path:
    for c in classes:
        (root / "train" / c).mkdir(parents=True)
        Image.fromarray(np.full((8, 8, 3), 7, np.uint8)).save(root / "train" / c / "a.png")
    (root / "val").mkdir()
    for v in val:
        Image.fromarray(np.full((8, 8, 3), 9, np.uint8)).save(root / "val" / f"{v}.png")
    return root


def _labels(root: Path, val_labels: str | None = None) -> dict[str, str]:
    args = {"path": str(root), "image_size": 8, "resize_size": 8}
    splits = build(**args, **({"val_labels": val_labels} if val_labels else {}))
    classes = splits.info["classes"]
    return {Path(p).stem: classes[i] for p, i in splits.val.samples}


@pytest.mark.parametrize("lines, expected", [
    # every number is a folder name, "10" is no index of 3 folders: names ("1" is folder 1, not index 1 = "10")
    (["v0 1", "v1 2", "v2 10"], {"v0": "1", "v1": "2", "v2": "10"}),
    # "0" is no folder name: indices into the sorted folders 1, 10, 2
    (["v0 0", "v1 1", "v2 2"], {"v0": "1", "v1": "10", "v2": "2"}),
])
def test_numbered_class_folders_read_as_the_whole_file_allows(tmp_path, lines, expected):
    root = _folder(tmp_path / "d", ["1", "2", "10"], ["v0", "v1", "v2"])
    (root / "val.txt").write_text("\n".join(f"{a}.png {b}" for a, b in (s.split() for s in lines)) + "\n")
    assert _labels(root, "val.txt") == expected


def test_numbers_that_are_both_names_and_other_indices_are_one_line(tmp_path, capsys):
    root = _folder(tmp_path / "d", ["1", "2", "10"], ["v0", "v1"])
    (root / "val.txt").write_text("v0.png 2\nv1.png 1\n")  # folder "2" or index 2 ("2"); "1": folder "1" or "10"
    with pytest.raises(DataError, match=r"val.txt:2: label 1 is both the class folder '1' and index 1 .*'10'"):
        _labels(root, "val.txt")
    assert main(["data", "inspect", str(root), "--set", "val_labels=val.txt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "val.txt:2" in err[0]


def test_a_csv_saved_with_a_byte_order_mark_is_read(tmp_path):
    root = _folder(tmp_path / "d", ["n01", "n02"], ["ILSVRC2012_val_00000001", "ILSVRC2012_val_00000002"])
    text = "ImageId,PredictionString\r\nILSVRC2012_val_00000001,n02 1 2 3 4\r\nILSVRC2012_val_00000002,n01 1 1 2 2\r\n"
    (root / "LOC_val_solution.csv").write_bytes(text.encode("utf-8-sig"))
    assert _labels(root) == {"ILSVRC2012_val_00000001": "n02", "ILSVRC2012_val_00000002": "n01"}
    (root / "mine.txt").write_bytes("ILSVRC2012_val_00000001.png n01\n".encode("utf-8-sig"))
    (root / "LOC_val_solution.csv").unlink()
    assert _labels(root, "mine.txt") == {"ILSVRC2012_val_00000001": "n01"}  # the first name too


@pytest.mark.parametrize("name, text, needle", [
    ("val.txt", "v0.png a\nv1.png b\nv0.JPEG b\n", "val.txt:3: v0 is labelled b here and a on line 1"),
    ("LOC_val_solution.csv", "ImageId,PredictionString\nv0,a 1 1 2 2\nv0,b 1 1 2 2\n",
     "LOC_val_solution.csv:3: v0 is labelled b here and a on line 2"),
])
def test_a_file_labelled_twice_differently_is_one_line(tmp_path, name, text, needle):
    root = _folder(tmp_path / "d", ["a", "b"], ["v0", "v1"])
    (root / name).write_text(text)
    with pytest.raises(DataError, match=needle):
        _labels(root, name)
    (root / name).write_text(text.replace("b 1 1 2 2\n", "a 1 1 2 2\n").replace("v0.JPEG b", "v0.JPEG a"))
    assert _labels(root, name)["v0"] == "a"  # the same label twice is no conflict


def test_class_names_written_decomposed_match_their_composed_form(tmp_path):
    """macOS writes file names decomposed ('café' as 'cafe' + U+0301); a val/ (or a copy evaluated on
    another machine) in the composed form is the same class, in the same place of the sorted list."""
    import unicodedata

    from fastvision.engine.state import classes_differ

    nfd, nfc = unicodedata.normalize("NFD", "café"), unicodedata.normalize("NFC", "café")
    for split, name in (("train", nfd), ("val", nfc)):
        for c in (name, "cafz"):
            (tmp_path / split / c).mkdir(parents=True)
            Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / split / c / "a.png")
    splits = build(path=str(tmp_path), image_size=8, resize_size=8)
    assert splits.info["classes"] == ["cafz", nfd]  # sorted as composed: é (U+00E9) after z, as the val copy
    assert sorted(label for _, label in splits.val.samples) == [0, 1]
    label = {Path(p).parent.name: i for p, i in splits.val.samples}
    assert label[nfc] == 1 and label["cafz"] == 0
    assert classes_differ({"classes": ["cafz", nfd]}, {"classes": ["cafz", nfc]}) is None
    assert classes_differ({"classes": ["cafz", nfd]}, {"classes": [nfc, "cafz"]}) is not None
    assert main(["data", "inspect", str(tmp_path)]) == 0  # no "val: class folders not in train/"
