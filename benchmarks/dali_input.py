"""ImageNet input path: DALI (CPU) vs the Pillow thread loader vs Pillow worker processes.

Generates ImageNet-like JPEGs (``fastvision data synth imagenet`` at 500 x 375, quality 90: the
typical ImageNet photo) and runs ``fastvision benchmark resnet50-imagenet --mode data`` once with
three ``--variant`` settings, timed in the same interleaved rounds: every batch is what the
training step receives (decode, random-resized crop to 224, flip, collate, to the device, the
task's batched augmentation), with the model removed.

* ``data.args.backend=dali`` with ``dali_device=cpu``: DALI's file reader, libjpeg-turbo decode
  fused with the random-resized crop, resize, flip; ``dali_threads`` = --workers.
* ``data.args.backend=pillow`` with ``data.loader=threads``, ``data.num_workers`` = --workers.
* ``data.args.backend=pillow`` with ``data.loader=processes``, ``data.num_workers`` = --workers.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/dali_input.py [--images 256] [--batch 32] [--workers 2]

The Markdown table goes to stdout (and ``--out``/resnet50-imagenet-data.md).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastvision import cli  # noqa: E402
from fastvision.data.synth.imagenet import synth  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=256, help="training JPEGs generated (4 classes)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2, help="DALI threads / Pillow threads / Pillow processes")
    ap.add_argument("--steps", type=int, default=24, help="timed batches per setting")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("runs/benchmark-dali"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = synth(Path(tmp) / "imagenet", seed=0, classes=4, per_class=max(1, args.images // 4), val_per_class=1,
                     size=500, height=375, quality=90)
        w = args.workers
        variants = [f"data.args.backend=dali,data.args.dali_device=cpu,data.args.dali_threads={w}",
                    f"data.args.backend=pillow,data.loader=threads,data.num_workers={w}",
                    f"data.args.backend=pillow,data.loader=processes,data.num_workers={w}"]
        argv = ["benchmark", "resnet50-imagenet", "--mode", "data", "--data", str(data), "--device", "cpu",
                "--batch-sizes", str(args.batch), "--steps", str(args.steps), "--rounds", str(args.rounds),
                "--warmup", "2", "--out", str(args.out), "--force", "--set", "task.args.num_classes=4",
                "--set", "model.args.num_classes=4"]
        for v in variants:
            argv += ["--variant", v]
        rc = cli.main(argv)
    if rc == 0:
        print((args.out / "resnet50-imagenet-data.md").read_text())
    return rc


if __name__ == "__main__":
    sys.exit(main())
