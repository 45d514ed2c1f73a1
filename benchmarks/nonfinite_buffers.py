"""What putting the buffers back costs: the per-step copy and select that make a skipped step leave
BatchNorm's running statistics as they were (``engine.step._keep_buffers`` / ``_restore_buffers``).

For each recipe (generated data at CPU sizes, one process), rounds alternate timing ``engine.train_step``
(which runs the copy and the select) and timing the copy + select alone on the same model's buffers,
both on the same batches after a warm-up. Reported: median ms per step, median ms of the buffer
copy + select, their ratio (the share of a step), and the buffers' count and bytes. A ratio, not
the absolute times, is what to read: the CPU is shared.

    OMP_NUM_THREADS=2 python benchmarks/nonfinite_buffers.py [--rounds 5] [--steps 10] [--json out.json]
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
from fastvision.data.synth import load_all
from fastvision.engine.step import _keep_buffers, _restore_buffers

RECIPES = {  # recipe -> (synth kind, synth options, CPU-sized overrides)
    "unet2d-microscopy": ("microscopy", {"count": 20, "size": 64},
                          ["data.args.image_size=[64,64]", "train.batch_size=4"]),
    "resnet18-imagefolder": ("imagenet", {"classes": 3, "per_class": 4, "val_per_class": 1, "size": 72},
                             ["data.args.image_size=64", "data.args.resize_size=72", "task.args.num_classes=3",
                              "model.args.num_classes=3", "train.batch_size=4"]),
    "unet3d-spleen-fast": ("spleen", {"cases": 4, "test_cases": 0, "size": 40},
                           ["data.args.patch_size=[32,32,32]", "task.args.sliding_window.roi_size=[32,32,32]",
                            "data.args.num_folds=2", "data.args.target_spacing=null", "train.batch_size=1",
                            "data.val_batch_size=1"]),
}


def _build(recipe: str, root: Path):
    kind, opts, tiny = RECIPES[recipe]
    data = load_all().get(kind)(root / kind, seed=0, **opts)
    sets = [f"data.args.path={data}", "train.device=cpu", "data.cache=none", "data.num_workers=0", "train.target=null",
            *tiny]
    cfg = config.load(recipe, [config.parse_override(s) for s in sets] + [{"train": {"amp": "off"}}])
    return engine.build(cfg, train=True)


def _time(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def measure(recipe: str, root: Path, rounds: int, steps: int) -> dict:
    run = _build(recipe, root)
    batches = itertools.cycle([b for b, _ in zip(run.train_loader, range(2), strict=False)])  # the first 2 batches
    run.step.model.train()
    for _ in range(3):  # warm-up: lazy optimizer state, allocator
        engine.train_step(run.step, batches)
    module, flag = run.model, torch.zeros(())

    def buffers() -> None:
        _restore_buffers(_keep_buffers(module), flag)

    step_ms, buf_ms = [], []
    for _ in range(rounds):  # interleaved: the same load on the shared CPU for both
        step_ms.append(_time(lambda: engine.train_step(run.step, batches), steps))
        buf_ms.append(_time(buffers, steps * 20))
    bufs = list(module.buffers())
    step, buf = statistics.median(step_ms), statistics.median(buf_ms)
    return {"recipe": recipe, "step_ms": step, "buffers_ms": buf, "share": buf / step, "buffers": len(bufs),
            "buffer_kb": sum(b.numel() * b.element_size() for b in bufs) / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes.split(","):
            rows.append(measure(recipe, Path(tmp), args.rounds, args.steps))
            r = rows[-1]
            print(f"{recipe:24s} step {r['step_ms']:8.2f} ms  buffers copy+select {r['buffers_ms']:7.3f} ms "
                  f"({100 * r['share']:.2f} % of a step)  {r['buffers']} buffers, {r['buffer_kb']:.1f} KB")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
