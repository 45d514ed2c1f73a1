"""The background checkpoint writer: host memory of a save, pinned staging on CUDA, atomicity.

The serialised checkpoint is streamed into the temp file, never held in Python memory (before
issue 28 a ``BytesIO`` held a second, full copy: measured here with tracemalloc, which sees Python
buffers but not torch's tensor storage); a process killed with SIGKILL in the middle of writes
leaves a ``last.pt`` that loads with ``weights_only=True``; on CUDA the GPU tensors are staged into
pinned buffers that the next save reuses, and the file holds the values of the moment ``write``
was called even when the step changes them right after.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc

import pytest
import torch

from fastvision.engine import checkpoint


def test_the_serialised_checkpoint_is_streamed_to_the_file_not_held_in_memory(tmp_path):
    state = {"model": {"w": torch.randn(2_000_000)}, "epoch": 3}  # 8 MB of tensor data
    writer = checkpoint.BackgroundWriter()
    tracemalloc.start()
    try:
        writer.write(state, [tmp_path / "last.pt", tmp_path / "best.pt"])
        writer.join()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = (tmp_path / "last.pt").stat().st_size
    assert size > 8_000_000
    assert peak < size / 8, f"{peak} bytes of Python memory for a {size}-byte checkpoint"  # a BytesIO: > size
    got = torch.load(tmp_path / "best.pt", weights_only=True)
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and got["epoch"] == 3


_CHILD = """
import sys, torch
from pathlib import Path
from fastvision.engine import checkpoint
out = Path(sys.argv[1])
writer = checkpoint.BackgroundWriter()
w = torch.zeros(1_000_000)
writer.write({"model": {"w": w}, "n": 0}, [out / "last.pt", out / "best.pt"])
writer.join()
print("ready", flush=True)
for n in range(1, 100000):
    w.fill_(n)
    writer.write({"model": {"w": w}, "n": n}, [out / "last.pt", out / "best.pt"])
"""


def test_a_kill_during_writes_leaves_a_loadable_last_checkpoint(tmp_path):
    """SIGKILL while the writer streams checkpoint after checkpoint: last.pt and best.pt load (weights
    only) and each holds one consistent write (every value equals its ``n``)."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_CHILD), str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # some writes in flight; any moment must be safe, so the delay is not critical
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    for name in ("last.pt", "best.pt"):
        got = torch.load(tmp_path / name, weights_only=True)
        assert torch.equal(got["model"]["w"], torch.full((1_000_000,), float(got["n"])))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a CUDA device")
def test_cuda_tensors_are_staged_in_reused_pinned_buffers(tmp_path):
    w = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    stage = checkpoint.PinnedStage()
    first = stage.copy({"w": w, "cpu": torch.ones(2)})
    w.add_(1)  # the next step, on the same stream, right after the copy was queued
    stage.wait()
    assert first["w"].is_pinned() and not first["cpu"].is_pinned()
    assert torch.equal(first["w"], torch.arange(1 << 20, dtype=torch.float32))
    second = stage.copy({"w": w, "cpu": torch.ones(2)})
    stage.wait()
    assert second["w"].data_ptr() == first["w"].data_ptr()  # the same pinned buffer, no new pinning
    writer = checkpoint.BackgroundWriter()
    writer.write({"model": {"w": w}}, [tmp_path / "last.pt"])
    w.mul_(0)
    writer.join()
    got = torch.load(tmp_path / "last.pt", weights_only=True)["model"]["w"]
    assert got.device.type == "cpu" and torch.equal(got, torch.arange(1 << 20, dtype=torch.float32) + 1)
