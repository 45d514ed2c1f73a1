"""Accuracy of the shard-aware order against a uniform one, on a generated ImageNet-like set.

resnet18-imagefolder trains (CPU, batch 16) from the JPEG folder (uniform permutation per epoch)
and from shard sets of the same files: shards of ~9 batches read in windows of 2 shards (ImageNet's
ratio at 256 MB shards and batch 256: ~2,300 images a shard), and tiny shards of ~1 batch in windows
of 1 (the harsh case: a batch from one or two shards). Same seeds; final top-1 per seed and mean.

    python benchmarks/shard_order_accuracy.py --work /tmp/shardacc --seeds 0 1 --epochs 8
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastvision import config  # noqa: E402
from fastvision.api import run_training  # noqa: E402
from fastvision.data.shards.writer import write_shards  # noqa: E402
from fastvision.data.synth import load_all  # noqa: E402


def _top1(data: Path, out: Path, seed: int, epochs: int, classes: int, *more: str) -> float:
    sets = [f"data.args.path={data}", "data.args.image_size=32", "data.args.resize_size=36",
            f"task.args.num_classes={classes}", f"model.args.num_classes={classes}", "train.batch_size=16",
            "train.target=null", "examples=0", "train.device=cpu", f"train.epochs={epochs}", f"train.seed={seed}",
            *more]
    summary = run_training("resnet18-imagefolder", out=str(out), extra=[config.parse_override(s) for s in sets]
                           + [{"train": {"amp": "off"}}], progress=False)
    return float(summary["top1"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/shardacc")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--classes", type=int, default=20)
    ap.add_argument("--per-class", type=int, default=60)
    args = ap.parse_args()
    work = Path(args.work)
    src = work / "src"
    if not (src / "train").is_dir():
        load_all().get("imagenet")(src, seed=0, classes=args.classes, per_class=args.per_class, val_per_class=20,
                                   size=40)
    sizes = {}
    for name, size in (("big", 144 * 4096), ("tiny", 16 * 4096)):  # a 40 px sample takes ~4 kB in a shard
        index = write_shards(src, work / name, size)
        sizes[name] = sum(s.nsamples for s in index.splits["train"]) / len(index.splits["train"])
    runs = {"folder (uniform)": (src, []),
            f"shards ~{sizes['big']:.0f}, window 2": (work / "big", ["data.args.shard_window=2"]),
            f"shards ~{sizes['tiny']:.0f}, window 1": (work / "tiny", ["data.args.shard_window=1"])}
    table = {}
    for k, (name, (data, more)) in enumerate(runs.items()):
        table[name] = [_top1(data, work / f"run{k}-{s}", s, args.epochs, args.classes, *more) for s in args.seeds]
    print(f"{args.classes * args.per_class} training JPEGs, batch 16, {args.epochs} epochs, seeds {args.seeds}")
    for name, tops in table.items():
        print(f"{name:18} top1 {statistics.mean(tops):.3f}  per seed {', '.join(f'{t:.3f}' for t in tops)}")
    (work / "accuracy.json").write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
