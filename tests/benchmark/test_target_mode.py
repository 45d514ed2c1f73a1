"""``benchmark --mode target``: real seeded training runs to a target, scored as MLPerf scores time to
train (the olympic mean), read back from each run's own ``summary.json``; a rerun reuses finished seeds."""
from __future__ import annotations

import json

import pytest

from fastvision.benchmark.target import olympic, score
from fastvision.cli import main

TINY = ["--device", "cpu", "--set", "data.args.image_size=[32,32]", "--set", "model.args.filters=[4,8,16]",
        "--set", "data.num_workers=0", "--set", "examples=0", "--set", "train.batch_size=4", "--set", "train.epochs=3"]


def test_olympic_mean_drops_one_run_at_each_end_and_four_from_forty():
    assert olympic([]) is None
    assert olympic([5.0, 7.0]) == (6.0, 0)  # under 3 runs: the plain mean
    assert olympic([10.0, 1.0, 4.0, 3.0, 100.0]) == ((3.0 + 4.0 + 10.0) / 3, 1)
    forty = [float(i) for i in range(1, 41)]  # MLPerf's 3D U-Net: 40 runs, the 4 fastest and 4 slowest out
    assert olympic(forty) == (sum(range(5, 37)) / 32, 4)


def test_score_leaves_out_the_seeds_that_did_not_reach_the_target():
    rows = [{"reached": True, "wall_s": w, "train_s": w - 1, "epochs": e} for w, e in ((12.0, 4), (9.0, 3), (30.0, 9))]
    rows.append({"reached": False, "wall_s": None, "train_s": None, "epochs": None})
    s = score(rows)
    assert (s["reached"], s["runs"]) == (3, 4)
    assert s["wall_s"]["olympic_mean"] == 12.0 and s["wall_s"]["spread"] == pytest.approx(30 / 9)
    assert s["train_s"]["median"] == 11.0 and s["epochs_median"] == 4


def test_target_mode_scores_the_seeds_runs_and_a_rerun_reuses_them(tiny_microscopy, tmp_path, capsys):
    out = tmp_path / "bt"
    argv = ["benchmark", "unet2d-microscopy", "--mode", "target", "--data", str(tiny_microscopy), "--seeds", "3",
            "--target", "iou=0.01", "--out", str(out), *TINY]
    code = main(argv)
    report = json.loads((out / "unet2d-microscopy-target.json").read_text())
    assert code == (0 if report["reached"] else 1)
    assert [r["seed"] for r in report["rows"]] == [0, 1, 2]
    for r in report["rows"]:  # each row is what the seed's own run recorded
        s = json.loads((out / f"seed-{r['seed']}" / "summary.json").read_text())
        assert r["reached"] == s["target_reached"] and r["wall_s"] == s.get("time_to_target_wall_s")
    # what an epoch is, for `plan --epochs-from`: the train split in whole batches of 4 (one process)
    from fastvision import config
    from fastvision.planning.estimate import dataset_items

    train_items = dataset_items(config.load("unet2d-microscopy"), str(tiny_microscopy))[0]
    assert report["global_batch"] == 4 and report["items_per_epoch"] == train_items // 4 * 4
    assert all(r["items_per_epoch"] == report["items_per_epoch"] for r in report["rows"])
    walls = sorted(r["wall_s"] for r in report["rows"] if r["reached"])
    if len(walls) == 3:
        assert report["wall_s"]["olympic_mean"] == walls[1]  # 3 runs: the fastest and the slowest dropped
    assert (out / "unet2d-microscopy-target.png").stat().st_size > 0
    assert "score:" in (out / "unet2d-microscopy-target.md").read_text() or not report["reached"]

    stamps = {p: p.stat().st_mtime_ns for p in out.glob("seed-*/summary.json")}
    assert main(argv) == code  # the finished seeds are read back, not trained again
    assert {p: p.stat().st_mtime_ns for p in out.glob("seed-*/summary.json")} == stamps
    capsys.readouterr()
    assert main([*argv[:9], "iou=0.02", *argv[10:]]) == 2  # another target on the same seeds' runs
    assert "another target or seed" in capsys.readouterr().err


def test_target_mode_without_a_target_names_the_way(tiny_microscopy, tmp_path, capsys):
    assert main(["benchmark", "unet2d-microscopy", "--mode", "target", "--data", str(tiny_microscopy),
                 "--out", str(tmp_path / "x"), *TINY]) == 2
    assert "has no train.target" in capsys.readouterr().err


def test_a_bad_key_or_data_folder_is_one_line_and_exit_2(tiny_microscopy, tmp_path, capfd):
    """An unknown --set key is refused before any run; a missing --data or a --target metric the run has not
    is the seed's own one line, not followed by a second one of the benchmark's, and leaves no --out (it kept
    a seed-0.argv.json there)."""
    base = ["benchmark", "unet2d-microscopy", "--mode", "target", "--seeds", "2",
            "--out", str(tmp_path / "bt"), "--device", "cpu"]
    for extra, needle in ((["--target", "iou=0.5", "--set", "bogus.key=1"], "unknown key bogus.key"),
                          (["--target", "iou=0.5", "--data", str(tmp_path / "nope")], "dataset folder not found"),
                          (["--target", "nope=0.5", "--data", str(tiny_microscopy)], "--target nope")):
        assert main([*base, *extra]) == 2
        err = capfd.readouterr().err  # the seed's process writes to the file descriptor
        lines = [x for x in err.splitlines() if x.startswith("fastvision: error:")]
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
        assert not (tmp_path / "bt").exists(), sorted(p.name for p in (tmp_path / "bt").iterdir())


def test_a_rerun_with_other_settings_is_refused_not_scored_with_the_old_runs(tiny_microscopy, tmp_path, capsys):
    """Before, a rerun into the same --out with another --set read the finished seeds back (target and seed
    alike) and scored runs of the old settings as the new ones'; --force then trains them afresh."""
    out = tmp_path / "bt"
    one = [*TINY[:-1], "train.epochs=1"]
    argv = ["benchmark", "unet2d-microscopy", "--mode", "target", "--data", str(tiny_microscopy), "--seeds", "1",
            "--target", "iou=0.99", "--out", str(out)]
    assert main([*argv, *one]) in (0, 1)
    first = (out / "seed-0" / "summary.json").stat().st_mtime_ns
    capsys.readouterr()
    assert main([*argv, *TINY]) == 2  # train.epochs=3 now
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other settings" in err[0] and "train.epochs=1" in err[0] and "train.epochs=3" in err[0]
    assert (out / "seed-0" / "summary.json").stat().st_mtime_ns == first  # nothing trained, nothing lost
    assert main([*argv, *TINY, "--force"]) in (0, 1)
    saved = json.loads((out / "seed-0" / "summary.json").read_text())
    assert saved["epochs"] == 3 or saved["target_reached"]
