"""Slide heat maps: a whole slide's tumour probabilities patch by patch (what ``fastvision predict`` writes
for a pathology run), their TIFF / PNG files with the grid step recorded, and reading that step back
(``fastvision froc``)."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import tifffile
import torch
from PIL import Image

from fastvision.data.formats.pathology import TiledTiff
from fastvision.errors import DataError


def slide_heatmap(slide_path: str | Path, predict, patch_size: int, stride: int | None = None,
                  batch_size: int = 64, level: int = 0) -> np.ndarray:
    """Tumour probability map of a whole slide, patch by patch.

    Args:
        slide_path: tiled RGB TIFF.
        predict: callable mapping uint8 patches ``(B, 3, P, P)`` to tumour probabilities ``(B,)``.
        patch_size: P.
        stride: grid step in pixels (default P); heat-map pixel (i, j) covers the patch at
            ``(i * stride, j * stride)``.
        batch_size: patches per ``predict`` call.
        level: the pyramid level the patches are read at (the level the model trained at,
            ``data.args.level``); P, the stride, H and W are in pixels of that level.

    Returns:
        float32 ``(H // stride, W // stride)`` probabilities (only full patches are scored).
    """
    stride = stride or patch_size
    slide = TiledTiff(slide_path, level)
    h, w = slide.shape[:2]
    ny, nx = (h - patch_size) // stride + 1, (w - patch_size) // stride + 1
    heat = np.zeros((h // stride, w // stride), np.float32)
    coords = [(i, j) for i in range(ny) for j in range(nx)]
    for k in range(0, len(coords), batch_size):
        chunk = coords[k:k + batch_size]
        arr = np.stack([slide.read_region(i * stride, j * stride, patch_size, patch_size)[..., :3] for i, j in chunk])
        probs = predict(torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous())
        probs = probs.detach().float().cpu().numpy()  # one transfer per batch, not per patch
        for (i, j), pr in zip(chunk, probs, strict=True):
            heat[i, j] = pr
    slide.close()
    return heat


def check_slides(slides: list[Path], patch_size: int, level: int = 0) -> dict[Path, float]:
    """Before any heat map is written: every slide opens (its TIFF header) at ``level`` and holds
    one patch there. Returns each slide's level-0 pixels per pixel of ``level``.

    Raises:
        DataError: naming the first slide that does not open, has no such level, or whose side
            at that level is below ``patch_size`` (its heat map would have no cell).
    """
    downsample = {}
    for path in slides:
        slide = TiledTiff(path, level)
        (h, w), downsample[path] = slide.shape[:2], slide.downsample
        slide.close()
        if h < patch_size or w < patch_size:
            raise DataError(f"{path}: {h} x {w} px at level {level}, smaller than the heat map's patch of "
                            f"{patch_size} px (task.args.heatmap_patch): no patch to score")
    return downsample


HEATMAP_KEY = "fastvision_heatmap"  # TIFF ImageDescription / PNG text: {"stride": slide px per cell, "patch": px}


def write_heatmap(heat: np.ndarray, out_stem: str | Path, stride: int | None = None,
                  patch: int | None = None) -> tuple[Path, Path]:
    """Write ``OUT.tif`` (float32 probabilities) and ``OUT.png`` (8-bit, 255 = probability 1).

    ``stride`` (slide pixels per heat-map pixel) and ``patch`` (the side of the patch a cell scored)
    are recorded in both files (:data:`HEATMAP_KEY`), so ``froc`` places each cell right: on a slide
    whose side is not a multiple of the stride (the last partial patch is not predicted: mask height
    // heat-map height is then not the stride), and at its patch's centre when patches overlap.
    """
    import json

    from PIL.PngImagePlugin import PngInfo

    out_stem = Path(out_stem)
    out_stem.parent.mkdir(parents=True, exist_ok=True)
    from fastvision.utils.files import atomic_write

    record = {"stride": int(stride)} if stride else {}
    record.update({"patch": int(patch)} if patch else {})
    meta = json.dumps({HEATMAP_KEY: record}) if record else None
    tif, png = out_stem.with_suffix(".tif"), out_stem.with_suffix(".png")  # atomic: never half-written
    buf = io.BytesIO()  # tifffile reads the name of a file it is given: an open temp file's is its descriptor
    tifffile.imwrite(buf, heat.astype(np.float32), photometric="minisblack", description=meta, metadata=None)
    atomic_write(tif, lambda f: f.write(buf.getvalue()))
    picture = Image.fromarray(np.clip(np.rint(heat * 255), 0, 255).astype(np.uint8))
    info = PngInfo()
    if meta:
        info.add_text(HEATMAP_KEY, meta)
    atomic_write(png, lambda f: picture.save(f, format="PNG", pnginfo=info))
    return tif, png


def heatmap_stride(path: str | Path) -> int | None:
    """The stride :func:`write_heatmap` recorded in ``path`` (TIFF or PNG), or None (another tool's file)."""
    return heatmap_record(path).get("stride")


def heatmap_patch(path: str | Path) -> int | None:
    """The patch side :func:`write_heatmap` recorded in ``path``, or None (another tool's file, or an older one)."""
    return heatmap_record(path).get("patch")


def heatmap_record(path: str | Path) -> dict[str, int]:
    """What :func:`write_heatmap` recorded in ``path`` (``stride``, ``patch``), or ``{}``."""
    import json

    path = Path(path)
    try:
        if path.suffix.lower() in (".tif", ".tiff"):
            with tifffile.TiffFile(path) as t:
                text = t.pages[0].description
        else:
            with Image.open(path) as im:
                text = im.text.get(HEATMAP_KEY, "")
        record = json.loads(text)[HEATMAP_KEY]
        return {k: int(record[k]) for k in ("stride", "patch") if k in record}
    except Exception:  # noqa: BLE001  (no such record: the caller's default applies)
        return {}
