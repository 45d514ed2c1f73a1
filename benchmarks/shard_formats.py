"""Shard formats compared on one generated ImageNet-like JPEG set (issue 42, item 1): fastvision's
WebDataset tar shards (``fastvision data shard``), litdata's chunks (``litdata.optimize``) and
MosaicML Streaming's MDS shards (``streaming.MDSWriter``).

All three hold the same training JPEGs as they are (encoded bytes, class index, source path), in
the same order (the fastvision writer's shuffled order), at the same target shard size, written by
one process. Reported per format: write time, bytes on disk, and items/s for

  (a) random access by index in the order fastvision's map-style sampler makes from the format's own
      shard sizes (:func:`fastvision.data.shards.reader.shard_order`, window 2, seed 0): what the
      sampler and ``Position`` resume need (``litdata.StreamingDataset[i]``, Streaming's
      ``get_item(i)``, fastvision's ``ShardReader.sample(i)``), reading the bytes only and also
      decoding each JPEG with Pillow;
  (b) each library's own sequential iteration (``for x in litdata.StreamingDataset``, ``for x in
      streaming.StreamingDataset``, ``for x in webdataset.WebDataset(urls)`` on fastvision's tars,
      and fastvision's reader in index order).

"Per core" is items over the CPU seconds of the process and its children (one torch thread; the
libraries' own reader threads count). Every pass checks that it returned every training sample
once and, for a sample of items, the source file's bytes. Modes run interleaved, ``--rounds``
times; medians. Needs litdata and mosaicml-streaming, which fastvision does not depend on: run it
from a separate venv (see benchmarks/RESULTS.md, issue 42, for its setup):

    nice -n 10 /work/shardcmp-venv/bin/python benchmarks/shard_formats.py --out /tmp/shardfmt \\
        --classes 10 --per-class 300 --size 256 --shard-size 8MB --rounds 3

``import streaming`` imports torchvision (for its own vision datasets, unused here); when torchvision
is absent (fastvision never installs it: a CPU torch has no matching CUDA-free torchvision wheel on
PyPI) the script registers an empty stand-in module first, and says so.
"""
from __future__ import annotations

import argparse
import gc
import importlib.metadata as md
import io
import json
import resource
import shutil
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastvision.data.shards.reader import ShardReader, encoded, shard_order  # noqa: E402
from fastvision.data.shards.store import ShardStore  # noqa: E402
from fastvision.data.shards.writer import write_shards  # noqa: E402
from fastvision.data.synth import load_all  # noqa: E402

FORMATS = ("fastvision (WebDataset tar)", "litdata", "MosaicML Streaming")


def _import_libraries() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType, str]:
    """litdata, streaming and webdataset, and a note when torchvision had to be stood in for."""
    note = ""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        import transformers.feature_extraction_utils  # noqa: F401  (streaming imports it; it probes torchvision)

        stub = {name: types.ModuleType(name) for name in ("torchvision", "torchvision.datasets",
                                                           "torchvision.transforms",
                                                           "torchvision.transforms.functional")}
        stub["torchvision.datasets"].VisionDataset = type("VisionDataset", (), {})
        stub["torchvision.datasets"].CIFAR10 = None
        stub["torchvision.transforms.functional"].to_tensor = None
        sys.modules.update(stub)
        note = "torchvision absent: an empty stand-in module let `import streaming` run"
    import litdata
    import streaming
    import webdataset

    return litdata, streaming, webdataset, note


def _cpu() -> float:
    """CPU seconds of this process (all threads) and its finished children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(fn: Callable[[], int]) -> tuple[float, float, int]:
    """``(items/s, items per CPU second, items)`` of ``fn()``, which returns the items it handled."""
    gc.collect()
    c0, t0 = _cpu(), time.perf_counter()
    n = fn()
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    return n / wall, n / max(cpu, 1e-9), n


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _lit_item(row: tuple[str, int, str]) -> dict:
    path, label, key = row
    return {"image": Path(path).read_bytes(), "cls": label, "id": key}


def write_all(libs, rows: list[tuple[str, int, str]], src: Path, out: Path, size: int) -> dict[str, float]:
    """Write the three formats into fresh folders under ``out``; seconds per format."""
    litdata, streaming, _, _ = libs
    for d in ("fv", "lit", "mds"):
        shutil.rmtree(out / d, ignore_errors=True)
    times = {}
    t0 = time.perf_counter()
    write_shards(src, out / "fv", size)
    times[FORMATS[0]] = time.perf_counter() - t0
    t0 = time.perf_counter()
    litdata.optimize(fn=_lit_item, inputs=rows, output_dir=str(out / "lit"), chunk_bytes=size, num_workers=1,
                     verbose=False, reorder_files=False, keep_data_ordered=True)
    times[FORMATS[1]] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with streaming.MDSWriter(out=str(out / "mds"), columns={"image": "bytes", "cls": "int", "id": "str"},
                             size_limit=size) as w:
        for row in rows:
            w.write(_lit_item(row))
    times[FORMATS[2]] = time.perf_counter() - t0
    return times


class Readers:
    """The three formats opened afresh (one round), each as ``get(i) -> (jpeg bytes, label, id)``."""

    def __init__(self, libs, out: Path):
        litdata, streaming, self.wds, _ = libs
        store = ShardStore(out / "fv")
        self.fv = ShardReader(store, store.index().splits["train"], verify=False)
        self.lit = litdata.StreamingDataset(str(out / "lit"))
        self.mds = streaming.StreamingDataset(local=str(out / "mds"), shuffle=False, batch_size=1)
        self.out = out
        lit_chunks = json.loads((out / "lit" / "index.json").read_text())["chunks"]
        self.counts = {FORMATS[0]: self.fv.counts(), FORMATS[1]: [c["chunk_size"] for c in lit_chunks],
                       FORMATS[2]: [int(s.samples) for s in self.mds.shards]}

    def get(self, fmt: str, i: int) -> tuple[bytes, int, str]:
        if fmt == FORMATS[0]:
            name, m = self.fv.sample(i)
            return encoded(m, name), int(m["cls"]), m["id"].decode()
        x = self.lit[i] if fmt == FORMATS[1] else self.mds.get_item(i)
        return bytes(x["image"]), int(x["cls"]), str(x["id"])

    def iterate(self, fmt: str):
        """The library's own sequential iteration, as (bytes, label, id)."""
        if fmt == FORMATS[0]:
            urls = [str(self.out / "fv" / s.url) for s in self.fv.shards]
            for x in self.wds.WebDataset(urls, shardshuffle=False, empty_check=False):
                yield next(v for k, v in x.items() if k.endswith(("jpeg", "jpg"))), int(x["cls"]), x["id"].decode()
        else:
            src = self.lit if fmt == FORMATS[1] else self.mds
            for x in src:
                yield bytes(x["image"]), int(x["cls"]), str(x["id"])

    def close(self) -> None:
        del self.lit, self.mds
        gc.collect()


def _check(seen: list[tuple[bytes, int, str]], truth: dict[str, tuple[str, int]], what: str) -> None:
    """Every training sample exactly once; bytes and labels of every 50th equal the source file's."""
    ids = [s[2] for s in seen]
    if sorted(ids) != sorted(truth):
        raise SystemExit(f"{what}: read {len(ids)} items, {len(set(ids))} distinct, expected {len(truth)}")
    for data, label, key in seen[::50]:
        path, want = truth[key]
        if data != Path(path).read_bytes() or label != want:
            raise SystemExit(f"{what}: item {key} differs from {path}")


def _decode(data: bytes) -> None:
    Image.open(io.BytesIO(data)).convert("RGB")


def one_round(libs, out: Path, truth: dict, results: dict) -> None:
    """Each format's random-access pass (bytes; bytes + decode) and sequential pass, fresh readers."""
    for fmt in FORMATS:
        for mode in ("random", "random + decode", "sequential"):
            readers = Readers(libs, out)
            order = shard_order(readers.counts[fmt], 2, torch.Generator().manual_seed(0))
            seen: list = []

            def run(fmt=fmt, mode=mode, readers=readers, order=order, seen=seen) -> int:
                if mode == "sequential":
                    seen.extend(readers.iterate(fmt))
                else:
                    for i in order:
                        seen.append(readers.get(fmt, i))
                        if mode == "random + decode":
                            _decode(seen[-1][0])
                return len(seen)

            results.setdefault((fmt, mode), []).append(_timed(run)[:2])
            _check(seen, truth, f"{fmt} {mode}")
            readers.close()


def versions(note: str) -> str:
    names = ("litdata", "mosaicml-streaming", "webdataset", "torch", "pillow")
    text = ", ".join(f"{n} {md.version(n)}" for n in names) + f"; Python {sys.version.split()[0]}"
    return text + (f"; {note}" if note else "")


def requirements(dist: str) -> str:
    """A distribution's unconditional requirements (what ``pip install`` pulls)."""
    reqs = [r.split(";")[0].split(">")[0].split("<")[0].split("=")[0].split("!")[0].strip()
            for r in md.requires(dist) or [] if "extra ==" not in r]
    return ", ".join(reqs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/shardfmt")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--per-class", type=int, default=300)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--shard-size", default="8MB")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    libs = _import_libraries()
    out = Path(args.out)
    src = out / "src"
    if not (src / "train").is_dir():
        load_all().get("imagenet")(src, seed=0, classes=args.classes, per_class=args.per_class, val_per_class=1,
                                   size=args.size, height=args.size * 3 // 4)
    from fastvision.data.shards.writer import parse_size

    size = parse_size(args.shard_size)
    write_shards(src, out / "fv", size)  # the writer's order, which the other two formats are given too
    reader = ShardReader(ShardStore(out / "fv"), ShardStore(out / "fv").index().splits["train"], verify=False)
    rows = [(str(src / m["id"].decode()), int(m["cls"]), m["id"].decode())
            for m in (reader.sample(i)[1] for i in range(len(reader)))]
    truth = {key: (path, label) for path, label, key in rows}
    writes: dict[str, list[float]] = {}
    results: dict = {}
    for _ in range(args.rounds):
        for fmt, s in write_all(libs, rows, src, out, size).items():
            writes.setdefault(fmt, []).append(s)
        one_round(libs, out, truth, results)
    report(args, libs, out, rows, writes, results)


def report(args, libs, out: Path, rows, writes, results) -> None:
    dirs = dict(zip(FORMATS, ("fv", "lit", "mds"), strict=True))
    readers = Readers(libs, out)
    print(f"measured with {versions(libs[3])}")
    source_mb = sum(Path(p).stat().st_size for p, _, _ in rows) / 1e6
    print(f"{len(rows)} training JPEGs {args.size}x{args.size * 3 // 4} ({source_mb:.1f} MB), "
          f"target shard size {args.shard_size}, {args.rounds} interleaved rounds, medians")
    doc: dict = {"versions": versions(libs[3]), "items": len(rows), "formats": {}}
    print(f"{'format':28} {'shards':>6} {'MB':>7} {'write s':>7} | items/s (per CPU s): "
          "random | random+decode | sequential")
    for fmt in FORMATS:
        med = {mode: tuple(statistics.median(v[k] for v in results[(fmt, mode)]) for k in (0, 1))
               for mode in ("random", "random + decode", "sequential")}
        entry = {"shards": len(readers.counts[fmt]), "mb": round(_du(out / dirs[fmt]) / 1e6, 2),
                 "write_s": round(statistics.median(writes[fmt]), 2),
                 **{mode: [round(w), round(c)] for mode, (w, c) in med.items()}}
        doc["formats"][fmt] = entry
        cells = " | ".join(f"{w:8.0f} ({c:6.0f})" for w, c in med.values())
        print(f"{fmt:28} {entry['shards']:6d} {entry['mb']:7.1f} {entry['write_s']:7.2f} | {cells}")
    readers.close()
    for dist in ("litdata", "mosaicml-streaming", "webdataset"):
        doc[f"requires {dist}"] = requirements(dist)
        print(f"{dist} requires: {doc[f'requires {dist}']}")
    (out / "report.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
