"""Issue 19's user-facing defects, through the real CLI: each is one line naming what to do, exit 2,
or the sensible behaviour (never a traceback)."""
from __future__ import annotations

import pytest
import torch

from fastvision.cli import main

TINY = ["--epochs", "1", "--batch-size", "4", "--device", "cpu", "--set", "data.args.image_size=[32,32]",
        "--set", "model.args.filters=[4,8,16]"]


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, *needles):
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.startswith("fastvision: error:")]
    assert len(lines) == 1, err
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])
    return lines[0]


def test_fp16_run_evaluates_and_predicts_on_cpu(tiny_microscopy, tmp_path, capsys):
    """A run trained with train.amp=fp16 (unet3d-spleen-fast's setting) on a GPU: evaluate and predict
    on a CPU run in fp32 instead of stopping with "fp16 needs a CUDA device; use --amp bf16", a flag
    these commands do not have."""
    run = tmp_path / "run"
    assert run_cli(capsys, "train", "unet2d-microscopy", "--data", tiny_microscopy, "--out", run, *TINY)[0] == 0
    ckpt = run / "checkpoints" / "last.pt"
    state = torch.load(ckpt, weights_only=True)
    state["config"]["train"]["amp"] = "fp16"  # as if trained on a GPU with fp16
    for name in ("best.pt", "last.pt"):
        torch.save(state, run / "checkpoints" / name)
    code, out, err = run_cli(capsys, "evaluate", run, "--device", "cpu")
    assert code == 0 and "iou:" in out, err
    code, _, err = run_cli(capsys, "predict", ckpt, tiny_microscopy / "images" / "img_0000.png",
                           "--out", tmp_path / "p", "--device", "cpu")
    assert code == 0 and (tmp_path / "p" / "img_0000_mask.png").is_file(), err
