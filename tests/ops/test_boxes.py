"""Box ops against independent references: MONAI box utils, brute-force NMS, hand-built cases."""
from __future__ import annotations

import math

import pytest
import torch
from monai.apps.detection.utils.box_coder import BoxCoder as MonaiBoxCoder
from monai.data.box_utils import box_iou as monai_box_iou

from fastvision.ops import (
    BACKGROUND,
    IGNORE,
    BoxCoder,
    batched_nms,
    box_iou,
    match_anchors,
    multiscale_anchors,
    nms_keep,
    smooth_l1,
)


def random_boxes(n: int, size: float = 100.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * size
    wh = torch.rand(n, 2, generator=g) * size / 3 + 1
    return torch.cat([xy, xy + wh], dim=1)


@pytest.mark.parametrize(
    "size,count",
    [((320, 320), 12804), ((256, 256), 6 * (32 * 32 + 16 * 16 + 8 * 8 + 4 * 4 + 2 * 2)), ((320, 480), None)],
)
def test_anchor_count(size, count):
    a = multiscale_anchors(size)
    h, w = size
    if count is None:  # level sizes by ceil division, computed independently
        count = 6 * sum(math.ceil(h / 2**level) * math.ceil(w / 2**level) for level in range(3, 8))
    assert a.shape == (count, 4)


def test_anchor_geometry_hand_computed():
    a = multiscale_anchors((320, 320))
    # Level 3, first cell: centre (4, 4), base 4 * 8 = 32; scale 1 ratio 1, ratio 2, and scale sqrt(2) ratio 1.
    torch.testing.assert_close(a[0], torch.tensor([-12.0, -12.0, 20.0, 20.0]))
    w2, h2 = 32 * math.sqrt(2), 32 / math.sqrt(2)
    torch.testing.assert_close(a[1], torch.tensor([4 - w2 / 2, 4 - h2 / 2, 4 + w2 / 2, 4 + h2 / 2]))
    s = 32 * math.sqrt(2)
    torch.testing.assert_close(a[3], torch.tensor([4 - s / 2, 4 - s / 2, 4 + s / 2, 4 + s / 2]))
    # Level 3, second cell in the first row moves by one stride in x.
    torch.testing.assert_close(a[6] - a[0], torch.tensor([8.0, 0.0, 8.0, 0.0]))
    # Level 7: 320 is not a multiple of 128, so TF puts centres on the grid corners.
    last = a[-6:]
    centre = (last[:, :2] + last[:, 2:]) / 2
    torch.testing.assert_close(centre, torch.full((6, 2), 256.0))


def test_iou_matches_monai():
    a, b = random_boxes(30, seed=1), random_boxes(20, seed=2)
    torch.testing.assert_close(box_iou(a, b), monai_box_iou(a, b).float())


def test_box_coder_matches_monai_and_round_trips():
    anchors = random_boxes(50, seed=3)
    gt = random_boxes(50, seed=4)
    ours = BoxCoder((10, 10, 5, 5))
    ref = MonaiBoxCoder(weights=(10.0, 10.0, 5.0, 5.0))
    codes = ours.encode(gt, anchors)
    torch.testing.assert_close(codes, ref.encode_single(gt, anchors).float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ours.decode(codes, anchors), gt, rtol=1e-5, atol=1e-3)
    # Batched shapes broadcast over the anchors.
    codes_b = ours.encode(gt.expand(2, 50, 4), anchors)
    torch.testing.assert_close(ours.decode(codes_b, anchors), gt.expand(2, 50, 4), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_smooth_l1_matches_torch(beta):
    x, y = torch.randn(100) * 3, torch.randn(100)
    ref = torch.nn.functional.smooth_l1_loss(x, y, beta=beta, reduction="none")
    torch.testing.assert_close(smooth_l1(x, y, beta), ref)


def test_matcher_hand_built():
    anchors = torch.tensor(
        [
            [0, 0, 10, 10],  # IoU 1 with gt0
            [0, 0, 10, 12],  # IoU 10/12 with gt0
            [50, 50, 60, 60],  # far from everything
            [100, 100, 104, 104],  # inside the crowd box
            [30, 30, 40, 40],  # best (but weak) anchor for the small gt1 -> forced match
        ],
        dtype=torch.float32,
    )
    gt = torch.tensor([[[0, 0, 10, 10], [29, 29, 31, 31], [90, 90, 130, 130], [0, 0, 0, 0]]], dtype=torch.float32)
    labels = torch.tensor([[3, 1, 2, -1]])
    crowd = torch.tensor([[False, False, True, False]])
    m = match_anchors(anchors, gt, labels, crowd)
    assert m.tolist() == [[0, 0, BACKGROUND, IGNORE, 1]]
    m = match_anchors(anchors, gt, labels, crowd, force_match=False)
    assert m.tolist() == [[0, 0, BACKGROUND, IGNORE, BACKGROUND]]


@pytest.mark.parametrize("case", ["empty", "padding_only", "crowd_only"])
def test_matcher_degenerate_images(case):
    anchors = multiscale_anchors((64, 64))
    if case == "empty":
        gt = torch.zeros(2, 0, 4)
        labels, crowd = torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.bool)
    else:
        gt = torch.tensor([[[0.0, 0, 64, 64]], [[0.0, 0, 64, 64]]])
        labels = torch.full((2, 1), -1 if case == "padding_only" else 0)
        crowd = torch.full((2, 1), case == "crowd_only")
    m = match_anchors(anchors, gt, labels, crowd)
    assert m.shape == (2, anchors.shape[0])
    assert not (m >= 0).any()  # no positives
    if case == "crowd_only":
        assert (m == IGNORE).any()
    else:
        assert (m == BACKGROUND).all()


def greedy_nms_reference(boxes, scores, thr):
    """Textbook greedy NMS, one box at a time, in Python."""
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
    keep = []
    for i in order:
        if all(float(box_iou(boxes[i : i + 1], boxes[j : j + 1])) <= thr for j in keep):
            keep.append(i)
    return sorted(keep)


@pytest.mark.parametrize("seed,thr", [(0, 0.5), (1, 0.3), (2, 0.6)])
def test_nms_matches_brute_force(seed, thr):
    boxes = random_boxes(60, size=60, seed=seed)
    scores = torch.rand(60, generator=torch.Generator().manual_seed(seed + 10))
    keep = nms_keep(boxes[None], scores[None], thr)[0]
    assert torch.nonzero(keep).flatten().tolist() == greedy_nms_reference(boxes, scores, thr)


def test_batched_nms_per_class_and_validity():
    boxes = torch.stack([random_boxes(40, size=50, seed=5), random_boxes(40, size=50, seed=6)])
    scores = torch.rand(2, 40, generator=torch.Generator().manual_seed(7))
    classes = torch.randint(0, 3, (2, 40), generator=torch.Generator().manual_seed(8))
    valid = scores > 0.2
    keep = batched_nms(boxes, scores, classes, 0.5, valid)
    for b in range(2):
        expected = []
        for c in range(3):
            idx = torch.nonzero((classes[b] == c) & valid[b]).flatten()
            expected += [int(idx[k]) for k in greedy_nms_reference(boxes[b, idx], scores[b, idx], 0.5)]
        assert torch.nonzero(keep[b]).flatten().tolist() == sorted(expected)
