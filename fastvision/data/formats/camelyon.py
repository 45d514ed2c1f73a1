"""Which slides a pathology split holds, and where each one's lesions are drawn.

Accepted per split folder (``PATH/<split>/``):

* ``images/NAME.tif`` + ``masks/NAME.tif`` (tiled uint8 masks, non-zero = lesion);
* ``images/NAME.tif`` + ``annotations/NAME.xml`` (ASAP polygons, see :mod:`.asap`);
* Camelyon16 as released: ``tumor/tumor_NNN.tif`` and ``normal/normal_NNN.tif`` with
  ``lesion_annotations/tumor_NNN.xml`` (training), or ``images/test_NNN.tif`` with
  ``lesion_annotations/test_NNN.xml`` for the test slides that have lesions.

A slide with neither mask nor annotation is normal, except in Camelyon16's ``tumor/`` folder,
where a missing annotation is an anomaly (the slide is skipped, not taken as normal).
"""
from __future__ import annotations

from pathlib import Path

SLIDE_SUFFIXES = (".tif", ".tiff")


def is_slide_split(split_dir: Path) -> bool:
    """True for the slide layouts (as opposed to ``normal/`` + ``tumor/`` folders of patch images)."""
    return (split_dir / "images").is_dir() or (split_dir / "lesion_annotations").is_dir()


def _slides(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*") if p.suffix.lower() in SLIDE_SUFFIXES
                  and not p.name.startswith(".")) if folder.is_dir() else []


def find_slides(split_dir: Path) -> tuple[list[tuple[Path, Path | None]], dict[str, list[str]]]:
    """``[(slide, lesion mask .tif or ASAP .xml or None)]`` and ``{anomaly kind: [slide names]}``."""
    anomalies: dict[str, list[str]] = {}
    camelyon = (split_dir / "lesion_annotations").is_dir()
    slides = _slides(split_dir / "images") + _slides(split_dir / "tumor") + _slides(split_dir / "normal")
    out = []
    for slide in slides:
        stem = slide.stem
        source = next((p for p in (split_dir / "masks" / slide.name, split_dir / "masks" / f"{stem}.tiff",
                                   split_dir / "annotations" / f"{stem}.xml",
                                   split_dir / "lesion_annotations" / f"{stem}.xml") if p.is_file()), None)
        if source is None and camelyon and slide.parent.name == "tumor":
            anomalies.setdefault("tumour slides without lesion annotations (skipped)", []).append(slide.name)
            continue
        out.append((slide, source))
    companions = [p.name for d in ("images", "tumor", "normal", "lesion_annotations")
                  for p in sorted((split_dir / d).glob("._*"))] if split_dir.is_dir() else []
    if companions:
        anomalies["macOS ._ companion files (ignored)"] = companions
    return out, anomalies
