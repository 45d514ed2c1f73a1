"""Sliding-window prediction (Gaussian or constant blending) and flip test-time augmentation."""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

Predictor = Callable[[Tensor], Tensor]


STYLES = ("monai", "nnunet")


def window_starts(size: int, roi: int, overlap: float, style: str = "monai") -> list[int]:
    """Start offsets of the windows along one axis.

    ``monai`` (MONAI's ``dense_patch_slices``): the step is ``int(roi * (1 - overlap))`` (at least 1),
    windows sit at multiples of it and the last one is shifted back to end at the border.
    ``nnunet`` (nnU-Net v2's ``compute_steps_for_sliding_window``): ``ceil((size - roi) / (roi * (1 - overlap)))
    + 1`` windows spread evenly from 0 to ``size - roi``, each start rounded half to even. Either way every
    voxel is covered, no window leaves the volume, and a ROI filling the axis is one window.
    """
    if roi >= size:
        return [0]
    if style == "nnunet":
        count = math.ceil((size - roi) / (roi * (1 - overlap))) + 1
        return [round((size - roi) / (count - 1) * i) for i in range(count)]
    step = max(1, int(roi * (1 - overlap)))
    count = math.ceil((size - roi) / step) + 1
    return [min(i * step, size - roi) for i in range(count)]


def importance_map(roi: Sequence[int], mode: str = "gaussian", sigma_scale: float = 0.125,
                   device: torch.device | str = "cpu", style: str = "monai") -> Tensor:
    """Per-voxel blending weight of one window.

    Args:
        roi: window shape (*R).
        mode: "constant" (all ones) or "gaussian" (separable Gaussian, sigma = sigma_scale * edge).
        sigma_scale: Gaussian width relative to each window edge.
        style: ``monai``: centred on the window, floored at 1e-3 so border voxels still count where only
            one window covers them; ``nnunet`` (v2's ``compute_gaussian``): centred on voxel ``edge // 2``,
            cut at scipy's ``gaussian_filter`` radius ``int(4 sigma + 0.5)``, voxels beyond it given the
            smallest weight inside (the scale cancels in the blend).

    Returns:
        float32 tensor (*R).
    """
    if mode == "constant":
        return torch.ones(tuple(roi), device=device)
    if mode != "gaussian":
        raise ValueError(f"blend mode must be 'constant' or 'gaussian', got {mode!r}")
    nn_style = style == "nnunet"  # built in float64 on the host, as scipy's filter, then moved
    w = torch.ones((), dtype=torch.float64 if nn_style else torch.float32, device="cpu" if nn_style else device)
    for n in roi:
        sigma = sigma_scale * n
        centre = n // 2 if nn_style else (n - 1) / 2.0
        x = torch.arange(n, dtype=w.dtype, device=w.device) - centre
        g = torch.exp(-(x**2) / (2 * sigma**2))
        if nn_style:
            g = torch.where(x.abs() <= int(4 * sigma + 0.5), g, 0.0)
        w = w[..., None] * g
    if nn_style:
        return torch.where(w > 0, w, w[w > 0].min()).float().to(device)
    return w.clamp(min=1e-3)


@torch.no_grad()
def sliding_window(predict: Predictor, x: Tensor, roi: Sequence[int], *, overlap: float = 0.25,
                   mode: str = "gaussian", sigma_scale: float = 0.125, sw_batch_size: int = 1,
                   device: torch.device | str | None = None, pad_value: float = 0.0, style: str = "monai") -> Tensor:
    """Sliding-window prediction over a batch of 2-D or 3-D images.

    Args:
        predict: maps windows (N, C, *R) to outputs (N, K, *R) on the input's device (e.g. a model
            under autocast; apply softmax inside it to blend probabilities instead of logits).
        x: (B, C, *S) input with len(S) in (2, 3); it stays on its device, where windows run.
        roi: window shape (*R); an entry <= 0 means the whole axis. Axes smaller than the ROI are
            padded symmetrically with ``pad_value`` and the padding is cropped from the result.
        overlap: fraction of the ROI shared by neighbouring windows, in [0, 1).
        mode: "gaussian" or "constant" blending (:func:`importance_map`).
        sigma_scale: Gaussian width relative to the ROI edge.
        sw_batch_size: windows per ``predict`` call.
        device: where outputs are accumulated and returned (default: ``x.device``); use "cpu" for
            volumes whose output does not fit next to the model on the GPU.
        style: ``monai`` or ``nnunet``: where the windows sit (:func:`window_starts`) and the Gaussian
            (:func:`importance_map`). Padding is symmetric in both, the odd voxel after the volume.

    Returns:
        (B, K, *S) float32 blended outputs.
    """
    dims = x.dim() - 2
    if dims not in (2, 3) or len(roi) != dims:
        raise ValueError(f"input (B, C, *S) with 2 or 3 spatial dims and a matching roi, got {tuple(x.shape)}, {roi}")
    if not 0 <= overlap < 1:
        raise ValueError(f"overlap must be in [0, 1), got {overlap}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {', '.join(STYLES)}, got {style!r}")
    out_device = torch.device(device) if device is not None else x.device
    size = tuple(x.shape[2:])
    roi = tuple(s if r <= 0 else int(r) for r, s in zip(roi, size, strict=True))
    pad = [max(0, r - s) for r, s in zip(roi, size, strict=True)]
    if any(pad):
        # F.pad lists the last axis first.
        x = F.pad(x, [p for d in reversed(pad) for p in (d // 2, d - d // 2)], value=pad_value)
    padded = tuple(x.shape[2:])
    starts = list(itertools.product(*[window_starts(s, r, overlap, style) for s, r in zip(padded, roi, strict=True)]))
    weight = importance_map(roi, mode, sigma_scale, device=out_device, style=style)
    out = None
    norm = torch.zeros(padded, device=out_device)
    for start in starts:  # the normaliser depends only on the window layout, not on the batch
        norm[tuple(slice(a, a + r) for a, r in zip(start, roi, strict=True))] += weight
    jobs = [(b, s) for b in range(x.shape[0]) for s in starts]
    for i in range(0, len(jobs), sw_batch_size):
        chunk = jobs[i: i + sw_batch_size]
        sls = [tuple(slice(a, a + r) for a, r in zip(s, roi, strict=True)) for _, s in chunk]
        windows = torch.stack([x[(b, slice(None)) + sl] for (b, _), sl in zip(chunk, sls, strict=True)])
        pred = predict(windows).to(out_device, torch.float32)
        if out is None:
            out = torch.zeros((x.shape[0], pred.shape[1], *padded), device=out_device)
        for (b, _), sl, p in zip(chunk, sls, pred, strict=True):
            out[(b, slice(None)) + sl] += p * weight
    out = out.div_(norm)  # in place: one (B, K, *S) float32 volume less at the peak of a large case
    crop = tuple(slice(d // 2, d // 2 + s) for d, s in zip(pad, size, strict=True))
    return out[(slice(None), slice(None)) + crop]


def sliding_window_inference(inputs: Tensor, model: Predictor, roi_size: Sequence[int], *, overlap: float = 0.25,
                             mode: str = "gaussian", sigma_scale: float = 0.125, sw_batch_size: int = 1,
                             device: torch.device | str | None = None, tta_flips: Sequence[int] = (),
                             style: str = "monai") -> Tensor:
    """Keyword form used by recipes (``task.args.sliding_window``): :func:`sliding_window` of ``model``.

    Args:
        inputs: (B, C, *S); model: (N, C, *R) -> (N, K, *R); roi_size, overlap, mode, sigma_scale,
            sw_batch_size, device, style: as :func:`sliding_window`.
        tta_flips: spatial axes (0-based, of *S) to mirror for :func:`flip_tta`; empty = no TTA.

    Returns:
        (B, K, *S) blended logits.
    """
    def run(x: Tensor) -> Tensor:
        return sliding_window(model, x, roi_size, overlap=overlap, mode=mode, sigma_scale=sigma_scale,
                              sw_batch_size=sw_batch_size, device=device, style=style)

    if tta_flips:
        return flip_tta(run, inputs, dims=[2 + d for d in tta_flips])
    return run(inputs)


def flip_tta(predict: Predictor, x: Tensor, dims: Sequence[int] = (2, 3, 4)) -> Tensor:
    """Average ``predict`` over the input mirrored along every subset of ``dims``.

    Each prediction is flipped back before averaging, so with three axes this is the eight-way
    mirroring of nnU-Net (the unflipped input included).

    Args:
        predict: (B, C, *S) -> (B, K, *S), e.g. a :func:`sliding_window` closure returning
            probabilities.
        x: (B, C, *S) input.
        dims: tensor axes to mirror (spatial axes are 2.. for (B, C, *S)).

    Returns:
        (B, K, *S) mean prediction.
    """
    total = None
    subsets = [c for k in range(len(dims) + 1) for c in itertools.combinations(dims, k)]
    for flip in subsets:
        y = predict(torch.flip(x, flip) if flip else x)
        y = torch.flip(y, flip) if flip else y
        total = y.float() if total is None else total + y
    return total / len(subsets)
