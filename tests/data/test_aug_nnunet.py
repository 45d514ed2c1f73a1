"""nnU-Net v2's augmentation ops (blur, low resolution, inverted / stats-keeping gamma, separate
rotation and zoom probabilities) against independent references: scipy's Gaussian filter,
``F.interpolate``'s two resizes (batchgeneratorsv2's definition), hand-computed statistics."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import ndimage

from fastvision.data.augment.degrade import lowres_gathered, odd_kernel_size, reflect_pad
from fastvision.data.augment.spatial import build_augment
from fastvision.errors import ConfigError


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("sigma, size", [(0.5, 3), (0.75, 5), (1.0, 7), (0.9, 5)])
def test_kernel_size_rounds_to_odd_as_batchgenerators(sigma, size):
    # round_to_nearest_odd(6 sigma + 0.5): 3.5 -> 3, 5.0 -> 5, 6.5 -> 7, 5.9 -> 5 (6 is even, 5.9 - 6 < 0)
    assert int(odd_kernel_size(torch.tensor(sigma))) == size


@pytest.mark.parametrize("nd, sigma", [(2, 0.75), (3, 0.6), (3, 1.0)])
def test_blur_matches_scipy(nd, sigma):
    x = torch.rand(2, 2, *([7] * nd), generator=gen(1))
    aug = build_augment(nd, blur={"prob": 1.0, "sigma": [sigma, sigma], "channel_prob": 1.0})
    out, _ = aug(x.clone(), None, gen(2))
    half = int(odd_kernel_size(torch.tensor(sigma))) // 2
    ref = x.numpy().astype(np.float64)
    for a in range(nd):  # torch's reflect padding is scipy's "mirror"; radius = int(truncate * sigma + 0.5)
        ref = ndimage.gaussian_filter1d(ref, sigma, axis=2 + a, mode="mirror", truncate=(half + 0.2) / sigma)
    assert torch.allclose(out.double(), torch.from_numpy(ref), atol=1e-5)


@pytest.mark.parametrize("shape", [(7, 6, 1), (5, 2, 3), (1, 8, 6)])
def test_blur_of_a_thin_axis_mirrors_it_as_scipy(shape):
    """A patch axis shorter than the kernel's reach (a thin stack's one-slice patch: 112 x 96 x 1 from
    ``configure``, where torch's reflect padding refuses): mirrored as often as it takes, scipy's "mirror"
    of any length; a one-voxel axis is left as it is."""
    x = torch.rand(2, 1, *shape, generator=gen(30))
    out, _ = build_augment(3, blur={"prob": 1.0, "sigma": [1.0, 1.0], "channel_prob": 1.0})(x.clone(), None, gen(31))
    ref = x.numpy().astype(np.float64)
    for a in range(3):
        ref = ndimage.gaussian_filter1d(ref, 1.0, axis=2 + a, mode="mirror", truncate=3.2)
    assert torch.allclose(out.double(), torch.from_numpy(ref), atol=1e-5)
    if shape[2] == 1:  # blurring along the slice axis changed nothing: the in-plane blur alone
        plane = ndimage.gaussian_filter1d(ndimage.gaussian_filter1d(x.numpy().astype(np.float64), 1.0, axis=2,
                                                                    mode="mirror", truncate=3.2),
                                          1.0, axis=3, mode="mirror", truncate=3.2)
        assert torch.allclose(out.double(), torch.from_numpy(plane), atol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_reflect_pad_is_numpys_reflect_at_any_width(n):
    x = torch.rand(2, n, 3, generator=gen(32))
    for r in range(0, 8):
        want = np.pad(x.numpy(), [(0, 0), (r, r), (0, 0)], mode="reflect")
        assert torch.equal(reflect_pad(x, 1, r), torch.from_numpy(want)), r


def test_blur_only_touches_firing_channels():
    x = torch.rand(8, 2, 6, 6, 6, generator=gen(3))
    out, _ = build_augment(3, blur={"prob": 0.5, "channel_prob": 0.5})(x.clone(), None, gen(4))
    changed = (out - x).flatten(2).abs().amax(2) > 0  # (B, C)
    assert 0 < int(changed.sum()) < 16  # some rows blurred, some untouched exactly


def _lowres_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    """batchgeneratorsv2's SimulateLowResolutionTransform on one channel: nearest-exact down, then linear up."""
    shape = list(x.shape[2:])
    small = [round(n * scale) for n in shape]
    mode = ("linear", "bilinear", "trilinear")[len(shape) - 1]
    return F.interpolate(F.interpolate(x, small, mode="nearest-exact"), shape, mode=mode)


@pytest.mark.parametrize("nd, shape, scale", [(2, (9, 7), 0.61), (3, (8, 6, 5), 0.5), (3, (7, 9, 6), 0.83)])
def test_lowres_gathered_matches_two_resizes(nd, shape, scale):
    """The batched (GPU) form: each row at its own scale, against the two resizes of each row."""
    scales = torch.tensor([scale, 0.5, 1.0])
    x = torch.rand(3, 1, *shape, generator=gen(5))
    want = torch.cat([_lowres_reference(x[i:i + 1], float(s)) for i, s in enumerate(scales)])
    assert torch.allclose(lowres_gathered(x, scales, None), want, atol=1e-6)
    out, _ = build_augment(nd, lowres={"prob": 1.0, "range": [scale, scale], "channel_prob": 1.0})(x, None, gen(6))
    assert torch.allclose(out, torch.cat([_lowres_reference(x[i:i + 1], scale) for i in range(3)]), atol=1e-6)


def test_lowres_hand_case_and_ignored_axis():
    # 4 voxels at scale 0.5: nearest-exact keeps voxels 1 and 3 (b, d); linear back: b, b + (d-b)/4, ...
    x = torch.tensor([[[0.0, 1.0, 2.0, 5.0]]])
    out, _ = build_augment(1 + 1, lowres={"prob": 1.0, "range": [0.5, 0.5], "channel_prob": 1.0})(
        x[..., None].expand(1, 1, 4, 2).contiguous(), None, gen(0))
    assert torch.allclose(out[0, 0, :, 0], torch.tensor([1.0, 2.0, 4.0, 5.0]))
    y = torch.rand(1, 1, 4, 4, 4, generator=gen(7))
    spec = {"prob": 1.0, "range": [0.5, 0.5], "channel_prob": 1.0, "ignore_axes": [0]}
    out, _ = build_augment(3, lowres=spec)(y, None, gen(0))
    ref = torch.stack([_lowres_reference(y[:, :, i], 0.5) for i in range(4)], 2)  # each slice of axis 0 alone
    assert torch.allclose(out, ref, atol=1e-6)


def _gamma_ref(x: np.ndarray, g: float, invert: bool, retain: bool = True) -> np.ndarray:
    x = -x if invert else x
    mean, std = x.mean(), x.std(ddof=1)
    lo, hi = x.min(), x.max()
    y = ((x - lo) / (hi - lo)) ** g * (hi - lo) + lo
    if retain:
        y = (y - y.mean()) / y.std(ddof=1) * std + mean
    return -y if invert else y


@pytest.mark.parametrize("op", ["gamma", "gamma_inverted"])
def test_gamma_keeps_stats_and_inverts(op):
    x = torch.rand(1, 1, 5, 6, generator=gen(8)) * 3 - 1
    out, _ = build_augment(2, **{op: {"prob": 1.0, "range": [1.4, 1.4], "retain_stats": True}})(x, None, gen(0))
    ref = _gamma_ref(x.double().numpy()[0, 0], 1.4, op == "gamma_inverted")
    assert np.allclose(out[0, 0].double().numpy(), ref, atol=1e-5)


@pytest.mark.parametrize("op", ["gamma", "gamma_inverted"])
@pytest.mark.parametrize("retain", [True, False])
@pytest.mark.parametrize("g", [0.7, 1.4])
def test_gamma_of_every_sample_and_channel_matches_the_formula(op, retain, g):
    """3-D batch of 2 x 2 channels, each (sample, channel) its own range and stats: the op (in its
    folded, exp-log form) against batchgeneratorsv2's formula in float64."""
    x = torch.randn(2, 2, 5, 6, 7, generator=gen(18)) * torch.tensor([1.0, 3.0]).reshape(1, 2, 1, 1, 1) + 0.5
    spec = {"prob": 1.0, "range": [g, g], "per_channel": True, "retain_stats": retain}
    out, _ = build_augment(3, **{op: spec})(x, None, gen(0))
    for b in range(2):
        for c in range(2):
            ref = _gamma_ref(x[b, c].double().numpy(), g, op == "gamma_inverted", retain)
            assert np.allclose(out[b, c].double().numpy(), ref, atol=2e-5, rtol=0), (b, c)


def test_gamma_per_channel_draws_differ():
    x = torch.rand(1, 2, 6, 6, generator=gen(9)).expand(1, 2, 6, 6).clone()
    x[:, 1] = x[:, 0]
    out, _ = build_augment(2, gamma={"prob": 1.0, "per_channel": True})(x, None, gen(1))
    assert not torch.allclose(out[:, 0], out[:, 1])


def test_separate_rotation_and_zoom_probabilities():
    """rotate_prob 1 / zoom_prob 0 only rotates: a zoomed-only sample would change a centred disc's area,
    a rotated-only one keeps it; and each probability fires on its own share of samples."""
    n = 400
    m = build_augment(2, affine={"prob": 0.0, "rotate_prob": 0.3, "zoom_prob": 0.6, "degrees": 30, "scale": [0.7, 1.4]})
    rng_masks = []

    class Spy:
        def __init__(self, gen):
            from fastvision.data.augment.spatial import _Rng

            self.r = _Rng(gen, n, torch.device("cpu"))

        def __getattr__(self, k):
            return getattr(self.r, k)

        def mask(self, p):
            out = self.r.mask(p)
            rng_masks.append((p, out.float().mean().item()))
            return out

    op = m.ops[0][1]
    op(torch.zeros(n, 1, 4, 4), None, Spy(gen(3)))
    probs = dict(rng_masks)
    assert abs(probs[0.3] - 0.3) < 0.07 and abs(probs[0.6] - 0.6) < 0.07
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    disc = (((yy - 15.5) ** 2 + (xx - 15.5) ** 2) < 8**2).float()[None, None]
    only_rot = build_augment(2, affine={"rotate_prob": 1.0, "zoom_prob": 0.0, "degrees": 40, "scale": [0.5, 0.5]})
    out, _ = only_rot(disc, None, gen(1))
    assert abs(out.sum().item() - disc.sum().item()) / disc.sum().item() < 0.03  # no 0.5 zoom (area x 4 or / 4)


@pytest.mark.parametrize("spec, key", [
    ({"blur": {"prob": 1.2}}, "data.augment.blur.prob"),
    ({"blur": {"channel_prob": -0.1}}, "data.augment.blur.channel_prob"),
    ({"lowres": {"range": [0.9, 0.5]}}, "data.augment.lowres.range"),
    ({"lowres": {"ignore_axes": [3]}}, "data.augment.lowres.ignore_axes"),
    ({"affine": {"zoom_prob": 2.0}}, "data.augment.affine.zoom_prob"),
    ({"gamma_inverted": {"prob": -1.0}}, "data.augment.gamma_inverted.prob"),
])
def test_bad_probabilities_name_the_key(spec, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_augment(3, **spec)


def test_new_ops_deterministic_and_shape_preserving():
    spec = {"blur": {"prob": 0.5}, "lowres": {"prob": 0.5}, "gamma_inverted": {"prob": 0.5, "retain_stats": True},
            "gamma": {"prob": 0.5, "per_channel": True, "retain_stats": True}}
    x = torch.rand(4, 2, 8, 8, 8, generator=gen(2))
    a, _ = build_augment(3, **spec)(x.clone(), None, gen(11))
    b, _ = build_augment(3, **spec)(x.clone(), None, gen(11))
    assert a.shape == x.shape and torch.equal(a, b) and torch.isfinite(a).all()


def test_flip_one_pass_per_sample_equals_each_axis_drawn_in_turn():
    """The CPU path flips a sample once over all its drawn axes; the masks are the same draws (one per
    axis, in axis order) as flipping axis by axis."""
    x, lab = torch.rand(6, 2, 4, 5, 3, generator=gen(12)), torch.randint(0, 300, (6, 4, 5, 3), generator=gen(13))
    out, out_lab = build_augment(3, flip={"prob": 0.5})(x, lab, gen(14))
    g = gen(14)
    masks = [torch.rand(6, generator=g) < 0.5 for _ in range(3)]
    for i in range(6):
        dims = [a for a in range(3) if masks[a][i]]
        assert torch.equal(out[i], x[i].flip([d + 1 for d in dims])) and torch.equal(out_lab[i], lab[i].flip(dims))
    assert out_lab.dtype == torch.int64  # labels beyond uint8 are moved as they are
    x0, lab0 = torch.rand(6, 2, 4, 5, 3, generator=gen(12)), torch.randint(0, 300, (6, 4, 5, 3), generator=gen(13))
    assert torch.equal(x, x0) and torch.equal(lab, lab0)  # the caller's tensors are left as they were


@pytest.mark.parametrize("prob", [0.5, 1.0])
def test_flip_after_an_op_that_made_the_batch_flips_each_sample_as_drawn(prob):
    """Behind the affine that cuts the patch (its own new tensor), the flip writes each drawn sample's flip
    over its row in place (prob 0.5: mixed axes) or flips the batch at once (prob 1: all axes everywhere);
    either way sample i is the affine's output flipped over the axes its three draws chose."""
    x, lab = torch.rand(5, 2, 9, 8, 7, generator=gen(40)), torch.randint(0, 3, (5, 9, 8, 7), generator=gen(41))
    aff = {"prob": 0.7, "degrees": 20, "size": [6, 5, 4]}
    g = gen(42)
    ref, ref_lab = build_augment(3, affine=aff)(x, lab, g)  # the same draws, then the flip's from g
    masks = [torch.rand(5, generator=g) < prob for _ in range(3)]
    out, out_lab = build_augment(3, affine=aff, flip={"prob": prob})(x, lab, gen(42))
    flipped = 0
    for i in range(5):
        dims = [a for a in range(3) if masks[a][i]]
        flipped += bool(dims)
        assert torch.equal(out[i], ref[i].flip([d + 1 for d in dims]))
        assert torch.equal(out_lab[i], ref_lab[i].flip(dims))
    assert flipped >= 3


def test_labels_move_as_uint8_and_come_back_in_their_dtype():
    lab = torch.randint(0, 4, (2, 6, 6, 6), generator=gen(15))
    aug = build_augment(3, flip={"prob": 1.0}, affine={"prob": 1.0, "degrees": 20})
    out8, lab8 = aug(torch.rand(2, 1, 6, 6, 6, generator=gen(16)), lab.to(torch.uint8), gen(17))
    out64, lab64 = aug(torch.rand(2, 1, 6, 6, 6, generator=gen(16)), lab, gen(17))
    assert lab64.dtype == torch.int64 and lab8.dtype == torch.uint8 and torch.equal(lab64, lab8.long())
    assert torch.equal(out8, out64)


@pytest.mark.parametrize("nd", [2, 3])
def test_linear_grid_is_affine_grid(nd):
    from fastvision.data.augment.affine import _linear_grid

    lin = torch.randn(3, nd, nd, generator=gen(18))
    shape = [3, 1, *([5, 7, 4][:nd])]
    ref = F.affine_grid(torch.cat([lin, torch.zeros(3, nd, 1)], 2), shape, align_corners=False)
    assert torch.allclose(_linear_grid(lin, torch.Size(shape[2:])), ref, atol=1e-6)


def test_sampling_scale_shrinks_by_the_draw():
    """nnU-Net's scale s multiplies the sampling coordinates: s = 2 halves a centred cube (zoom 1/2);
    as a zoom (the default), 2 doubles it."""
    lab = torch.zeros(1, 16, 16, 16, dtype=torch.long)
    lab[:, 4:12, 4:12, 4:12] = 1
    spec = {"prob": 0.0, "rotate_prob": 0.0, "zoom_prob": 1.0, "scale": [2.0, 2.0], "same_zoom": True}
    _, small = build_augment(3, affine={**spec, "sampling_scale": True})(torch.zeros(1, 1, 16, 16, 16), lab, gen(0))
    _, big = build_augment(3, affine=spec)(torch.zeros(1, 1, 16, 16, 16), lab, gen(0))
    assert int(small.sum()) == 4**3 and int(big.sum()) == 16**3


def test_fused_sampler_matches_grid_sample():
    """resample.sample (what affine.compiled compiles) against grid_sample: trilinear image, nearest label."""
    from fastvision.data.augment.resample import sample

    x = torch.rand(2, 2, 9, 8, 7, generator=gen(19))
    lab = torch.randint(0, 3, (2, 9, 8, 7), generator=gen(20), dtype=torch.uint8)
    lin = torch.eye(3).repeat(2, 1, 1) * 0.9 + torch.randn(2, 3, 3, generator=gen(21)) * 0.2
    grid = F.affine_grid(torch.cat([lin, torch.zeros(2, 3, 1)], 2), list(x.shape), align_corners=False)
    img, out_lab = sample(x, lab, lin)
    assert torch.allclose(img, F.grid_sample(x, grid, align_corners=False), atol=1e-5)
    ref = F.grid_sample(lab[:, None].float(), grid, mode="nearest", align_corners=False)[:, 0].to(torch.uint8)
    assert (out_lab != ref).float().mean() < 0.01 and out_lab.dtype == torch.uint8  # ties at .5 may round apart


def test_blur_rows_each_with_their_own_sigmas():
    """Every (sample, channel) row blurred with its own sigma per axis (drawn after the two masks), each
    against scipy's Gaussian filter with that row's kernel."""
    x = torch.rand(3, 2, 7, 6, 8, generator=gen(22))
    out, _ = build_augment(3, blur={"prob": 1.0, "sigma": [0.5, 1.0], "channel_prob": 1.0})(x.clone(), None, gen(23))
    g = gen(23)
    torch.rand(3, generator=g), torch.rand(3, 2, generator=g)  # the sample and channel draws
    sig = 0.5 + 0.5 * torch.rand(3, 2, 3, generator=g)
    for b in range(3):
        for c in range(2):
            ref = x[b, c].double().numpy()
            for a in range(3):
                s = float(sig[b, c, a])
                half = int(odd_kernel_size(torch.tensor(s))) // 2
                ref = ndimage.gaussian_filter1d(ref, s, axis=a, mode="mirror", truncate=(half + 0.2) / s)
            assert np.allclose(out[b, c].double().numpy(), ref, atol=1e-5)


def test_linear_label_hand_cases():
    """``label_mode: linear`` (batchgeneratorsv2's per-class bilinear + argmax, ties to the nearest label)
    on a 4 x 4 label zoomed by 1/2 (``sampling_scale`` 2): output voxel (1, 1) samples input pixel
    (0.5, 0.5), the centre of labels [[1, 2], [3, 3]]: class 3 has half the weight and wins, where nearest
    takes voxel (0, 0)'s 1. Output voxel (2, 2) samples (2.5, 2.5) of [[2, 0], [2, 0]]: a 2-0 tie, settled
    by the nearest voxel (2, 2): 2. Outside the input: background."""
    lab = torch.tensor([[1, 2, 0, 0], [3, 3, 0, 0], [0, 0, 2, 0], [0, 0, 2, 0]], dtype=torch.uint8)[None]
    spec = {"prob": 0.0, "rotate_prob": 0.0, "zoom_prob": 1.0, "scale": [2.0, 2.0], "same_zoom": True,
            "sampling_scale": True}
    img = torch.zeros(1, 1, 4, 4)
    _, near = build_augment(2, affine=spec)(img, lab, gen(0))
    _, lin = build_augment(2, affine={**spec, "label_mode": "linear"})(img, lab, gen(0))
    assert lin.dtype == torch.uint8 and lin.shape == lab.shape
    assert int(near[0, 1, 1]) == 1 and int(lin[0, 1, 1]) == 3
    assert int(lin[0, 2, 2]) == 2 and int(lin[0, 0, 0]) == 0 and int(lin[0, 3, 3]) == 0
    _, given = build_augment(2, affine={**spec, "label_mode": "linear", "label_classes": 4})(img, lab, gen(0))
    assert torch.equal(given, lin)  # the class count given (no host sync on a GPU) or read from the batch


def test_enlarged_patch_centre_crop_and_no_zero_corners():
    """``affine.size``: a 12^3 patch from a 20^3 input. Not firing: the centred crop (margin 4 each side);
    firing with no rotation or zoom: the same voxels (a bilinear read at voxel centres); rotated 30 degrees
    about every axis, the corners come from the margin: no zeros, where the same rotation of the 12^3
    patch alone leaves zero corners."""
    x = torch.rand(2, 1, 20, 20, 20, generator=gen(30)) + 1
    lab = torch.randint(0, 3, (2, 20, 20, 20), generator=gen(31))
    still = build_augment(3, affine={"prob": 0.0, "size": [12, 12, 12]})(x, lab, gen(0))
    assert torch.equal(still[0], x[:, :, 4:16, 4:16, 4:16]) and torch.equal(still[1], lab[:, 4:16, 4:16, 4:16])
    same = build_augment(3, affine={"prob": 1.0, "size": [12, 12, 12]})(x, lab, gen(0))
    assert torch.allclose(same[0], still[0], atol=1e-5) and torch.equal(same[1], still[1])
    rot = {"prob": 1.0, "degrees": 30.0, "rotate_prob": 1.0, "zoom_prob": 0.0}
    big, _ = build_augment(3, affine={**rot, "size": [12, 12, 12]})(x, lab, gen(1))
    alone, _ = build_augment(3, affine=rot)(x[:, :, 4:16, 4:16, 4:16].contiguous(), lab[:, 4:16, 4:16, 4:16], gen(1))
    assert big.shape == (2, 1, 12, 12, 12) and big.min() > 0.5 and (alone == 0).any()
    # one sample firing (the CPU path's index_copy into the centred crops)
    half, half_lab = build_augment(3, affine={"prob": 0.5, "degrees": 30.0, "size": [12, 12, 12]})(x, lab, gen(2))
    assert half.shape == (2, 1, 12, 12, 12) and half_lab.shape == (2, 12, 12, 12)
    # nnU-Net's order: the spatial transform cuts the patch first, the mirror moves the smaller patch
    names = [n for n, _ in build_augment(3, flip={"prob": 0.5}, affine={"size": [12, 12, 12]}).ops]
    assert names == ["affine", "flip"]


@pytest.mark.parametrize("spec, key", [({"size": [8, 8]}, "size"), ({"label_mode": "cubic"}, "label_mode"),
                                       ({"label_classes": 0}, "label_classes")])
def test_bad_affine_size_or_label_mode_names_the_key(spec, key):
    with pytest.raises(ConfigError, match=f"data.augment.affine.{key}"):
        build_augment(3, affine=spec)
