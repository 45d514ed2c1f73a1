"""Activation memory with and without ``train.activation_checkpointing``, and plan's estimate of it.

For one recipe per model family (2-D U-Net, 3-D U-Net, SegResNet, ResNet, SSD), CPU-sized as in
``benchmarks/plan_memory.py``, off and on interleaved, each a fresh build and two real
``engine.train_step`` calls (the engine's build applies the switch):
  * saved for backward: the peak of bytes autograd holds for the backward, counted by a
    ``saved_tensors_hooks`` pack hook (each storage once, from when it is saved until it dies;
    weights excluded). A checkpointed block's inner tensors are checkpoint's, not autograd's:
    this is the memory the switch removes, without the recompute.
  * measured peak: the CPU allocator's peak over build + two steps (``torch.profiler`` memory
    events, ``fastvision.planning.peak.measured_peak``): everything, the recompute included.
  * plan's estimate: ``fastvision.planning.estimate.trace`` (fake tensors, the recipe's switch
    traced as it runs) peak bytes, without the workspace margin; its ratio to the measured peak.

Usage: OMP_NUM_THREADS=2 python benchmarks/activation_checkpointing.py [--recipes a,b] [--device cpu]
"""
from __future__ import annotations

import copy
import functools
import weakref

import torch
from plan_memory import recipe_args  # benchmarks/, the script's folder

from fastvision import config
from fastvision.planning import estimate as est
from fastvision.planning.peak import measured_peak

# recipe -> (family, batch, overrides for a CPU-sized run)
CASES = {
    "unet2d-seed001": ("2-D U-Net", 4, {"task": {"args": {"sample_shape": [1, 256, 256]}}}),
    "unet3d-spleen-fast": ("3-D U-Net", 1, {"task": {"args": {"sample_shape": [1, 32, 32, 32]}}}),
    "segresnet-brats": ("SegResNet", 2, {"task": {"args": {"sample_shape": [4, 32, 32, 32]}}}),
    "resnet50-imagenet": ("ResNet", 2, {}),
    "ssd320-coco": ("SSD (backbone)", 2, {}),
}


class SavedPeak:
    """Peak bytes of storages held for the backward (pack hook; freed when the storage dies)."""

    def __init__(self):
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not (t.is_leaf and t.requires_grad):  # weights are not activations
            st = t.untyped_storage()
            key = st._cdata
            if key not in self.live:
                self.live[key] = st.nbytes()
                self.current += st.nbytes()
                self.peak = max(self.peak, self.current)
                weakref.finalize(st, functools.partial(self._free, key))
        return t

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def measure(cfg, batch: int, device: torch.device) -> tuple[int, int]:
    """(peak saved-for-backward bytes, measured peak bytes) of build + two steps."""
    saved = SavedPeak()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        peak = measured_peak(cfg, batch, device)
    return saved.peak, peak


def main() -> None:
    device, names = recipe_args(__doc__, CASES)
    print("| family | recipe | input | batch | saved for backward MiB off -> on | measured peak MiB off -> on "
          "| plan estimate MiB off -> on | estimate / measured off, on |")
    print("|---|---|---|---:|---|---|---|---|")
    for name in names:
        family, batch, over = CASES[name]
        base = config.load(name, [over])
        base.train.amp = "off"  # fp32 on the CPU (the trace resolves amp: auto to fp32 here as well)
        row = {}
        for ckpt in (False, True):  # interleaved: off then on, per recipe
            cfg = copy.deepcopy(base)
            cfg.train.activation_checkpointing = ckpt
            saved, peak = measure(cfg, batch, device)
            row[ckpt] = (saved, peak, est.trace(cfg, batch).peak_bytes)
        (s0, p0, e0), (s1, p1, e1) = row[False], row[True]
        shape = base.task.args.get("sample_shape") or base.task.args.get("image_size")
        mib = 2**20
        print(f"| {family} | {name} | {shape} | {batch} | {s0 / mib:.1f} -> {s1 / mib:.1f} ({s1 / s0:.2f}x) "
              f"| {p0 / mib:.1f} -> {p1 / mib:.1f} ({p1 / p0:.2f}x) | {e0 / mib:.1f} -> {e1 / mib:.1f} "
              f"| {e0 / p0:.3f}, {e1 / p1:.3f} |", flush=True)


if __name__ == "__main__":
    main()
