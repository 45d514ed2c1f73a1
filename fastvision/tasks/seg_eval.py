"""The segmentation task's validation metrics: per-case Dice / IoU / HD95 and the pooled figures
(:class:`SegEvaluator`; the task is :class:`~fastvision.tasks.segment.SegmentationTask`)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fastvision.metrics import RegionCounts, hd95
from fastvision.metrics.cases import CaseSums, case_counts, case_scores
from fastvision.tasks.base import Evaluator, Task


class SegEvaluator(Evaluator):
    """Per-case scores as :class:`~fastvision.metrics.cases.CaseSums` (Dice, IoU, optional HD95),
    pooled tp/fp/fn as :class:`~fastvision.metrics.RegionCounts`, for the foreground classes (or
    the regions of mode ``regions``) and, in softmax mode with ``regions``, the derived regions;
    plus the loss sums. Each item of a validation batch is one case.

    The sums live on the device of the first batch, so updates never copy to the host.
    """

    def __init__(self, task: Task):  # a SegmentationTask (tasks.segment imports this module)
        self.task = task
        self._reset(torch.device("cpu"))

    def _groups(self) -> list[tuple[str, list[str]]]:
        """(group, channel names): ``classes`` (foreground classes or regions) then ``regions``."""
        t = self.task
        if t.mode == "regions":
            return [("classes", t.region_names or [str(r) for r in range(len(t.regions))])]
        names = [str(c) for c in range(1, t.num_classes)] if t.mode == "softmax" else ["1"]
        return [("classes", names)] + ([("regions", t.region_names)] if t.regions else [])

    def _reset(self, device: torch.device) -> None:
        self.device = device
        self.parts: dict[str, Any] = {}
        for group, names in self._groups():
            c = len(names)
            self.parts[f"{group}.dice"] = CaseSums(c, device)
            self.parts[f"{group}.iou"] = CaseSums(c, device)
            if self.task.hd95:
                self.parts[f"{group}.hd95"] = CaseSums(c, device, scale=2.0**20)
            self.parts[f"{group}.pooled"] = RegionCounts(c, device)
        self.loss_sum = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of loss * n, n)

    def _masks(self, outputs: Tensor, label: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        """(pred, truth) boolean ``(B, C, *S)`` masks per group."""
        t = self.task
        pred = t.predict_labels(outputs)
        if t.mode == "regions":
            return {"classes": (pred, t.region_masks(label))}
        if t.mode == "sigmoid":
            return {"classes": (pred.bool().unsqueeze(1), (label > 0).unsqueeze(1))}
        if outputs.shape[1] == 2 and not t.regions:  # two classes: the foreground mask is one compare
            return {"classes": (foreground_of_two(outputs).unsqueeze(1), (label == 1).unsqueeze(1))}
        fg = torch.arange(1, t.num_classes, device=label.device).view(1, -1, *([1] * (label.dim() - 1)))
        out = {"classes": (pred.unsqueeze(1) == fg, label.unsqueeze(1) == fg)}
        if t.regions:
            out["regions"] = (t.region_masks(pred), t.region_masks(label))
        return out

    def update(self, outputs: Tensor, batch: dict[str, Any]) -> None:
        label = batch["label"]
        if label.device != self.device:
            self._reset(label.device)  # first batch: nothing accumulated yet
        for group, (pred, truth) in self._masks(outputs, label).items():
            tp, fp, fn = case_counts(pred, truth)
            self.parts[f"{group}.dice"].update(case_scores(tp, fp, fn, "dice", self.task.empty))
            self.parts[f"{group}.iou"].update(case_scores(tp, fp, fn, "iou", self.task.empty))
            if self.task.hd95:
                self.parts[f"{group}.hd95"].update(_hd95_cases(pred, truth, self._spacings(batch, pred)))
            self.parts[f"{group}.pooled"].add(tp.sum(0), fp.sum(0), fn.sum(0))  # the same counts, pooled
        if self.task.val_loss:
            n = label.shape[0]
            loss = self.task.loss(outputs.float(), batch).detach().double()
            self.loss_sum += torch.stack([loss * n, loss.new_tensor(float(n))])

    def _spacings(self, batch: dict[str, Any], pred: Tensor) -> list | None:
        """Each case's voxel size in mm, for HD95 in mm as MONAI's ``compute_hausdorff_distance(spacing=...)``
        and the BraTS challenge give it: the preprocessing's target spacing (every case is resampled to
        it), else the case's own (``batch["spacing"]``); None (voxels) where the data has no voxel size."""
        nd = pred.dim() - 2
        if self.task.spacing is not None and len(self.task.spacing) == nd:
            return [self.task.spacing] * pred.shape[0]
        given = batch.get("spacing")
        if isinstance(given, Tensor) and given.dim() == 2 and given.shape == (pred.shape[0], nd):
            return [tuple(float(v) for v in row) for row in given.tolist()]
        return None

    def state(self) -> Tensor:
        return torch.cat([p.state() for p in self.parts.values()] + [self.loss_sum])

    def load_state(self, state: Tensor) -> None:
        self._reset(state.device)
        start = 0
        for part in self.parts.values():
            n = part.state().numel()
            part.load_state(state[start:start + n])
            start += n
        self.loss_sum = state[start:start + 2].clone()

    def compute(self) -> dict[str, float]:
        out: dict[str, float] = {}
        case_suffix, pooled_suffix = ("", "_pooled") if self.task.average == "case" else ("_case", "")
        groups = self._groups()
        for group, names in groups:
            # with derived regions (softmax + regions) the regions are the headline: per-label means
            # get the "_labels" suffix (seed 000's mean_dice is dice_labels)
            tag = "_labels" if group == "classes" and len(groups) == 2 else ""
            pooled = self.parts[f"{group}.pooled"]
            for metric in ("dice", "iou", "hd95"):
                if metric == "hd95" and not self.task.hd95:
                    continue
                sums = self.parts[f"{group}.{metric}"]
                per = sums.mean_batch().cpu().tolist()
                out[f"{metric}{tag}{case_suffix}"] = sums.mean()
                if len(names) > 1:
                    out.update({f"{metric}{case_suffix}/{k}": v for k, v in zip(names, per, strict=True)})
                if metric == "hd95":
                    continue
                whole = (pooled.dice() if metric == "dice" else pooled.iou()).cpu()
                pooled_mean = float(np.nanmean(whole.numpy())) if (~whole.isnan()).any() else math.nan
                out[f"{metric}{tag}{pooled_suffix}"] = pooled_mean
                if len(names) > 1:
                    out.update({f"{metric}{pooled_suffix}/{k}": v for k, v in zip(names, whole.tolist(), strict=True)})
        if self.task.val_loss:
            n = float(self.loss_sum[1])
            out["val_loss"] = float(self.loss_sum[0]) / n if n else float("nan")
        return out


def foreground_of_two(logits: Tensor) -> Tensor:
    """``logits.argmax(1) == 1`` of (B, 2, *S) logits as a bool (B, *S), without the argmax: class 1
    wins where its logit is larger, or where it alone is NaN (argmax takes a NaN as the largest and
    the first of ties, NaN or not)."""
    a, b = logits[:, 0], logits[:, 1]
    win = b > a
    if logits.is_floating_point():
        win |= b.isnan() & ~a.isnan()
    return win


def _hd95_cases(pred: Tensor, truth: Tensor, spacings: list | None = None) -> Tensor:
    """``(B, C)`` float64 HD95, in mm with each case's ``spacings`` (voxels without); NaN where either mask
    is empty (left out of the mean)."""
    b, c = pred.shape[:2]
    out = torch.full((b, c), math.nan, dtype=torch.float64, device=pred.device)
    for i in range(b):
        for j in range(c):
            d = hd95(pred[i, j], truth[i, j], spacings[i] if spacings else None)
            if torch.isfinite(d):
                out[i, j] = d
    return out


VAL_WINDOW_HELP = ("roi (the sliding window's roi_size), whole, halves, or a positive voxel count (whole where "
                   "it fits)")


def check_val_window(value: Any) -> str | int:
    """``task.args.val_window`` as given, or a one-line ConfigError naming the key."""
    if value in ("roi", "whole", "halves") or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    from fastvision.errors import ConfigError

    raise ConfigError(f"task.args.val_window: {value!r}; valid: {VAL_WINDOW_HELP}")


def check_sliding_window(window: dict | None) -> dict | None:
    """``task.args.sliding_window`` as given, its keys (those of
    :func:`~fastvision.inference.window.sliding_window_inference`) and values checked when the task is built,
    so a bad one is one line before any step or run folder (an overlap of 1.5 or a mode ``gauss`` stopped the
    first validation with a traceback, after the first epoch had trained).

    Raises:
        ConfigError: naming the key.
    """
    import inspect

    from fastvision.errors import ConfigError
    from fastvision.inference.window import STYLES, sliding_window_inference

    if window is None:
        return None
    if not isinstance(window, dict):
        raise ConfigError(f"task.args.sliding_window: expected a mapping such as {{roi_size: [96, 96, 96]}}, got "
                          f"{window!r}")
    key = "task.args.sliding_window"
    valid = [k for k in inspect.signature(sliding_window_inference).parameters if k not in ("inputs", "model")]
    for k in window:
        if k not in valid:
            raise ConfigError(f"unknown key {key}.{k}; valid keys: {', '.join(valid)}")
    roi = window.get("roi_size")
    if not (isinstance(roi, (list, tuple)) and len(roi) in (2, 3) and all(type(r) is int for r in roi)):
        raise ConfigError(f"{key}.roi_size: 2 or 3 integers, one per spatial axis (<= 0: the whole axis), got {roi!r}")
    spatial_dims = len(roi)
    checks = {"overlap": (lambda v: isinstance(v, (int, float)) and 0 <= v < 1, "a fraction in [0, 1)"),
              "mode": (lambda v: v in ("gaussian", "constant"), "gaussian or constant"),
              "sigma_scale": (lambda v: isinstance(v, (int, float)) and v > 0, "a number > 0"),
              "sw_batch_size": (lambda v: type(v) is int and v >= 1, "an integer >= 1"),
              "style": (lambda v: v in STYLES, " or ".join(STYLES)),
              "tta_flips": (lambda v: isinstance(v, (list, tuple)) and all(
                  type(a) is int and 0 <= a < spatial_dims for a in v), f"spatial axes in [0, {spatial_dims})")}
    for k, (ok, want) in checks.items():
        if k in window and not ok(window[k]):
            raise ConfigError(f"{key}.{k}: {want}, got {window[k]!r}")
    return dict(window)


def model_divisor(model: torch.nn.Module) -> tuple[int, ...]:
    """The size every spatial axis of the model's input must divide by (``UNet`` / ``SegResNet``
    ``divisor``), under DDP and ``torch.compile`` (:func:`fastvision.distributed.unwrap`) and an EMA's
    ``.module``."""
    from fastvision.distributed.wrap import unwrap

    bare = unwrap(model)
    for m in (bare, getattr(bare, "module", None)):
        if hasattr(m, "divisor"):
            return tuple(int(d) for d in m.divisor)
    from fastvision.errors import ConfigError

    raise ConfigError(f"task.args.val_window: {type(model).__name__} states no size divisor (UNet and SegResNet "
                      "do); use val_window: roi")


def validation_window(window: dict, spatial: tuple[int, ...], model: torch.nn.Module,
                      val_window: str | int) -> dict:
    """The sliding-window arguments of one validation volume (``task.args.val_window``).

    ``roi``: the recipe's window. ``whole``: one window, the volume rounded up per axis to the model's
    divisor (the window code pads it symmetrically with zeros and crops the logits back), so a volume
    a few voxels larger than the window no longer costs 2^3 overlapping windows. ``halves``: as
    ``whole``, but the longest axis is covered by two windows of half its size (rounded up to the
    divisor; they overlap where that rounding passes the middle) run as one batch of 2: on the CPU,
    PyTorch runs a batch-1 3-D convolution of a narrow net on its slow path (``slow_conv3d``; a
    64x64x48 volume at widths 8-128 costs 3x two 32x64x48 windows in one batch). A voxel count: the
    whole volume where its rounded size fits in that many voxels, else the recipe's window (a memory
    cap for large volumes). Validation only: ``predict`` keeps the recipe's window.
    """
    if val_window == "roi":
        return window
    div = model_divisor(model)
    roi = [math.ceil(s / d) * d for s, d in zip(spatial, div, strict=True)]
    if val_window not in ("whole", "halves") and math.prod(roi) > val_window:
        return window
    if val_window == "halves":
        a = max(range(len(spatial)), key=lambda i: spatial[i])
        roi[a] = min(roi[a], math.ceil(math.ceil(spatial[a] / 2) / div[a]) * div[a])
    # overlap 0: one window per axis, or exactly two on a halved one; constant blending returns a
    # single window's logits exactly (x * 1 / 1) and averages the two halves where they overlap
    return {**window, "roi_size": roi, "overlap": 0.0, "mode": "constant",
            "sw_batch_size": max(2, int(window.get("sw_batch_size", 1)))}
