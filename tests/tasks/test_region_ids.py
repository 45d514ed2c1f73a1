"""task.args.regions holds class ids of the data: an id past its classes (a region never present, which
empty=one scored 1 where the prediction was empty too) or the background 0 is one line before any run
folder; it trained and scored without a word."""
from __future__ import annotations

import pytest

from fastvision.errors import ConfigError
from fastvision.losses import DiceLoss
from fastvision.tasks.segment import SegmentationTask


@pytest.mark.parametrize("mode,regions,info", [
    ("softmax", [[1, 2, 5]], None),              # the softmax model's 4 classes are the limit
    ("softmax", [[0, 1]], None),                 # background inside a region
    ("regions", [[1, 2, 3], [4]], {"num_classes": 4}),  # BraTS file id 4 after the 4 -> 3 map
    ("regions", [[1], []], None),
])
def test_region_of_no_class_is_refused(mode, regions, info):
    with pytest.raises(ConfigError, match=r"task.args.regions .*each region a non-empty list of class ids"):
        SegmentationTask(num_classes=4, mode=mode, regions=regions, region_names=[f"r{i}" for i in range(len(regions))],
                         info=info, loss=DiceLoss(softmax=mode == "softmax", sigmoid=mode == "regions"))


def test_brats_regions_still_build():
    for mode, info in (("softmax", None), ("regions", {"num_classes": 4}), ("regions", None)):
        task = SegmentationTask(num_classes=4, mode=mode, regions=[[1, 2, 3], [1, 3], [3]],
                                region_names=["WT", "TC", "ET"], info=info, loss=DiceLoss(sigmoid=True))
        assert task.regions == [[1, 2, 3], [1, 3], [3]]
