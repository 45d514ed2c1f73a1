"""Synthetic 3-D medical data in real on-disk layouts: BraTS brain tumours and spleen CT.

``brats`` writes the Medical Segmentation Decathlon Task01 layout (4-D NIfTI, channels FLAIR, T1w,
T1gd, T2w; MSD label ids) or, with ``layout="brats"``, the raw BraTS layout (one folder per case,
``*_flair/_t1/_t1ce/_t2/_seg.nii.gz``, BraTS label ids 1/2/4, LPS affines). The same seed writes the
same cases in both layouts, so the two loaders can be checked against each other.
``spleen`` writes the Task09 layout: CT in HU (int16) with a body, liver, spine and spleen, and a
different voxel spacing per case so resampling is exercised.

Geometry is drawn in millimetres on a world grid, tumours as nested ellipsoids: edema around a
tumour core whose outer shell enhances and whose centre is necrotic.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fastvision.data.synth import SYNTH, require
from fastvision.errors import ConfigError

# Internal BraTS label ids (after 4 -> 3): 1 necrotic/non-enhancing core, 2 edema, 3 enhancing.
_INTERNAL_TO_MSD = np.array([0, 2, 1, 3], dtype=np.uint8)  # MSD Task01: 1 edema, 2 non-enh., 3 enh.
_INTERNAL_TO_BRATS = np.array([0, 1, 2, 4], dtype=np.uint8)
_INTERNAL_TO_BRATS2023 = np.array([0, 1, 2, 3], dtype=np.uint8)  # BraTS 2023-24: enhancing tumour is 3
# Mean intensity per modality (flair, t1, t1ce, t2) for brain, edema, necrotic core, enhancing.
_MRI_MEANS = np.array([
    [300.0, 420.0, 410.0, 340.0],  # normal brain
    [620.0, 330.0, 360.0, 720.0],  # edema: bright FLAIR and T2
    [260.0, 210.0, 230.0, 800.0],  # necrotic core: dark T1, bright T2
    [450.0, 380.0, 950.0, 520.0],  # enhancing rim: bright T1gd
])


def _nifti(array: np.ndarray, affine: np.ndarray, path: Path) -> None:
    import nibabel as nib

    img = nib.Nifti1Image(array, affine)
    img.header.set_xyzt_units("mm", "sec")
    img.set_qform(affine, code=1)
    img.set_sform(affine, code=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(img, str(path))


def write_decathlon_case(out: Path, case: str, image: np.ndarray, label: np.ndarray | None, affine: np.ndarray,
                         training: list[dict[str, str]], test: list[str]) -> None:
    """Write one case of a Decathlon folder: ``imagesTr`` + ``labelsTr`` and its ``training`` entry,
    or, without a ``label``, ``imagesTs`` and its ``test`` entry (paths as dataset.json lists them)."""
    if label is None:
        _nifti(image, affine, out / f"imagesTs/{case}.nii.gz")
        test.append(f"./imagesTs/{case}.nii.gz")
        return
    _nifti(image, affine, out / f"imagesTr/{case}.nii.gz")
    _nifti(label, affine, out / f"labelsTr/{case}.nii.gz")
    training.append({"image": f"./imagesTr/{case}.nii.gz", "label": f"./labelsTr/{case}.nii.gz"})


def as_nnunetv2(out: Path, write_msd: Callable[[Path], Path]) -> Path:
    """``--layout nnunetv2``: the Decathlon folder ``write_msd`` writes (into a staging folder beside ``out``),
    converted into ``out`` as ``nnUNetv2_convert_MSD_dataset`` converts it: the same cases, one file per channel."""
    import shutil
    import tempfile

    from fastvision.data.formats.nnunetv2 import from_msd

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.msd-") as tmp:
        from_msd(write_msd(Path(tmp) / "msd"), Path(tmp) / "v2")
        out.mkdir(exist_ok=True)
        for p in (Path(tmp) / "v2").iterdir():
            shutil.move(str(p), str(out / p.name))
    return out


def _smooth_noise(rng: np.random.Generator, shape: tuple[int, ...], cells: int = 4) -> np.ndarray:
    """Low-frequency field in [-1, 1]: a coarse random grid upsampled by repetition and blurring."""
    coarse = rng.uniform(-1, 1, size=(cells,) * len(shape))
    idx = np.ix_(*[np.minimum((np.arange(n) * cells) // n, cells - 1) for n in shape])
    field = coarse[idx]
    for axis in range(len(shape)):  # box blur to remove the block edges
        k = max(1, shape[axis] // cells)
        c = np.cumsum(np.pad(field, [(k, k) if a == axis else (0, 0) for a in range(len(shape))], mode="edge"), axis)
        field = (np.take(c, range(2 * k, 2 * k + shape[axis]), axis)
                 - np.take(c, range(0, shape[axis]), axis)) / (2 * k)
    return field


def brats_volume(rng: np.random.Generator, shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic brain with a tumour, in RAS voxel order at 1 mm isotropic spacing.

    Returns:
        (image float32 (4, X, Y, Z) in channel order flair, t1, t1ce, t2; label uint8 (X, Y, Z) with
        internal ids 0..3).
    """
    grid = np.stack(np.meshgrid(*[np.arange(n, dtype=np.float32) - (n - 1) / 2 for n in shape], indexing="ij"))
    size = np.asarray(shape, dtype=np.float32)
    head = (((grid / (size[:, None, None, None] * rng.uniform(0.38, 0.45, 3)[:, None, None, None])) ** 2).sum(0)) <= 1
    centre = (rng.uniform(-0.15, 0.15, 3) * size)[:, None, None, None]
    r_core = rng.uniform(0.08, 0.13, 3) * size

    def inside(radius: np.ndarray) -> np.ndarray:
        return (((grid - centre) / radius[:, None, None, None]) ** 2).sum(0) <= 1

    label = np.zeros(shape, dtype=np.uint8)
    label[inside(r_core * rng.uniform(1.6, 2.0))] = 2
    label[inside(r_core)] = 3
    label[inside(r_core * rng.uniform(0.45, 0.65))] = 1
    label[~head] = 0
    means = _MRI_MEANS[label]  # (X, Y, Z, 4)
    bias = 1 + 0.1 * _smooth_noise(rng, shape)  # scanner bias field
    image = means * bias[..., None] * (1 + 0.05 * rng.standard_normal(means.shape))
    image = np.where(head[..., None], np.clip(image, 1, None), 0).astype(np.float32)
    return np.moveaxis(image, -1, 0), label


@SYNTH.register("brats")
def synth_brats(out: Path, *, seed: int = 0, cases: int = 8, test_cases: int = 2, size: int = 64,
                layout: str = "decathlon") -> Path:
    """Write synthetic BraTS cases.

    Args:
        out: output folder (created).
        seed: random seed; the same seed gives the same cases in both layouts.
        cases: labelled (training) cases.
        test_cases: unlabelled cases (Decathlon ``imagesTs``; ignored for the raw layout).
        size: edge of the cubic volume in voxels (1 mm isotropic).
        layout: "decathlon" (Task01 with dataset.json), "brats" (raw per-case folders of 2017-2021's names,
            under HGG/ and LGG/ as 2019), "brats2023" (BraTS 2023-24's ``BraTS-GLI-NNNNN-000/...-t2f.nii.gz``
            folders, enhancing tumour 3) or "nnunetv2" (the Task01 folder as nnU-Net v2's converter writes
            it: one file per channel, the MSD label ids).

    Returns:
        ``out``.
    """
    require("brats", cases=(cases, 1), test_cases=(test_cases, 0), size=(size, 8))
    if layout not in ("decathlon", "brats", "brats2023", "nnunetv2"):
        raise ConfigError(f"data synth brats --layout {layout!r}: must be decathlon, brats, brats2023 or nnunetv2")
    if layout == "nnunetv2":
        return as_nnunetv2(out, lambda msd: synth_brats(msd, seed=seed, cases=cases, test_cases=test_cases, size=size))
    out = Path(out)
    rng = np.random.default_rng(seed)
    ras = np.diag([1.0, 1.0, 1.0, 1.0])
    ras[:3, 3] = -(size - 1) / 2
    training, test = [], []
    for n in range(cases + test_cases):
        image, label = brats_volume(rng, (size, size, size))
        case = f"BRATS_{n + 1:03d}"
        labelled = n < cases
        if layout == "decathlon":
            write_decathlon_case(out, case, np.moveaxis(image, 0, -1).round().astype(np.int16),
                                 _INTERNAL_TO_MSD[label] if labelled else None, ras, training, test)
        elif labelled:
            # Raw BraTS files are stored LPS: flip x and y (data and affine) so world positions match.
            lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ ras
            lps[:2, 3] = (size - 1) / 2
            flip = (slice(None, None, -1), slice(None, None, -1))
            if layout == "brats":
                folder = out / ("HGG" if n % 2 == 0 else "LGG") / f"BraTS19_SYN_{n + 1:03d}_1"
                sep, mods, labels = "_", ("flair", "t1", "t1ce", "t2"), _INTERNAL_TO_BRATS
            else:  # 2023-24: one folder per case, channels t2f (FLAIR), t1n, t1c, t2w
                folder = out / f"BraTS-GLI-{n + 1:05d}-000"
                sep, mods, labels = "-", ("t2f", "t1n", "t1c", "t2w"), _INTERNAL_TO_BRATS2023
            for c, mod in enumerate(mods):
                _nifti(image[c][flip].round().astype(np.int16), lps, folder / f"{folder.name}{sep}{mod}.nii.gz")
            _nifti(labels[label][flip], lps, folder / f"{folder.name}{sep}seg.nii.gz")
    if layout == "decathlon":
        meta = {
            "name": "BRATS", "description": "synthetic gliomas (fastvision)", "tensorImageSize": "4D",
            "modality": {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"},
            "labels": {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"},
            "numTraining": len(training), "numTest": len(test), "training": training, "test": test,
        }
        (out / "dataset.json").write_text(json.dumps(meta, indent=2))
    return out


def spleen_volume(rng: np.random.Generator, shape: tuple[int, int, int],
                  spacing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CT-like abdomen in HU on a grid of ``shape`` voxels at ``spacing`` mm, RAS voxel order.

    Returns:
        (image int16 (X, Y, Z) in HU, label uint8 (X, Y, Z) with 1 = spleen).
    """
    axes = [(np.arange(n) - (n - 1) / 2) * s for n, s in zip(shape, spacing, strict=True)]
    x, y, z = np.meshgrid(*axes, indexing="ij")  # mm; RAS+: +x patient right, +y anterior

    def ellipsoid(c: tuple[float, float, float], r: tuple[float, float, float]) -> np.ndarray:
        return ((x - c[0]) / r[0]) ** 2 + ((y - c[1]) / r[1]) ** 2 + ((z - c[2]) / r[2]) ** 2 <= 1

    j = lambda a: a * rng.uniform(0.85, 1.15)  # noqa: E731 - per-case anatomical variation
    body = (x / j(46.0)) ** 2 + (y / j(34.0)) ** 2 <= 1
    fat = body & ((x / 40.0) ** 2 + (y / 28.0) ** 2 > 1)
    image = np.full(shape, -1000.0)
    image[body] = 40.0
    image[fat] = -100.0
    image[ellipsoid((15.0, 2.0, 5.0), (j(22.0), j(18.0), j(30.0)))] = 60.0  # liver: patient right, +x
    image[(x / 5.0) ** 2 + ((y + 22.0) / 5.0) ** 2 <= 1] = 700.0  # spine: posterior, -y
    spleen = ellipsoid((j(-22.0), j(-8.0), rng.uniform(-10, 10)), (j(11.0), j(8.0), j(16.0))) & body
    image[spleen] = 105.0
    image += 12.0 * rng.standard_normal(shape) + 20.0 * _smooth_noise(rng, shape)
    return np.clip(image, -1024, 3071).astype(np.int16), spleen.astype(np.uint8)


@SYNTH.register("spleen")
def synth_spleen(out: Path, *, seed: int = 0, cases: int = 8, test_cases: int = 2, size: int = 64,
                 zoom: float = 1.0, layout: str = "decathlon") -> Path:
    """Write synthetic spleen CT in the Decathlon Task09 layout (``layout: nnunetv2``: nnU-Net v2's raw
    layout of the same cases, ``imagesTr/spleen_1_0000.nii.gz``, as its MSD converter writes them).

    In-plane spacing is drawn in [1.2, 1.8] mm and slice spacing in [1.5, 3.0] mm per case; the
    slice count is chosen so every case covers about ``1.5 * size`` mm, as real scans vary in both.

    Args:
        out: output folder (created).
        seed: random seed.
        cases: labelled cases; test_cases: unlabelled cases in ``imagesTs``.
        size: in-plane edge in voxels.
        zoom: multiplies every spacing: the anatomy is fixed in mm (body about 92 x 68 mm), so
            small volumes need ``zoom`` about 64 / size to show the whole body and spleen.

    Returns:
        ``out``.
    """
    require("spleen", cases=(cases, 1), test_cases=(test_cases, 0), size=(size, 8), zoom=(zoom, ">0"))
    if layout not in ("decathlon", "nnunetv2"):
        raise ConfigError(f"data synth spleen --layout {layout!r}: must be decathlon or nnunetv2")
    if layout == "nnunetv2":
        return as_nnunetv2(out, lambda msd: synth_spleen(msd, seed=seed, cases=cases, test_cases=test_cases,
                                                         size=size, zoom=zoom))
    out = Path(out)
    rng = np.random.default_rng(seed)
    training, test = [], []
    for n in range(cases + test_cases):
        spacing = np.array([rng.uniform(1.2, 1.8)] * 2 + [rng.uniform(1.5, 3.0)]) * zoom
        shape = (size, size, max(8, int(round(1.5 * size / spacing[2]))))
        image, label = spleen_volume(rng, shape, spacing)
        # Stored LPS (x and y flipped), as CT converted from DICOM usually is.
        affine = np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])
        affine[:3, 3] = [(shape[0] - 1) / 2 * spacing[0], (shape[1] - 1) / 2 * spacing[1],
                         -(shape[2] - 1) / 2 * spacing[2]]
        image, label = image[::-1, ::-1], label[::-1, ::-1]
        case = f"spleen_{n + 1}"
        write_decathlon_case(out, case, np.ascontiguousarray(image),
                             np.ascontiguousarray(label) if n < cases else None, affine, training, test)
    meta = {
        "name": "Spleen", "description": "synthetic spleen CT (fastvision)", "tensorImageSize": "3D",
        "modality": {"0": "CT"}, "labels": {"0": "background", "1": "spleen"},
        "numTraining": len(training), "numTest": len(test), "training": training, "test": test,
    }
    (out / "dataset.json").write_text(json.dumps(meta, indent=2))
    return out
