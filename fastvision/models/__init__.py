"""Model registry glue: importing this package registers every model in ``fastvision.registry.MODELS``.

``create_model("unet3d-nonewnet", out_channels=3)`` builds a registered model after checking the
keyword arguments against the builder's signature; ``list_models()`` names them all.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from fastvision.registry import MODELS


def create_model(name: str, **kwargs: Any) -> nn.Module:
    """Build registered model ``name``; unknown or mistyped keywords raise ``ConfigError``."""
    return MODELS.build(name, kwargs, where=f"model {name}")


WEIGHT_ARGS = ("pretrained", "backbone_weights")  # model.args that name weights files


def without_weights(model_args: dict) -> dict:
    """``model.args`` without weights files: they change values, not shapes, so planning (and
    measuring memory) never reads or downloads them."""
    return {k: v for k, v in model_args.items() if k not in WEIGHT_ARGS}


def spatial_dims(model: nn.Module) -> int:
    """3 for a model with 3-D convolutions, else 2: what its inputs' spatial rank must be."""
    return 3 if any(isinstance(m, (nn.Conv3d, nn.ConvTranspose3d)) for m in model.modules()) else 2


def list_models() -> list[str]:
    """Sorted names of all registered models."""
    return MODELS.names()


from fastvision.models import probe, resnet, segresnet, ssd, unet  # noqa: E402,F401  (importing a module registers its models)
