"""Two-step smoke runs of the 3-D recipes on tiny synthetic Decathlon data (CPU)."""
from __future__ import annotations

import math

import pytest

engine = pytest.importorskip("fastvision.engine")
from fastvision import config  # noqa: E402
from fastvision.data.synth import load_all  # noqa: E402


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Datasets cache preprocessed cases under FASTVISION_CACHE: keep them out of the user's cache."""
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "fastvision-cache"))


CASES = [  # recipe, synthetic kind, patch edge (or edges), model args
    # the recipe's blocks (1, 2, 2, 4 down; 1, 1, 1 up) at half its width: 16 filters cost twice the CPU
    ("segresnet-brats", "brats", 32, {"init_filters": 8}),
    ("unet3d-spleen-fast", "spleen", 32, {}),
    ("unet3d-spleen-baseline", "spleen", 32, {}),
    # all six levels of the No New-Net, narrow: the 32-320 channels of the recipe cost 30 s of CPU at 64^3.
    # Its 6th level must be > 1 voxel (instance norm): 64 along one axis gives it 2 x 1 x 1 (a 64^3
    # patch, 2^3, costs 4 times the CPU for nothing more)
    pytest.param("unet3d-brats", "brats", [64, 32, 32], {"filters": [4, 8, 8, 8, 8, 8]}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("recipe,kind,patch,model_args", CASES)
def test_recipe_two_steps(tmp_path, recipe, kind, patch, model_args):
    data = load_all().get(kind)(tmp_path / "data", seed=0, cases=5, test_cases=0, size=24)
    patch = patch if isinstance(patch, list) else [patch] * 3
    over = {"data": {"args": {"path": str(data), "patch_size": patch}, "num_workers": 0},
            "model": {"args": model_args},
            "task": {"args": {"sliding_window": {"roi_size": patch}}},
            "train": {"epochs": 1, "steps_per_epoch": 2, "batch_size": 1, "amp": "off", "device": "cpu",
                      "target": None}, "examples": 0}
    run = tmp_path / "run"
    run.mkdir()
    summary = engine.fit(config.load(recipe, [over]), run, progress=False)
    assert math.isfinite(summary["train_loss"]) and 0.0 <= summary["dice"] <= 1.0
    assert (run / "metrics.jsonl").is_file()


def test_cli_predict_writes_nifti_with_input_affine(tmp_path):
    """`fastvision predict RUN imagesTs/...` on a trained 3-D run: one NIfTI per input, input geometry."""
    import inspect

    import nibabel as nib
    import numpy as np

    from fastvision import cli
    from fastvision.tasks.segment import SegmentationTask

    if "predict_nifti_files" not in inspect.getsource(SegmentationTask.predict_files):
        pytest.skip("SegmentationTask.predict_files does not dispatch NIfTI inputs to "
                    "inference.nifti.predict_nifti_files yet")
    data = load_all().get("brats")(tmp_path / "data", seed=0, cases=5, test_cases=1, size=16)
    over = {"data": {"args": {"path": str(data), "patch_size": [16] * 3}, "num_workers": 0},
            "task": {"args": {"sliding_window": {"roi_size": [16] * 3}}}, "model": {"args": {"filters": [4, 8, 16]}},
            "train": {"epochs": 1, "steps_per_epoch": 1, "batch_size": 1, "amp": "off", "device": "cpu"}, "examples": 0}
    run = tmp_path / "run"
    run.mkdir()
    engine.fit(config.load("unet3d-brats", [over]), run, progress=False)
    image = data / "imagesTs" / "BRATS_006.nii.gz"
    assert cli.main(["predict", str(run), str(image), "--out", str(tmp_path / "pred"), "--device", "cpu"]) == 0
    ref, got = nib.load(str(image)), nib.load(str(tmp_path / "pred" / "BRATS_006.nii.gz"))
    assert got.shape == ref.shape[:3]
    np.testing.assert_allclose(got.affine, ref.affine, atol=1e-6)
    assert set(np.unique(np.asarray(got.dataobj)).tolist()) <= {0, 1, 2, 3}  # Task01's MSD ids on output
