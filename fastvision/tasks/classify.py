"""Image classification (ResNet on ImageNet / ImageFolder, pathology tumour patches).

Batches arrive as uint8 ``(B, 3, H, W)``: a quarter of float32's bytes on the host-to-device
link. ``to_device`` turns them into float in [0, 1] on the device (what the batched colour jitter
of :mod:`fastvision.data.augment.spatial` expects); ``forward`` normalises with the seed-004 mean/std
(DALI's CropMirrorNormalize values, in 0-255 units). MixUp (seed 004's 250-epoch recipe) mixes
the batch with a random permutation of itself under one Beta(a, a) weight per batch, as DLE's
``mixup.py`` does; weight and permutation are drawn on the device from the augmentation generator.

Metrics are sums (top-k hits, count, loss, and for binary tasks score histograms giving AUC), so
one all-reduce gives exact whole-set values across ranks.
"""
from __future__ import annotations

import csv
import io
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fastvision import distributed
from fastvision.errors import ConfigError
from fastvision.metrics import topk_correct
from fastvision.registry import TASKS
from fastvision.tasks.base import DeviceConstants, Evaluator, Task

log = logging.getLogger(__name__)

AUC_BINS = 8192  # score histogram bins over the logit of class 1's probability, in [-AUC_LOGIT, AUC_LOGIT]
AUC_LOGIT = 16.0  # beyond it float32 probabilities are 0 or 1 within 1.2e-7: ties for any AUC


def beta_symmetric(n: int, alpha: float, generator: torch.Generator | None, device: torch.device,
                   tries: int = 16) -> Tensor:
    """``n`` samples of Beta(alpha, alpha) without a host sync (Johnk's method, vectorised).

    ``X = U^(1/a), Y = V^(1/a)``; given ``X + Y <= 1``, ``X / (X + Y)`` is Beta(a, a). Each sample
    gets ``tries`` candidate pairs and keeps the first accepted one (for a <= 1 a pair is accepted
    with probability >= pi/4, so all 16 failing has probability < 1e-10; then 0.5 is used).
    """
    u = torch.rand(2, n, tries, generator=generator, device=device).pow(1.0 / alpha)
    s = u[0] + u[1]
    ok = s <= 1
    first = ok.float().argmax(1, keepdim=True)  # index of the first accepted pair
    lam = (u[0] / s.clamp_min(1e-12)).gather(1, first).squeeze(1)
    return torch.where(ok.any(1), lam, torch.full_like(lam, 0.5))


def check_mean_std(mean, std) -> None:
    """``task.args.mean`` / ``std``: three numbers each, in 0-255 units, std above 0. torchvision's and
    timm's 0-1 values (0.485, 0.456, 0.406 / 0.229, 0.224, 0.225) are refused with the 0-255 ones:
    taken as 0-255 values they subtract no mean and scale the images up 255 times, without a word."""
    for key, values in (("mean", mean), ("std", std)):
        if len(values) != 3:
            raise ConfigError(f"task.args.{key}={list(values)}: one value per RGB channel (3), in 0-255 units")
    if min(std) <= 0:
        raise ConfigError(f"task.args.std={list(std)}: each above 0 (0-255 units, seed 004: 58.395, 57.12, 57.385)")
    if max(*mean, *std) <= 1:
        raise ConfigError(f"task.args.mean={list(mean)}, std={list(std)}: in 0-255 units, as the images arrive "
                          f"(torchvision's 0-1 values times 255: mean={[round(m * 255, 3) for m in mean]}, "
                          f"std={[round(v * 255, 3) for v in std]})")


@TASKS.register("classification")
class ClassificationTask(Task):
    """Single-label classification.

    Args:
        num_classes: number of classes C.
        mixup: MixUp Beta parameter (seed 004: 0.2 for 250 epochs); 0 disables.
        image_size: side of the synthetic benchmark images.
        mean: per-channel mean in 0-255 units.
        std: per-channel std in 0-255 units.
        auc: also report the ROC AUC of class 1 (binary tasks, e.g. tumour vs normal).
        heatmap_patch: ``predict`` on a tiled TIFF writes a heat map with this patch size; 0 off.
        heatmap_stride: heat-map grid step in pixels (default the patch size).
        loss: the loss module, called with int64 labels ``(B,)`` or MixUp soft targets ``(B, C)``.
        augment: batched augmentation ``(image, None, generator) -> (image, None)`` or None.
        info: the dataset's ``info`` (``classes``: names by index, ``num_classes``), when built
            with a dataset; gives ``predict`` its class names.

    Raises:
        ConfigError: the dataset has more classes than ``num_classes`` (labels out of range).
    """

    primary_metric = "top1"
    higher_is_better = True
    unit_metrics = ("top1", "top5", "auc")
    predicts_tree = True  # predict takes every image under a folder (val/<class>/...): one CSV row per file

    def __init__(self, *, num_classes: int = 1000, mixup: float = 0.0, image_size: int = 224,
                 mean: list[float] = (123.68, 116.28, 103.53), std: list[float] = (58.395, 57.12, 57.385),
                 auc: bool = False, heatmap_patch: int = 0, heatmap_stride: int = 0,
                 loss: nn.Module, augment=None, info: dict | None = None):
        if mixup < 0:
            raise ConfigError(f"task.args.mixup={mixup}: the Beta(a, a) parameter of MixUp, > 0 (seed 004's "
                              "250 epochs: 0.2), or 0 for none")
        check_mean_std(mean, std)
        if getattr(loss, "reduction", "mean") != "mean":  # 'sum' scaled the LR by the batch, val_loss by it twice
            raise ConfigError(f"loss.args.reduction={loss.reduction}: classification trains on each batch's mean "
                              "loss (the LR is per image, at optim.ref_batch) and reports val_loss per image; "
                              "leave it 'mean'")
        self.num_classes, self.mixup, self.image_size = num_classes, float(mixup), image_size
        self.consts = DeviceConstants(mean=torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1) / 255,
                                      std=torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1) / 255)
        self.auc, self.heatmap_patch, self.heatmap_stride = auc, heatmap_patch, heatmap_stride or heatmap_patch
        self.loss_fn, self.augment_fn = loss, augment
        info = info or {}
        self.data_classes = int(info.get("num_classes", 0))  # the dataset's, where the build knows them
        if self.data_classes > num_classes:
            raise ConfigError(f"task.args.num_classes is {num_classes} but the dataset has {self.data_classes} "
                              f"classes; set task.args.num_classes and model.args.num_classes to {self.data_classes}")
        self.class_names = [str(c) for c in info.get("classes", [])] or [str(c) for c in range(num_classes)]

    def check_model(self, model: nn.Module) -> None:
        """The model's last linear layer (the head) gives ``num_classes`` scores, before any step or
        run folder: one line naming both keys (a smaller head stopped the first step with "Target 9
        is out of bounds", a larger ``task.args.num_classes`` than the head trained without a word); a
        head larger than the dataset's classes is one warning (timm trains it without a word)."""
        head = next((m for m in reversed(list(model.modules())) if isinstance(m, nn.Linear)), None)
        if head is not None and head.out_features != self.num_classes:
            raise ConfigError(f"model.args.num_classes gives a head of {head.out_features} classes but "
                              f"task.args.num_classes is {self.num_classes}; set both to the dataset's classes")
        have = self.data_classes
        if 0 < have < self.num_classes and distributed.is_main():  # scores no label names: only softmax mass
            log.warning("task.args.num_classes is %d but the dataset has %d classes: the head scores %d classes no "
                        "label names; set task.args.num_classes and model.args.num_classes to %d", self.num_classes,
                        have, self.num_classes - have, have)

    # -- input ---------------------------------------------------------------------
    def to_device(self, batch: dict[str, Any], device: torch.device, channels_last: bool = False) -> dict[str, Any]:
        """uint8 images travel as uint8 and become float [0, 1] on the device."""
        batch = super().to_device(batch, device, False)
        image = batch["image"]
        if image.dtype == torch.uint8:
            image = image.float().div_(255)
        if channels_last:
            image = image.contiguous(memory_format=torch.channels_last)
        return {**batch, "image": image}

    def normalise(self, image: Tensor) -> Tensor:
        """(B, 3, H, W) float in [0, 1] -> normalised; keeps the memory format."""
        c, d = self.consts, image.device
        return (image - c.get("mean", d)) / c.get("std", d)

    def augment(self, batch: dict[str, Any], generator: torch.Generator | None) -> dict[str, Any]:
        image = batch["image"]
        if self.augment_fn is not None:
            from fastvision.data.augment.keyed import SAMPLE_KEY

            keyed = {} if SAMPLE_KEY not in batch else {"keys": batch[SAMPLE_KEY]}  # train.augment_rng: sample
            image, _ = self.augment_fn(image, None, generator, **keyed)
        out = {**batch, "image": image}
        if self.mixup > 0:  # DLE: c = Beta(a, a) once, perm = randperm(B); x' = c x + (1 - c) x[perm]
            lam = beta_symmetric(1, self.mixup, generator, image.device)
            perm = torch.randperm(image.shape[0], generator=generator, device=image.device)
            w = lam.view(1, 1, 1, 1).to(image.dtype)
            out["image"] = w * image + (1 - w) * image[perm]
            onehot = nn.functional.one_hot(batch["label"], self.num_classes).float()
            out["soft_label"] = lam.view(1, 1) * onehot + (1 - lam.view(1, 1)) * onehot[perm]
        return out

    # -- model ---------------------------------------------------------------------
    def forward(self, model: nn.Module, batch: dict[str, Any]) -> Tensor:
        return model(self.normalise(batch["image"]))

    def eval_forward(self, model: nn.Module, batch: dict[str, Any]) -> Tensor:
        return self.forward(model, batch)

    def loss(self, outputs: Tensor, batch: dict[str, Any]) -> Tensor:
        return self.loss_fn(outputs, batch.get("soft_label", batch["label"]))

    def evaluator(self) -> Evaluator:
        return ClassEvaluator(self)

    def synthetic_batch(self, batch_size: int, device: torch.device) -> dict[str, Any]:
        """A batch as ``to_device`` leaves it: float [0, 1] images and int64 labels."""
        s = self.image_size
        return {"image": torch.rand(batch_size, 3, s, s, device=device),
                "label": torch.randint(0, self.num_classes, (batch_size,), device=device)}

    # -- prediction on files ---------------------------------------------------------
    @torch.no_grad()
    def predict_files(self, model: nn.Module, files: list[Path], out_dir: Path, cfg, device) -> list[Path]:
        """Tiled TIFF slides -> heat maps (``heatmap_patch`` > 0); other images -> ``predictions.csv``
        (file, class index, class name, probability of that class).

        Images are prepared as evaluation items are (resize + centre crop per ``data.args``).
        """
        from fastvision.data.formats.heatmap import check_slides, slide_heatmap, write_heatmap
        from fastvision.data.formats.imagefolder import load_crop
        from fastvision.inference.inputs import check_unique_names
        from fastvision.tasks.detect import check_images
        from fastvision.utils.files import atomic_write

        model.eval()
        args = cfg.data.args
        size = int(args.get("image_size", args.get("patch_size", self.image_size)))
        resize = int(args.get("resize_size", size))

        def probs(x: Tensor) -> Tensor:
            logits = self.forward(model, self.to_device({"image": x}, device))
            return logits.float().softmax(1)

        slides = [f for f in files if self.heatmap_patch and f.suffix.lower() in (".tif", ".tiff")]
        check_unique_names(slides, "{0}_heatmap.tif")  # the slides' heat maps, before any is written
        level = int(args.get("level", 0))  # slides are read at the level the model trained at
        downsample = check_slides(slides, self.heatmap_patch, level)  # each holds a patch: no half-written --out
        # every image decodes to its end, before the first: a truncated JPEG after them dropped the rows predicted
        check_images([f for f in files if f not in downsample])
        written, rows = [], []
        for f in files:
            if self.heatmap_patch and f.suffix.lower() in (".tif", ".tiff"):
                heat = slide_heatmap(f, lambda x: probs(x)[:, 1], self.heatmap_patch, self.heatmap_stride,
                                     level=level)
                ds = downsample[f]  # the record is in level-0 pixels, those of the masks froc reads
                written += list(write_heatmap(heat, out_dir / f"{f.stem}_heatmap", round(self.heatmap_stride * ds),
                                               round(self.heatmap_patch * ds)))
                continue
            arr = load_crop(str(f), False, size, resize, (1.0, 1.0), (1.0, 1.0), 0.0)
            p = probs(torch.from_numpy(arr).permute(2, 0, 1)[None].contiguous())[0].cpu()
            top = int(p.argmax())
            name = self.class_names[top] if top < len(self.class_names) else str(top)
            rows.append([str(f), top, name, f"{float(p[top]):.6f}"])
        if rows:
            path = out_dir / "predictions.csv"
            text = io.StringIO(newline="")
            csv.writer(text).writerows([["file", "class", "class_name", "probability"], *rows])
            atomic_write(path, lambda fh: fh.write(text.getvalue().encode()))  # never a half-written table
            written.append(path)
        return written


class ClassEvaluator(Evaluator):
    """Sums: [top-1 hits, top-5 hits, count, loss * weight, weight] (+ two AUC score histograms), the
    weight of a batch its count, or with ``loss.args.weight`` its labels' class weights: ``val_loss`` is then
    the weighted mean over the whole set, as torch's over all of it (not a mean of batch means, which
    moved with the validation batch size). ``top5`` is reported only with more than 5 classes (timm's
    reads 1 with 5 or fewer).

    The sums live on the device of the first batch, so updates never copy to the host.
    """

    def __init__(self, task: ClassificationTask):
        self.task = task
        self._size = 5 + (2 * AUC_BINS if task.auc else 0)
        self.sums = torch.zeros(self._size, dtype=torch.float64)

    def update(self, outputs: Tensor, batch: dict[str, Any]) -> None:
        label = batch["label"]
        if self.sums.device != label.device:
            self.sums = self.sums.to(label.device)  # first batch: nothing accumulated yet
        n = label.shape[0]
        hits = topk_correct(outputs, label, (1, 5)).double()
        loss = self.task.loss_fn(outputs.float(), label).detach().double()
        weight = getattr(self.task.loss_fn, "weight", None)  # a weighted mean divides by its labels' weights
        w = weight.double()[label].sum() if weight is not None else loss.new_tensor(float(n))
        self.sums[:5] += torch.stack([hits[0], hits[1], loss.new_tensor(float(n)), loss * w, w])
        if self.task.auc:  # binned on the logit: a confident model's probabilities crowd into 0.999-1
            out = outputs.float()
            logit = out[:, 1] - torch.logsumexp(torch.cat([out[:, :1], out[:, 2:]], 1), 1)  # of softmax[:, 1]
            bins = ((logit.nan_to_num(0.0) + AUC_LOGIT) * (AUC_BINS / (2 * AUC_LOGIT))).clamp_(0, AUC_BINS - 1).long()
            bins += AUC_BINS * (label == 1).long()
            self.sums[5:] += torch.bincount(bins, minlength=2 * AUC_BINS).double()

    def compute(self) -> dict[str, float]:
        s = self.sums.cpu()
        n = float(s[2])
        out = {"top1": float(s[0]) / n if n else float("nan"), "top5": float(s[1]) / n if n else float("nan"),
               "val_loss": float(s[3]) / float(s[4]) if n else float("nan")}
        if self.task.num_classes <= 5:  # every label is among the 5 best: top-5 would always read 1
            del out["top5"]
        if self.task.auc:
            out["auc"] = histogram_auc(s[5:5 + AUC_BINS].numpy(), s[5 + AUC_BINS:].numpy())
        return out


def histogram_auc(neg: np.ndarray, pos: np.ndarray) -> float:
    """ROC AUC from score histograms: P(score_pos > score_neg) + P(same bin) / 2.

    Equals the Mann-Whitney AUC exactly when no two scores of different classes share a bin.
    """
    n_neg, n_pos = neg.sum(), pos.sum()
    if n_neg == 0 or n_pos == 0:
        return float("nan")
    below = np.cumsum(neg) - neg  # negatives in strictly lower bins
    return float((pos * (below + 0.5 * neg)).sum() / (n_neg * n_pos))
