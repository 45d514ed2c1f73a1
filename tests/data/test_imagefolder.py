"""ImageFolder format and the ``imagenet`` synthetic generator: layout, item shapes/dtypes,
crop geometry against hand-computed slices, draft decoding, and DataError on bad layouts."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from PIL import Image

from fastvision.data.formats import imagefolder as F
from fastvision.data.synth import imagenet as S
from fastvision.errors import DataError
from fastvision.registry import DATASETS


def _digest(root):
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.JPEG")):
        h.update(p.relative_to(root).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def synth_root(tmp_path_factory):
    return S.synth(tmp_path_factory.mktemp("inet"), seed=3, classes=3, per_class=4, val_per_class=2, size=48)


def test_synth_layout_and_determinism(synth_root, tmp_path):
    files = sorted(p.relative_to(synth_root).as_posix() for p in synth_root.rglob("*.JPEG"))
    assert len(files) == 3 * (4 + 2)
    assert "train/class002/00003.JPEG" in files and "val/class000/00001.JPEG" in files
    with Image.open(synth_root / files[0]) as im:
        assert im.format == "JPEG" and im.size == (48, 48) and im.mode == "RGB"
    again = S.synth(tmp_path, seed=3, classes=3, per_class=4, val_per_class=2, size=48)
    assert _digest(again) == _digest(synth_root)


def test_synth_classes_differ_in_colour(tmp_path):
    # mean hue of the object differs between classes: the dominant channel of the brightest pixels
    root = S.synth(tmp_path, seed=0, classes=3, per_class=6, val_per_class=1, size=48)
    dominant = []
    for c in range(3):
        arrs = [np.asarray(Image.open(p)).astype(float) for p in sorted((root / "train" / f"class{c:03d}").iterdir())]
        sat = [a[(a.max(-1) - a.min(-1)) > 90] for a in arrs]  # saturated pixels = the object
        dominant.append(int(np.concatenate(sat).mean(0).argmax()))
    assert dominant == [0, 1, 2]  # hues 0, 1/3, 2/3: red, green, blue


def test_build_items(synth_root):
    splits = DATASETS.build("imagefolder", {"path": str(synth_root), "image_size": 32, "resize_size": 40})
    assert splits.info["classes"] == ["class000", "class001", "class002"]
    assert (splits.info["train_images"], splits.info["val_images"]) == (12, 6)
    torch.manual_seed(0)
    for ds in (splits.train, splits.val):
        item = ds[len(ds) - 1]
        assert item["image"].dtype == torch.uint8 and item["image"].shape == (3, 32, 32)
        assert item["label"].dtype == torch.int64 and item["label"].shape == () and item["label"].item() == 2
        assert item["id"].endswith(".JPEG")
    # evaluation is deterministic
    assert torch.equal(splits.val[0]["image"], splits.val[0]["image"])


def _write_png(path, arr):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def test_center_crop_is_exact_slice(tmp_path):
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, size=(40, 80, 3), dtype=np.uint8)  # H=40, W=80
    _write_png(tmp_path / "a.png", arr)
    # shorter side 40 -> resize 40 (no scaling), centre crop 32: rows 4..36, cols 24..56
    out = F.load_crop(str(tmp_path / "a.png"), False, 32, 40, (0.08, 1.0), (0.75, 4 / 3), 0.0)
    np.testing.assert_array_equal(out, arr[4:36, 24:56])
    # shorter side 40 -> 20 halves everything: crop 16 covers original rows 4..36, cols 24..56
    assert F.center_box(80, 40, 20, 16) == (24.0, 4.0, 56.0, 36.0)


def test_train_full_box_and_flip(tmp_path):
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, size=(24, 24, 3), dtype=np.uint8)
    _write_png(tmp_path / "b.png", arr)
    out = F.load_crop(str(tmp_path / "b.png"), True, 24, 24, (1.0, 1.0), (1.0, 1.0), hflip=1.0)
    np.testing.assert_array_equal(out, arr[:, ::-1])


def test_random_resized_box_ranges():
    torch.manual_seed(0)
    for _ in range(200):
        left, top, right, bottom = F.random_resized_box(300, 200, (0.08, 1.0), (3 / 4, 4 / 3))
        w, h = right - left, bottom - top
        assert 0 <= left and 0 <= top and right <= 300 and bottom <= 200
        # rounding of w and h to whole pixels widens the ranges slightly
        assert 0.08 * 0.9 <= w * h / 60000 <= 1.0
        assert 0.75 * 0.9 <= w / h <= 4 / 3 * 1.1
    # impossible aspect -> centred fallback with clamped aspect
    assert F.random_resized_box(100, 10, (0.9, 1.0), (1.0, 1.0)) == (45.0, 0.0, 55.0, 10.0)


def test_draft_decoding_of_large_jpeg(tmp_path):
    yy, xx = np.mgrid[0:768, 0:1024]
    arr = np.stack([xx % 256, yy % 256, (xx + yy) % 256], -1).astype(np.uint8)
    path = tmp_path / "big.jpg"
    Image.fromarray(arr).save(path, quality=95)
    assert F.open_image(str(path), (256, 192)).size == (256, 192)  # DCT scale 1/4
    assert F.open_image(str(path), (300, 200)).size == (512, 384)  # 1/4 would be too small
    out = F.load_crop(str(path), False, 64, 64, (0.08, 1.0), (0.75, 4 / 3), 0.0)
    full = np.asarray(Image.open(path).convert("RGB").resize((64, 64), Image.BILINEAR, box=(128, 0, 896, 768)))
    assert out.shape == (64, 64, 3)
    assert np.abs(out.astype(int) - full.astype(int)).mean() < 12  # same picture, reduced decode


def test_bad_layouts(tmp_path):
    with pytest.raises(DataError, match="nope"):
        DATASETS.build("imagefolder", {"path": str(tmp_path / "nope")})
    (tmp_path / "train").mkdir()
    with pytest.raises(DataError, match="no class folders"):
        DATASETS.build("imagefolder", {"path": str(tmp_path)})
    (tmp_path / "train" / "cat").mkdir()
    with pytest.raises(DataError, match="cat: no images"):
        DATASETS.build("imagefolder", {"path": str(tmp_path)})
    _write_png(tmp_path / "train" / "cat" / "1.png", np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(DataError, match="val"):
        DATASETS.build("imagefolder", {"path": str(tmp_path)})
    _write_png(tmp_path / "val" / "dog" / "1.png", np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(DataError, match="dog"):
        DATASETS.build("imagefolder", {"path": str(tmp_path)})


def test_unreadable_image_names_path(tmp_path):
    for split in ("train", "val"):
        _write_png(tmp_path / split / "cat" / "ok.png", np.zeros((8, 8, 3), np.uint8))
    (tmp_path / "train" / "cat" / "broken.JPEG").write_bytes(b"\xff\xd8\xff garbage")
    splits = DATASETS.build("imagefolder", {"path": str(tmp_path), "image_size": 8, "resize_size": 8})
    broken = [i for i, (p, _) in enumerate(splits.train.samples) if p.endswith("broken.JPEG")][0]
    with pytest.raises(DataError, match="broken.JPEG"):
        splits.train[broken]


def test_dali_backend_without_dali_is_one_clear_error(tmp_path):
    """The optional DALI backend: where DALI (or CUDA) is missing, a ConfigError saying what to do."""
    try:
        import nvidia.dali  # noqa: F401

        pytest.skip("DALI is installed here")
    except ImportError:
        pass
    from fastvision.data.synth.imagenet import synth
    from fastvision.errors import ConfigError
    from fastvision.registry import DATASETS

    root = synth(tmp_path / "inet", classes=2, per_class=2, val_per_class=1, size=32)
    with pytest.raises(ConfigError, match="backend=dali needs NVIDIA DALI"):
        DATASETS.build("imagefolder", {"path": str(root), "backend": "dali"})


def test_backend_choice_is_checked(synth_root):
    """A misspelt ``data.args.backend`` is a ConfigError listing the decoders (pillow, dali, nvjpeg)."""
    from fastvision.errors import ConfigError

    with pytest.raises(ConfigError, match="backend.*'pillow', 'dali', 'nvjpeg'.*'nvjpg'"):
        DATASETS.build("imagefolder", {"path": str(synth_root), "backend": "nvjpg"})


@pytest.mark.parametrize("key,value", [("image_size", 0), ("resize_size", -1), ("scale", [0.9, 0.1]),
                                       ("scale", [0.5, 1.5]), ("ratio", [0.0, 1.0]), ("ratio", [2.0, 0.5]),
                                       ("hflip", 2.0)])
def test_crop_settings_no_image_can_take_are_one_line(synth_root, key, value):
    """A crop setting that is out of range stops before anything is read, naming its key (it was a
    ZeroDivisionError traceback, a 'math domain error', or a run that ignored it)."""
    from fastvision.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"^data\.args\.{key}="):
        DATASETS.build("imagefolder", {"path": str(synth_root), key: value})


def test_crop_settings_checked_on_a_shard_set(synth_root, tmp_path):
    from fastvision.data.shards.writer import write_shards
    from fastvision.errors import ConfigError

    write_shards(synth_root, tmp_path / "shards")
    with pytest.raises(ConfigError, match=r"^data\.args\.hflip="):
        DATASETS.build("imagefolder", {"path": str(tmp_path / "shards"), "hflip": -0.5})


def test_16_bit_grey_png_is_scaled_not_clipped(tmp_path):
    """A 16-bit grey PNG keeps its picture: 0..65535 becomes 0..255 (Pillow's convert clips at 255,
    which turned every value above 255 white)."""
    ramp = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "g16.png")
    with Image.open(tmp_path / "g16.png") as im:
        assert im.mode.startswith("I;16")
    rgb = np.asarray(F.open_image(str(tmp_path / "g16.png")))
    want = np.round(ramp / 257.0)
    assert rgb.shape == (64, 64, 3) and (rgb == rgb[..., :1]).all()
    assert np.abs(rgb[..., 0] - want).max() <= 1 and rgb.mean() == pytest.approx(want.mean(), abs=0.5)


def test_undecodable_cached_bytes_name_the_file_not_a_buffer(tmp_path):
    with pytest.raises(DataError) as e:
        F.load_crop(b"not an image at all", True, 8, 8, (0.5, 1.0), (0.75, 4 / 3), 0.5, torch.Generator(),
                    name="train/cat/notes.JPEG")
    assert str(e.value).startswith("train/cat/notes.JPEG: cannot decode image") and "BytesIO" not in str(e.value)


def test_data_given_the_split_folder_says_which_folder_to_give(synth_root):
    """--data DATA/train (or a class folder) names the folder above ('image folder not found:
    DATA/train/train' before)."""
    for given in (synth_root / "train", synth_root / "train" / "class001"):
        with pytest.raises(DataError, match=rf"no train/ folder: .*did you mean --data {synth_root}\?$"):
            DATASETS.build("imagefolder", {"path": str(given)})


def test_the_slides_and_masks_layout_is_no_imagefolder(tmp_path):
    """``train/images`` + ``train/masks`` (what `data synth pathology` writes) trained as an ImageFolder
    of two classes, 'images' and 'masks', without a word; now one line naming the layout."""
    from fastvision.data.synth.pathology import synth

    out = synth(tmp_path / "p", slides=1, val_slides=1, size=128, tile=64)
    with pytest.raises(DataError, match=r"train: its folders are images/, masks/: .*resnet18-pathology"):
        DATASETS.build("imagefolder", {"path": str(out)})


def test_val_labels_unused_by_class_folders_says_so(synth_root, caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        splits = DATASETS.build("imagefolder", {"path": str(synth_root), "val_labels": "val.txt"})
    assert splits.info["val_layout"] == "class folders"
    said = [r.getMessage() for r in caplog.records if "val_labels" in r.getMessage()]
    assert len(said) == 1 and "val.txt is not used" in said[0] and "class folders" in said[0]
