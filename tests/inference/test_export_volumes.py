"""``fastvision export`` of a 3-D run (a fold of a ``train --folds`` folder): the file takes the sliding
window ``predict`` feeds the model, not benchmark mode's ``task.args.sample_shape``."""
from __future__ import annotations

import importlib.util

import torch

from fastvision.cli import main
from fastvision.inference import export
from tests.cli.input_checks import one_line_error

HAS_ORT = all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime"))


def test_volume_export_takes_the_sliding_window(spleen_folds, tmp_path, capsys):
    """The folds were trained with ``roi_size [16, 16, 16]`` and the recipe's ``sample_shape [1, 96, 96, 96]``:
    the export traced at 96^3, so the file refused every window the run's ``predict`` runs the model on."""
    _, out, _ = spleen_folds
    fold = out / "fold-0"
    fmt = "onnx" if HAS_ORT else "torchscript"
    dest = tmp_path / f"m{export.SUFFIX[fmt]}"
    assert main(["export", str(fold), "--format", fmt, "--out", str(dest)]) == 0
    printed = capsys.readouterr().out
    assert "batchx1x16x16x16" in printed and ": ok" in printed
    model, _, _ = export.load_model(fold)
    x = torch.randn(2, 1, 16, 16, 16, generator=torch.Generator().manual_seed(1))
    diff = export.max_abs_diff(dest, fmt, model, x)  # the exported file runs a window of the run's size
    assert diff is not None and diff <= 1e-4


def test_the_folds_folder_itself_is_one_line(spleen_folds, tmp_path, capsys):
    _, out, _ = spleen_folds
    code = main(["export", str(out), "--format", "torchscript", "--out", str(tmp_path / "m.pt")])
    one_line_error(code, capsys.readouterr().err, str(out))
    assert not (tmp_path / "m.pt").exists()
