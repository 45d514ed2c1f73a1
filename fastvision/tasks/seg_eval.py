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
                self.parts[f"{group}.hd95"].update(_hd95_cases(pred, truth))
            self.parts[f"{group}.pooled"].add(tp.sum(0), fp.sum(0), fn.sum(0))  # the same counts, pooled
        if self.task.val_loss:
            n = label.shape[0]
            loss = self.task.loss(outputs.float(), batch).detach().double()
            self.loss_sum += torch.stack([loss * n, loss.new_tensor(float(n))])

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


def _hd95_cases(pred: Tensor, truth: Tensor) -> Tensor:
    """``(B, C)`` float64 HD95 in voxels; NaN where either mask is empty (left out of the mean)."""
    b, c = pred.shape[:2]
    out = torch.full((b, c), math.nan, dtype=torch.float64, device=pred.device)
    for i in range(b):
        for j in range(c):
            d = hd95(pred[i, j], truth[i, j])
            if torch.isfinite(d):
                out[i, j] = d
    return out
