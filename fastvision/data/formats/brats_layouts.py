"""BraTS challenge folders as released, year by year: which files form a case, and what labels mean.

Accepted (any nesting under the root, ``.nii`` or ``.nii.gz``):

===============  ===============================================  ==================  =================
layout           files of case ``C``                              file labels         class ids (load)
===============  ===============================================  ==================  =================
brats2017-2021   ``C/C_{flair,t1,t1ce,t2,seg}.nii.gz``            0, 1 NCR/NET, 2 ED,  4 -> 3
                 (``BraTS19_*``, ``BraTS20_Training_001``,        4 ET
                 ``BraTS2021_00000``; 2019 nests HGG/ and LGG/)
brats2023-gli    ``C/C-{t1c,t1n,t2f,t2w,seg}.nii.gz``             0, 1 NETC, 2 SNFH,   unchanged
                 (``BraTS-GLI-00000-000``; MEN/MET/PED/SSA too)   3 ET
===============  ===============================================  ==================  =================

Either way the classes are fastvision's (1 necrotic / non-enhancing core, 2 edema, 3 enhancing),
so the nested regions WT = {1, 2, 3}, TC = {1, 3}, ET = {3} apply unchanged, and the channels are
stacked FLAIR, T1, T1ce, T2 (= t2f, t1n, t1c, t2w), the order of MSD Task01.

Known quirks handled: macOS ``._name`` companions are ignored (counted as anomalies); a case
whose segmentation has another name (BraTS 2020's ``BraTS20_Training_355`` ships
``W39_1998.09.19_Segm.nii``) uses the one other NIfTI in its folder whose name contains "seg",
recorded as an anomaly.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastvision.errors import DataError

# (layout, modality suffixes in channel order FLAIR, T1, T1ce, T2, separator, label map, file labels)
_OLD = ("flair", "t1", "t1ce", "t2")
_NEW = ("t2f", "t1n", "t1c", "t2w")
_NIFTI = re.compile(r"^(?P<case>.+?)(?P<sep>[_-])(?P<mod>flair|t1ce|t1|t2|t2f|t1n|t1c|t2w|seg)"
                    r"(?P<ext>\.nii(?:\.gz)?)$", re.IGNORECASE)


@dataclass
class Layout:
    """What a BraTS folder turned out to be."""

    name: str  # "brats2017-2021" or "brats2023-gli"
    year: str  # "2019", "2020", "2021", "2017-2021" or "2023-2024"
    label_map: tuple[tuple[int, int], ...]  # file label -> class id
    file_labels: str  # the release's own label ids, for the report
    cases: list[dict[str, Any]] = field(default_factory=list)
    anomalies: dict[str, list[str]] = field(default_factory=dict)

    def convention(self) -> dict[str, Any]:
        """The facts recorded in the dataset ``info`` (and printed by ``data inspect``)."""
        return {"layout": self.name, "year": self.year, "file_labels": self.file_labels,
                "label_map": {str(a): b for a, b in self.label_map} or "none (ids already 0..3)"}


def _is_companion(p: Path) -> bool:
    """macOS AppleDouble files (``._name``) that archives made on a Mac carry beside every file."""
    return p.name.startswith("._")


def detect(root: str | Path) -> Layout:
    """Find every case under ``root`` and name the release's layout.

    Raises:
        DataError: ``root`` missing, no case found, both naming schemes mixed, or a case lacks a
            modality (naming the folder and the file).
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"BraTS folder {root} does not exist")
    anomalies: dict[str, list[str]] = defaultdict(list)
    groups: dict[tuple[Path, str], dict[str, Path]] = defaultdict(dict)
    schemes: dict[str, str] = {}
    for p in sorted(root.rglob("*.nii*")):
        if _is_companion(p):
            anomalies["macOS ._ companion files (ignored)"].append(str(p.relative_to(root)))
            continue
        m = _NIFTI.match(p.name)
        if not m:
            continue
        mod = m["mod"].lower()
        scheme = "new" if m["sep"] == "-" else "old"
        if mod != "seg" and (mod in _NEW) != (scheme == "new"):
            continue  # e.g. "x_t2f.nii": not a BraTS name
        groups[(p.parent, m["case"])][mod] = p
        schemes[m["case"]] = scheme
    kinds = set(schemes.values())
    if not groups or not kinds:
        hint = "; it holds a dataset.json: use data.name=decathlon" if (root / "dataset.json").is_file() else ""
        raise DataError(f"no BraTS cases under {root} (expected CASE/CASE_flair.nii.gz or "
                        f"CASE/CASE-t2f.nii.gz with the other modalities beside it){hint}")
    if len(kinds) > 1:
        old = next(c for c, s in schemes.items() if s == "old")
        new = next(c for c, s in schemes.items() if s == "new")
        raise DataError(f"{root}: mixes BraTS naming schemes ({old}_flair and {new}-t2f); one release per folder")
    new = kinds == {"new"}
    mods = _NEW if new else _OLD
    cases = []
    for (folder, case), files in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        if not any(m in files for m in mods):
            continue  # a lone seg file: not a case
        for m in mods:
            if m not in files:
                sep, ext = "-" if new else "_", ".nii" if all(p.suffix == ".nii" for p in files.values()) else ".nii.gz"
                raise DataError(f"BraTS case {folder} lacks {case}{sep}{m}{ext}")
        label = files.get("seg") or _odd_segmentation(folder, set(files.values()))
        if label is not None and "seg" not in files:
            anomalies["segmentation under another name (used)"].append(str(label.relative_to(root)))
        if label is None:
            anomalies["cases without a segmentation"].append(case)
        cases.append({"id": case, "image": [files[m] for m in mods], "label": label})
    if new:
        layout = Layout("brats2023-gli", "2023-2024", (), "0 background, 1 NETC, 2 SNFH, 3 ET")
    else:
        layout = Layout("brats2017-2021", _year(cases[0]["id"]), ((4, 3),), "0 background, 1 NCR/NET, 2 ED, 4 ET")
    layout.cases, layout.anomalies = cases, dict(anomalies)
    return layout


def case_files(path: Path) -> tuple[str, list[Path]] | None:
    """A file named as a BraTS modality or segmentation (either release's scheme): its case id and the
    case's four modality files beside it, in channel order (FLAIR, T1, T1ce, T2 = t2f, t1n, t1c, t2w),
    whether they exist or not; None for any other name (``x_t2f.nii.gz`` included, as :func:`detect`)."""
    m = _NIFTI.match(Path(path).name)
    if not m:
        return None
    mods = _NEW if m["sep"] == "-" else _OLD
    if m["mod"].lower() != "seg" and m["mod"].lower() not in mods:
        return None
    return m["case"], [Path(path).parent / f"{m['case']}{m['sep']}{x}{m['ext']}" for x in mods]


def _odd_segmentation(folder: Path, used: set[Path]) -> Path | None:
    """The single other NIfTI in ``folder`` whose name says "seg" (case-insensitive), else None."""
    others = [p for p in folder.iterdir() if p.name.lower().endswith((".nii", ".nii.gz"))
              and p not in used and not _is_companion(p) and "seg" in p.name.lower()]
    return others[0] if len(others) == 1 else None


def _year(case: str) -> str:
    for prefix, year in (("BraTS2021_", "2021"), ("BraTS20_", "2020"), ("BraTS19_", "2019"), ("BraTS18_", "2018")):
        if case.startswith(prefix):
            return year
    return "2017-2021"


def scan_labels(cases: list[dict[str, Any]], layout: Layout, root: Path) -> tuple[set[int], dict[str, dict]]:
    """The label values of ``cases``' files (as stored) and what ``data inspect`` reports of them:
    ``{"unusable": {kind: [files]}, "anomalies": {kind: [files]}}``. Unusable (training stops at them):
    values that are not whole numbers (:func:`~fastvision.data.preprocess3d.whole_labels`), values past the
    classes 0..3 after the release's map. An anomaly: a 2017-2021 file holding 3, which that release does
    not use (ET is 4); it trains as ET and ``predict`` writes ET as 4."""
    import nibabel as nib
    import numpy as np

    from fastvision.data.preprocess3d import whole_labels

    values: set[int] = set()
    fractions, past, threes = [], [], []
    for case in cases:
        name = str(Path(case["label"]).relative_to(root))
        try:
            found = set(np.unique(whole_labels(np.asarray(nib.load(str(case["label"])).dataobj), name)).tolist())
        except DataError:
            fractions.append(name)
            continue
        except Exception:  # noqa: BLE001  (a truncated or damaged file: listed as unreadable)
            continue
        values |= found
        if max(dict(layout.label_map).get(v, v) for v in found) > 3:
            past.append(name)
        if layout.label_map and 3 in found:
            threes.append(name)
    return values, {
        "unusable": {"label files of values that are not whole numbers, first 10 (interpolated?)": fractions,
                     "label values past the classes 0..3, first 10 (BraTS 2024's cavity 4? remap it)": past},
        "anomalies": {"label files holding 3, first 10 (this release's ET is 4; 3 trains as ET, predict "
                      "writes ET as 4)": threes}}
