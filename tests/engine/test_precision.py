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


@pytest.mark.parametrize("amx,avx512,unit", [(False, False, None), (True, False, "AMX bf16 tiles"),
                                             (False, True, "AVX-512 BF16"), (True, True, "AMX bf16 tiles")])
def test_auto_on_cpu_keeps_fp32_and_names_native_bf16(monkeypatch, amx, avx512, unit):
    """``auto`` on any CPU is fp32 (no autocast, no scaler); where the CPU computes bf16 natively (AMX
    tiles: Sapphire Rapids+; AVX-512 BF16: Zen 4+, Cooper Lake) the logged line names the unit and
    ``train.amp=bf16`` as the faster opt-in, AMX first. torch's own CPU probes are replaced, so every
    branch runs on any machine."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)  # torch < 2.5: absent
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512, raising=False)
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
    assert len(mine) == 1
    if unit is None:
        assert "bf16 is faster" not in mine[0]
    else:
        assert mine[0].endswith(f"this CPU has {unit}: train.amp=bf16 is faster)")
    assert runtime.cpu_native_bf16() == unit
    with p.autocast():
        y = torch.nn.functional.conv3d(torch.randn(2, 1, 4, 4, 4), torch.randn(2, 1, 3, 3, 3))
    assert y.dtype == torch.float32


def test_bf16_on_cpu_autocasts_convolutions():
    """The opt-in: ``train.amp: bf16`` on a CPU runs convolutions in bf16, with no scaler."""
    p = runtime.Precision("bf16", torch.device("cpu"))
    with p.autocast():
        y = torch.nn.functional.conv3d(torch.randn(2, 1, 4, 4, 4), torch.randn(2, 1, 3, 3, 3))
    assert p.mode == "bf16" and y.dtype == torch.bfloat16 and not p.scaler.is_enabled()


def test_cpu_probes_missing_mean_no_native_bf16(monkeypatch):
    """A torch without the probes (older builds, other CPUs) is taken as no native bf16; one probe
    missing leaves the other one's answer."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert runtime.cpu_native_bf16() == "AVX-512 BF16"
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    assert runtime.cpu_native_bf16() is None


def test_no_onednn_means_no_native_bf16(monkeypatch):
    """Without oneDNN the probes' units are not used by torch's CPU convolutions: no hint."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert runtime.cpu_native_bf16() is None


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


def _scaled_steps(scaler: torch.amp.GradScaler, grads: list[float]) -> list[tuple[float, bool]]:
    """Each step: scaled backward of ``g * w`` (an inf ``g`` overflows), scaler step and update; returns
    (scale after the update, whether the weight moved) per step. torch's GradScaler runs on the CPU too."""
    w = torch.nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([w], lr=0.1)
    out = []
    for g in grads:
        opt.zero_grad()
        before = w.detach().clone()
        scaler.scale(w * g).backward()
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), not torch.equal(before, w.detach())))
    return out


def test_static_loss_scale_starts_at_the_number_never_grows_and_halves_on_an_overflow():
    """``train.loss_scale: 128`` (seed 004's AMP runs, DLE's --static-loss-scale): the scale is 128 from the
    first step, stays 128 over more clean steps than the dynamic scaler's growth interval would allow, and an
    overflowed step is skipped and halves it (DLE PyTorch's GradScaler(growth_interval=10^9)). The dynamic
    default is torch's: from 2^16, doubled after 2000 clean steps."""
    static = runtime.loss_scaler("cpu", True, 128)
    steps = _scaled_steps(static, [1.0] * 2001 + [float("inf"), 1.0])
    assert [s for s, _ in steps[:2001]] == [128.0] * 2001 and all(moved for _, moved in steps[:2001])
    assert steps[2001] == (64.0, False)  # skipped, backed off
    assert steps[2002] == (64.0, True)
    dynamic = runtime.loss_scaler("cpu", True, "dynamic")  # torch's defaults
    assert dynamic.get_scale() == 2.0**16 and dynamic.get_growth_interval() == 2000
    assert not runtime.loss_scaler("cpu", False, 128).is_enabled()  # bf16 / fp32: no scaler, whatever the value


@pytest.mark.parametrize("bad", [0, -1, float("inf"), True, "static"])
def test_a_bad_loss_scale_is_one_line_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"^train\.loss_scale: expected dynamic or a positive number") as e:
        runtime.Precision("off", torch.device("cpu"), bad)
    assert "\n" not in str(e.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_on_cuda_builds_the_static_scaler():
    p = runtime.Precision("fp16", torch.device("cuda", torch.cuda.current_device()), 128)
    assert p.scaler.is_enabled() and p.scaler.get_scale() == 128.0
    assert p.scaler.get_growth_interval() == runtime.STATIC_GROWTH_INTERVAL
