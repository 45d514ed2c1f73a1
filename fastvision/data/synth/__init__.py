"""Synthetic data generators, one module per kind, written in real file formats.

``fastvision data synth KIND OUT`` calls ``SYNTH.get(KIND)(Path(OUT), seed=..., **options)``.
"""
from __future__ import annotations

import importlib

from fastvision.registry import Registry

SYNTH = Registry("synthetic data kind")

# Importing a kind's module registers it.
_KINDS = ("microscopy", "imagenet", "coco", "medical", "geometry", "pathology")


def load_all() -> Registry:
    for name in _KINDS:
        importlib.import_module(f"{__name__}.{name}")
    return SYNTH
