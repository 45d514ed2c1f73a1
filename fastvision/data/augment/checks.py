"""Range checks of each ``data.augment`` op's options (:func:`~fastvision.data.augment.spatial.build_augment`):
a value out of range is a one-line :class:`~fastvision.errors.ConfigError` naming its key."""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from fastvision.errors import ConfigError


def _validate(name: str, op: Any, nd: int) -> None:
    where = f"data.augment.{name}"
    for f in fields(op):
        v = getattr(op, f.name)
        if f.name.endswith("prob") and v is not None and not 0.0 <= v <= 1.0:
            raise ConfigError(f"{where}.{f.name} must be in [0, 1], got {v}")
        if isinstance(v, float) and not f.name.endswith("prob") and v < 0:
            raise ConfigError(f"{where}.{f.name} must be >= 0, got {v}")
    if name == "crop" and (len(op.size) != nd or min(op.size) < 1):
        raise ConfigError(f"{where}.size needs {nd} positive sizes, got {op.size}")
    if name == "flip" and op.axes is not None and any(not 0 <= a < nd for a in op.axes):
        raise ConfigError(f"{where}.axes must be spatial axes in [0, {nd}), got {op.axes}")
    if name == "affine":
        for key in ("rotate_axes", "zoom_axes"):
            axes = getattr(op, key)
            if axes is not None and any(not 0 <= a < nd for a in axes):
                raise ConfigError(f"{where}.{key} must be spatial axes in [0, {nd}), got {axes}")
        if op.size is not None and (len(op.size) != nd or min(op.size) < 1):
            raise ConfigError(f"{where}.size needs {nd} positive sizes, got {op.size}")
        if op.label_mode not in ("nearest", "linear"):
            raise ConfigError(f"{where}.label_mode: {op.label_mode!r}; valid: nearest, linear")
        if op.label_classes is not None and op.label_classes < 1:
            raise ConfigError(f"{where}.label_classes must be >= 1, got {op.label_classes}")
    if name == "lowres" and op.ignore_axes is not None and any(not 0 <= a < nd for a in op.ignore_axes):
        raise ConfigError(f"{where}.ignore_axes must be spatial axes in [0, {nd}), got {op.ignore_axes}")
    for key in ("scale", "range", "sigma"):
        v = getattr(op, key, None)
        if v is not None and name in ("affine", "gamma", "gamma_inverted", "lowres", "blur") \
                and not (len(v) == 2 and 0 < v[0] <= v[1]):
            raise ConfigError(f"{where}.{key} must be [low, high] with 0 < low <= high, got {v}")
    if name == "foreground_shift" and op.range is not None and not (len(op.range) == 2 and op.range[0] <= op.range[1]):
        raise ConfigError(f"{where}.range must be [low, high] with low <= high, got {op.range}")
    if name == "color_jitter" and op.hue > 0.5:
        raise ConfigError(f"{where}.hue must be <= 0.5, got {op.hue}")
