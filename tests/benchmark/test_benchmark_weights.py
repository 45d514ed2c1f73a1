"""``benchmark`` never reads the weights files a recipe names (``model.args.pretrained``): they change
values, not the time, and an offline node must still measure a recipe that starts from ImageNet."""
from __future__ import annotations

import json

from fastvision import cli


def test_train_mode_runs_with_an_unreadable_weights_file(tmp_path):
    missing = tmp_path / "no-such-weights.pth"
    argv = ["benchmark", "resnet18-imagefolder", "--device", "cpu", "--batch-sizes", "2", "--steps", "2",
            "--warmup", "1", "--precision", "fp32", "--out", str(tmp_path / "out"),
            "--set", f"model.args.pretrained={missing}", "--set", "task.args.image_size=32"]
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "out" / "resnet18-imagefolder-train.json").read_text())
    assert report["results"][0]["items_per_s"] > 0
