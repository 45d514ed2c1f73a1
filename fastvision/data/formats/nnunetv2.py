"""nnU-Net v2's raw dataset layout, read as the Decathlon reader's cases (and written from an MSD folder).

``DatasetNNN_Name/dataset.json`` names ``channel_names`` (``{"0": "T2", "1": "ADC"}``), ``labels``
(``{"background": 0, "PZ": 1}``, or region lists), ``numTraining`` and ``file_ending`` and has no
``training`` list: the cases are the files. Each channel is a file of its own,
``imagesTr/{case}_{channel:04d}{file_ending}``; the label is ``labelsTr/{case}{file_ending}``; test images
lie in ``imagesTs`` named as the training images (nnU-Net's ``dataset_format.md``). A ``dataset`` entry
(``{case: {"images": [paths], "label": path}}``, paths relative to the folder) lists the files instead.

Refused with one line naming the file, as nnU-Net's ``verify_dataset_integrity`` refuses them: an image not
named ``{case}_XXXX``, a channel past ``channel_names``, a missing channel file or label, a
``file_ending`` that is not NIfTI (fastvision reads ``.nii.gz`` and ``.nii``). Labels without images and a
``numTraining`` that is not the count found are anomalies (logged, listed by ``data inspect``).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from fastvision.data.formats.dataset_labels import parse_labels
from fastvision.errors import DataError

ENDINGS = (".nii.gz", ".nii")  # the file endings fastvision reads (nibabel's NIfTI)
_CHANNEL = re.compile(r"(.+)_(\d{4})")
UNUSABLE = "images not usable as nnU-Net v2 channel files"
ABSENT = "channel or label files that do not exist"


def channel_of(name: str, ending: str) -> tuple[str, int] | None:
    """``(case, channel)`` of a file named as nnU-Net v2's channel files, ``{case}_{XXXX}{ending}``, else None."""
    m = _CHANNEL.fullmatch(name[: -len(ending)]) if name.endswith(ending) else None
    return (m.group(1), int(m.group(2))) if m else None


def folder_hint(root: Path) -> str:
    """``root`` lacks dataset.json: the folder the user likely meant, as a hint (nnU-Net's ``nnUNet_raw`` with
    ``DatasetNNN_Name`` folders in it, or a dataset's ``imagesTr``), else ``""``."""
    if root.name in ("imagesTr", "labelsTr", "imagesTs") and (root.parent / "dataset.json").is_file():
        return f"; it is a dataset's {root.name}: --data {root.parent}"
    inner = sorted(p.parent.name for p in root.glob("*/dataset.json")) if root.is_dir() else []
    return f"; it holds {len(inner)} dataset folder(s), e.g. {inner[0]}: --data {root / inner[0]}" if inner else ""


def is_v2(meta: Any) -> bool:
    """A dataset.json without MSD's ``training`` list: nnU-Net v2's (checked further by :func:`read_raw`)."""
    return isinstance(meta, dict) and "training" not in meta


def file_ending(meta: dict[str, Any], f: Path) -> str:
    """dataset.json's ``file_ending``, one that fastvision reads, else one line naming the file and key."""
    ending = meta.get("file_ending")
    if ending is None:
        raise DataError(f"{f}: neither a Decathlon dataset.json (no 'training' list) nor nnU-Net v2's "
                        "(no 'file_ending'; v2 also names 'channel_names', 'labels', 'numTraining')")
    if ending not in ENDINGS:
        raise DataError(f"{f}: file_ending {ending!r}: fastvision reads NIfTI only ('.nii.gz' or '.nii'); "
                        "convert the images and labels to NIfTI")
    return ending


def channel_names(meta: dict[str, Any], f: Path) -> list[str]:
    """``channel_names`` in channel order; its keys must be ``"0"`` .. ``"n-1"``."""
    names = meta.get("channel_names")
    if not isinstance(names, dict) or not names:
        raise DataError(f"{f}: channel_names must map channel numbers to names, e.g. {{\"0\": \"CT\"}}, "
                        f"got {names!r}")
    if sorted(str(k) for k in names) != sorted(str(i) for i in range(len(names))):
        raise DataError(f"{f}: channel_names keys must be 0..{len(names) - 1}, got {', '.join(map(str, names))}")
    return [str(names[k]) for k in sorted(names, key=int)]


def group_channels(folder: Path, ending: str, names: list[str], root: Path,
                   problems: list[str] | None) -> dict[str, list[Path]]:
    """``{case: [channel files in channel order]}`` of a folder of ``{case}_{XXXX}{ending}`` files.

    A file not so named, a channel past ``names`` or a case lacking a channel is a DataError naming the
    file, or with a ``problems`` list, appended there (its case left out).
    """
    found: dict[str, dict[int, Path]] = {}
    bad: set[str] = set()

    def refuse(case: str | None, p: Path, why: str) -> None:
        if problems is None:  # the error names the whole path, data inspect's list the folder's
            raise DataError(f"{p}: {why}")
        problems.append(f"{p.relative_to(root)} ({why.split(' (')[0]})")
        bad.add(case or "")

    files = sorted(p for p in folder.iterdir() if p.name.endswith(ending) and not p.name.startswith("."))
    for p in files:
        named = channel_of(p.name, ending)
        if named is None:
            refuse(None, p, f"not named {{case}}_XXXX{ending} (nnU-Net v2: the channel's 4-digit number after "
                            "the case id)")
            continue
        case, channel = named
        if channel >= len(names):
            refuse(case, p, f"channel {channel}, but dataset.json's channel_names has {len(names)} "
                            f"({', '.join(f'{i:04d} {n}' for i, n in enumerate(names))})")
        found.setdefault(case, {})[channel] = p
    for case, channels in found.items():
        for c in range(len(names)):
            if c not in channels and case not in bad:
                refuse(case, folder / f"{case}_{c:04d}{ending}", f"does not exist (channel {c}, {names[c]}, "
                                                                   f"of case {case})")
    return {case: [ch[c] for c in sorted(ch)] for case, ch in sorted(found.items()) if case not in bad}


def _listed(root: Path, meta: dict[str, Any], f: Path) -> list[dict[str, Any]]:
    """The cases of v2's optional ``dataset`` entry (paths relative to ``root`` or absolute)."""
    try:
        return [{"id": str(case), "image": [root / p for p in e["images"]], "label": root / e["label"]}
                for case, e in meta["dataset"].items()]
    except (KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{f}: dataset must map case ids to {{\"images\": [paths], \"label\": path}} ({e})") from e


def read_raw(root: Path, meta: dict[str, Any], missing: list[str] | None = None) -> dict[str, Any]:
    """An nnU-Net v2 raw folder as :func:`~fastvision.data.formats.decathlon.read_dataset_json` returns a
    Decathlon one: ``{"meta", "training": [{"id", "image": [path per channel], "label"}], "test": [path of
    each test case's first channel], "test_cases": [[paths]], "anomalies", "unusable"}``.

    With ``missing`` (``data inspect``), missing files and bad images are listed in ``unusable``, their cases
    left out; otherwise each is a DataError naming the file.
    """
    f = root / "dataset.json"
    ending, names = file_ending(meta, f), channel_names(meta, f)
    values = sorted(parse_labels(meta, root)[0])  # before any file: v2's ignore label, a value not an integer
    if values != list(range(len(values))):  # the values are the class indices (nnU-Net refuses gaps too)
        raise DataError(f"{f}: labels {', '.join(map(str, values))} are not consecutive from 0 (nnU-Net v2: 0, 1, 2, "
                        "...); renumber the label files and dataset.json's labels")
    problems: list[str] | None = None if missing is None else []
    if "dataset" in meta:
        training = _listed(root, meta, f)
    else:
        if not (root / "imagesTr").is_dir():
            raise DataError(f"{root / 'imagesTr'}: not found (an nnU-Net v2 folder holds dataset.json, imagesTr/, "
                            "labelsTr/)")
        groups = group_channels(root / "imagesTr", ending, names, root, problems)
        training = [{"id": c, "image": files, "label": root / "labelsTr" / f"{c}{ending}"}
                    for c, files in groups.items()]
    absent = [p for c in training for p in [*c["image"], c["label"]] if not p.is_file()]
    if absent and missing is None:
        raise DataError(f"{absent[0]}: does not exist (nnU-Net v2's layout: images imagesTr/{{case}}_XXXX{ending}, "
                        f"labels labelsTr/{{case}}{ending})")
    training = [c for c in training if not any(p in absent for p in [*c["image"], c["label"]])]
    tests = group_channels(root / "imagesTs", ending, names, root, []) if (root / "imagesTs").is_dir() else {}
    return {"meta": meta, "training": training, "test": [files[0] for files in tests.values()],
            "test_cases": list(tests.values()), "anomalies": _anomalies(root, meta, training, ending),
            "unusable": {UNUSABLE: problems or [], ABSENT: [_shown(p, root) for p in absent]}, "layout": "nnunetv2",
            "kind": "nnU-Net v2 raw layout"}


def _shown(p: Path, root: Path) -> str:
    return str(p.relative_to(root)) if p.is_relative_to(root) else str(p)


def _anomalies(root: Path, meta: dict[str, Any], training: list[dict[str, Any]], ending: str) -> dict[str, list[str]]:
    have = {c["label"].resolve() for c in training}
    # a refused case's label has images: not "without images"
    cases = {named[0] for p in ((root / "imagesTr").iterdir() if (root / "imagesTr").is_dir() else [])
             if (named := channel_of(p.name, ending))}
    labels = sorted((root / "labelsTr").glob(f"*{ending}")) if (root / "labelsTr").is_dir() else []
    out = {"labels without images (ignored)": [f"labelsTr/{p.name}" for p in labels if not p.name.startswith(".")
                                               and p.resolve() not in have and p.name[: -len(ending)] not in cases],
           "macOS ._ companion files (ignored)": [f"{d}/{p.name}" for d in ("imagesTr", "labelsTr", "imagesTs")
                                                  for p in sorted((root / d).glob("._*")) if (root / d).is_dir()],
           # a .nii among .nii.gz files (or the reverse): nnU-Net reads only file_ending's, so does this reader
           f"NIfTI files not ending in file_ending {ending} (ignored)": [
               f"{d}/{p.name}" for d in ("imagesTr", "labelsTr", "imagesTs") if (root / d).is_dir()
               for p in sorted((root / d).iterdir()) if p.name.endswith(ENDINGS) and not p.name.endswith(ending)
               and not p.name.startswith(".")]}
    stated = meta.get("numTraining")
    if stated is not None and stated != len(training):  # nnU-Net's verify_dataset_integrity refuses this
        out[f"dataset.json's numTraining is {stated}; cases found"] = [str(len(training))]
    return {k: v for k, v in out.items() if v}


def from_msd(src: Path, out: Path, ending: str = ".nii.gz") -> Path:
    """Write the Decathlon folder ``src`` as an nnU-Net v2 raw folder ``out``, as ``nnUNetv2_convert_MSD_dataset``
    does: 4-D images split into one file per channel (``{case}_{c:04d}``; 3-D ones become ``_0000``), labels
    copied, dataset.json with ``labels`` as ``{name: value}``, ``channel_names`` for ``modality``,
    ``file_ending`` and no ``training``/``test`` lists. The label ids are the MSD ones (nnU-Net's converter
    keeps them)."""
    import nibabel as nib
    import numpy as np

    meta = json.loads((src / "dataset.json").read_text())
    for sub, entries in (("imagesTr", [e["image"] for e in meta["training"]]),
                         ("imagesTs", [e["image"] if isinstance(e, dict) else e for e in meta.get("test", [])])):
        for rel in entries:
            img = nib.load(str(src / rel))
            data = np.asanyarray(img.dataobj)
            case = Path(rel).name[: -len(".nii.gz")] if rel.endswith(".nii.gz") else Path(rel).stem
            stack = [data] if data.ndim == 3 else [data[..., c] for c in range(data.shape[3])]
            for c, volume in enumerate(stack):
                header = img.header.copy()
                header.set_data_shape(volume.shape)
                header.set_slope_inter(None, None)  # dataobj is scaled already
                (out / sub).mkdir(parents=True, exist_ok=True)
                target = out / sub / f"{case}_{c:04d}{ending}"
                nib.save(nib.Nifti1Image(np.ascontiguousarray(volume), img.affine, header), str(target))
    for e in meta["training"]:
        case = Path(e["label"]).name.split(".nii")[0]
        (out / "labelsTr").mkdir(parents=True, exist_ok=True)
        if ending == ".nii.gz" and e["label"].endswith(".nii.gz"):
            shutil.copyfile(src / e["label"], out / "labelsTr" / f"{case}{ending}")
        else:
            nib.save(nib.load(str(src / e["label"])), str(out / "labelsTr" / f"{case}{ending}"))
    v2 = {k: v for k, v in meta.items() if k not in ("training", "test", "modality", "labels", "numTest")}
    v2.update(channel_names=meta["modality"], labels={str(n): int(v) for v, n in meta["labels"].items()},
              numTraining=len(meta["training"]), file_ending=ending)
    (out / "dataset.json").write_text(json.dumps(v2, indent=2))
    return out
