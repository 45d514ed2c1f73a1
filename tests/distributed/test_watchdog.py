"""The hang doctor under the real torchrun: one of two ranks frozen with SIGSTOP after a checkpoint.

Rank 0 waits in the step's gradient all-reduce; after ``train.hang_timeout_s`` it writes its stacks
to ``RUN/hang/rank-0.txt``, names rank 1 (host and pid) in one line and exits 124. Without restarts
the job fails; with restarts left (rank 1 continued with SIGCONT, so torchrun can stop it) the
restarted workers resume from the untouched ``last.pt`` and end with the uninterrupted job's
weights. The job runs through a small wrapper of ``fastvision.cli.main`` that also says whether the
default process group is still joined when ``train`` returns (it must not be).

The job without restarts is this module's own; the one with restarts is test_elastic's restarting
job, whose last interruption is this frozen rank (:func:`freeze`): one torchrun job and two worker
processes fewer than a restarting job of its own, the property the same (a hang in a restarting
torchrun job, its restarted workers ending as the uninterrupted job).

Data is the fixture of tests/distributed/conftest.py (21 generated 32x32 microscopy PNG pairs); the
uninterrupted reference is conftest's job, run once for this module and test_elastic.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from fastvision.distributed.watchdog import HANG_EXIT, Watchdog, check_timeouts
from fastvision.errors import ConfigError
from tests.conftest import ROOT, clean_env
from tests.distributed.conftest import EPOCHS, TINY, last_model
from tests.distributed.test_dist_train import _worker_pid
from tests.distributed.test_elastic import shared_interrupted, shared_uninterrupted

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, SIGSTOP")]

# seconds without progress that count as a hang: a tiny step takes milliseconds, and no two beats of a
# healthy run of this job were more than 0.5 s apart on 2 loaded cores (load average 6): 10 times that
HANG_S = 5

WRAPPER = """\
import sys
import torch.distributed as d
from fastvision.cli import main
rc = main(sys.argv[1:])
print(f"train returned {rc}; process group joined: {d.is_initialized()}", file=sys.stderr)
sys.exit(rc)
"""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """conftest's ``uninterrupted``, the very run test_elastic compares with: one job for both modules."""
    return shared_uninterrupted(tmp_path_factory)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict:
    """test_elastic's restarting job (``--max-restarts 4``), its last interruption :func:`freeze`."""
    return shared_interrupted(tmp_path_factory)


def job_command(data: Path, out: Path, wrapper: Path, restarts: int) -> list[str]:
    """The 2-worker torchrun job (``restarts`` restarts) of ``fastvision train`` through :data:`WRAPPER`
    (written to ``wrapper``), resuming from ``out``, its hang timeout :data:`HANG_S`."""
    wrapper.write_text(WRAPPER)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(restarts), str(wrapper), "train", "unet2d-microscopy", "--data", str(data),
            "--out", str(out), "--epochs", str(EPOCHS), "--resume", "auto", *TINY, "--set", "train.checkpoint_every=5",
            "--set", f"train.hang_timeout_s={HANG_S}"]


def _wait(what, seconds: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + seconds
    while not what() and time.monotonic() < deadline and (proc is None or proc.poll() is None):
        time.sleep(0.02)
    return bool(what())


def freeze(proc: subprocess.Popen, victim: int, log: Path, hang: Path) -> dict:
    """SIGSTOP the worker ``victim`` (rank 1) of the job ``proc`` (its stderr in ``log``, its run's
    ``hang`` folder), wait for the watchdog's report, then SIGCONT it (torchrun can stop, or restart,
    a frozen worker only once it runs). Returns what was seen (JSON-able): the report line came
    (``reported``) after ``seconds``, the hang folder's stack files then, ``report.txt``, and where
    the job's stderr stood at the freeze (``cut``)."""
    cut = len(log.read_text())
    os.kill(victim, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        reported = _wait(lambda: "did not arrive" in log.read_text()[cut:] and (hang / "report.txt").exists(),
                         HANG_S + 90, proc)
        seconds = time.monotonic() - stopped_at
        live_stacks = sorted(p.name for p in hang.glob("rank-*.txt")) if hang.exists() else []
        report = (hang / "report.txt").read_text() if reported else ""
    finally:
        try:
            os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:
            pass
    return {"victim": victim, "reported": reported, "seconds": seconds, "live_stacks": live_stacks,
            "report": report, "cut": cut}


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_frozen_rank_is_named_and_the_job_exits_or_restarts(restarts, data, request, tmp_path):
    if restarts == 0:
        out, tag, log = tmp_path / "run", uuid.uuid4().hex, tmp_path / "stderr.txt"
        with log.open("w") as err_file:
            proc = subprocess.Popen(job_command(data, out, tmp_path / "train_job.py", restarts), cwd=ROOT,
                                    env=clean_env(FV_TEST_TAG=tag), stdout=subprocess.DEVNULL, stderr=err_file,
                                    text=True)
        try:
            assert _wait((out / "checkpoints" / "last.pt").exists, 180, proc), "no checkpoint written"
            victim = _worker_pid(tag, 1)
            assert victim is not None and proc.poll() is None, "no worker to freeze"
            seen = freeze(proc, victim, log, out / "hang")
            proc.wait(timeout=240)
        finally:
            proc.kill()
        rc, full_err, killed = proc.returncode, log.read_text(), []
    else:  # test_elastic's job, frozen after three interruptions
        job = request.getfixturevalue("interrupted")
        out, seen, rc, full_err, killed = Path(job["out"]), job["frozen"], job["rc"], job["err"], job["victims"]
    err, before = full_err[seen["cut"]:], full_err[:seen["cut"]]  # the job's stderr from the freeze on, before it
    # no live rank reported: before the freeze a report may only name a worker the job killed (a SIGKILLed rank
    # did not arrive either; on a loaded machine the watchdog can say so before torchrun restarts the job)
    early = [x for x in before.splitlines() if "did not arrive" in x]
    assert all(any(f", {pid}) did not arrive" in x for pid in killed) for x in early), before[-3000:]
    last, hang = out / "checkpoints" / "last.pt", out / "hang"
    victim, reported, seconds, live_stacks, report = (seen[k] for k in ("victim", "reported", "seconds",
                                                                         "live_stacks", "report"))
    assert reported, err[-3000:]
    assert seconds < HANG_S + 90
    line = next(x for x in err.splitlines() if "did not arrive" in x)
    assert f"rank 1 ({socket.gethostname()}, {victim}) did not arrive" in line, line
    assert f"stacks in {hang}" in line and "rank 0 (" not in line
    assert live_stacks == ["rank-0.txt"], live_stacks  # the live rank's; the frozen one could not write
    assert report.strip() == line.split("watchdog: ", 1)[-1]
    stacks = (hang / "rank-0.txt").read_text()
    assert "Thread MainThread" in stacks and "fastvision-watchdog" in stacks and "engine/loop.py" in stacks
    assert f"exitcode: {HANG_EXIT}" in err or f"exitcode  : {HANG_EXIT}" in err, err[-3000:]
    if restarts == 0:
        assert rc != 0
        ckpt = torch.load(last, weights_only=True)  # the last good checkpoint, untouched by the exit
        assert all(torch.isfinite(t).all() for t in ckpt["model"].values() if t.is_floating_point())
    else:
        assert rc == 0, err[-3000:]
        assert "resumed from" in err
        assert err.count("process group joined: False") == 2, err[-2000:]  # both ranks of the restart
        weights, whole = last_model(out), request.getfixturevalue("uninterrupted")
        assert all(torch.equal(weights[k], whole[k]) for k in whole)


def _store():
    from tests.conftest import free_port

    return torch.distributed.TCPStore("127.0.0.1", free_port(), 3, is_master=True, wait_for_workers=False)


def test_in_one_process_the_rank_whose_heartbeat_stops_is_named(tmp_path):
    """Three watchdogs on one real TCPStore: rank 0 beats once and then waits (a collective), rank 1
    publishes once and freezes (never started), rank 2 lives on at the same step."""
    store, exits = _store(), []
    dogs = [Watchdog(0.5, tmp_path / "hang", r, 3, store, exit=exits.append) for r in range(3)]
    dogs[1]._publish()
    dogs[2].start()
    dogs[0].start()
    for d in (dogs[0], dogs[2]):
        d.beat(7)
    deadline = time.monotonic() + 60
    while not exits and time.monotonic() < deadline:
        dogs[2].beat(7)  # rank 2 stays alive; it never stalls, so it never reports
        time.sleep(0.05)
    dogs[0].close()
    dogs[2].close()
    assert exits == [HANG_EXIT]
    line = store.get("fastvision/hang/report").decode()
    assert line == f"step 7: rank 1 ({dogs[1].who}) did not arrive; stacks in {tmp_path / 'hang'}/"
    assert sorted(p.name for p in (tmp_path / "hang").iterdir()) == ["rank-0.txt", "report.txt"]
    assert (tmp_path / "hang" / "report.txt").read_text() == line + "\n"
    assert "no progress for 0.5 s after step 7" in (tmp_path / "hang" / "rank-0.txt").read_text()


@pytest.mark.parametrize("before, after, expected", [
    ({0: (5, 9, "a, 1"), 1: (3, 9, "b, 2")}, {0: (8, 9, "a, 1"), 1: (3, 9, "b, 2")}, "rank 1 (b, 2) did not arrive;"),
    ({0: (5, 9, "a, 1")}, {0: (8, 9, "a, 1")}, "rank 1 (never reported) did not arrive;"),
    ({0: (5, 9, "a, 1"), 1: (3, 8, "b, 2")}, {0: (8, 9, "a, 1"), 1: (4, 8, "b, 2")},
     "rank 1 (b, 2) did not arrive (alive, behind);"),
    ({0: (5, 9, "a, 1"), 1: (3, 9, "b, 2")}, {0: (8, 9, "a, 1"), 1: (4, 9, "b, 2")}, "every rank is alive"),
])
def test_the_report_line_from_two_heartbeat_reads(before, after, expected, tmp_path):
    line = Watchdog(5, tmp_path, 0, 2).summary(before, after)
    assert line.startswith("step 0: ") and expected in line


@pytest.mark.parametrize("hang, dist, ok", [(240, 300, True), (0, 300, True), (None, 300, True), (300, 300, False),
                                            (400, 300, False), (-1, 300, False)])
def test_the_hang_timeout_must_come_before_the_collectives_own(hang, dist, ok):
    if ok:
        check_timeouts(hang, dist)
    else:
        with pytest.raises(ConfigError, match="train.hang_timeout_s"):
            check_timeouts(hang, dist)


def test_nccl_flight_recorder_variables_keep_the_users_and_follow_the_run(monkeypatch, tmp_path):
    from fastvision.distributed.watchdog import DUMP_FILE, FLIGHT_RECORDER, nccl_flight_recorder_env, point_dumps_at

    for key in [*FLIGHT_RECORDER, *DUMP_FILE]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the user's choice stays
    nccl_flight_recorder_env()
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    point_dumps_at(tmp_path / "a" / "hang")
    point_dumps_at(tmp_path / "b" / "hang")  # a second run in the same process: its own folder
    assert [os.environ[k] for k in DUMP_FILE] == [str(tmp_path / "b" / "hang" / "nccl-trace-rank-")] * 2
    monkeypatch.setenv(DUMP_FILE[0], "/scratch/traces/rank_")
    point_dumps_at(tmp_path / "c" / "hang")
    assert os.environ[DUMP_FILE[0]] == "/scratch/traces/rank_"


def test_nproc_refuses_the_timeouts_before_starting_workers(monkeypatch, tmp_path, capsys):
    """``train --nproc 2`` with hang_timeout_s >= dist_timeout_s started both workers, which refused it after
    the process group was made; the launcher refuses it first."""
    from fastvision import cli, distributed

    monkeypatch.setattr(distributed, "launch_local", lambda *a, **k: pytest.fail("workers started"))
    code = cli.main(["train", "unet2d-microscopy", "--nproc", "2", "--device", "cpu", "--out", str(tmp_path / "r"),
                     "--set", "train.hang_timeout_s=100", "--set", "train.dist_timeout_s=50"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "train.hang_timeout_s (100 s)" in err[0] and not (tmp_path / "r").exists()
