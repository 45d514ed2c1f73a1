"""FROC for lesion detection on whole slides, with the Camelyon16 challenge definitions.

Pipeline per slide: a tumour probability heat map -> detections as local maxima (greedy NMS:
take the highest pixel, suppress a square around it, repeat while above a threshold) ->
an evaluation mask (lesions grown by ``dilation_px`` and labelled with 8-connectivity; lesions
whose major axis is shorter than ``itc_max_px`` are "isolated tumour cells", neither counted nor
penalised) -> per lesion the highest detection probability inside it, and the probabilities of
detections outside every lesion (false positives). Over all slides, for each threshold
``t``: sensitivity = lesions with a detection >= t / all lesions, FP rate = FPs >= t / slides.
The FROC score is the mean sensitivity at 1/4, 1/2, 1, 2, 4 and 8 FPs per slide, linearly
interpolated. The curve follows the challenge's ``Evaluation_FROC.py`` including its quirk of
skipping the lowest probability as a threshold (MONAI's ``compute_froc_curve_data`` does the same),
so scores are comparable with published ones.

Camelyon16 used ``dilation_px = 75 um / (0.243 um * 2**level * 2)`` and ``itc_max_px = 275 um /
(0.243 um * 2**level)`` at mask level ``level``; hole filling of the dilated mask is not done here.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fastvision.errors import DataError

log = logging.getLogger(__name__)

EVAL_FP_RATES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


def label_components(mask: np.ndarray) -> np.ndarray:
    """8-connected component labels of a boolean (H, W) mask: int32, 0 = background, 1..n.

    Labels propagate as the minimum pixel id over 3x3 neighbourhoods with pointer jumping, so
    the loop runs about log(component diameter) times rather than once per pixel.
    """
    mask = np.asarray(mask, bool)
    h, w = mask.shape
    big = h * w + 1
    lab = np.where(mask, np.arange(1, h * w + 1).reshape(h, w), 0)
    while True:
        padded = np.pad(np.where(mask, lab, big), 1, constant_values=big)
        nb = np.min([padded[dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3)], axis=0)
        new = np.where(mask, nb, 0)
        flat = new.ravel()
        new = np.where(mask, flat[np.maximum(new, 1) - 1], 0)  # jump to the label's own label
        if np.array_equal(new, lab):
            break
        lab = new
    out = np.zeros((h, w), np.int32)
    out[mask] = np.searchsorted(np.unique(lab[mask]), lab[mask]) + 1  # consecutive 1..n
    return out


def dilate(mask: np.ndarray, radius: float) -> np.ndarray:
    """Pixels at Euclidean distance < ``radius`` from a true pixel of ``mask`` (Camelyon16 rule)."""
    mask = np.asarray(mask, bool)
    if radius <= 1:
        return mask.copy()
    r = int(np.ceil(radius))
    h, w = mask.shape
    padded = np.pad(mask, r)
    out = np.zeros_like(mask)
    for dy in range(-r, r + 1):
        for dx in range(-r, r + 1):
            if dy * dy + dx * dx < radius * radius:
                out |= padded[r + dy:r + dy + h, r + dx:r + dx + w]
    return out


def major_axis_length(labels: np.ndarray, n: int) -> np.ndarray:
    """Per-label major axis length (px) of the ellipse with the same second moments: 4 sqrt(l_max).

    Same definition as scikit-image's ``regionprops().major_axis_length``.
    """
    out = np.zeros(n)
    ys, xs = np.nonzero(labels)
    ids = labels[ys, xs]
    for k in range(1, n + 1):
        sel = ids == k
        pts = np.stack([ys[sel], xs[sel]]).astype(np.float64)
        cov = np.cov(pts, bias=True) if pts.shape[1] > 1 else np.zeros((2, 2))
        out[k - 1] = 4 * np.sqrt(max(np.linalg.eigvalsh(cov).max(), 0.0))
    return out


def evaluation_mask(lesion_mask: np.ndarray, dilation_px: float = 0.0,
                    itc_max_px: float = 0.0) -> tuple[np.ndarray, set[int]]:
    """Labelled lesions for scoring.

    Args:
        lesion_mask: (H, W) array, non-zero = tumour.
        dilation_px: grow lesions by this Euclidean distance before labelling (merges close ones).
        itc_max_px: lesions with a major axis below this are isolated tumour cells (ITC).

    Returns:
        ``(labels, itc)``: int32 (H, W) lesion labels 1..n and the set of ITC labels.
    """
    labels = label_components(dilate(np.asarray(lesion_mask) > 0, dilation_px))
    n = int(labels.max())
    itc = set()
    if itc_max_px > 0 and n:
        itc = {k + 1 for k, length in enumerate(major_axis_length(labels, n)) if length < itc_max_px}
    return labels, itc


def local_maxima(heat: np.ndarray, threshold: float = 0.5, radius: int = 1) -> list[tuple[float, int, int]]:
    """Detections ``(probability, y, x)`` by greedy NMS on a (h, w) heat map.

    Args:
        heat: probabilities.
        threshold: stop when the highest remaining value is below this.
        radius: half-side of the square suppressed around each detection (heat-map pixels).
    """
    heat = np.array(heat, dtype=np.float64)
    out = []
    while heat.size:
        i = int(heat.argmax())
        y, x = divmod(i, heat.shape[1])
        p = heat[y, x]
        if p < threshold:
            break
        out.append((float(p), y, x))
        heat[max(y - radius, 0):y + radius + 1, max(x - radius, 0):x + radius + 1] = -np.inf
    return out


def fp_tp_probs(detections: Sequence[tuple[float, int, int]], labels: np.ndarray, itc: set[int] = frozenset(),
                scale: float = 1.0, centre: float | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Split one slide's detections into false positives and per-lesion best probabilities.

    Args:
        detections: ``(probability, y, x)`` in heat-map pixels.
        labels: evaluation-mask labels (H, W) from :func:`evaluation_mask`.
        itc: labels ignored for scoring.
        scale: mask pixels per heat-map pixel (the stride); a detection at heat pixel (y, x) is
            looked up at mask pixel ``int(y * scale + centre)``.
        centre: mask pixels from a cell's patch corner to its centre: half the patch side.
            Default ``scale / 2``, the centre of a patch as large as the stride; with overlapping
            patches (stride < patch) the cell's patch reaches further than its stride.

    Returns:
        ``(fp_probs, tp_probs, num_lesions)``: probabilities of detections outside lesions;
        per label 1..max the highest detection probability inside it (0 if missed, ITCs
        included as 0 as in the challenge code); lesions that count (non-ITC).
    """
    n = int(labels.max())
    tp = np.zeros(n)
    fp = []
    centre = scale / 2 if centre is None else centre
    for p, y, x in detections:
        my = min(int(y * scale + centre), labels.shape[0] - 1)
        mx = min(int(x * scale + centre), labels.shape[1] - 1)
        k = int(labels[my, mx])
        if k == 0:
            fp.append(p)
        elif k not in itc:
            tp[k - 1] = max(tp[k - 1], p)
    return np.asarray(fp, np.float64), tp, n - len(itc)


def froc_curve(fp_probs: np.ndarray, tp_probs: np.ndarray, num_lesions: int,
               num_slides: int) -> tuple[np.ndarray, np.ndarray]:
    """FP rate per slide and sensitivity at every threshold (the challenge's thresholds).

    Args:
        fp_probs: false-positive probabilities pooled over slides.
        tp_probs: per-lesion best probabilities pooled over slides.
        num_lesions: lesions that count, over all slides.
        num_slides: number of slides.

    Returns:
        ``(fps_per_slide, sensitivity)`` from the lowest to the highest threshold, ending (0, 0).
    """
    fp_probs, tp_probs = np.asarray(fp_probs, np.float64), np.asarray(tp_probs, np.float64)
    thresholds = np.unique(np.concatenate([fp_probs, tp_probs]))[1:]
    fps = [(fp_probs >= t).sum() for t in thresholds] + [0]
    tps = [(tp_probs >= t).sum() for t in thresholds] + [0]
    return np.asarray(fps, np.float64) / num_slides, np.asarray(tps, np.float64) / max(num_lesions, 1)


def froc_summary(fps_per_slide: np.ndarray, sensitivity: np.ndarray,
                 rates: Sequence[float] = EVAL_FP_RATES) -> dict[str, float]:
    """Sensitivity at each FP rate, interpolated on the curve of :func:`froc_curve`, and their mean.

    Returns:
        ``{"froc": mean sensitivity, "sens@<rate>": sensitivity, ...}``.
    """
    sens = np.interp(rates, fps_per_slide[::-1], sensitivity[::-1])
    return {"froc": float(np.mean(sens)), **{f"sens@{r:g}": float(s) for r, s in zip(rates, sens, strict=True)}}


def froc(heatmaps: Sequence[np.ndarray], masks: Sequence[np.ndarray | None], threshold: float = 0.5,
         nms_radius: int = 1, dilation_px: float = 0.0, itc_max_px: float = 0.0,
         scales: Sequence[float | None] | None = None,
         centres: Sequence[float | None] | None = None) -> dict[str, float]:
    """FROC score of heat maps against lesion masks.

    Args:
        heatmaps: per slide a (h, w) tumour probability map.
        masks: per slide a (H, W) lesion mask (non-zero = tumour) at an integer multiple of the
            heat-map size, or None for a normal slide.
        threshold: lowest probability kept as a detection.
        nms_radius: suppression half-side in heat-map pixels.
        dilation_px: lesion growth in mask pixels (see :func:`evaluation_mask`).
        itc_max_px: ITC major-axis limit in mask pixels.
        scales: per slide the mask pixels per heat-map pixel (the heat-map stride at the mask's
            resolution); None, or a None entry, infers ``mask height / heat-map height``.
        centres: per slide half the patch side in mask pixels (see :func:`fp_tp_probs`); None, or a
            None entry, is half the scale (patches as large as the stride).

    Returns:
        ``{"froc": score, "sens@0.25": ..., ..., "sens@8": ..., "slides": n, "lesions": counted}``.
    """
    fps, tps, lesions = [], [], 0
    scales = [None] * len(heatmaps) if scales is None else scales
    centres = [None] * len(heatmaps) if centres is None else centres
    for heat, mask, scale, centre in zip(heatmaps, masks, scales, centres, strict=True):
        if mask is None:
            labels, itc, scale = np.zeros(heat.shape, np.int32), set(), 1.0
        else:
            labels, itc = evaluation_mask(mask, dilation_px, itc_max_px)
            scale = mask.shape[0] / heat.shape[0] if scale is None else scale
        fp, tp, n = fp_tp_probs(local_maxima(heat, threshold, nms_radius), labels, itc, scale, centre)
        fps.append(fp)
        tps.append(tp)
        lesions += n
    curve = froc_curve(np.concatenate(fps), np.concatenate(tps), lesions, len(heatmaps))
    return {**froc_summary(*curve), "slides": float(len(heatmaps)), "lesions": float(lesions)}


# ------------------------------------------------------------------ files and CLI

HEAT_SUFFIX = "_heatmap"  # what ``fastvision predict`` appends to the slide name
MASK_EXTENSIONS = (".tif", ".tiff", ".png")


def read_heatmap(path: Path) -> np.ndarray:
    """(h, w) float64 probabilities from a float TIFF, or an 8-bit PNG/TIFF (255 = probability 1)."""
    import tifffile
    from PIL import Image

    try:
        arr = tifffile.imread(path) if path.suffix.lower() in (".tif", ".tiff") else np.asarray(Image.open(path))
    except Exception as e:  # PIL and tifffile raise several types for unreadable files
        raise DataError(f"{path}: cannot read heat map ({e})") from e
    if arr.ndim != 2:
        raise DataError(f"{path}: heat map must be one channel (h, w), got shape {arr.shape}")
    arr = arr.astype(np.float64) / (255.0 if arr.dtype == np.uint8 else 1.0)
    if not np.isfinite(arr).all() or arr.min() < 0 or arr.max() > 1:
        raise DataError(f"{path}: heat map values must be probabilities in [0, 1]")
    return arr


def read_mask(path: Path, downsample: int = 1) -> np.ndarray:
    """Boolean lesion mask, every ``downsample``-th pixel; tiled TIFFs are read a strip at a time.

    A whole-slide mask at level 0 does not fit in memory; the strip read keeps the peak at one
    band of ``downsample`` rows.
    """
    from fastvision.data.formats.pathology import TiledTiff, mask_channel

    if path.suffix.lower() == ".png":
        from PIL import Image

        try:
            arr = np.asarray(Image.open(path))
        except Exception as e:  # PIL raises several types for unreadable files
            raise DataError(f"{path}: cannot read mask ({e})") from e
        return mask_channel(arr[::downsample, ::downsample], path) > 0
    tif = TiledTiff(path)
    h, w = tif.shape[:2]
    band = max(downsample, 256 // downsample * downsample)  # rows per read, a multiple of downsample
    rows = [mask_channel(tif.read_region(y, 0, min(band, h - y), w)[::downsample, ::downsample], path) > 0
            for y in range(0, h, band)]
    tif.close()
    return np.concatenate(rows)


def pair_files(heat_dir: Path, mask_dir: Path) -> list[tuple[str, Path, Path | None]]:
    """``(slide name, heat map, mask or None)`` for every heat map; a slide without a mask is normal.

    Heat maps are ``NAME_heatmap.tif`` (as ``fastvision predict`` writes), ``NAME.tif`` or the
    PNG forms (a TIFF wins over a PNG of the same name); masks are ``MASK_DIR/NAME.tif|tiff|png``.
    """
    for d in (heat_dir, mask_dir):
        if not d.is_dir():
            raise DataError(f"folder not found: {d}")
    heats: dict[str, Path] = {}
    for p in sorted(heat_dir.iterdir(), key=lambda p: (p.suffix.lower() == ".png", p.name)):
        if p.suffix.lower() in (".tif", ".tiff", ".png"):
            name = p.stem[:-len(HEAT_SUFFIX)] if p.stem.endswith(HEAT_SUFFIX) else p.stem
            heats.setdefault(name, p)
    if not heats:
        raise DataError(f"{heat_dir}: no heat maps (.tif or .png)")
    masks = {p.stem: p for p in sorted(mask_dir.iterdir(), reverse=True) if p.suffix.lower() in MASK_EXTENSIONS}
    if masks and not set(masks) & set(heats):
        raise DataError(f"{mask_dir}: no mask is named like a heat map in {heat_dir} "
                        f"(e.g. heat map {next(iter(heats))!r}, mask {next(iter(masks))!r})")
    for name in sorted(set(masks) - set(heats)):
        log.warning("%s: mask without a heat map, not scored", masks[name])
    return [(name, heats[name], masks.get(name)) for name in sorted(heats)]


def froc_files(heat_dir: str | Path, mask_dir: str | Path, *, stride: int | None = None, patch: int | None = None,
               mask_downsample: int = 1, threshold: float = 0.5, nms_radius: int = 1, dilation_px: float = 0.0,
               itc_max_px: float = 0.0) -> dict[str, float]:
    """FROC of a folder of heat maps against a folder of lesion masks.

    Args:
        heat_dir: heat maps (see :func:`pair_files`).
        mask_dir: lesion masks at the slides' resolution (non-zero = tumour); none = normal slide.
        stride: mask pixels per heat-map pixel (the ``heatmap_stride`` used by ``predict``);
            default: the stride ``predict`` recorded in the heat map, else mask height //
            heat-map height.
        patch: side in mask pixels of the patch a heat-map cell scored (``heatmap_patch``);
            default: the patch ``predict`` recorded, else the stride. A detection is looked up at
            its patch's centre.
        mask_downsample: read every N-th mask pixel (memory); ``stride``, ``dilation_px`` and
            ``itc_max_px`` stay in the mask file's pixels.
        threshold, nms_radius: detection settings of :func:`local_maxima`.
        dilation_px, itc_max_px: evaluation-mask settings of :func:`evaluation_mask`.

    Returns:
        :func:`froc`'s dict plus ``slides``, ``tumour_slides`` and ``lesions``.
    """
    from fastvision.data.formats.heatmap import heatmap_record

    heats, masks, scales, centres = [], [], [], []
    for _name, heat_path, mask_path in pair_files(Path(heat_dir), Path(mask_dir)):
        heat = read_heatmap(heat_path)
        mask = None if mask_path is None else read_mask(mask_path, mask_downsample)
        if mask is not None and not mask.any():
            mask = None  # an all-zero mask is a normal slide
        if mask is not None:
            full_h = mask.shape[0] * mask_downsample
            record = heatmap_record(heat_path)  # predict records its stride and patch
            step = stride or record.get("stride") or full_h // heat.shape[0]
            if step < 1 or heat.shape[0] * step > full_h:
                raise DataError(f"{mask_path}: mask height {full_h} px cannot hold heat map {heat_path.name} "
                                f"of {heat.shape[0]} rows at stride {step} (masks at another resolution than the "
                                "slides': give --stride, their pixels per heat-map cell)")
            scales.append(step / mask_downsample)
            if not patch and record.get("patch") and record.get("stride"):  # the recorded patch, in these masks' pixels
                side = record["patch"] * step / record["stride"]  # (--stride for masks at another resolution)
            else:
                side = patch or step
            centres.append(side / 2 / mask_downsample)
        else:
            scales.append(None)
            centres.append(None)
        heats.append(heat)
        masks.append(mask)
    if not any(m is not None for m in masks):  # every slide normal: no sensitivity to measure
        what = "no lesion in any mask" if any(Path(mask_dir).iterdir()) else "no masks (.tif, .tiff, .png)"
        raise DataError(f"{mask_dir}: {what}; the FROC needs slides with lesions")
    out = froc(heats, masks, threshold, nms_radius, dilation_px / mask_downsample, itc_max_px / mask_downsample, scales,
               centres)
    return {**out, "tumour_slides": float(sum(m is not None for m in masks))}


def camelyon16_distances(um_per_px: float) -> tuple[float, float]:
    """Camelyon16's ``(dilation_px, itc_max_px)`` for a mask of ``um_per_px`` microns per pixel.

    Lesions are grown by 75 um / 2 and ITCs are lesions shorter than 275 um (the challenge's
    ``Evaluation_FROC.py``: 75 / (0.243 * 2**level * 2) and 275 / (0.243 * 2**level)).
    """
    return 75.0 / (um_per_px * 2), 275.0 / um_per_px
