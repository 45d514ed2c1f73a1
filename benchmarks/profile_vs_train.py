"""``fastvision profile`` times the step ``fastvision train`` runs: their median step times agree.

Both run unet2d-microscopy at a small size on the same generated data, in this process, taking
turns (``--rounds``) so machine load falls on both alike. ``train`` logs every step
(``train.log_every=1``: ``step_time_s`` in ``metrics.jsonl``, the interval between two logged
steps); ``profile`` reports the wall time of each profiled step after its warm-up. Prints both
medians and their ratio (target: within 10 %).

    OMP_NUM_THREADS=2 python benchmarks/profile_vs_train.py [--rounds 3] [--size 64] [--batch-size 8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

import fastvision
from fastvision import config
from fastvision.api import overrides_to_dicts
from fastvision.data.synth.microscopy import synth
from fastvision.profiling import profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2, help="train epochs per round")
    p.add_argument("--steps", type=int, default=16, help="profiled steps per round")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="profile-vs-train-"))
    data = synth(tmp / "data", seed=0, count=80, size=args.size)
    flat = {"data": str(data), "batch_size": args.batch_size, "device": "cpu", "examples": 0,
            "data.args.image_size": [args.size, args.size], "model.args.filters": [8, 16, 32, 64],
            "train.log_every": 1, "train.target": None}
    train_steps, profile_steps = [], []
    for r in range(args.rounds):
        run = tmp / f"train-{r}"
        fastvision.train("unet2d-microscopy", out=str(run), epochs=args.epochs, **flat)
        events = [json.loads(line) for line in open(run / "metrics.jsonl")]
        times = [e["data"]["step_time_s"] for e in events if isinstance(e["step"], list) and len(e["step"]) == 2]
        train_steps += times[1:]  # the first step waits for the loader to start, as profile's warm-up does
        report = profile(config.load("unet2d-microscopy", overrides_to_dicts(flat)), steps=args.steps, warmup=3)
        profile_steps.append(report["step_ms"]["p50"] / 1e3)
        print(f"round {r}: train median {statistics.median(times[1:]):.4f} s, profile p50 "
              f"{profile_steps[-1]:.4f} s", flush=True)
    med_train, med_profile = statistics.median(train_steps), statistics.median(profile_steps)
    print(json.dumps({"recipe": "unet2d-microscopy", "size": args.size, "batch_size": args.batch_size,
                      "rounds": args.rounds, "train_median_step_s": med_train,
                      "profile_median_step_s": med_profile, "ratio_profile_over_train": med_profile / med_train,
                      "torch": torch.__version__, "threads": torch.get_num_threads()}, indent=2))


if __name__ == "__main__":
    main()
