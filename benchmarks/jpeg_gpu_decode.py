"""ResNet-50 training from JPEG files: Pillow decoding on the host vs nvJPEG on the GPU (issue 40).

One process builds ``resnet50-imagenet`` twice on a generated JPEG ImageFolder (``fastvision data
synth imagenet`` at 500 x 375, quality 90: the typical ImageNet photo): ``data.args.backend=pillow``
(the recipe's worker processes, ``--workers`` of them) and ``data.args.backend=nvjpeg``
(torchvision's batched nvJPEG decode, then Pillow's crop / resize arithmetic on the GPU). Both
train with ``engine.train_step``, the recipe's batch, precision and channels_last. The two take
turns for ``--rounds`` rounds: before each timed chunk the process tree is let go idle (the other loader's
queue full) and the batches this loader built ahead are taken untimed (so a head start is not
timed as speed), then ``--steps`` steps are timed between two synchronizes. Images/s per round,
their median, and the ratio go to ``--out`` (JSON).

The unique JPEGs are generated in parallel (``--unique``, one process per core) and hard-linked up
to ``--images`` files, so an epoch is long enough that the Pillow loader's epoch restarts rarely
fall in a chunk; both backends read the same files from the page cache (decoding, not disk, is
compared). Sized for about 3 minutes on an H100 with the defaults; on a machine without CUDA (or
without torchvision) it refuses with one line.

    python benchmarks/jpeg_gpu_decode.py --out runs/jpeg_gpu_decode.json [--workers 14] [--compile]
    python benchmarks/jpeg_gpu_decode.py --out runs/jpeg_host.json --host-only --unique 256   # any machine

``--host-only`` (no GPU needed) times the host side alone, one thread, in items per CPU second: the
Pillow path's whole training item vs what the nvJPEG path leaves to the host (read, JPEG header,
crop draws), to show how many host cores each needs for a given rate.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastvision import config, engine  # noqa: E402
from fastvision.data.loader import endless_batches, prefetch_depth  # noqa: E402
from fastvision.data.synth.imagenet import synth  # noqa: E402
from fastvision.errors import FastvisionError  # noqa: E402
from fastvision.utils.hostcpu import host_cpu_name, wait_idle  # noqa: E402

CLASSES = 8


def _part(args: tuple[Path, int, int]) -> Path:
    root, seed, per_class = args
    return synth(root / f"part{seed}", seed=seed, classes=CLASSES, per_class=per_class, val_per_class=1, size=500,
                 height=375, quality=90)


def make_folder(root: Path, unique: int, images: int, procs: int) -> Path:
    """``root/data/{train,val}/classNNN/*.JPEG``: ``unique`` generated JPEGs, hard-linked up to ``images``."""
    per_class = max(1, unique // (CLASSES * procs))
    with ProcessPoolExecutor(procs) as pool:
        parts = list(pool.map(_part, [(root, k, per_class) for k in range(procs)]))
    out = root / "data"
    files = {"train": [], "val": []}
    for k, part in enumerate(parts):
        for src in sorted(part.rglob("*.JPEG")):
            split, cls = src.parts[-3], src.parts[-2]
            dst = out / split / cls / f"p{k}_{src.name}"
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
            files[split].append(dst)
    train = files["train"]
    for j in range(images - len(train)):  # copies of the training files, as links
        src = train[j % len(train)]
        os.link(src, src.with_name(f"c{j}_{src.name}"))
    return out


def build(recipe: str, data: Path, setting: dict, batch: int, compile_: bool) -> tuple[engine.Run, object]:
    train = {"device": "cuda", "batch_size": batch, "compile": compile_}
    over = [{"data": {"args": {"path": str(data)}}, "train": train}, setting]
    run = engine.build(config.load(recipe, over), train=True)
    return run, endless_batches(run.train_loader)


def chunk(run: engine.Run, batches, steps: int) -> float:
    """Images/s of ``steps`` training steps, after taking what the loader built ahead untimed."""
    if not wait_idle(timeout=20):  # the other backend's loader fills its queue first: not on this one's time
        print("jpeg_gpu_decode: the process tree did not go idle in 20 s; timing anyway", flush=True)
    ready, producers = prefetch_depth(run.train_loader)
    for _ in range(ready + producers):
        next(batches)
    torch.cuda.synchronize()  # deliberate: the chunk starts on an idle device
    t0 = time.perf_counter()
    images = sum(engine.train_step(run.step, batches).images for _ in range(steps))
    torch.cuda.synchronize()  # deliberate: the chunk ends when the device is done
    return images / (time.perf_counter() - t0)


def host_rates(data: Path, rounds: int, n: int) -> dict[str, list[float]]:
    """Training items per CPU second of one thread (``time.thread_time``), interleaved rounds: the
    Pillow path's whole item (read, decode, crop, resize, flip) vs the nvJPEG path's host part
    (read, JPEG header, crop draws; the decode is the GPU's)."""
    from fastvision.data import gpu_decode
    from fastvision.data.cache.select import wrap_train_set
    from fastvision.data.formats import imagefolder

    samples = imagefolder.list_samples(data / "train", imagefolder.find_classes(data / "train"))[:n]
    kw = dict(image_size=224, resize_size=256, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip=0.5)
    paths = {"pillow": wrap_train_set(imagefolder.ImageFolderDataset(samples, True, **kw), cache="none"),
             "nvjpeg_host": gpu_decode.host_dataset(samples, True, **kw)}
    rates: dict[str, list[float]] = {k: [] for k in paths}
    for r in range(rounds):
        for k, ds in paths.items():
            ds.set_epoch(r)
            t0 = time.thread_time()
            for i in range(len(ds)):
                ds[i]
            rates[k].append(len(ds) / (time.thread_time() - t0))
    return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON result file")
    ap.add_argument("--recipe", default="resnet50-imagenet")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 2)),
                    help="Pillow worker processes (the recipe's loader) and nvJPEG host threads (at most 8)")
    ap.add_argument("--unique", type=int, default=1024, help="distinct generated JPEGs")
    ap.add_argument("--images", type=int, default=16384, help="training files (hard links of the unique ones)")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per chunk")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=6, help="untimed steps per backend first (cuDNN autotuning)")
    ap.add_argument("--compile", action="store_true", help="train.compile (adds about a minute per backend)")
    ap.add_argument("--host-only", action="store_true",
                    help="any machine: items per CPU second of the host side of each path, no training")
    args = ap.parse_args()
    if args.host_only:
        return host_only(args)
    if not torch.cuda.is_available():
        print("jpeg_gpu_decode: needs a CUDA device (torch.cuda.is_available() is False); nothing measured")
        return 2
    t_start = time.perf_counter()
    settings = {"pillow": {"data": {"args": {"backend": "pillow"}, "loader": "processes",
                                    "num_workers": args.workers}},
                "nvjpeg": {"data": {"args": {"backend": "nvjpeg", "nvjpeg_threads": min(8, args.workers)}}}}
    with tempfile.TemporaryDirectory() as tmp:
        data = make_folder(Path(tmp), args.unique, args.images, max(1, min(16, os.cpu_count() or 1)))
        t_data = time.perf_counter() - t_start
        try:
            runs = {k: build(args.recipe, data, s, args.batch, args.compile) for k, s in settings.items()}
        except FastvisionError as e:
            print(f"jpeg_gpu_decode: {e}")
            return 2
        for run, batches in runs.values():
            for _ in range(args.warmup):
                engine.train_step(run.step, batches)
        torch.cuda.synchronize()
        rates: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for k, (run, batches) in runs.items():
                rates[k].append(chunk(run, batches, args.steps))
                print(f"{k}: {rates[k][-1]:.0f} img/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    run = runs["pillow"][0]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(),
              "torchvision": _version("torchvision"), "cpus": os.cpu_count(), "host": platform.node(),
              "recipe": args.recipe, "batch": args.batch, "precision": run.precision.mode,
              "channels_last": run.cfg.train.channels_last, "compile": args.compile, "workers": args.workers,
              "unique_jpegs": args.unique, "train_files": args.images, "jpeg": "500x375 q90 (fastvision data synth)",
              "steps_per_chunk": args.steps, "rounds": args.rounds, "images_per_s": rates,
              "median_images_per_s": med, "nvjpeg_over_pillow": med["nvjpeg"] / med["pillow"],
              "data_generation_s": round(t_data, 1), "wall_s": round(time.perf_counter() - t_start, 1),
              "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"pillow {med['pillow']:.0f} img/s, nvjpeg {med['nvjpeg']:.0f} img/s "
          f"({result['nvjpeg_over_pillow']:.2f}x) on {result['device']}; {args.out}")
    return 0


def host_only(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        data = make_folder(Path(tmp), args.unique, 0, max(1, min(16, os.cpu_count() or 1)))
        rates = host_rates(data, args.rounds, args.unique)
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {"mode": "host-only", "cpu": host_cpu_name(), "cpus": os.cpu_count(),
              "jpeg": "500x375 q90 (fastvision data synth)", "items": args.unique, "rounds": args.rounds,
              "items_per_cpu_s": rates, "median_items_per_cpu_s": med,
              "nvjpeg_host_over_pillow": med["nvjpeg_host"] / med["pillow"],
              "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"items per CPU second, one thread: pillow {med['pillow']:.0f}, nvjpeg host side {med['nvjpeg_host']:.0f} "
          f"({result['nvjpeg_host_over_pillow']:.1f}x); {args.out}")
    return 0


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
