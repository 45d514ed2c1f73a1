"""fastvision: train image segmentation, detection and classification models fast.

Notebook API::

    import fastvision
    summary = fastvision.train("unet2d-microscopy", epochs=5, **{"train.amp": "bf16"})
    model = fastvision.create_model("unet2d-seed001")
    fastvision.list_models()
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def create_model(name: str, **kwargs: Any):
    """Build a registered model; unknown keyword arguments raise ``ConfigError``."""
    from fastvision.models import create_model as _create

    return _create(name, **kwargs)


def list_models() -> list[str]:
    from fastvision.models import list_models as _list

    return _list()


def train(recipe: str, out: str | None = None, resume: str | None = None, **overrides: Any) -> dict[str, Any]:
    """Train a recipe (a shipped name or a YAML path) and return the run summary.

    Args:
        recipe: e.g. ``"unet2d-microscopy"``.
        out: run directory (default ``runs/<recipe>-<time>``); must not exist unless resuming.
        resume: ``"auto"`` or a checkpoint path.
        **overrides: flat CLI-style options (``epochs=5``, ``batch_size=8``, ``lr=1e-3``, ``amp="bf16"``,
            ``data="path"``) or dotted keys (``**{"optim.weight_decay": 1e-4}``).
    """
    from fastvision.api import run_training

    return run_training(recipe, out=out, resume=resume, overrides=overrides)
