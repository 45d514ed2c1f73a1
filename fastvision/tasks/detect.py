"""Object detection (SSD320, seed 002): padded box batches in, focal + smooth-L1 loss, COCO mAP out.

Batches come from :func:`fastvision.data.formats.coco.collate_detection`: ``image (B, 3, S, S)``
uint8, padded ``boxes / labels / iscrowd`` and the ids and original sizes that map detections
back to COCO results. Images are normalised on the device. Validation post-processes on the
device (score threshold, batched NMS, top 100) and scores the whole set with pycocotools.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fastvision.data.formats.coco import collate_detection
from fastvision.errors import ConfigError, DataError, check_range
from fastvision.metrics.coco import METRIC_NAMES, COCOEvaluator, to_coco_results, write_results
from fastvision.models.ssd import postprocess, ssd_loss
from fastvision.registry import TASKS
from fastvision.tasks.base import DeviceConstants, Evaluator, Task

log = logging.getLogger(__name__)

# ImageNet statistics, as the ResNet backbone expects.
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
_CONSTS = DeviceConstants(mean=torch.tensor(MEAN).view(1, 3, 1, 1), std=torch.tensor(STD).view(1, 3, 1, 1))
PALETTE = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
           (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212)]


def focal_params(alpha: float | None, gamma: float | None, loss: nn.Module | None) -> tuple[float, float]:
    """The focal ``(alpha, gamma)``, set in one place: ``task.args`` or the ``loss: focal`` section.

    Without a focal loss module, ``task.args`` or the seed's 0.25 / 2. With one, its values (alpha
    None is -1: no class weighting); a ``task.args`` value that differs is a ConfigError rather than
    silently losing to the loss section, and so is a focal setting the detection loss has no use for
    (``use_softmax``, ``weight``, ``reduction``, ``include_background: false``, one alpha per class).
    """
    if loss is None or not hasattr(loss, "gamma"):
        return (0.25 if alpha is None else float(alpha)), (2.0 if gamma is None else float(gamma))
    a = getattr(loss, "alpha", None)
    unused = {"use_softmax": getattr(loss, "use_softmax", False),
              "reduction": getattr(loss, "reduction", "mean") != "mean",
              "include_background": not getattr(loss, "include_background", True),
              "weight": getattr(loss, "weight", None) is not None,
              "alpha": torch.is_tensor(a) and a.numel() > 1}  # the detection loss has one alpha for all classes
    for key, set_ in unused.items():
        if set_:
            raise ConfigError(f"loss.args.{key}: the detection loss is the seed's sigmoid focal loss over anchors "
                              "(matched, normalised by the matches); of loss.args it takes only a scalar alpha and "
                              f"gamma, so {key} would be ignored: remove it")
    a = -1.0 if a is None else float(a.reshape(-1)[0]) if torch.is_tensor(a) else float(a)
    for key, given, used in (("alpha", alpha, a), ("gamma", gamma, float(loss.gamma))):
        if given is not None and not math.isclose(float(given), used, rel_tol=1e-6):
            raise ConfigError(f"task.args.{key}={given} but the focal loss has {key}={used:g} (loss.args.{key}): "
                              f"set {key} in one place")
    return a, float(loss.gamma)


@TASKS.register("detection")
class DetectionTask(Task):
    """Single-shot detection with sigmoid focal loss and COCO evaluation.

    Args:
        image_size: square network input side (pixels); must match ``data.args.image_size``.
        num_classes: foreground classes (for benchmark batches; the model has its own).
        alpha, gamma: focal loss parameters (seed: 0.25, 2), or from the recipe's ``loss: focal``
            section (:func:`focal_params`).
        match_iou: argmax matcher threshold (seed: 0.5).
        score_threshold, nms_iou, max_detections: post-processing (seed: 1e-8, 0.6, 100).
        max_boxes: pad targets to this fixed count (static shapes for ``--compile``); None: per batch.
            Boxes beyond it are left out of the targets, with one warning naming the first such image.
        ann_file: validation ``instances_*.json``; default from the dataset's ``info``.
        cat_ids: COCO category id per class index; default from the dataset's ``info``.
        results_path: write the validation results JSON here.
        loss: the recipe's loss module; a ``focal`` loss supplies ``alpha`` and ``gamma`` (the box
            matching, smooth-L1 and normalisation by matches are built in).
        augment: unused (crop and flip change box counts, so they run in the dataset).
        info: the dataset's ``info`` (``val_ann_file``, ``cat_ids``, ``class_names``).
    """

    primary_metric = "map"
    unit_metrics = METRIC_NAMES  # COCO's APs are fractions in [0, 1]
    higher_is_better = True

    def __init__(self, *, image_size: int = 320, num_classes: int = 90, alpha: float | None = None,
                 gamma: float | None = None,
                 match_iou: float = 0.5, score_threshold: float = 1e-8, nms_iou: float = 0.6,
                 max_detections: int = 100, max_boxes: int | None = None, ann_file: str | None = None,
                 cat_ids: list[int] | None = None, results_path: str | None = None,
                 loss: nn.Module | None = None, augment: Any = None, info: dict | None = None):
        info = info or {}
        for key, value in (("image_size", image_size), ("num_classes", num_classes),
                           ("max_detections", max_detections), ("max_boxes", max_boxes)):
            check_range(f"task.args.{key}", value, 1)
        check_range("task.args.match_iou", match_iou, 0.0, 1.0, closed="(]")
        check_range("task.args.nms_iou", nms_iou, 0.0, 1.0, closed="(]")
        check_range("task.args.score_threshold", score_threshold, 0.0, 1.0)
        self.image_size, self.num_classes = image_size, num_classes
        self.alpha, self.gamma = focal_params(alpha, gamma, loss)
        self.match_iou = match_iou
        self.post = {"score_threshold": score_threshold, "iou_threshold": nms_iou, "max_detections": max_detections}
        self.max_boxes = max_boxes
        self._warned_max_boxes = False
        self.ann_file = ann_file or info.get("val_ann_file")
        self.cat_ids = list(cat_ids or info.get("cat_ids") or range(1, num_classes + 1))
        self.class_names = list(info.get("class_names") or [str(c) for c in self.cat_ids])
        self.results_path = results_path
        if info.get("image_size") not in (None, image_size):
            raise ConfigError(f"task.args.image_size={image_size} but data.args.image_size={info['image_size']}")
        self.data_classes = info.get("num_classes")

    def check_model(self, model: nn.Module) -> None:
        """The detector's class count against the dataset's categories and ``task.args.num_classes``, before
        any step or run folder: a dataset with more categories than ``model.args.num_classes`` trained without
        a word, the extra categories' boxes taught as background and never predicted."""
        have = getattr(model, "num_classes", None)
        if have is None:
            return
        if self.data_classes is not None and have != self.data_classes:
            from fastvision.data.formats.anomalies import first_few

            raise ConfigError(f"model.args.num_classes={have} but the dataset has {self.data_classes} categories "
                              f"({first_few(self.class_names, 5)}); set model.args.num_classes and "
                              f"task.args.num_classes to {self.data_classes}")
        if have != self.num_classes:
            raise ConfigError(f"model.args.num_classes={have} but task.args.num_classes={self.num_classes}; "
                              "set both to the dataset's number of categories")

    # -- batches -------------------------------------------------------------------
    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        if self.max_boxes is not None and not self._warned_max_boxes:
            over = [it for it in items if len(it["labels"]) > self.max_boxes]
            if over:  # once per process: a fixed target count for --compile must not drop boxes unseen
                self._warned_max_boxes = True
                log.warning("task.args.max_boxes=%d: image %d has %d boxes, the ones beyond %d are left out of its "
                            "training targets (and so in every image with more; raise max_boxes to keep them)",
                            self.max_boxes, int(over[0]["image_id"]), len(over[0]["labels"]), self.max_boxes)
        return collate_detection(items, self.max_boxes)

    def normalise(self, image: Tensor) -> Tensor:
        """uint8 ``(B, 3, H, W)`` -> float ImageNet-normalised, keeping the memory format."""
        d = image.device
        return (image.float() - _CONSTS.get("mean", d)) / _CONSTS.get("std", d)

    def forward(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, Tensor]:
        return model(self.normalise(batch["image"]))

    def loss(self, outputs: dict[str, Tensor], batch: dict[str, Any]) -> Tensor:
        return ssd_loss(outputs, batch["boxes"], batch["labels"], batch["iscrowd"], self.alpha, self.gamma,
                        self.match_iou)["loss"]

    # -- evaluation ----------------------------------------------------------------
    def eval_forward(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, Tensor]:
        """Detections ``{"boxes" (B, D, 4), "scores" (B, D), "labels" (B, D)}`` in input pixels."""
        out = self.forward(model, batch)
        return postprocess(out, tuple(batch["image"].shape[-2:]), **self.post)

    def evaluator(self) -> Evaluator:
        if not self.ann_file:
            raise ConfigError("detection needs the validation annotations: set task.args.ann_file "
                              "or use the coco dataset")
        return COCOEvaluator(self.ann_file, self.cat_ids, (self.image_size, self.image_size),
                             postprocess=lambda o: postprocess(o, (self.image_size, self.image_size), **self.post),
                             results_path=self.results_path)

    def synthetic_batch(self, batch_size: int, device: torch.device) -> dict[str, Any]:
        """Random images with 8 random boxes each (a COCO-like count), for benchmark mode."""
        S, M = self.image_size, 8
        g = torch.Generator(device="cpu").manual_seed(0)
        xy = torch.rand(batch_size, M, 2, generator=g) * S * 0.7
        wh = torch.rand(batch_size, M, 2, generator=g) * S * 0.3 + 8
        return {
            "image": torch.randint(0, 256, (batch_size, 3, S, S), dtype=torch.uint8, generator=g).to(device),
            "boxes": torch.cat([xy, xy + wh], -1).to(device),
            "labels": torch.randint(0, self.num_classes, (batch_size, M), generator=g).to(device),
            "iscrowd": torch.zeros(batch_size, M, dtype=torch.bool, device=device),
            "image_id": torch.arange(batch_size, device=device),
            "orig_size": torch.full((batch_size, 2), S, dtype=torch.int64, device=device),
        }

    # -- pictures and prediction -----------------------------------------------------
    def save_examples(self, outputs: dict[str, Tensor], batch: dict[str, Any], out_dir: Path, limit: int,
                      min_score: float = 0.3) -> list[Path]:
        """PNGs of validation images: ground truth in thin white, detections in class colours."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for i in range(min(limit, batch["image"].shape[0])):
            gt = batch["boxes"][i][batch["labels"][i] >= 0]
            name = f"{int(batch['image_id'][i])}_boxes.png"
            paths.append(draw_detections(batch["image"][i], outputs["boxes"][i], outputs["scores"][i],
                                         outputs["labels"][i], self.class_names, out_dir / name, min_score, gt))
        return paths

    @torch.no_grad()
    def predict_files(self, model: nn.Module, files: list[Path], out_dir: Path, cfg: Any, device: torch.device,
                      min_score: float = 0.3, coco_ids: str = "auto") -> list[Path]:
        """Images -> ``detections.json`` (COCO results, original pixels) + one ``<name>_boxes.png`` each.

        Image ids in the JSON are those of ``coco_ids`` (:func:`predict_images`: a COCO file's ids, so
        pycocotools scores the JSON against that file, or the files' positions in ``files``);
        ``images.json`` maps them to the files (a COCO ``images`` list: ``file_name`` COCO's, the path under
        the image root, and ``path`` the file, absolute). Category ids follow the dataset's mapping.
        """
        from PIL import Image

        from fastvision.data.formats.imagefolder import open_image
        from fastvision.inference.inputs import check_unique_names

        out_dir = Path(out_dir)
        check_unique_names([Path(f) for f in files], "{0}_boxes.png")  # before any file is written
        check_images(files)
        ids, names = predict_images(files, coco_ids)
        out_dir.mkdir(parents=True, exist_ok=True)
        S = self.image_size
        model.eval()
        results, written, images = [], [], []
        for k, f, name in zip(ids, files, names, strict=True):
            img = open_image(str(f))  # as the dataset reads its images (16-bit grey scaled, not clipped)
            w, h = img.size
            # COCO's file_name is the path under the image root (predict_images); path: the file itself,
            # absolute, so the mapping holds from any working directory
            images.append({"id": k, "file_name": name, "width": w, "height": h,
                           "path": str(Path(f).resolve())})
            x = torch.from_numpy(np.asarray(img.resize((S, S), Image.BILINEAR)).copy())
            x = x.permute(2, 0, 1)[None].to(device)
            det = self.eval_forward(model, {"image": x})
            sizes = torch.tensor([[h, w]])
            results += to_coco_results(det["boxes"], det["scores"], det["labels"], torch.tensor([k]), sizes,
                                       (S, S), self.cat_ids)
            scale = torch.tensor([w / S, h / S, w / S, h / S], device=det["boxes"].device)
            original = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)
            written.append(draw_detections(original, det["boxes"][0] * scale, det["scores"][0], det["labels"][0],
                                           self.class_names, out_dir / f"{Path(f).stem}_boxes.png", min_score))
        written.insert(0, write_results(images, out_dir / "images.json"))
        written.insert(0, write_results(results, out_dir / "detections.json"))
        return written


def predict_images(files: list[Path], coco_ids: str = "auto") -> tuple[list[int], list[str]]:
    """(the image id, the COCO ``file_name``) of each of ``files`` in ``predict``'s ``detections.json`` and
    ``images.json``.

    ``coco_ids`` is a COCO instances or image-info file (its ids by file name: every file must be in it),
    ``none`` (the positions 0..N-1), or ``auto``: the COCO layout's ``ROOT/annotations/instances_<folder>.json``
    of the files' one folder where it lists every file (``val2017/`` of a COCO root), else the positions.
    A JSON whose ids are not the annotation file's cannot be scored by pycocotools against it, nor one of
    inputs stored at another size than the file's width/height (a resized copy: its boxes are in the other
    grid), which is one line, as the COCO reader refuses such an image. ``file_name`` is the COCO file's own
    (``patch0/x.jpg`` of a file listing sub-folders); without one COCO's form, the path relative to the image
    root, the inputs' common folder (``a/x.jpg`` and ``b/y.jpg``; the bare name for one folder).
    """
    entries, source = _coco_entries(files, coco_ids)
    if entries is None:
        root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files]) if files else ""
        return list(range(len(files))), [Path(os.path.relpath(os.path.abspath(f), root)).as_posix() for f in files]
    return _same_sizes(files, entries, source), [str(entries[f.name]["file_name"]) for f in files]


def _coco_entries(files: list[Path], coco_ids: str) -> tuple[dict[str, dict] | None, str | Path]:
    """(the COCO ``images`` entries by file name that ``coco_ids`` gives the files, its file) or (None, "")."""
    from fastvision.data.formats.coco_check import image_entries

    if coco_ids == "none":
        return None, ""
    if coco_ids != "auto":
        names = image_entries(coco_ids)
        missing = [f for f in files if f.name not in names]
        if missing:
            raise DataError(f"--coco-ids {coco_ids}: {missing[0]} is not in its images list ({len(missing)} of "
                            f"{len(files)} inputs are not; it lists {len(names)} files)")
        return names, coco_ids
    folders = {f.parent for f in files}
    folder = folders.pop() if len(folders) == 1 else None
    ann = folder.parent / "annotations" / f"instances_{folder.name}.json" if folder else None
    if ann is not None and ann.is_file():
        try:
            names = image_entries(ann)
        except DataError as e:
            log.warning("image ids are the inputs' positions: %s", e)
            return None, ""
        if all(f.name in names for f in files):
            log.info("image ids from %s (COCO layout; --coco-ids none for positions)", ann)
            return names, ann
        log.warning("image ids are the inputs' positions: %s does not list every input; pass --coco-ids FILE",
                    ann)
    return None, ""


def _same_sizes(files: list[Path], entries: dict[str, dict], source: str | Path) -> list[int]:
    """The ids of ``files`` in ``entries`` (a COCO file's, by name), each file stored at its entry's
    width x height where the entry gives them (DataError naming the first that is not)."""
    from PIL import Image

    from fastvision.data.formats.coco_check import other_size

    for f in files:
        im = entries[f.name]
        if all(type(im.get(k)) is int for k in ("width", "height")):  # else nothing to compare: no file read
            with Image.open(f) as pic:
                size = pic.size
            if why := other_size(im, size, f, str(source), "pycocotools would score detections.json against boxes "
                                 "of another grid; predict the images as annotated, or --coco-ids none"):
                raise DataError(why)
    return [entries[f.name]["id"] for f in files]


def check_images(files: list[Path]) -> None:
    """Before any file is written: every input is an image that decodes to the end (a header read and
    the end marker of a JPEG or PNG; a file without it is decoded in full), so a text file or a truncated
    JPEG among the inputs is one line naming it, not a stop part-way with some pictures written.

    Raises:
        DataError: naming the first such input and how many there are.
    """
    from fastvision.data.formats.anomalies import first_few, image_decodes

    bad: list[tuple[Path, str]] = []
    for f in files:
        try:
            image_decodes(Path(f))
        except Exception as e:  # noqa: BLE001  (any decoder failure: the input is not a usable image)
            bad.append((Path(f), str(e)))
    if bad:
        more = f" ({len(bad)} inputs do not decode: {first_few([str(f) for f, _ in bad])})" if len(bad) > 1 else ""
        raise DataError(f"cannot read image {bad[0][0]}: {bad[0][1]}{more}; nothing was written")


def draw_detections(image: Tensor, boxes: Tensor, scores: Tensor, labels: Tensor, names: list[str], path: Path,
                    min_score: float = 0.3, gt_boxes: Tensor | None = None) -> Path:
    """Draw boxes on a ``(3, H, W)`` uint8 image and save a PNG.

    Args:
        image: ``(3, H, W)`` uint8.
        boxes: ``(D, 4)`` xyxy pixels of ``image``.
        scores: ``(D,)``; boxes under ``min_score`` are skipped.
        labels: ``(D,)`` class indices (-1: empty slot).
        names: class names by index.
        gt_boxes: ``(N, 4)`` ground truth, drawn thin white.
    """
    from PIL import Image, ImageDraw

    from fastvision.utils.files import atomic_write

    pil = Image.fromarray(image.detach().cpu().permute(1, 2, 0).contiguous().numpy())
    draw = ImageDraw.Draw(pil)
    if gt_boxes is not None:
        for b in gt_boxes.detach().cpu().tolist():
            draw.rectangle(b, outline=(255, 255, 255), width=1)
    on_host = [t.detach().cpu().tolist() for t in (boxes, scores, labels)]
    for b, s, c in zip(*on_host, strict=True):
        if c < 0 or s < min_score:
            continue
        colour = PALETTE[c % len(PALETTE)]
        draw.rectangle(b, outline=colour, width=2)
        name = names[c] if c < len(names) else str(c)
        draw.text((b[0] + 2, max(0.0, b[1] - 11)), f"{name} {s:.2f}", fill=colour)
    path = Path(path)
    atomic_write(path, lambda f: pil.save(f, format="PNG"))  # a stopped predict leaves no half-written picture
    return path
