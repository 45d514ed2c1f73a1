"""Box operations for single-shot detection, in plain batched torch (no torchvision).

Boxes are ``xyxy`` in pixels throughout. Ground truth arrives padded: ``(B, M, 4)`` boxes with
``labels == -1`` marking padding, so matching and encoding run over the whole batch in a few
kernels and never sync with the host. The conventions follow the TF Object Detection API
configuration of SSD320 v1.2 (seed 002): multiscale grid anchors, an argmax matcher at IoU 0.5
with forced matches, and the Faster R-CNN box coder with weights (10, 10, 5, 5).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

# Matcher codes for anchors that are not matched to a ground-truth box.
BACKGROUND = -1
IGNORE = -2


def box_area(boxes: Tensor) -> Tensor:
    """Area of ``(..., 4)`` xyxy boxes; degenerate boxes give 0."""
    return (boxes[..., 2] - boxes[..., 0]).clamp(min=0) * (boxes[..., 3] - boxes[..., 1]).clamp(min=0)


def _intersection(a: Tensor, b: Tensor) -> Tensor:
    lt = torch.maximum(a[..., :, None, :2], b[..., None, :, :2])
    rb = torch.minimum(a[..., :, None, 2:], b[..., None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    return wh[..., 0] * wh[..., 1]


def box_iou(a: Tensor, b: Tensor) -> Tensor:
    """Pairwise IoU.

    Args:
        a: ``(..., N, 4)`` xyxy boxes.
        b: ``(..., M, 4)`` xyxy boxes (same leading dims as ``a``).

    Returns:
        ``(..., N, M)`` IoU; 0 where the union is empty.
    """
    inter = _intersection(a, b)
    union = box_area(a)[..., :, None] + box_area(b)[..., None, :] - inter
    return torch.where(union > 0, inter / union.clamp(min=1e-12), torch.zeros_like(inter))


def box_ioa(a: Tensor, b: Tensor) -> Tensor:
    """Pairwise intersection over the area of ``a`` (how much of each ``a`` box lies inside ``b``).

    Shapes as :func:`box_iou`. Used for crowd regions, as COCOeval does.
    """
    inter = _intersection(a, b)
    area = box_area(a)[..., :, None]
    return torch.where(area > 0, inter / area.clamp(min=1e-12), torch.zeros_like(inter))


def match_anchors(
    anchors: Tensor,
    gt_boxes: Tensor,
    gt_labels: Tensor,
    gt_crowd: Tensor | None = None,
    iou_threshold: float = 0.5,
    force_match: bool = True,
) -> Tensor:
    """Argmax matcher with forced matches and crowd regions ignored.

    Each anchor takes its highest-IoU real ground-truth box when that IoU is at least
    ``iou_threshold``. With ``force_match`` every real box also claims the anchor it overlaps most,
    so small boxes are never left without a positive. Anchors left unmatched that lie at least
    ``iou_threshold`` inside a crowd box (intersection over anchor area) are ignored: they are
    neither positives nor negatives.

    Args:
        anchors: ``(A, 4)`` xyxy.
        gt_boxes: ``(B, M, 4)`` xyxy, padded.
        gt_labels: ``(B, M)`` int64, ``-1`` for padding.
        gt_crowd: ``(B, M)`` bool, True for crowd boxes (or None).
        iou_threshold: positive threshold (TF config: matched = unmatched threshold = 0.5).
        force_match: give every real box at least its best anchor.

    Returns:
        ``(B, A)`` int64: index into ``M`` of the matched box, :data:`BACKGROUND` or :data:`IGNORE`.
    """
    B, M = gt_labels.shape
    A = anchors.shape[0]
    if M == 0:
        return torch.full((B, A), BACKGROUND, dtype=torch.long, device=anchors.device)
    crowd = gt_crowd if gt_crowd is not None else torch.zeros_like(gt_labels, dtype=torch.bool)
    real = (gt_labels >= 0) & ~crowd  # (B, M)
    iou = box_iou(anchors.expand(B, A, 4), gt_boxes)  # (B, A, M)
    iou_real = iou.masked_fill(~real[:, None, :], -1.0)
    best_iou, best_gt = iou_real.max(dim=2)  # (B, A)
    matches = torch.where(best_iou >= iou_threshold, best_gt, torch.full_like(best_gt, BACKGROUND))

    is_crowd = (gt_labels >= 0) & crowd
    ioa = box_ioa(anchors.expand(B, A, 4), gt_boxes).masked_fill(~is_crowd[:, None, :], 0.0)
    in_crowd = ioa.amax(dim=2) >= iou_threshold
    matches = torch.where((matches == BACKGROUND) & in_crowd, torch.full_like(matches, IGNORE), matches)

    if force_match:
        # Best anchor of each real box; padding rows scatter to a dummy column that is dropped.
        best_anchor = iou_real.argmax(dim=1)  # (B, M)
        target = torch.where(real, best_anchor, torch.full_like(best_anchor, A))
        padded = torch.cat([matches, matches.new_full((B, 1), BACKGROUND)], dim=1)
        gt_index = torch.arange(M, device=anchors.device).expand(B, M)
        padded.scatter_(1, target, gt_index)
        matches = padded[:, :A]
    return matches


class BoxCoder:
    """Faster R-CNN box coder: centre offsets scaled by anchor size, log size ratios.

    Args:
        weights: ``(wx, wy, ww, wh)`` multipliers of the encoded targets (TF: 10, 10, 5, 5).
        clip: largest ``dw``/``dh`` before ``exp`` in decoding, so wild predictions stay finite.
    """

    def __init__(self, weights: Sequence[float] = (10.0, 10.0, 5.0, 5.0), clip: float = math.log(1000.0 / 16)):
        self.weights = tuple(float(w) for w in weights)
        self.clip = clip

    @staticmethod
    def _cxcywh(boxes: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        w = boxes[..., 2] - boxes[..., 0]
        h = boxes[..., 3] - boxes[..., 1]
        return boxes[..., 0] + 0.5 * w, boxes[..., 1] + 0.5 * h, w, h

    def encode(self, boxes: Tensor, anchors: Tensor) -> Tensor:
        """Regression targets of ``boxes`` relative to ``anchors``.

        Args:
            boxes: ``(..., 4)`` xyxy ground truth (positive width and height).
            anchors: ``(..., 4)`` xyxy, broadcastable to ``boxes``.

        Returns:
            ``(..., 4)`` targets ``(dx, dy, dw, dh)``.
        """
        wx, wy, ww, wh = self.weights
        gx, gy, gw, gh = self._cxcywh(boxes)
        ax, ay, aw, ah = self._cxcywh(anchors)
        gw, gh = gw.clamp(min=1e-6), gh.clamp(min=1e-6)
        return torch.stack(
            [wx * (gx - ax) / aw, wy * (gy - ay) / ah, ww * torch.log(gw / aw), wh * torch.log(gh / ah)], dim=-1
        )

    def decode(self, codes: Tensor, anchors: Tensor) -> Tensor:
        """Inverse of :meth:`encode`: ``(..., 4)`` codes -> ``(..., 4)`` xyxy boxes."""
        wx, wy, ww, wh = self.weights
        ax, ay, aw, ah = self._cxcywh(anchors)
        codes = codes.float()
        cx = codes[..., 0] / wx * aw + ax
        cy = codes[..., 1] / wy * ah + ay
        w = torch.exp((codes[..., 2] / ww).clamp(max=self.clip)) * aw
        h = torch.exp((codes[..., 3] / wh).clamp(max=self.clip)) * ah
        return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)


def smooth_l1(pred: Tensor, target: Tensor, beta: float = 1.0) -> Tensor:
    """Elementwise smooth-L1 (Huber with ``delta = beta``, divided by ``beta``); no reduction."""
    diff = (pred - target).abs()
    if beta <= 0:
        return diff
    return torch.where(diff < beta, 0.5 * diff * diff / beta, diff - 0.5 * beta)


def anchor_grid_sizes(image_size: tuple[int, int], levels: Sequence[int] = (3, 4, 5, 6, 7)) -> list[tuple[int, int]]:
    """Feature-map sizes of FPN levels for an image: stride-2 convs with padding 1 round up."""
    sizes = []
    for level in levels:
        h, w = image_size
        for _ in range(level):
            h, w = (h + 1) // 2, (w + 1) // 2
        sizes.append((h, w))
    return sizes


def multiscale_anchors(
    image_size: tuple[int, int],
    levels: Sequence[int] = (3, 4, 5, 6, 7),
    anchor_scale: float = 4.0,
    aspect_ratios: Sequence[float] = (1.0, 2.0, 0.5),
    scales_per_octave: int = 2,
    grid_sizes: Sequence[tuple[int, int]] | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """RetinaNet/TF multiscale grid anchors in the order the SSD head flattens its outputs.

    At level ``l`` the stride is ``2**l`` and the base size ``anchor_scale * 2**l``; each location
    gets ``scales_per_octave * len(aspect_ratios)`` anchors of size ``base * 2**(i / spo)`` with
    width ``* sqrt(ratio)`` and height ``/ sqrt(ratio)``. As in TF, centres sit at half a stride
    when the stride divides the image, else at the grid corners. 320x320 gives 12,804 anchors.

    Args:
        image_size: ``(H, W)`` of the network input in pixels.
        grid_sizes: ``(h, w)`` per level; default from :func:`anchor_grid_sizes`.

    Returns:
        ``(A, 4)`` float32 xyxy, ordered level, row, column, (scale, ratio).
    """
    H, W = image_size
    grid_sizes = list(grid_sizes or anchor_grid_sizes(image_size, levels))
    out = []
    for level, (gh, gw) in zip(levels, grid_sizes, strict=True):
        stride = 2.0**level
        base = anchor_scale * stride
        sizes = []
        for i in range(scales_per_octave):
            scale = 2.0 ** (i / scales_per_octave)
            for r in aspect_ratios:
                sizes.append((base * scale * math.sqrt(r), base * scale / math.sqrt(r)))
        wh = torch.tensor(sizes, dtype=torch.float32, device=device)  # (K, 2)
        off_y = stride / 2 if H % stride == 0 else 0.0
        off_x = stride / 2 if W % stride == 0 else 0.0
        cy = torch.arange(gh, dtype=torch.float32, device=device) * stride + off_y
        cx = torch.arange(gw, dtype=torch.float32, device=device) * stride + off_x
        cy, cx = torch.meshgrid(cy, cx, indexing="ij")
        ctr = torch.stack([cx, cy], dim=-1).reshape(-1, 1, 2)  # (gh*gw, 1, 2)
        out.append(torch.cat([ctr - wh / 2, ctr + wh / 2], dim=-1).reshape(-1, 4))
    return torch.cat(out)


def nms_keep(boxes: Tensor, scores: Tensor, iou_threshold: float, valid: Tensor | None = None) -> Tensor:
    """Exact greedy NMS over a batch, as a boolean mask.

    Greedy NMS keeps box ``i`` iff no higher-scoring kept box overlaps it above the threshold. That
    recursion is solved by fixed-point iteration on the whole IoU matrix: after ``k`` sweeps the
    ``k`` best boxes are final, and in practice a handful of sweeps suffice. One host sync per
    sweep checks convergence; this runs at evaluation only.

    Args:
        boxes: ``(B, N, 4)`` xyxy.
        scores: ``(B, N)``.
        iou_threshold: boxes with IoU strictly above it are suppressed.
        valid: ``(B, N)`` bool, candidates that take part (default all).

    Returns:
        ``(B, N)`` bool, True for kept boxes.
    """
    B, N = scores.shape
    if valid is None:
        valid = torch.ones_like(scores, dtype=torch.bool)
    order = scores.masked_fill(~valid, float("-inf")).argsort(dim=1, descending=True, stable=True)
    sb = boxes.gather(1, order[..., None].expand(B, N, 4))
    sv = valid.gather(1, order)
    over = box_iou(sb, sb) > iou_threshold
    # over[b, i, j] for j < i: a better box j can suppress i.
    over &= torch.ones(N, N, dtype=torch.bool, device=boxes.device).tril(-1)
    over &= sv[:, None, :]
    keep = sv.clone()
    for _ in range(N + 1):
        new = sv & ~(over & keep[:, None, :]).any(dim=2)
        if torch.equal(new, keep):  # host sync: convergence test
            break
        keep = new
    out = torch.zeros_like(keep)
    return out.scatter(1, order, keep)


def batched_nms(boxes: Tensor, scores: Tensor, classes: Tensor, iou_threshold: float,
                valid: Tensor | None = None) -> Tensor:
    """Per-class greedy NMS by offsetting each class's boxes so that classes never overlap.

    Args:
        boxes: ``(B, N, 4)`` xyxy.
        scores: ``(B, N)``.
        classes: ``(B, N)`` int64.
        iou_threshold: suppression threshold.
        valid: ``(B, N)`` bool candidates (default all).

    Returns:
        ``(B, N)`` bool keep mask.
    """
    if boxes.numel() == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    span = (boxes.max() - boxes.min()).clamp(min=0) + 1
    offset = classes.to(boxes.dtype)[..., None] * span
    return nms_keep(boxes + offset, scores, iou_threshold, valid)


def clip_boxes(boxes: Tensor, size: tuple[int, int]) -> Tensor:
    """Clip ``(..., 4)`` xyxy boxes to an ``(H, W)`` image."""
    H, W = size
    x = boxes[..., 0::2].clamp(0, W)
    y = boxes[..., 1::2].clamp(0, H)
    return torch.stack([x[..., 0], y[..., 0], x[..., 1], y[..., 1]], dim=-1)


__all__ = [
    "BACKGROUND", "IGNORE", "BoxCoder", "anchor_grid_sizes", "batched_nms", "box_area", "box_ioa", "box_iou",
    "clip_boxes", "match_anchors", "multiscale_anchors", "nms_keep", "smooth_l1",
]
