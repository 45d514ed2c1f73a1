"""The affine's nearest resampling of 3-D CPU labels (``nearest_3d``, one gather) against
``F.grid_sample(mode="nearest")`` on the same grid, bit for bit: rotations, zooms in and out, an output
window of another size, positions outside the input (zeros), exact .5 ties, and every label dtype the
pipeline moves."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastvision.data.augment.affine import _gathers_nearest, _linear_grid, _rotation, affine, nearest_3d


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _lin(b: int, seed: int) -> torch.Tensor:
    """(B, 3, 3) sampling matrices: rotations up to about 57 degrees about each axis, scales 0.6-1.6."""
    g = gen(seed)
    rot = _rotation((torch.rand(b, 3, generator=g) - 0.5) * 2, 3)
    return rot.transpose(1, 2) * (0.6 + torch.rand(b, 3, 1, generator=g))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int64, torch.float32])
@pytest.mark.parametrize("shape_in, shape_out", [((9, 8, 7), (9, 8, 7)), ((12, 10, 9), (7, 8, 6)),
                                                 ((6, 7, 5), (10, 9, 11))])
def test_gathered_nearest_is_grid_sample_bit_for_bit(dtype, shape_in, shape_out):
    x = torch.randint(1, 200, (3, 2, *shape_in), generator=gen(1)).to(dtype)
    grid = _linear_grid(_lin(3, 2), torch.Size(shape_out))
    ref = F.grid_sample(x.float(), grid, mode="nearest", align_corners=False).to(dtype)
    got = nearest_3d(x, grid)
    assert got.dtype == dtype and got.shape == ref.shape
    assert torch.equal(got, ref)
    assert (ref == 0).any() and (ref != 0).any()  # positions outside the input (zeros) and inside are both hit


def test_ties_round_half_to_even_as_grid_sample():
    """Sampling scale 2 on 8 voxels a side puts every source coordinate on a .5 (-3.5, -1.5, 0.5, ... 10.5):
    the ties inside round half to even, as grid_sample's nearbyint (0.5 -> 0, 2.5 -> 2, 4.5 -> 4, 6.5 -> 6)."""
    x = torch.arange(8 ** 3, dtype=torch.int64).reshape(1, 1, 8, 8, 8) + 1
    grid = _linear_grid(torch.eye(3)[None] * 2, torch.Size([8, 8, 8]))
    got = nearest_3d(x, grid)
    assert torch.equal(got, F.grid_sample(x.double(), grid.double(), mode="nearest", align_corners=False).long())
    row = got[0, 0, 4, 4].tolist()  # z and y at 0.5 + 2 * 4 - 4 = 4.5 -> 4
    assert row == [0, 0, 1 + 4 * 64 + 4 * 8 + 0, 1 + 4 * 64 + 4 * 8 + 2, 1 + 4 * 64 + 4 * 8 + 4,
                   1 + 4 * 64 + 4 * 8 + 6, 0, 0]


def test_the_affine_labels_are_grid_samples():
    """Through the op: rotated samples' labels (class indices, uint8 as the loader gives them) are
    grid_sample's nearest on the op's own grid."""
    img = torch.rand(4, 1, 10, 9, 8, generator=gen(3))
    lab = torch.randint(0, 4, (4, 10, 9, 8), generator=gen(4), dtype=torch.uint8)
    ang = (torch.rand(4, 3, generator=gen(5)) - 0.5)
    zoom = 0.8 + 0.5 * torch.rand(4, 3, generator=gen(6))
    _, got = affine(img, lab, ang, zoom)
    half = torch.tensor([8.0, 9.0, 10.0]) / 2
    lin = _rotation(ang, 3).transpose(1, 2) * half[None, None, :] / half[None, :, None] / zoom[:, :, None]
    grid = _linear_grid(lin, torch.Size([10, 9, 8]))
    ref = F.grid_sample(lab[:, None].float(), grid, mode="nearest", align_corners=False)[:, 0].to(torch.uint8)
    assert torch.equal(got, ref)


def test_where_the_gather_does_not_serve():
    assert _gathers_nearest(torch.zeros(1, 1, 4, 4, 4, dtype=torch.uint8))
    assert not _gathers_nearest(torch.zeros(1, 1, 4, 4, 4, dtype=torch.bool))  # no zero padding for bool
    assert not _gathers_nearest(torch.zeros(1, 1, 4, 4))  # 2-D: grid_sample's kernel is vectorised there
    assert not _gathers_nearest(torch.zeros(1, 1, 1, 1, 1).expand(1, 1, 256, 256, 255))  # indices past 2^24
