"""The optimizer step on the CPU: torch's fused kernels against foreach, on each recipe's own model.

For every recipe whose optimizer is SGD, Adam or AdamW, the recipe's model and optimizer are built
twice through ``engine.build`` (one seed: the same initial weights), once with ``optim.impl:
foreach`` (what ``auto`` chose on the CPU before) and once with ``fused`` (what it chooses now).
Both get the same gradients each step; their steps alternate (interleaved, so drift in machine
load hits both alike). Reports the median step of each, the ratio, and whether the weights after
all steps are bit-equal.

    python benchmarks/fused_cpu_optim.py [--recipes resnet50-imagenet unet3d-brats ...] [--steps 20]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from fastvision import config, engine

RECIPES = ["resnet50-imagenet", "ssd320-coco", "unet3d-brats", "unet3d-spleen-fast", "unet2d-seed001"]


def build(recipe: str, impl: str):
    over = {"optim": {"impl": impl}, "train": {"device": "cpu", "amp": "off", "compile": False}}
    if recipe.startswith("ssd320"):  # no download: random backbone weights time the same step
        over["model"] = {"args": {"pretrained": None}}
    cfg = config.load(recipe, [over])
    run = engine.build(cfg, data_info={}, train=True)
    return run.model, run.step.optimizer, cfg.optim.name


def measure(recipe: str, steps: int) -> dict:
    (m_a, o_a, name), (m_b, o_b, _) = build(recipe, "foreach"), build(recipe, "fused")
    pa, pb = list(m_a.parameters()), list(m_b.parameters())
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True)), "the two builds differ before any step"
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"foreach": [], "fused": []}
    for i in range(steps + 2):
        for x, y in zip(pa, pb, strict=True):
            g = torch.randn(x.shape, generator=gen) * 1e-2
            x.grad, y.grad = torch.empty_like(x).copy_(g), torch.empty_like(y).copy_(g)  # the weights' strides
        for impl, opt in (("foreach", o_a), ("fused", o_b)) if i % 2 == 0 else (("fused", o_b), ("foreach", o_a)):
            t = time.perf_counter()
            opt.step()
            if i >= 2:  # the first two steps create the state
                times[impl].append(time.perf_counter() - t)
    fe, fu = statistics.median(times["foreach"]), statistics.median(times["fused"])
    diff = max((x - y).abs().max().item() for x, y in zip(pa, pb, strict=True))
    return {"recipe": recipe, "optimizer": name, "parameters_M": round(sum(p.numel() for p in pa) / 1e6, 2),
            "foreach_ms": round(fe * 1e3, 2), "fused_ms": round(fu * 1e3, 2), "speedup": round(fe / fu, 2),
            "bit_equal": diff == 0.0, "max_abs_diff": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=RECIPES)
    p.add_argument("--steps", type=int, default=20, help="timed steps per side")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    rows = [measure(r, args.steps) for r in args.recipes]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}, {args.steps} steps")
    print("| recipe | optimizer | parameters | foreach ms | fused ms | fused speed-up | weights after all steps |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        eq = "bit-equal" if r["bit_equal"] else f"max difference {r['max_abs_diff']:.1e}"
        print(f"| {r['recipe']} | {r['optimizer']} | {r['parameters_M']} M | {r['foreach_ms']} | {r['fused_ms']} | "
              f"{r['speedup']}x | {eq} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
