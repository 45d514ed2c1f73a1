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

from typing import Sequence

import numpy as np

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


def evaluation_mask(lesion_mask: np.ndarray, dilation_px: float = 0.0, itc_max_px: float = 0.0) -> tuple[np.ndarray, set[int]]:
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
                scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, int]:
    """Split one slide's detections into false positives and per-lesion best probabilities.

    Args:
        detections: ``(probability, y, x)`` in heat-map pixels.
        labels: evaluation-mask labels (H, W) from :func:`evaluation_mask`.
        itc: labels ignored for scoring.
        scale: mask pixels per heat-map pixel; a detection at heat pixel (y, x) is looked up at
            mask pixel ``int((y + 0.5) * scale)`` (the centre of the area it covers).

    Returns:
        ``(fp_probs, tp_probs, num_lesions)``: probabilities of detections outside lesions;
        per label 1..max the highest detection probability inside it (0 if missed, ITCs
        included as 0 as in the challenge code); lesions that count (non-ITC).
    """
    n = int(labels.max())
    tp = np.zeros(n)
    fp = []
    for p, y, x in detections:
        my = min(int((y + 0.5) * scale), labels.shape[0] - 1)
        mx = min(int((x + 0.5) * scale), labels.shape[1] - 1)
        k = int(labels[my, mx])
        if k == 0:
            fp.append(p)
        elif k not in itc:
            tp[k - 1] = max(tp[k - 1], p)
    return np.asarray(fp, np.float64), tp, n - len(itc)


def froc_curve(fp_probs: np.ndarray, tp_probs: np.ndarray, num_lesions: int, num_slides: int) -> tuple[np.ndarray, np.ndarray]:
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


def froc_score(fps_per_slide: np.ndarray, sensitivity: np.ndarray, rates: Sequence[float] = EVAL_FP_RATES) -> float:
    """Mean sensitivity at the given FP rates, interpolated on the curve of :func:`froc_curve`."""
    return float(np.mean(np.interp(rates, fps_per_slide[::-1], sensitivity[::-1])))


def froc(heatmaps: Sequence[np.ndarray], masks: Sequence[np.ndarray | None], threshold: float = 0.5,
         nms_radius: int = 1, dilation_px: float = 0.0, itc_max_px: float = 0.0) -> dict[str, float]:
    """FROC score of heat maps against lesion masks.

    Args:
        heatmaps: per slide a (h, w) tumour probability map.
        masks: per slide a (H, W) lesion mask (non-zero = tumour) at an integer multiple of the
            heat-map size, or None for a normal slide.
        threshold: lowest probability kept as a detection.
        nms_radius: suppression half-side in heat-map pixels.
        dilation_px: lesion growth in mask pixels (see :func:`evaluation_mask`).
        itc_max_px: ITC major-axis limit in mask pixels.

    Returns:
        ``{"froc": score, "sens@0.25": ..., ..., "sens@8": ...}``.
    """
    fps, tps, lesions = [], [], 0
    for heat, mask in zip(heatmaps, masks, strict=True):
        if mask is None:
            labels, itc, scale = np.zeros(heat.shape, np.int32), set(), 1.0
        else:
            labels, itc = evaluation_mask(mask, dilation_px, itc_max_px)
            scale = mask.shape[0] / heat.shape[0]
        fp, tp, n = fp_tp_probs(local_maxima(heat, threshold, nms_radius), labels, itc, scale)
        fps.append(fp)
        tps.append(tp)
        lesions += n
    curve = froc_curve(np.concatenate(fps), np.concatenate(tps), lesions, len(heatmaps))
    sens = np.interp(EVAL_FP_RATES, curve[0][::-1], curve[1][::-1])
    out = {"froc": float(np.mean(sens))}
    out.update({f"sens@{r:g}": float(s) for r, s in zip(EVAL_FP_RATES, sens)})
    return out
