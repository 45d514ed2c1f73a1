"""``fastvision data synth KIND OUT --option V``: an option value no dataset can have (no images, no
cases, a zero size or spacing) is one line naming the option, exit 2, and nothing is written."""
from __future__ import annotations

import pytest

from fastvision.cli import main


@pytest.mark.parametrize("kind, options, named", [
    ("microscopy", ["--count", "0"], "--count 0: must be at least 1"),
    ("microscopy", ["--size", "0"], "--size 0: must be at least 16"),
    ("imagenet", ["--classes", "1"], "--classes 1: must be at least 2"),
    ("imagenet", ["--per-class", "0"], "--per-class 0: must be at least 1"),
    ("imagenet", ["--quality", "99"], "--quality 99: must be at most 95"),
    ("coco", ["--val", "0"], "--val 0: must be at least 1"),
    ("coco", ["--min-size", "0"], "--min-size 0: must be more than 0"),
    ("brats", ["--cases", "0"], "--cases 0: must be at least 1"),
    ("brats", ["--layout", "nifti"], "--layout 'nifti': must be decathlon, brats, brats2023 or nnunetv2"),
    ("spleen", ["--cases", "0"], "--cases 0: must be at least 1"),
    ("spleen", ["--zoom", "0"], "--zoom 0: must be more than 0"),
    ("spleen", ["--test-cases", "-1"], "--test-cases -1: must be at least 0"),
    ("prostate", ["--spacing", "[0.6, 0, 3.6]"], "--spacing 0.6,0,3.6: must be more than 0 (each)"),
    ("hippocampus", ["--shape", "[2, 2, 2]"], "--shape 2,2,2: must be at least 8 (each)"),
    ("thinstack", ["--slices", "0"], "--slices 0: must be at least 1"),
    ("pathology", ["--slides", "0"], "--slides 0: must be at least 1"),
    ("pathology", ["--tile", "24"], "--tile 24: must be a multiple of 16"),
    ("imagenet", ["--seed", "-1"], "--seed -1: must be at least 0"),  # was numpy's ValueError traceback
    ("pathology", ["--seed", "-3"], "--seed -3: must be at least 0"),
])
def test_a_senseless_option_is_one_line_naming_it(kind, options, named, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["data", "synth", kind, str(out), *options]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"fastvision: error: data synth {kind} {named}"], err
    assert not out.exists()


def test_the_bound_is_the_smallest_sensible_value(tmp_path, capsys):
    assert main(["data", "synth", "microscopy", str(tmp_path / "m0"), "--count", "0", "--size", "16"]) == 2
    assert main(["data", "synth", "hippocampus", str(tmp_path / "h0"), "--cases", "1", "--shape", "[7, 8, 8]"]) == 2
    assert main(["data", "synth", "microscopy", str(tmp_path / "m"), "--count", "1", "--size", "16"]) == 0
    assert main(["data", "synth", "hippocampus", str(tmp_path / "h"), "--cases", "1", "--shape", "[8, 8, 8]"]) == 0
    assert len(list((tmp_path / "m" / "images").iterdir())) == 1
    assert len(list((tmp_path / "h" / "imagesTr").iterdir())) == 1


@pytest.mark.parametrize("options, named", [
    (["--clases", "3"], "--clases: no such option; valid: --seed, --classes, --per-class, --val-per-class, "
                        "--size, --height, --quality"),  # was "unknown key data synth imagenet.clases; ... per_class"
    (["--classes", "x"], "--classes: expected int, got 'x'"),  # was "data synth imagenet.classes: ..."
    (["--per-class", "1.5"], "--per-class: expected int, got 1.5"),
])
def test_an_unknown_option_or_wrong_type_is_named_as_typed(options, named, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["data", "synth", "imagenet", str(out), *options]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"fastvision: error: data synth imagenet {named}"]
    assert not out.exists()
