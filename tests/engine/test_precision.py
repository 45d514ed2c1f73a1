"""``train.amp: auto``: the precision actually used per device, and that it is logged."""
from __future__ import annotations

import logging

import pytest
import torch

from fastvision.engine import runtime
from fastvision.errors import ConfigError


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("tiles", [False, True])
def test_auto_on_cpu_keeps_fp32_and_names_bf16_where_amx(monkeypatch, tiles):
    """``auto`` on any CPU is fp32 (no autocast, no scaler); where the CPU has AMX bf16 tiles (Sapphire
    Rapids+) the logged line names ``train.amp=bf16`` as the faster opt-in. torch's own CPU probe is
    replaced, so both branches run on any machine."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: tiles)
    # a handler on the module's logger itself: the CLI may have stopped propagation to the root
    logger, lines = logging.getLogger("fastvision.engine.runtime"), _Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        p = runtime.Precision("auto", torch.device("cpu"))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert p.mode == "off" and p.requested == "auto" and p.dtype is None and not p.scaler.is_enabled()
    mine = [line for line in lines.lines if line.startswith("precision: off (train.amp=auto; cpu: fp32")]
    assert len(mine) == 1 and ("train.amp=bf16 is faster" in mine[0]) == tiles
    with p.autocast():
        y = torch.nn.functional.conv3d(torch.randn(2, 1, 4, 4, 4), torch.randn(2, 1, 3, 3, 3))
    assert y.dtype == torch.float32


def test_bf16_on_cpu_autocasts_convolutions():
    """The opt-in: ``train.amp: bf16`` on a CPU runs convolutions in bf16, with no scaler."""
    p = runtime.Precision("bf16", torch.device("cpu"))
    with p.autocast():
        y = torch.nn.functional.conv3d(torch.randn(2, 1, 4, 4, 4), torch.randn(2, 1, 3, 3, 3))
    assert p.mode == "bf16" and y.dtype == torch.bfloat16 and not p.scaler.is_enabled()


def test_cpu_probe_missing_means_fp32(monkeypatch):
    """A torch without the AMX probe (older builds, other CPUs) is taken as no tiles."""
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert not runtime.cpu_has_bf16_tiles()


@pytest.mark.parametrize("capability,bf16,want", [((7, 0), False, "fp16"), ((7, 5), False, "fp16"),
                                                  ((8, 0), True, "bf16"), ((9, 0), True, "bf16")])
def test_auto_on_cuda_by_compute_capability(monkeypatch, capability, bf16, want):
    """V100 (7.0) / T4 (7.5): fp16 + loss scaling as seed 004; A100 (8.0) / H100 (9.0): bf16.
    The device queries are replaced: this machine has no GPU (the gpu test below checks a real one)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    mode, why = runtime.resolve_amp("auto", torch.device("cuda"))
    assert mode == want and f"sm_{capability[0]}{capability[1]}" in why


def test_explicit_modes_unchanged_and_errors():
    assert runtime.resolve_amp("bf16", torch.device("cpu"))[0] == "bf16"
    with pytest.raises(ConfigError, match="auto"):
        runtime.Precision("fp8", torch.device("cpu"))
    with pytest.raises(ConfigError, match="CUDA"):
        runtime.Precision("fp16", torch.device("cpu"))


@pytest.mark.gpu
def test_auto_on_this_gpu_uses_a_scaler_only_for_fp16():
    p = runtime.Precision("auto", torch.device("cuda"))
    assert p.mode in ("bf16", "fp16") and p.scaler.is_enabled() == (p.mode == "fp16")
    with p.autocast():
        y = torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    assert y.dtype == p.dtype
