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


def list_models() -> list[str]:
    """Sorted names of all registered models."""
    return MODELS.names()


from fastvision.models import resnet, segresnet, ssd, unet  # noqa: E402,F401  (importing a module registers its models)
