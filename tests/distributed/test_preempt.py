"""The ranks' agreement on a stop, on two real gloo processes: built only when something can ask
for it, exchanged every ``every`` steps on the default group (no group of its own), and every rank
reads the same flags at the same step."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, clean_env, communicate_all, free_port

pytestmark = pytest.mark.dist

WORKER = """
import json, os, signal, sys
from datetime import timedelta
import torch, torch.distributed as d
from fastvision.distributed.preempt import Preemption

rank, cpu = int(sys.argv[1]), torch.device("cpu")
d.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2,
                     timeout=timedelta(seconds=60))
quiet, timed, signalled = Preemption([], every=3), Preemption([], every=3), Preemption(["SIGUSR2"], every=3)
quiet.start(cpu, timed_checkpoints=False)
timed.start(cpu, timed_checkpoints=True)
signalled.start(cpu, timed_checkpoints=False)
out = {"quiet": quiet.agreement is None, "timed": timed.agreement is not None}
if rank == 0:  # on one rank only: a collective here would pair with rank 1's next one and garble it
    out["quiet_steps"] = [quiet.after_step(s, checkpoint=True) for s in range(1, 7)]
with signalled:
    steps = []
    for s in range(1, 8):
        if rank == 1 and s == 2:
            os.kill(os.getpid(), signal.SIGUSR2)
        steps.append(signalled.after_step(s, checkpoint=rank == 0 and s >= 4))
    out.update(steps=steps, now=signalled.agree_now(), stopped=signalled.stopped)
out["groups"] = len(d.distributed_c10d._world.pg_map)
print(json.dumps(out))
d.destroy_process_group()
"""


def test_two_ranks_agree_every_k_steps_only_when_asked_and_on_the_default_group():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(port)], cwd=ROOT, env=clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p, (out, err) in zip(procs, communicate_all(procs, timeout=120), strict=True):
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    no, stop, ckpt = [False, False], [True, False], [True, True]
    for res in outs:
        assert res["quiet"] and res["timed"]  # no stop signals, no clock: nothing to agree on
        assert res["groups"] == 1  # the default group only: no gloo side group
        # rank 1's signal (at step 2) reaches both ranks at step 3; rank 0's wish for a checkpoint (from
        # step 4) at step 6; between multiples of 3 nothing is exchanged
        assert res["steps"] == [no, no, stop, no, no, ckpt, no]
        assert res["now"] == stop and res["stopped"] == 12
    assert outs[0]["quiet_steps"] == [no] * 6
