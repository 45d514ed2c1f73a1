"""Shared fixtures: tiny real datasets written to disk once per session, and GPU skipping."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_microscopy(tmp_path_factory):
    """16 generated 32x32 image/mask PNG pairs in the microscopy folder format."""
    from fastvision.data.synth.microscopy import synth

    return synth(tmp_path_factory.mktemp("micro") / "data", seed=1, count=16, size=32)


def tiny_overrides(data_path, **more) -> dict:
    """Flat + dotted overrides that make unet2d-microscopy run in about a second on CPU."""
    return {"data": str(data_path), "epochs": 2, "batch_size": 4, "device": "cpu",
            "data.args.image_size": [32, 32], "model.args.filters": [4, 8, 16],
            "data.num_workers": 0, "train.log_every": 1, "examples": 2, **more}
