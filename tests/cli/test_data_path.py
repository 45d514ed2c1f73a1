"""``train --data DIR`` with a relative folder: the run's saved config names it absolutely, so the run can be
evaluated or predicted from another directory (the saved path was relative to where train ran)."""
from __future__ import annotations

import yaml

from fastvision.api import overrides_to_dicts
from tests.conftest import cli_here


def test_a_relative_data_folder_is_saved_absolute(tiny_microscopy, tmp_path, monkeypatch):
    monkeypatch.chdir(tiny_microscopy.parent)
    out = tmp_path / "run"
    assert cli_here(["train", "unet2d-microscopy", "--data", tiny_microscopy.name, "--out", str(out), "--device",
                     "cpu", "--epochs", "1", "--set", "data.args.image_size=[32,32]", "--set",
                     "model.args.filters=[4,8,16]", "--set", "data.num_workers=0", "--set", "examples=0"]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())["data"]["args"]["path"]
    assert saved == str(tiny_microscopy)
    monkeypatch.chdir(tmp_path)  # from elsewhere: the saved run evaluates
    assert cli_here(["evaluate", str(out / "checkpoints" / "last.pt"), "--device", "cpu"]) == 0


def test_a_url_stays_as_given():
    assert overrides_to_dicts({"data": "https://host/shards"}) == [{"data": {"args": {"path": "https://host/shards"}}}]
