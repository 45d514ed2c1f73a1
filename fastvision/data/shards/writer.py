"""``fastvision data shard SRC OUT``: write a dataset as WebDataset tar shards plus ``shards.json``.

Shards hold the files as they are (the encoded JPEG/PNG bytes) and their labels, so a shard set
is about the size of the dataset. Each split's samples are written in one fixed shuffled order
(``torch.randperm`` of the writer seed, recorded in the index): a shard then mixes the classes
instead of holding one, which the shard-aware training order relies on. Shard boundaries follow
from the member sizes alone, so they are known before a byte is written.

The writer is deterministic (same input and options, same bytes: fixed tar metadata and order)
and resumable: a shard goes to a temporary file and is renamed into place when complete, so after
an interruption every shard present is whole; the next run checks each one present (size, tar
structure, sample count, member names and sizes, the bytes of the members it made) and writes only
the missing ones. A finished shard is never rewritten.
The index is written last; a shard set without ``shards.json`` is unfinished.

Members of sample ``<key>`` (WebDataset groups members by key):
  ImageFolder: ``<key>.<jpeg|png|...>`` the file, ``<key>.cls`` the class index (decimal text),
  ``<key>.id`` the file's path relative to SRC.
  COCO: ``<key>.<ext>`` the image, ``<key>.json`` ``{"image": the COCO image record,
  "annotations": its usable annotations}``; the validation annotation file is copied beside.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastvision.data.shards import tario
from fastvision.data.shards.store import INDEX, SHARD_NAME, Shard, ShardIndex, index_doc, parse_index
from fastvision.errors import ConfigError, DataError
from fastvision.utils.files import atomic_write

log = logging.getLogger(__name__)
WRITER_SEED = 0
# atomic_write's partial file of a shard (SHARD_NAME: write_split's names), of the index, or of a copied annotation file
TEMP_NAME = re.compile(rf"\.(?:{SHARD_NAME.pattern}|shards\.json|instances_[^/]*\.json)\.(?:[^/]+\.tmp|tmp[^/]*)")


@dataclass
class Member:
    """One file of a sample: extension, byte size, and how to read its bytes."""

    ext: str
    size: int
    read: Callable[[], bytes]
    path: Path | None = None  # the source file (None: a generated member)


def _file(path: str | Path, ext: str | None = None) -> Member:
    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError as e:
        raise DataError(f"{p}: cannot read ({e})") from e
    return Member(ext or p.suffix.lower().lstrip(".") or "bin", size, p.read_bytes, p)


def _text(data: bytes, ext: str) -> Member:
    return Member(ext, len(data), lambda: data)


def parse_size(text: str | int) -> int:
    """``"256MB"`` / ``"1.5GB"`` / ``"64KiB"`` / ``1000`` -> bytes."""
    if isinstance(text, int):
        return text
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 1024, "MIB": 1024 ** 2, "GIB": 1024 ** 3}
    s = text.strip().upper()
    num = s.rstrip("KMGIB")
    try:
        value = int(float(num) * units[s[len(num):]])
    except (KeyError, ValueError):
        raise ConfigError(f"--shard-size {text!r}: expected a size like 256MB, 1GB or 64KiB") from None
    if value < tario.BLOCK * 4:
        raise ConfigError(f"--shard-size {text!r}: at least 2KB")
    return value


def imagefolder_source(src: Path, skip_unreadable: bool = False
                       ) -> tuple[dict[str, Any], dict[str, list[list[Member]]], dict[str, Path]]:
    """ImageFolder / ImageNet layout: ``(info, {split: [sample members]}, files to copy)``.

    Every image is checked first (header, and its end marker or a full decode: a truncated download
    is found), before a shard is written: files training would stop on are one DataError naming
    the count and the first ones, or, with ``skip_unreadable``, left out with one warning.
    """
    from fastvision.data.formats.imagefolder import build

    splits = build(path=str(src), skip_unreadable=skip_unreadable)  # skipping: the builder's probe and warning
    if not skip_unreadable:
        _check_decodes(src, [p for ds in (splits.train, splits.val) for p, _ in ds.samples])
    out = {}
    for name, ds in (("train", splits.train), ("val", splits.val)):
        out[name] = [[_file(p), _text(str(label).encode(), "cls"),
                      _text(os.path.relpath(p, src).encode(), "id")] for p, label in ds.samples]
    info = {k: splits.info[k] for k in ("classes", "num_classes")}
    return info, out, {}


def _check_decodes(src: Path, files: list[str | Path]) -> None:
    """Every image decodes (header, and its end marker or a full decode: a truncated download is found),
    before a shard is written; else one DataError naming the count and the first ones."""
    from fastvision.data.formats.anomalies import first_few, undecodable

    bad = [os.path.relpath(p, src) for p in undecodable(files)]
    if bad:
        raise DataError(f"{src}: {len(bad)} image file(s) that do not decode ({first_few(bad)}); nothing "
                        "written: fix or remove them, or pass --skip-unreadable to leave them out")


def _coco_splits(src: Path) -> tuple[str, str]:
    names = sorted(p.name[len("instances_"):-len(".json")] for p in (src / "annotations").glob("instances_*.json"))
    train = [n for n in names if "train" in n]
    val = [n for n in names if "val" in n]
    if len(train) != 1 or len(val) != 1:
        raise DataError(f"{src / 'annotations'}: expected one instances_<train split>.json and one "
                        f"instances_<val split>.json, found {', '.join(names) or 'none'}")
    return train[0], val[0]


def coco_source(src: Path, skip_unreadable: bool = False
                ) -> tuple[dict[str, Any], dict[str, list[list[Member]]], dict[str, Path]]:
    """COCO layout: each image with a JSON member of its record and usable annotations. Images that are
    missing or do not decode are one DataError before a shard is written or, with ``skip_unreadable``,
    left out with one warning (the reader's); an image stored at another size than its width/height is one
    DataError (the reader's)."""
    from fastvision.data.formats.coco import build
    from fastvision.data.formats.coco_check import check_images

    train_split, val_split = _coco_splits(src)
    splits = build(path=str(src), train_split=train_split, val_split=val_split, skip_unreadable=skip_unreadable)
    if not skip_unreadable:
        _check_decodes(src, [ds.path(i) for ds in (splits.train, splits.val) for i in range(len(ds))])
    # the training images' sizes too (the reader checks the validation ones when it is built, a training
    # image only when read: a shard set would carry it to training)
    check_images([splits.train.coco.imgs[i] for i in splits.train.ids], splits.train.image_dir,
                 splits.train.ann_file.name, decode=False)
    out = {}
    for name, ds in (("train", splits.train), ("val", splits.val)):
        rows = []
        for i, image_id in enumerate(ds.ids):
            anns = ds.coco.imgToAnns.get(image_id, [])  # the usable ones (the index holds only those)
            doc = json.dumps({"image": ds.coco.imgs[image_id], "annotations": anns}, sort_keys=True).encode()
            rows.append([_file(ds.path(i)), _text(doc, "json")])
        out[name] = rows
    info = {"cat_ids": splits.info["cat_ids"], "class_names": splits.info["class_names"],
            "classes": splits.info["classes"], "num_classes": splits.info["num_classes"]}  # classes: as the reader's
    return info, out, {"val_ann_file": Path(splits.info["val_ann_file"])}


SOURCES = {"imagefolder": imagefolder_source, "coco": coco_source}


def detect_source(src: Path) -> str:
    if not src.is_dir():
        raise DataError(f"{src}: dataset folder not found")
    if any((src / "annotations").glob("instances_*.json")):
        return "coco"
    if (src / "train").is_dir():
        return "imagefolder"
    raise DataError(f"{src}: neither an ImageFolder/ImageNet folder (train/<class>/) nor COCO "
                    f"(annotations/instances_*.json); `fastvision data shard` reads those")


def plan(samples: list[list[Member]], shard_size: int) -> list[list[int]]:
    """Sample indices of each shard: a shard closes when the next sample would pass ``shard_size``."""
    shards: list[list[int]] = [[]]
    used = tario.BLOCK * 2
    for i, members in enumerate(samples):
        need = tario.member_bytes(m.size for m in members)
        if shards[-1] and used + need > shard_size:
            shards.append([])
            used = tario.BLOCK * 2
        shards[-1].append(i)
        used += need
    return shards if shards[0] else []


def _existing(path: Path, keys: list[str], rows: list[list[Member]]) -> Shard:
    """The record of a shard a previous run finished; DataError if it is not the planned shard: its size,
    its members' names and sizes, and the bytes of the members the writer made (labels, ids, COCO
    records: a class or an annotation changed since, with every size the same) must be this input's."""
    expected = sum(tario.member_bytes(m.size for m in r) for r in rows) + len(tario.END)
    size = path.stat().st_size
    if size != expected:
        raise DataError(f"{path}: {size} bytes where this input makes {expected}: the source or "
                        f"--shard-size changed since it was written (remove {path.parent} to start over)")
    table, sha = tario.scan(path, path.name, verify=True)
    found = len(tario.samples(table))
    if found != len(rows):
        raise DataError(f"{path}: {found} samples where this input makes {len(rows)} (remove {path.parent} to "
                        "start over)")
    planned = [(f"{key}.{m.ext}", m) for key, members in zip(keys, rows, strict=True) for m in members]
    if len(table) != len(planned):
        raise DataError(f"{path}: {len(table)} members where this input makes {len(planned)} (remove "
                        f"{path.parent} to start over)")
    with open(path, "rb") as f:
        for (name, m), (got, (offset, n)) in zip(planned, table.items(), strict=True):
            same = got == name and n == m.size
            if same and m.path is None:  # made by the writer: small, compared byte for byte
                f.seek(offset)
                same = f.read(n) == m.read()
            if not same:
                raise DataError(f"{path}: member {got} is not what this input makes ({name}): the source "
                                f"changed since it was written (remove {path.parent} to start over)")
    return Shard(path.name, len(rows), size, sha or "")


def _write_shard(path: Path, keys: list[str], rows: list[list[Member]]) -> Shard:
    digest = hashlib.sha256()

    def write(f) -> None:
        for key, members in zip(keys, rows, strict=True):
            for m in members:
                data = m.read()
                if len(data) != m.size:
                    raise DataError(f"{key}.{m.ext}: changed size while being sharded")
                tario.write_member(f, f"{key}.{m.ext}", data, digest)
        f.write(tario.END)
        digest.update(tario.END)

    atomic_write(path, write)  # whole or absent: a killed writer leaves no partial shard under this name
    return Shard(path.name, len(rows), path.stat().st_size, digest.hexdigest())


def write_split(out: Path, split: str, samples: list[list[Member]], shard_size: int) -> list[Shard]:
    """Write (or complete) one split's shards in the writer's shuffled order."""
    g = torch.Generator()
    g.manual_seed(WRITER_SEED)
    order = torch.randperm(len(samples), generator=g).tolist()
    done = []
    for k, idx in enumerate(plan([samples[i] for i in order], shard_size)):
        path = out / f"{split}-{k:06d}.tar"
        keys = [f"{j:08d}" for j in idx]  # the position in the written order: unique and dot-free
        rows = [samples[order[j]] for j in idx]
        if path.exists():
            done.append(_existing(path, keys, rows))
        else:
            done.append(_write_shard(path, keys, rows))
            log.debug("%s: %d samples, %.1f MB", path, len(rows), done[-1].filesize / 1e6)
    return done


def _is_writers(p: Path) -> bool:
    """A file ``data shard`` writes into OUT: the index, a shard, a killed writer's temporary file, or the
    ``annotations/`` folder of copied annotation files (COCO's)."""
    temp = lambda q: TEMP_NAME.fullmatch(q.name) is not None  # noqa: E731  (atomic_write's partial file)
    if p.is_dir():
        return p.name == "annotations" and all(q.is_file() and (q.suffix == ".json" or temp(q)) for q in p.iterdir())
    return p.name == INDEX or SHARD_NAME.fullmatch(p.name) is not None or temp(p)


def check_out(out: Path, src: Path, source: str, info: dict[str, Any], force: bool = False) -> None:
    """Refuse ``out`` unless it is absent, empty, or a shard set of this source: only the writer's files
    (an unfinished set, completed by this run) and, once finished, an index of the same format and
    dataset facts. A user's folder is never written into (nor its files taken for stale shards).
    ``force``: other files may be there; a finished index must still be this source's."""
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a folder; choose a new output folder")
    if not out.is_dir():
        return
    foreign = [] if force else sorted(p.name for p in out.iterdir() if not _is_writers(p))
    if foreign:
        more = f", ... ({len(foreign)} entries)" if len(foreign) > 3 else ""
        raise DataError(f"{out}: exists and is not a shard set (holds {', '.join(foreign[:3])}{more}); "
                        f"choose a new output folder, or pass --force to write the shards beside them")
    if (out / INDEX).is_file():
        try:
            index = parse_index(json.loads((out / INDEX).read_bytes()), str(out), str(out / INDEX))
        except (OSError, ValueError) as e:
            raise DataError(f"{out / INDEX}: not a readable shard index ({e})") from e
        if index.source != source or index.info != json.loads(json.dumps(info)):
            raise DataError(f"{out}: a shard set of another dataset than {src} ({index.source}, "
                            f"{index.info.get('num_classes', '?')} classes); choose a new output folder")


def check_apart(out: Path, src: Path, splits: dict[str, list[list[Member]]]) -> None:
    """Refuse an ``out`` inside a folder the source's images are read from (``SRC/train`` or a class
    folder, COCO's image folders): the shards would become part of the dataset (an ImageFolder class
    of no images, a source that no longer reads). Beside them (``SRC/shards``) is fine."""
    top = src.resolve()
    folders = {m.path.parent for rows in splits.values() for row in rows for m in row if m.path is not None}
    read = {d for f in folders for r in [f.resolve()] for d in (r, *r.parents) if top in d.parents}
    target = out.resolve()
    hit = next((d for d in (target, *target.parents) if d in read), None)
    if hit is not None:
        raise DataError(f"{out}: inside {hit}, a folder the dataset {src} is read from (the shards would "
                        f"become part of it); choose an output folder outside it")


def _recorded_size(out: Path) -> int | str:
    """The shard size a finished set at ``out`` was written with (its index's ``writer``), else 256MB: a
    rerun without ``--shard-size`` checks the set as written instead of refusing each shard's size."""
    try:
        return int(json.loads((out / INDEX).read_bytes())["writer"]["shard_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return "256MB"


def write_shards(src: str | Path, out: str | Path, shard_size: int | str | None = None,
                 source: str | None = None, force: bool = False, skip_unreadable: bool = False) -> ShardIndex:
    """Shard dataset ``src`` into ``out`` (see the module docstring); returns the written index.

    Args:
        src: an ImageFolder/ImageNet or COCO dataset folder.
        out: the shard set folder: absent or empty, or a shard set of ``src`` (an unfinished one is
            completed, a finished one checked); any other folder is refused (:func:`check_out`).
        shard_size: target bytes per shard (``"256MB"``); a sample larger than it gets a shard alone.
            None: a finished set's own (its index's), else 256MB.
        source: ``imagefolder`` or ``coco`` (default: detected from ``src``'s layout).
        force: write into any existing folder (shards already there must still be this input's).
        skip_unreadable: leave out, with one warning, images that are missing (COCO) or do not decode
            (else they are one error before anything is written).
    """
    src, out = Path(src), Path(out)
    size = parse_size(_recorded_size(out) if shard_size is None else shard_size)
    source = source or detect_source(src)
    if source not in SOURCES:
        raise ConfigError(f"data shard --format {source!r}: one of {', '.join(SOURCES)}")
    try:
        info, splits, files = SOURCES[source](src, skip_unreadable)
    except DataError as e:  # the readers' way out is training's key; this command's is its flag or SRC
        said = str(e).replace("data.args.skip_unreadable=true", "--skip-unreadable")
        raise DataError(said.replace("--data (data.args.path) is the folder", "SRC is the folder")) from None
    check_apart(out, src, splits)
    check_out(out, src, source, info, force)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*tmp*"):  # a killed writer's partial shard: never one a reader sees
        if TEMP_NAME.fullmatch(stale.name):  # only the writer's own (with --force a user's files are beside)
            stale.unlink()
    index = ShardIndex(str(out), source, info, {}, writer={"seed": WRITER_SEED, "shard_size": size})
    for split, samples in splits.items():
        index.splits[split] = write_split(out, split, samples, size)
    for key, path in files.items():
        rel = f"{path.parent.name}/{path.name}"
        data = path.read_bytes()
        atomic_write(out / rel, lambda f, data=data: f.write(data))
        index.files[key] = rel
    doc = json.dumps(index_doc(index), indent=1).encode()
    atomic_write(out / INDEX, lambda f: f.write(doc))
    return index
