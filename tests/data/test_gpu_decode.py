"""The GPU JPEG decoder backend (``data.args.backend: nvjpeg``, torchvision's batched nvJPEG).

On the CPU, everything but the nvJPEG call: the host items (encoded bytes, label, crop window) and
their collate; the crop windows against the Pillow path's sampler for the same (seed, epoch,
index) and the batches in its order; the crop + resize + flip math against Pillow's own
``Image.resize(box=...)`` (Pillow decodes the file here, as the stand-in for nvJPEG: it is the
independent reference, so only resampling differs: at most 1 level, Pillow rounding each pass);
hand-computed filter weights; Pillow's fallback for files nvJPEG does not take; the one-line error
where torchvision or CUDA is missing. The nvJPEG decode itself runs in the ``gpu`` tests.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fastvision.data import gpu_decode as G
from fastvision.data.cache.select import wrap_train_set
from fastvision.data.formats import imagefolder as F
from fastvision.data.transforms import item_generator, random_resized_box
from fastvision.distributed import TrainSampler
from fastvision.errors import ConfigError, DataError
from fastvision.registry import DATASETS

KW = dict(scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3), hflip=0.5)
S, RESIZE = 32, 40  # boxes stay under 2 S wide: the Pillow path decodes at full scale (no DCT draft)
CPU = torch.device("cpu")


def _smooth(w, h, rng):
    yy, xx = np.mgrid[0:h, 0:w].astype(float)
    img = np.stack([127 + 100 * np.sin(xx / w * rng.uniform(2, 9) + rng.uniform(0, 6))
                    * np.cos(yy / h * rng.uniform(2, 9)) for _ in range(3)], -1)
    return img.clip(0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Smooth JPEGs (quality 90), landscape, portrait and square, one greyscale."""
    d = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    out = []
    for i, (w, h) in enumerate([(60, 45), (45, 60), (52, 52), (63, 40), (48, 36)]):
        img = Image.fromarray(_smooth(w, h, rng))
        (img.convert("L") if i == 4 else img).save(d / f"{i}.JPEG", quality=90)
        out.append((str(d / f"{i}.JPEG"), i))
    return out


def _decoded(path):
    """The stand-in for nvJPEG: Pillow's full decode of the file, uint8 (3, H, W)."""
    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)


def _gpu_path_image(item):
    box = torch.tensor([item["box"]], dtype=torch.float64)
    return G.to_uint8(G.resample([_decoded(item["id"])], box, torch.tensor([item["flip"]]), S))[0]


@pytest.mark.parametrize("seed", [0, 7])
def test_training_crops_equal_the_pillow_paths(photos, seed):
    """Same (seed, epoch, index): the same window and flip as the Pillow path's sampler draws, and
    the same pixels as its item within 1 level (mean per image measured 0-0.23)."""
    pillow = wrap_train_set(F.ImageFolderDataset(photos, True, S, RESIZE, **KW), cache="none", seed=seed)
    host = G.host_dataset(photos, True, image_size=S, resize_size=RESIZE, seed=seed, **KW)
    flips, diffs = set(), []
    for epoch in (0, 3):
        pillow.set_epoch(epoch)
        host.set_epoch(epoch)
        for i, (path, label) in enumerate(photos):
            item = host[i]
            w, h = Image.open(path).size
            assert item["box"] == random_resized_box(w, h, KW["scale"], KW["ratio"], item_generator(seed, epoch, i))
            assert item["size"] == (w, h) and item["label"] == label and item["nvjpeg"]
            flips.add(item["flip"])
            d = (_gpu_path_image(item).int() - pillow[i]["image"].int()).abs()
            assert d.max() <= 1, (path, epoch)
            diffs.append(d.double().mean().item())
    assert flips == {True, False} and max(diffs) < 0.3


def test_validation_equals_the_pillow_centre_crop(photos):
    """The Pillow path's fractional centre box ("shorter side -> 40, centre 32"), resampled alike."""
    host = G.host_dataset(photos, False, image_size=S, resize_size=RESIZE, **KW)
    pillow = F.ImageFolderDataset(photos, False, S, RESIZE, **KW)
    for i, (path, _) in enumerate(photos):
        item = host[i]
        assert item["box"] == F.center_box(*Image.open(path).size, RESIZE, S) and not item["flip"]
        assert (_gpu_path_image(item).int() - pillow[i]["image"].int()).abs().max() <= 1


def test_weights_hand_computed():
    """4 pixels -> 2: support 2, centres 1 and 3: taps (3, 3, 1, 0) / 7 and (0, 1, 3, 3) / 7; a flip swaps
    the outputs; an unscaled integer box is the identity."""
    starts, ends = torch.tensor([0.0, 0.0]), torch.tensor([4.0, 4.0])
    bounds = [G._axis_bounds(0.0, 4.0, 4, 2)] * 2
    assert bounds[0] == (0, 4)
    w, offsets = G.axis_weights(starts, ends, bounds, 2, torch.tensor([False, True]), CPU)
    want = torch.tensor([[3, 0], [3, 1], [1, 3], [0, 3]]) / 7  # (pixel, output)
    assert offsets == [0, 4]
    torch.testing.assert_close(w[:4], want)
    torch.testing.assert_close(w[4:], want.flip(1))
    img = torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8)
    out = G.resample([img], torch.tensor([[2.0, 1.0, 5.0, 4.0]], dtype=torch.float64), torch.tensor([False]), 3)
    assert torch.equal(G.to_uint8(out)[0], img[:, 1:4, 2:5])


def test_host_batches_of_two_ranks_read_each_file_once(photos):
    """5 files over 2 ranks at batch 3: the padded shards (3 each) read one file twice in the epoch, where the
    Pillow path's sampler (engine.build.train_sampler) shares them out 3 + 2."""
    data = G.host_dataset(photos, True, image_size=S, resize_size=RESIZE, seed=3, **KW)
    ids = []
    for r in range(2):
        loader = G.host_loader(data, True, batch_size=3, shard_id=r, num_shards=2, seed=3, threads=1)
        loader.set_epoch(0)
        ids += [p for b in loader for p in b["id"]]
    assert sorted(ids) == sorted(p for p, _ in photos)


def test_host_batches_follow_the_pillow_order(photos):
    """Training batches are the TrainSampler's (seed, epoch) order, full batches only, with each
    file's bytes, and a mid-epoch start continues them; validation shards cover the set once."""
    data = G.host_dataset(photos, True, image_size=S, resize_size=RESIZE, seed=3, **KW)
    loader = G.host_loader(data, True, batch_size=2, shard_id=0, num_shards=1, seed=3, threads=2)
    loader.set_epoch(1)
    batches = list(loader)
    sampler = TrainSampler(len(photos), num_replicas=1, rank=0, seed=3)
    sampler.set_epoch(1)
    order = [photos[i][0] for i in sampler][:4]
    assert [p for b in batches for p in b["id"]] == order and len(loader) == 2
    b = batches[0]
    assert b["box"].shape == (2, 4) and b["box"].dtype == torch.float64 and b["size"].shape == (2, 2)
    assert b["flip"].dtype == torch.bool and b["label"].tolist() == [int(p.split("/")[-1][0]) for p in b["id"]]
    assert all(bytes(t.numpy()) == open(p, "rb").read() for t, p in zip(b["data"], b["id"], strict=True))
    loader.set_epoch(1, start_sample=2)  # a mid-epoch resume: the straight epoch's later batches, same crops
    later = list(loader)
    assert [x["id"] for x in later] == [x["id"] for x in batches[1:]]
    assert all(torch.equal(x["box"], y["box"]) and torch.equal(x["flip"], y["flip"])
               for x, y in zip(later, batches[1:], strict=True))
    val = G.host_dataset(photos, False, image_size=S, resize_size=RESIZE, **KW)
    ids = [p for r in range(2) for b in G.host_loader(val, False, batch_size=2, shard_id=r, num_shards=2, seed=0,
                                                        threads=1) for p in b["id"]]
    assert ids == [p for p, _ in photos]


def test_files_nvjpeg_does_not_take_are_decoded_like_pillow(tmp_path, photos):
    """CMYK JPEGs and a PNG named .JPEG go to Pillow (no nvJPEG call); a file whose pixels do not
    decode is named in the Pillow path's error."""
    rgb = _smooth(60, 45, np.random.default_rng(1))
    Image.fromarray(rgb).convert("CMYK").save(tmp_path / "cmyk.JPEG", quality=90)
    Image.fromarray(rgb).save(tmp_path / "png.JPEG", format="PNG")
    samples = [(str(tmp_path / "cmyk.JPEG"), 0), (str(tmp_path / "png.JPEG"), 1)]
    host = G.host_dataset(samples, False, image_size=S, resize_size=RESIZE, **KW)
    items = [host[0], host[1]]
    assert [it["nvjpeg"] for it in items] == [False, False]
    out = G.decode_batch(G.collate_encoded(items), S, CPU, decode_jpeg=None)
    ref = F.ImageFolderDataset(samples, False, S, RESIZE, **KW)
    assert out["image"].shape == (2, 3, S, S) and out["label"].tolist() == [0, 1]
    for i in range(2):
        assert (out["image"][i].int() - ref[i]["image"].int()).abs().max() <= 1
    data = (tmp_path / "png.JPEG").read_bytes()
    (tmp_path / "cut.JPEG").write_bytes(data[: len(data) // 2])  # header fine, pixels missing
    cut = G.host_dataset([(str(tmp_path / "cut.JPEG"), 0)], False, image_size=S, resize_size=RESIZE, **KW)[0]
    with pytest.raises(DataError, match="cut.JPEG: cannot decode image"):
        G.decode_batch(G.collate_encoded([cut]), S, CPU, decode_jpeg=None)
    (tmp_path / "junk.JPEG").write_bytes(b"\xff\xd8\xff not a jpeg")
    with pytest.raises(DataError, match="junk.JPEG: cannot decode image"):
        G.host_dataset([(str(tmp_path / "junk.JPEG"), 0)], False, image_size=S, resize_size=RESIZE, **KW)[0]


def _has_torchvision() -> bool:
    try:
        import torchvision.io  # noqa: F401
    except Exception:
        return False
    return True


def test_missing_torchvision_or_cuda_is_one_config_error(photos, tmp_path, capsys):
    """Whichever is missing here is named, with data.args.backend; the CLI exits 2 with one line."""
    if _has_torchvision() and torch.cuda.is_available():
        pytest.skip("torchvision and CUDA are both here")
    from fastvision import cli
    from fastvision.data.synth.imagenet import synth

    want = "needs CUDA" if _has_torchvision() else "needs torchvision"
    root = synth(tmp_path / "inet", classes=2, per_class=2, val_per_class=1, size=32)
    with pytest.raises(ConfigError, match=f"data.args.backend=nvjpeg .*{want}"):
        DATASETS.build("imagefolder", {"path": str(root), "backend": "nvjpeg"})
    rc = cli.main(["train", "resnet18-imagefolder", "--data", str(root), "--device", "cpu",
                   "--out", str(tmp_path / "r"),
                   "--set", "data.args.backend=nvjpeg"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "data.args.backend=nvjpeg" in err and want in err


@pytest.mark.gpu
def test_nvjpeg_batches_on_the_gpu(photos, tmp_path):
    """torchvision's nvJPEG: validation within JPEG-decoder tolerance of the Pillow path (mean per
    image <= 2 levels: another IDCT and chroma upsampling), training crops too, CMYK / PNG through
    Pillow; a mid-epoch start gives the straight epoch's later batches."""
    pytest.importorskip("torchvision")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rgb = _smooth(60, 45, np.random.default_rng(1))
    Image.fromarray(rgb).convert("CMYK").save(tmp_path / "cmyk.JPEG", quality=90)
    Image.fromarray(rgb).save(tmp_path / "prog.JPEG", quality=90, progressive=True)
    samples = photos + [(str(tmp_path / "cmyk.JPEG"), 5), (str(tmp_path / "prog.JPEG"), 6)]
    cuda = torch.device("cuda")
    for train in (False, True):
        data = G.NvjpegImageFolder(samples, train=train, image_size=S, resize_size=RESIZE, threads=2, **KW)
        loader = data.make_loader(batch_size=3, shard_id=0, num_shards=1, seed=4, device=cuda)
        loader.set_epoch(2)
        batches = list(loader)
        ref = F.ImageFolderDataset(samples, train, S, RESIZE, **KW)
        if train:
            ref = wrap_train_set(ref, cache="none", seed=4)
            ref.set_epoch(2)
        index = {p: i for i, (p, _) in enumerate(samples)}
        for b in batches:
            assert b["image"].is_cuda and b["image"].dtype == torch.uint8 and b["image"].shape[1:] == (3, S, S)
            for img, path in zip(b["image"].cpu(), b["id"], strict=True):
                d = (img.double() - ref[index[path]]["image"].double()).abs().mean().item()
                assert d <= 2.0, (path, d)
        if train:
            loader.set_epoch(2, start_sample=3)
            later = list(loader)
            assert [b["id"] for b in later] == [b["id"] for b in batches[1:]]
            assert all(torch.equal(a["image"], b["image"]) for a, b in zip(later, batches[1:], strict=True))
    with pytest.raises(ConfigError, match="device is cpu"):
        G.NvjpegImageFolder(samples, train=False, image_size=S, resize_size=RESIZE, **KW).make_loader(
            batch_size=2, shard_id=0, num_shards=1, seed=0, device=CPU)


@pytest.mark.gpu
def test_resnet18_trains_two_steps_from_nvjpeg_batches(tmp_path):
    """The recipe path end to end: build, two training steps and validation through the backend."""
    pytest.importorskip("torchvision")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from fastvision import cli
    from fastvision.data.synth.imagenet import synth

    root = synth(tmp_path / "inet", classes=3, per_class=8, val_per_class=2, size=64)
    rc = cli.main(["train", "resnet18-imagefolder", "--data", str(root), "--device", "cuda",
                   "--out", str(tmp_path / "r"), "--set", "data.args.backend=nvjpeg", "--set", "train.batch_size=8",
                   "--set", "train.epochs=1", "--set", "train.steps_per_epoch=2"])
    assert rc == 0
