"""Camelyon16 lesion annotations: ASAP XML polygons, rasterised at the resolution a grid needs.

An ASAP file (``lesion_annotations/tumor_001.xml``) lists polygons in level-0 pixel coordinates::

    <ASAP_Annotations><Annotations>
      <Annotation Name="_0" Type="Polygon" PartOfGroup="_0" Color="#F4FA58">
        <Coordinates><Coordinate Order="0" X="67866.7031" Y="110640.406" /> ...</Coordinates>
      </Annotation> ...
    </Annotations><AnnotationGroups><Group Name="_0" PartOfGroup="None" .../> ...</AnnotationGroups>
    </ASAP_Annotations>

Camelyon16 puts lesions in groups ``_0`` and ``_1`` (and ``Tumor`` in some files) and regions to
cut out of them in ``_2`` (also any group named "Exclusion"). A whole-slide mask is never built at
level 0: :func:`rasterize` fills a mask at ``downsample`` (a 200k x 100k slide at 32 is 6k x 3k),
testing each mask pixel's centre against the polygons, so the mask is exact at that scale.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

from fastvision.errors import DataError

EXCLUSION_GROUPS = ("_2", "exclusion")


def read_polygons(path: str | Path) -> list[tuple[str, np.ndarray]]:
    """``[(group, (N, 2) float64 x, y level-0 pixels)]`` of every polygon in an ASAP XML file.

    Raises:
        DataError: not parseable XML, or a coordinate that is not a number (naming the file).
    """
    path = Path(path)
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        raise DataError(f"{path}: not a readable ASAP XML file ({e})") from e
    out = []
    for ann in root.iter("Annotation"):
        coords = sorted(ann.iter("Coordinate"), key=lambda c: int(float(c.get("Order", 0))))
        if ann.get("Type", "Polygon") not in ("Polygon", "Spline", "Rectangle") or len(coords) < 3:
            continue  # dots and lines carry no area
        try:
            xy = np.array([[_number(c.get("X")), _number(c.get("Y"))] for c in coords], dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise DataError(f"{path}: annotation {ann.get('Name')!r} has a non-numeric coordinate ({e})") from e
        out.append((str(ann.get("PartOfGroup", "")), xy))
    return out


def _number(text: str | None) -> float:
    """ASAP writes ``1.5e+004`` and, from some locales, ``1234,5``."""
    if text is None:
        raise ValueError("missing X or Y")
    try:
        return float(text)
    except ValueError:
        return float(text.replace(",", "."))


def is_exclusion(group: str) -> bool:
    return group.lower() in EXCLUSION_GROUPS


def rasterize(polygons: list[tuple[str, np.ndarray]], height: int, width: int, downsample: float) -> np.ndarray:
    """Lesion mask ``(ceil(height / d), ceil(width / d))`` bool at downsample ``d`` of level 0.

    Mask pixel (i, j) is lesion when its centre ``((j + 0.5) d, (i + 0.5) d)`` lies inside a
    lesion polygon and outside every exclusion polygon.

    Args:
        polygons: from :func:`read_polygons` (level-0 pixel coordinates).
        height, width: level-0 size of the slide.
        downsample: level-0 pixels per mask pixel.
    """
    from matplotlib.path import Path as MplPath

    shape = (int(np.ceil(height / downsample)), int(np.ceil(width / downsample)))
    mask = np.zeros(shape, bool)
    # lesions first, then exclusions cut out, whatever their order in the file
    for exclude in (False, True):
        for group, xy in polygons:
            if is_exclusion(group) != exclude:
                continue
            scaled = xy / downsample - 0.5  # in mask pixel-centre units
            x0, y0 = np.floor(scaled.min(0)).astype(int)
            x1, y1 = np.ceil(scaled.max(0)).astype(int)
            x0, y0, x1, y1 = max(x0, 0), max(y0, 0), min(x1 + 1, shape[1]), min(y1 + 1, shape[0])
            if x0 >= x1 or y0 >= y1:
                continue
            yy, xx = np.mgrid[y0:y1, x0:x1]
            inside = MplPath(scaled).contains_points(np.stack([xx.ravel(), yy.ravel()], 1)).reshape(yy.shape)
            mask[y0:y1, x0:x1] = (mask[y0:y1, x0:x1] & ~inside) if exclude else (mask[y0:y1, x0:x1] | inside)
    return mask


def grid_labels_from_mask(mask: np.ndarray, mask_downsample: int, height: int, width: int,
                          patch: int) -> list[tuple[int, int, int]]:
    """:func:`~fastvision.data.formats.pathology.grid_labels` from a low-resolution mask.

    Args:
        mask: (Hm, Wm) bool lesion mask, one pixel per ``mask_downsample`` grid pixels.
        height, width: grid-level size; patch: patch side in grid pixels (a multiple of
            ``mask_downsample``, at least 4 of its pixels).

    Returns:
        ``(y, x, label)``: tumour (1) when at least half the patch's central region is lesion,
        normal (0) when the patch has no lesion pixel, ambiguous patches left out.
    """
    d = mask_downsample
    p, q = patch // d, (patch // 4) // d
    out = []
    for y in range(0, height - patch + 1, patch):
        for x in range(0, width - patch + 1, patch):
            cell = mask[y // d:y // d + p, x // d:x // d + p]
            if cell[q:p - q, q:p - q].mean() >= 0.5:
                out.append((y, x, 1))
            elif not cell.any():
                out.append((y, x, 0))
    return out


def mask_downsample_for(patch: int) -> int:
    """The coarsest power-of-two mask scale dividing ``patch // 4`` (so a patch spans >= 4 x 4 mask
    pixels and its central half is whole mask pixels: the labels equal a level-0 mask's at centres)."""
    d = 1  # d divides patch // 4, so the central region (patch // 4 margins) is whole mask pixels
    while patch // 4 > 0 and (patch // 4) % (d * 2) == 0:
        d *= 2
    return d
