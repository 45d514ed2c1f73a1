"""Estimated vs measured peak training memory for every recipe at two batch sizes (issue 14).

Estimate: ``fastvision.planning.estimate.trace`` (fake tensors, no device): the traced peak of live
tensor bytes, without the planner's workspace margin. Measured (``fastvision.planning.peak``): the
same two training steps run for real, model built inside the window,
  * on CPU: ``torch.profiler`` memory events of the CPU allocator (every allocation and free in the
    window; the running sum's maximum is the peak),
  * on a GPU (when one is present and ``--device cuda``): ``torch.cuda.max_memory_allocated``.
On the CPU, 3-D recipes run at a 32^3 patch (unet3d-brats at 64^3: its five poolings need it)
and in fp32 (bf16 3-D convolutions are about 6x slower than fp32 on this CPU); 2-D fp16 recipes
run bf16 autocast (CPU fp16 convolutions are not the GPU's path). The estimator traces exactly
what is measured.

Usage: OMP_NUM_THREADS=1 python benchmarks/plan_memory.py [--device cpu|cuda] [--recipes a,b]
"""
from __future__ import annotations

import argparse
import time

import torch

from fastvision import config
from fastvision.planning import estimate as est
from fastvision.planning.peak import measured_peak

# recipe -> (batch sizes, overrides for a CPU-sized run)
CPU_CASES = {
    "resnet18-imagefolder": ((8, 16), {}),
    "resnet18-pathology": ((8, 16), {}),
    "resnet50-imagenet": ((1, 2), {}),
    "resnet50-imagenet-250ep": ((1, 2), {}),
    "segresnet-brats": ((1, 2), {"task": {"args": {"sample_shape": [4, 32, 32, 32]}}}),
    "ssd320-coco": ((1, 2), {}),
    "ssd320-small-shapes": ((4, 8), {}),
    "unet2d-microscopy": ((4, 8), {}),
    "unet2d-seed001": ((2, 4), {"task": {"args": {"sample_shape": [1, 256, 256]}}}),
    "unet3d-brats": ((1, 2), {"task": {"args": {"sample_shape": [4, 64, 64, 64]}}}),  # 32^3 leaves 1^3 at the bottom
    "unet3d-spleen-baseline": ((1, 2), {"task": {"args": {"sample_shape": [1, 32, 32, 32]}}}),
    "unet3d-spleen-fast": ((1, 2), {"task": {"args": {"sample_shape": [1, 32, 32, 32]}}}),
}


def recipe_args(doc: str, cases: dict) -> tuple[torch.device, list[str]]:
    """``--device`` and ``--recipes`` (a comma-separated subset of ``cases``; default all) of a memory
    benchmark; prints the machine line the tables start with."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipes", help="comma-separated subset")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    return device, args.recipes.split(",") if args.recipes else list(cases)


def main() -> None:
    device, names = recipe_args(__doc__, CPU_CASES)
    print("| recipe | input | amp | batch | estimated MiB | measured MiB | estimate / measured | trace s |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name in names:
        sizes, over = CPU_CASES[name]
        if device.type == "cuda":
            over = {}  # the recipe as shipped
        cfg = config.load(name, [over])
        if device.type == "cpu" and cfg.train.amp == "fp16":
            cfg.train.amp = "off" if "sample_shape" in over.get("task", {}).get("args", {}) else "bf16"
        shape = cfg.task.args.get("sample_shape") or cfg.task.args.get("image_size")
        for b in sizes:
            t0 = time.perf_counter()
            estimate = est.trace(cfg, b).peak_bytes
            trace_s = time.perf_counter() - t0
            measured = measured_peak(cfg, b, device)
            print(f"| {name} | {shape} | {cfg.train.amp} | {b} | {estimate / 2**20:.1f} | {measured / 2**20:.1f} "
                  f"| {estimate / measured:.3f} | {trace_s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
