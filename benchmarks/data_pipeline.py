"""Input-pipeline benchmark: epoch time of fastvision's caches and loaders next to MONAI's.

Two pipelines, every variant in one run, repeats interleaved (round r runs every variant once):

* 3-D segmentation on generated CT-like NIfTI volumes. Deterministic prefix (MONAI transforms, the
  same objects for every variant): load, channel first, RAS, resample to 1.5 x 1.5 x 2 mm, CT window,
  crop foreground, pad/crop to a fixed box, plain tensors. Random part: a foreground-biased 64^3
  crop (pos:neg 1:1): fastvision does it batched (``gpu_aug`` Crop, on CPU here); MONAI does it per
  item (``RandCropByPosNegLabeld``).
* 2-D microscopy (``MicroscopyDataset``: PNG decode, scale, resize), random flips + rot90: batched in
  fastvision, ``RandFlipd``/``RandRotate90d`` per item in MONAI.

Variants: (a) plain dataset + process loader (2 workers), (b) RAM cache + thread loader,
(c) persistent disk cache, (d) smart cache, (e) GPU cache + GPU augmentation (CUDA only), and
MONAI CacheDataset / PersistentDataset with ThreadDataLoader. Epoch time excludes cache filling
(reported as "fill s"); the disk caches are warmed by one pass first.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data_pipeline.py [--repeats 3] [--volumes 10]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import nibabel as nib
import numpy as np
import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastvision.data import transforms as T  # noqa: E402
from fastvision.data.cache import CacheDataset, PersistentDataset, _Cached  # noqa: E402
from fastvision.data.cache_select import files_identity, wrap_train_set  # noqa: E402
from fastvision.data.cache_smart import GPUCacheDataset, SmartCacheDataset  # noqa: E402
from fastvision.data.gpu_aug import build_augment  # noqa: E402
from fastvision.data.loader import ProcessLoader, ThreadLoader  # noqa: E402

BOX, CROP = (96, 96, 64), (64, 64, 48)


def write_volumes(root: Path, n: int, seed: int = 0) -> list[dict[str, str]]:
    """CT-like volumes (air, body, a brighter ellipsoid organ = label 1), 1 x 1 x 2.5 mm voxels."""
    rng = np.random.default_rng(seed)
    shape = (144, 144, 56)
    zz, yy, xx = np.meshgrid(*[np.linspace(-1, 1, s) for s in shape], indexing="ij")
    files = []
    for i in range(n):
        c = rng.uniform(-0.3, 0.3, 3)
        body = (zz ** 2 + yy ** 2) < 0.7 ** 2
        organ = ((zz - c[0]) / 0.25) ** 2 + ((yy - c[1]) / 0.2) ** 2 + ((xx - c[2]) / 0.3) ** 2 < 1
        img = np.where(body, 40.0, -1000.0) + np.where(organ, 80.0, 0.0) + rng.normal(0, 20, shape)
        affine = np.diag([1.0, 1.0, 2.5, 1.0])
        ip, lp = root / f"case{i:03d}.nii.gz", root / f"case{i:03d}_seg.nii.gz"
        nib.save(nib.Nifti1Image(img.astype(np.int16), affine), ip)
        nib.save(nib.Nifti1Image(organ.astype(np.uint8), affine), lp)
        files.append({"image": str(ip), "label": str(lp)})
    return files


class FileList(Dataset):
    """Items ``{"image": path, "label": path}``; identity from the files' path, size and mtime."""

    def __init__(self, files: list[dict[str, str]]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, str]:
        return dict(self.files[i])

    def identity(self, i: int) -> str:
        return files_identity([self.files[i]["image"], self.files[i]["label"]])


def prefix_3d() -> list[Any]:
    from monai import transforms as M

    keys = ["image", "label"]
    return [M.LoadImaged(keys, image_only=True), M.EnsureChannelFirstd(keys), M.Orientationd(keys, axcodes="RAS"),
            M.Spacingd(keys, pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
            M.ScaleIntensityRanged("image", a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
            M.CropForegroundd(keys, source_key="image"), M.ResizeWithPadOrCropd(keys, spatial_size=BOX),
            M.EnsureTyped(keys, track_meta=False)]


class MonaiRead:
    """Microscopy item ``index`` as a MONAI ``Transform`` (so MONAI caches it: plain callables end
    MONAI's cached prefix)."""

    def __new__(cls, dataset: Dataset):
        from monai.transforms import Transform

        class _Read(Transform):
            def __call__(self, d):
                item = dataset[d["index"]]
                return {**item, "label": item["label"][None]}  # MONAI spatial transforms need channel first

        return _Read()


def epoch(loader: Any, aug: Callable | None, gen: torch.Generator, ep: int) -> float:
    """Seconds to draw every batch of one epoch (and augment it, for batched augmentation)."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(ep)
    t0 = time.perf_counter()
    for batch in loader:
        if aug is not None:
            aug(batch["image"], batch["label"], gen)
    return time.perf_counter() - t0


def variants_3d(files, tmp: Path, bs: int, cuda: bool) -> dict[str, tuple[Callable[[], Any], Callable | None]]:
    from monai.data import CacheDataset as MCache, PersistentDataset as MPersist, ThreadDataLoader
    from monai.transforms import Compose, RandCropByPosNegLabeld

    prefix = prefix_3d()
    base = FileList(files)
    aug = build_augment(3, crop={"size": list(CROP), "pos": 1, "neg": 1})
    mrand = RandCropByPosNegLabeld(["image", "label"], "label", spatial_size=CROP, pos=1, neg=1, num_samples=1)
    mono = Compose([*prefix, mrand])
    tl = lambda ds: ThreadLoader(ds, batch_size=bs, shuffle=True, num_workers=0)  # noqa: E731
    out = {
        "(a) plain + process loader": (lambda: ProcessLoader(_Cached(base, prefix), batch_size=bs, shuffle=True,
                                                              num_workers=2), aug),
        "(b) RAM cache + thread loader": (lambda: tl(CacheDataset(base, prefix, progress=False, num_workers=2)), aug),
        "(c) persistent cache": (lambda: tl(_warm(PersistentDataset(base, prefix, tmp / "fv-disk"))), aug),
        "(d) smart cache (half, 25%)": (lambda: tl(SmartCacheDataset(base, prefix, cache_num=len(base) // 2,
                                                                      replace_rate=0.25, num_workers=1,
                                                                      progress=False)), aug),
        "MONAI CacheDataset + ThreadDataLoader": (lambda: ThreadDataLoader(
            MCache(files, mono, num_workers=2, progress=False), batch_size=bs, shuffle=True, num_workers=0), None),
        "MONAI PersistentDataset + ThreadDataLoader": (lambda: ThreadDataLoader(
            _warm(MPersist(files, mono, cache_dir=tmp / "monai-disk")), batch_size=bs, shuffle=True,
            num_workers=0), None),
    }
    if cuda:
        out["(e) GPU cache + GPU aug"] = (lambda: tl(GPUCacheDataset(CacheDataset(base, prefix, progress=False),
                                                                    "cuda")), aug)
    return out


def variants_2d(data: Path, tmp: Path, bs: int, cuda: bool) -> dict[str, tuple[Callable[[], Any], Callable | None]]:
    from monai.data import CacheDataset as MCache, PersistentDataset as MPersist, ThreadDataLoader
    from monai.transforms import Compose, RandFlipd, RandRotate90d

    from fastvision.data.formats.microscopy import microscopy

    ds = microscopy(path=str(data), image_size=[128, 128]).train
    aug = build_augment(2, flip={"axes": [0, 1]}, rot90={})
    keys = ["image", "label"]
    mono = Compose([MonaiRead(ds), RandFlipd(keys, 0.5, 0), RandFlipd(keys, 0.5, 1), RandRotate90d(keys, 0.5)])
    index = [{"index": i} for i in range(len(ds))]
    tl = lambda d: ThreadLoader(d, batch_size=bs, shuffle=True, num_workers=0)  # noqa: E731
    wrap = lambda cache, **kw: wrap_train_set(ds, cache=cache, cache_dir=str(tmp / "fv2d"), **kw)  # noqa: E731
    out = {
        "(a) plain + process loader": (lambda: ProcessLoader(ds, batch_size=bs, shuffle=True, num_workers=2), aug),
        "(b) RAM cache + thread loader": (lambda: tl(wrap("ram")), aug),
        "(c) persistent cache": (lambda: tl(_warm(wrap("disk"))), aug),
        "(d) smart cache (half, 25%)": (lambda: tl(wrap("smart", cache_num=len(ds) // 2, replace_rate=0.25)), aug),
        "MONAI CacheDataset + ThreadDataLoader": (lambda: ThreadDataLoader(
            MCache(index, mono, num_workers=2, progress=False), batch_size=bs, shuffle=True, num_workers=0), None),
        "MONAI PersistentDataset + ThreadDataLoader": (lambda: ThreadDataLoader(
            _warm(MPersist(index, mono, cache_dir=tmp / "monai2d")), batch_size=bs, shuffle=True,
            num_workers=0), None),
    }
    if cuda:
        out["(e) GPU cache + GPU aug"] = (lambda: tl(wrap("gpu", device="cuda")), aug)
    return out


def _warm(ds: Dataset) -> Dataset:
    for i in range(len(ds)):  # writes every entry; the timed epochs then read them
        ds[i]
    return ds


def run(variants: dict[str, tuple[Callable[[], Any], Callable | None]], repeats: int) -> dict[str, dict]:
    """Build every variant (fill timed), then ``repeats`` interleaved rounds of one epoch each."""
    built, res = {}, {}
    for name, (make, aug) in variants.items():
        t0 = time.perf_counter()
        built[name] = (make(), aug)
        res[name] = {"fill_s": time.perf_counter() - t0, "epochs": [], "items": len(built[name][0].dataset)}
    gens = {n: torch.Generator("cuda" if n.startswith("(e)") else "cpu").manual_seed(0) for n in built}
    for r in range(repeats + 1):  # round 0 warms threads, allocators and the page cache
        for name, (loader, aug) in built.items():
            t = epoch(loader, aug, gens[name], r)
            if r:
                res[name]["epochs"].append(t)
    for name, (loader, _) in built.items():
        ds = getattr(loader, "dataset", None)
        if isinstance(ds, SmartCacheDataset):
            ds.shutdown()
    return res


def table(title: str, res: dict[str, dict]) -> str:
    base = statistics.median(res["(a) plain + process loader"]["epochs"])
    lines = [f"\n### {title}\n", "| variant | fill s | items/epoch | epoch s (median) | ms/item | speed-up vs (a), per item |",
             "|---|---:|---:|---:|---:|---:|"]
    per_a = base / res["(a) plain + process loader"]["items"]
    for name, r in res.items():
        med = statistics.median(r["epochs"])
        per = med / r["items"]
        lines.append(f"| {name} | {r['fill_s']:.2f} | {r['items']} | {med:.3f} | {1e3 * per:.2f} | {per_a / per:.1f}x |")
    med = {k: statistics.median(v["epochs"]) for k, v in res.items()}
    lines.append("")
    lines.append(f"- cached vs uncached: (a)/(b) = **{med['(a) plain + process loader'] / med['(b) RAM cache + thread loader']:.1f}x**")
    lines.append(f"- fastvision RAM cache vs MONAI CacheDataset: **{med['MONAI CacheDataset + ThreadDataLoader'] / med['(b) RAM cache + thread loader']:.1f}x**")
    lines.append(f"- fastvision persistent vs MONAI PersistentDataset: **{med['MONAI PersistentDataset + ThreadDataLoader'] / med['(c) persistent cache']:.1f}x**")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--volumes", type=int, default=10)
    ap.add_argument("--images", type=int, default=64, help="microscopy images (256 x 256 PNG)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cuda = torch.cuda.is_available()
    if not cuda:
        print("(e) GPU cache + GPU aug: skipped (no CUDA device)")
    from fastvision.data.synth.microscopy import synth

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "vol").mkdir()
        files = write_volumes(tmp / "vol", args.volumes)
        r3 = run(variants_3d(files, tmp, 2, cuda), args.repeats)
        print(table(f"3-D segmentation: {args.volumes} NIfTI volumes 144x144x56, batch 2, crop {CROP}", r3))
        data = synth(tmp / "micro", seed=0, count=args.images, size=256)
        r2 = run(variants_2d(data, tmp, 16, cuda), args.repeats)
        print(table(f"2-D microscopy: {args.images} PNGs 256x256 -> 128x128, batch 16, flips + rot90", r2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
