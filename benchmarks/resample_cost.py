"""What ``data.args.resample: nnunet`` costs: one case's ``preprocess_case``, MONAI's order against nnU-Net's.

A generated CT volume (a bright ellipsoid in soft tissue, air around the body, noise) at a clinical size and
spacing is written as NIfTI once; then each mode preprocesses it (read, reorient, crop, window, resample)
``--repeats`` times, alternating, and the median wall time of each is reported with the ratio. This runs once
per case when a cache fills (``data.cache``), not per step::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/resample_cost.py --shape 512 512 90 --spacing 0.8 0.8 5 \\
        --target 1.5 1.5 2.5
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def write_case(folder: Path, shape: tuple[int, int, int], spacing: tuple[float, float, float]) -> tuple[Path, Path]:
    import nibabel as nib

    rng = np.random.default_rng(0)
    g = np.meshgrid(*[np.linspace(-1, 1, n, dtype=np.float32) for n in shape], indexing="ij")
    body = g[0] ** 2 + g[1] ** 2 < 0.8
    organ = ((g[0] - 0.3) / 0.2) ** 2 + ((g[1] + 0.2) / 0.15) ** 2 + (g[2] / 0.5) ** 2 < 1
    image = np.where(body, 40.0, -1000.0).astype(np.float32) + np.where(organ, 60.0, 0.0).astype(np.float32)
    image += rng.normal(0, 15, shape).astype(np.float32)
    affine = np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])  # LPS-like storage: RAS mirrors two axes
    ip, lp = folder / "ct.nii.gz", folder / "ct_label.nii.gz"
    nib.save(nib.Nifti1Image(image, affine), str(ip))
    nib.save(nib.Nifti1Image(organ.astype(np.uint8), affine), str(lp))
    return ip, lp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[512, 512, 90])
    ap.add_argument("--spacing", type=float, nargs=3, default=[0.8, 0.8, 5.0])
    ap.add_argument("--target", type=float, nargs=3, default=[1.5, 1.5, 2.5])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from fastvision.data.preprocess3d import PreprocessParams, preprocess_case

    with tempfile.TemporaryDirectory() as tmp:
        ip, lp = write_case(Path(tmp), tuple(args.shape), tuple(args.spacing))
        times: dict[str, list[float]] = {"monai": [], "nnunet": []}
        shapes = {}
        for _ in range(args.repeats):
            for mode in times:
                params = PreprocessParams(target_spacing=tuple(args.target), intensity="ct",
                                          window=(-160.0, 240.0, -2.0, 2.0), crop_foreground="nonzero", resample=mode)
                t0 = time.perf_counter()
                out = preprocess_case({"image": [ip], "label": lp}, params)
                times[mode].append(time.perf_counter() - t0)
                shapes[mode] = tuple(out["image"].shape[1:])
    m = {k: statistics.median(v) for k, v in times.items()}
    print(f"case {tuple(args.shape)} at {tuple(args.spacing)} mm -> {tuple(args.target)} mm; median of {args.repeats}")
    for k in times:
        print(f"  resample {k:<6}: {m[k]:6.2f} s  -> {shapes[k]}")
    print(f"  nnunet / monai: {m['nnunet'] / m['monai']:.2f}x")


if __name__ == "__main__":
    main()
