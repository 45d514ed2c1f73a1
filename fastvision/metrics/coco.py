"""COCO box evaluation: detections -> results JSON (original pixels and category ids) -> COCOeval.

The metric is pycocotools' own ``COCOeval`` (mAP@[.5:.95], AP50, AP75, AP small/medium/large),
never a re-implementation. Under DDP each rank holds the detections of its shard; the
evaluator's :meth:`COCOEvaluator.state` gathers them on every rank (a collective every rank
reaches, since the engine calls ``state()`` everywhere), so the metric is that of the whole set.
"""
from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fastvision import distributed
from fastvision.data.formats.coco import load_coco
from fastvision.metrics import Evaluator
from fastvision.utils.files import atomic_text

METRIC_NAMES = ("map", "ap50", "ap75", "ap_small", "ap_medium", "ap_large")


def to_coco_results(boxes: Tensor, scores: Tensor, labels: Tensor, image_ids: Tensor, orig_sizes: Tensor,
                    input_size: tuple[int, int], cat_ids: list[int]) -> list[dict[str, Any]]:
    """Fixed-shape detections of resized inputs -> COCO result dicts in original image pixels.

    Args:
        boxes: ``(B, D, 4)`` xyxy in network-input pixels.
        scores: ``(B, D)``.
        labels: ``(B, D)`` contiguous class indices; ``-1`` marks an empty slot.
        image_ids: ``(B,)`` COCO image ids.
        orig_sizes: ``(B, 2)`` original ``(h, w)``.
        input_size: ``(H, W)`` of the network input (the whole image was resized to it).
        cat_ids: COCO category id of each class index.

    Returns:
        ``[{"image_id", "category_id", "bbox": [x, y, w, h], "score"}, ...]``.
    """
    boxes, scores, labels = boxes.detach().float().cpu(), scores.detach().float().cpu(), labels.cpu()
    sizes = orig_sizes.cpu().float()
    H, W = input_size
    scale = torch.stack([sizes[:, 1] / W, sizes[:, 0] / H, sizes[:, 1] / W, sizes[:, 0] / H], dim=1)  # (B, 4)
    boxes = boxes * scale[:, None, :]
    out = []
    for b, img_id in enumerate(image_ids.cpu().tolist()):
        ok = labels[b] >= 0
        kept = zip(boxes[b][ok].tolist(), scores[b][ok].tolist(), labels[b][ok].tolist(), strict=True)
        for (x0, y0, x1, y1), s, c in kept:
            out.append({"image_id": int(img_id), "category_id": int(cat_ids[c]),
                        "bbox": [x0, y0, x1 - x0, y1 - y0], "score": float(s)})
    return out


def write_results(results: list[dict[str, Any]], path: str | Path) -> Path:
    """Write a COCO results JSON atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    atomic_text(path, json.dumps(results))
    return path


def coco_metrics(coco_gt: Any, results: list[dict[str, Any]] | str | Path,
                 img_ids: list[int] | None = None) -> dict[str, float]:
    """pycocotools bbox evaluation.

    Args:
        coco_gt: ``pycocotools.coco.COCO`` or the path of an instances JSON (read by
            :func:`~fastvision.data.formats.coco.load_coco`: its usable annotations, those the reader
            skips are not ground truth either).
        results: result dicts or the path of a results JSON.
        img_ids: evaluate only these images (default: all images of ``coco_gt``).

    Returns:
        ``{"map", "ap50", "ap75", "ap_small", "ap_medium", "ap_large"}``; 0.0 when there are no
        detections (COCOeval cannot load an empty result list).
    """
    from pycocotools.cocoeval import COCOeval

    if not hasattr(coco_gt, "loadRes"):
        coco_gt = load_coco(coco_gt)
    if isinstance(results, (str, Path)):
        results = json.loads(Path(results).read_text())
    if not results:
        return {k: 0.0 for k in METRIC_NAMES}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools reports by print
        dt = coco_gt.loadRes(results)
        ev = COCOeval(coco_gt, dt, "bbox")
        if img_ids is not None:
            ev.params.imgIds = sorted(img_ids)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    # COCOeval reports -1 for an area range without ground truth; kept, since 0 would read as a miss.
    return {k: float(v) for k, v in zip(METRIC_NAMES, ev.stats[:6], strict=True)}


class COCOEvaluator(Evaluator):
    """Collects detections over the validation set and scores them with COCOeval.

    Args:
        ann_file: ground-truth ``instances_<split>.json``.
        cat_ids: COCO category id of each class index.
        input_size: ``(H, W)`` network input the images were resized to.
        postprocess: turns raw model outputs into ``{"boxes", "scores", "labels"}`` (applied when
            ``update`` receives raw outputs, i.e. a dict with ``"cls_logits"``).
        results_path: also write the gathered results JSON here (main rank only).
    """

    def __init__(self, ann_file: str | Path, cat_ids: list[int], input_size: tuple[int, int],
                 postprocess: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
                 results_path: str | Path | None = None):
        self.ann_file, self.cat_ids, self.input_size = ann_file, list(cat_ids), tuple(input_size)
        self.postprocess, self.results_path = postprocess, results_path
        # image id -> its detections; a dict so an image seen twice is counted once
        self.detections: dict[int, list[dict[str, Any]]] = {}
        self.sums = torch.zeros(1, dtype=torch.float64)

    def update(self, outputs: dict[str, Tensor], batch: dict[str, Any]) -> None:
        """Add one batch. ``outputs``: detections (or raw outputs, see ``postprocess``)."""
        if "cls_logits" in outputs:
            if self.postprocess is None:
                raise ValueError("COCOEvaluator got raw model outputs but no postprocess function")
            outputs = self.postprocess(outputs)
        # Host copy: evaluation only, once per batch.
        res = to_coco_results(outputs["boxes"], outputs["scores"], outputs["labels"], batch["image_id"],
                              batch["orig_size"], self.input_size, self.cat_ids)
        for img_id in batch["image_id"].cpu().tolist():
            self.detections[int(img_id)] = []
        for r in res:
            self.detections[r["image_id"]].append(r)

    def state(self) -> Tensor:
        """Gather every rank's detections (a collective all ranks reach); return this rank's image count.

        The engine sums the returned counts across ranks and hands them to :meth:`load_state`.
        """
        local = float(len(self.detections))
        merged: dict[int, list[dict[str, Any]]] = {}
        for part in distributed.gather_objects(self.detections):
            merged.update(part)
        self.detections = merged
        return torch.tensor([local], dtype=torch.float64)

    def load_state(self, state: Tensor) -> None:
        self.sums = state  # images evaluated over all ranks; the detections were merged in ``state``

    def results(self) -> list[dict[str, Any]]:
        """All collected result dicts, in image order."""
        return [r for k in sorted(self.detections) for r in self.detections[k]]

    def compute(self) -> dict[str, float]:
        """COCO metrics over the images seen (and writes the results JSON when asked)."""
        results = self.results()
        if self.results_path is not None and distributed.is_main():
            write_results(results, self.results_path)
        metrics = coco_metrics(self.ann_file, results, img_ids=sorted(self.detections))
        metrics["images"] = float(len(self.detections))
        return metrics


def ground_truth_as_detections(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """A batch's non-crowd boxes as perfect detections (score 1), for checking the evaluation path."""
    labels = batch["labels"].masked_fill(batch["iscrowd"], -1)
    return {"boxes": batch["boxes"], "scores": (labels >= 0).float(), "labels": labels}

