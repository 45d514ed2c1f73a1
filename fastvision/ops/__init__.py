"""Operators in plain torch: boxes (IoU, matching, box coding, anchors, NMS) and nested label regions."""
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
from fastvision.ops.regions import region_lut, region_masks, regions_to_classes

__all__ = [
    "BACKGROUND", "IGNORE", "BoxCoder", "anchor_grid_sizes", "batched_nms", "box_area", "box_ioa", "box_iou",
    "clip_boxes", "match_anchors", "multiscale_anchors", "nms_keep", "region_lut",
    "region_masks", "regions_to_classes", "smooth_l1",
]
