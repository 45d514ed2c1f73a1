"""The background checkpoint writer: host memory of a save, pinned staging on CUDA, atomicity.

The serialised checkpoint is streamed into the temp file, never held in Python memory (before
issue 28 a ``BytesIO`` held a second, full copy: measured here with tracemalloc, which sees Python
buffers but not torch's tensor storage); a process killed with SIGKILL in the middle of writes
leaves a ``last.pt`` that loads with ``weights_only=True``; on CUDA the GPU tensors are staged into
pinned buffers that the next save reuses, and the file holds the values of the moment ``write``
was called even when the step changes them right after.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

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


_DIES_MID_WRITE = """
import os, sys
from pathlib import Path
from fastvision.engine import checkpoint
checkpoint.atomic_write(Path(sys.argv[1]), lambda f: (f.write(b"PK" + bytes(4096)), f.flush(), os._exit(9)))
"""


def _killed_mid_write(path) -> None:
    """A process that dies inside ``atomic_write`` of ``path`` (no cleanup runs, as after SIGKILL)."""
    assert subprocess.run([sys.executable, "-c", _DIES_MID_WRITE, str(path)], timeout=120).returncode == 9


def test_a_first_checkpoint_killed_mid_write_lets_the_restart_start_afresh(tmp_path):
    """kill -9 during the run's first checkpoint write left ``checkpoints/.last.pt.XXXX.tmp``, and every
    ``--resume auto`` restart (torchrun --max-restarts, Kubernetes) refused the folder: 'exists but holds no
    checkpoints/last.pt to resume'. The restart starts afresh there and the leftover is removed."""
    from fastvision.api import prepare_run_dir

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    (run / "metrics.jsonl").write_text("{}\n")
    _killed_mid_write(run / "checkpoints" / "last.pt")
    _killed_mid_write(run / "config.yaml")  # SIGTERM as the run starts, before its handler: config.yaml's write
    left = list((run / "checkpoints").iterdir())
    assert len(left) == 1 and checkpoint.unfinished_write(left[0])
    assert prepare_run_dir("r", str(run), "auto") == (run, None)
    assert list((run / "checkpoints").iterdir()) == []
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "metrics.previous.jsonl"]


def test_a_resume_removes_the_temp_files_of_killed_writes_and_a_refusal_keeps_them(tmp_path):
    """Each kill -9 mid-write left a checkpoint-sized temp file that resumed runs kept for ever; a refused
    --out (no --resume: maybe another run's folder) is left as it is."""
    from fastvision.api import prepare_run_dir
    from fastvision.errors import DataError

    run = tmp_path / "run"
    last = run / "checkpoints" / "last.pt"
    checkpoint.atomic_write(last, lambda f: torch.save({"model": {}}, f))
    _killed_mid_write(last)
    _killed_mid_write(run / "checkpoints" / "best.pt")
    assert len(list(last.parent.iterdir())) == 3
    with pytest.raises(DataError, match="already exists"):
        prepare_run_dir("r", str(run), None)
    assert len(list(last.parent.iterdir())) == 3
    assert prepare_run_dir("r", str(run), "auto") == (run, last)
    assert list(last.parent.iterdir()) == [last] and checkpoint.load(last)["model"] == {}


def test_resume_auto_without_out_continues_the_run_whose_last_checkpoint_is_newest(tmp_path, monkeypatch):
    """Run a (stopped at 12:00) and run b (finished at 11:00, its plots redrawn at 13:00, which moves its
    folder's time): ``--resume auto`` took b, the folder touched last, and "continued" a finished run."""
    from fastvision.api import prepare_run_dir

    monkeypatch.chdir(tmp_path)
    lasts = {}
    for name, ckpt_t, folder_t in (("r-a", 12, 10), ("r-b", 11, 13)):
        last = lasts[name] = Path("runs") / name / "checkpoints" / "last.pt"
        checkpoint.atomic_write(last, lambda f: torch.save({"model": {}}, f))
        os.utime(last, (ckpt_t * 3600, ckpt_t * 3600))
        os.utime(last.parent.parent, (folder_t * 3600, folder_t * 3600))
    (Path("runs") / "other-c" / "checkpoints").mkdir(parents=True)  # another recipe's run: never chosen
    assert prepare_run_dir("r", None, "auto") == (Path("runs") / "r-a", lasts["r-a"])


def test_a_checkpoint_whose_bytes_changed_on_disk_is_refused_naming_the_record(tmp_path):
    """One flipped byte inside a tensor: ``torch.load(weights_only=True)`` returns the changed weights without a
    word (a resume trained on from them); the zip archive's CRC-32 that torch.save stored says otherwise."""
    from fastvision.errors import DataError

    path = tmp_path / "last.pt"
    w = torch.full((1000,), 7.0)
    checkpoint.atomic_write(path, lambda f: torch.save({"model": {"w": w}, "epoch": 1}, f))
    assert torch.equal(checkpoint.load(path)["model"]["w"], w)
    data = bytearray(path.read_bytes())
    at = data.find(w.numpy().tobytes()) + 400
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path, weights_only=True)["model"]["w"], w)  # torch alone: silent
    with pytest.raises(DataError) as info:
        checkpoint.load(path)
    assert str(info.value).startswith(f"{path}: damaged: the bytes of archive/data/0 do not match the checksum")
    with pytest.raises(DataError, match="damaged"):
        checkpoint.load_run_checkpoint(path)  # evaluate / predict / export


def test_an_archive_saved_without_checksums_still_loads(tmp_path):
    config = getattr(getattr(torch.serialization, "config", None), "save", None)
    if config is None or not hasattr(config, "compute_crc32"):
        pytest.skip("this torch always writes CRC-32s")
    path = tmp_path / "last.pt"
    config.compute_crc32 = False
    try:
        torch.save({"model": {"w": torch.ones(3)}}, path)
    finally:
        config.compute_crc32 = True
    assert torch.equal(checkpoint.load(path)["model"]["w"], torch.ones(3))


def test_a_resume_adopts_rollback_pt_unless_it_is_ahead_of_the_resumed_step(tmp_path):
    """rollback.pt of step 10: a resume at step 12 may roll back to it; one from an older step-6.pt may not (it
    is the abandoned branch's future); an unreadable one is no target."""
    from fastvision.engine.policy import CheckpointPolicy, Every

    path = tmp_path / "rollback.pt"
    checkpoint.atomic_write(path, lambda f: torch.save({"model": {"w": torch.ones(4)}, "step": 10}, f))
    assert checkpoint.saved_step(path) == 10
    for step, good in ((12, (path, 10)), (6, None)):
        policy = CheckpointPolicy(tmp_path, Every(None), 0)
        policy.resumed(step, checkpoint.saved_step)
        assert policy.good == good
    path.write_bytes(b"PK not a checkpoint")
    policy = CheckpointPolicy(tmp_path, Every(None), 0)
    policy.resumed(12, checkpoint.saved_step)
    assert policy.good is None


@pytest.mark.parametrize("change,words", [
    ({"model": {"name": "unet5d"}}, "its model 'unet5d' does not build in this version (saved by fastvision 99.0"),
    ({"model": {"args": {"new_knob": 1}}}, "its model 'unet3d-spleen' does not build in this version"),
    ({"task": {"name": "tracking"}}, "its task 'tracking' does not build in this version"),
])
@pytest.mark.parametrize("command", ["evaluate", "predict", "export"])
def test_a_checkpoint_of_another_version_names_the_file_model_and_what_this_version_knows(tmp_path, capsys,
                                                                                          change, words, command):
    # evaluate / predict printed a bare "unknown model 'unet5d'; valid: ..." (export named the file alone)
    from fastvision import cli, config

    saved = config.to_dict(config.load("unet3d-spleen-baseline"))
    for section, values in change.items():
        for key, value in values.items():
            saved[section][key] = {**saved[section][key], **value} if isinstance(value, dict) else value
    path = tmp_path / "other.pt"
    torch.save({"config": saved, "model": {}, "fastvision": "99.0"}, path)
    argv = {"evaluate": ["evaluate", str(path), "--device", "cpu"],
            "predict": ["predict", str(path), str(path), "--out", str(tmp_path / "p"), "--device", "cpu"],
            "export": ["export", str(path), "--out", str(tmp_path / "m.onnx")]}[command]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"fastvision: error: {path}: ") and words in err, err
    known = {"model": "valid: " if "name" in change.get("model", {}) else "valid keys: ", "task": "valid: "}
    assert next(known[s] for s in change) in err  # what this version builds
    assert not (tmp_path / "p").exists() and not (tmp_path / "m.onnx").exists()
