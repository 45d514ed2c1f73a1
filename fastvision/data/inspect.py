"""``fastvision data inspect PATH``: what is in a dataset folder, before you train on it.

Recognises the layout, then reports counts, shapes, dtypes, intensity range and class balance.
Float files holding NaN or Inf are listed (every float microscopy image, every float-stored NIfTI
volume is read in full for it, as nnU-Net's integrity check does: integer files cannot hold them).
Layouts register an inspector with :func:`inspector`; the first whose ``detect`` accepts the
folder reports on it.
"""
from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from fastvision.data.nonfinite import NONFINITE_FILES, nifti_nonfinite
from fastvision.errors import ConfigError, DataError

# the layouts whose inspector takes data.args, and which (None: microscopy checks its own, its rule's)
SETTINGS: dict[str, set[str] | None] = {"microscopy": None, "imagefolder": {"val_labels"}}
_INSPECTORS: list[tuple[str, Callable[[Path], bool], Callable[[Path], dict[str, Any]]]] = []


def inspector(name: str, detect: Callable[[Path], bool]):
    """Register ``fn(path) -> report dict`` for folders where ``detect(path)`` is true."""

    def deco(fn):
        _INSPECTORS.append((name, detect, fn))
        return fn

    return deco


def inspect_path(path: Path | str, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report of the first layout that detects ``path``; ``settings``: the dataset builder
    arguments its checks follow (``data inspect --set channels=3``; microscopy only). A URL
    (``http(s)://``, ``s3://``) is a shard set or, without ``shards.json``, a TFRecord folder."""
    from fastvision.data.shards.remote import is_remote

    if is_remote(path):
        if settings:
            raise ConfigError(f"data inspect --set: only the microscopy layout takes settings, {path} is a URL")
        return _inspect_url(str(path))
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: not found")
    for name, detect, fn in _INSPECTORS:
        if detect(path):
            if settings and name not in SETTINGS:
                raise ConfigError(f"data inspect --set: only the {' and '.join(SETTINGS)} layouts take "
                                  f"settings, {path} is {name}")
            allowed = SETTINGS.get(name)
            if settings and allowed is not None and not set(settings) <= allowed:
                raise ConfigError(f"data inspect --set {', '.join(sorted(set(settings) - allowed))}: the {name} "
                                  f"layout of {path} takes {', '.join(sorted(allowed))}")
            return {"layout": name, "path": str(path), **(fn(path, **settings) if settings else fn(path))}
    raise DataError(f"{path}: unrecognised dataset layout; known: {', '.join(n for n, _, _ in _INSPECTORS)}")


def print_report(report: dict[str, Any]) -> None:
    """One row per fact; each anomaly kind gets its own row (count and first names or ids)."""
    table = Table(title=f"{report['layout']} dataset: {report['path']}", show_header=False)
    table.add_column(overflow="fold")
    table.add_column(overflow="fold")  # file names wrap rather than end in "..."
    table.add_row("detected layout", str(report.get("detected", report["layout"])))
    for k, v in report.items():
        if k in ("layout", "path", "detected", "anomalies", "unusable"):
            continue
        table.add_row(k, ", ".join(f"{a}: {b}" for a, b in v.items()) if isinstance(v, dict) else str(v))
    anomalies = report.get("anomalies") or {}
    for kind, text in anomalies.items():
        table.add_row(f"[yellow]anomaly[/yellow]: {kind}", text)
    if not anomalies:
        table.add_row("anomalies", "none found")
    Console().print(table)


def anomaly_rows(found: dict[str, Sequence[Any]]) -> dict[str, str]:
    """``{kind: [ids]}`` -> ``{kind: "count (first ids)"}`` for the report, empty kinds dropped."""
    from fastvision.data.formats.anomalies import first_few

    return {k: f"{len(v)} ({first_few(v)})" for k, v in found.items() if v}


@inspector("shards", lambda p: (p / "shards.json").is_file())
def inspect_shards(path: Path) -> dict[str, Any]:
    from fastvision.data.formats.shard_sets import inspect_set

    return inspect_set(path)


def _inspect_url(url: str) -> dict[str, Any]:
    from fastvision.data.formats.shard_sets import inspect_set, inspect_tfrecords
    from fastvision.data.shards.remote import NotFound

    try:
        return {"layout": "shards", "path": url, **inspect_set(url)}
    except NotFound as missing:
        try:
            return {"layout": "tfrecords", "path": url, **inspect_tfrecords(url)}
        except NotFound as e:
            raise DataError(f"{missing}; not a TFRecord folder either: {e}") from None


def _tfrecords(path: Path) -> bool:
    from fastvision.data.shards.tfrecord import is_tfrecord_set

    return is_tfrecord_set(path)


@inspector("tfrecords", _tfrecords)
def inspect_tfrecords(path: Path) -> dict[str, Any]:
    from fastvision.data.formats.shard_sets import inspect_tfrecords as report

    return report(path)


@inspector("microscopy", lambda p: (p / "images").is_dir() and (p / "masks").is_dir())
def inspect_microscopy(path: Path, **settings: Any) -> dict[str, Any]:
    """Every pair read and put through training's own :func:`prepare_pair` with the microscopy
    builder's ``channels`` / ``num_classes`` / ``binarize`` (its defaults, or ``settings``)."""
    from fastvision.data.formats.microscopy import pair_files, prepare_pair, unread_subfolders
    from fastvision.data.formats.microscopy_check import MaskTally, microscopy_rule, read_pair

    rule, stops = microscopy_rule(settings)
    nonfinite = rule.pop("nonfinite")  # how a file is read, not a rule of prepare_pair's
    unusable: dict[str, list[str]] = {}  # what training would stop on: every one listed, then exit 2
    tally = MaskTally()
    usable = 0
    for img_path, mask_path in pair_files(path, unusable):
        pair = read_pair(img_path, mask_path, path, unusable, nonfinite, tally.anomalies)
        if pair is None:
            continue
        img, mask = pair
        try:
            prepare_pair(img, mask, img_path, mask_path, **rule)
            usable += 1
        except DataError as e:  # still described below (shape, dtype): the row says why it stops
            unusable.setdefault(stops, []).append(str(e).replace(str(path) + "/", ""))
        tally.add(img, mask, img_path, mask_path)
    tally.flag_mixed_binary_encodings()
    nested = unread_subfolders(path)
    if nested:  # training warns and trains without them
        tally.anomalies["sub-folders not read (pairs are the files directly in images/ and masks/)"] = nested
    total = sum(tally.classes.values()) or 1
    values = sorted(tally.classes)
    return {"detected": "microscopy images/ + masks/ (paired by file stem)", "pairs": usable,
            "image shapes": dict(tally.shapes), "dtypes": dict(tally.dtypes),
            "intensity range": tally.range_text() if usable else "-",
            "mask encodings (files)": dict(tally.encodings),
            "mask values (pixel share)": {v: f"{tally.classes[v] / total:.2%}" for v in values[:20]},
            "anomalies": anomaly_rows({**unusable, **tally.anomalies}),
            "unusable": {k: len(v) for k, v in unusable.items()}}


def _pathology_splits(path: Path) -> list[Path]:
    from fastvision.data.formats.camelyon import is_slide_split

    return [d for d in sorted(path.iterdir()) if d.is_dir() and not d.name.startswith(".")
            and (is_slide_split(d) or ((d / "normal").is_dir() and (d / "tumor").is_dir()))] if path.is_dir() else []


def _looks_pathology(path: Path) -> bool:
    """A split of slides (``images/`` + ``masks/`` or ``annotations/``, Camelyon16's ``lesion_annotations/``),
    or of patch folders (``normal/`` + ``tumor/``) unless ``train/`` makes it an ImageFolder as well.
    Checked before ImageFolder, which would take ``train/images`` and ``train/masks`` for classes.
    A ``train/`` of class folders is an ImageFolder even beside a ``val/images/`` (Tiny-ImageNet's)."""
    from fastvision.data.formats.camelyon import is_slide_split

    train = path / "train"
    if train.is_dir() and not is_slide_split(train):
        return False
    splits = _pathology_splits(path)
    return any(map(is_slide_split, splits)) or (bool(splits) and not train.is_dir())


@inspector("pathology", _looks_pathology)
def inspect_pathology(path: Path) -> dict[str, Any]:
    from fastvision.data.formats.asap import is_exclusion, read_polygons
    from fastvision.data.formats.camelyon import find_slides, is_slide_split
    from fastvision.data.formats.pathology import TiledTiff

    report: dict[str, Any] = {}
    anomalies: dict[str, list[str]] = {}
    unusable: dict[str, list[str]] = {}  # slides and masks whose TIFF does not open: training stops on them
    kinds = set()
    for d in _pathology_splits(path):
        split = d.name
        if not is_slide_split(d):
            kinds.add("patch folders (normal/, tumor/)")
            for name in ("normal", "tumor"):
                report[f"{split} {name} patches"] = sum(1 for p in (d / name).iterdir() if not p.name.startswith("."))
            continue
        kinds.add("Camelyon16 (tumor/, normal/, lesion_annotations/*.xml)" if (d / "lesion_annotations").is_dir()
                  else "slides (images/ + masks/ or annotations/*.xml)")
        slides, found = find_slides(d)
        for kind, names in found.items():
            anomalies[f"{split}: {kind}"] = names
        with_source = sum(s is not None for _, s in slides)
        report[f"{split} slides (with a mask or annotation)"] = f"{len(slides)} ({with_source})"
        readable = []
        for slide, source in slides:  # each TIFF's header and tile table (the pixels are read per patch)
            tiffs = [slide] + ([source] if source is not None and source.suffix.lower() != ".xml" else [])
            try:
                for f in tiffs:
                    TiledTiff(f).close()
            except DataError:
                unusable.setdefault(f"{split}: TIFFs that do not open", []).append(str(f.relative_to(path)))
                continue
            readable.append((slide, source))
        if readable:
            t = TiledTiff(readable[0][0])
            report[f"{split} levels (first slide)"] = ", ".join(f"{h}x{w}" for h, w in t.level_shapes)
            t.close()
        polys = [g for _, s in slides if s is not None and s.suffix.lower() == ".xml" for g, _ in read_polygons(s)]
        if polys:
            report[f"{split} lesion polygons (exclusions)"] = f"{len(polys)} ({sum(map(is_exclusion, polys))})"
    report = {"detected": "pathology: " + "; ".join(sorted(kinds)), **report,
              "anomalies": anomaly_rows({**unusable, **anomalies}),
              "unusable": {k: len(v) for k, v in unusable.items()}}
    return report


@inspector("imagefolder", lambda p: (p / "train").is_dir() and any(d.is_dir() for d in (p / "train").iterdir()))
def inspect_imagefolder(path: Path, header_limit: int = 5000, val_labels: str | None = None) -> dict[str, Any]:
    """Counts, sizes and modes per split; up to ``header_limit`` evenly spaced files per split are
    read to their end (a truncated file is found). Unreadable files and validation classes the
    training split lacks are what training stops on (``unusable``: exit 2 after the report).
    ``val_labels``: the builder's key, the labels of a flat ``val/`` (``--set val_labels=val.txt``)."""
    from fastvision.data.formats.imagefolder import (
        EXTENSIONS,
        find_classes,
        list_samples,
        loose_images,
    )
    from fastvision.data.formats.imagenet_val import flat_val_layout, flat_val_samples

    train_dir, val_dir = "train", "val"
    report: dict[str, Any] = {"detected": f"ImageFolder ({train_dir}/<class>/*)"}
    anomalies: dict[str, list[str]] = {}
    unusable: dict[str, list[str]] = {}
    classes = find_classes(path / train_dir)
    for split in (train_dir, val_dir):
        d = path / split
        if not d.is_dir():  # only val/ gets here (no train/ is an error above): training stops on it
            unusable[f"{split}/ missing (training validates on it; a folder of another name: data.args.val_dir)"] = [
                str(d)]
            continue
        flat = flat_val_layout(d, EXTENSIONS) if split == val_dir else None
        if flat:
            samples, how = flat_val_samples(flat[0], classes, path, EXTENSIONS, val_labels or flat[1])
            report["detected"] += f"; {split}: {how}"
            names = classes
        else:
            names = find_classes(d)
            if split == val_dir:
                nfc = lambda c: unicodedata.normalize("NFC", c)  # noqa: E731  (as the reader matches them)
                extra = sorted(set(map(nfc, names)) - set(map(nfc, classes)))
                if extra:
                    unusable[f"{split}: class folders not in {train_dir}/"] = extra
                missing = sorted(set(map(nfc, classes)) - set(map(nfc, names)))
                if missing:
                    anomalies[f"{split}: {train_dir}/ classes without a {split} folder (not validated)"] = missing
            samples = list_samples(d, names)
            anomalies[f"{split}: image files beside the class folders (not read)"] = loose_images(d)[:1000]
        anomalies[f"{split}: macOS ._ companion files (ignored)"] = [
            str(p.relative_to(path)) for p in sorted(d.rglob("._*"))][:1000]
        per_class = Counter(names[i] for _, i in samples)
        report[f"{split} images"] = len(samples)
        report[f"{split} classes"] = len(per_class)
        report[f"{split} per class (first 20)"] = dict(sorted(per_class.items())[:20])
        sizes, modes, checked = _image_headers([p for p, _ in samples], header_limit, anomalies, split, path, unusable)
        report[f"{split} sizes (files checked {checked})"] = dict(sizes.most_common(5))
        report[f"{split} modes (files checked {checked})"] = dict(modes)
    report["anomalies"] = anomaly_rows({**unusable, **anomalies})
    report["unusable"] = {k: len(v) for k, v in unusable.items() if v}
    return report


def _image_headers(files: list[str], limit: int, anomalies: dict[str, list[str]], split: str,
                   root: Path, unusable: dict[str, list[str]]) -> tuple[Counter, Counter, int]:
    """Sizes and modes of up to ``limit`` evenly spaced files, each checked to its end
    (:func:`check_complete`: the end marker, else a full decode); CMYK, 16-bit, PNG-named-JPEG
    files go to ``anomalies`` (they load: converted to RGB, named here so you know), files that do
    not decode (a truncated JPEG too) to ``unusable``."""
    from fastvision.data.formats.anomalies import image_facts

    sizes, modes = Counter(), Counter()
    picked = files[:: max(1, len(files) // limit)]
    for p in picked:
        rel = str(Path(p).relative_to(root))
        facts = image_facts(p)
        if facts is None:  # any decoder failure, truncated data included
            unusable.setdefault(f"{split}: image files that do not decode", []).append(rel)
            continue
        (size, fmt, mode, _) = facts
        sizes[f"{size[0]}x{size[1]}"] += 1
        modes[mode] += 1
        suffix = Path(p).suffix.lower()
        if suffix in (".jpg", ".jpeg") and fmt != "JPEG":
            anomalies.setdefault(f"{split}: {fmt} files named {Path(p).suffix} (decoded as {fmt})", []).append(rel)
        if mode == "CMYK":
            anomalies.setdefault(f"{split}: CMYK images (converted to RGB)", []).append(rel)
        elif mode.startswith("I;16"):
            anomalies.setdefault(f"{split}: 16-bit grey images (scaled to 8 bits, converted to RGB)", []).append(rel)
        elif mode not in ("RGB",):
            anomalies.setdefault(f"{split}: {mode} images (converted to RGB)", []).append(rel)
    return sizes, modes, len(picked)


@inspector("coco", lambda p: (p / "annotations").is_dir() and any((p / "annotations").glob("instances_*.json")))
def inspect_coco(path: Path) -> dict[str, Any]:
    from fastvision.data.formats.coco_check import inspect_folder

    report, anomalies, unusable = inspect_folder(path)
    return {**report, "anomalies": anomaly_rows({**unusable, **anomalies}),
            "unusable": {k: len(v) for k, v in unusable.items() if v}}


@inspector("decathlon", lambda p: (p / "dataset.json").is_file())
def inspect_decathlon(path: Path) -> dict[str, Any]:
    import nibabel as nib

    from fastvision.data.formats.anomalies import channel_mismatches, nifti_complete
    from fastvision.data.formats.decathlon import modality_names, read_dataset_json, task01_label_map
    from fastvision.data.spatial3d import label_off_grid

    ds = read_dataset_json(path, missing=(missing := []))  # nnU-Net v2's folder: its own kinds in "unusable"
    unusable = {"files dataset.json lists that do not exist": missing, **ds.get("unusable", {})}
    meta, grids = ds["meta"], []
    unusable[f"images whose channel count is not dataset.json's modality count ({len(modality_names(meta))})"] = [
        f"{p.relative_to(path)} ({n})" for p, n in channel_mismatches(ds["training"], modality_names(meta))]
    shapes, spacings, classes = Counter(), Counter(), Counter()
    read = 0
    for case in ds["training"]:  # every case's headers; label voxels of the first 10 readable ones
        try:
            img, label = (nib.load(str(p)) for p in (case["image"][0], case["label"]))
            nifti_complete(Path(case["image"][0]), img) or nifti_complete(Path(case["label"]), label)  # truncated?
            if read < 10:
                values, counts = np.unique(np.asarray(label.dataobj), return_counts=True)
        except Exception as e:  # noqa: BLE001  (any nibabel failure: the file is not a usable NIfTI)
            unusable.setdefault("unreadable NIfTI files", []).append(f"{case['id']}: {str(e).splitlines()[0][:80]}")
            continue
        bad = nifti_nonfinite([*case["image"], case["label"]], path)
        if bad:
            unusable.setdefault(NONFINITE_FILES, []).extend(bad)
        if label_off_grid(img.shape, img.affine, label.shape, label.affine):
            grids.append(str(Path(case["label"]).relative_to(path)))
        if read < 10:
            shapes[str(img.shape)] += 1
            spacings[str(tuple(round(float(z), 2) for z in img.header.get_zooms()[:3]))] += 1
            for v, c in zip(values.tolist(), counts.tolist(), strict=True):
                classes[int(v)] += c
        read += 1
    total = sum(classes.values()) or 1
    kind = ds.get("kind", "Medical Segmentation Decathlon")
    return {"detected": kind + (" Task01 (MSD label ids, loaded as BraTS ids)" if task01_label_map(meta) else ""),
            "name": meta.get("name", "?"), "modality": meta.get("modality") or meta.get("channel_names", {}),
            "labels": meta.get("labels", {}), "training cases": len(ds["training"]), "test cases": len(ds["test"]),
            "shapes (first 10)": dict(shapes), "spacing mm (first 10)": dict(spacings),
            "label values (first 10)": sorted(classes),
            "label voxels (first 10)": {v: f"{c / total:.2%}" for v, c in sorted(classes.items())},
            "anomalies": anomaly_rows({**unusable, **ds["anomalies"],
                                       "labels on another grid than their image (resampled onto it by world "
                                       "position when read)": grids}),
            "unusable": {k: len(v) for k, v in unusable.items() if v}}


def _looks_brats(path: Path) -> bool:
    """Case files (``*_flair.nii*`` or ``*-t2f.nii*``) at most three folders down."""
    return path.is_dir() and any(next(path.glob(depth + pattern), None) is not None
                                 for pattern in ("*_flair.nii*", "*-t2f.nii*")
                                 for depth in ("", "*/", "*/*/", "*/*/*/"))


@inspector("brats", _looks_brats)
def inspect_brats(path: Path) -> dict[str, Any]:
    import nibabel as nib

    from fastvision.data.formats.anomalies import case_grid_problems, unreadable_files
    from fastvision.data.formats.brats_layouts import detect, scan_labels

    layout = detect(path)
    labelled = [c for c in layout.cases if c["label"] is not None]
    shapes = Counter(str(nib.load(str(c["image"][0])).shape) for c in labelled[:10])
    unusable = {NONFINITE_FILES: [b for c in labelled for b in nifti_nonfinite([*c["image"], c["label"]], path)]}
    unusable["unreadable NIfTI files (truncated or damaged)"] = unreadable_files(labelled, path)
    unusable["cases whose modality files are not one 4-channel image (headers)"] = case_grid_problems(labelled, 4, path)
    values, found = scan_labels(labelled[:10], layout, path)  # training stops at them (preprocess3d)
    unusable.update(found["unusable"])
    return {"detected": f"BraTS {layout.year} ({layout.name})", "cases": len(layout.cases),
            "labelled cases": len(labelled), "label convention": layout.convention(),
            "shapes (first 10)": dict(shapes), "label values (first 10)": sorted(int(v) for v in values),
            "anomalies": anomaly_rows({**unusable, **layout.anomalies, **found["anomalies"]}),
            "unusable": {k: len(v) for k, v in unusable.items() if v}}
