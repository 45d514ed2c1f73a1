"""Two CPU paths of the nnU-Net augmentation, each beside what it replaced, one thread, CPU time, interleaved
rounds (medians):

- the affine's 3-D label resampling: ``grid_sample(mode="nearest")`` on a float copy of the labels (the 3-D
  kernel is a scalar loop per voxel) against :func:`~fastvision.data.augment.affine.nearest_3d` (one gather at
  the same source positions, bit for bit the same labels; checked here before timing);
- the flip of a batch whose samples drew different axes: a stack of per-sample flips (the op before
  2026-11-29) against :func:`~fastvision.data.augment.spatial._flip_rows` as the pipeline's first op (a new
  batch) and behind an op that made the batch (in place).

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/aug_cpu_paths.py --rounds 15 --json /tmp/aug_cpu_paths.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def _ms(fn, reps: int) -> float:
    t0 = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patch", type=int, nargs=3, default=[64, 64, 64])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--channels", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args()
    from fastvision.data.augment.affine import _linear_grid, _rotation, nearest_3d
    from fastvision.data.augment.spatial import _flip_rows, _Rng
    from fastvision.engine import runtime

    runtime.set_heap("keep")  # as train sets it (engine.build)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    b, c, size = a.batch, a.channels, torch.Size(a.patch)
    lab = torch.randint(0, 3, (b, 1, *size), generator=g).to(torch.uint8)
    img = torch.randn(b, c, *size, generator=g)
    ang = (torch.rand(b, 3, generator=g) - 0.5) * 1.05  # nnU-Net's +-30 degrees
    lin = _rotation(ang, 3).transpose(1, 2) * (0.7 + 0.7 * torch.rand(b, 1, 1, generator=g))
    grid = _linear_grid(lin, size)

    def grid_nearest():
        return F.grid_sample(lab.to(grid.dtype), grid, mode="nearest", align_corners=False).to(lab.dtype)

    if not torch.equal(grid_nearest(), nearest_3d(lab, grid)):
        raise SystemExit("nearest_3d differs from grid_sample's nearest")
    axes = [[-3, -1], [-2]] + [[-1]] * (b - 2)  # every sample its own axes: the per-row path
    axes = axes[:b]

    def stacked():  # the op before 2026-11-29
        return torch.stack([x.flip(d) for x, d in zip(img, axes, strict=True)])

    caller = _Rng(None, b, img.device)
    caller.caller = {img.untyped_storage().data_ptr()}
    own = img.clone()
    mine = _Rng(None, b, img.device)
    mine.caller = set()
    if not torch.equal(stacked(), _flip_rows(img, axes, caller)):
        raise SystemExit("_flip_rows differs from the stacked flips")
    cases = {
        "label nearest, grid_sample": grid_nearest,
        "label nearest, nearest_3d": lambda: nearest_3d(lab, grid),
        "flip, stacked per-sample flips": stacked,
        "flip, _flip_rows, first op (new batch)": lambda: _flip_rows(img, axes, caller),
        "flip, _flip_rows, behind an op (in place)": lambda: _flip_rows(own, axes, mine),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(a.rounds):
        names = list(cases) if r % 2 == 0 else list(cases)[::-1]
        for name in names:
            times[name].append(_ms(cases[name], a.reps) / b)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{b} x {c} x {list(size)}, one thread, CPU ms per sample, medians of {a.rounds} rounds:")
    for k, v in med.items():
        print(f"  {k:45s} {v:7.2f}  (rounds {min(times[k]):.2f}-{max(times[k]):.2f})")
    flip = med["flip, stacked per-sample flips"]
    print(f"nearest: grid_sample / nearest_3d = "
          f"{med['label nearest, grid_sample'] / med['label nearest, nearest_3d']:.2f}x; flip: stacked / first op = "
          f"{flip / med['flip, _flip_rows, first op (new batch)']:.2f}x, stacked / in place = "
          f"{flip / med['flip, _flip_rows, behind an op (in place)']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "ms_per_sample": times, "median": med, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
