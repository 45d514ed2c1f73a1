"""Engine overhead: fastvision's training step against a minimal hand-written PyTorch loop.

Both loops train the same model (same initial weights), with the same loss module, optimizer,
precision and in-memory batches; only the loop differs. Chunks of steps alternate between the two
(interleaved, so drift in machine load hits both alike). A step's time is the interval between two
successive batch requests, taken by an instrumented in-memory loader, so both loops are timed by
the same clock at the same place. Random augmentation is off: it is work, not overhead.

    python benchmarks/engine_overhead.py [--recipe unet2d-microscopy] [--rounds 6] [--steps 12]

Prints the median step times and their ratio (fastvision / hand-written; target <= 1.03).
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time

import torch

from fastvision import config, engine
from fastvision.engine.log import RunLogger


class TimedBatches:
    """Yields ``steps`` copies of prepared batches and stamps the time of every request."""

    def __init__(self, batches: list[dict], steps: int):
        self.batches, self.steps, self.stamps = batches, steps, []

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for i in range(self.steps):
            self.stamps.append(time.perf_counter())
            yield self.batches[i % len(self.batches)]
        self.stamps.append(time.perf_counter())

    def step_times(self) -> list[float]:
        d = [b - a for a, b in itertools.pairwise(self.stamps)]
        return d[1:]  # the first step of a chunk warms caches


def hand_loop(model, loss_fn, optimizer, scheduler, loader, device, precision) -> None:
    """The minimal loop a user would write: the baseline."""
    model.train()
    for batch in loader:
        x = batch["image"].to(device, non_blocking=True)
        y = (batch["label"] > 0).unsqueeze(1).float().to(device, non_blocking=True)
        with precision.autocast():
            loss = loss_fn(model(x), y)
        precision.scaler.scale(loss).backward()
        precision.scaler.step(optimizer)
        precision.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="unet2d-microscopy")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=12, help="steps per chunk")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--amp", default="off")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()

    cfg = config.load(args.recipe, [{"data": {"augment": {}}, "train": {"device": "cpu", "amp": args.amp,
                                                                         "batch_size": args.batch_size,
                                                                         "steps_per_epoch": args.steps,
                                                                         "epochs": args.rounds}}])
    cfg.data.augment = {}
    # two builds under one seed: the same initial weights; each has its own optimizer and schedule
    fv_run, hw_run = (engine.build(cfg, train=True, loaders=False) for _ in range(2))
    assert fv_run.task.mode == "sigmoid", "this benchmark's hand loop is written for the binary recipe"
    items = [fv_run.train_set[i] for i in range(args.batch_size * 2)]
    batches = [fv_run.task.collate(items[:args.batch_size]), fv_run.task.collate(items[args.batch_size:])]
    logger = RunLogger.__new__(RunLogger)  # a disabled logger: no files, no output
    logger.enabled, logger._progress, logger._task, logger._file, logger._tb = False, None, None, None, None
    state = {"step": 0}
    fv, hw = [], []
    for r in range(args.rounds):
        fv_run.train_loader = TimedBatches(batches, args.steps)
        engine.train_one_epoch(fv_run, r, state, logger)
        fv += fv_run.train_loader.step_times()
        loader = TimedBatches(batches, args.steps)
        hand_loop(hw_run.model, hw_run.task.loss_fn, hw_run.step.optimizer, hw_run.step.scheduler, loader,
                  hw_run.device, hw_run.precision)
        hw += loader.step_times()
    med_fv, med_hw = statistics.median(fv), statistics.median(hw)
    result = {"recipe": args.recipe, "batch_size": args.batch_size, "amp": args.amp, "steps_timed": len(fv),
              "fastvision_median_s": med_fv, "hand_median_s": med_hw, "ratio": med_fv / med_hw,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
