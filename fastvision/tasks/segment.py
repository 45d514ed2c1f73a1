"""Semantic segmentation (2-D and 3-D): softmax classes, a binary sigmoid channel, or
overlapping sigmoid regions (BraTS WT/TC/ET).

Metrics are exact over the whole validation set: confusion counts (or per-region tp/fp/fn) are
summed over batches and ranks before IoU and Dice are computed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from ..metrics import ConfusionMatrix, RegionCounts, dice_per_class, iou_per_class
from ..registry import TASKS
from .base import DeviceConstants, Evaluator, Task


@TASKS.register("segmentation")
class SegmentationTask(Task):
    """Batches are ``{"image": (B, C, *S) float, "label": (B, *S) int64}``.

    Args:
        num_classes: classes including background (2 for binary).
        mode: "softmax" (C = num_classes logits), "sigmoid" (one logit, binary) or "regions"
            (one sigmoid logit per entry of ``regions``).
        regions: label sets forming each region, e.g. ``[[1, 2, 3], [1, 3], [3]]`` for BraTS WT,
            TC, ET after the 4 -> 3 remap.
        sample_shape: (C, *S) of one input, for benchmark mode's synthetic batches.
        sliding_window: validation by sliding window: ``{roi_size, overlap, mode, sw_batch_size}``.
        loss: the loss module (built by the engine from the recipe's ``loss`` section).
        augment: callable ``(image, label, generator) -> (image, label)`` or None.
        info: the dataset's ``info`` (every task receives it; segmentation needs nothing from it).
    """

    primary_metric = "iou"
    higher_is_better = True

    def __init__(self, *, num_classes: int = 2, mode: Literal["softmax", "sigmoid", "regions"] = "softmax",
                 regions: list[list[int]] | None = None, sample_shape: list[int] = (1, 256, 256),
                 sliding_window: dict | None = None, loss: nn.Module, augment=None, info: dict | None = None):
        self.num_classes, self.mode, self.loss_fn, self.augment_fn = num_classes, mode, loss, augment
        self.regions = [list(r) for r in regions] if regions else None
        if mode == "regions" and not self.regions:
            from ..errors import ConfigError

            raise ConfigError("task.args.regions is required with task.args.mode=regions")
        if mode == "regions":
            self.primary_metric = "dice"
            lut = torch.zeros(max(256, 1 + max(max(r) for r in self.regions)), len(self.regions), dtype=torch.bool)
            for i, r in enumerate(self.regions):
                lut[r, i] = True
            self.consts = DeviceConstants(region_lut=lut)
        self.sample_shape = tuple(sample_shape)
        self.sliding_window = dict(sliding_window) if sliding_window else None

    # -- training ------------------------------------------------------------------
    def augment(self, batch: dict[str, Any], generator: torch.Generator | None) -> dict[str, Any]:
        if self.augment_fn is None:
            return batch
        image, label = self.augment_fn(batch["image"], batch["label"], generator)
        return {**batch, "image": image, "label": label}

    def target(self, label: Tensor) -> Tensor:
        """Loss target for the mode: class indices, or float masks shaped like the logits."""
        if self.mode == "softmax":
            return label
        if self.mode == "sigmoid":
            return (label > 0).unsqueeze(1).float()
        return self.region_masks(label).float()

    def region_masks(self, label: Tensor) -> Tensor:
        """(B, *S) labels -> (B, R, *S) bool region masks, by a (label id -> regions) lookup table."""
        return self.consts.get("region_lut", label.device)[label].movedim(-1, 1)

    def loss(self, outputs: Tensor, batch: dict[str, Any]) -> Tensor:
        return self.loss_fn(outputs, self.target(batch["label"]))

    # -- evaluation ----------------------------------------------------------------
    def eval_forward(self, model: nn.Module, batch: dict[str, Any]) -> Tensor:
        if self.sliding_window is None:
            return model(batch["image"])
        from ..inference import sliding_window_inference

        return sliding_window_inference(batch["image"], model=model, **self.sliding_window)

    def predict_labels(self, logits: Tensor) -> Tensor:
        """(B, C, *S) logits -> (B, *S) class indices (softmax / sigmoid) or (B, R, *S) bool."""
        if self.mode == "softmax":
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
        """Overlay PNGs: image in grey, ground truth outline green, prediction red."""
        from ..viz import overlay_png

        out_dir.mkdir(parents=True, exist_ok=True)
        pred = self.predict_labels(logits)
        if self.mode == "regions":
            pred = pred.any(1).long()
        paths = []
        for i in range(min(limit, pred.shape[0])):
            image, label, p = batch["image"][i], batch["label"][i], pred[i]
            if image.dim() == 4:  # 3-D: the axial slice with the most foreground
                z = int(label.flatten(1).sum(1).argmax()) if label.any() else label.shape[0] // 2
                image, label, p = image[:, z], label[z], p[z]
            name = batch.get("id", [str(i)] * pred.shape[0])[i]
            paths.append(overlay_png(image, label, p, out_dir / f"{name}_overlay.png"))
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
            from ..inference import predict_nifti_files

            return predict_nifti_files(self, model, files, out_dir, cfg, device)
        from ..data.formats.microscopy import IMAGE_EXTS, _to_channels, fit_size, read_array, to_unit_float
        from ..errors import DataError
        from ..viz import overlay_png

        args = {"image_size": [256, 256], "fit": "resize", "channels": 1, **cfg.data.args}
        size = tuple(args["image_size"])
        written = []
        model.eval()
        for f in files:
            if f.suffix.lower() not in IMAGE_EXTS:
                raise DataError(f"{f}: expected a PNG or TIFF image")
            arr = read_array(f)
            img = to_unit_float(arr)
            image = torch.from_numpy(img[None] if img.ndim == 2 else img.transpose(2, 0, 1).copy())
            image = _to_channels(image, args["channels"], f)
            h, w = image.shape[-2:]
            x, _ = fit_size(image, torch.zeros(h, w, dtype=torch.long), size, args["fit"])
            logits = self.eval_forward(model, {"image": x[None].to(device)}).float()
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
            out = out_dir / f"{f.stem}_mask{f.suffix.lower()}"
            if f.suffix.lower() == ".png":
                from PIL import Image

                Image.fromarray(mask).save(out)
            else:
                import tifffile

                tifffile.imwrite(out, mask)
            written += [out, overlay_png(image, None, pred, out_dir / f"{f.stem}_overlay.png")]
        return written

class SegEvaluator(Evaluator):
    """Confusion counts (softmax / sigmoid) or per-region tp/fp/fn (regions), plus loss sums.

    The sums live on the device of the first batch, so updates never copy to the host.
    """

    def __init__(self, task: SegmentationTask):
        self.task = task
        self._reset(torch.device("cpu"))

    def _reset(self, device: torch.device) -> None:
        regions = self.task.regions
        self.device = device
        self.counts = (RegionCounts(len(regions), device) if self.task.mode == "regions"
                       else ConfusionMatrix(self.task.num_classes, device))
        self.loss_sum = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of loss * n, n)

    def update(self, outputs: Tensor, batch: dict[str, Any]) -> None:
        label = batch["label"]
        if label.device != self.device:
            self._reset(label.device)  # first batch: nothing accumulated yet
        pred = self.task.predict_labels(outputs)
        if self.task.mode == "regions":
            self.counts.update(pred, self.task.region_masks(label))
        else:
            self.counts.update(pred, label)
        n = label.shape[0]
        loss = self.task.loss(outputs.float(), batch).detach().double()
        self.loss_sum += torch.stack([loss * n, loss.new_tensor(float(n))])

    def state(self) -> Tensor:
        return torch.cat([self.counts.state(), self.loss_sum])

    def load_state(self, state: Tensor) -> None:
        self._reset(state.device)
        self.counts.load_state(state[:-2])
        self.loss_sum = state[-2:].clone()

    def compute(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.task.mode == "regions":
            dice, iou = self.counts.dice().cpu(), self.counts.iou().cpu()
            for r, (d, j) in enumerate(zip(dice.tolist(), iou.tolist())):
                out[f"dice/{r}"], out[f"iou/{r}"] = d, j
        else:
            iou, dice = iou_per_class(self.counts).cpu()[1:], dice_per_class(self.counts).cpu()[1:]  # foreground
            if self.task.num_classes > 2:
                for c, (j, d) in enumerate(zip(iou.tolist(), dice.tolist()), start=1):
                    out[f"iou/{c}"], out[f"dice/{c}"] = j, d
        out["iou"], out["dice"] = float(np.nanmean(iou.numpy())), float(np.nanmean(dice.numpy()))
        n = float(self.loss_sum[1])
        out["val_loss"] = float(self.loss_sum[0]) / n if n else float("nan")
        return out
