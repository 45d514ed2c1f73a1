"""Dataset fingerprint (``data inspect --fingerprint``): statistics checked against figures worked
out by hand on a tiny dataset, the per-case cache, and bad inputs named by case."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fastvision.cli import main
from fastvision.data import fingerprint as fpm
from fastvision.errors import DataError

nib = pytest.importorskip("nibabel")  # fastvision reads NIfTI lazily: only these tests need it


def _save(array, spacing, path, lps=False):
    affine = np.diag([*(-s if lps and i < 2 else s for i, s in enumerate(spacing)), 1.0])
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(np.asarray(array), affine), str(path))


def _dataset(root, cases, labels=None):
    """cases: [(image (X, Y, Z), label (X, Y, Z), spacing, lps)] -> Decathlon folder."""
    training = []
    for i, (img, lab, sp, lps) in enumerate(cases):
        _save(img.astype(np.float32), sp, root / f"imagesTr/c{i}.nii.gz", lps)
        _save(lab.astype(np.uint8), sp, root / f"labelsTr/c{i}.nii.gz", lps)
        training.append({"image": f"./imagesTr/c{i}.nii.gz", "label": f"./labelsTr/c{i}.nii.gz"})
    meta = {"name": "Tiny", "modality": {"0": "CT"}, "labels": labels or {"0": "background", "1": "organ"},
            "training": training, "test": []}
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


def _tiny(root):
    """Case 0: foreground values 1, 2, 3; case 1: 10, 20 (stored LPS); case 2: empty label."""
    img0 = np.zeros((6, 5, 4))
    img0[1:4, 1:3, 1:3] = 7.0  # non-zero box 3 x 2 x 2
    lab0 = np.zeros((6, 5, 4))
    for v, idx in zip((1.0, 2.0, 3.0), ((1, 1, 1), (2, 1, 1), (3, 2, 2)), strict=True):
        img0[idx], lab0[idx] = v, 1
    img1 = np.full((4, 4, 3), 5.0)  # no zero: the crop keeps everything
    lab1 = np.zeros((4, 4, 3))
    img1[0, 0, 0], img1[3, 2, 1] = 10.0, 20.0
    lab1[0, 0, 0], lab1[3, 2, 1] = 1, 1
    img2, lab2 = np.ones((4, 4, 4)), np.zeros((4, 4, 4))
    return _dataset(root, [(img0, lab0, (0.5, 0.5, 2.0), False), (img1, lab1, (0.6, 0.5, 2.5), True),
                           (img2, lab2, (0.5, 0.6, 3.0), False)])


def test_statistics_by_hand(tmp_path):
    fp = fpm.fingerprint(_tiny(tmp_path / "d"), cache=False)
    ch = fp["channels"][0]
    # pooled foreground 1, 2, 3, 10, 20: mean 7.2; population variance 254.8 / 5 = 50.96
    assert ch["modality"] == "CT" and ch["samples"] == 5
    assert ch["mean"] == pytest.approx(7.2) and ch["std"] == pytest.approx(math.sqrt(50.96))
    assert ch["median"] == 3 and (ch["min"], ch["max"]) == (1, 20)
    # linear interpolation: rank 0.005 * 4 = 0.02 -> 1.02; rank 0.995 * 4 = 3.98 -> 10 + 0.98 * 10
    assert ch["percentile_00_5"] == pytest.approx(1.02) and ch["percentile_99_5"] == pytest.approx(19.8)
    cases = {c["id"]: c for c in fp["cases"]}
    assert cases["c0"]["shape"] == [6, 5, 4] and cases["c0"]["shape_after_crop"] == [3, 2, 2]
    assert cases["c1"]["shape_after_crop"] == [4, 4, 3]
    assert cases["c1"]["spacing"] == pytest.approx([0.6, 0.5, 2.5])  # LPS storage: spacing is still positive
    assert fp["median_spacing"] == pytest.approx([0.5, 0.5, 2.5])
    assert fp["median_shape"] == [4, 4, 4]
    total = 6 * 5 * 4 + 4 * 4 * 3 + 4 * 4 * 4  # 232 voxels, 5 of them foreground
    assert fp["class_fractions"][1] == pytest.approx(5 / total)
    assert fp["class_fractions"][0] == pytest.approx(227 / total)
    assert fp["empty_label_cases"] == ["c2"]
    assert list(fp["anomalies"]) == ["cases with an empty label (no foreground)"]


def test_samples_are_bounded_per_case(tmp_path):
    fp = fpm.fingerprint(_tiny(tmp_path / "d"), cache=False, samples_per_case=2)
    assert fp["channels"][0]["samples"] == 4  # case 0 keeps 2 of its 3, case 1 both


def test_cache_by_file_identity(tmp_path, monkeypatch):
    root = _tiny(tmp_path / "d")
    cache = tmp_path / "cache"
    first = fpm.fingerprint(root, cache=cache)
    assert len(list(cache.glob("*.json"))) == 3

    def boom(*a, **k):
        raise AssertionError("recomputed a cached case")

    monkeypatch.setattr(fpm, "case_fingerprint", boom)
    assert fpm.fingerprint(root, cache=cache)["channels"] == first["channels"]
    img = nib.load(str(root / "imagesTr/c1.nii.gz"))
    data = np.asarray(img.dataobj).copy()
    data[0, 0, 0] = 30.0
    nib.save(nib.Nifti1Image(data, img.affine), str(root / "imagesTr/c1.nii.gz"))  # a new file identity
    with pytest.raises(AssertionError, match="recomputed"):
        fpm.fingerprint(root, cache=cache)


def test_label_values_outside_dataset_json(tmp_path):
    lab = np.zeros((4, 4, 4))
    lab[1, 1, 1] = 3
    root = _dataset(tmp_path / "d", [(np.ones((4, 4, 4)), lab, (1, 1, 1), False)])
    with pytest.raises(DataError, match=r"case c0: label values \[3\] are not in .*dataset.json"):
        fpm.fingerprint(root, cache=False)


def test_channels_with_different_spacings(tmp_path):
    _save(np.ones((4, 4, 4)), (1, 1, 1), tmp_path / "a_0000.nii.gz")
    _save(np.ones((4, 4, 4)), (1, 1, 2), tmp_path / "a_0001.nii.gz")
    _save(np.zeros((4, 4, 4)), (1, 1, 1), tmp_path / "a.nii.gz")
    case = {"id": "a", "image": [tmp_path / "a_0000.nii.gz", tmp_path / "a_0001.nii.gz"],
            "label": tmp_path / "a.nii.gz"}
    with pytest.raises(DataError, match=r"case a: channel a_0001.nii.gz has spacing \[1.0, 1.0, 2.0\]"):
        fpm.case_fingerprint(case)


def test_case_far_off_the_spacing_is_named(tmp_path, monkeypatch):
    lab = np.zeros((4, 4, 4))
    lab[1, 1, 1] = 1
    cases = [(np.ones((4, 4, 4)), lab, (1, 1, 1), False)] * 3 + [(np.ones((4, 4, 4)), lab, (1, 1, 5), False)]
    root = _dataset(tmp_path / "d", cases)
    warned = []  # the CLI's logging setup may stop propagation to caplog: record the calls themselves
    monkeypatch.setattr(fpm.log, "warning", lambda msg, *a: warned.append(msg % a))
    fp = fpm.fingerprint(root, cache=False)
    kind = "cases more than 2x off the median spacing on an axis"
    assert fp["anomalies"] == {kind: ["c3"]}
    assert len(warned) == 1 and kind in warned[0] and warned[0].endswith(": c3")


def test_cli_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "cache"))
    root = _tiny(tmp_path / "d")
    out = tmp_path / "fp.json"
    assert main(["data", "inspect", str(root), "--fingerprint", "--json", str(out)]) == 0
    assert "foreground mean 7.2" in capsys.readouterr().out
    assert json.loads(out.read_text())["channels"][0]["percentile_99_5"] == pytest.approx(19.8)
    assert len(list((tmp_path / "cache" / "fingerprint").glob("*.json"))) == 3


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.uint16, np.int32, np.float32, np.float64, bool])
def test_label_counts_against_numpy_unique(dtype):
    """Counts per value on the stored dtype, checked against ``np.unique`` (the reference)."""
    rng = np.random.default_rng(0)
    lab = rng.integers(0, 2 if dtype is bool else 5, (7, 6, 5)).astype(dtype)
    values, counts = np.unique(lab.astype(np.int64), return_counts=True)
    assert fpm.label_counts(lab, "x.nii.gz") == {int(v): int(n) for v, n in zip(values, counts, strict=True)}


def test_label_counts_make_no_wide_copy():
    """A 2 Mi-voxel uint8 label is counted without an int64 copy or a sorted one (16 MiB each):
    numpy's allocations during the count stay under the label's own 2 MiB (tracemalloc sees numpy)."""
    import tracemalloc

    lab = np.zeros((128, 128, 128), np.uint8)
    lab[10:20, 10:20, 10:20] = 2
    tracemalloc.start()
    try:
        counts = fpm.label_counts(lab, "big.nii.gz")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert counts == {0: 128**3 - 1000, 2: 1000}
    assert peak < lab.nbytes


@pytest.mark.parametrize("values,match", [([0.0, 1.5], "whole number"), ([0.0, float("nan")], "whole number"),
                                          ([0, -1], "negative"), ([0.0, -1.0], "negative")])
def test_label_counts_refuse_bad_values(values, match):
    dtype = np.float32 if isinstance(values[1], float) else np.int16
    with pytest.raises(DataError, match=f"lab.nii.gz: .*{match}"):
        fpm.label_counts(np.asarray(values, dtype), "lab.nii.gz")


def test_label_counts_read_float_noise_as_training_does():
    """configure refused a float label of 1.9999 (float noise of 2) that training rounds to class 2; it counts it
    as training reads it (whole_labels), 0.9999 as 1, not truncated to 0."""
    lab = np.asarray([0.0, 1.9999, 2.0001, 0.9999], np.float32)
    assert fpm.label_counts(lab, "lab.nii.gz") == {0: 1, 1: 1, 2: 2}


def test_region_labels_in_dataset_json(tmp_path):
    """nnU-Net v2 region-based labels (lists): accepted; every value a region lists is valid; the
    regions reach ``configure``, which plans one sigmoid output per region. They used to fail with
    ``int()`` of a list."""
    from fastvision.planning import configure as cf

    lab = np.zeros((8, 8, 8))
    lab[2:5, 2:5, 2:5] = 1
    lab[3, 3, 3] = 2
    img = np.where(lab > 0, 5.0, 1.0)
    labels = {"background": 0, "whole": [1, 2], "core": 2}
    root = _dataset(tmp_path / "d", [(img, lab, (1, 1, 1), False)] * 2, labels=labels)
    fp = fpm.fingerprint(root, cache=False)
    assert fp["regions"] == {"whole": [1, 2], "core": [2]}
    assert fp["labels"] == {0: "background", 1: "label 1", 2: "core"}
    assert fp["class_fractions"] == {0: pytest.approx(1 - 27 / 512), 1: pytest.approx(26 / 512),
                                     2: pytest.approx(1 / 512)}
    plan = cf.configure(root, fingerprint=fp, memory="8GiB")
    task = plan["overrides"]["task"]["args"]
    assert task["mode"] == "regions" and task["regions"] == [[1, 2], [2]] and task["region_names"] == ["whole", "core"]
    assert plan["overrides"]["model"]["args"]["out_channels"] == 2


def test_label_on_another_grid_is_resampled_as_training_does(tmp_path):
    """A label whose origin is one voxel off its image's: resampled onto the image grid (nearest)
    with training's warning naming the file, not refused. Hand count: the label (all 1) shifted by
    +1 voxel along x leaves image column x = 0 (5 x 4 voxels) outside it, so background there."""
    img = np.ones((6, 5, 4), np.float32)
    _save(img, (1, 1, 1), tmp_path / "imagesTr/c0.nii.gz")
    path = tmp_path / "labelsTr/c0.nii.gz"
    path.parent.mkdir(parents=True)
    affine = np.diag([1.0, 1.0, 1.0, 1.0])
    affine[0, 3] = 1.0
    nib.save(nib.Nifti1Image(np.ones((6, 5, 4), np.uint8), affine), str(path))
    case = {"id": "c0", "image": [tmp_path / "imagesTr/c0.nii.gz"], "label": path}
    with pytest.warns(RuntimeWarning, match="c0.nii.gz.*resampled onto the image grid"):
        rec = fpm.case_fingerprint(case)
    assert rec["label_counts"] == {0: 20, 1: 100}


def test_a_resampled_label_reaches_the_cli_user_as_one_log_line(tmp_path):
    """``fastvision data inspect DIR --fingerprint`` in a real process, on a case whose label is one
    voxel off its image: stderr has one ``fastvision: warning:`` line naming the label file (and the
    fingerprint's anomaly line naming the case), and no Python warning format (category, source line)."""
    import subprocess
    import sys

    from tests.conftest import clean_env

    lab = np.zeros((6, 5, 4))
    lab[2:4, 1:3, 1:3] = 1
    root = _dataset(tmp_path / "d", [(np.ones((6, 5, 4)), lab, (1, 1, 1), False)])
    moved = root / "labelsTr/c0.nii.gz"
    affine = np.eye(4)
    affine[0, 3] = 1.0
    nib.save(nib.Nifti1Image(lab.astype(np.uint8), affine), str(moved))
    env = clean_env(FASTVISION_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "fastvision", "data", "inspect", str(root), "--fingerprint"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "label grid" in line]
    assert len(lines) == 1 and lines[0].startswith(f"fastvision: warning: {moved}: label grid")
    # and the fingerprint's anomaly line, which a cached run prints too
    assert f"{root}: 1 cases whose label is on another grid than its image (resampled onto it, nearest): c0" in (
        proc.stderr)
    assert "Warning:" not in proc.stderr and "warnings.warn" not in proc.stderr and ".py:" not in proc.stderr
