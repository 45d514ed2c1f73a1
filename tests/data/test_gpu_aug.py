"""Batched augmentation: config checking, determinism, shapes, label alignment, hand-computed ops."""
from __future__ import annotations

import colorsys
import math

import pytest
import torch

from fastvision.data.augment.intensity import _shift_hue
from fastvision.data.augment.spatial import affine, build_augment
from fastvision.errors import ConfigError

FULL = {
    "crop": {"size": [6, 6], "pos": 1, "neg": 1},
    "flip": {"prob": 0.5},
    "rot90": {"prob": 0.5},
    "affine": {"prob": 0.5, "degrees": 20, "scale": [0.9, 1.1]},
    "intensity": {"prob": 0.5, "scale": 0.1, "shift": 0.1},
    "noise": {"prob": 0.5, "std": 0.1},
    "brightness": {"prob": 0.5},
    "contrast": {"prob": 0.5},
    "gamma": {"prob": 0.5, "range": [0.7, 1.5]},
}


def full_spec(nd: int) -> dict:
    spec = {k: dict(v) for k, v in FULL.items()}
    spec["crop"]["size"] = [6] * nd
    return spec


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("spec, match", [
    ({"flop": {}}, "data.augment.flop"),
    ({"flip": {"probability": 0.5}}, "data.augment.flip.probability"),
    ({"flip": {"prob": "high"}}, "data.augment.flip.prob"),
    ({"flip": {"prob": 1.5}}, "data.augment.flip.prob"),
    ({"flip": {"axes": [2]}}, "data.augment.flip.axes"),
    ({"crop": {"pos": 1}}, "data.augment.crop"),
    ({"crop": {"size": [4, 4, 4]}}, "data.augment.crop.size"),
    ({"affine": {"scale": [1.2, 0.8]}}, "data.augment.affine.scale"),
    ({"affine": {"rotate_axes": [2]}}, "data.augment.affine.rotate_axes"),
    ({"affine": {"zoom_axes": [0, 5]}}, "data.augment.affine.zoom_axes"),
    ({"noise": 0.1}, "data.augment.noise"),
])
def test_bad_spec_names_the_key(spec, match):
    with pytest.raises(ConfigError, match=match.replace(".", r"\.")):
        build_augment(2, **spec)


def test_empty_spec_is_none():
    assert build_augment(3) is None
    assert build_augment(2, flip=None) is None


@pytest.mark.parametrize("nd", [2, 3])
def test_deterministic_under_seed(nd):
    aug = build_augment(nd, **full_spec(nd))
    x = torch.randn(4, 2, *[9] * nd)
    y = (torch.rand(4, *[9] * nd) > 0.7).long()
    a = aug(x, y, gen(3))
    b = aug(x, y, gen(3))
    c = aug(x, y, gen(4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert a[0].shape == (4, 2, *[6] * nd) and a[1].shape == (4, *[6] * nd) and a[1].dtype == torch.int64
    x0, y0 = x.clone(), y.clone()
    aug(x, y, gen(0))
    assert torch.equal(x, x0) and torch.equal(y, y0)  # inputs untouched


def ids(b: int, spatial: list[int]) -> torch.Tensor:
    """(B, *S) int64: a unique id per voxel (and per sample), a function of the coordinates."""
    n = math.prod(spatial)
    return torch.arange(b * n).reshape(b, *spatial)


@pytest.mark.parametrize("nd, spatial, spec", [
    (2, [8, 8], {"flip": {"prob": 0.5}, "rot90": {"prob": 0.7}}),
    (2, [8, 10], {"crop": {"size": [5, 7]}, "flip": {"prob": 0.5}, "rot90": {"prob": 0.7}}),
    (3, [6, 7, 7], {"flip": {"prob": 0.5, "axes": [0, 2]}, "rot90": {"prob": 0.7}}),
    (3, [6, 8, 8], {"crop": {"size": [4, 5, 5], "pos": 1, "neg": 2}, "flip": {"prob": 0.5}, "rot90": {"prob": 1.0}}),
    (2, [4, 4], {"crop": {"size": [6, 6]}}),  # padding path
])
def test_labels_follow_geometry(nd, spatial, spec):
    """Image channel 0 carries the label's id: exact geometric ops must keep them equal."""
    aug = build_augment(nd, **spec)
    y = ids(6, spatial)
    x = torch.stack([y.float(), torch.zeros_like(y, dtype=torch.float32)], 1)
    xo, yo = aug(x, y, gen(1))
    assert torch.equal(xo[:, 0], yo.float())
    one_hot = torch.stack([y.float(), -y.float()], 1)  # float (B, L, *S) labels follow too
    xo2, yo2 = aug(x, one_hot, gen(1))
    assert torch.equal(xo2[:, 0], yo2[:, 0]) and torch.equal(xo, xo2)
    # Each output voxel came from its own sample (crop/flip never mixes samples).
    n = math.prod(spatial)
    owner = torch.div(yo, n, rounding_mode="floor").flatten(1)
    if "crop" not in spec or spec["crop"]["size"][0] <= spatial[0]:  # padding adds id-0 voxels
        assert torch.equal(owner, torch.arange(6)[:, None].expand_as(owner))


@pytest.mark.parametrize("size", [[8, 8], [6, 10]])
def test_affine_quarter_turn_is_rot90(size):
    """A 90-degree rotation maps pixel centres onto pixel centres: it must equal torch.rot90 (square)."""
    y = ids(2, size)
    x = y.float()[:, None]
    ang = torch.full((2, 1), math.pi / 2)
    xo, yo = affine(x, y, ang, torch.ones(2, 2))
    if size[0] == size[1]:
        ref = torch.rot90(x, -1, (-2, -1))  # counter-clockwise in (x, y) with y down = rot90 k=-1
        assert torch.allclose(xo, ref, atol=1e-3)
        assert torch.equal(yo, torch.rot90(y, -1, (-2, -1)))
    else:
        assert torch.allclose(xo[:, 0].round(), yo.float().where(xo[:, 0] != 0, 0))


@pytest.mark.parametrize("nd", [2, 3])
def test_affine_identity_and_label_alignment(nd):
    y = ids(2, [6] * nd)
    x = y.float()[:, None]
    xo, yo = affine(x, y, torch.zeros(2, 1 if nd == 2 else 3), torch.ones(2, nd))
    assert torch.allclose(xo, x, atol=1e-3) and torch.equal(yo, y)
    # Blocky labels under a 30-degree rotation + zoom: bilinear image and nearest label agree
    # away from block edges; a wrong direction or centre would disagree almost everywhere.
    blocks = torch.zeros(2, *[16] * nd, dtype=torch.long)
    coords = torch.meshgrid(*[torch.arange(16) // 4] * nd, indexing="ij")
    blocks[:] = sum(c * 4**i for i, c in enumerate(coords)) + 1
    ang = torch.tensor([[0.5], [-0.3]]) if nd == 2 else torch.tensor([[0.5, 0.2, -0.3], [0.1, -0.4, 0.2]])
    xo, yo = affine(blocks.float()[:, None], blocks, ang, torch.full((2, nd), 1.1))
    inside = (yo > 0) & (xo[:, 0] > 0)
    agree = (xo[:, 0].round().long() == yo) & inside
    assert agree.sum() > 0.5 * inside.sum()


@pytest.mark.parametrize("restrict", [True, False])
def test_affine_in_plane_of_one_axis(restrict):
    """rotate_axes=[2], zoom_axes=[0, 1]: every slice along axis 2 is turned and zoomed in its own
    plane, so a volume whose value is the slice index keeps that value (or the zero padding) in
    every slice; rotating about all axes mixes the slices."""
    vol = torch.arange(8.0).expand(4, 1, 16, 16, 8).clone()  # (B, C, X, Y, Z): value = z index
    opts = {"prob": 1.0, "degrees": 180, "scale": [0.7, 1.4], "same_zoom": True}
    if restrict:
        opts.update(rotate_axes=[2], zoom_axes=[0, 1])
    out, _ = build_augment(3, affine=opts)(vol, None, gen(0))
    z = torch.arange(8.0).expand_as(out)
    # in-plane interpolation only blends a slice's value with the zero padding: 0 <= out <= z, slice 0
    # stays 0, and away from the edges the slice's value is exact; blending across slices breaks this
    in_plane = (out >= -1e-5) & (out <= z + 1e-4)
    if restrict:
        assert in_plane.all() and out[..., 0].abs().max() < 1e-5
        assert torch.isclose(out, z, atol=1e-4)[..., 1:].float().mean() > 0.3
    else:
        assert not (in_plane.all() and out[..., 0].abs().max() < 1e-5)


def test_affine_same_zoom_is_one_factor_per_sample():
    """A box of 1s in the centre zoomed with same_zoom keeps its aspect: its extent grows by the same
    factor along the zoomed axes; with zoom_axes=[0] axis 1 keeps its extent."""
    img = torch.zeros(6, 1, 32, 32)
    img[:, :, 12:20, 12:20] = 1.0

    def extents(out):
        m = out[:, 0] > 0.5
        return m.any(2).sum(1).float(), m.any(1).sum(1).float()  # along axis 0, along axis 1

    out, _ = build_augment(2, affine={"prob": 1.0, "scale": [0.5, 1.5], "same_zoom": True})(img, None, gen(1))
    e0, e1 = extents(out)
    assert torch.allclose(e0, e1, atol=1.0) and (e0 - 8).abs().max() > 1  # zoomed, and the same along both
    out, _ = build_augment(2, affine={"prob": 1.0, "scale": [0.5, 1.5], "zoom_axes": [0]})(img, None, gen(1))
    e0, e1 = extents(out)
    assert torch.equal(e1, torch.full_like(e1, 8.0)) and (e0 - 8).abs().max() > 1


@pytest.mark.parametrize("pos, neg", [(1.0, 0.0), (0.0, 1.0)])
def test_pos_neg_crop_centres_on_requested_class(pos, neg):
    """With one odd voxel per sample, pos-only (or neg-only) crops must all contain it."""
    b, s = 8, [12, 12, 12]
    g = gen(0)
    where = torch.randint(0, 12, (b, 3), generator=g)
    y = torch.zeros(b, *s, dtype=torch.long) if pos else torch.ones(b, *s, dtype=torch.long)
    y[torch.arange(b), where[:, 0], where[:, 1], where[:, 2]] = 1 - y[0, 0, 0, 0]
    aug = build_augment(3, crop={"size": [3, 3, 3], "pos": pos, "neg": neg})
    _, yo = aug(torch.zeros(b, 1, *s), y, gen(5))
    odd = (yo > 0) if pos else (yo == 0)
    assert odd.flatten(1).sum(1).tolist() == [1] * b


def test_uniform_crop_covers_positions():
    y = ids(1, [10]).expand(64, 10)[:, None].float()
    aug = build_augment(2, crop={"size": [1, 4]})
    xo, _ = aug(y[:, None].expand(64, 1, 1, 10).contiguous(), None, gen(0))
    starts = set(xo[:, 0, 0, 0].long().tolist())
    assert starts == set(range(7))  # all 7 valid starts drawn in 64 samples


@pytest.mark.parametrize("name, opts, check", [
    ("brightness", {"prob": 1.0, "factor": 0.3}, "ratio"),
    ("intensity", {"prob": 1.0, "scale": 0.3}, "ratio"),
    ("contrast", {"prob": 1.0, "factor": 0.5}, "range"),
    ("gamma", {"prob": 1.0, "range": [0.5, 2.0]}, "range"),
])
def test_intensity_ops(name, opts, check):
    x = torch.rand(4, 2, 8, 8) + 0.5
    xo, _ = build_augment(2, **{name: opts})(x, None, gen(2))
    flat, fo = x.flatten(2), xo.flatten(2)
    if check == "ratio":  # one factor per sample, within the configured range
        r = xo / x
        f = next(v for k, v in opts.items() if k != "prob")
        assert torch.allclose(r, r[:, :1, :1, :1].expand_as(r), atol=1e-5)
        assert ((r - 1).abs() <= f + 1e-5).all() and not torch.allclose(r, torch.ones_like(r))
    else:  # per-channel range preserved, values changed
        assert (fo.amin(2) >= flat.amin(2) - 1e-5).all() and (fo.amax(2) <= flat.amax(2) + 1e-5).all()
        assert not torch.allclose(xo, x)


def test_foreground_shift_is_seed000_brightness_correction():
    """DLE's RandomBrightnessCorrection (dataset/transforms.py), by hand: a sample fires with p 0.5; then
    each channel gets one offset in [0.9, 1.1) added where the z-scored value is > 0, nothing elsewhere."""
    x = torch.randn(400, 4, 3, 4, 5)
    x[:, :, 0] = 0.0  # background (0 after the foreground z-score) stays 0
    xo, _ = build_augment(3, foreground_shift={"prob": 0.5, "range": [0.9, 1.1]})(x, None, gen(3))
    d, pos = xo - x, x > 0
    fired = d.flatten(1).abs().amax(1) > 0
    assert 0.4 < fired.float().mean() < 0.6
    assert torch.equal(d[~pos], torch.zeros_like(d[~pos]))  # x <= 0: untouched, fired or not
    for b in range(x.shape[0]):
        offsets = [d[b, c][pos[b, c]] for c in range(4)]
        if not fired[b]:
            assert all(torch.equal(o, torch.zeros_like(o)) for o in offsets)
            continue
        for o in offsets:  # one offset per channel, in range
            assert torch.allclose(o, o[0].expand_as(o), atol=1e-6) and 0.9 - 1e-6 <= float(o[0]) < 1.1 + 1e-6
        assert len({round(float(o[0]), 6) for o in offsets}) == 4  # drawn per channel
    with pytest.raises(ConfigError, match=r"data.augment.foreground_shift.range"):
        build_augment(3, foreground_shift={"range": [1.1, 0.9]})


def test_noise_and_prob_zero_is_identity():
    x = torch.rand(3, 1, 5, 5, 5)
    assert torch.equal(build_augment(3, noise={"prob": 0.0, "std": 1.0})(x, None, gen(0))[0], x)
    xo, _ = build_augment(3, noise={"prob": 1.0, "std": 1.0})(x, None, gen(0))
    assert 0 < (xo - x).std() < 1.0


def test_hue_shift_matches_colorsys():
    g = gen(0)
    rgb = torch.rand(4, 3, 3, 5, generator=g)
    shift = torch.tensor([0.1, -0.25, 0.5, 1 / 3])
    out = _shift_hue(rgb, shift)
    for b in range(4):
        for i in range(3):
            for j in range(5):
                h, s, v = colorsys.rgb_to_hsv(*rgb[b, :, i, j].tolist())
                ref = colorsys.hsv_to_rgb((h + shift[b].item()) % 1.0, s, v)
                assert torch.allclose(out[b, :, i, j], torch.tensor(ref), atol=1e-5)


def test_color_jitter_saturation_zero_is_gray():
    x = 0.5 + 0.1 * torch.rand(2, 3, 4, 4)  # low saturation: factors up to 2 stay inside [0, 1]
    aug = build_augment(2, color_jitter={"prob": 1.0, "saturation": 1.0})
    xo, _ = aug(x, None, gen(0))
    assert xo.shape == x.shape and (xo >= 0).all() and (xo <= 1).all()
    with pytest.raises(ConfigError, match="RGB"):
        aug(torch.rand(2, 1, 4, 4), None, gen(0))
    gray = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    gray_out = 0.299 * xo[:, 0] + 0.587 * xo[:, 1] + 0.114 * xo[:, 2]
    assert torch.allclose(gray, gray_out, atol=1e-5)  # blending with luma keeps luma


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_without_host_sync():
    spec = full_spec(3)
    del spec["noise"]  # noise is drawn on the device generator: same law, different stream
    aug = build_augment(3, **spec)
    x = torch.randn(4, 2, 9, 9, 9)
    y = (torch.rand(4, 9, 9, 9) > 0.7).long()
    cpu = aug(x, y, gen(3))
    xc, yc = x.cuda(), y.cuda()  # the copies from pageable memory wait by design: outside the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = aug(xc, yc, gen(3))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.allclose(gpu[0].cpu(), cpu[0], atol=1e-4) and torch.equal(gpu[1].cpu(), cpu[1])
