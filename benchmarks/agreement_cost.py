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

    python benchmarks/agreement_cost.py [--rounds 5] [--before /tmp/fastvision-before] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--before", type=Path, help="a source tree of the previous design (per-step gloo exchange)")
    p.add_argument("--json")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from fastvision.data.synth.microscopy import synth

    settings = {"none": (ROOT, ["train.stop_signals=[]"]), "every-10": (ROOT, [])}
    if args.before:
        settings["before"] = (args.before.resolve(), [])
    times: dict[str, list[float]] = {k: [] for k in settings}
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


if __name__ == "__main__":
    main()
