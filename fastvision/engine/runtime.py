"""Numerics and speed switches: precision (autocast + GradScaler), TF32, seeding, compile.

Everything here is chosen once per run from the config and passed explicitly; nothing is stored
in module globals.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fastvision.config import AMP_MODES
from fastvision.errors import ConfigError

log = logging.getLogger(__name__)

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_amp(mode: str, device: torch.device) -> tuple[str, str]:
    """The precision ``train.amp`` means on ``device``, and why.

    ``auto``: on CUDA, bf16 where the GPU computes it natively (compute capability 8.0+: A100,
    H100, RTX 30xx and newer), else fp16 with dynamic loss scaling (V100, T4: seed 004's AMP);
    on CPU and other devices fp32 ("off", the CPU default). Other modes are returned unchanged.
    """
    if mode != "auto":
        return mode, "as configured"
    if device.type != "cuda":
        return "off", f"{device.type}: fp32"
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if major >= 8 and torch.cuda.is_bf16_supported():
        return "bf16", f"{name} (sm_{major}{minor}) computes bf16 natively"
    return "fp16", f"{name} (sm_{major}{minor}) has no native bf16: fp16 with dynamic loss scaling"


def autocast_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype ``train.amp`` means on ``device`` (None: fp32), by :func:`resolve_amp`.

    The one amp -> dtype rule: :class:`Precision` (train, evaluate), prediction and ``plan``'s trace
    all ask it, so ``auto`` means the same everywhere.
    """
    return _DTYPES.get(resolve_amp(mode, device)[0])


@dataclass
class Precision:
    """Autocast context and loss scaler for one of ``off``, ``fp16``, ``bf16`` or ``auto``.

    fp16 uses a dynamic GradScaler (skips steps whose gradients overflow); bf16 has the fp32
    exponent range and needs no scaler. bf16 autocast also works on CPU. ``auto`` is resolved
    once here (:func:`resolve_amp`); ``mode`` is then the precision actually used (``requested``
    keeps what was asked) and is logged.
    """

    mode: str
    device: torch.device

    def __post_init__(self) -> None:
        if self.mode not in AMP_MODES:
            raise ConfigError(f"train.amp: expected off, fp16, bf16 or auto, got {self.mode!r}")
        self.requested = self.mode
        self.mode, why = resolve_amp(self.mode, self.device)
        if self.requested == "auto":
            log.info("precision: %s (train.amp=auto; %s)", self.mode, why)
        if self.mode == "fp16" and self.device.type != "cuda":
            raise ConfigError("train.amp=fp16 needs a CUDA device; use --amp bf16 on CPU")
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.mode == "fp16")

    @property
    def dtype(self) -> torch.dtype | None:
        return autocast_dtype(self.mode, self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.mode == "off":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_DTYPES[self.mode])


def set_tf32(enabled: bool) -> None:
    """TF32 tensor-core math for fp32 matmuls and convolutions (Ampere and newer)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True


def augment_seed(seed: int, rank: int, step: int = 0) -> int:
    """Seed of a rank's batched-augmentation generator: at the start of a run (``step`` 0), and when a
    checkpoint's per-rank streams cannot continue (another world size) at ``step``."""
    return seed * 1_000_003 + rank + 7_919 * step


def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    """Every RNG the training loop draws from, as tensors and plain types (weights_only-safe)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["augment"] = generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "augment" in state:
        generator.set_state(state["augment"])


def prepare_model(model: nn.Module, device: torch.device, channels_last: bool) -> nn.Module:
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=_memory_format(model))
    return model


def _memory_format(model: nn.Module) -> torch.memory_format:
    from fastvision.models import spatial_dims

    return torch.channels_last_3d if spatial_dims(model) == 3 else torch.channels_last


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def maybe_compile(model: nn.Module, mode: bool | str) -> nn.Module:
    """``torch.compile`` (the seeds' XLA) for ``train.compile``: false, true (== default), or a mode.

    ``reduce-overhead`` replays the step's kernels as CUDA graphs (for launch-bound small models);
    it needs static shapes (fixed crop sizes, ``drop_last`` loaders, no data-dependent shapes in
    the step); a new shape records a new graph. ``max-autotune`` also searches kernel configs (long
    first steps).
    """
    if mode is False or mode in ("false", "off", "none"):
        return model
    if mode is True or mode in ("true", "on"):
        mode = "default"
    if mode not in COMPILE_MODES:
        raise ConfigError(f"train.compile: expected false, true or one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if not hasattr(torch, "compile"):
        raise ConfigError("train.compile needs torch >= 2.0")
    return torch.compile(model, mode=mode)
