"""The affine's separable path (a diagonal matrix: zoom without rotation) against ``grid_sample`` on
``F.affine_grid``'s grid, and the ops' in-place updates of the pipeline's own tensors against their
out-of-place results (same numbers, the caller's tensors untouched)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastvision.data.augment.affine import _linear_grid, _linear_label, affine
from fastvision.data.augment.separable import Separable, diagonal_rows
from fastvision.data.augment.spatial import _Rng, build_augment


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grid(diag: torch.Tensor, out: tuple[int, ...], exact: bool = False) -> torch.Tensor:
    """``F.affine_grid`` of the diagonal matrices (B, nd) in (x, y[, z]) order: the independent reference;
    ``exact``: the grid the op builds (``_linear_grid``, affine_grid to 1e-7: test_aug_nnunet), for the
    bit-exact nearest (affine_grid's coordinates differ by an ulp, which moves a position within float
    rounding of a .5 to the other voxel)."""
    if exact:
        return _linear_grid(torch.diag_embed(diag), torch.Size(out))
    theta = torch.cat([torch.diag_embed(diag), torch.zeros(diag.shape[0], diag.shape[1], 1)], 2)
    return F.affine_grid(theta, [diag.shape[0], 1, *out], align_corners=False)


@pytest.mark.parametrize("shape_in, shape_out", [((9, 8, 7), (9, 8, 7)), ((12, 10, 9), (7, 8, 6)),
                                                 ((6, 7, 5), (10, 9, 11)), ((9, 11), (9, 11)), ((8, 6), (5, 9))])
def test_separable_matches_grid_sample(shape_in, shape_out):
    """Scales below and above 1 (sampling beyond the input: zeros), each axis its own; the output grid
    not the input's size (off the input's voxel centres). Image to float rounding, labels bit for bit."""
    nd = len(shape_in)
    diag = torch.tensor([[0.45, 1.3, 0.8][:nd], [1.7, 0.6, 1.0][:nd], [1.25] * nd, [0.33] * nd])
    x = torch.randn(4, 2, *shape_in, generator=gen(1))
    lab = torch.randint(0, 5, (4, 1, *shape_in), generator=gen(2), dtype=torch.uint8)
    grid = _grid(diag, shape_out)
    sep = Separable(torch.diag_embed(diag), shape_in, shape_out)
    ref = F.grid_sample(x, grid, mode="bilinear", align_corners=False)
    assert torch.allclose(sep.linear(x), ref, atol=2e-6) and (ref == 0).any()  # zeros outside are reached
    ref_lab = F.grid_sample(lab.float(), _grid(diag, shape_out, True), mode="nearest", align_corners=False)
    assert torch.equal(sep.nearest(lab), ref_lab.to(torch.uint8))


def test_nearest_ties_round_half_to_even_as_grid_sample():
    """Zoom 1/2 on 4 voxels (sampling scale 2): the output voxels read input positions -1.5, 0.5, 2.5
    and 4.5; the two inside ties round half to even (0.5 -> 0, 2.5 -> 2), as grid_sample's nearbyint."""
    lab = torch.tensor([[[1, 2, 3, 4]]], dtype=torch.uint8)[:, :, None].expand(1, 1, 1, 4).contiguous()
    diag = torch.tensor([[2.0, 1.0]])
    got = Separable(torch.diag_embed(diag), (1, 4), (1, 4)).nearest(lab)
    assert got.flatten().tolist() == [0, 1, 3, 0]
    ref = F.grid_sample(lab.float(), _grid(diag, (1, 4), True), mode="nearest", align_corners=False)
    assert torch.equal(got, ref.to(torch.uint8))


def test_diagonal_rows():
    lin = torch.eye(3).repeat(3, 1, 1) * torch.tensor([0.5, 1.0, 2.0])[:, None, None]
    lin[1, 0, 2] = 1e-7
    assert diagonal_rows(lin) == [True, False, True]


@pytest.mark.parametrize("size", [None, [6, 7, 5]])
def test_affine_dispatches_each_sample(size):
    """A batch of rotated and zoom-only samples: the zoom-only ones (separable) equal grid_sample on
    affine_grid's grid, the rotated ones what the op gives them alone, each in its place."""
    x = torch.randn(4, 1, 8, 9, 7, generator=gen(3))
    lab = torch.randint(0, 3, (4, 8, 9, 7), generator=gen(4), dtype=torch.uint8)
    ang = torch.tensor([[0.0, 0, 0], [0.3, -0.2, 0.1], [0.0, 0, 0], [0.0, 0.4, 0]])
    zoom = torch.tensor([[1.3, 0.7, 1.1], [1.2, 1.2, 1.2], [0.6, 0.6, 0.6], [1.0, 1.0, 1.0]])
    out, out_lab = affine(x, lab, ang, zoom, size=size)
    spatial = tuple(size or x.shape[2:])
    for i in range(4):
        alone = affine(x[i:i + 1], lab[i:i + 1], ang[i:i + 1], zoom[i:i + 1], size=size)
        assert torch.allclose(out[i], alone[0][0], atol=1e-6) and torch.equal(out_lab[i], alone[1][0])
    for i in (0, 2):  # sampling maps output to input: n_in = (out / in) / zoom, in (x, y, z) order
        d = torch.tensor(spatial[::-1]) / torch.tensor(x.shape[2:][::-1]) / zoom[i]
        grid = _grid(d[None], spatial)
        assert torch.allclose(out[i:i + 1], F.grid_sample(x[i:i + 1], grid, align_corners=False), atol=2e-6)
        ref = F.grid_sample(lab[i:i + 1, None].float(), _grid(d[None], spatial, True), mode="nearest",
                            align_corners=False)
        assert torch.equal(out_lab[i], ref[0, 0].to(torch.uint8))


def test_linear_labels_separable_as_grid_sample():
    """``label_mode: linear`` (per-class bilinear, argmax, ties to the nearest label) on the separable
    maps against the same rule on grid_sample's: the scores agree to float rounding, so the labels agree
    except where a score sits on a float16 rounding boundary (none in this case)."""
    lab = torch.randint(0, 4, (3, 10, 9, 8), generator=gen(5), dtype=torch.uint8)
    diag = torch.tensor([[0.7, 1.3, 1.0], [1.5, 1.5, 1.5], [0.5, 0.9, 2.0]])
    grid = _grid(diag, (10, 9, 8), True)
    sep = Separable(torch.diag_embed(diag), (10, 9, 8), (10, 9, 8))

    def gs(mode):
        return lambda t: F.grid_sample(t.float(), grid, mode=mode, align_corners=False).to(t.dtype)

    ref = _linear_label(lab, gs("bilinear"), gs("nearest"), 4)
    got = _linear_label(lab, sep.linear, sep.nearest, 4)
    assert torch.equal(got, ref) and (ref != F.grid_sample(lab[:, None].float(), grid, mode="nearest",
                                                           align_corners=False)[:, 0].to(torch.uint8)).any()


class _NotOwned(_Rng):
    def owns(self, x):  # every tensor is the caller's: the out-of-place path
        return False


class _Owned(_Rng):
    def owns(self, x):  # every tensor the pipeline's own: the in-place path
        return True


SPECS = {"noise": {"std": 0.1}, "brightness": {}, "contrast": {}, "gamma": {"per_channel": True, "retain_stats": True},
         "gamma_inverted": {"retain_stats": True}, "blur": {"channel_prob": 0.5}, "lowres": {"channel_prob": 0.5},
         "affine": {"rotate_prob": 0.5, "zoom_prob": 0.5, "degrees": 20, "scale": [0.7, 1.4]}}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("prob", [0.5, 1.0])
def test_in_place_equals_out_of_place(name, prob):
    """Each op updating the pipeline's own tensor in place gives the numbers its out-of-place path gives
    (the same draws, the same operations in the same order)."""
    op = build_augment(3, **{name: {**SPECS[name], "prob": prob}}).ops[0][1]
    x = torch.randn(6, 2, 7, 6, 5, generator=gen(6))
    lab = torch.randint(0, 3, (6, 7, 6, 5), generator=gen(7), dtype=torch.uint8)
    a, a_lab = op(x.clone(), lab.clone(), _NotOwned(gen(8), 6, x.device))
    b, b_lab = op(x.clone(), lab.clone(), _Owned(gen(8), 6, x.device))
    assert torch.equal(a, b) and torch.equal(a_lab, b_lab) and not torch.equal(a, x)


def test_pipeline_leaves_the_callers_tensors_alone():
    """The whole nnU-Net pipeline (ops after the first copy update in place) returns new tensors and
    leaves the caller's image and label as they were, whichever op copies first."""
    from fastvision.planning.configure.recipe import augmentation

    spec, _ = augmentation([8, 8, 8], [1.0] * 3, None, "nnunet")
    for p in (0.0, 0.5, 1.0):
        s = {k: {kk: (p if kk.endswith("prob") else vv) for kk, vv in v.items()} for k, v in spec.items() if v}
        x = torch.randn(3, 2, 8, 8, 8, generator=gen(9))
        lab = torch.randint(0, 3, (3, 8, 8, 8), generator=gen(10), dtype=torch.uint8)
        x0, lab0 = x.clone(), lab.clone()
        build_augment(3, **s)(x, lab, gen(11))
        assert torch.equal(x, x0) and torch.equal(lab, lab0)


def test_an_op_called_alone_owns_nothing():
    """An op called with a random source that does not know the caller's tensors writes a new tensor."""
    x = torch.randn(3, 1, 4, 4, 4, generator=gen(13))
    x0 = x.clone()
    out, _ = build_augment(3, brightness={"prob": 1.0}).ops[0][1](x, None, _Rng(gen(0), 3, x.device))
    assert torch.equal(x, x0) and not torch.equal(out, x0)


def test_uniform_draws_unchanged():
    """``_Rng.uniform`` (scaled in place) gives lo + (hi - lo) u, bit for bit."""
    u = torch.rand(5, 3, generator=gen(12))
    assert torch.equal(_Rng(gen(12), 5, torch.device("cpu")).uniform(0.7, 1.4, 3), 0.7 + (1.4 - 0.7) * u)
