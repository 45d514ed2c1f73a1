"""A full disk: one line naming the file, exit 2, the last good checkpoint kept; a read-only place or a path
under a file: one line naming it.

Real ENOSPC from the kernel, no mock: ``/dev/full`` under the real ``torch.save`` (its zip writer reports
the failure as a ``RuntimeError`` whose context is the ``OSError``), and, where this process may mount one
(root with CAP_SYS_ADMIN), a small tmpfs under a real ``fastvision train``.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastvision.engine import checkpoint
from fastvision.errors import DiskFullError
from fastvision.utils.files import atomic_write, disk_full


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_atomic_write_on_enospc_names_the_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "last.pt"
    atomic_write(path, lambda f: torch.save({"w": torch.ones(3)}, f))
    before = path.read_bytes()
    full = open("/dev/full", "wb")  # buffered, as a file of atomic_write's is: torch sees a short write
    try:
        with pytest.raises(DiskFullError) as info:
            atomic_write(path, lambda f: torch.save({"w": torch.zeros(100_000)}, full))
    finally:
        try:
            full.close()  # its buffer cannot be flushed either
        except OSError:
            pass
    e = info.value
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC and e.filename == str(path)
    assert str(e).startswith(f"{path}: not written: {os.strerror(errno.ENOSPC)}")
    assert str(e).endswith("the file there before is kept") and "\n" not in str(e)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]
    # torch's own error is what atomic_write saw; the ENOSPC was in its context
    assert isinstance(e.__cause__, RuntimeError) and disk_full(e.__cause__).errno == errno.ENOSPC


def test_other_write_errors_are_not_called_a_full_disk(tmp_path):
    def fails(f):
        raise OSError(errno.EIO, "I/O error")

    with pytest.raises(OSError) as info:
        atomic_write(tmp_path / "x.bin", fails)
    assert not isinstance(info.value, DiskFullError) and info.value.errno == errno.EIO
    assert disk_full(ValueError("no")) is None
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A mounted tmpfs of ``size`` bytes (rounded to pages by the kernel); skipped where mounting is refused."""
    mounted = []

    def mount(size: str) -> Path:
        where = tmp_path / f"tmpfs-{len(mounted)}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()[:100]}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


TRAIN = ["--epochs", "2", "--device", "cpu", "--batch-size", "4", "--set", "data.args.image_size=[32,32]",
         "--set", "model.args.filters=[4,8,16]", "--set", "data.num_workers=0", "--set", "examples=0"]


def _train(data: Path, out: Path, *more: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastvision", "train", "unet2d-microscopy", "--data", str(data),
                           "--out", str(out), *TRAIN, *more], capture_output=True, text=True, timeout=300)


def test_train_on_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(tiny_microscopy, small_tmpfs):
    """256 KiB holds the run's config, log and one checkpoint (about 190 KB, last/best/rollback hard links):
    epoch 1's checkpoint does not fit. The command says so in one line naming last.pt, exits 2, and epoch 0's
    checkpoint still loads without pickle."""
    out = small_tmpfs("256k") / "run"
    r = _train(tiny_microscopy, out)
    assert r.returncode == 2, r.stderr[-2000:]
    last = out / "checkpoints" / "last.pt"
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith(f"fastvision: error: {last}: not written: {os.strerror(errno.ENOSPC)}"), r.stderr
    assert "Traceback" not in r.stderr
    assert checkpoint.load(last)["epoch"] == 0
    assert not [p for p in out.rglob("*.tmp")]


@pytest.mark.parametrize("size", ["4k", "8k"])
def test_train_whose_log_cannot_be_written_names_the_log(tiny_microscopy, small_tmpfs, size):
    """One page: the config is written, the first metrics.jsonl line is not (a plain append, not atomic_write).
    Two: the log fills its page, and a later line is written in part, its rest left in the file's buffer: closing
    the log tried to flush that rest and raised a nameless ENOSPC over the first ('a file: No space left')."""
    out = small_tmpfs(size) / "run"
    r = _train(tiny_microscopy, out, "--batch-size", "1", "--set", "train.log_every=1")  # lines before a checkpoint
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (f"fastvision: error: {out / 'metrics.jsonl'}: "
                                                 f"{os.strerror(errno.ENOSPC)}"), r.stderr
    assert "Traceback" not in r.stderr


def test_train_into_a_read_only_place_or_under_a_file_is_one_line(tiny_microscopy, small_tmpfs, tmp_path):
    """--out under a file (ENOTDIR, portable) and on a read-only mount (EROFS, where mountable)."""
    r = _train(tiny_microscopy, Path("/dev/null") / "run")
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("fastvision: error: /dev/null/run"), r.stderr
    assert last.endswith(f": {os.strerror(errno.ENOTDIR)}") and "Traceback" not in r.stderr, r.stderr
    ro = small_tmpfs("64k")
    subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
    r = _train(tiny_microscopy, ro / "run")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"fastvision: error: {ro / 'run'}: {os.strerror(errno.EROFS)}"), r.stderr
    assert "Traceback" not in r.stderr


def test_train_into_a_place_that_takes_no_folder_is_one_line(tiny_microscopy):
    """/proc takes no new folder: the kernel answers mkdir with ENOENT, which the CLI used to let through as a
    traceback (it passes ENOENT on only when mkdir raised it: a missing input file is not a place to write)."""
    r = _train(tiny_microscopy, Path("/proc") / "fastvision-run" / "x")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"fastvision: error: /proc/fastvision-run: cannot make this folder ({os.strerror(errno.ENOENT)})"), r.stderr
    assert "Traceback" not in r.stderr


def test_only_mkdirs_no_such_file_counts_as_a_place_to_fix(tmp_path):
    from fastvision.utils.files import os_error_in

    def raised(f):
        try:
            f()
        except OSError as e:
            return e
    assert os_error_in(raised(lambda: Path("/proc/fastvision-x/y").mkdir(parents=True))) is not None
    assert os_error_in(raised(lambda: os.makedirs("/proc/fastvision-x/y"))) is not None
    assert os_error_in(raised(lambda: open(tmp_path / "missing"))) is None  # a missing input: a bug or its own check
    assert os_error_in(raised(lambda: Path("/proc/fastvision-x").mkdir()), codes=(errno.ENOSPC,)) is None


def test_a_failed_background_write_is_raised_at_the_next_step_not_the_next_checkpoint(tmp_path):
    """The write's error used to wait in the writer until the next checkpoint (an epoch later: an hour of an
    ImageNet run trained for nothing); ``raise_failed`` (the loop asks after every step) raises it once the
    write has failed, and never waits for a write in flight."""
    (tmp_path / "afile").write_text("")
    writer = checkpoint.BackgroundWriter()
    writer.raise_failed()  # nothing written yet
    writer.write({"model": {"w": torch.ones(3)}}, [tmp_path / "afile" / "last.pt"])  # a folder that is a file
    writer._thread.join()  # the write has failed in the background
    with pytest.raises(OSError) as info:
        writer.raise_failed()
    assert str(tmp_path / "afile") in str(info.value)
    writer.raise_failed()  # reported once


def test_train_stops_in_the_epoch_after_the_checkpoint_that_did_not_fit(small_tmpfs, tmp_path):
    """256 KiB: epoch 1's checkpoint does not fit. The run stops during epoch 2 (12 steps), before validating
    it, instead of training and validating the whole epoch first."""
    from fastvision.data.synth.microscopy import synth

    data = synth(tmp_path / "data", seed=1, count=64, size=32)
    out = small_tmpfs("256k") / "run"
    r = subprocess.run([sys.executable, "-m", "fastvision", "train", "unet2d-microscopy", "--data", str(data),
                        "--out", str(out), *TRAIN, "--epochs", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "not written: " in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert checkpoint.load(out / "checkpoints" / "last.pt")["epoch"] == 0
    epochs = [e["step"] for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if isinstance(e["step"], list) and len(e["step"]) == 1]
    assert epochs == [[0], [1]]  # epoch 2 was not validated
