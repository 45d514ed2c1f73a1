"""Pathology: synthetic slides, tile-by-tile reading vs tifffile's whole-image read, patch
labels vs the masks, both layouts, errors, heat maps, and FROC against a hand computation and
MONAI's Camelyon16 implementation."""
from __future__ import annotations

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from fastvision.data.formats import heatmap as H
from fastvision.data.formats import pathology as P
from fastvision.data.synth import pathology as S
from fastvision.errors import DataError
from fastvision.metrics import froc as FR
from fastvision.registry import DATASETS


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    return S.synth(tmp_path_factory.mktemp("path"), seed=1, slides=2, val_slides=1, size=256, lesions=2, tile=64)


def test_synth_layout_tiled_and_deterministic(slides, tmp_path):
    img = slides / "train" / "images" / "slide_000.tif"
    with tifffile.TiffFile(img) as t:
        assert t.pages[0].is_tiled and t.pages[0].shape == (256, 256, 3)
    mask = tifffile.imread(slides / "train" / "masks" / "slide_000.tif")
    assert mask.dtype == np.uint8 and 0 < mask.mean() < 0.5  # tumour slide
    assert tifffile.imread(slides / "train" / "masks" / "slide_001.tif").max() == 0  # normal slide
    again = S.synth(tmp_path, seed=1, slides=2, val_slides=1, size=256, lesions=2, tile=64)
    np.testing.assert_array_equal(tifffile.imread(again / "train" / "images" / "slide_000.tif"), tifffile.imread(img))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_synth_lesions_are_whole_blobs(seed):
    # each drawn blob is one lesion (overlapping blobs may merge), not a lesion plus frayed specks
    for n in (1, 3):
        mask = S.lesion_mask(512, n, np.random.default_rng(seed))
        assert 1 <= FR.label_components(mask > 0).max() <= n


@pytest.mark.parametrize("y,x,h,w", [(0, 0, 64, 64), (10, 50, 100, 30), (200, 230, 80, 40), (-5, -7, 20, 20),
                                     (300, 0, 4, 4)])
def test_read_region_matches_whole_read(slides, y, x, h, w):
    path = slides / "train" / "images" / "slide_000.tif"
    whole = tifffile.imread(path)
    ref = np.zeros((h, w, 3), np.uint8)
    ys, xs = slice(max(y, 0), min(y + h, 256)), slice(max(x, 0), min(x + w, 256))
    if ys.start < ys.stop and xs.start < xs.stop:
        ref[ys.start - y:ys.stop - y, xs.start - x:xs.stop - x] = whole[ys, xs]
    np.testing.assert_array_equal(P.TiledTiff(path).read_region(y, x, h, w), ref)


def test_slide_patches_labels_follow_mask(slides):
    splits = DATASETS.build("pathology", {"path": str(slides), "patch_size": 32, "normal_per_tumor": 1.0})
    train = splits.train
    assert splits.info["train_tumor"] > 0
    n_normal = splits.info["train_patches"] - splits.info["train_tumor"]
    assert n_normal == splits.info["train_tumor"]  # balanced 1:1
    masks = {}
    for i in range(len(train)):
        path, y, x, label = train.samples[i]
        key = path.replace("/images/", "/masks/")
        m = masks.setdefault(key, tifffile.imread(key))[y:y + 32, x:x + 32]
        if label == 1:
            assert m[8:24, 8:24].mean() >= 0.5
        else:
            assert m.max() == 0
    item = train[0]
    assert item["image"].dtype == torch.uint8 and item["image"].shape == (3, 32, 32)
    assert item["label"].dtype == torch.int64 and item["label"].shape == ()
    path, y, x, _ = train.samples[0]
    np.testing.assert_array_equal(item["image"].permute(1, 2, 0).numpy(), tifffile.imread(path)[y:y + 32, x:x + 32])


def test_tumour_patches_are_darker(slides):
    # the synthetic tumour texture (dense dark nuclei) is what a classifier can learn
    ds = DATASETS.build("pathology", {"path": str(slides), "patch_size": 32}).train
    mean = {0: [], 1: []}
    for i in range(len(ds)):
        it = ds[i]
        mean[int(it["label"])].append(it["image"].float().mean().item())
    assert max(mean[1]) < min(mean[0])


def test_patch_folder_layout(tmp_path):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in ("normal", "tumor"):
            d = tmp_path / split / name
            d.mkdir(parents=True)
            for i in range(2):
                Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(d / f"{i}.png")
    splits = DATASETS.build("pathology", {"path": str(tmp_path), "patch_size": 16})
    assert [s[1] for s in splits.train.samples] == [0, 0, 1, 1]
    item = splits.val[3]
    assert item["image"].shape == (3, 16, 16) and item["label"].item() == 1


def test_errors(tmp_path, slides):
    with pytest.raises(DataError, match="not found"):
        DATASETS.build("pathology", {"path": str(tmp_path / "x")})
    (tmp_path / "train" / "normal").mkdir(parents=True)
    with pytest.raises(DataError, match="normal: no patch images"):
        DATASETS.build("pathology", {"path": str(tmp_path)})
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "train" / "normal" / "a.png")
    with pytest.raises(DataError, match="tumor: missing"):
        DATASETS.build("pathology", {"path": str(tmp_path)})
    (tmp_path / "train" / "images").mkdir()
    with pytest.raises(DataError, match="no .tif slides"):
        DATASETS.build("pathology", {"path": str(tmp_path)})
    (tmp_path / "train" / "images" / "bad.tif").write_bytes(b"II*\x00garbage")
    with pytest.raises(DataError, match="bad.tif"):
        DATASETS.build("pathology", {"path": str(tmp_path)})
    (tmp_path / "train" / "images" / "bad.tif").unlink()
    tifffile.imwrite(tmp_path / "train" / "images" / "s.tif", np.zeros((64, 64, 3), np.uint8), tile=(32, 32))
    (tmp_path / "train" / "masks").mkdir()
    tifffile.imwrite(tmp_path / "train" / "masks" / "s.tif", np.zeros((32, 64), np.uint8))
    with pytest.raises(DataError, match="differs"):
        DATASETS.build("pathology", {"path": str(tmp_path)})


def test_slide_heatmap_and_writers(slides, tmp_path):
    path = slides / "val" / "images" / "slide_000.tif"
    whole = tifffile.imread(path).astype(np.float64)
    heat = H.slide_heatmap(path, lambda x: 1 - x.float().mean((1, 2, 3)) / 255, patch_size=32, stride=32, batch_size=5)
    assert heat.shape == (8, 8)
    ref = 1 - whole.reshape(8, 32, 8, 32, 3).mean((1, 3, 4)) / 255
    np.testing.assert_allclose(heat, ref, rtol=1e-5)
    tif, png = H.write_heatmap(heat, tmp_path / "out" / "slide_000")
    np.testing.assert_array_equal(tifffile.imread(tif), heat)
    np.testing.assert_array_equal(np.asarray(Image.open(png)), np.rint(heat * 255).astype(np.uint8))


# ---------------------------------------------------------------- FROC

def test_label_components_hand_case():
    m = np.zeros((6, 7), bool)
    m[0, 0] = m[1, 1] = m[2, 2] = True  # diagonal chain: one component under 8-connectivity
    m[0, 5:7] = True
    m[4:6, 0:7] = True
    m[5, 3] = False
    lab = FR.label_components(m)
    assert lab.max() == 3
    assert lab[0, 0] == lab[2, 2] != lab[0, 5] and lab[4, 0] == lab[5, 6]
    assert (lab > 0).sum() == m.sum() and FR.label_components(np.ones((3, 3), bool)).max() == 1


def test_dilate_and_major_axis():
    m = np.zeros((5, 5), bool)
    m[2, 2] = True
    assert FR.dilate(m, 1.2).sum() == 5  # plus shape: diagonals at sqrt(2) > 1.2
    assert FR.dilate(m, 1.5).sum() == 9
    line = np.zeros((3, 7), np.int32)
    line[1, 1:6] = 1  # x in 0..4 around its mean: variance 2 -> 4 sqrt(2)
    np.testing.assert_allclose(FR.major_axis_length(line, 1), [4 * np.sqrt(2)])
    labels, itc = FR.evaluation_mask(line, itc_max_px=6.0)
    assert itc == {1}


def _hand_case():
    """Three slides (16x16 heat map = mask), three lesions, hand-placed peaks (NMS radius 1)."""
    heat = [np.zeros((16, 16)) for _ in range(3)]
    mask = [np.zeros((16, 16), np.uint8), np.zeros((16, 16), np.uint8), None]
    mask[0][1:5, 1:5] = 1      # lesion L1
    mask[0][10:14, 10:14] = 1  # lesion L2
    mask[1][1:4, 12:15] = 1    # lesion L3
    for s, y, x, p in [(0, 2, 2, 0.9), (0, 4, 4, 0.5), (0, 7, 7, 0.6), (0, 11, 11, 0.3),
                       (1, 2, 13, 0.8), (1, 8, 2, 0.2), (2, 5, 5, 0.7), (2, 12, 3, 0.1)]:
        heat[s][y, x] = p
    return heat, mask


def test_froc_hand_computed():
    heat, mask = _hand_case()
    # FP probs {0.6, 0.2, 0.7, 0.1}; lesion bests L1 0.9, L2 0.3, L3 0.8; 3 lesions, 3 slides.
    # thresholds (lowest, 0.1, skipped) 0.2 0.3 0.6 0.7 0.8 0.9 then the (0, 0) end point:
    #   FPs/slide 1, 2/3, 2/3, 1/3, 0, 0, 0 ; sensitivity 1, 1, 2/3, 2/3, 2/3, 1/3, 0
    # interpolated: @1/4 -> 2/3, @1/2 -> 2/3, @1, 2, 4, 8 -> 1   => FROC = (4/3 + 4) / 6 = 8/9
    out = FR.froc(heat, mask, threshold=0.05, nms_radius=1)
    assert out["froc"] == pytest.approx(8 / 9)
    assert [out[f"sens@{r:g}"] for r in FR.EVAL_FP_RATES] == pytest.approx([2 / 3, 2 / 3, 1, 1, 1, 1])
    assert FR.local_maxima(heat[0], 0.05, 1) == [(0.9, 2, 2), (0.6, 7, 7), (0.5, 4, 4), (0.3, 11, 11)]


def test_froc_matches_monai():
    from monai.metrics import (
        compute_fp_tp_probs,
        compute_froc_curve_data,
        compute_froc_score,
    )

    heat, mask = _hand_case()
    ours_fp, ours_tp, m_fp, m_tp, lesions = [], [], [], [], 0
    for h, msk in zip(heat, mask, strict=True):
        labels, itc = FR.evaluation_mask(msk if msk is not None else np.zeros_like(h))
        det = FR.local_maxima(h, 0.05, 1)
        fp, tp, n = FR.fp_tp_probs(det, labels, itc)
        ours_fp.append(fp), ours_tp.append(tp)
        lesions += n
        probs = np.array([d[0] for d in det])
        ys, xs = np.array([d[1] for d in det]), np.array([d[2] for d in det])
        # MONAI indexes evaluation_mask[y, x] with y_coord/x_coord
        mfp, mtp, _ = compute_fp_tp_probs(probs, ys, xs, labels)
        m_fp.append(np.asarray(mfp)), m_tp.append(np.asarray(mtp))
    ours = FR.froc_curve(np.concatenate(ours_fp), np.concatenate(ours_tp), lesions, 3)
    ref = compute_froc_curve_data(np.concatenate(m_fp), np.concatenate(m_tp), lesions, 3)
    np.testing.assert_allclose(ours[0], ref[0])
    np.testing.assert_allclose(ours[1], ref[1])
    assert FR.froc_summary(*ours)["froc"] == pytest.approx(compute_froc_score(*ref))


def test_froc_itc_and_scaled_mask():
    heat, mask = _hand_case()
    # masks at 2x the heat-map resolution give the same answer
    big = [None if m is None else np.kron(m, np.ones((2, 2), np.uint8)) for m in mask]
    assert FR.froc(heat, big, threshold=0.05)["froc"] == pytest.approx(8 / 9)
    # L3 (3x3, major axis 4 sqrt(2/3) = 3.27 px) becomes an ITC: its detection is ignored and
    # 2 lesions remain; L1 0.9, L2 0.3; FPs as before
    out = FR.froc(heat, mask, threshold=0.05, itc_max_px=3.5)
    fps, sens = FR.froc_curve(np.array([0.6, 0.2, 0.7, 0.1]), np.array([0.9, 0.3]), 2, 3)
    assert out["froc"] == pytest.approx(FR.froc_summary(fps, sens)["froc"])
    # by hand: thresholds 0.2 0.3 0.6 0.7 0.9 -> FPs 1, 2/3, 2/3, 1/3, 0, 0; sens 1, 1, 1/2, 1/2, 1/2, 0
    # @1/4: between (0, 1/2) and (1/3, 1/2) -> 1/2 ; @1/2 -> 1/2 ; @1.. -> 1  => (1 + 4) / 6
    assert out["froc"] == pytest.approx(5 / 6)


# ---------------------------------------------------------------- `fastvision froc` CLI

def _froc_cli(argv, monkeypatch):
    from fastvision import cli

    return cli.main(argv)


def _write_hand_case(tmp_path, fmt, up=2, pad=0):
    """The hand case on disk: heat maps as predict names them, masks `up` x larger (+ `pad` rows/cols),
    slide_002 (normal) without a mask."""
    heat, mask = _hand_case()
    hd, md = tmp_path / "heat", tmp_path / "masks"
    md.mkdir()
    for i, (h, m) in enumerate(zip(heat, mask, strict=True)):
        tif, png = H.write_heatmap(h.astype(np.float32), hd / f"slide_{i:03d}_heatmap")
        (png if fmt == "tif" else tif).unlink()
        if m is not None:
            big = np.pad(np.kron(m, np.ones((up, up), np.uint8)), ((0, pad), (0, pad)))
            tifffile.imwrite(md / f"slide_{i:03d}.tif", big, tile=(16, 16), photometric="minisblack")
    return hd, md


@pytest.mark.parametrize("fmt,up,pad,flags", [
    ("tif", 2, 0, []),
    ("png", 2, 0, []),                                  # 8-bit heat maps keep the order of the peaks
    ("tif", 2, 5, []),                                  # slide not a multiple of the stride: 37 // 16 = 2
    ("tif", 4, 3, ["--stride", "4", "--mask-downsample", "2"]),
    ("tif", 2, 0, ["--mask-downsample", "2"]),
])
def test_froc_cli_hand_case(tmp_path, monkeypatch, capsys, fmt, up, pad, flags):
    import json

    hd, md = _write_hand_case(tmp_path, fmt, up, pad)
    rc = _froc_cli(["froc", str(hd), str(md), "--threshold", "0.05", "--json", str(tmp_path / "f.json"), *flags],
                   monkeypatch)
    assert rc == 0
    out = json.loads((tmp_path / "f.json").read_text())
    assert out["froc"] == pytest.approx(8 / 9)  # the hand computation of test_froc_hand_computed
    assert (out["slides"], out["tumour_slides"], out["lesions"]) == (3, 2, 3)
    assert "FROC 0.8889" in capsys.readouterr().out


def test_froc_cli_itc_in_mask_pixels(tmp_path, monkeypatch):
    import json

    # masks 2x the heat map: L3 is 6x6 mask px, major axis 4 sqrt(35/12) = 6.83 px; ITC below 7 px
    # -> the hand value 5/6 of test_froc_itc_and_scaled_mask; below 6.5 px it still counts (8/9)
    hd, md = _write_hand_case(tmp_path, "tif")
    for limit, want in ((7.0, 5 / 6), (6.5, 8 / 9)):
        assert _froc_cli(["froc", str(hd), str(md), "--threshold", "0.05", "--itc-max-px", str(limit),
                          "--json", str(tmp_path / "f.json"), "--force"], monkeypatch) == 0
        assert json.loads((tmp_path / "f.json").read_text())["froc"] == pytest.approx(want)


def test_camelyon16_distances():
    # Evaluation_FROC.py at level 5 of a 0.243 um/px slide: 75 / (0.243 * 32 * 2), 275 / (0.243 * 32)
    d, i = FR.camelyon16_distances(0.243 * 2 ** 5)
    assert d == pytest.approx(4.8225, abs=1e-4) and i == pytest.approx(35.365, abs=1e-3)


def test_froc_cli_errors(tmp_path, monkeypatch, capsys):
    hd, md = _write_hand_case(tmp_path, "tif")
    (tmp_path / "empty").mkdir()
    assert _froc_cli(["froc", str(tmp_path / "empty"), str(md)], monkeypatch) == 2
    assert "no heat maps" in capsys.readouterr().err
    for p in md.iterdir():
        p.rename(md / f"other_{p.name}")
    assert _froc_cli(["froc", str(hd), str(md)], monkeypatch) == 2
    assert "no mask is named like a heat map" in capsys.readouterr().err
    assert _froc_cli(["froc", str(hd), str(tmp_path / "nope")], monkeypatch) == 2
    assert "folder not found" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    tifffile.imwrite(bad / "s.tif", np.full((4, 4), 2.0, np.float32))
    assert _froc_cli(["froc", str(bad), str(tmp_path / "empty")], monkeypatch) == 2
    assert "probabilities in [0, 1]" in capsys.readouterr().err
