"""Synthetic Decathlon datasets of different geometry, for ``fastvision configure`` and its check
against nnU-Net's planner: ``prostate`` (anisotropic two-channel MR, about 0.6 x 0.6 x 3.6 mm),
``hippocampus`` (tiny MR crops, about 35 x 50 x 35 voxels at 1 mm) and ``thinstack`` (a few thick
slices of a large in-plane image).

Anatomy is drawn in normalised coordinates (-1..1 over the field of view), so the same objects
appear whatever the voxel grid; each case jitters shape and spacing a little, as real scans do.
Written like the Decathlon archives: one 3-D (or 4-D for several channels) NIfTI per case, RAS
affines carrying the spacing, dataset.json with ``modality`` and ``labels``.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fastvision.data.synth import SYNTH, require
from fastvision.data.synth.medical import _smooth_noise, write_decathlon_case


def organ_case(rng: np.random.Generator, shape: Sequence[int], means: np.ndarray, radii: Sequence[float] = (0.35, 0.2)
               ) -> tuple[np.ndarray, np.ndarray]:
    """Nested ellipsoids in a body on a noisy background.

    Args:
        rng: generator.
        shape: (X, Y, Z) voxels.
        means: (labels + 2, C) mean intensity per region (row 0 outside the body, row 1 body, then
            one row per label) and channel.
        radii: outer radius of each label's ellipsoid (label 1 the largest), in field-of-view units.

    Returns:
        (image float32 (X, Y, Z, C), label uint8 (X, Y, Z)).
    """
    grid = np.stack(np.meshgrid(*[np.linspace(-1, 1, n) for n in shape], indexing="ij"))
    centre = rng.uniform(-0.1, 0.1, 3)[:, None, None, None]
    body = (((grid / 0.9) ** 2).sum(0)) <= 1
    label = np.zeros(shape, dtype=np.uint8)
    for value, r in enumerate(radii, start=1):
        axes = r * rng.uniform(0.85, 1.15, 3)
        label[(((grid - centre) / axes[:, None, None, None]) ** 2).sum(0) <= 1] = value
    region = np.where(body, label.astype(np.int64) + 1, 0)
    bias = 1 + 0.1 * _smooth_noise(rng, tuple(shape))
    image = means[region] * bias[..., None] * (1 + 0.05 * rng.standard_normal((*shape, means.shape[1])))
    image[~body] = means[0]
    return image.astype(np.float32), label


def write_decathlon(out: Path, name: str, modality: Sequence[str], labels: Sequence[str],
                    cases: list[tuple[np.ndarray, np.ndarray, np.ndarray]], test_cases: int = 0) -> Path:
    """Write ``(image (X, Y, Z, C), label (X, Y, Z), spacing (3,))`` cases as a Decathlon folder;
    the last ``test_cases`` go to imagesTs without their labels."""
    out = Path(out)
    training, test = [], []
    for n, (image, label, spacing) in enumerate(cases):
        affine = np.diag([*map(float, spacing), 1.0])
        case = f"{name.lower()}_{n + 1:03d}"
        data = image[..., 0] if image.shape[-1] == 1 else image
        labelled = n < len(cases) - test_cases
        write_decathlon_case(out, case, np.ascontiguousarray(data),
                             np.ascontiguousarray(label) if labelled else None, affine, training, test)
    meta = {"name": name, "description": f"synthetic {name} (fastvision)",
            "tensorImageSize": "4D" if len(modality) > 1 else "3D",
            "modality": {str(i): m for i, m in enumerate(modality)},
            "labels": {str(i): v for i, v in enumerate(labels)},
            "numTraining": len(training), "numTest": len(test), "training": training, "test": test}
    (out / "dataset.json").write_text(json.dumps(meta, indent=2))
    return out


def _jitter(rng: np.random.Generator, values: Sequence[float], amount: float) -> np.ndarray:
    return np.asarray(values, dtype=float) * rng.uniform(1 - amount, 1 + amount, len(values))


@SYNTH.register("prostate")
def synth_prostate(out: Path, *, seed: int = 0, cases: int = 8, test_cases: int = 0, size: int = 64, slices: int = 16,
                   spacing: tuple[float, float, float] = (0.6, 0.6, 3.6)) -> Path:
    """Write synthetic prostate MR (Task05-like): two channels (T2, ADC), labels PZ and TZ, thick slices.

    Args:
        out: output folder (created).
        seed: random seed.
        cases: labelled cases; test_cases: unlabelled ones in imagesTs.
        size: in-plane edge in voxels (+-10 % per case).
        slices: slices per case (+-2).
        spacing: voxel size in mm (X, Y, Z); in-plane +-5 % per case, slice thickness +-10 %.
    """
    require("prostate", cases=(cases, 1), test_cases=(test_cases, 0), size=(size, 8), slices=(slices, 1),
            spacing=(spacing, ">0"))
    rng = np.random.default_rng(seed)
    means = np.array([[0.0, 0.0], [350.0, 1200.0], [600.0, 1600.0], [250.0, 900.0]])  # out, body, PZ, TZ
    data = []
    for _ in range(cases + test_cases):
        edge = int(round(size * rng.uniform(0.9, 1.1)))
        shape = (edge, edge, max(4, slices + int(rng.integers(-2, 3))))
        sp = np.array([*([spacing[0] * rng.uniform(0.95, 1.05)] * 2), spacing[2] * rng.uniform(0.9, 1.1)])
        image, label = organ_case(rng, shape, means, radii=(0.4, 0.22))
        data.append((image, label, sp))
    return write_decathlon(out, "Prostate", ["T2", "ADC"], ["background", "PZ", "TZ"], data, test_cases)


@SYNTH.register("hippocampus")
def synth_hippocampus(out: Path, *, seed: int = 0, cases: int = 12, test_cases: int = 0,
                      shape: tuple[int, int, int] = (35, 50, 35)) -> Path:
    """Write synthetic hippocampus MR crops (Task04-like): tiny volumes at 1 mm, anterior / posterior labels.

    Args:
        out: output folder (created).
        seed: random seed.
        cases: labelled cases; test_cases: unlabelled ones.
        shape: median volume in voxels; each case varies by +-3 voxels per axis.
    """
    require("hippocampus", cases=(cases, 1), test_cases=(test_cases, 0), shape=(shape, 8))
    rng = np.random.default_rng(seed)
    means = np.array([[0.0], [60.0], [110.0], [85.0]])
    data = []
    for _ in range(cases + test_cases):
        sh = tuple(int(n + rng.integers(-3, 4)) for n in shape)
        image, label = organ_case(rng, sh, means, radii=(0.45, 0.25))
        data.append((image, label, np.ones(3)))
    return write_decathlon(out, "Hippocampus", ["MRI"], ["background", "Anterior", "Posterior"], data, test_cases)


@SYNTH.register("thinstack")
def synth_thinstack(out: Path, *, seed: int = 0, cases: int = 8, test_cases: int = 0, size: int = 96,
                    slices: int = 5, spacing: tuple[float, float, float] = (0.8, 0.8, 6.0),
                    modality: str = "CT") -> Path:
    """Write a thin stack: a few thick slices of a large in-plane image (a 2-D problem in a 3-D file).

    Args:
        out: output folder (created).
        seed: random seed.
        cases: labelled cases; test_cases: unlabelled ones.
        size: in-plane edge in voxels (+-10 %); slices: slices per case (+-1, at least 2).
        spacing: voxel size in mm (X, Y, Z), +-5 % per case.
        modality: dataset.json modality ("CT": intensities in HU, else MR-like).
    """
    require("thinstack", cases=(cases, 1), test_cases=(test_cases, 0), size=(size, 8), slices=(slices, 1),
            spacing=(spacing, ">0"))
    rng = np.random.default_rng(seed)
    ct = modality.upper() == "CT"
    means = np.array([[-1000.0], [40.0], [150.0]]) if ct else np.array([[0.0], [300.0], [700.0]])
    data = []
    for _ in range(cases + test_cases):
        edge = int(round(size * rng.uniform(0.9, 1.1)))
        shape = (edge, edge, max(2, slices + int(rng.integers(-1, 2))))
        image, label = organ_case(rng, shape, means, radii=(0.3,))
        data.append((np.round(image) if ct else image, label, _jitter(rng, spacing, 0.05)))
    return write_decathlon(out, "ThinStack", [modality], ["background", "lesion"], data, test_cases)
