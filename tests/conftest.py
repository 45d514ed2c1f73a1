"""Shared fixtures: tiny real datasets written to disk once per session, and GPU skipping."""
from __future__ import annotations

import atexit
import gc
import getpass
import logging
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# the child processes' temporary folder, removed when this (pytest or xdist worker) process exits: torchrun leaves
# a torchelastic_* log folder in it per job (about 110 a suite run, in /tmp before). Inductor's cache stays where
# it was, shared with the tests run in this process
_CHILD_TMP = tempfile.mkdtemp(prefix="fastvision-tests-")
atexit.register(shutil.rmtree, _CHILD_TMP, ignore_errors=True)
_INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move every object alive after collection (the imported modules, torch's and MONAI's included) out of
    the garbage collector's reach: a full ``gc.collect()``, which autobatch, tune and the DDP tests call
    after each try, then scans only what the tests made (0.3-0.6 s a call in a process that has collected
    the suite, under 0.01 s after)."""
    gc.freeze()


def clean_env(**more: str) -> dict[str, str]:
    """This process's environment without launcher variables (torchrun, SLURM), one thread per
    worker and the repo importable: the start of every multi-process test's child environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TMPDIR=_CHILD_TMP, TORCHINDUCTOR_CACHE_DIR=_INDUCTOR_CACHE)
    env.update(more)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged_processes(tag: str) -> list[int]:
    """PIDs of every live process whose environment carries ``FV_TEST_TAG=tag`` (a launcher, torchrun, its
    workers: start the command with ``clean_env(FV_TEST_TAG=tag)``)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and f"FV_TEST_TAG={tag}".encode() in (d / "environ").read_bytes().split(b"\0") \
                    and b"State:\tZ" not in (d / "status").read_bytes():
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def sigterm_after_steps(proc: subprocess.Popen, metrics: Path, steps: int, tag: str,
                        timeout: float = 90) -> tuple[str, list[int]]:
    """Once ``metrics`` (a run's metrics.jsonl) logs ``steps`` training steps, SIGTERM ``proc`` alone (as
    ``kill PID`` does) and wait for it: ``(its stderr, the tagged processes still alive 10 s later)``;
    whatever is left is killed after."""
    import signal
    import time

    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline and \
                (not metrics.exists() or metrics.read_text().count('"step": [') < steps):
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        os.kill(proc.pid, signal.SIGTERM)
        err = proc.communicate(timeout=timeout)[1]
        deadline = time.monotonic() + 10
        while tagged_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return err, tagged_processes(tag)
    finally:
        proc.kill()
        for pid in tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)


def monai_version() -> tuple[int, int]:
    """(major, minor) of the installed MONAI, the reference some tests compare with (its behaviour moved)."""
    import monai

    return tuple(int(x) for x in monai.__version__.split(".")[:2])


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once it ends; one that runs past ``timeout`` seconds is killed
    (its returncode then says so) and what it wrote is still returned."""
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate())
    return outs


def run_gloo_ranks(tmp_path: Path, child: str, args: list[str], ranks: int = 2, timeout: float = 400) -> list:
    """Run the script ``child`` (its ``{root}`` filled with the repository root) as ``ranks`` gloo ranks
    of one node (env:// rendezvous) with ``*args OUT``; asserts every rank exits 0 (their stderr in
    the message) and returns what each rank wrote to its ``OUT`` as JSON, in rank order."""
    import json
    import sys

    script = tmp_path / "child.py"
    script.write_text(child.format(root=str(ROOT)))
    outs = [tmp_path / f"rank{r}.json" for r in range(ranks)]
    port, procs = free_port(), []
    for r, out in enumerate(outs):
        env = clean_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FASTVISION_CACHE=str(tmp_path / "fvcache"))
        procs.append(subprocess.Popen([sys.executable, str(script), *args, str(out)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errs = [err for _, err in communicate_all(procs, timeout=timeout)]
    assert [p.returncode for p in procs] == [0] * ranks, "\n".join(e[-3000:] for e in errs)
    return [json.loads(out.read_text()) for out in outs]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_microscopy(tmp_path_factory):
    """16 generated 32x32 image/mask PNG pairs in the microscopy folder format."""
    from fastvision.data.synth.microscopy import synth

    return synth(tmp_path_factory.mktemp("micro") / "data", seed=1, count=16, size=32)


def tiny_overrides(data_path, **more) -> dict:
    """Flat + dotted overrides that make unet2d-microscopy run in about a second on CPU."""
    return {"data": str(data_path), "epochs": 2, "batch_size": 4, "device": "cpu",
            "data.args.image_size": [32, 32], "model.args.filters": [4, 8, 16],
            "data.num_workers": 0, "train.log_every": 1, "examples": 2, **more}


def _reset_logging() -> None:
    """A CLI call leaves the "fastvision" logger writing to that test's (later closed) stderr and not
    propagating: back to no handler, propagating."""
    logger = logging.getLogger("fastvision")
    logger.handlers[:], logger.propagate = [], True


@pytest.fixture(autouse=True)
def _logging_as_found():
    """After every test the "fastvision" logger propagates again, with no handler: a test that ran the CLI
    in this process (``run_cli``, ``main``) otherwise left it writing to that test's closed stderr, and a
    later test on the same pytest-xdist worker saw no records in caplog (an order-dependent failure)."""
    yield
    _reset_logging()


@pytest.fixture
def fresh_logging():
    """Reset the "fastvision" logger before and after the test, so warnings reach caplog and nothing
    writes to a closed stream."""
    _reset_logging()
    yield
    _reset_logging()


def cli_here(argv: list[str], *, threads: int | None = None) -> int:
    """``fastvision ARGV`` in this process (``fastvision.cli.main``), for tests about what a command
    writes and returns rather than about a process of its own (which costs seconds of torch import).
    ``threads``: torch threads while it runs (1: as a subprocess under ``clean_env``'s OMP_NUM_THREADS=1,
    so both compute the same bits). Afterwards this process's thread count and logger are as before."""
    from fastvision.cli import main

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return main(argv)
    finally:
        torch.set_num_threads(before)
        _reset_logging()
