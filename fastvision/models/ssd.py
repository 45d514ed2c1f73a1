"""SSD320 v1.2 (seed 002): a RetinaNet-style single-shot detector on a ResNet + FPN.

The story, top to bottom: frozen BN, the FPN over levels 3-7, the weight-shared predictor, the
model (outputs logits, box codes and its anchors), the loss (sigmoid focal normalised by the
number of matches, smooth-L1 by matches x code size 4, as the seed's config), post-processing
(score threshold, batched NMS, top 100), then the registered variants ``ssd320`` (ResNet-50,
depth 256, as the TF config) and ``ssd320-small`` (ResNet-18, depth 64, two tower layers: trains
on a CPU).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastvision.losses import sigmoid_focal_loss
from fastvision.models.resnet import build_resnet
from fastvision.ops.boxes import (
    BoxCoder,
    batched_nms,
    clip_boxes,
    match_anchors,
    multiscale_anchors,
    smooth_l1,
)
from fastvision.registry import MODELS

LEVELS = (3, 4, 5, 6, 7)
# TF config: BN decay 0.997 (PyTorch momentum = 1 - decay), eps 1e-3.
BN_MOMENTUM, BN_EPS = 0.003, 1e-3


class FrozenBatchNorm2d(nn.Module):
    """BatchNorm with fixed statistics and affine parameters (buffers, not parameters).

    Keeps the ``weight/bias/running_mean/running_var`` names so state dicts load unchanged.
    """

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        for name, value in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_buffer(name, torch.full((num_features,), value))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.pop(prefix + "num_batches_tracked", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale[None, :, None, None].to(x.dtype) + shift[None, :, None, None].to(x.dtype)


def freeze_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every ``BatchNorm2d`` in ``module`` by a :class:`FrozenBatchNorm2d` with its values."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            frozen = FrozenBatchNorm2d(child.num_features, child.eps)
            for key in ("weight", "bias", "running_mean", "running_var"):
                getattr(frozen, key).copy_(getattr(child, key).detach())
            setattr(module, name, frozen)
        else:
            freeze_batchnorm(child)
    return module


def _conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout, eps=BN_EPS, momentum=BN_MOMENTUM),
        nn.ReLU6(inplace=True),
    )


class FPN(nn.Module):
    """Feature pyramid P3-P7 from C3-C5, as TF's ``ssd_resnet_v1_fpn`` builds it.

    1x1 laterals; P5 is the C5 lateral, P4/P3 add the nearest-upsampled coarser level and pass a
    3x3 conv-BN-ReLU6; P6 and P7 are stride-2 3x3 conv-BN-ReLU6 on P5 and P6.

    Args:
        in_channels: channels of C3, C4, C5.
        depth: channels of every output level.
    """

    def __init__(self, in_channels: tuple[int, int, int], depth: int):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, depth, 1) for c in in_channels)
        self.smooth = nn.ModuleList(_conv_bn(depth, depth) for _ in in_channels[:-1])
        self.p6 = _conv_bn(depth, depth, stride=2)
        self.p7 = _conv_bn(depth, depth, stride=2)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):  # TF config: truncated normal, std 0.03
                nn.init.trunc_normal_(m.weight, std=0.03, a=-0.06, b=0.06)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, feats: list[Tensor]) -> list[Tensor]:
        """``[C3, C4, C5]`` -> ``[P3, ..., P7]``, each ``(B, depth, H/2**l, W/2**l)`` (ceil)."""
        top = self.lateral[-1](feats[-1])
        outs = [top]
        for i in range(len(feats) - 2, -1, -1):
            lat = self.lateral[i](feats[i])
            top = lat + F.interpolate(top, size=lat.shape[-2:], mode="nearest")
            outs.insert(0, self.smooth[i](top))
        p6 = self.p6(outs[-1])
        return outs + [p6, self.p7(p6)]


class SharedHead(nn.Module):
    """Weight-shared predictor: separate box and class towers whose convs are shared by all levels.

    As in TF's ``WeightSharedConvolutionalBoxPredictor``, conv weights are shared across levels
    while each level keeps its own BatchNorm (feature statistics differ by scale).

    Args:
        depth: input and tower channels.
        num_anchors: anchors per location (6).
        num_classes: foreground classes (sigmoid outputs, no background logit).
        num_layers: tower depth (4 in the TF config).
        num_levels: pyramid levels (5).
    """

    def __init__(self, depth: int, num_anchors: int, num_classes: int, num_layers: int = 4, num_levels: int = 5):
        super().__init__()
        self.num_classes = num_classes
        self.box_convs = nn.ModuleList(nn.Conv2d(depth, depth, 3, padding=1, bias=False) for _ in range(num_layers))
        self.cls_convs = nn.ModuleList(nn.Conv2d(depth, depth, 3, padding=1, bias=False) for _ in range(num_layers))

        def norms() -> nn.ModuleList:
            return nn.ModuleList(
                nn.ModuleList(nn.BatchNorm2d(depth, eps=BN_EPS, momentum=BN_MOMENTUM) for _ in range(num_layers))
                for _ in range(num_levels)
            )

        self.box_norms, self.cls_norms = norms(), norms()
        self.box_pred = nn.Conv2d(depth, num_anchors * 4, 3, padding=1)
        self.cls_pred = nn.Conv2d(depth, num_anchors * num_classes, 3, padding=1)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, std=0.01)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        # Prior probability 0.01 for every class, so focal loss starts near the background answer.
        nn.init.constant_(self.cls_pred.bias, -math.log((1 - 0.01) / 0.01))

    @staticmethod
    def _tower(x: Tensor, convs: nn.ModuleList, norms: nn.ModuleList) -> Tensor:
        for conv, norm in zip(convs, norms, strict=True):
            x = F.relu6(norm(conv(x)))
        return x

    def forward(self, feats: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Per-level maps -> ``(cls_logits (B, A, K), box_codes (B, A, 4))``, A ordered level, y, x, anchor."""
        cls_out, box_out = [], []
        B = feats[0].shape[0]
        for lvl, x in enumerate(feats):
            c = self.cls_pred(self._tower(x, self.cls_convs, self.cls_norms[lvl]))
            b = self.box_pred(self._tower(x, self.box_convs, self.box_norms[lvl]))
            cls_out.append(c.permute(0, 2, 3, 1).reshape(B, -1, self.num_classes))
            box_out.append(b.permute(0, 2, 3, 1).reshape(B, -1, 4))
        return torch.cat(cls_out, 1), torch.cat(box_out, 1)


class SSD(nn.Module):
    """ResNet backbone + FPN + shared head; returns raw outputs and the anchors they refer to.

    Args:
        backbone: module with ``forward_features(x) -> [C3, C4, C5]`` and ``feature_channels``.
        num_classes: foreground classes.
        depth: FPN and head channels.
        head_layers: conv layers per tower.
        anchor_scale, aspect_ratios, scales_per_octave: anchor generator settings.
        bn_momentum: running-statistics momentum of the FPN and head BatchNorms (TF's decay 0.997
            is 0.003: right for 12,500 steps, but a few hundred steps leave the eval statistics
            near their initial values, so short runs want PyTorch's 0.1).
    """

    def __init__(self, backbone: nn.Module, num_classes: int, depth: int = 256, head_layers: int = 4,
                 anchor_scale: float = 4.0, aspect_ratios: tuple[float, ...] = (1.0, 2.0, 0.5),
                 scales_per_octave: int = 2, bn_momentum: float = BN_MOMENTUM):
        super().__init__()
        self.backbone = backbone
        self.fpn = FPN(tuple(backbone.feature_channels), depth)
        self.anchor_args = dict(levels=LEVELS, anchor_scale=anchor_scale, aspect_ratios=tuple(aspect_ratios),
                                scales_per_octave=scales_per_octave)
        num_anchors = len(aspect_ratios) * scales_per_octave
        self.head = SharedHead(depth, num_anchors, num_classes, head_layers, len(LEVELS))
        for m in [*self.fpn.modules(), *self.head.modules()]:
            if isinstance(m, nn.BatchNorm2d):
                m.momentum = bn_momentum
        self.num_classes = num_classes
        self._anchor_cache: dict[tuple, Tensor] = {}

    def anchors(self, image_size: tuple[int, int], grid_sizes: list[tuple[int, int]], device: torch.device) -> Tensor:
        """``(A, 4)`` xyxy anchors for an input size, cached (they depend only on shapes)."""
        key = (tuple(image_size), tuple(grid_sizes), str(device))
        if getattr(torch.compiler, "is_exporting", lambda: False)() or torch.jit.is_tracing():  # constants of the
            # exported graph, not a module attribute set while tracing (torch.export warns about that one)
            return multiscale_anchors(image_size, grid_sizes=grid_sizes, device=device, **self.anchor_args)
        if key not in self._anchor_cache:
            self._anchor_cache[key] = multiscale_anchors(image_size, grid_sizes=grid_sizes, device=device,
                                                         **self.anchor_args)
        return self._anchor_cache[key]

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        """Raw detector outputs.

        Args:
            x: normalised images ``(B, 3, H, W)``.

        Returns:
            ``{"cls_logits": (B, A, K), "box_codes": (B, A, 4), "anchors": (A, 4)}``.
        """
        feats = self.fpn(self.backbone.forward_features(x))
        cls_logits, box_codes = self.head(feats)
        grids = [tuple(f.shape[-2:]) for f in feats]
        return {"cls_logits": cls_logits, "box_codes": box_codes,
                "anchors": self.anchors(tuple(x.shape[-2:]), grids, x.device)}


def ssd_loss(outputs: dict[str, Tensor], boxes: Tensor, labels: Tensor, iscrowd: Tensor | None = None,
             alpha: float = 0.25, gamma: float = 2.0, iou_threshold: float = 0.5,
             coder: BoxCoder | None = None) -> dict[str, Tensor]:
    """Sigmoid focal loss + smooth-L1, summed and normalised as seed 002's TF config.

    The focal term is divided by the number of matched anchors (``normalize_loss_by_num_matches``),
    the smooth-L1 term by matches x the box code size, 4 (``normalize_loc_loss_by_codesize``): the
    box term is the mean over the 4 coordinates of a matched anchor, not their sum.
    Ignored anchors (inside crowd boxes) contribute to neither term. No host syncs.

    Args:
        outputs: :meth:`SSD.forward` outputs.
        boxes: ``(B, M, 4)`` padded ground-truth boxes, xyxy pixels of the network input.
        labels: ``(B, M)`` contiguous class indices, ``-1`` for padding.
        iscrowd: ``(B, M)`` bool.

    Returns:
        ``{"loss", "cls_loss", "box_loss", "num_matches"}`` scalars (float32).
    """
    coder = coder or BoxCoder()
    cls_logits, box_codes, anchors = outputs["cls_logits"], outputs["box_codes"], outputs["anchors"]
    if labels.shape[1] == 0:  # a batch of empty images: one padding row keeps the gathers valid
        boxes, labels = boxes.new_zeros(labels.shape[0], 1, 4), labels.new_full((labels.shape[0], 1), -1)
        iscrowd = None
    matches = match_anchors(anchors, boxes.float(), labels, iscrowd, iou_threshold)  # (B, A)
    pos = matches >= 0
    num = pos.sum().clamp(min=1).float()
    idx = matches.clamp(min=0)
    matched_labels = labels.gather(1, idx)
    K = cls_logits.shape[-1]
    # one-hot by comparison: F.one_hot range-checks its input with a host read off CUDA
    classes = torch.arange(K, device=matched_labels.device)
    target = (matched_labels.clamp(min=0)[..., None] == classes).to(torch.float32) * pos[..., None]
    cls = sigmoid_focal_loss(cls_logits, target, alpha, gamma, reduction="none")
    cls_loss = (cls * (matches != -2)[..., None]).sum() / num
    matched_boxes = boxes.float().gather(1, idx[..., None].expand(-1, -1, 4))
    box_target = coder.encode(matched_boxes, anchors)
    reg = smooth_l1(box_codes.float(), box_target, 1.0).sum(-1)
    box_loss = torch.where(pos, reg, torch.zeros_like(reg)).sum() / (num * box_codes.shape[-1])
    return {"loss": cls_loss + box_loss, "cls_loss": cls_loss, "box_loss": box_loss, "num_matches": num}


def _detect(logits: Tensor, codes: Tensor, anchors: Tensor, image_size: tuple[int, int], score_threshold: float,
            iou_threshold: float, max_detections: int, k: int, coder: BoxCoder) -> tuple[dict[str, Tensor], Tensor]:
    """Detections from the ``k`` best (anchor, class) candidates of each image, and how many survived NMS."""
    B, A, K = logits.shape
    scores = torch.sigmoid(logits).reshape(B, A * K)
    top_scores, top_idx = scores.topk(k, dim=1)
    anchor_idx, classes = top_idx // K, top_idx % K
    cand_codes = codes.gather(1, anchor_idx[..., None].expand(B, k, 4))
    cand_boxes = clip_boxes(coder.decode(cand_codes, anchors[anchor_idx]), image_size)
    valid = (top_scores > score_threshold) & (cand_boxes[..., 2] > cand_boxes[..., 0]) & (
        cand_boxes[..., 3] > cand_boxes[..., 1])
    keep = batched_nms(cand_boxes, top_scores, classes, iou_threshold, valid)
    kept_scores = top_scores.masked_fill(~keep, -1.0)
    d = min(max_detections, k)
    best, order = kept_scores.topk(d, dim=1)
    ok = best > 0
    out_boxes = cand_boxes.gather(1, order[..., None].expand(B, d, 4)) * ok[..., None]
    out_labels = torch.where(ok, classes.gather(1, order), torch.full_like(order, -1))
    out = {"boxes": out_boxes, "scores": best.clamp(min=0), "labels": out_labels}
    if d < max_detections:  # tiny inputs: pad to the fixed shape
        pad = max_detections - d
        out = {"boxes": F.pad(out["boxes"], (0, 0, 0, pad)), "scores": F.pad(out["scores"], (0, pad)),
               "labels": F.pad(out["labels"], (0, pad), value=-1)}
    return out, keep.sum(1)


@torch.no_grad()
def postprocess(outputs: dict[str, Tensor], image_size: tuple[int, int], score_threshold: float = 1e-8,
                iou_threshold: float = 0.6, max_detections: int = 100, pre_nms_top_k: int = 1000,
                coder: BoxCoder | None = None, max_candidates: int = 8000) -> dict[str, Tensor]:
    """Sigmoid scores, top-k candidates, decode, clip, batched NMS, best ``max_detections``.

    The seed (TF's ``batch_multiclass_non_max_suppression``: per class, NMS over every anchor above the
    threshold, 100 per class, then the best 100) has no candidate limit. The ``pre_nms_top_k`` best
    (anchor, class) pairs give its result exactly whenever ``max_detections`` of them survive NMS: per
    class they are that class's best, greedy NMS decides each box from better ones only, and any box
    left out scores below all of them. An image where fewer survive (NMS suppressed most of its top
    candidates) is run again with twice the candidates, up to ``max_candidates`` (the NMS is
    quadratic in them), or until no candidate above the threshold is left out.

    Args:
        outputs: :meth:`SSD.forward` outputs.
        image_size: ``(H, W)`` of the network input, for clipping.

    Returns:
        Fixed-shape ``{"boxes": (B, D, 4) xyxy, "scores": (B, D), "labels": (B, D) int64}`` with
        ``D = max_detections``; empty slots have score 0 and label -1.
    """
    coder = coder or BoxCoder()
    logits, codes, anchors = outputs["cls_logits"].float(), outputs["box_codes"].float(), outputs["anchors"]
    B, A, K = logits.shape
    k = min(pre_nms_top_k, A * K)
    out, kept = _detect(logits, codes, anchors, image_size, score_threshold, iou_threshold, max_detections, k, coder)
    cap = min(max_candidates, A * K)
    # host reads: evaluation only (the NMS itself syncs once a sweep)
    short = (kept < max_detections).nonzero().flatten().tolist() if k < cap else []
    for i in short:  # one image at a time: the NMS's memory grows with the square of the candidates
        above = int((torch.sigmoid(logits[i]) > score_threshold).sum())  # candidates that can take part
        ki, one = k, None
        while ki < cap and ki < above:
            ki = min(2 * ki, cap)
            one, n = _detect(logits[i:i + 1], codes[i:i + 1], anchors, image_size, score_threshold, iou_threshold,
                             max_detections, ki, coder)
            if int(n) >= max_detections:
                break
        if one is not None:
            for key in out:
                out[key][i] = one[key][0]
    return out


def build_ssd(depth_resnet: int, num_classes: int, depth: int, head_layers: int, frozen_bn: bool,
              backbone_weights: str | None, anchor_scale: float = 4.0, bn_momentum: float = BN_MOMENTUM,
              pad_in: int | None = None) -> SSD:
    """ResNet-``depth_resnet`` backbone (``backbone_weights``: ``"imagenet"``, a local state dict, or
    None for random; ``pad_in``: its stem's input channel padding) + FPN + head."""
    backbone = build_resnet(depth_resnet, num_classes=0, pretrained=backbone_weights, pad_in=pad_in)
    if frozen_bn:
        freeze_batchnorm(backbone)
    return SSD(backbone, num_classes, depth, head_layers, anchor_scale=anchor_scale, bn_momentum=bn_momentum)


def _backbone_weights(pretrained: str | None, backbone_weights: str | None) -> str | None:
    if pretrained and backbone_weights:
        from fastvision.errors import ConfigError

        raise ConfigError("model.args: give pretrained or backbone_weights, not both")
    return pretrained or backbone_weights


@MODELS.register("ssd320")
def ssd320(num_classes: int = 90, frozen_bn: bool = False, pretrained: str | None = None,
           backbone_weights: str | None = None, pad_in: int | None = None) -> SSD:
    """SSD320 v1.2: ResNet-50, FPN depth 256, 4-layer towers (TF ``ssd320_full_8gpus.config``).

    ``pretrained`` (``--pretrained``): the backbone's initial weights, ``"imagenet"`` (torchvision's
    ResNet-50 through torch.hub's cache, as the seed starts from ImageNet) or a local
    torchvision-layout file; ``backbone_weights`` is the older name. ``frozen_bn`` freezes the
    backbone's BN, as the seed does on top of ImageNet weights. ``pad_in: 4``: the stem reads 4 channels
    (RGB + zeros), a speed lever (docs/gpu.md, "Model levers").
    """
    return build_ssd(50, num_classes, 256, 4, frozen_bn, _backbone_weights(pretrained, backbone_weights),
                     pad_in=pad_in)


@MODELS.register("ssd320-small")
def ssd320_small(num_classes: int = 90, frozen_bn: bool = False, pretrained: str | None = None,
                 backbone_weights: str | None = None, anchor_scale: float = 4.0, bn_momentum: float = 0.1) -> SSD:
    """CPU-sized variant: ResNet-18, FPN/head depth 64, 2-layer towers, same anchor layout and loss.

    ``anchor_scale`` sets the P3 anchor side (``anchor_scale * 8`` px): smaller inputs want a
    smaller one (4 gives 32 px, 10% of a 320 input; 2 gives 16 px, 12.5% of a 128 input).
    ``bn_momentum`` defaults to PyTorch's 0.1: CPU runs last a few hundred steps (see :class:`SSD`).
    """
    return build_ssd(18, num_classes, 64, 2, frozen_bn, _backbone_weights(pretrained, backbone_weights), anchor_scale,
                     bn_momentum)
