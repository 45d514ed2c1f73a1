"""ResNet v1.5 family (18/34/50/101/152), the classification backbone of seed 004.

v1.5 differs from the original ResNet v1 only in the bottleneck block that downsamples: the
stride sits on the 3x3 conv instead of the first 1x1 conv (+0.5 % top-1, about 5 % fewer img/s,
per NVIDIA's README). Parameter names match torchvision's ``resnet*`` exactly (``conv1``, ``bn1``,
``layer1.0.conv1``, ``layer2.0.downsample.0``, ``fc``...) so a torchvision-style state dict loads
with :func:`load_pretrained` without renaming.

Initialisation follows NVIDIA's ``--weight_init fan_in``: convs are Kaiming-normal with
``mode="fan_in"`` and the ReLU gain (torchvision uses ``fan_out``); BN weights 1, biases 0; with
``zero_init_residual`` the last BN of every residual branch starts at 0 so each block begins as
the identity, which helps large-batch training (Goyal et al. 2017).

All ops are 2-D convs, BN, ReLU and pooling, which run natively in ``channels_last``; nothing in
the forward pass forces a layout change.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from fastvision.errors import DataError
from fastvision.models.pad_in import check_pad_in, pad_input_convs
from fastvision.registry import MODELS

log = logging.getLogger(__name__)


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convs (ResNet-18/34). Stride, if any, is on the first conv.

    Args:
        cin: input channels.
        width: channels of both convs (output = ``width * expansion``).
        stride: spatial stride of the block (1 or 2).
        downsample: projection of the identity path when shape changes, else None.
    """

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(cin, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (ResNet-50/101/152); v1.5: the stride is on the 3x3 conv.

    Args:
        cin: input channels.
        width: channels of the inner 1x1/3x3 convs; output is ``width * 4``.
        stride: spatial stride of the block (1 or 2), applied by ``conv2``.
        downsample: projection of the identity path when shape changes, else None.
    """

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, width * self.expansion)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet v1.5 classifier with torchvision parameter names.

    Args:
        block: ``BasicBlock`` or ``Bottleneck``.
        layers: number of blocks in each of the four stages, e.g. ``(3, 4, 6, 3)``.
        num_classes: classifier outputs; 0 drops the classifier (``forward`` returns pooled
            features ``(B, C5)``), for use as a backbone.
        in_channels: channels of the input image.
        zero_init_residual: start the last BN of every residual branch at gamma = 0.

    Attributes:
        feature_channels: channels of C3, C4, C5 (``forward_features`` outputs).
        feature_strides: strides of C3, C4, C5 relative to the input (8, 16, 32).
    """

    feature_strides = (8, 16, 32)
    # train.activation_checkpointing: true checkpoints each residual block (SSD's backbone too)
    checkpoint_blocks = ("layer1.*", "layer2.*", "layer3.*", "layer4.*")

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: tuple[int, int, int, int],
                 num_classes: int = 1000, in_channels: int = 3, zero_init_residual: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = 64
        stages = []
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), layers, strict=True)):
            stage, cin = self._make_stage(block, cin, width, n, stride=1 if i == 0 else 2)
            stages.append(stage)
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.feature_channels = tuple(w * block.expansion for w in (128, 256, 512))
        self.num_features = cin
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights(zero_init_residual)

    @staticmethod
    def _make_stage(block, cin: int, width: int, n: int, stride: int) -> tuple[nn.Sequential, int]:
        cout = width * block.expansion
        downsample = None
        if stride != 1 or cin != cout:
            downsample = nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))
        blocks = [block(cin, width, stride, downsample)]
        blocks += [block(cout, width) for _ in range(n - 1)]
        return nn.Sequential(*blocks), cout

    def _init_weights(self, zero_init_residual: bool) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_bn().weight)

    def stem(self, x: Tensor) -> Tensor:
        """(B, in_channels, H, W) -> (B, 64, H/4, W/4)."""
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))

    def forward_features(self, x: Tensor) -> list[Tensor]:
        """Multi-scale feature maps for detection necks (FPN, SSD).

        Args:
            x: images ``(B, in_channels, H, W)``, normalised float.

        Returns:
            ``[C3, C4, C5]`` of shapes ``(B, feature_channels[i], H/s, W/s)`` for strides
            ``s = 8, 16, 32`` (ceil division for sizes not divisible by 32).
        """
        c2 = self.layer1(self.stem(x))
        c3 = self.layer2(c2)
        c4 = self.layer3(c3)
        c5 = self.layer4(c4)
        return [c3, c4, c5]

    def forward(self, x: Tensor) -> Tensor:
        """Class logits.

        Args:
            x: images ``(B, in_channels, H, W)``, normalised float.

        Returns:
            logits ``(B, num_classes)`` (pooled features ``(B, num_features)`` when
            ``num_classes == 0``).
        """
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _unwrap_state_dict(obj: object, path: Path) -> dict[str, Tensor]:
    """Accept a bare state dict or a checkpoint holding one under a common key; strip DDP prefixes."""
    if isinstance(obj, dict):
        for key in ("model", "state_dict", "model_state_dict"):
            if key in obj and isinstance(obj[key], dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise DataError(f"{path}: not a state dict of tensors")
    from fastvision.utils.files import strip_prefixes

    return strip_prefixes(obj)


# torchvision's ImageNet weights (IMAGENET1K_V1: the plain 90-epoch recipe, the closest to the
# TF-slim resnet_v1_50 checkpoint that seed 002 starts from); the 8 hex digits are the sha256 prefix
IMAGENET_URLS = {
    18: "https://download.pytorch.org/models/resnet18-f37072fd.pth",
    34: "https://download.pytorch.org/models/resnet34-b627a593.pth",
    50: "https://download.pytorch.org/models/resnet50-0676ba61.pth",
    101: "https://download.pytorch.org/models/resnet101-63fe2227.pth",
    152: "https://download.pytorch.org/models/resnet152-394f9c45.pth",
}


def imagenet_state_dict(depth: int) -> dict[str, Tensor]:
    """torchvision's ImageNet state dict for ResNet-``depth`` through torch.hub's cache.

    The file ``$TORCH_HOME/hub/checkpoints/<name>`` (``torch.hub.get_dir()``) is used when it is
    there; otherwise it is downloaded with ``torch.hub.load_state_dict_from_url`` (hash-checked),
    unless ``FASTVISION_OFFLINE`` is set. torchvision itself is not imported.

    Raises:
        DataError: one line naming the file to place and where, when it is neither cached nor
            downloadable.
    """
    if depth not in IMAGENET_URLS:
        raise DataError(f"--pretrained imagenet: no ImageNet weights for ResNet-{depth}")
    url = IMAGENET_URLS[depth]
    name = url.rsplit("/", 1)[1]
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    place = (f"place torchvision's ResNet-{depth} ImageNet weights ({url}) at {folder / name}")
    if not (folder / name).is_file() and os.environ.get("FASTVISION_OFFLINE"):
        raise DataError(f"--pretrained imagenet: {name} is not in torch.hub's cache and FASTVISION_OFFLINE is set; "
                        f"{place}")
    try:
        return torch.hub.load_state_dict_from_url(url, model_dir=str(folder), map_location="cpu", progress=False,
                                                  check_hash=True, file_name=name, weights_only=True)
    except (OSError, RuntimeError) as e:  # no network (URLError is an OSError), bad hash, corrupt file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"--pretrained imagenet: cannot get {name} ({reason}); {place}") from e


def load_pretrained(model: nn.Module, path: str | Path | dict, strict_head: bool = False) -> dict[str, list[str]]:
    """Load a torchvision-layout state dict (a file, or an already loaded dict) into ``model``.

    A file is read with ``torch.load(weights_only=True)`` (never unpickled). The classifier
    (``fc.*``) is skipped with a warning when its shape differs, so ImageNet weights can start a
    model with another number of classes. Any other missing, unexpected or mis-shaped key is an
    error naming the file and the keys.

    Args:
        model: the model to fill (e.g. from ``resnet50(num_classes=2)``).
        path: ``.pt``/``.pth`` file with a state dict (or a checkpoint with ``model``/``state_dict``),
            or the state dict itself.
        strict_head: raise instead of skipping a classifier of a different shape.

    Returns:
        ``{"skipped": [...], "missing": [...], "unexpected": [...]}`` (the last two are only
        non-empty for ``fc.*`` keys of a headless model).

    Raises:
        DataError: the file is missing or unreadable, or the keys do not fit the model.
    """
    if isinstance(path, dict):
        state, path = _unwrap_state_dict(path, "state dict"), "state dict"
    else:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"pretrained weights not found: {path}")
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # corrupt file or pickled objects beyond tensors: a few words, not torch's advice
            from fastvision.utils.files import load_failure

            why = load_failure(path, e, "a state dict (torch.save(model.state_dict(), PATH))")
            raise DataError(f"{path}: cannot load weights ({why})") from e
        state = _unwrap_state_dict(obj, path)
    own = model.state_dict()
    skipped = [k for k in state if k in own and state[k].shape != own[k].shape]
    bad_shape = [k for k in skipped if not k.startswith("fc.") or strict_head]
    if bad_shape:
        desc = ", ".join(f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in bad_shape[:5])
        raise DataError(f"{path}: shape mismatch: {desc}")
    for k in skipped:
        del state[k]
    if skipped:
        log.warning("%s: classifier shape differs, not loaded: %s", path, ", ".join(skipped))
    missing = sorted(set(own) - set(state) - set(skipped))
    unexpected = sorted(set(state) - set(own))
    # a headless backbone (num_classes=0) legitimately ignores fc.*; anything else is a wrong file
    bad = [k for k in missing if not k.startswith("fc.")] + [k for k in unexpected if not k.startswith("fc.")]
    if bad:
        raise DataError(f"{path}: keys do not match the model ({len(missing)} missing, {len(unexpected)} "
                        f"unexpected), e.g. {', '.join(bad[:5])}")
    model.load_state_dict(state, strict=False)
    return {"skipped": skipped, "missing": missing, "unexpected": unexpected}


_DEPTHS: dict[int, tuple[type[BasicBlock] | type[Bottleneck], tuple[int, int, int, int]]] = {
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
    101: (Bottleneck, (3, 4, 23, 3)),
    152: (Bottleneck, (3, 8, 36, 3)),
}


def build_resnet(depth: int, num_classes: int = 1000, in_channels: int = 3, zero_init_residual: bool = True,
                 pretrained: str | None = None, pad_in: int | None = None) -> ResNet:
    """ResNet v1.5 of the given depth, optionally loaded from a torchvision-style state dict.

    ``pretrained``: a state dict file, or ``"imagenet"`` for torchvision's ImageNet weights through
    torch.hub's cache (:func:`imagenet_state_dict`). ``pad_in``: the stem reads the image zero-padded to a
    multiple of ``pad_in`` channels (MLPerf's 4: a speed lever, same outputs up to rounding and the same
    parameters; :mod:`~fastvision.models.pad_in`).
    """
    block, layers = _DEPTHS[depth]
    model = ResNet(block, layers, num_classes, in_channels, zero_init_residual)
    if pretrained == "imagenet":
        load_pretrained(model, imagenet_state_dict(depth))
    elif pretrained:
        load_pretrained(model, pretrained)
    pad_input_convs(model, "conv1", check_pad_in(pad_in))
    return model


@MODELS.register("resnet18")
def resnet18(num_classes: int = 1000, in_channels: int = 3, zero_init_residual: bool = True,
             pretrained: str | None = None, pad_in: int | None = None) -> ResNet:
    return build_resnet(18, num_classes, in_channels, zero_init_residual, pretrained, pad_in)


@MODELS.register("resnet34")
def resnet34(num_classes: int = 1000, in_channels: int = 3, zero_init_residual: bool = True,
             pretrained: str | None = None, pad_in: int | None = None) -> ResNet:
    return build_resnet(34, num_classes, in_channels, zero_init_residual, pretrained, pad_in)


@MODELS.register("resnet50")
def resnet50(num_classes: int = 1000, in_channels: int = 3, zero_init_residual: bool = True,
             pretrained: str | None = None, pad_in: int | None = None) -> ResNet:
    return build_resnet(50, num_classes, in_channels, zero_init_residual, pretrained, pad_in)


@MODELS.register("resnet101")
def resnet101(num_classes: int = 1000, in_channels: int = 3, zero_init_residual: bool = True,
              pretrained: str | None = None, pad_in: int | None = None) -> ResNet:
    return build_resnet(101, num_classes, in_channels, zero_init_residual, pretrained, pad_in)


@MODELS.register("resnet152")
def resnet152(num_classes: int = 1000, in_channels: int = 3, zero_init_residual: bool = True,
              pretrained: str | None = None, pad_in: int | None = None) -> ResNet:
    return build_resnet(152, num_classes, in_channels, zero_init_residual, pretrained, pad_in)
