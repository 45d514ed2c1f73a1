"""The model args that are GPU speed levers (issue 40; docs/gpu.md, "Model levers"): which of them a
model accepts, their values in a config, and the values worth trying from there.

Each gives the stock model's results up to float rounding (tests/models/test_levers.py), so
``fastvision tune`` classes them ``numeric`` and checks the losses; ``fastvision profile`` names the
ones still at their stock value. None is a recipe default until a GPU measurement wins with it.

- ``model.args.norm``: ``instance`` -> ``instance_cl`` (keeps a channels-last layout, the act fused),
  where the model's norm is instance;
- ``model.args.up``: ``transpose`` -> ``shuffle`` (1x1 conv + pixel shuffle), where the up-conv's
  kernel equals its stride (2);
- ``model.args.drop_bias``: ``false`` -> ``true`` (no conv bias before a batch / instance norm),
  where the model has such biases;
- ``model.args.pad_in``: ``null`` -> ``4`` / ``8`` (the first conv reads the image zero-padded to a multiple
  of that many channels), where the image's channels are not already one.
"""
from __future__ import annotations

import inspect
from typing import Any

from fastvision.registry import MODELS

LEVER_KEYS = ("model.args.norm", "model.args.up", "model.args.drop_bias", "model.args.pad_in")
LAYOUT_COPYING_NORMS = ("instance",)  # stock norms that copy a channels-last input to contiguous


def model_args(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The builder's defaults with the config's ``model.args`` on top (``{}`` for an unknown model)."""
    try:
        sig = inspect.signature(MODELS.get(name))
    except Exception:  # noqa: BLE001  (an unknown name is the build's error to raise, not ours)
        return {}
    out = {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    return {**out, **(args or {})}


def levers(name: str, args: dict[str, Any]) -> dict[str, tuple]:
    """``{key: (value, ...)}``: the levers model ``name`` accepts whose value in ``args`` is the stock
    one, with the values to try. Only keys the model's builder takes are offered."""
    a = model_args(name, args)
    out: dict[str, tuple] = {}
    if a.get("norm") in LAYOUT_COPYING_NORMS:
        out["model.args.norm"] = ("instance_cl",)
    if a.get("up") == "transpose" and a.get("up_kernel", 2) == 2:
        out["model.args.up"] = ("shuffle",)
    if a.get("drop_bias") is False and a.get("bias", True) and a.get("norm", "batch") in ("batch", "instance",
                                                                                         "instance_cl"):
        out["model.args.drop_bias"] = (True,)
    if "pad_in" in a and not a["pad_in"]:
        pads = tuple(m for m in (4, 8) if int(a.get("in_channels", 3)) % m)
        if pads:
            out["model.args.pad_in"] = pads
    return out


def current(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The config's value of every lever key the model accepts (``{"model.args.norm": "instance"}``)."""
    a = model_args(name, args)
    return {key: a[key.split(".")[-1]] for key in LEVER_KEYS if key.split(".")[-1] in a}
