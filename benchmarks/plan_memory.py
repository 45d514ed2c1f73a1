"""Estimated vs measured peak training memory for every recipe at two batch sizes (issue 14).

Estimate: ``fastvision.planning.estimate.trace`` (fake tensors, no device): the traced peak of live
tensor bytes, without the planner's workspace margin. Measured: the same two training steps run
for real, model built inside the window,
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
import copy
import gc
import itertools
import time

import torch

from fastvision import config, engine
from fastvision.models import without_weights
from fastvision.planning import estimate as est
from fastvision.planning.autobatch import recipe_run

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


def measured_peak(cfg, batch: int, device: torch.device) -> int:
    """Peak bytes of building the recipe and running two real training steps on ``device``."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        _run(cfg, batch, device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _run(cfg, batch, device)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def _run(cfg, batch: int, device: torch.device) -> None:
    """Two ``engine.train_step`` calls (the step ``train`` runs) on a synthetic batch; no weights
    file is read (they change values, not memory), as in the estimate."""
    cfg = copy.deepcopy(cfg)
    cfg.model.args = without_weights(cfg.model.args)
    run, make_optimizer = recipe_run(cfg, device)
    run.step.optimizer = make_optimizer(run.model)
    run.step.scheduler = torch.optim.lr_scheduler.LambdaLR(run.step.optimizer, lambda _: 1.0)
    batch = run.task.synthetic_batch(batch, device)
    for _ in range(2):
        engine.train_step(run.step, itertools.repeat(batch))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipes", help="comma-separated subset")
    args = ap.parse_args()
    device = torch.device(args.device)
    names = args.recipes.split(",") if args.recipes else list(CPU_CASES)
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
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
