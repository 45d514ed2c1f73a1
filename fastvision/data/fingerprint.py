"""Dataset fingerprint of a Decathlon folder: what ``fastvision configure`` plans a recipe from.

``fastvision data inspect DATA --fingerprint [--json F]`` reads every training case (in parallel,
each case cached by the identity of its files: path, size and mtime) and reports, as nnU-Net v2's
``DatasetFingerprintExtractor`` does:

* per case: shape and spacing (RAS voxel axes X, Y, Z, the order fastvision trains in) and the
  shape after cropping to the non-zero region (any channel != 0, nnU-Net's ``crop_to_nonzero``);
* per channel: the modality (dataset.json) and foreground intensity statistics - mean, std,
  median, min, max and the 0.5 / 99.5 percentiles over voxels where the label is > 0. Like nnU-Net,
  statistics come from a bounded number of voxels per case (``samples_per_case``): all of a case's
  foreground voxels when it has fewer, else a seeded uniform sample of that many (nnU-Net v2 draws
  ``1e8 / cases`` per case with replacement; a smaller bound keeps the cache small and moves the
  percentiles by well under 1 % of their spread);
* class voxel fractions and the cases whose label is empty: labels counted by ``torch.bincount``
  on their stored dtype (no int64 copy, no sort); ``labels`` in dataset.json as MSD writes them
  (``{value: name}``), as nnU-Net v2 does (``{name: value}``), or with nnU-Net v2's regions (a list
  of values per name: ``regions`` in the fingerprint, planned as one sigmoid output each);
* ``median_relative_size_after_cropping`` (voxels kept by the crop, median over cases), which
  decides nnU-Net's non-zero mask for z-scoring.

A label on another grid than its image is resampled onto the image grid (nearest) with the warning
training gives (:func:`fastvision.data.spatial3d.label_onto_image`: one rule for both).
Bad inputs: channels of one case on different grids, or label values that dataset.json does not
name, stop with one line naming the case (training would fail or learn wrong classes); a case with
no foreground, or far off the others' spacing (more than ``FAR_SPACING`` x the median on an axis),
is listed under ``anomalies`` and logged as one warning line naming the cases, as is a case whose label was
resampled onto its image grid (from the record: a cached fingerprint names them too).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastvision.data.cache.select import default_cache_dir, files_identity
from fastvision.data.formats.anomalies import check_channels
from fastvision.data.formats.dataset_labels import parse_labels, task01_label_map
from fastvision.data.formats.decathlon import modality_names, read_dataset_json
from fastvision.data.preprocess3d import (
    foreground_box,
    load_nifti,
    orientation_to_ras,
    reorient,
    spacing_of,
    whole_labels,
)
from fastvision.data.spatial3d import label_onto_image
from fastvision.errors import DataError
from fastvision.utils.files import atomic_text

log = logging.getLogger(__name__)

SAMPLES_PER_CASE = 10_000  # foreground voxels per case for the intensity statistics
FAR_SPACING = 2.0  # a case whose spacing is this far (either way) from the median on an axis is named
_VERSION = 3  # bump when the per-case record changes: it is part of the cache key


def _read_ras(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(X, Y, Z[, C]) array as stored (dtype kept) in RAS voxel order and its RAS affine."""
    data, affine, _ = load_nifti(path)
    return reorient(np.asarray(data), affine, orientation_to_ras(affine))


def label_counts(label: np.ndarray, name: str) -> dict[int, int]:
    """Voxels per label value, by ``torch.bincount`` on the stored integer dtype (no int64 copy, no
    sort); a float label (many tools store labels as float32) must hold whole non-negative values
    and is read as training reads it (:func:`~fastvision.data.preprocess3d.whole_labels`: int16 class ids,
    float noise within 1e-3 of a whole number rounded, a value farther off an error naming the file)."""
    if label.dtype.kind == "b":
        label = label.view(np.uint8)
    if label.dtype.kind == "f":  # as training reads it: float noise within 1e-3 rounded, farther (NaN too) an error
        label = whole_labels(label, name)
    if label.dtype.kind not in "iu":
        raise DataError(f"{name}: label dtype {label.dtype} is not an integer or float type")
    if label.dtype.kind == "i" and label.size and int(label.min()) < 0:
        raise DataError(f"{name}: negative label value {int(label.min())}")
    if label.dtype in (np.uint16, np.uint32, np.uint64):  # torch.bincount lacks these; values are checked small
        label = label.astype(np.int32 if label.dtype == np.uint16 or int(label.max()) < 2**31 else np.int64)
    counts = torch.bincount(torch.from_numpy(np.ascontiguousarray(label).reshape(-1)))
    return {int(v): int(n) for v, n in enumerate(counts.tolist()) if n}


def case_fingerprint(case: dict[str, Any], samples_per_case: int = SAMPLES_PER_CASE,
                     seed: int = 1234) -> dict[str, Any]:
    """The fingerprint record of one case (see the module docstring).

    Args:
        case: ``{"id", "image": [paths], "label": path}`` as :func:`read_dataset_json` lists it.
        samples_per_case: foreground voxels kept per channel for the intensity statistics.
        seed: sampling seed (with the case id, so a case's sample does not depend on the others).

    Returns:
        ``{"id", "shape", "spacing", "shape_after_crop", "label_counts": {value: voxels}, "label_resampled",
        "samples": [[floats] per channel]}``.
    """
    channels, affine = [], None
    for p in case["image"]:
        data, aff = _read_ras(Path(p))
        data = data[..., None] if data.ndim == 3 else data
        if affine is not None and (not np.allclose(spacing_of(aff), spacing_of(affine), rtol=1e-3)
                                   or data.shape[:3] != channels[0].shape[:3]):
            raise DataError(f"case {case['id']}: channel {Path(p).name} has spacing "
                            f"{np.round(spacing_of(aff), 3).tolist()} and shape {list(data.shape[:3])}, channel "
                            f"{Path(case['image'][0]).name} {np.round(spacing_of(affine), 3).tolist()} and "
                            f"{list(channels[0].shape[:3])}")
        affine = aff if affine is None else affine
        channels.append(data)
    image = np.concatenate(channels, axis=-1).astype(np.float32)  # (X, Y, Z, C)
    spacing = spacing_of(affine)
    label, label_affine = _read_ras(Path(case["label"]))
    label = label[..., 0] if label.ndim == 4 and label.shape[3] == 1 else label
    counts = label_counts(label, str(case["label"]))  # on the stored dtype; also checks the values
    if label.dtype.kind not in "iu":
        label = label.astype(np.int16)  # training's label dtype (preprocess3d._load_case)
    # training's rule: a label on another grid is resampled onto the image grid, with a warning
    moved = label_onto_image(label, label_affine, affine, image.shape[:3], str(case["label"]))
    resampled = moved is not label
    if resampled:
        counts = label_counts(moved, str(case["label"]))
    label = moved
    box = foreground_box(torch.from_numpy((image != 0).any(-1)))
    fg = label > 0
    n_fg = int(fg.sum())
    rng = np.random.default_rng([seed, int(hashlib.sha1(case["id"].encode()).hexdigest()[:8], 16)])
    pick = None if n_fg <= samples_per_case else rng.choice(n_fg, samples_per_case, replace=False)
    samples = []
    for c in range(image.shape[-1]):
        v = image[..., c][fg]
        samples.append((v if pick is None else v[np.sort(pick)]).astype(float).tolist())
    return {"id": case["id"], "shape": list(image.shape[:3]), "spacing": [float(s) for s in spacing],
            "shape_after_crop": [b - a for a, b in box], "label_counts": counts, "label_resampled": resampled,
            "samples": samples}


def _cached(case: dict[str, Any], cache: Path | None, samples_per_case: int) -> dict[str, Any]:
    """:func:`case_fingerprint`, read from / written to ``cache`` keyed by the case's file identity."""
    if cache is None:
        return case_fingerprint(case, samples_per_case)
    ident = files_identity([*case["image"], case["label"]]) + f"|{samples_per_case}|v{_VERSION}"
    f = cache / (hashlib.sha256(ident.encode()).hexdigest()[:32] + ".json")
    if f.is_file():
        try:
            return json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):  # a damaged entry is recomputed
            pass
    record = case_fingerprint(case, samples_per_case)
    atomic_text(f, json.dumps(record))
    return record


def intensity_stats(samples: np.ndarray) -> dict[str, float]:
    """nnU-Net's ``foreground_intensity_properties_per_channel`` entry of pooled foreground samples."""
    if samples.size == 0:
        return {k: float("nan") for k in ("mean", "std", "median", "min", "max", "percentile_00_5", "percentile_99_5")}
    return {"mean": float(np.mean(samples)), "std": float(np.std(samples)), "median": float(np.median(samples)),
            "min": float(np.min(samples)), "max": float(np.max(samples)),
            "percentile_00_5": float(np.percentile(samples, 0.5)),
            "percentile_99_5": float(np.percentile(samples, 99.5))}


def fingerprint(path: str | Path, *, workers: int | None = None, cache: Path | None | bool = True,
                samples_per_case: int = SAMPLES_PER_CASE) -> dict[str, Any]:
    """Fingerprint of the Decathlon folder ``path`` (every training case).

    Args:
        path: folder with dataset.json.
        workers: cases read at once (default: the CPU count, at most 8).
        cache: a folder, True for ``$FASTVISION_CACHE/fingerprint``, or False for none.
        samples_per_case: foreground voxels per case and channel for the intensity statistics.

    Returns:
        A JSON-able dict: ``cases`` (per-case records without their samples), ``channels`` (name,
        modality and intensity statistics each), ``median_spacing``, ``median_shape``,
        ``median_shape_after_crop``, ``class_fractions``, ``empty_label_cases``, ``labels`` and
        ``anomalies`` (``{kind: [case ids]}``).
    """
    found = read_dataset_json(path)
    meta, cases = found["meta"], found["training"]
    if not cases:
        raise DataError(f"{Path(path) / 'dataset.json'}: lists no training cases")
    check_channels(cases, modality_names(meta), Path(path) / "dataset.json")  # headers, before any case is read
    folder = default_cache_dir().parent / "fingerprint" if cache is True else (Path(cache) if cache else None)
    workers = workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:  # decompression and numpy release the GIL
        records = list(pool.map(lambda c: _cached(c, folder, samples_per_case), cases))
    return summarize(meta, records, Path(path))


def _modalities(meta: dict[str, Any], n: int) -> list[str]:
    """dataset.json's names of the ``n`` channels (``unknown`` past the ones it names)."""
    names = modality_names(meta)[:n]
    return names + ["unknown"] * (n - len(names))


def summarize(meta: dict[str, Any], records: list[dict[str, Any]], path: Path) -> dict[str, Any]:
    """Pool per-case records into the dataset fingerprint; raise on label values dataset.json lacks."""
    labels, regions = parse_labels(meta, path)
    if regions and (to := dict(task01_label_map(meta))):  # v2's BraTS regions: in the ids the reader trains on
        regions = {name: sorted(to.get(v, v) for v in values) for name, values in regions.items()}
    for r in records:
        extra = sorted(set(map(int, r["label_counts"])) - set(labels)) if labels else []
        if extra:
            raise DataError(f"case {r['id']}: label values {extra} are not in {path / 'dataset.json'} labels "
                            f"{sorted(labels)}")
    n_ch = len(records[0]["samples"])
    channels = []
    for c, modality in enumerate(_modalities(meta, n_ch)):
        pooled = np.concatenate([np.asarray(r["samples"][c], dtype=np.float64) for r in records])
        channels.append({"channel": c, "modality": modality, **intensity_stats(pooled), "samples": int(pooled.size)})
    spacings = np.array([r["spacing"] for r in records])
    median_spacing = np.median(spacings, axis=0)
    totals: dict[int, int] = {}
    for r in records:
        for v, n in r["label_counts"].items():
            totals[int(v)] = totals.get(int(v), 0) + n
    all_voxels = sum(totals.values())
    empty = [r["id"] for r in records if not any(int(v) > 0 for v in r["label_counts"])]
    far = [r["id"] for r in records if np.any(np.maximum(np.asarray(r["spacing"]) / median_spacing,
                                                         median_spacing / np.asarray(r["spacing"])) > FAR_SPACING)]
    anomalies = {k: v for k, v in {
        "cases with an empty label (no foreground)": empty,
        f"cases more than {FAR_SPACING:g}x off the median spacing on an axis": far,
        # listed from the record, so a cached fingerprint names them too (the reader's warning fires once, uncached)
        "cases whose label is on another grid than its image (resampled onto it, nearest)":
            [r["id"] for r in records if r.get("label_resampled")]}.items() if v}
    for kind, ids in anomalies.items():
        log.warning("%s: %d %s: %s", path, len(ids), kind, ", ".join(ids[:10]) + (" ..." if len(ids) > 10 else ""))
    return {
        "dataset": str(path), "name": meta.get("name", path.name), "labels": labels, "regions": regions,
        "n_cases": len(records),
        "axis_order": "X, Y, Z (RAS voxel axes)",
        "cases": [{k: v for k, v in r.items() if k != "samples"} for r in records],
        "channels": channels,
        "median_spacing": median_spacing.tolist(),
        "median_shape": np.median([r["shape"] for r in records], axis=0).tolist(),
        "median_shape_after_crop": np.median([r["shape_after_crop"] for r in records], axis=0).tolist(),
        "median_relative_size_after_cropping": float(np.median([np.prod(r["shape_after_crop"]) / np.prod(r["shape"])
                                                                for r in records])),
        "class_fractions": {v: n / all_voxels for v, n in sorted(totals.items())},
        "empty_label_cases": empty,
        "anomalies": anomalies,
    }


def text_report(fp: dict[str, Any]) -> str:
    """The fingerprint as aligned text: dataset figures, then one line per channel."""
    def vec(v):
        return " x ".join(f"{x:.3g}" for x in v)

    rows = [("dataset", f"{fp['name']} ({fp['dataset']}), {fp['n_cases']} training cases"),
            ("axes", fp["axis_order"]),
            ("median spacing mm", vec(fp["median_spacing"])),
            ("spacing range mm", " x ".join(f"{min(c['spacing'][a] for c in fp['cases']):.3g}-"
                                            f"{max(c['spacing'][a] for c in fp['cases']):.3g}" for a in range(3))),
            ("median shape", vec(fp["median_shape"])),
            ("median shape after crop", vec(fp["median_shape_after_crop"])),
            ("class voxel fractions", ", ".join(f"{v} {fp['labels'].get(int(v), '?')}: {f:.3%}"
                                                for v, f in fp["class_fractions"].items())),
            ("cases with an empty label", ", ".join(fp["empty_label_cases"]) or "none")]
    for ch in fp["channels"]:
        rows.append((f"channel {ch['channel']} ({ch['modality']})",
                     f"foreground mean {ch['mean']:.4g}, std {ch['std']:.4g}, p0.5 {ch['percentile_00_5']:.4g}, "
                     f"p99.5 {ch['percentile_99_5']:.4g} ({ch['samples']:,} voxels)"))
    for kind, ids in fp["anomalies"].items():
        rows.append((f"anomaly: {kind}", ", ".join(ids[:10])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def cmd_fingerprint(path: Path, json_path: str | None = None) -> int:
    """``fastvision data inspect PATH --fingerprint [--json F]``."""
    if json_path and Path(json_path).is_dir():  # before the fingerprint's reading: a refusal costs nothing
        raise DataError(f"--json {json_path}: is a folder; give a file path")
    fp = fingerprint(path)
    print("fingerprint:\n" + text_report(fp))  # the CLI's output
    if json_path:
        atomic_text(Path(json_path), json.dumps(fp, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0
