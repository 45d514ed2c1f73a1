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


def resampled_case(tmp_path, affine, shape, target):
    """A case whose image is non-zero in an inner box (so the crop cuts), preprocessed to ``target`` spacing."""
    import nibabel as nib
    import numpy as np

    from fastvision.data.preprocess3d import PreprocessParams, preprocess_case

    data = np.zeros(shape, np.float32)
    data[1:-1, 2:-1, 1:] = 1.0
    nib.save(nib.Nifti1Image(data, affine), str(tmp_path / "img.nii.gz"))
    return preprocess_case({"image": [tmp_path / "img.nii.gz"], "label": None},
                           PreprocessParams(target_spacing=target, intensity="none", crop_foreground=True))


def scipy_restore(values, meta, shape, background=None, fill=0.0, background_fill=1.0):
    """(K, *shape) ``values`` read back at every input voxel by scipy's linear interpolation: each voxel's
    continuous index on the resampled grid is inverse(preprocessed affine) @ input affine @ v (independent of
    the restore's steps), the crop's outside holds ``fill`` (``background_fill`` for class ``background``), the
    grid's border value beyond its edge."""
    import numpy as np
    from scipy.ndimage import map_coordinates

    box = meta["crop_box"]
    full = np.full((values.shape[0], *meta["resampled_shape"]), fill, np.float64)
    if background is not None:
        full[background] = background_fill
    full[(slice(None),) + tuple(slice(a, b) for a, b in box)] = values.double().numpy()
    v = np.stack(np.meshgrid(*[np.arange(n, dtype=np.float64) for n in shape], indexing="ij"), 0).reshape(3, -1)
    m = np.linalg.solve(np.asarray(meta["affine"], np.float64), np.asarray(meta["input_affine"], np.float64))
    coords = m[:3, :3] @ v + m[:3, 3:4] + np.array([[a] for a, _ in box], np.float64)
    return np.stack([map_coordinates(f, coords, order=1, mode="nearest") for f in full]).reshape(-1, *shape)
