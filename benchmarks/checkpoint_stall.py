"""How long a checkpoint write stalls the training thread: synchronous vs background.

Builds a recipe's run with ``engine.build`` (no dataset: ``data_info={}``), takes one training step
on a synthetic batch so the optimizer has its state, then alternates (``--rounds``) two ways of
writing the same checkpoint (``engine.state.checkpoint_state``) to ``last.pt`` and ``best.pt``:
``atomic_write`` of ``torch.save`` twice in the training thread (what ``fit`` did before issue 10) and
``checkpoint.BackgroundWriter.write`` (what it does now: a CPU snapshot in the training thread, then
serialise + fsync + rename in a thread). The stall is the time until the training thread may go
on; the background write is joined (untimed) before the next round. Prints median stalls, their
ratio and the checkpoint size.

    OMP_NUM_THREADS=2 python benchmarks/checkpoint_stall.py [--recipe resnet50-imagenet] [--rounds 5]
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fastvision import config, engine
from fastvision.engine import checkpoint, runtime
from fastvision.engine.state import checkpoint_state, initial_state, resolved_config
from fastvision.utils.files import atomic_write


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="resnet50-imagenet")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--set", action="append", default=["task.args.image_size=64", "train.batch_size=2"])
    args = p.parse_args()
    cfg = config.load(args.recipe, [config.parse_override(s) for s in args.set])
    cfg.train.device, cfg.train.amp, cfg.train.compile = "cpu", "off", False
    run = engine.build(cfg, data_info={}, train=True)
    engine.train_step(run.step, itertools.repeat(run.task.synthetic_batch(cfg.train.batch_size, run.device)))
    state, resolved = initial_state({}), resolved_config(cfg)
    out = Path(tempfile.mkdtemp(prefix="ckpt-stall-"))
    paths = [out / "last.pt", out / "best.pt"]
    writer = checkpoint.BackgroundWriter()
    sync, background = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        ckpt = checkpoint_state(run, state, resolved, [runtime.rng_state(run.step.generator)])
        for path in paths:
            atomic_write(path, lambda f, ckpt=ckpt: torch.save(ckpt, f))  # called before the loop moves on
        sync.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        writer.write(checkpoint_state(run, state, resolved, [runtime.rng_state(run.step.generator)]), paths)
        background.append(time.perf_counter() - t0)
        writer.join()
    size_mb = paths[0].stat().st_size / 2**20
    print(json.dumps({"recipe": args.recipe, "checkpoint_mb": size_mb, "rounds": args.rounds,
                      "sync_stall_median_s": statistics.median(sync),
                      "background_stall_median_s": statistics.median(background),
                      "ratio_background_over_sync": statistics.median(background) / statistics.median(sync),
                      "torch": torch.__version__}, indent=2))


if __name__ == "__main__":
    main()
