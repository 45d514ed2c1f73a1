"""Peak host RAM of one checkpoint save: before issue 28 (serialised into a BytesIO) vs now (streamed).

Each measurement runs in a fresh subprocess: it builds a recipe's run with ``engine.build`` (no
dataset), takes one training step so the optimizer has its state, builds the checkpoint
(``engine.state.checkpoint_state``), then resets the kernel's RSS high-water mark
(``/proc/self/clear_refs`` 5) and saves to ``last.pt`` + ``best.pt`` in one of two ways:

- ``before``: what ``BackgroundWriter`` did before issue 28, replayed here: a CPU snapshot, then
  ``torch.save`` into a ``BytesIO`` and that buffer written to each file (a second, serialised
  copy of the checkpoint in host RAM).
- ``now``: ``checkpoint.BackgroundWriter.write`` + ``join`` as ``fit`` calls it (host copies, on
  CUDA into reused pinned buffers; ``torch.save`` streamed into the temp file).

Before the save, ``malloc_trim(0)`` hands freed heap back to the kernel, so the copies need fresh
pages. The figure is ``VmHWM`` after the save minus ``VmRSS`` before it (the save's own peak), in MiB,
beside the checkpoint's size. CPU only here: the model lives in host RAM, so the snapshot is a
host-to-host copy; on a GPU the same copy goes into pinned memory. Rounds alternate the two ways.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_ram.py [--recipe resnet50-imagenet] [--rounds 3]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import io
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _status(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (from /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(recipe: str, overrides: list[str], way: str) -> dict:
    """One save in this process; returns its peak RAM above the pre-save RSS."""
    import torch

    from fastvision import config, engine
    from fastvision.engine import checkpoint, runtime
    from fastvision.engine.state import checkpoint_state, initial_state, resolved_config

    cfg = config.load(recipe, [config.parse_override(s) for s in overrides])
    cfg.train.device, cfg.train.amp, cfg.train.compile = "cpu", "off", False
    run = engine.build(cfg, data_info={}, train=True)
    engine.train_step(run.step, itertools.repeat(run.task.synthetic_batch(cfg.train.batch_size, run.device)))
    ckpt = checkpoint_state(run, initial_state({}), resolved_config(cfg), [runtime.rng_state(run.step.generator)])
    out = Path(tempfile.mkdtemp(prefix="ckpt-ram-"))
    paths = [out / "last.pt", out / "best.pt"]
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the kernel: the save's pages count
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    before = _status("VmRSS")
    if way == "before":
        data = checkpoint.snapshot(ckpt)
        buf = io.BytesIO()
        torch.save(data, buf)
        for p in paths:
            checkpoint.atomic_write(p, lambda f: f.write(buf.getbuffer()))
        del data, buf
    else:
        writer = checkpoint.BackgroundWriter()
        writer.write(ckpt, paths)
        writer.join()
    peak = _status("VmHWM") - before
    size = paths[0].stat().st_size
    assert torch.load(paths[1], weights_only=True).keys() == ckpt.keys()
    return {"way": way, "peak_above_rss_mib": peak / 2**20, "checkpoint_mib": size / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="resnet50-imagenet")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--set", action="append", default=["task.args.image_size=64", "train.batch_size=2"])
    p.add_argument("--child", choices=["before", "now"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.recipe, args.set, args.child)))
        return
    results: dict[str, list[dict]] = {"before": [], "now": []}
    for _ in range(args.rounds):
        for way in ("before", "now"):
            cmd = [sys.executable, __file__, "--recipe", args.recipe, "--child", way,
                   *itertools.chain.from_iterable(("--set", s) for s in args.set)]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            results[way].append(json.loads(line))
    med = {w: statistics.median(r["peak_above_rss_mib"] for r in rs) for w, rs in results.items()}
    print(json.dumps({"recipe": args.recipe, "rounds": args.rounds,
                      "checkpoint_mib": results["now"][0]["checkpoint_mib"],
                      "peak_above_rss_mib_before": med["before"], "peak_above_rss_mib_now": med["now"],
                      "ratio_now_over_before": med["now"] / med["before"],
                      "all": results}, indent=2))


if __name__ == "__main__":
    main()
