"""froc with masks at another resolution than the slides (Camelyon16 evaluates on level-5 masks):
``--stride`` gives the masks' pixels per heat-map cell, and the patch ``predict`` recorded (in the
slides' pixels) follows at the same scale; it was used unscaled, each cell looked up 3.5 cells off."""
from __future__ import annotations

import numpy as np
import pytest
import tifffile

from fastvision.data.formats.heatmap import write_heatmap
from fastvision.errors import DataError
from fastvision.metrics.froc import froc_files


def test_a_lower_resolution_mask_with_its_stride_scores_as_the_full_one(tmp_path):
    full = np.zeros((128, 128), np.uint8)
    full[56:72, 56:72] = 1  # cell (1, 1)'s patch centre (64, 64) at stride 32, patch 64 (overlapping)
    heat = np.zeros((3, 3), np.float32)
    heat[1, 1], heat[0, 0] = 0.9, 0.7  # the lesion's cell; a false positive (centre (32, 32): no lesion)
    write_heatmap(heat, tmp_path / "heat" / "s_heatmap", stride=32, patch=64)
    for name, mask in (("full", full), ("quarter", full[::4, ::4])):
        (tmp_path / name).mkdir()
        tifffile.imwrite(tmp_path / name / "s.tif", mask)
    kw = dict(threshold=0.5, nms_radius=0)
    at_full = froc_files(tmp_path / "heat", tmp_path / "full", **kw)
    at_quarter = froc_files(tmp_path / "heat", tmp_path / "quarter", stride=8, **kw)
    # hand: the lesion is found at 0.9, the one FP (0.7) lies below it: sensitivity 1 at every FP rate
    assert at_full["froc"] == 1.0 and at_quarter == at_full
    with pytest.raises(DataError, match="cannot hold heat map .* give --stride"):
        froc_files(tmp_path / "heat", tmp_path / "quarter", **kw)  # the recorded 32 does not fit 32 rows
