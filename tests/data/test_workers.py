"""``data.num_workers: auto``: the rule on hand-computed core counts (affinity sets, ranks per node, srun
pinning, torch threads, CPU vs CUDA), resolved in this process, through a real CPU training run (the
number in its config.yaml), in two srun tasks sharing or pinned to the cores, and bad values at the CLI."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import yaml

from fastvision.data.workers import MAX_WORKERS, choose, resolve, share_of
from fastvision.distributed import DistEnv
from fastvision.utils.hostcpu import process_cores
from tests.cli.input_checks import one_line_error, run_cli
from tests.conftest import ROOT, clean_env, cli_here, free_port


def cores(lo: int, hi: int) -> set[int]:
    return set(range(lo, hi))


ALL8 = cores(0, 8)


@pytest.mark.parametrize("mine, node, threads, device, workers", [
    # one process on 8 cores driving a GPU: 8 - 1 for the training thread
    (ALL8, [ALL8], 4, "cuda", 7),
    # torchrun / srun without binding, 2 ranks on one 8-core set: 8 / 2 - 1 each
    (ALL8, [ALL8, ALL8], 1, "cuda", 3),
    # 8 GPU ranks on a 64-core node: 64 / 8 - 1
    (cores(0, 64), [cores(0, 64)] * 8, 1, "cuda", 7),
    # srun --cpu-bind pinned each of 2 tasks to its own 4 cores: the set is already this task's, not halved
    (cores(0, 4), [cores(0, 4), cores(4, 8)], 1, "cuda", 3),
    # pinned to one core each: nothing left beside the training thread
    ({3}, [{0}, {1}, {2}, {3}], 1, "cuda", 0),
    # a NUMA binding: 4 ranks, two per 16-core socket: 16 / 2 - 1
    (cores(16, 32), [cores(0, 16), cores(0, 16), cores(16, 32), cores(16, 32)], 1, "cuda", 7),
    # sets overlapping in 2 cores: 4 own + 2 x 1/2 = 5, - 1
    (cores(0, 6), [cores(0, 6), cores(4, 10)], 1, "cuda", 4),
    # more ranks than cores: a share of 0.5 core is 0
    (cores(0, 2), [cores(0, 2)] * 4, 1, "cuda", 0),
    # a 96-core host, one GPU process: capped at 8 (DLE nnU-Net's default)
    (cores(0, 96), [cores(0, 96)], 1, "cuda", MAX_WORKERS),
    # CPU training: the main process's torch threads compute and keep their cores
    (cores(0, 2), [cores(0, 2)], 2, "cpu", 0),
    (cores(0, 2), [cores(0, 2)], 1, "cpu", 1),
    (cores(0, 16), [cores(0, 16)], 4, "cpu", 8),  # 12 left, capped
    (ALL8, [ALL8, ALL8], 1, "cpu", 3),  # 2 ranks on the CPU, 1 thread each: 4 - 1
    (ALL8, [ALL8, ALL8], 4, "cpu", 0),  # 4 threads each take the share
    (cores(0, 4), [cores(0, 4), cores(4, 8)], 2, "cpu", 2),  # pinned: 4 own - 2 threads
])
def test_the_rule(mine, node, threads, device, workers):
    assert choose(mine, node, threads=threads, device_type=device)[0] == workers


@pytest.mark.parametrize("mine, node, text", [
    (ALL8, [ALL8, ALL8], "8 cores in this process's affinity / 2 ranks on the node, 1 for the main process"),
    (cores(0, 4), [cores(0, 4), cores(4, 8)], "4 cores in this process's affinity, its own (the node's other rank"),
    (cores(0, 6), [cores(0, 6), cores(4, 10)], "shared in part with 1 of the node's other ranks: a share of 5.0"),
    (cores(0, 96), [cores(0, 96)], "96 cores in this process's affinity, 1 for the main process (the GPU computes); "
                                   "at most 8 per process"),
])
def test_the_reason_names_the_cores_and_the_sharing(mine, node, text):
    assert text in choose(mine, node, threads=1, device_type="cuda")[1]


def test_each_core_is_shared_among_the_sets_that_hold_it():
    assert share_of(ALL8, [ALL8] * 4) == 2.0
    assert share_of({0, 1, 2}, [{0, 1, 2}, {2, 3}]) == 2.5  # cores 0, 1 own, core 2 halved


def own_share(ranks: int, threads: int, cuda: bool = False) -> int:
    """Hand-computed: this process's affinity / ranks sharing it, less the main process, in [0, 8]."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0, min(8, n // ranks - (1 if cuda else threads)))


@pytest.mark.parametrize("env, ranks", [(DistEnv(), 1),
                                        # a rank with no collective to make (distributed.alone): the node's 2 share
                                        (DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2), 2)])
def test_resolved_here_from_this_processs_affinity(env, ranks, caplog):
    assert process_cores() == frozenset(os.sched_getaffinity(0))
    with caplog.at_level(logging.INFO, logger="fastvision.data.workers"):
        got = resolve(env, "cpu", threads=1)
    assert got == own_share(ranks, 1)
    line = [r.getMessage() for r in caplog.records if "data.num_workers auto:" in r.getMessage()]
    who = "rank 1: " if ranks > 1 else ""
    assert len(line) == 1 and line[0].startswith(f"{who}data.num_workers auto: {got} (")


TINY = ["--device", "cpu", "--epochs", "1", "--batch-size", "4", "--set", "data.args.image_size=[32,32]",
        "--set", "model.args.filters=[4,8,16]", "--set", "examples=0", "--set", "data.num_workers=auto"]


def test_a_cpu_run_trains_with_its_resolved_workers_and_saves_the_number(tiny_microscopy, tmp_path, capsys):
    out = tmp_path / "run"
    # worker processes: the resolved count is a real DataLoader's
    assert cli_here(["train", "unet2d-microscopy", "--data", str(tiny_microscopy), "--out", str(out), *TINY,
                     "--set", "data.loader=processes"], threads=1) == 0
    want = own_share(1, 1)
    saved = yaml.safe_load((out / "config.yaml").read_text())["data"]["num_workers"]
    assert saved == want and isinstance(saved, int)
    line = [x for x in capsys.readouterr().err.splitlines() if "data.num_workers auto:" in x]
    assert line == [f"fastvision.data.workers: data.num_workers auto: {want} ({len(os.sched_getaffinity(0))} cores "
                    f"in this process's affinity, 1 for the main process's torch thread (the cpu computes)"
                    + ("; the loader's own thread or the main process builds the batches)" if want == 0 else ")")]
    assert (out / "checkpoints" / "last.pt").is_file()


@pytest.mark.parametrize("value, needle", [("-1", "data.num_workers must be >= 0, got -1"),
                                           ("many", "data.num_workers: expected"), ("2.5", "data.num_workers")])
def test_bad_values_are_one_line_naming_the_key(value, needle, tiny_microscopy, tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", "unet2d-microscopy", "--data", tiny_microscopy, "--out", tmp_path / "r",
                           "--device", "cpu", "--set", f"data.num_workers={value}")
    one_line_error(code, err, needle)


def _srun_pair(data, out, pin: bool) -> list[str]:
    """Two tasks of one node under srun's variables (one each on cores 0 and 1 with ``pin``); their stderr."""
    port, procs = free_port(), []
    for r in range(2):
        env = clean_env(SLURM_JOB_ID="4711", SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS="2",
                        SLURM_STEP_ID="0", SLURM_NODEID="0", SLURM_TASKS_PER_NODE="2", SLURM_NODELIST="localhost",
                        MASTER_PORT=str(port))
        pinning = (lambda r=r: os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[r]})) if pin else None
        cmd = [sys.executable, "-m", "fastvision.cli", "train", "unet2d-microscopy", "--data", str(data),
               "--out", str(out), *TINY]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True, preexec_fn=pinning))
    try:
        errs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for e in errs)
    return errs


@pytest.mark.dist
@pytest.mark.skipif(len(process_cores()) < 2, reason="two tasks pinned to a core each need 2 cores")
@pytest.mark.parametrize("pin", [False, True])
def test_two_srun_tasks_each_take_their_share(pin, tiny_microscopy, tmp_path):
    n = len(os.sched_getaffinity(0))
    errs = _srun_pair(tiny_microscopy, tmp_path / "run", pin)
    # shared: the node's 2 tasks halve this set; pinned: each task's one core is its own, not halved again
    want = 0 if pin else own_share(2, 1)
    why = ("1 core in this process's affinity, its own (the node's other rank runs on other cores)" if pin
           else f"{n} cores in this process's affinity / 2 ranks on the node")
    for r, err in enumerate(errs):
        line = [x for x in err.splitlines() if "data.num_workers auto:" in x]
        want_line = f"rank {r}: data.num_workers auto: {want} ({why}, 1 for the main"
        assert len(line) == 1 and want_line in line[0], err[-2000:]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["data"]["num_workers"]
    assert saved == want and (tmp_path / "run" / "checkpoints" / "last.pt").is_file()
