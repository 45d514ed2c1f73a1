"""``fastvision profile`` times the step ``fastvision train`` runs: their median step times agree.

Two runs of unet2d-microscopy at a small size are built by ``engine.build`` from one config on the
same generated data. They take turns, ``--rounds`` times, each turn ``--steps`` steps (plus one
dropped first step, which waits for the loader to restart): ``train`` through
``engine.train_one_epoch`` (fit's epoch loop, logging every step: ``step_time_s``, the interval
between two logged steps) and ``profile`` through ``profiling.profile_run`` (the wall time of each
profiled step). Fine interleaving puts the load of a shared machine on both alike. Prints the
median over all turns of each turn's median step time and their ratio (target: within 10 %).

    OMP_NUM_THREADS=2 python benchmarks/profile_vs_train.py [--rounds 8] [--steps 4] [--size 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from fastvision import config, engine
from fastvision.api import overrides_to_dicts
from fastvision.data.synth.microscopy import synth
from fastvision.engine.log import RunLogger
from fastvision.profiling import profile_run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="timed steps per turn")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="profile-vs-train-"))
    data = synth(tmp / "data", seed=0, count=80, size=args.size)
    flat = {"data": str(data), "batch_size": args.batch_size, "device": "cpu", "epochs": args.rounds,
            "data.args.image_size": [args.size, args.size], "model.args.filters": [8, 16, 32, 64],
            "train.log_every": 1, "train.steps_per_epoch": args.steps + 1}
    cfg = config.load("unet2d-microscopy", overrides_to_dicts(flat))
    train_run, profile_run_ = engine.build(cfg, train=True), engine.build(cfg, train=True)
    logger = RunLogger(tmp, progress=False)
    state = {"step": 0}
    train_medians, profile_medians = [], []
    for r in range(args.rounds):
        train_run.train_loader.set_epoch(r)
        engine.train_one_epoch(train_run, r, state, logger)
        events = [json.loads(line) for line in open(tmp / "metrics.jsonl")]
        times = [e["data"]["step_time_s"] for e in events if e["step"][:1] == [r] and len(e["step"]) == 2]
        train_medians.append(statistics.median(times[1:]))
        report = profile_run(profile_run_, steps=args.steps, warmup=1)
        profile_medians.append(report["step_ms"]["p50"] / 1e3)
        print(f"round {r}: train {train_medians[-1]:.4f} s, profile {profile_medians[-1]:.4f} s", flush=True)
    logger.close()
    med_train, med_profile = statistics.median(train_medians), statistics.median(profile_medians)
    print(json.dumps({"recipe": "unet2d-microscopy", "size": args.size, "batch_size": args.batch_size,
                      "rounds": args.rounds, "steps_per_turn": args.steps, "train_median_step_s": med_train,
                      "profile_median_step_s": med_profile, "ratio_profile_over_train": med_profile / med_train,
                      "torch": torch.__version__, "threads": torch.get_num_threads()}, indent=2))


if __name__ == "__main__":
    main()
