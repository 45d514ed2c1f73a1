"""``fastvision evaluate --json``: an existing file is kept unless --force, a folder is refused with one line,
through the real CLI on a real (tiny) run."""
from __future__ import annotations

import json

from tests.cli.input_checks import guarded_json, one_line_error, run_cli

TINY = ["--epochs", "1", "--batch-size", "4", "--device", "cpu", "--set", "data.args.image_size=[32,32]",
        "--set", "model.args.filters=[4,8,16]"]


def test_evaluate_json_is_not_replaced_without_force_nor_a_folder(tiny_microscopy, tmp_path, capsys):
    run = tmp_path / "run"
    assert run_cli(capsys, "train", "unet2d-microscopy", "--data", tiny_microscopy, "--out", run, *TINY)[0] == 0
    assert "iou" in json.loads(guarded_json(capsys, ["evaluate", run, "--device", "cpu"], tmp_path).read_text())


def test_a_folder_as_tune_out_or_fingerprint_json_is_refused_before_any_work(tiny_microscopy, tmp_path, capsys):
    """Both write files: a folder there was an IsADirectoryError after the work (tune's trials, the
    fingerprint's reading); now one line, even with --force, before it."""
    (tmp_path / "dir").mkdir()
    code, out, err = run_cli(capsys, "tune", "unet2d-microscopy", "--data", tiny_microscopy, "--out", tmp_path / "dir",
                             "--force")
    one_line_error(code, err, "--out", "is a folder")
    code, out, err = run_cli(capsys, "data", "inspect", tiny_microscopy, "--fingerprint", "--json", tmp_path / "dir")
    one_line_error(code, err, "--json", "is a folder")
    assert out == "" and not any((tmp_path / "dir").iterdir())
