"""Per-file folder against a shard set: files opened per epoch and training items/s per host core,
from local disk and over HTTP (a local ``http.server`` adding a fixed latency per request; the
first epoch fills the shard cache, a later one reads it).

One thread reads and decodes each training item (the cache pipeline: encoded bytes, then the
random-resized crop to 224 with its flip), in the training order of epoch 0 (the folder's uniform
permutation, the shards' shard-aware one). Opens are counted with a Python audit hook ("open"
events for .JPEG and .tar files). Modes run interleaved, ``--rounds`` times; medians reported.

    python benchmarks/shards.py --out /tmp/shardbench --classes 10 --per-class 400 --size 256
"""
from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastvision.data.formats.imagefolder import build as folder_build  # noqa: E402
from fastvision.data.formats.shard_sets import build_shards  # noqa: E402
from fastvision.data.shards.writer import write_shards  # noqa: E402
from fastvision.data.synth import load_all  # noqa: E402
from fastvision.distributed.samplers import TrainSampler  # noqa: E402

OPENS = {"n": 0}


def _audit(event: str, args) -> None:
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and str(args[0]).endswith((".JPEG", ".tar")):
        OPENS["n"] += 1


class _Slow(http.server.SimpleHTTPRequestHandler):
    latency = 0.02

    def do_GET(self):
        time.sleep(self.latency)
        super().do_GET()

    def log_message(self, *args):
        pass


def _epoch(ds, limit: int) -> tuple[float, int]:
    """Items/s and files opened reading the first ``limit`` items of epoch 0's training order."""
    base, (read, crop) = ds.cache_pipeline()
    sampler = TrainSampler(len(ds), num_replicas=1, rank=0, seed=0, order=getattr(ds, "epoch_order", None))
    sampler.set_epoch(0)
    order = list(sampler)[:limit]
    OPENS["n"] = 0
    t0 = time.perf_counter()
    for i in order:
        crop(read(base[i]), torch.Generator().manual_seed(i))
    return len(order) / (time.perf_counter() - t0), OPENS["n"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/shardbench")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--per-class", type=int, default=400)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--shard-size", default="64MB")
    ap.add_argument("--items", type=int, default=0, help="items timed per epoch (0: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    src = out / "src"
    if not (src / "train").is_dir():
        load_all().get("imagenet")(src, seed=0, classes=args.classes, per_class=args.per_class, val_per_class=1,
                                   size=args.size, height=args.size * 3 // 4)
    t0 = time.perf_counter()
    write_shards(src, out / "shards", args.shard_size)
    shard_s = time.perf_counter() - t0
    sys.addaudithook(_audit)
    kw = {"image_size": 224}
    folder = folder_build(path=str(src), **kw).train
    local = build_shards(str(out / "shards"), "imagefolder", kw).train
    _Slow.latency = args.latency_ms / 1000
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Slow, directory=str(out / "shards")))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    limit = args.items or len(folder)
    rows: dict[str, list[tuple[float, int]]] = {k: [] for k in ("folder", "shards local", "HTTP first epoch",
                                                                 "HTTP later epoch")}
    for r in range(args.rounds):
        rows["folder"].append(_epoch(folder, limit))
        rows["shards local"].append(_epoch(build_shards(str(out / "shards"), "imagefolder", kw).train, limit))
        remote = build_shards(url, "imagefolder", kw, shard_cache_dir=str(out / f"cache{r}")).train
        rows["HTTP first epoch"].append(_epoch(remote, limit))
        later = build_shards(url, "imagefolder", kw, shard_cache_dir=str(out / f"cache{r}")).train
        rows["HTTP later epoch"].append(_epoch(later, limit))
    httpd.shutdown()
    base = statistics.median(v for v, _ in rows["folder"])
    report = {"items": limit, "train_images": len(folder), "shards": len(local.reader.shards),
              "write_s": round(shard_s, 1), "rows": {}}
    print(f"{len(folder)} JPEGs {args.size}x{args.size * 3 // 4}, {len(local.reader.shards)} shards of "
          f"{args.shard_size}; {limit} items timed per epoch, {args.rounds} rounds; sharding took {shard_s:.1f} s")
    print(f"{'mode':18} {'items/s/core':>12} {'vs folder':>9} {'files opened':>12}")
    for name, vals in rows.items():
        rate, opens = statistics.median(v for v, _ in vals), max(o for _, o in vals)
        report["rows"][name] = {"items_per_s": round(rate, 1), "ratio": round(rate / base, 2), "opens": opens}
        print(f"{name:18} {rate:12.1f} {rate / base:9.2f} {opens:12d}")
    (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
