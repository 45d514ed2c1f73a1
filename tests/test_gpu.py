"""What only a GPU can show: fp16 loss scaling, bf16 and TF32 numerics, compile, NCCL, prefetch.

Skipped without CUDA (see conftest.py). Run on a GPU machine with `pytest -m gpu`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastvision
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_mixed_precision_training_on_cuda(amp, tiny_microscopy, tmp_path):
    summary = fastvision.train("unet2d-microscopy", out=str(tmp_path / amp),
                               **tiny_overrides(tiny_microscopy, device="cuda", amp=amp, epochs=3))
    assert np.isfinite(summary["train_loss"]) and summary["iou"] >= 0.0
    ckpt = torch.load(tmp_path / amp / "checkpoints" / "last.pt", weights_only=True)
    if amp == "fp16":
        assert ckpt["scaler"]["scale"] > 0  # dynamic loss scale was saved for resume


def test_compile_and_channels_last_match_eager(tiny_microscopy, tmp_path):
    common = tiny_overrides(tiny_microscopy, device="cuda", epochs=1, tf32=False,
                            **{"data.augment.flip": None, "data.augment.rot90": None, "train.deterministic": True})
    fastvision.train("unet2d-microscopy", out=str(tmp_path / "eager"), **common)
    fastvision.train("unet2d-microscopy", out=str(tmp_path / "fast"), compile=True, channels_last=True, **common)
    a = torch.load(tmp_path / "eager" / "checkpoints" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "fast" / "checkpoints" / "last.pt", weights_only=True)["model"]
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=1e-3, atol=1e-4)


def test_single_gpu_nccl_process_group(tiny_microscopy, tmp_path, monkeypatch):
    """A world of one through the NCCL path: init, all-reduce, barrier, shutdown."""
    import torch.distributed as tdist

    from fastvision import dist

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29531")
    tdist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        t = torch.ones(3, device="cuda")
        tdist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        assert dist.rank() == 0
    finally:
        tdist.destroy_process_group()


def test_monitor_matches_the_cuda_device_by_uuid():
    """NVML counts GPUs in PCI order, CUDA after CUDA_VISIBLE_DEVICES: the handle must be the same GPU."""
    pynvml = pytest.importorskip("pynvml")
    from fastvision.profiling.monitor import nvml_handle

    for index in range(torch.cuda.device_count()):
        handle = nvml_handle(index)
        got = pynvml.nvmlDeviceGetUUID(handle)
        got = got.decode() if isinstance(got, bytes) else got
        assert got == f"GPU-{torch.cuda.get_device_properties(index).uuid}"
