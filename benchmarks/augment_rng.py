"""What ``train.augment_rng: sample`` costs: the batched augmentation with per-sample keys beside the
per-rank generator, the same ops on the same batches, interleaved in one process.

    python benchmarks/augment_rng.py [--device cpu|cuda] [--rounds 7] [--json OUT]

Two pipelines: nnU-Net's augmentation as ``configure --trainer nnunet`` writes it (3-D, configure's own
``augmentation`` function, on 2 x 1 x 24 x 32 x 32 patches, the generated CT plan) and the microscopy
recipe's flips and rotations (2-D, 16 x 1 x 128 x 128). Each round times ``--calls`` calls of each mode,
alternating; the report is the median time per call and the ratio keyed / rank.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fastvision.data.augment.keyed import sample_key
from fastvision.data.augment.spatial import build_augment
from fastvision.planning.configure.recipe import augmentation

PATCH = [24, 32, 32]  # the generated CT plan's patch, batch 2
# nnU-Net's augmentation exactly as `configure --trainer nnunet` writes it for that patch (its own function, not a copy)
NNUNET = augmentation(PATCH, [1.5, 1.5, 1.5], None, "nnunet")[0]
CASES = {  # name: (spatial dims, ops, image shape, label shape)
    "nnunet-3d": (3, NNUNET, (2, 1, *PATCH), (2, *PATCH)),
    "microscopy-2d": (2, {"flip": {"axes": [0, 1]}, "rot90": {}}, (16, 1, 128, 128), (16, 128, 128)),
}


def _time(fn, calls: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls


def measure(aug, ishape, lshape, device: torch.device, rounds: int, calls: int) -> dict:
    """Median ms per call of ``aug`` with the per-rank generator and with fresh per-sample keys, alternating."""
    g = torch.Generator().manual_seed(0)
    image = torch.randn(*ishape, generator=g).to(device)
    label = (torch.rand(*lshape, generator=g) > 0.7).long().to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    counter = iter(range(10 ** 9))

    def rank():
        aug(image.clone(), label.clone(), gen)

    def keyed():  # a new epoch's keys each call: fresh draws, as training makes them
        n = next(counter)
        aug(image.clone(), label.clone(), None, keys=torch.tensor([sample_key(0, n, i) for i in range(ishape[0])]))

    rank(), keyed()  # warm-up
    times = {"rank": [], "sample": []}
    for _ in range(rounds):
        times["rank"].append(_time(rank, calls, device))
        times["sample"].append(_time(keyed, calls, device))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"rank_ms": med["rank"] * 1e3, "sample_ms": med["sample"] * 1e3, "ratio": med["sample"] / med["rank"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for name, (dims, ops, ishape, lshape) in CASES.items():
        row = measure(build_augment(dims, **ops), ishape, lshape, device, args.rounds, args.calls)
        rows.append({"case": name, "batch": ishape[0], **row})
        print(f"{name:14s} batch {ishape[0]:3d}: rank {row['rank_ms']:8.3f} ms, sample {row['sample_ms']:8.3f} ms "
              f"a call ({row['ratio']:.3f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
