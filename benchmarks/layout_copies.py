"""Layout copies and step time of the 3-D U-Net's engine step on a CPU: stock InstanceNorm vs the
layout-keeping ``instance_cl``, in NCDHW and NDHWC (issue 40).

    python benchmarks/layout_copies.py [--size 32] [--filters 8,16,32] [--batch 2] [--rounds 5] [--steps 3]
    python benchmarks/layout_copies.py --recipe RECIPE.yaml [--rounds 7] [--steps 3]

Each setting is built by ``engine.build`` from ``unet3d-brats`` (fp32, ``up: shuffle``: the CPU's
transposed 3-D conv copies its input, which would blur the norm's share) and stepped by
``engine.train_step`` on a synthetic batch. One step under ``torch.profiler`` counts the copies of
hidden activations (``aten::copy_`` / ``clone`` / ``contiguous`` / ``_to_copy`` of tensors with
the batch and a hidden width), split by where they come from: a convolution op, or anything
else (the norm). Then the settings take turns in ``--rounds`` interleaved rounds of ``--steps``
steps; the table gives each setting's median step time and its ratio to NCDHW stock.

``--recipe``: the same four settings on a recipe's own network, patch and batch (e.g. what ``configure
--trainer nnunet`` writes: a 3-D U-Net with its transposed up-convs and deep supervision), fp32 on the CPU;
only the norm and the layout change.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fastvision import config, engine  # noqa: E402
from fastvision.errors import FastvisionError  # noqa: E402

COPIES = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy")


def build(norm: str, channels_last: bool, size: int, filters: list[int], batch: int, recipe: str | None = None):
    sets = {"model.args.norm": norm, "train.channels_last": channels_last, "train.device": "cpu", "train.amp": "off",
            "train.batch_size": batch, "data.augment": {}}
    if recipe is None:
        sets.update({"task.args.sample_shape": [4, size, size, size], "model.args.filters": filters,
                     "model.args.up": "shuffle"})
    run = engine.build(config.load(recipe or "unet3d-brats", [config.nested(k, v) for k, v in sets.items()]), {},
                       train=True, loaders=False)
    data = run.task.to_device(run.task.synthetic_batch(batch, run.device), run.device, channels_last)
    return run, itertools.repeat(data)


def copies(run, batches, batch: int, widths: set[int]) -> collections.Counter:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        engine.train_step(run.step, batches)
    out = collections.Counter()
    for e in prof.events():
        shape = tuple(e.input_shapes[0]) if e.input_shapes and e.input_shapes[0] else ()
        if e.name in COPIES and len(shape) == 5 and shape[0] == batch and shape[1] in widths:
            parents, p = set(), e.cpu_parent
            while p is not None:
                parents.add(p.name)
                p = p.cpu_parent
            conv = bool(parents & {"aten::_convolution", "aten::convolution_backward"})
            out["conv" if conv else "norm"] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--filters", default="8,16,32")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--recipe", help="a recipe's own network, patch and batch (default: unet3d-brats at --size, "
                                    "--filters, --batch)")
    a = p.parse_args(argv)
    filters = [int(v) for v in a.filters.split(",")]
    name = "unet3d-brats"
    if a.recipe:
        try:
            cfg = config.load(a.recipe)
        except FastvisionError as e:
            print(f"layout_copies: {e}", file=sys.stderr)
            return 2
        name, filters, a.batch = a.recipe, list(cfg.model.args["filters"]), cfg.train.batch_size
        shape = cfg.task.args["sample_shape"]
    widths = set(filters) | {2 * f for f in filters}
    settings = [(n, cl) for cl in (False, True) for n in ("instance", "instance_cl")]
    runs, found, times = {}, {}, collections.defaultdict(list)
    for s in settings:
        runs[s] = build(*s, a.size, filters, a.batch, a.recipe)
        engine.train_step(runs[s][0].step, runs[s][1])  # warm-up
        found[s] = copies(*runs[s], a.batch, widths)
    for r in range(a.rounds):
        for s in settings if r % 2 == 0 else settings[::-1]:
            for _ in range(a.steps):
                t0 = time.perf_counter()
                engine.train_step(runs[s][0].step, runs[s][1])
                times[s].append(time.perf_counter() - t0)
    base = statistics.median(times[settings[0]])
    where = f"patch {shape}" if a.recipe else f"{a.size}^3 x 4"
    print(f"{name}, filters {filters}, {where}, batch {a.batch}, fp32, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; {a.rounds} rounds x {a.steps} steps")
    print("| layout | norm | activation copies: norm / conv | step ms (median) | x NCDHW stock |")
    print("|---|---|---|---|---|")
    for s in settings:
        med = statistics.median(times[s])
        print(f"| {'NDHWC' if s[1] else 'NCDHW'} | {s[0]} | {found[s]['norm']} / {found[s]['conv']} | "
              f"{med * 1e3:.1f} | {base / med:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
