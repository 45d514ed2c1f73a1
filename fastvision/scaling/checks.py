"""Checks of the ``fastvision scale`` options, before any run or simulation: one line naming the option."""
from __future__ import annotations

from fastvision.errors import ConfigError, check_low

# option -> (attribute, lowest value, whether the lowest value itself is allowed)
_LIMITS = {
    "--epochs": ("epochs", 1, True), "--repeats": ("repeats", 1, True), "--batch": ("batch", 1, True),
    "--compute-ms": ("compute_ms", 0, False), "--grad-mb": ("grad_mb", 0, False),
    "--bucket-mb": ("bucket_mb", 0, False), "--overhead-ms": ("overhead_ms", 0, True),
    "--gpus-per-node": ("gpus_per_node", 1, True), "--input-rate": ("input_rate", 0, False),
    "--input-workers": ("input_workers", 1, True), "--gpus": ("gpus", 1, True), "--jitter-ms": ("jitter_ms", 0, True),
}


def check_args(args) -> None:
    """Refuse a ``scale`` command that would do nothing, and every numeric option out of its range.

    Raises:
        ConfigError: naming the option and its valid range.
    """
    if not args.recipe and not args.simulate:
        raise ConfigError("scale: give a recipe to sweep, or --simulate (with --compute-ms and --grad-mb)")
    for flag, (attr, low, inclusive) in _LIMITS.items():
        check_low(flag, getattr(args, attr, None), low, inclusive)
