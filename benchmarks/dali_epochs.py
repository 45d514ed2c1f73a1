"""DALI loader epochs before issue 28 (a pipeline built per epoch, crop fused into the decode) and
now (one pipeline reset per epoch, the crop window decoded alone), interleaved in one process.

"Before" is ``fastvision/data/dali.py`` at commit ``--before`` (read with ``git show``, loaded as
a module of its own); "now" is the working tree's. Both read the same generated ImageNet-like
JPEGs (500 x 375, quality 90) into 224 px random-resized crops with flips, DALI on the CPU
(``dali_device=cpu``) with the same thread count, batch 32, whole epochs; rounds alternate which
goes first. Round 0 (the first build of each) is left out of the medians. Prints images/s per
round, the medians and their ratio.

    OMP_NUM_THREADS=2 python benchmarks/dali_epochs.py [--rounds 5] [--images 256] [--threads 2]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _before(commit: str, folder: Path):
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:fastvision/data/dali.py"], check=True,
                         capture_output=True, text=True).stdout
    (folder / "dali_before.py").write_text(src)
    spec = importlib.util.spec_from_file_location("dali_before", folder / "dali_before.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    import torch

    from fastvision.data import dali as now
    from fastvision.data.formats.imagefolder import find_classes, list_samples
    from fastvision.data.synth.imagenet import synth

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--before", default="4f6e98f", help="commit whose dali.py is the 'before'")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = synth(Path(tmp) / "imagenet", seed=0, classes=4, per_class=args.images // 4, val_per_class=1,
                     size=500, height=375, quality=90)
        samples = list_samples(root / "train", find_classes(root / "train"))
        kw = dict(train=True, image_size=224, resize_size=256, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip=0.5,
                  dali_device="cpu", threads=args.threads)
        loaders = {name: mod.DaliImageFolder(samples, **kw).make_loader(
            batch_size=args.batch, shard_id=0, num_shards=1, seed=0, device=torch.device("cpu"))
            for name, mod in (("before", _before(args.before, Path(tmp))), ("now", now))}
        rates: dict[str, list[float]] = {"before": [], "now": []}
        for r in range(args.rounds):
            for name in ("before", "now") if r % 2 == 0 else ("now", "before"):
                loader = loaders[name]
                loader.set_epoch(r)
                t = time.perf_counter()
                n = sum(b["image"].shape[0] for b in loader)
                rates[name].append(n / (time.perf_counter() - t))
        med = {k: statistics.median(v[1:]) for k, v in rates.items()}
        print(json.dumps({"images_per_s": rates, "median_after_round_0": med,
                          "ratio_now_over_before": med["now"] / med["before"], "threads": args.threads,
                          "batch": args.batch, "images": len(samples)}, indent=2))


if __name__ == "__main__":
    main()
