"""``fastvision plan``: a batch, data set size or price out of range, and a folder given as --json / --png, are
one line naming the option (exit 2) before any trace, through the real CLI."""
from __future__ import annotations

import pytest

from tests.cli.input_checks import one_line_error, run_cli


@pytest.mark.parametrize("argv,needle", [
    (["--batch-size", "-4"], "--batch-size -4"),
    (["--batch-size", "0", "--no-switches"], "--batch-size 0"),
    (["--dataset-size", "0"], "--dataset-size 0"),
    (["--price-per-gpu-hour", "-1"], "--price-per-gpu-hour -1"),
    (["--price-per-gpu-hour", "inf"], "--price-per-gpu-hour inf: must be a finite"),  # cost 'inf'
    (["--fixed-ms", "inf"], "--fixed-ms inf: must be a finite"),  # nan or inf: a plan of nan s
    (["--fixed-ms", "nan"], "--fixed-ms nan: must be a finite"),
    (["--input-rate", "nan"], "--input-rate nan: items/s per host core must be a finite"),
])
def test_plan_refuses_numbers_out_of_range(argv, needle, capsys, monkeypatch):
    from fastvision.planning import estimate

    monkeypatch.setattr(estimate, "trace", lambda *a, **k: pytest.fail("traced before the options were checked"))
    code, out, err = run_cli(capsys, "plan", "resnet50-imagenet", *argv)
    one_line_error(code, err, needle)
    assert out == ""


def test_plan_refuses_data_and_dataset_size_together(tmp_path, capsys, monkeypatch):
    """Both given, --data was dropped without a word (even a folder that does not exist): now one line."""
    from fastvision.planning import estimate

    monkeypatch.setattr(estimate, "trace", lambda *a, **k: pytest.fail("traced before the options were checked"))
    code, out, err = run_cli(capsys, "plan", "resnet50-imagenet", "--data", tmp_path / "none", "--dataset-size", "9")
    one_line_error(code, err, "--data", "--dataset-size 9", "give one")
    assert out == ""


@pytest.mark.parametrize("flag", ["--json", "--png"])
def test_plan_refuses_a_folder_as_output_file_even_with_force(flag, tmp_path, capsys):
    code, _, err = run_cli(capsys, "plan", "unet2d-microscopy", "--no-switches", flag, tmp_path, "--force")
    one_line_error(code, err, flag, str(tmp_path), "folder")


@pytest.mark.parametrize("shape, needle", [
    ("[1,24,24]", "must be divisible by"),  # the U-Net's own check: 24 is no multiple of 2**4
    ("[1,8]", "must be divisible by"),  # a 1-D sample for a 2-D network
])
def test_plan_names_the_sample_shape_the_model_cannot_take(shape, needle, capsys):
    """The traced step's error was a traceback (exit 1); now one line naming task.args.sample_shape."""
    code, _, err = run_cli(capsys, "plan", "unet2d-microscopy", "--no-switches", "--set",
                           f"task.args.sample_shape={shape}")
    one_line_error(code, err, "the traced training step failed", needle, "task.args.sample_shape")


@pytest.mark.parametrize("row,key", [
    ({"items_per_s": 100, "items_per_cpu_s": float("inf"), "cache": "none"}, "items_per_cpu_s inf"),
    ({"items_per_s": float("inf"), "num_workers": 4}, "items_per_s inf"),
    ({"items_per_s": -5}, "items_per_s -5"),
])
@pytest.mark.parametrize("command", ["plan", "scale"])
def test_a_benchmark_json_of_an_infinite_or_negative_rate_is_one_line(tmp_path, capsys, monkeypatch, row, key,
                                                                      command):
    # --input-rate inf as a number was refused, the same rate read from a JSON (json writes it as Infinity) planned
    # "0.0 host cores per GPU at inf items/s per core": no host limit, silently; -5 planned negative cores
    import json

    from fastvision.planning import estimate

    monkeypatch.setattr(estimate, "trace", lambda *a, **k: pytest.fail("traced before the options were checked"))
    report = tmp_path / "data.json"
    report.write_text(json.dumps({"recipe": "resnet50-imagenet", "data": "imagefolder", "results": [row]}))
    argv = (["plan", "resnet50-imagenet", "--gpus", "8", "--input-rate", str(report)] if command == "plan" else
            ["scale", "--simulate", "--compute-ms", "100", "--grad-mb", "100", "--batch", "32", "--input-json",
             str(report)])
    code, out, err = run_cli(capsys, *argv)
    one_line_error(code, err, f"{report}: {key} is not a finite rate > 0")
