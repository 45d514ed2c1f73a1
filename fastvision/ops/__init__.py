"""Detection operators in plain torch: box IoU, matching, box coding, anchors, NMS."""
from fastvision.ops.boxes import (
    BACKGROUND,
    IGNORE,
    BoxCoder,
    anchor_grid_sizes,
    batched_nms,
    box_area,
    box_ioa,
    box_iou,
    clip_boxes,
    match_anchors,
    multiscale_anchors,
    nms_keep,
    smooth_l1,
)

__all__ = [
    "BACKGROUND", "IGNORE", "BoxCoder", "anchor_grid_sizes", "batched_nms", "box_area", "box_ioa", "box_iou",
    "clip_boxes", "match_anchors", "multiscale_anchors", "nms_keep", "smooth_l1",
]
