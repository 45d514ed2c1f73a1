"""What the ranks' stop agreement costs per step: 2 CPU ranks (gloo) under torchrun, with and without it.

Settings, alternated in rounds (the same seed, data and steps), each a real
``torchrun --nproc-per-node 2 -m fastvision.cli train unet2d-microscopy`` at 32x32 (a tiny step,
so a per-step cost shows as much as it can):

* ``none``: ``train.stop_signals=[]`` and no timed checkpoints: nothing can ask for a stop, so no
  agreement is made and no collective issued;
* ``every-10``: the default (SIGTERM, SIGUSR1): one 8-byte all-reduce on the default group every
  ``train.log_every`` (10) steps;
* ``before`` (with ``--before DIR``, a source tree of the previous design, e.g. ``git archive``
  of commit 4f6e98f): a gloo side group made for the agreement and an asynchronous all-reduce
  after every step.

Reported: the median seconds per training step (``train_time_s`` of the summary over the steps
run: build, validation and checkpoints excluded) of each setting and its ratio to ``none``.

``--micro`` isolates the exchange itself, where a shared machine's noise hides it in a whole step:
two gloo ranks run 2000 "steps" of a fixed CPU matmul (0.1 to 0.4 ms here: a worst case), with the tree's own
agreement called after each (``Agreement.at`` every 10 steps here; ``Agreement.exchange`` every
step in the ``--before`` tree) or not at all, in alternating rounds; reported is the median extra
microseconds per step.

    python benchmarks/agreement_cost.py [--rounds 5] [--before /tmp/fastvision-before] [--micro] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETS = ["data.args.image_size=[32,32]", "model.args.filters=[4,8,16]", "data.num_workers=0", "examples=0",
        "data.repeats=25", "train.log_every=10", "train.val_every=1000", "train.seed=0"]


def _run(tree: Path, data: Path, out: Path, extra: list[str]) -> float:
    """Seconds per step of one 2-rank job run from source ``tree``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "fastvision.cli", "train", "unet2d-microscopy", "--data", str(data), "--out", str(out), "--epochs", "1",
           "--device", "cpu", "--batch-size", "2", *[a for s in [*SETS, *extra] for a in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text())
    import torch

    steps = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"]
    return summary["train_time_s"] / steps


MICRO = """
import sys, time, torch, torch.distributed as d
rank, port, mode, steps = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(1)
d.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
from fastvision.distributed.preempt import Agreement
if mode == "before":
    agree = Agreement(300.0)
    call = lambda s: agree.exchange([0, 0])
elif mode == "every-10":
    agree = Agreement("cpu", 10)
    call = lambda s: agree.at(s, [0, 0])
else:
    call = lambda s: None
a = torch.randn(96, 96)
d.barrier()
t = time.perf_counter()
for s in range(1, steps + 1):
    a = torch.tanh(a @ a)  # the step's work
    call(s)
d.barrier()
print((time.perf_counter() - t) / steps)
d.destroy_process_group()
"""


def _micro(tree: Path, mode: str, steps: int = 2000) -> float:
    """Seconds per step of 2 gloo ranks running the step's stand-in with ``mode``'s agreement."""
    with socket.socket() as sock:  # a free port for this pair's process group
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", MICRO, str(r), port, mode, str(steps)], cwd=tree, env=env,
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    return max(float(p.communicate()[0].strip()) for p in procs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--before", type=Path, help="a source tree of the previous design (per-step gloo exchange)")
    p.add_argument("--micro", action="store_true", help="the exchange alone, beside a fixed stand-in step")
    p.add_argument("--json")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from fastvision.data.synth.microscopy import synth

    settings = {"none": (ROOT, ["train.stop_signals=[]"]), "every-10": (ROOT, [])}
    if args.before:
        settings["before"] = (args.before.resolve(), [])
    times: dict[str, list[float]] = {k: [] for k in settings}
    if args.micro:
        return _report_micro(args, settings)
    with tempfile.TemporaryDirectory() as tmp:
        data = synth(Path(tmp) / "data", seed=0, count=40, size=32)  # 32 to train: 8 steps x 25 repeats
        for r in range(args.rounds):
            for name, (tree, extra) in settings.items():
                times[name].append(_run(tree, data, Path(tmp) / f"{name}-{r}", extra))
                print(f"round {r} {name}: {times[name][-1] * 1e3:.2f} ms/step", flush=True)
    base = statistics.median(times["none"])
    rows = {k: {"median_ms": statistics.median(v) * 1e3, "ratio_to_none": statistics.median(v) / base,
                "all_ms": [round(x * 1e3, 3) for x in v]} for k, v in times.items()}
    print(f"{'setting':10} {'ms/step':>9} {'vs none':>8}")
    for k, row in rows.items():
        print(f"{k:10} {row['median_ms']:9.2f} {row['ratio_to_none']:8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                               "rounds": args.rounds, "settings": rows}, indent=2))


def _report_micro(args, settings: dict) -> None:
    times: dict[str, list[float]] = {k: [] for k in settings}
    for r in range(args.rounds):
        for name, (tree, _) in settings.items():
            times[name].append(_micro(tree, name))
            print(f"round {r} {name}: {times[name][-1] * 1e6:.1f} us/step", flush=True)
    base = statistics.median(times["none"])
    rows = {k: {"median_us": statistics.median(v) * 1e6, "extra_us": (statistics.median(v) - base) * 1e6,
                "all_us": [round(x * 1e6, 1) for x in v]} for k, v in times.items()}
    print(f"{'setting':10} {'us/step':>9} {'extra us':>9}")
    for k, row in rows.items():
        print(f"{k:10} {row['median_us']:9.1f} {row['extra_us']:9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "micro": rows}, indent=2))


if __name__ == "__main__":
    main()
