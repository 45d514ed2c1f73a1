"""A tiny two-fold ``train --folds`` folder, trained once per session through the CLI."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# The trainings of these tests: tiny patch, window and network, one epoch, flips on two axes (so
# --tta has axes to mirror), no data cache.
FOLD_FLAGS = ["--epochs", "1", "--device", "cpu", "--set", "data.args.num_folds=2",
              "--set", "data.args.patch_size=[16,16,16]", "--set", "task.args.sliding_window.roi_size=[16,16,16]",
              "--set", "task.args.sliding_window.overlap=0.5", "--set", "model.args.filters=[4,8,16]",
              "--set", "data.num_workers=0", "--set", "train.val_every=1", "--set", "examples=0",
              "--set", "train.target=null", "--set", "data.augment={flip: {axes: [0, 1]}}"]


@pytest.fixture(scope="session")
def spleen_folds(tmp_path_factory) -> tuple[Path, Path, str]:
    """(data folder with 4 training and 10 test cases, the folds folder, the train output)."""
    from fastvision import cli
    from fastvision.data.synth import load_all

    root = tmp_path_factory.mktemp("folds")
    data = load_all().get("spleen")(root / "Task09", seed=3, cases=4, test_cases=10, size=20)
    out = root / "cv"
    before = os.environ.get("FASTVISION_CACHE")
    os.environ["FASTVISION_CACHE"] = str(root / "cache")
    try:
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli.main(["train", "unet3d-spleen-baseline", "--data", str(data), "--folds", "all",
                           "--out", str(out), *FOLD_FLAGS])
    finally:
        if before is None:
            os.environ.pop("FASTVISION_CACHE", None)
        else:
            os.environ["FASTVISION_CACHE"] = before
    assert rc == 0, buf.getvalue()
    return data, out, buf.getvalue()
