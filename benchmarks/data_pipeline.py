"""Input-pipeline benchmark: the recipes' real input paths next to MONAI's equivalents.

Every fastvision variant is built the way ``fastvision train`` builds it: ``config.load(recipe)``
with ``--set`` overrides, ``engine.build`` (dataset from the registry, task), then
``engine.cached_train_set`` (``data.cache``) and ``engine.make_loader`` (sampler, loader), and each
batch goes through ``task.to_device`` and ``task.augment`` as in the training step, with the
model removed. All variants are timed in one run, repeats interleaved (round r runs every variant
once; round 0 warms threads and the page cache and is not counted).

* 3-D: generated spleen CT (``fastvision.data.synth`` ``spleen``, NIfTI, Decathlon layout).
  ``unet3d-spleen-fast`` as shipped (``data.cache: gpu``: preprocessed volumes on the training
  device, here the CPU; foreground-biased crop per item after the cache; thread loader), the same
  recipe with ``data.cache: ram`` / ``disk`` / ``none``, and ``unet3d-spleen-baseline`` as shipped
  (no cache, preprocessing and crop per item in 4 worker processes). MONAI: the fast tutorial's
  transforms (LoadImaged, EnsureChannelFirstd, Orientationd RAS, Spacingd 1.5 x 1.5 x 2,
  ScaleIntensityRanged -57..164, CropForegroundd, SpatialPadd, FgBgToIndicesd (cached, as seed 003
  shows), then RandCropByPosNegLabeld pos 1 neg 1) in CacheDataset / PersistentDataset +
  ThreadDataLoader(num_workers=0), and the plain Dataset + DataLoader(4 workers) of the baseline
  tutorial. One crop per volume per epoch in every variant (MONAI's tutorial draws num_samples=4;
  here 1, so items/epoch are equal).
* 2-D: ``unet2d-microscopy`` as shipped (no cache, thread loader, batched flips + rot90) and with
  ``data.cache: ram``; MONAI CacheDataset + RandFlipd x2 + RandRotate90d + ThreadDataLoader over the
  same decoded items.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data_pipeline.py [--repeats 3] [--volumes 8]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastvision import config, engine  # noqa: E402
from fastvision.data.formats.decathlon import read_dataset_json  # noqa: E402

PATCH = (48, 48, 32)
Step = Callable[[Any, torch.Generator], Any]


def recipe_path(recipe: str, data: Path, *sets: str) -> tuple[Any, Step, int]:
    """(loader, per-batch step, items per epoch) exactly as ``fastvision train RECIPE`` builds them
    (``train.amp=off``: no model runs, and the fp16 recipes refuse a CPU otherwise)."""
    overrides = (f"data.args.path={data}", "train.device=cpu", "train.amp=off", *sets)
    cfg = config.load(recipe, [config.parse_override(s) for s in overrides])
    run = engine.build(cfg, train=True)  # train: the cache, the loaders and the recipe's batched augmentation
    loader = run.train_loader

    def step(batch: Any, gen: torch.Generator) -> Any:
        return run.task.augment(run.task.to_device(batch, run.device, cfg.train.channels_last), gen)

    return loader, step, len(loader.sampler)


def monai_3d(data: Path, tmp: Path, bs: int) -> dict[str, Callable[[], tuple[Any, Step | None, int]]]:
    from monai import transforms as M
    from monai.data import (
        CacheDataset,
        DataLoader,
        Dataset,
        PersistentDataset,
        ThreadDataLoader,
    )

    keys = ["image", "label"]
    files = [{"image": str(c["image"][0]), "label": str(c["label"])} for c in read_dataset_json(data)["training"]]
    # fold 0 of 5 trains on 4/5 of the cases: the same count as the recipes' training split
    files = files[: len(files) - len(files) // 5]
    prefix = [M.LoadImaged(keys, image_only=True), M.EnsureChannelFirstd(keys), M.Orientationd(keys, axcodes="RAS"),
              M.Spacingd(keys, pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
              M.ScaleIntensityRanged("image", a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
              M.CropForegroundd(keys, source_key="image"), M.SpatialPadd(keys, spatial_size=PATCH),
              M.FgBgToIndicesd("label", image_key="image"),  # seed 003: the crop's candidate voxels (body only), cached
              M.EnsureTyped(keys, track_meta=False)]
    crop = M.RandCropByPosNegLabeld(keys, "label", spatial_size=PATCH, pos=1, neg=1, num_samples=1,
                                    fg_indices_key="label_fg_indices", bg_indices_key="label_bg_indices")
    pipe = M.Compose([*prefix, crop])
    n = len(files)

    def warm(ds):
        for i in range(len(ds)):
            ds[i]
        return ds

    return {
        "MONAI CacheDataset + ThreadDataLoader": lambda: (ThreadDataLoader(
            CacheDataset(files, pipe, num_workers=2, progress=False, copy_cache=False), batch_size=bs, shuffle=True,
            num_workers=0), None, n),
        "MONAI PersistentDataset + ThreadDataLoader": lambda: (ThreadDataLoader(
            warm(PersistentDataset(files, pipe, cache_dir=tmp / "monai-disk")), batch_size=bs, shuffle=True,
            num_workers=0), None, n),
        "MONAI Dataset + DataLoader (4 workers)": lambda: (DataLoader(
            Dataset(files, pipe), batch_size=bs, shuffle=True, num_workers=4), None, n),
    }


def variants_3d(data: Path, tmp: Path, bs: int) -> dict[str, Callable[[], tuple[Any, Step | None, int]]]:
    tiny = (f"train.batch_size={bs}", f"data.args.patch_size=[{PATCH[0]},{PATCH[1]},{PATCH[2]}]",
            f"data.cache_dir={tmp / 'fv-disk'}")

    def fast(*sets: str) -> Callable[[], tuple[Any, Step, int]]:
        return lambda: _warm(recipe_path("unet3d-spleen-fast", data, *tiny, *sets))

    return {
        "unet3d-spleen-fast (as shipped: cache gpu)": fast(),
        "unet3d-spleen-fast, data.cache=ram": fast("data.cache=ram"),
        "unet3d-spleen-fast, data.cache=disk": fast("data.cache=disk"),
        "unet3d-spleen-fast, data.cache=none": fast("data.cache=none"),
        "unet3d-spleen-baseline (as shipped: no cache, 4 processes)":
            lambda: recipe_path("unet3d-spleen-baseline", data, *tiny),
        **monai_3d(data, tmp, bs),
    }


def variants_2d(data: Path, bs: int) -> dict[str, Callable[[], tuple[Any, Step | None, int]]]:
    from monai.data import CacheDataset, ThreadDataLoader
    from monai.transforms import Compose, RandFlipd, RandRotate90d, Transform

    from fastvision.data.formats.microscopy import microscopy

    tiny = (f"train.batch_size={bs}",)
    ds = microscopy(path=str(data), image_size=[128, 128], val_fraction=0.2, split_seed=0).train

    class Read(Transform):  # the same decoded item; a MONAI Transform so CacheDataset caches it
        def __call__(self, d):
            item = ds[d["index"]]
            return {**item, "label": item["label"][None]}

    keys = ["image", "label"]
    pipe = Compose([Read(), RandFlipd(keys, 0.5, 0), RandFlipd(keys, 0.5, 1), RandRotate90d(keys, 0.5)])
    return {
        "unet2d-microscopy (as shipped: no cache, threads)": lambda: recipe_path("unet2d-microscopy", data, *tiny),
        "unet2d-microscopy, data.cache=ram": lambda: recipe_path("unet2d-microscopy", data, *tiny, "data.cache=ram"),
        "MONAI CacheDataset + ThreadDataLoader": lambda: (ThreadDataLoader(
            CacheDataset([{"index": i} for i in range(len(ds))], pipe, num_workers=2, progress=False),
            batch_size=bs, shuffle=True, num_workers=0), None, len(ds)),
    }


def _warm(built: tuple[Any, Step, int]) -> tuple[Any, Step, int]:
    """Fill a disk cache before timing (a second run's state); other caches fill when built."""
    ds = getattr(built[0], "dataset", None)
    if ds is not None and hasattr(ds, "warm"):
        ds.warm(2, False)
    return built


def run(variants: dict[str, Callable[[], tuple[Any, Step | None, int]]], repeats: int) -> dict[str, dict]:
    """Build every variant (build + fill timed), then ``repeats`` interleaved rounds of one epoch each."""
    built, res = {}, {}
    for name, make in variants.items():
        t0 = time.perf_counter()
        built[name] = make()
        res[name] = {"fill_s": time.perf_counter() - t0, "epochs": [], "items": built[name][2]}
    for r in range(repeats + 1):
        for name, (loader, step, _) in built.items():
            gen = torch.Generator().manual_seed(r)
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(r)
            t0 = time.perf_counter()
            for batch in loader:
                if step is not None:
                    step(batch, gen)
            if r:
                res[name]["epochs"].append(time.perf_counter() - t0)
    return res


def table(title: str, res: dict[str, dict], pairs: list[tuple[str, str, str]]) -> str:
    lines = [f"\n### {title}\n", "| variant | build + fill s | items/epoch | epoch s (median) | ms/item |",
             "|---|---:|---:|---:|---:|"]
    per = {}
    for name, r in res.items():
        med = statistics.median(r["epochs"])
        per[name] = med / r["items"]
        lines.append(f"| {name} | {r['fill_s']:.2f} | {r['items']} | {med:.3f} | {1e3 * per[name]:.2f} |")
    lines.append("")
    for label, slow, fast in pairs:
        lines.append(f"- {label}: **{per[slow] / per[fast]:.1f}x** "
                     f"(ms/item {1e3 * per[slow]:.2f} / {1e3 * per[fast]:.2f})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--volumes", type=int, default=10, help="generated spleen cases (8 train at fold 0 of 5)")
    ap.add_argument("--size", type=int, default=96, help="generated volume edge (voxels)")
    ap.add_argument("--images", type=int, default=64, help="microscopy images (256 x 256 PNG)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from fastvision.data.synth.medical import synth_spleen
    from fastvision.data.synth.microscopy import synth

    fast = "unet3d-spleen-fast (as shipped: cache gpu)"
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spleen = synth_spleen(tmp / "spleen", seed=0, cases=args.volumes, test_cases=0, size=args.size)
        r3 = run(variants_3d(spleen, tmp, 2), args.repeats)
        print(table(f"3-D: {args.volumes} generated spleen volumes {args.size}^3, batch 2, patch {PATCH}", r3, [
            ("cached 3-D path vs uncached (same recipe, data.cache=none)", "unet3d-spleen-fast, data.cache=none", fast),
            ("cached 3-D path vs the baseline recipe's plain path",
             "unet3d-spleen-baseline (as shipped: no cache, 4 processes)", fast),
            ("vs MONAI CacheDataset + ThreadDataLoader", "MONAI CacheDataset + ThreadDataLoader", fast),
            ("disk cache vs MONAI PersistentDataset", "MONAI PersistentDataset + ThreadDataLoader",
             "unet3d-spleen-fast, data.cache=disk"),
        ]))
        micro = synth(tmp / "micro", seed=0, count=args.images, size=256)
        r2 = run(variants_2d(micro, 16), args.repeats)
        print(table(f"2-D: {args.images} microscopy PNGs 256^2 -> 128^2, batch 16, flips + rot90", r2, [
            ("ram cache vs as shipped", "unet2d-microscopy (as shipped: no cache, threads)",
             "unet2d-microscopy, data.cache=ram"),
            ("ram cache vs MONAI CacheDataset + ThreadDataLoader", "MONAI CacheDataset + ThreadDataLoader",
             "unet2d-microscopy, data.cache=ram"),
        ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
