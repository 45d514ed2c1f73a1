"""Tests for fastvision.distributed: launch-environment table, samplers, and real 2-rank gloo jobs.

The multi-process tests start this very file as the worker (``python tests/distributed/test_dist.py
OUT``) under ``torch.distributed.run --standalone`` (through ``distributed.launch_local``) and under
hand-made SLURM variables, so the code path is the one a user's job takes. Each worker checks
DDP's averaged gradient against plain autograd on the concatenated global batch, and the reduced
metric sums against the whole-set sums.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # also run as a worker script

from fastvision import distributed  # noqa: E402
from fastvision.errors import ConfigError  # noqa: E402
from tests.conftest import clean_env, communicate_all, free_port  # noqa: E402

# --------------------------------------------------------------------------- environment table

ENV_CASES = [
    ("single", {}, distributed.DistEnv()),
    ("torchrun", {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"},
     distributed.DistEnv(3, 1, 4, 2, "torchrun", "10.0.0.5", 1234)),
    # torchrun inside a SLURM allocation: torchrun's variables win
    ("torchrun-in-slurm", {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "5",
                           "SLURM_JOB_ID": "77", "SLURM_NTASKS": "1"},
     distributed.DistEnv(1, 1, 2, 2, "torchrun", "h", 5)),
    ("srun", {"SLURM_JOB_ID": "123456", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
              "SLURM_STEP_ID": "0", "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "2(x4)",
              "SLURM_NODELIST": "node[01-03,07]"},
     distributed.DistEnv(5, 1, 8, 2, "slurm", "node01", 12000 + 123456 % 20000)),
    ("srun-step-vars", {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "16",
                        "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEPID": "1", "SLURM_NODEID": "1",
                        "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_STEP_NODELIST": "gpu-a,gpu-b",
                        "SLURM_JOB_NODELIST": "gpu-[a-z]"},
     distributed.DistEnv(0, 0, 3, 1, "slurm", "gpu-a", 12009)),
    ("srun-overrides", {"SLURM_JOB_ID": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2",
                        "SLURM_STEP_ID": "0", "SLURM_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "40000"},
     distributed.DistEnv(1, 1, 2, 2, "slurm", "127.0.0.1", 40000)),
    # RANK / LOCAL_RANK / WORLD_SIZE copied from srun's variables, no MASTER_*: srun's rendezvous (was torch's
    # env:// traceback: seed 001's setup_dist_env.sh exports exactly these)
    ("srun-with-copied-ranks", {"SLURM_JOB_ID": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2",
                                "SLURM_STEP_ID": "0", "SLURM_NODELIST": "n[1-2]", "RANK": "1", "LOCAL_RANK": "1",
                                "WORLD_SIZE": "2"},
     distributed.DistEnv(1, 1, 2, 2, "slurm", "n1", 12001)),
    # one-task allocation run straight from the batch script: a legitimate single process
    ("sbatch-one-task", {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
                         "SLURM_NODELIST": "n1"}, distributed.DistEnv()),
]


@pytest.mark.parametrize("name,environ,expected", ENV_CASES, ids=[c[0] for c in ENV_CASES])
def test_detect_env(name, environ, expected):
    assert distributed.detect_env(environ) == expected


@pytest.mark.parametrize("environ", [
    {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "4", "SLURM_NODELIST": "n[1-2]"},  # salloc shell, no srun
    # inside the batch script, Slurm marks the batch step with id 4294967294 (SLURM_BATCH_SCRIPT)
    {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_STEP_ID": "4294967294"},
])
def test_slurm_without_srun_is_an_actionable_error(environ):
    with pytest.raises(ConfigError, match="srun"):
        distributed.detect_env(environ)


@pytest.mark.parametrize("bad", [{"RANK": "x", "WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "2.5"}])
def test_malformed_variables_name_the_key(bad):
    with pytest.raises(ConfigError, match="RANK|WORLD_SIZE"):
        distributed.detect_env(bad)


_SRUN = {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"}
_TR = {"MASTER_ADDR": "h", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("environ,says", [
    # a rank at or past the world size (or below 0) waited for ever for a peer that does not exist
    ({"RANK": "2", "WORLD_SIZE": "2", **_TR}, "RANK=2 is outside [0, WORLD_SIZE=2)"),
    ({"RANK": "-1", "WORLD_SIZE": "2", **_TR}, "RANK=-1 is outside"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0: must be >= 1"),  # was an optim "global batch 0" line
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", **_TR}, "LOCAL_RANK=2 is outside"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
    # torch's env:// rendezvous raised a traceback for these
    ({"RANK": "0", "WORLD_SIZE": "2"}, "not MASTER_ADDR or MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "not MASTER_PORT"),
    # half of the pair: the process trained alone on the whole data set without a word
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4 is set but RANK is not"),
    ({**_SRUN, "SLURM_PROCID": "3", "SLURM_NTASKS": "2", "SLURM_NODELIST": "a,b"}, "SLURM_PROCID=3 is outside"),
    ({**_SRUN, "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3", "SLURM_TASKS_PER_NODE": "2(x2)",
      "SLURM_NODELIST": "n[1-2]"}, "SLURM_LOCALID=3 is outside"),
    ({**_SRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[2-1]"}, "range '2-1'"),  # IndexError
    ({**_SRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-2"}, "unbalanced"),  # host 'n1-2'
    ({**_SRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-]"}, "range '1-'"),  # host 'n1'
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, "without SLURM_JOB_ID"),  # trained alone
])
def test_inconsistent_launch_variables_are_one_line(environ, says):
    with pytest.raises(ConfigError) as e:
        distributed.detect_env(environ)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("launch", ["srun", "env"])
def test_a_rendezvous_port_in_use_is_one_line(launch, monkeypatch):
    """Rank 0 of an srun job (tcp://) or of hand-set torchrun variables (env://) whose MASTER_PORT another
    process holds: was torch's DistNetworkError traceback (exit 1)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_JOB_ID", "SLURM_PROCID"):
            monkeypatch.delenv(k, raising=False)
        if launch == "srun":
            for k, v in {**_SRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "127.0.0.1"}.items():
                monkeypatch.setenv(k, v)
        else:
            for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
                monkeypatch.setenv(k, v)
        monkeypatch.setenv("MASTER_PORT", port)
        with pytest.raises(ConfigError, match=f"MASTER_PORT {port} on 127.0.0.1 is in use"):
            distributed.init("cpu", timeout_s=20)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("rank, says", [
    (1, "rank 1 could not reach the rendezvous at 127.0.0.1:{port} within 1 s (train.dist_timeout_s"),
    (0, "rank 0: not every rank joined the rendezvous at 127.0.0.1:{port} within 1 s (train.dist_timeout_s"),
])
def test_a_rendezvous_the_other_ranks_never_reach_is_one_line(rank, says, monkeypatch):
    """An srun task whose peers never came (rank 0 stopped on a taken MASTER_PORT, a rank that never started):
    after train.dist_timeout_s it was torch's DistNetworkError (rank 1: nobody listens) or DistStoreError (rank 0:
    '1/2 clients joined') traceback, exit 1."""
    port = free_port()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {**_SRUN, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_NODELIST": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        distributed.init("cpu", timeout_s=1)
    assert str(e.value).startswith(says.format(port=port)) and "\n" not in str(e.value), str(e.value)
    assert not torch.distributed.is_initialized()


@pytest.mark.dist
def test_a_gloo_interface_this_host_lacks_is_one_line():
    """GLOO_SOCKET_IFNAME=eth9 on a host without it: was gloo's enforce-fail traceback on every rank."""
    code = ("import sys\nfrom fastvision import distributed\nfrom fastvision.errors import ConfigError\n"
            "try:\n    distributed.init('cpu', timeout_s=60)\nexcept ConfigError as e:\n"
            "    print(e, file=sys.stderr)\n    sys.exit(2)\n")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, env=clean_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                       MASTER_PORT=port, GLOO_SOCKET_IFNAME="fvnoif9"))
             for r in range(2)]
    for p, (_, err) in zip(procs, communicate_all(procs, timeout=120), strict=True):
        assert p.returncode == 2, err[-2000:]
        assert err.strip().startswith("GLOO_SOCKET_IFNAME=fvnoif9: no such network interface on this host"), err


def test_nproc_from_the_shell_of_a_multi_task_allocation_launches_its_own_workers():
    """``salloc -n 2`` then ``fastvision train --nproc 2``: refused as 'not started by srun' (the line itself
    suggested torchrun, which --nproc is); --nproc starts the tasks, so none trains alone. Without --nproc, or
    inside an srun task, the rules stay."""
    shell = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n1"}
    assert distributed.outer_launcher(2, shell) == "single"
    with pytest.raises(ConfigError, match="--nproc N"):
        distributed.outer_launcher(1, shell)
    task = {**shell, "SLURM_PROCID": "1", "SLURM_STEP_ID": "0"}
    assert distributed.outer_launcher(2, task) == "slurm"  # under srun --nproc is unused, as before
    with pytest.raises(ConfigError, match="SLURM_PROCID=3"):
        distributed.outer_launcher(2, {**task, "SLURM_PROCID": "3"})


@pytest.mark.parametrize("environ", [{"RANK": "0"}, {"WORLD_SIZE": "1"}, {"RANK": "0", "WORLD_SIZE": "1"}])
def test_a_single_process_pair_half_is_harmless(environ):
    assert distributed.detect_env(environ).world_size == 1


@pytest.mark.parametrize("nodelist,hosts", [
    ("localhost", ["localhost"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("r[1-2]n[3,5]", ["r1n3", "r1n5", "r2n3", "r2n5"]),
    ("x[9-10]-ib", ["x9-ib", "x10-ib"]),
    ("n[1-2],m[003-004]", ["n1", "n2", "m003", "m004"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert distributed.expand_nodelist(nodelist) == hosts


def test_single_process_helpers_are_identities():
    t = torch.tensor([1.0, 2.0])
    assert distributed.all_reduce_sum(t) is t and t.tolist() == [1.0, 2.0]
    assert distributed.gather_objects({"a": 1}) == [{"a": 1}]
    assert distributed.broadcast_object(7) == 7
    assert (distributed.rank(), distributed.world_size(), distributed.is_main()) == (0, 1, True)
    env, dev = distributed.init("cpu")
    assert env == distributed.DistEnv() and dev == torch.device("cpu")
    m = torch.nn.Linear(2, 2)
    assert distributed.wrap_model(m, dev) is m and distributed.unwrap(m) is m
    with distributed.no_sync(m):
        pass
    distributed.barrier()
    distributed.shutdown()


def test_unwrap_strips_compile_wrapper():
    m = torch.nn.Linear(2, 2)
    fake_compiled = torch.nn.Module()
    fake_compiled._orig_mod = m  # the attribute torch.compile's OptimizedModule exposes
    assert distributed.unwrap(fake_compiled) is m


# --------------------------------------------------------------------------- samplers


@pytest.mark.parametrize("n", [0, 1, 2, 5, 7, 10, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_eval_sampler_covers_every_index_once(n, world):
    shards = [list(distributed.EvalSampler(n, num_replicas=world, rank=r)) for r in range(world)]
    assert sorted(i for s in shards for i in s) == list(range(n))
    lengths = [len(s) for s in shards]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == [len(distributed.EvalSampler(n, num_replicas=world, rank=r)) for r in range(world)]
    # contiguous: concatenation in rank order is the natural order
    assert [i for s in shards for i in s] == list(range(n))


def test_eval_sampler_hand_case():
    assert [list(distributed.EvalSampler(7, num_replicas=3, rank=r)) for r in range(3)] == [[0, 1], [2, 3], [4, 5, 6]]


@pytest.mark.parametrize("n,world", [(8, 2), (12, 4), (7, 2), (5, 4), (3, 4), (10, 3)])
def test_train_sampler_shards(n, world):
    shards = [list(distributed.TrainSampler(n, num_replicas=world, rank=r, seed=3)) for r in range(world)]
    per_rank = -(-n // world)
    assert all(len(s) == per_rank for s in shards)
    flat = [i for s in shards for i in s]
    assert set(flat) == set(range(n))  # every sample seen
    if n % world == 0:
        assert len(set(flat)) == len(flat)  # disjoint
    else:
        assert len(flat) - len(set(flat)) == per_rank * world - n  # only the wrap-around repeats


@pytest.mark.parametrize("n,world", [(10, 2), (12, 3)])
def test_train_sampler_deterministic_in_seed_and_epoch(n, world):
    def shards(seed, epoch):
        out = []
        for r in range(world):
            s = distributed.TrainSampler(n, num_replicas=world, rank=r, seed=seed)
            s.set_epoch(epoch)
            out.append(list(s))
        return out

    assert shards(0, 1) == shards(0, 1)
    assert shards(0, 1) != shards(0, 2)
    assert shards(0, 1) != shards(1, 1)
    assert shards(0, 1) != shards(1, 0)  # seed + epoch would collide here


@pytest.mark.parametrize("n,world,batch", [(16, 2, 4), (24, 4, 3), (18, 3, 2)])
def test_train_sampler_global_batches_match_one_process(n, world, batch):
    """Ranks' k-th batches together form the k-th batch of one process with world x the batch."""
    one = distributed.TrainSampler(n, num_replicas=1, rank=0, seed=11)
    one.set_epoch(4)
    ref = list(one)
    per_rank = []
    for r in range(world):
        s = distributed.TrainSampler(n, num_replicas=world, rank=r, seed=11)
        s.set_epoch(4)
        per_rank.append(list(s))
    for k in range(n // (batch * world)):
        together = sorted(i for s in per_rank for i in s[k * batch:(k + 1) * batch])
        assert together == sorted(ref[k * batch * world:(k + 1) * batch * world])


def test_train_sampler_drop_last_and_no_shuffle():
    s = [list(distributed.TrainSampler(7, num_replicas=2, rank=r, shuffle=False, drop_last=True)) for r in range(2)]
    assert s == [[0, 2, 4], [1, 3, 5]]


def _epoch_batches(n: int, world: int, batch: int, monkeypatch) -> list[list[list[int]]]:
    """Each rank's training batches of one epoch, from the sampler ``train`` builds (engine.build.train_sampler)
    in a job of ``world`` ranks, with the loader's drop_last rule (make_loader)."""
    from fastvision import config
    from fastvision.distributed import samplers
    from fastvision.engine.build import train_sampler

    cfg = config.load("unet2d-microscopy", [])
    out = []
    for r in range(world):
        monkeypatch.setattr(samplers, "world_size", lambda: world)
        monkeypatch.setattr(samplers, "rank", lambda r=r: r)
        s = train_sampler(n, cfg, batch)
        s.set_epoch(3)
        idx = list(s)
        assert len(idx) == len(s)
        full = len(idx) // batch * batch if len(idx) >= batch else len(idx)
        out.append([idx[i:i + batch] for i in range(0, full, batch)])
    return out


@pytest.mark.parametrize("n,world,batch", [(31, 2, 4), (7, 2, 4), (33, 2, 4), (32, 3, 4), (23, 3, 2), (5, 4, 2)])
def test_training_epoch_reads_each_item_once_as_one_process_at_the_global_batch(n, world, batch, monkeypatch):
    """31 items, 2 ranks x 4: the padded shards (16 each) made a 4th global batch whose last item repeated the
    epoch's first, where one process at batch 8 trains 3 batches. Now the k-th batches of the ranks together are
    the k-th batch of one process at the global batch, no item twice, the same number of steps."""
    ranks = _epoch_batches(n, world, batch, monkeypatch)
    (one,) = _epoch_batches(n, 1, batch * world, monkeypatch)
    assert {len(b) for b in ranks} == {len(one)}  # every rank takes the one process's number of steps
    seen = [i for b in ranks for step in b for i in step]
    assert len(seen) == len(set(seen))
    for k, together in enumerate(zip(*ranks, strict=True)):
        assert sorted(i for step in together for i in step) == sorted(one[k])


# --------------------------------------------------------------------------- real 2-rank jobs




def _check_results(out: Path, world: int, launcher: str) -> None:
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(results):
        assert res["env"]["rank"] == r and res["env"]["world_size"] == world
        assert res["env"]["launcher"] == launcher
        assert res["sum"] == sum(range(1, world + 1))
        assert res["gathered"] == [f"r{i}" for i in range(world)]
        assert res["broadcast"] == "from-0"
        assert res["grad_max_err"] < 1e-6
        assert res["eval_sums"] == res["eval_sums_ref"]
    assert results[0]["weights"] == results[1]["weights"]  # DDP keeps replicas identical


def _srun_workers(tmp_path: Path, job_id: str, *mode: str, stdout: int = subprocess.PIPE,
                  **slurm: str) -> list[subprocess.Popen]:
    """Two workers of this file (``mode`` as in ``__main__``) under hand-made ``srun`` variables of
    job ``job_id`` on this host, plus the ``slurm`` ones; stderr piped."""
    port = free_port()
    procs = []
    for r in range(2):
        env = clean_env()
        env.update(SLURM_JOB_ID=job_id, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS="2",
                   SLURM_STEP_ID="0", SLURM_NODELIST="localhost", MASTER_PORT=str(port), **slurm)
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(tmp_path), *mode],
                                      cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.dist
def test_two_rank_slurm_srun_variables(tmp_path):
    procs = _srun_workers(tmp_path, "4242", SLURM_NODEID="0", SLURM_TASKS_PER_NODE="2")
    errs = [err for _, err in communicate_all(procs, timeout=180)]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for e in errs)
    _check_results(tmp_path, 2, "slurm")


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raises TimeoutError in what runs in this (main) thread past ``seconds``: a hang fails the test
    (a subprocess it waits for is then killed by ``subprocess.run``)."""
    import signal

    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def launch_here(argv: list[str], err_file: Path, timeout: float = 180) -> tuple[int, str]:
    """``distributed.launch_local(2, argv)`` (the code behind ``--nproc``), called in this process: the
    launcher's exit code and what it and its workers wrote to stderr (kept in ``err_file``). Running past
    ``timeout`` seconds (a hang) fails the test.

    In this process, not through a ``python -c`` of its own: that one would only import torch (seconds of
    CPU) to start the same torchrun process with the same arguments and the same environment."""
    saved = os.dup(2)
    try:
        with time_limit(timeout), err_file.open("w") as err:  # the launcher's stderr: to the file meanwhile
            os.dup2(err.fileno(), 2)
            rc = distributed.launch_local(2, argv, environ=clean_env())
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return rc, err_file.read_text()


def _launch(out: Path, mode: str, timeout: float = 180) -> tuple[int, str]:
    """:func:`launch_here` running this file's ``mode`` worker, its results in ``out``."""
    return launch_here([str(Path(__file__).resolve()), str(out), mode], out / f"{mode}.stderr", timeout)


def run_once(tmp_path_factory, name: str, make):
    """``make(folder)`` (its result JSON-able, its files in ``folder``) run once in the whole test run,
    however many test modules and pytest-xdist workers ask for it: the first one runs it under a file
    lock, the others wait for it and read its result. Returns ``(folder, result)``."""
    import filelock

    run_id, base = os.environ.get("PYTEST_XDIST_TESTRUNUID"), tmp_path_factory.getbasetemp()
    folder = base.parent / f"{name}-{run_id}" if run_id else base / name  # shared by this run's workers
    with filelock.FileLock(f"{folder}.lock"):
        done = folder / "result.json"
        if not done.exists():
            folder.mkdir(exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix="try-", dir=folder))  # after a failed try: a clean folder
            done.write_text(json.dumps({"folder": str(work), "result": make(work)}))
        res = json.loads(done.read_text())
        return Path(res["folder"]), res["result"]


@pytest.fixture(scope="module")
def two_rank_job(tmp_path_factory) -> tuple[Path, int, str]:
    """One ``launch_local`` job of 2 ranks that does what the next four tests check (its results folder,
    exit code and stderr): the collectives, a DDP step and a sharded metric (``rank{r}.json``), BatchNorm
    training vs emulated workers (``emu0.json``), the fp16 comm hook (``hook{r}.json``), and ends the way
    the teardown test needs (``teardown{r}.json``). One job instead of four: 4 torch imports, not 16."""
    out, (rc, err) = run_once(tmp_path_factory, "two_rank_job", lambda out: _launch(out, "job"))
    return out, rc, err


@pytest.mark.dist
def test_launch_local_two_workers(two_rank_job):
    out, rc, err = two_rank_job
    assert rc == 0, err[-3000:]
    _check_results(out, 2, "torchrun")


@pytest.mark.dist
def test_emulated_workers_match_two_rank_ddp(two_rank_job):
    out, rc, err = two_rank_job
    assert rc == 0, err[-3000:]
    res = json.loads((out / "emu0.json").read_text())
    assert res["emulated_rel"] <= 1e-5
    # the same global batch through one BatchNorm is a different model: emulation is not a no-op
    assert res["naive_rel"] > 1e-3


@pytest.mark.dist
def test_dead_rank_fails_the_job_naming_it(tmp_path):
    rc, err = _launch(tmp_path, "die", timeout=60)  # TimeoutError (a hang) fails the test
    assert rc == 7  # the worker's own exit status, not torchrun's 1
    assert "fastvision: rank 1 exited with code 7 first" in err and "ChildFailedError" not in err, err[-3000:]


@pytest.mark.dist
def test_dead_rank_under_srun_variables_does_not_hang(tmp_path):
    """No torchrun watchdog here: gloo itself must raise on the survivor when its peer vanishes."""
    procs = _srun_workers(tmp_path, "7", "die", stdout=subprocess.DEVNULL)
    codes = []
    for p in procs:
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("surviving rank hung after its peer died")
        codes.append(p.returncode)
    assert codes[1] == 7 and codes[0] != 0


def test_horovod_missing_is_an_actionable_error():
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="make horovod.*ddp"):
            distributed.horovod()
    else:
        pytest.skip("horovod is installed")


@pytest.mark.parametrize("argv,expected", [
    (["train", "r", "--nproc", "2", "--set", "a=1"], ["train", "r", "--set", "a=1"]),
    (["train", "--nproc=4", "r"], ["train", "r"]),
    (["train", "r"], ["train", "r"]),
])
def test_strip_option(argv, expected):
    assert distributed.strip_option(argv, "--nproc") == expected


@pytest.mark.parametrize("n,workers,b", [(11, 2, 2), (16, 4, 2), (9, 3, 1)])
def test_emulation_order_matches_rank_batches(n, workers, b):
    """Emulated micro-batch (j, w) is rank w's j-th batch of a real job with the same seed."""
    emu = distributed.TrainSampler(n, num_replicas=1, rank=0, seed=1, emulate_workers=workers, batch_size=b)
    emu.set_epoch(3)
    got = list(emu)
    assert len(got) == len(emu)
    real = []
    for r in range(workers):
        s = distributed.TrainSampler(n, num_replicas=workers, rank=r, seed=1)
        s.set_epoch(3)
        real.append(list(s))
    full = len(real[0]) // b
    want = [i for j in range(full) for w in range(workers) for i in real[w][j * b:(j + 1) * b]]
    assert got == want


def _worker(out: Path) -> None:
    """One rank of a real job: collectives, a DDP step, an EvalSampler-sharded metric."""
    torch.set_num_threads(1)
    env, device = distributed.init("cpu", timeout_s=60)
    _collectives(out, env, device)
    distributed.shutdown()


def _collectives(out: Path, env: distributed.DistEnv, device: torch.device) -> None:
    """What :func:`_worker` checks, in a joined process group (``rank{r}.json``)."""
    r, w = distributed.rank(), distributed.world_size()
    res: dict = {"env": {"rank": env.rank, "world_size": env.world_size, "launcher": env.launcher}}
    res["sum"] = distributed.all_reduce_sum(torch.tensor([float(r + 1)], dtype=torch.float64)).item()
    res["gathered"] = distributed.gather_objects(f"r{r}")
    res["broadcast"] = distributed.broadcast_object("from-0" if r == 0 else "wrong", src=0)

    # DDP gradient == plain autograd on the concatenated global batch (equal per-rank batches).
    g = torch.Generator().manual_seed(0)
    x_all, y_all = torch.randn(4 * w, 3, generator=g), torch.randn(4 * w, 2, generator=g)
    torch.manual_seed(1)
    ref = torch.nn.Linear(3, 2)
    model = distributed.wrap_model(torch.nn.Linear(3, 2), device, bucket_cap_mb=1.0)
    distributed.unwrap(model).load_state_dict(ref.state_dict())
    idx = list(distributed.TrainSampler(4 * w, shuffle=False))
    torch.nn.functional.mse_loss(model(x_all[idx]), y_all[idx]).backward()
    torch.nn.functional.mse_loss(ref(x_all), y_all).backward()
    res["grad_max_err"] = max((a.grad - b.grad).abs().max().item()
                              for a, b in zip(distributed.unwrap(model).parameters(), ref.parameters(), strict=True))
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    res["weights"] = [p.detach().tolist() for p in distributed.unwrap(model).parameters()]

    # Odd-sized validation set: per-rank sums reduced == whole-set sums (no padding duplicates).
    n_val = 7
    vals = torch.arange(n_val, dtype=torch.float64)
    sums = torch.zeros(2, dtype=torch.float64)
    for i in distributed.EvalSampler(n_val):
        sums += torch.stack([vals[i], torch.ones((), dtype=torch.float64)])
    res["eval_sums"] = distributed.all_reduce_sum(sums).tolist()
    res["eval_sums_ref"] = [vals.sum().item(), float(n_val)]

    distributed.barrier()
    (out / f"rank{r}.json").write_text(json.dumps(res))


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3, padding=1), torch.nn.BatchNorm2d(3), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(3 * 16, 2))


def _bn_data(n: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return torch.randn(n, 1, 4, 4, generator=g), torch.randn(n, 2, generator=g)


def _sgd_epochs(model, batches_per_step, x, y, epochs_batches) -> list[list]:
    """Plain training: each step averages ``batches_per_step`` micro-batch losses, then SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for batches in epochs_batches:
        for k in range(0, len(batches) - batches_per_step + 1, batches_per_step):
            for idx in batches[k:k + batches_per_step]:
                (torch.nn.functional.mse_loss(model(x[idx]), y[idx]) / batches_per_step).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in distributed.unwrap(model).parameters()]


def _batches(sampler, epoch: int, b: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    idx = list(sampler)
    return [idx[i:i + b] for i in range(0, len(idx) - b + 1, b)]


def _emulation(out: Path, env: distributed.DistEnv, device: torch.device) -> None:
    """2-rank DDP training of a BatchNorm model vs --emulate-workers 2 (and vs a naive big batch)."""
    x, y, b = *_bn_data(), 2
    ddp = distributed.wrap_model(_bn_model(), device)
    sampler = distributed.TrainSampler(len(x), seed=5)
    ddp_w = _sgd_epochs(ddp, 1, x, y, [_batches(sampler, e, b) for e in range(2)])
    res = {}
    if env.rank == 0:
        emu = distributed.TrainSampler(len(x), num_replicas=1, rank=0, seed=5, emulate_workers=2, batch_size=b)
        emu_w = _sgd_epochs(_bn_model(), 2, x, y, [_batches(emu, e, b) for e in range(2)])
        one = distributed.TrainSampler(len(x), num_replicas=1, rank=0, seed=5)
        naive_w = _sgd_epochs(_bn_model(), 1, x, y, [_batches(one, e, 2 * b) for e in range(2)])
        rel = lambda ws: max(((a - c).norm() / c.norm()).item() for a, c in zip(ws, ddp_w, strict=True))  # noqa: E731
        res = {"emulated_rel": rel(emu_w), "naive_rel": rel(naive_w)}
    (out / f"emu{env.rank}.json").write_text(json.dumps(res))
    distributed.barrier()  # rank 1 must not tear down gloo while rank 0 is still running the references


def _hook(out: Path, env: distributed.DistEnv, device: torch.device) -> None:
    """DDP with ``ddp_comm_hook: fp16`` (gloo reduces fp16, not bf16): gradients equal the plain
    global-batch gradients to fp16 precision, and the fp32 all-reduce's exactly."""
    g = torch.Generator().manual_seed(0)
    x_all, y_all = torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)
    torch.manual_seed(1)
    ref = torch.nn.Linear(3, 2)
    torch.nn.functional.mse_loss(ref(x_all), y_all).backward()
    idx = list(distributed.TrainSampler(8, shuffle=False))
    res = {}
    for hook in ("none", "fp16"):
        model = distributed.wrap_model(torch.nn.Linear(3, 2), device, comm_hook=hook)
        distributed.unwrap(model).load_state_dict(ref.state_dict())
        torch.nn.functional.mse_loss(model(x_all[idx]), y_all[idx]).backward()
        res[hook] = max(((a.grad - b.grad).abs() / b.grad.abs().clamp(min=1e-3)).max().item()
                        for a, b in zip(distributed.unwrap(model).parameters(), ref.parameters(), strict=True))
        res[hook + "_fp16_exact"] = all(torch.equal(a.grad, a.grad.half().float())
                                        for a in distributed.unwrap(model).parameters())
    try:
        distributed.wrap_model(torch.nn.Linear(3, 2), device, comm_hook="bf16")
    except ConfigError as e:
        res["bf16_error"] = str(e)
    try:  # SyncBatchNorm on CPU ranks: torch's ValueError deep in DDP's constructor before
        distributed.wrap_model(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2)), device,
                               sync_bn=True)
        res["sync_bn_error"] = None
    except ConfigError as e:
        res["sync_bn_error"] = str(e)
    res["sync_bn_without_bn"] = type(distributed.wrap_model(torch.nn.Linear(3, 2), device, sync_bn=True)).__name__
    (out / f"hook{env.rank}.json").write_text(json.dumps(res))
    distributed.barrier()


@pytest.mark.dist
def test_fp16_comm_hook_all_reduces_half_precision_gradients(two_rank_job):
    out, rc, err = two_rank_job
    assert rc == 0, err[-3000:]
    for r in range(2):
        res = json.loads((out / f"hook{r}.json").read_text())
        assert res["none"] < 1e-5 and not res["none_fp16_exact"]  # fp32 all-reduce
        assert 1e-6 < res["fp16"] < 2e-3 and res["fp16_fp16_exact"]  # gradients went through fp16
        if "bf16_error" in res:  # torch 2.13 refuses the bf16 hook on gloo (2.4 and 2.14 register it): one line
            assert res["bf16_error"].startswith("train.ddp_comm_hook: bf16 is not available here")


@pytest.mark.dist
def test_sync_bn_on_cpu_ranks_is_one_config_line(two_rank_job):
    """``train.sync_bn: true`` on gloo CPU ranks is a ConfigError naming the key (exit 2), not torch's ValueError
    traceback from every rank; a model without BatchNorm still wraps (nothing to convert)."""
    out, rc, err = two_rank_job
    assert rc == 0, err[-3000:]
    for r in range(2):
        res = json.loads((out / f"hook{r}.json").read_text())
        assert res["sync_bn_error"].startswith("train.sync_bn: torch's SyncBatchNorm runs on CUDA devices only")
        assert res["sync_bn_without_bn"] == "DistributedDataParallel"


@pytest.mark.dist
def test_gloo_threads_are_joined_before_the_interpreter_exits(two_rank_job):
    """gloo's worker threads outlive destroy_process_group; one that asks for the GIL once the
    interpreter finalizes (in a run: to release a work that holds backward's autograd context; here:
    a future's callback) ends the process with SIGABRT ("terminate called without an active
    exception"). distributed.shutdown joins them before. (The job's end, after its other checks.)"""
    out, rc, err = two_rank_job
    assert rc == 0, err[-3000:]  # not SIGABRT
    for r in range(2):
        seen = json.loads((out / f"teardown{r}.json").read_text())
        if seen["at_exit"] is None:
            pytest.skip("no /proc/self/task to count threads in")
        if "old_torch" in seen:
            pytest.skip(f"torch {seen['old_torch']}: the forced late callback would hang shutdown (before 2.5)")
        assert seen["before_shutdown"] > 0  # torch still names them pt_gloo_runloop: the count means something
        assert seen["at_exit"] == 0, seen
        if r == 0:  # its callback ran on a gloo thread: the case the join is for was exercised
            assert seen["late_inline"] is False, seen


@pytest.mark.dist
def test_shutdown_after_an_error_does_not_wait_for_a_stuck_collective(tmp_path):
    rc, err = _launch(tmp_path, "stuck", timeout=120)
    assert rc == 0, err[-3000:]
    assert json.loads((tmp_path / "stuck0.json").read_text())["shutdown_s"] < 10


def _dying_worker(out: Path) -> None:
    """Rank 1 dies after the first collective; rank 0 keeps reducing and must not hang."""
    torch.set_num_threads(1)
    env, _ = distributed.init("cpu", timeout_s=600)  # longer than the test allows: failure must come sooner
    distributed.all_reduce_sum(torch.ones(1))
    if env.rank == 1:
        os._exit(7)
    for _ in range(10_000):
        distributed.all_reduce_sum(torch.ones(1))
        import time
        time.sleep(0.01)


def _wait_for(path: Path, seconds: float) -> None:
    """Until ``path`` exists (another rank's signal), or ``seconds`` have passed."""
    import time

    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _gloo_threads() -> int | None:
    """gloo's worker threads alive in this process (torch names them ``pt_gloo_runloop``); None without /proc."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    names = []
    for t in tasks:
        try:
            names.append(Path(f"/proc/self/task/{t}/comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("pt_gloo_runloop")


class _SlowFinalizer:
    """Held by this module: its ``__del__`` runs while the interpreter finalizes and keeps it there a
    moment (GIL released), so a gloo thread that asks for the GIL then does so during finalization."""

    def __del__(self):
        import time

        time.sleep(0.6)


def _job_worker(out: Path) -> None:
    """One rank of the job the ``two_rank_job`` tests share: :func:`_collectives`, :func:`_emulation`,
    :func:`_hook`, then the end :func:`_teardown` checks."""
    import atexit

    torch.set_num_threads(1)
    seen: dict = {}
    atexit.register(lambda: (out / f"teardown{seen['rank']}.json").write_text(json.dumps(
        {**seen, "at_exit": _gloo_threads()})))  # registered before any of dist's: runs after them
    env, device = distributed.init("cpu", timeout_s=60)
    seen["rank"] = env.rank
    _collectives(out, env, device)
    _emulation(out, env, device)
    _hook(out, env, device)
    _teardown(out, env, device, seen)


def _teardown(out: Path, env: distributed.DistEnv, device: torch.device, seen: dict) -> None:
    """A good run's end (DDP step, barrier, shutdown) with a gloo worker thread that needs the GIL after
    the caller has finished: the exit must be clean (not SIGABRT), gloo's threads joined before the
    interpreter finalizes. ``seen`` (with this ``rank``) is written by an ``atexit`` function registered
    before the process group was joined."""
    import atexit
    import threading
    import time

    import torch.distributed as tdist

    model = distributed.wrap_model(torch.nn.Linear(3, 2), device)
    model(torch.randn(4, 3)).sum().backward()  # DDP's all-reduce works hold backward's context
    distributed.barrier()
    main_done = threading.Event()

    def late(fut):  # runs on the gloo thread that ran the all-reduce (after the barrier: none waits for it)
        if threading.current_thread() is threading.main_thread():
            # the work was done before .then(): torch runs the callback inline, here; waiting for
            # main_done (set at exit) would wait for ever
            seen["late_inline"] = True
            return fut.value()
        seen["late_inline"] = False
        main_done.wait()
        time.sleep(0.2)  # wakes while the interpreter finalizes, unless the thread is joined first
        return fut.value()

    from fastvision.optim.torch_private import torch_version

    if torch_version() < (2, 5):
        # torch < 2.5 frees the group in shutdown() with the GIL held: a gloo thread that needs the GIL
        # then (this callback) waits for ever (docs/distributed.md, "torch before 2.5")
        seen["old_torch"] = torch.__version__
        distributed.shutdown()
        return
    # rank 0 attaches its callback before rank 1 joins the all-reduce, so rank 0's cannot be done
    # yet: its callback runs on a gloo thread however loaded the machine is
    attached = out / "attached"
    if env.rank == 1:
        _wait_for(attached, 60)
    tdist.all_reduce(torch.ones(1), async_op=True).get_future().then(late)
    if env.rank == 0:
        attached.write_text("")
    seen["before_shutdown"] = _gloo_threads()
    distributed.shutdown()
    atexit.register(main_done.set)  # registered after shutdown's: runs before it
    globals()["_slow"] = _SlowFinalizer()


def _stuck_worker(out: Path) -> None:
    """Rank 0 leaves after an error with a collective its peer never joins: shutdown(join_threads=False)
    returns at once (joining would wait for the collective's timeout)."""
    import time

    import torch.distributed as tdist

    torch.set_num_threads(1)
    env, _ = distributed.init("cpu", timeout_s=60)
    distributed.barrier()
    if env.rank == 0:
        tdist.all_reduce(torch.ones(1), async_op=True)  # rank 1 never takes part
        t0 = time.monotonic()
        distributed.shutdown(join_threads=False)
        (out / "stuck0.json").write_text(json.dumps({"shutdown_s": time.monotonic() - t0}))
        # rank 1 leaves now, while this rank exits: the way the CLI ends (its exit code, no SIGABRT
        # from the stuck thread meeting the closed connection as the interpreter finalizes)
        distributed.exit_process(0)
    else:  # alive (connected) until rank 0 has left, or the test's limit
        _wait_for(out / "stuck0.json", 50)
        os._exit(0)


def _compile_worker(out: Path) -> None:
    """``train.compile: auto`` in a 2-rank job: rank 0 compiles (dynamo with its eager backend: a real
    trace), rank 1's backend raises (a real compile error); then ``AutoCompile``'s calls up to and past its
    decision, which is a collective. Writes each rank's choice and reason (``compile{r}.json``)."""
    from fastvision.engine.runtime import AutoCompile

    torch.set_num_threads(1)
    env, device = distributed.init("cpu", timeout_s=60)

    def broken(gm, example_inputs):
        raise RuntimeError("this backend cannot compile")

    torch.manual_seed(0)
    # the bare model, as under horovod: dynamo does not trace a gloo DDP wrapper's forward (torch 2.13
    # runs it eagerly, no backend called), so a DDP model would show no compile to fail
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    auto = AutoCompile(model, trial=2, backend="eager" if env.rank == 0 else broken)
    x = torch.randn(4, 3)
    for _ in range(2 + 2 * auto.trial + 2):  # the decision is call 2 + 2 x trial; two calls after it
        auto(x).sum().backward()
    (out / f"compile{env.rank}.json").write_text(json.dumps({"choice": auto.choice, "reason": auto.reason}))
    distributed.shutdown()


@pytest.mark.dist
def test_compile_auto_is_the_jobs_choice_when_one_ranks_compile_fails(tmp_path):
    """Rank 1's compile fails and it goes on eagerly at once; rank 0's works, and at the decision call it
    learns of rank 1's failure and falls back too: no job runs compiled on one rank and eager on another."""
    procs = _srun_workers(tmp_path, "4646", "compile", SLURM_NODEID="0", SLURM_TASKS_PER_NODE="2")
    errs = [err for _, err in communicate_all(procs, timeout=180)]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for e in errs)
    got = [json.loads((tmp_path / f"compile{r}.json").read_text()) for r in range(2)]
    assert got[1]["choice"] == "eager" and "cannot compile" in got[1]["reason"]
    assert got[0] == {"choice": "eager", "reason": "the compile failed on 1 of 2 ranks"}


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else "basic"
    {"basic": _worker, "job": _job_worker, "die": _dying_worker, "stuck": _stuck_worker,
     "compile": _compile_worker}[mode](Path(sys.argv[1]))


@pytest.mark.parametrize("environ,expected", [  # {ppid} / {pid}: this process's, filled in by the test
    ({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3"}, "slurm42.3"),
    ({"SLURM_JOBID": "42"}, "slurm42.0"),
    ({"TORCHELASTIC_RUN_ID": "abc", "MASTER_PORT": "29501"}, "tr{ppid}-29501"),
    ({"LOCAL_WORLD_SIZE": "2"}, "tr{ppid}-"),
    ({}, "p{pid}"),
])
def test_job_key_names_the_job_from_the_launch_environment(environ, expected):
    assert distributed.job_key(environ) == expected.format(ppid=os.getppid(), pid=os.getpid())


def test_torchrun_restart_count_is_read():
    env = distributed.detect_env({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "2", **_TR})
    assert (env.rank, env.world_size, env.restart) == (1, 2, 2)
    assert distributed.detect_env({"RANK": "0", "WORLD_SIZE": "2", **_TR}).restart == 0


@pytest.mark.parametrize("environ, job", [({"SLURM_JOB_ID": "77"}, "77"), ({"SLURM_JOBID": "77"}, "77"),
                                          ({"SLURM_JOB_ID": "78", "SLURM_ARRAY_JOB_ID": "70",
                                            "SLURM_ARRAY_TASK_ID": "3"}, "70_3"), ({}, None)])
def test_the_job_scontrol_requeues(environ, job):
    from fastvision.distributed.env import requeue_job_id

    assert requeue_job_id(environ) == job
