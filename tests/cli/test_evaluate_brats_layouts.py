"""``evaluate --data`` of BraTS in the other layout than the run trained on: both layouts read to the same
classes and channel order (as ``predict`` takes either), so the same cases score the same. Before, a raw
challenge folder given to a Decathlon-trained run stopped with training's hint ``--set data.name=brats``,
which ``evaluate`` does not take."""
from __future__ import annotations

import json

from fastvision.api import brats_layout_of
from fastvision.cli import main
from fastvision.data.synth import load_all

SMALL = ["--epochs", "1", "--device", "cpu", "--amp", "off", "--set", "data.args.patch_size=[16,16,16]",
         "--set", "task.args.sliding_window.roi_size=[16,16,16]", "--set", "model.args.filters=[4,8,16,32]",
         "--set", "data.num_workers=0", "--set", "data.cache=ram"]


def test_a_run_trained_on_task01_scores_the_raw_challenge_copy_of_its_cases_the_same(tmp_path, capsys):
    synth = load_all().get("brats")
    dec = synth(tmp_path / "Task01", seed=3, cases=5, size=16)
    raw = synth(tmp_path / "raw", seed=3, cases=5, size=16, layout="brats")  # the same cases, raw BraTS files
    assert brats_layout_of("decathlon", str(raw)) == "brats" and brats_layout_of("brats", str(dec)) == "decathlon"
    assert brats_layout_of("decathlon", str(dec)) is None and brats_layout_of("brats", str(raw)) is None
    run = tmp_path / "run"
    assert main(["train", "unet3d-brats", "--data", str(dec), "--out", str(run), *SMALL]) == 0
    for name, folder in (("dec", dec), ("raw", raw)):
        assert main(["evaluate", str(run), "--data", str(folder), "--device", "cpu",
                     "--json", str(tmp_path / f"{name}.json")]) == 0, name
    capsys.readouterr()
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("dec", "raw"))
    assert a["items"] == b["items"] > 0 and "dice/ET" in a
    assert a == b
