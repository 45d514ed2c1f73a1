"""Synthetic data generators, one module per kind, written in real file formats.

``fastvision data synth KIND OUT`` calls ``SYNTH.get(KIND)(Path(OUT), seed=..., **options)``.
"""
from __future__ import annotations

import importlib
from typing import Any

from fastvision.errors import ConfigError
from fastvision.registry import Registry

SYNTH = Registry("synthetic data kind")

# Importing a kind's module registers it.
_KINDS = ("microscopy", "imagenet", "coco", "medical", "geometry", "pathology")


def load_all() -> Registry:
    for name in _KINDS:
        importlib.import_module(f"{__name__}.{name}")
    return SYNTH


def require(kind: str, **rules: tuple[Any, float | str]) -> None:
    """Refuse a generator option that makes no sense, as one line naming it: ``rules`` maps an option to
    ``(value, minimum)``; the minimum ``">0"`` means more than 0; a list value (a shape, a spacing) is
    checked item by item. ``require("microscopy", count=(count, 1))``."""
    for name, (value, least) in rules.items():
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        try:
            ok = all(v > 0 if least == ">0" else v >= least for v in items)
        except TypeError:
            ok = False
        if not ok:
            need = "more than 0" if least == ">0" else f"at least {least}"
            shown = ",".join(map(str, items)) if isinstance(value, (list, tuple)) else value
            raise ConfigError(f"data synth {kind} --{name.replace('_', '-')} {shown}: must be {need}"
                              + (" (each)" if isinstance(value, (list, tuple)) else ""))
