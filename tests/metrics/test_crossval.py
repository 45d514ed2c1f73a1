"""``fastvision cv``: fold averaging from DLLogger-style metrics.jsonl files (hand-computed values)."""
from __future__ import annotations

import argparse
import json

import pytest

from fastvision.errors import DataError
from fastvision.metrics.crossval import add_cli, cross_validate, read_run


def _run(path, fold, epochs, summary=None):
    path.mkdir(parents=True)
    lines = [{"type": "LOG", "step": "PARAMETER", "data": {"config": {"data": {"args": {"fold": fold}}}}}]
    lines += [{"type": "LOG", "step": [e], "data": row} for e, row in enumerate(epochs)]
    if summary is not None:
        lines.append({"type": "LOG", "step": [], "data": summary})
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_average_of_folds(tmp_path):
    a = _run(tmp_path / "f0", 0, [{"dice": 0.1}], {"dice": 0.80, "dice/1": 0.7, "epochs": 3, "run_dir": "x"})
    b = _run(tmp_path / "f1", 1, [{"dice": 0.2}], {"dice": 0.90, "dice/1": 0.9, "epochs": 3})
    c = _run(tmp_path / "f2", 2, [{"dice": 0.3, "dice/1": 0.5}, {"dice": 0.70, "dice/1": 0.8}])  # no summary
    res = cross_validate([a, b, c])
    assert res["folds"] == [0, 1, 2]
    assert set(res["mean"]) == {"dice", "dice/1"}  # bookkeeping keys and strings dropped
    assert res["mean"]["dice"] == pytest.approx(0.8)
    assert res["mean"]["dice/1"] == pytest.approx(0.8)
    assert res["std"]["dice"] == pytest.approx((0.02 / 3) ** 0.5)
    assert res["per_run"]["dice/1"] == [0.7, 0.9, 0.8]
    assert read_run(c / "metrics.jsonl")[0] == {"dice": 0.7, "dice/1": 0.8}


def test_errors(tmp_path):
    a = _run(tmp_path / "a", 0, [{"dice": 0.5}])
    with pytest.raises(DataError, match="iou"):
        cross_validate([a], metrics=["iou"])
    with pytest.raises(DataError, match="metrics.jsonl"):
        cross_validate([tmp_path / "missing"])
    empty = _run(tmp_path / "empty", 0, [])
    with pytest.raises(DataError, match="no epoch"):
        read_run(empty)


def test_cli(tmp_path, capsys):
    a = _run(tmp_path / "a", 0, [], {"dice": 0.6})
    b = _run(tmp_path / "b", 1, [], {"dice": 0.8})
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["cv", str(a), str(b), "--json", str(tmp_path / "cv.json")])
    assert args.func(args) == 0
    assert json.loads((tmp_path / "cv.json").read_text())["mean"]["dice"] == pytest.approx(0.7)
    assert "0.7000" in capsys.readouterr().out


@pytest.mark.parametrize("text,words", [
    ("{}", "no targets"),                       # JSON, but no table (was KeyError: 'targets')
    ("[1, 2]", "no targets"),                   # not an object (was AttributeError)
    ('{"targets": ["1"], "cases": [3], "mean": {}, "pooled": {}, "dice": 1, "dice_pooled": 1}', "case row"),
    ("{not json", "not JSON"),
])
def test_cv_of_a_damaged_crossval_json_is_one_line(tmp_path, capsys, text, words):
    from fastvision import cli

    (tmp_path / "cv").mkdir()
    (tmp_path / "cv" / "crossval.json").write_text(text)
    assert cli.main(["cv", str(tmp_path / "cv")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and str(tmp_path / "cv" / "crossval.json") in err


def test_cv_prints_a_crossval_json_with_and_without_postprocessing(tmp_path, capsys):
    from fastvision import cli
    from fastvision.metrics.crossval import fold_table

    rows = [{"id": "a", "fold": 0, "tp": [3], "fp": [1], "fn": [0]},
            {"id": "b", "fold": 1, "tp": [1], "fp": [0], "fn": [1]}]
    res = fold_table(rows, ["1"])  # no "postprocessed" table: no step was kept
    (tmp_path / "cv").mkdir()
    (tmp_path / "cv" / "crossval.json").write_text(json.dumps(res))
    assert cli.main(["cv", str(tmp_path / "cv")]) == 0
    assert "0.8571" in capsys.readouterr().out  # case a: 2*3 / (2*3 + 1)
    res["postprocessed"] = fold_table(rows[:1], ["1"])
    (tmp_path / "cv" / "crossval.json").write_text(json.dumps(res))
    assert cli.main(["cv", str(tmp_path / "cv")]) == 0 and "after postprocessing" in capsys.readouterr().out


def test_cv_metrics_of_a_folds_folder_is_one_line(tmp_path, capsys):
    from fastvision import cli
    from fastvision.metrics.crossval import fold_table

    (tmp_path / "cv").mkdir()
    (tmp_path / "cv" / "crossval.json").write_text(json.dumps(fold_table(
        [{"id": "a", "fold": 0, "tp": [3], "fp": [1], "fn": [0]}], ["1"])))
    assert cli.main(["cv", str(tmp_path / "cv"), "--metrics", "iou"]) == 2  # was the Dice table, --metrics ignored
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--metrics" in err and "fold-*" in err


def test_cv_of_two_folds_folders_names_the_folds_folder(tmp_path, capsys):
    from fastvision import cli

    for name in ("a", "b"):
        _run(tmp_path / name / "fold-0", 0, [], {"dice": 0.5})
    assert cli.main(["cv", str(tmp_path / "a"), str(tmp_path / "b")]) == 2  # was "a/metrics.jsonl: not a run"
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train --folds folder" in err and f"fastvision cv {tmp_path / 'a'}" in err
