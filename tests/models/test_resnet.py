"""ResNet v1.5: parameter counts (torchvision's published figures), v1.5 stride placement, fan-in
init, torchvision-layout state dicts, forward/backward of every registered depth."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fastvision.errors import DataError
from fastvision.models import resnet as R
from fastvision.registry import MODELS

# torchvision model cards: resnet18 11.69M ... resnet152 60.19M (exact counts)
PARAMS = {
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
}


def n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name,count", sorted(PARAMS.items()))
def test_parameter_count_matches_torchvision(name, count):
    assert n_params(MODELS.build(name)) == count


def test_resnet50_v15_stride_on_3x3():
    m = R.resnet50()
    blk = m.layer2[0]
    assert blk.conv1.stride == (1, 1) and blk.conv1.kernel_size == (1, 1)
    assert blk.conv2.stride == (2, 2) and blk.conv2.kernel_size == (3, 3)
    assert blk.downsample[0].stride == (2, 2)
    for layer in (m.layer3, m.layer4):
        assert layer[0].conv1.stride == (1, 1) and layer[0].conv2.stride == (2, 2)


def test_fan_in_init_and_zero_residual():
    torch.manual_seed(0)
    m = R.resnet50(zero_init_residual=True)
    w = m.layer4[0].conv2.weight  # fan_in = 512 * 3 * 3, 2.4M samples
    expected = math.sqrt(2.0 / (512 * 9))
    assert abs(w.std().item() / expected - 1) < 0.01
    assert all(b.bn3.weight.abs().sum() == 0 for layer in (m.layer1, m.layer4) for b in layer)
    assert m.layer1[0].bn1.weight.eq(1).all()
    m2 = R.resnet18(zero_init_residual=False)
    assert m2.layer1[0].bn2.weight.eq(1).all()


# Keys as they appear in torchvision's resnet50 state dict (written out by hand, not generated).
TV_KEYS_R50 = [
    "conv1.weight", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var",
    "bn1.num_batches_tracked", "layer1.0.conv1.weight", "layer1.0.bn3.running_var",
    "layer1.0.downsample.0.weight", "layer1.0.downsample.1.weight", "layer2.0.conv2.weight",
    "layer3.5.conv3.weight", "layer4.2.bn3.bias", "fc.weight", "fc.bias",
]


def _torchvision_like_state(num_classes: int = 1000) -> dict[str, torch.Tensor]:
    """A torchvision-layout resnet50 state dict with random values (no download)."""
    g = torch.Generator().manual_seed(1)
    ref = R.resnet50(num_classes=num_classes).state_dict()
    out = {}
    for k, v in ref.items():
        out[k] = v.clone() if v.dtype == torch.long else torch.randn(v.shape, generator=g)
    return out


def test_torchvision_key_names():
    keys = set(R.resnet50().state_dict())
    assert set(TV_KEYS_R50) <= keys
    assert len(keys) == 320  # torchvision resnet50: 320 state-dict entries


@pytest.mark.parametrize("wrap", ["bare", "state_dict+module", "model"])
def test_load_pretrained_same_head(tmp_path, wrap):
    state = _torchvision_like_state()
    obj = {"bare": state, "state_dict+module": {"state_dict": {"module." + k: v for k, v in state.items()}},
           "model": {"model": state, "epoch": torch.tensor(3)}}[wrap]
    torch.save(obj, tmp_path / "w.pth")
    m = R.resnet50()
    report = R.load_pretrained(m, tmp_path / "w.pth")
    assert report["skipped"] == []
    for k, v in m.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_load_pretrained_other_head_skips_fc(tmp_path, caplog):
    state = _torchvision_like_state(1000)
    torch.save(state, tmp_path / "w.pth")
    m = MODELS.build("resnet50", {"num_classes": 7, "pretrained": str(tmp_path / "w.pth")})
    assert m.fc.weight.shape == (7, 2048)
    assert torch.equal(m.layer3[2].conv2.weight, state["layer3.2.conv2.weight"])
    with pytest.raises(DataError, match="fc.weight"):
        R.load_pretrained(R.resnet50(num_classes=7), tmp_path / "w.pth", strict_head=True)


def test_load_pretrained_headless(tmp_path):
    torch.save(_torchvision_like_state(), tmp_path / "w.pth")
    rep = R.load_pretrained(R.resnet50(num_classes=0), tmp_path / "w.pth")
    assert rep["unexpected"] == ["fc.bias", "fc.weight"]


def test_load_pretrained_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        R.load_pretrained(R.resnet18(), tmp_path / "none.pth")
    torch.save(R.resnet18().state_dict(), tmp_path / "r18.pth")
    with pytest.raises(DataError, match="r18.pth"):  # wrong depth: missing/mis-shaped keys
        R.load_pretrained(R.resnet50(), tmp_path / "r18.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="junk.pth"):
        R.load_pretrained(R.resnet18(), tmp_path / "junk.pth")


@pytest.mark.parametrize("kind, why", [
    ("jpeg", "not a file torch.save wrote"),  # an image given as the weights
    ("empty", "the file is empty"),
    ("pickled_model", r"pickled Python objects .*not a state dict \(torch.save\(model.state_dict\(\)"),
])
def test_load_pretrained_unloadable_file_is_one_line_without_torchs_advice(tmp_path, kind, why):
    """A file torch.load(weights_only=True) refuses: one line saying what it is, never torch's
    multi-line advice to rerun with weights_only=False (fastvision does not unpickle code)."""
    path = tmp_path / "w.pth"
    if kind == "jpeg":
        from PIL import Image
        Image.new("RGB", (8, 8)).save(path, format="JPEG")
    elif kind == "empty":
        path.write_bytes(b"")
    else:  # torch.save(model): the whole module pickled, as many shared checkpoints are
        torch.save(torch.nn.Linear(2, 2), path)
    with pytest.raises(DataError, match=why) as info:
        R.load_pretrained(R.resnet18(), path)
    msg = str(info.value)
    assert "\n" not in msg and "weights_only" not in msg and msg.startswith(f"{path}: cannot load weights")


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_forward_backward_every_depth(name):
    torch.manual_seed(0)
    m = MODELS.build(name, {"num_classes": 5, "zero_init_residual": False})
    x = torch.randn(2, 3, 32, 32)
    y = m(x)
    assert y.shape == (2, 5)
    y.logsumexp(1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("name,channels", [("resnet18", (128, 256, 512)), ("resnet50", (512, 1024, 2048))])
def test_forward_features_strides(name, channels):
    m = MODELS.build(name, {"num_classes": 0, "in_channels": 1}).eval()
    feats = m.forward_features(torch.randn(1, 1, 64, 96))
    strides = (8, 16, 32)
    assert [tuple(f.shape) for f in feats] == [(1, c, 64 // s, 96 // s) for c, s in zip(channels, strides, strict=True)]
    assert m.feature_channels == channels
    assert m(torch.randn(1, 1, 64, 64)).shape == (1, channels[-1])


def test_channels_last_same_result():
    torch.manual_seed(0)
    m = R.resnet18(num_classes=4, zero_init_residual=False).eval()
    x = torch.randn(2, 3, 40, 40)
    ref = m(x)
    m_cl = m.to(memory_format=torch.channels_last)
    out = m_cl(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    feats = m_cl.forward_features(x.contiguous(memory_format=torch.channels_last))
    assert feats[0].is_contiguous(memory_format=torch.channels_last)


# ----------------------------------------------------------------------------------------------
# --pretrained imagenet: torch.hub's cache, never a download in tests


def _hub_file(torch_home: Path, depth: int) -> Path:
    name = R.IMAGENET_URLS[depth].rsplit("/", 1)[1]
    return torch_home / "hub" / "checkpoints" / name


def test_pretrained_imagenet_loads_the_cached_torchvision_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setenv("FASTVISION_OFFLINE", "1")  # the cached file must be used as is
    src = R.resnet18(num_classes=1000)
    with torch.no_grad():
        src.conv1.weight.fill_(0.125)
        src.layer4[1].bn2.running_var.fill_(3.0)
    f = _hub_file(tmp_path, 18)
    f.parent.mkdir(parents=True)
    torch.save(src.state_dict(), f)
    m = MODELS.build("resnet18", {"pretrained": "imagenet"})
    for k, v in src.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k
    # the SSD backbone (headless, fc.* ignored) with frozen BN, as seed 002 starts
    ssd = MODELS.build("ssd320-small", {"num_classes": 3, "pretrained": "imagenet", "frozen_bn": True})
    assert torch.equal(ssd.backbone.conv1.weight, src.conv1.weight)
    bn = ssd.backbone.layer4[1].bn2
    assert type(bn).__name__ == "FrozenBatchNorm2d" and torch.equal(bn.running_var, src.layer4[1].bn2.running_var)
    assert not any("bn" in n for n, _ in ssd.backbone.named_parameters())  # BN is not trained


def test_pretrained_imagenet_offline_without_the_file_says_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setenv("FASTVISION_OFFLINE", "1")
    with pytest.raises(DataError) as err:
        MODELS.build("resnet50", {"num_classes": 10, "pretrained": "imagenet"})
    msg = str(err.value)
    assert "\n" not in msg and str(_hub_file(tmp_path, 50)) in msg and R.IMAGENET_URLS[50] in msg
