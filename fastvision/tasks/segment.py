"""Semantic segmentation (2-D and 3-D): softmax classes, a binary sigmoid channel, or
overlapping sigmoid regions (BraTS WT/TC/ET).

Validation metrics (``SegEvaluator``): each case's Dice and IoU (and HD95 with ``hd95``) per
foreground class or region, averaged over cases (seed 000, seed 003 / MONAI ``DiceMetric``, BraTS,
nnU-Net), beside the pooled figures (tp/fp/fn summed over the whole set; seed 001's IoU). Both
are sums over cases, combined across ranks by one exact all-reduce (``metrics.cases.CaseSums``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import default_collate

from fastvision.ops.regions import region_lut, region_masks
from fastvision.registry import TASKS
from fastvision.tasks.base import DeviceConstants, Evaluator, Task
from fastvision.tasks.seg_eval import (  # noqa: F401 (SegEvaluator re-exported)
    SegEvaluator,
    check_sliding_window,
    check_val_window,
    foreground_of_two,
    validation_window,
)


@TASKS.register("segmentation")
class SegmentationTask(Task):
    """Batches are ``{"image": (B, C, *S) float, "label": (B, *S) int64}``.

    Args:
        num_classes: classes including background (2 for binary).
        mode: "softmax" (C = num_classes logits), "sigmoid" (one logit, binary) or "regions"
            (one sigmoid logit per entry of ``regions``).
        regions: label sets forming each region, e.g. ``[[1, 2, 3], [1, 3], [3]]`` for BraTS WT,
            TC, ET after the 4 -> 3 remap. Also with mode "softmax": regions scored from the argmax
            labels (BraTS WT/TC/ET of a per-label model, seed 000); then ``region_names`` is required.
        region_names: names used in the metric keys (``dice/WT``); default: the region's index.
        sample_shape: (C, *S) of one input, for benchmark mode's synthetic batches.
        sliding_window: validation by sliding window: ``{roi_size, overlap, mode, sw_batch_size, style}``;
            ``style``: ``monai`` (MONAI's window placement and Gaussian) or ``nnunet`` (nnU-Net v2's predictor:
            its evenly spread windows and Gaussian; ``predict`` also resamples logits, not probabilities, back
            to each file's grid). The windows see the arrays as training did (RAS) in both.
        val_window: the window of validation (with ``sliding_window``; ``predict`` keeps the recipe's):
            ``roi`` its ``roi_size``; ``whole`` one forward per volume, the volume padded up to the
            model's divisor; ``halves`` two windows in one batch, each half the longest axis (the
            CPU's batch-1 convolutions are slow); a voxel count: ``whole`` where the padded volume
            has at most that many voxels, else ``roi`` (:func:`~fastvision.tasks.seg_eval.validation_window`).
        eval: ``sliding_window`` (or one plain forward without ``sliding_window``), or ``crop``:
            seed 000's single forward on the centre ``eval_crop`` of each volume (cropped or
            zero-padded per axis); voxels outside the crop are predicted background.
        eval_crop: spatial size of the ``crop`` evaluation (seed 000: 224 x 224 x 160).
        average: what the unsuffixed ``dice`` / ``iou`` are: ``case``: the mean over cases of each
            case's score (pooled kept as ``dice_pooled``), or ``pooled``: tp/fp/fn summed over the
            whole set (seed 001's IoU; per-case kept as ``dice_case``).
        empty: score of a case whose truth is empty for a class: ``ignore`` (MONAI
            ``ignore_empty``: left out), ``one`` (BraTS: 1 if the prediction is empty too, else 0)
            or ``zero`` (seed 000's TF code).
        hd95: also the per-case 95th-percentile Hausdorff distance, in mm where the data has a voxel
            size (the preprocessing's target spacing, else the case's own), else in voxels (pixels);
            cases where the prediction or the truth is empty are left out of it.
        val_loss: also compute the loss in validation (``val_loss``). ``false`` saves the loss on
            every validation volume (~5 ms per 50x50x36 volume on one CPU thread); nothing
            else reads it unless the recipe targets it (``train.target=val_loss=...``, then refused
            as not a metric of the run). The other metrics do not change.
        loss: the loss module (built by the engine from the recipe's ``loss`` section).
        augment: callable ``(image, label, generator) -> (image, label)`` or None.
        info: the dataset's ``info`` (every task receives it; segmentation needs nothing from it).
    """

    primary_metric = "iou"
    higher_is_better = True
    # fractions in [0, 1], per class too (dice/WT): --target dice=90 is refused (hd95 is a distance)
    unit_metrics = ("dice", "iou", "dice_case", "iou_case", "dice_pooled", "iou_pooled")

    def __init__(self, *, num_classes: int = 2, mode: Literal["softmax", "sigmoid", "regions"] = "softmax",
                 regions: list[list[int]] | None = None, region_names: list[str] | None = None,
                 sample_shape: list[int] = (1, 256, 256), sliding_window: dict | None = None,
                 eval: Literal["sliding_window", "crop"] = "sliding_window", eval_crop: list[int] | None = None,
                 average: Literal["case", "pooled"] = "case", empty: Literal["ignore", "one", "zero"] = "ignore",
                 hd95: bool = False, val_loss: bool = True, val_window: str | int = "roi", loss: nn.Module,
                 augment=None, info: dict | None = None):
        from fastvision.errors import ConfigError

        self.num_classes, self.mode, self.loss_fn, self.augment_fn = num_classes, mode, loss, augment
        self.regions = [list(r) for r in regions] if regions else None
        if mode == "regions" and not self.regions:
            raise ConfigError("task.args.regions is required with task.args.mode=regions")
        # the label classes: the data's (any mode), else the softmax model's; an id past them is a region never
        # present (scored 1 or left out, without a word), 0 puts the background in the region
        known = (info or {}).get("num_classes") or (num_classes if mode == "softmax" else None)
        if any(not r or not all(0 < int(i) < (known or 2**15) for i in r) for r in self.regions or ()):
            raise ConfigError(f"task.args.regions {self.regions}: each region a non-empty list of class ids "
                              + (f"1..{known - 1} (the data's classes: {known}, background 0)" if known else
                                 "above 0 (the background)"))
        if self.regions and mode == "sigmoid":
            raise ConfigError("task.args.regions: use mode=regions (one sigmoid per region) or mode=softmax")
        if region_names is not None and (not self.regions or len(region_names) != len(self.regions)):
            raise ConfigError("task.args.region_names: one name per entry of task.args.regions")
        if self.regions and mode == "softmax" and region_names is None:
            raise ConfigError("task.args.region_names is required with regions in softmax mode (keys dice/<name>)")
        self.region_names = list(region_names) if region_names else None
        self.eval_mode, self.average, self.empty, self.hd95 = eval, average, empty, hd95
        if not isinstance(val_loss, bool):
            raise ConfigError(f"task.args.val_loss must be true or false, got {val_loss!r}")
        self.val_loss, self.val_window = val_loss, check_val_window(val_window)
        self.eval_crop = tuple(eval_crop) if eval_crop else None
        if eval == "crop" and self.eval_crop is None:
            raise ConfigError("task.args.eval=crop needs task.args.eval_crop, e.g. [224, 224, 160]")
        if self.regions:
            self.primary_metric = "dice"
            self.consts = DeviceConstants(region_lut=region_lut(self.regions))
        self.sample_shape = tuple(sample_shape)
        self.sliding_window = check_sliding_window(sliding_window or None)
        spacing = ((info or {}).get("preprocess") or {}).get("target_spacing") or (info or {}).get("spacing")
        self.spacing = tuple(float(s) for s in spacing) if spacing else None  # the voxel size the overlays draw
        # an nnU-Net v2 run: predict groups {case}_XXXX channel files by case and writes {case}{file_ending}
        self.channel_files = ((info or {}).get("label_convention") or {}).get("file_ending")

    # -- training ------------------------------------------------------------------
    def check_model(self, model: nn.Module) -> None:
        """The model's logits (a U-Net's or SegResNet's ``out_channels``) are what the task reads: one per class
        (softmax), per region (``mode: regions``) or one (sigmoid). Before any step or run folder, one line
        naming both keys: ``task.args.num_classes: 3`` beside a 4-channel BraTS model trained and scored
        without a word (the argmax's label 3 was never scored)."""
        from fastvision.errors import ConfigError

        have = getattr(model, "out_channels", None)
        if self.mode == "regions":
            want, key = len(self.regions), f"task.args.regions ({len(self.regions)} regions, mode regions)"
        elif self.mode == "sigmoid":
            want, key = 1, "task.args.mode=sigmoid (one logit)"
        else:
            want, key = self.num_classes, f"task.args.num_classes={self.num_classes} (mode softmax)"
        if isinstance(have, int) and have != want:
            raise ConfigError(f"model.args.out_channels={have} but {key} reads {want} channel(s); set them alike")
        self._check_loss(want)

    def _check_loss(self, channels: int) -> None:
        """The loss once on a tiny all-background batch of ``channels`` logits: a setting it refuses only at its
        first call (``loss.args.weight`` of another length than the channels, ``label_smoothing`` out of [0, 1])
        is one line naming loss.args before any step or run folder, not the first step's error."""
        from fastvision.errors import ConfigError

        space = [2] * (len(self.sample_shape) - 1)
        where = next((b.device for b in self.loss_fn.buffers()), torch.device("cpu"))  # its class weights' device
        try:
            with torch.no_grad():
                label = torch.zeros(1, *space, dtype=torch.long, device=where)
                self.loss_fn(torch.zeros(1, channels, *space, device=where), self.target(label))
        except (ValueError, RuntimeError, IndexError) as e:
            raise ConfigError(f"loss.args: {str(e).splitlines()[0]} (the loss on the model's {channels} "
                              "channel(s))") from e

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """``default_collate``; an item holding several patches of one volume (``data.args.num_samples``:
        :data:`~fastvision.data.transforms.SAMPLES_KEY`) gives them as consecutive rows."""
        from fastvision.data.transforms import SAMPLES_KEY

        if items and SAMPLES_KEY in items[0]:
            items = [p for item in items for p in item[SAMPLES_KEY]]
        return default_collate(items)

    def augment(self, batch: dict[str, Any], generator: torch.Generator | None) -> dict[str, Any]:
        if self.augment_fn is None:
            return batch
        from fastvision.data.augment.keyed import SAMPLE_KEY

        keyed = {} if SAMPLE_KEY not in batch else {"keys": batch[SAMPLE_KEY]}  # train.augment_rng: sample
        image, label = self.augment_fn(batch["image"], batch["label"], generator, **keyed)
        return {**batch, "image": image, "label": label}

    def target(self, label: Tensor) -> Tensor:
        """Loss target for the mode: class indices, or float masks shaped like the logits."""
        if self.mode == "softmax":
            return label
        if self.mode == "sigmoid":
            return (label > 0).unsqueeze(1).float()
        return self.region_masks(label).float()

    def region_masks(self, label: Tensor) -> Tensor:
        """(B, *S) labels -> (B, R, *S) bool region masks (:func:`fastvision.ops.regions.region_masks`)."""
        return region_masks(label, self.consts.get("region_lut", label.device))

    def loss(self, outputs: Tensor | list[Tensor], batch: dict[str, Any]) -> Tensor:
        """The loss of the logits; a list (a deep-supervised model in training: full resolution first)
        gets nnU-Net's scale weights against the label downsampled to each scale."""
        if isinstance(outputs, (list, tuple)):
            from fastvision.losses.compound import DeepSupervisionLoss

            return DeepSupervisionLoss(self.loss_fn)(outputs, self.target(batch["label"]))
        return self.loss_fn(outputs, self.target(batch["label"]))

    # -- evaluation ----------------------------------------------------------------
    def eval_forward(self, model: nn.Module, batch: dict[str, Any]) -> Tensor:
        """Validation logits: the crop, one plain forward, or the sliding window that
        ``val_window`` picks for the volume."""
        return self._forward(model, batch["image"], validation=True)

    def _forward(self, model: nn.Module, image: Tensor, validation: bool) -> Tensor:
        if self.eval_mode == "crop":
            return self._crop_forward(model, image)
        if self.sliding_window is None:
            return model(image)
        from fastvision.inference.window import sliding_window_inference

        window = self.sliding_window
        if validation and self.val_window != "roi":
            window = validation_window(window, tuple(image.shape[2:]), model, self.val_window)
        return sliding_window_inference(image, model=model, **window)

    def _crop_forward(self, model: nn.Module, image: Tensor) -> Tensor:
        """One forward on the centre crop (zero-padded where the volume is smaller) of size
        ``eval_crop``; the logits are put back in place, background everywhere else."""
        spatial = image.shape[2:]
        if len(self.eval_crop) != len(spatial):
            from fastvision.errors import ConfigError

            raise ConfigError(f"task.args.eval_crop {list(self.eval_crop)} does not match {len(spatial)}-D images")
        src, dst = [], []
        for n, m in zip(spatial, self.eval_crop, strict=True):
            lo = max(0, (n - m) // 2)
            k = min(n, m)
            src.append(slice(lo, lo + k))
            off = max(0, (m - n) // 2)
            dst.append(slice(off, off + k))
        x = image.new_zeros(*image.shape[:2], *self.eval_crop)
        x[(Ellipsis, *dst)] = image[(Ellipsis, *src)]
        logits = model(x).float()
        out = logits.new_full((logits.shape[0], logits.shape[1], *spatial), -20.0)
        if self.mode == "softmax":
            out[:, 0] = 20.0  # background wins the argmax outside the crop
        out[(Ellipsis, *src)] = logits[(Ellipsis, *dst)]
        return out

    def predict_labels(self, logits: Tensor) -> Tensor:
        """(B, C, *S) logits -> (B, *S) class indices (softmax / sigmoid) or (B, R, *S) bool."""
        if self.mode == "softmax":
            if logits.shape[1] == 2:  # the argmax of two logits, as one compare (cheaper than argmax)
                return foreground_of_two(logits).long()
            return logits.argmax(1)
        if self.mode == "sigmoid":
            return (logits[:, 0] > 0).long()
        return logits > 0

    def evaluator(self) -> Evaluator:
        return SegEvaluator(self)

    def synthetic_batch(self, batch_size: int, device: torch.device) -> dict[str, Any]:
        c, *spatial = self.sample_shape
        return {"image": torch.randn(batch_size, c, *spatial, device=device),
                "label": torch.randint(0, self.num_classes, (batch_size, *spatial), device=device)}

    # -- pictures ------------------------------------------------------------------
    def save_examples(self, logits: Tensor, batch: dict[str, Any], out_dir: Path, limit: int) -> list[Path]:
        """Overlay PNGs: image in grey, ground truth outline green, prediction red; a 3-D case is cut
        in the plane of its two finest axes (:func:`finest_plane`) at the voxel aspect."""
        from fastvision.inference.overlays import overlay_png

        out_dir.mkdir(parents=True, exist_ok=True)
        pred = self.predict_labels(logits)
        if self.mode == "regions":
            pred = pred.any(1).long()
        paths = []
        for i in range(min(limit, pred.shape[0])):
            image, label, p, pixel = batch["image"][i], batch["label"][i], pred[i], (1.0, 1.0)
            if image.dim() == 4:
                spacing = self.spacing
                if spacing is None and "spacing" in batch:  # a dataset without a target spacing
                    spacing = tuple(batch["spacing"][i].tolist())
                image, label, p, pixel = finest_plane(image, label, p, spacing)
            name = batch.get("id", [str(i)] * pred.shape[0])[i]
            paths.append(overlay_png(image, label, p, out_dir / f"{name}_overlay.png", pixel))
        return paths


    # -- prediction on files ----------------------------------------------------------
    @torch.no_grad()
    def predict_files(self, model: nn.Module, files: list[Path], out_dir: Path, cfg, device) -> list[Path]:
        """2-D images (PNG/TIFF) -> a mask per input in the same format, plus an overlay PNG.

        The image is prepared exactly as the microscopy dataset prepares training images (unit
        scaling, channels, resize or pad to ``data.args.image_size``); logits are mapped back to
        the original size before the argmax, so masks match the input pixel for pixel.
        """
        if any(f.is_dir() or f.name.endswith((".nii", ".nii.gz")) for f in files):  # volumes: 3-D path
            from fastvision.inference.nifti import predict_nifti_files

            return predict_nifti_files(self, model, files, out_dir, cfg, device)
        from fastvision.data.formats.microscopy import _to_channels, fit_size, read_array, to_unit_float
        from fastvision.data.formats.microscopy_files import IMAGE_EXTS, file_stem
        from fastvision.data.nonfinite import NonFinite
        from fastvision.errors import DataError
        from fastvision.inference.inputs import check_unique_names
        from fastvision.inference.overlays import overlay_png

        check_unique_names(files, "{0}_mask.* and {0}_overlay.png", file_stem)  # before any file is written
        for f in files:  # a JPEG among the inputs: said before the first mask is written, not after
            if f.suffix.lower() not in IMAGE_EXTS:
                raise DataError(f"{f}: expected a PNG or TIFF image (the formats a microscopy run reads)")
        args = {"image_size": [256, 256], "fit": "resize", "channels": 1, **cfg.data.args}
        size = tuple(args["image_size"])
        finite = NonFinite(str(args.get("nonfinite", "error")))  # a NaN input: the run's policy, as in training
        written = []
        model.eval()
        for f in files:
            arr = finite(read_array(f), f)
            img = to_unit_float(arr)
            image = torch.from_numpy(img[None] if img.ndim == 2 else img.transpose(2, 0, 1).copy())
            image = _to_channels(image, args["channels"], f)
            h, w = image.shape[-2:]
            x, _ = fit_size(image, torch.zeros(h, w, dtype=torch.long), size, args["fit"])
            logits = self._forward(model, x[None].to(device), validation=False).float()  # the recipe's window
            if args["fit"] == "pad":  # undo the padding, then the shrink (if any)
                scale = min(1.0, size[0] / h, size[1] / w)
                logits = logits[..., : max(1, int(h * scale)), : max(1, int(w * scale))]
            logits = torch.nn.functional.interpolate(logits, size=(h, w), mode="bilinear", align_corners=False)
            pred = self.predict_labels(logits)[0]
            if self.mode == "regions":
                pred = pred.any(0).long()
            mask = pred.cpu().numpy().astype(np.uint8)
            if self.num_classes == 2:
                mask = mask * 255  # binary masks saved as 0/255, like the input masks
            stem = file_stem(f)  # a.ome.tif -> a_mask.tif
            out = _write_mask(mask, out_dir / f"{stem}_mask{f.suffix.lower()}")
            written += [out, overlay_png(image, None, pred, out_dir / f"{stem}_overlay.png")]
        return written


def _write_mask(mask: np.ndarray, out: Path) -> Path:
    """A (H, W) uint8 mask as PNG or TIFF (``out``'s suffix), atomically: a stopped predict leaves no half-written
    mask. TIFF goes through memory: tifffile reads the name of a file it is given, an open temp file's is a number."""
    import io

    from fastvision.utils.files import atomic_write

    buf = io.BytesIO()
    if out.suffix == ".png":
        from PIL import Image

        Image.fromarray(mask).save(buf, format="PNG")
    else:
        import tifffile

        tifffile.imwrite(buf, mask)
    atomic_write(out, lambda fh: fh.write(buf.getvalue()))
    return out


def finest_plane(image: Tensor, label: Tensor, pred: Tensor, spacing: tuple[float, ...] | None):
    """The slice of a RAS (X, Y, Z) case in the plane of its two finest axes (axial for CT and
    thick-slice MR; a tie keeps X, Y) through the most foreground (truth, else prediction, else the
    middle); rows run along the later axis flipped (anterior / superior up), columns along the earlier.

    Args:
        image: (C, X, Y, Z); label, pred: (X, Y, Z) (label may be class ids or a region mask).
        spacing: voxel size (3,) in mm; None: isotropic.

    Returns:
        (image (C, H, W), label (H, W), pred (H, W), (pixel height, pixel width) in mm).
    """
    spacing = tuple(spacing) if spacing else (1.0, 1.0, 1.0)
    cut = max(range(3), key=lambda a: (spacing[a], a))  # the coarsest axis; on a tie the last (Z)
    a, b = [d for d in range(3) if d != cut]
    fg = label if label.any() else pred
    k = int((fg > 0).sum(dim=[d for d in range(3) if d != cut]).argmax()) if fg.any() else label.shape[cut] // 2

    def plane(x: Tensor) -> Tensor:  # (..., X, Y, Z) -> (..., rows = b flipped, cols = a)
        s = x.select(x.dim() - 3 + cut, k)
        return s.transpose(-1, -2).flip(-2)

    return plane(image), plane(label), plane(pred), (spacing[b], spacing[a])
