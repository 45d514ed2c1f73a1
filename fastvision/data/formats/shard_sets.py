"""``--data OUT`` on a shard set: the ImageFolder and COCO builders read shards when given one.

:func:`recognise` wraps a registered dataset builder so that a ``path`` holding ``shards.json``
(or an ``http(s)://`` URL of one) is read by :func:`build_shards` with the same item arguments
(image size, crop, flip, ...), and adds the shard options to its ``data.args``:

  shard_cache_dir   node-local cache of shards fetched over HTTP (default ~/.cache/fastvision/shards)
  shard_cache_gb    cache size limit, every set's together; least recently used shards are evicted (default 100)
  shard_retries     extra tries after an HTTP error or timeout (default 3)
  shard_timeout_s   per-request timeout (default 30)
  shard_verify      check a local shard's sha256 when a process first opens it (default true)
  shard_window      shards whose samples are shuffled together in the training order (default 2)
  tfrecord_label_offset  subtracted from a TFRecord's image/class/label (default 1: DLE's 1-1000)

A folder of DLE ImageNet TFRecords (``train-*-of-*``, ``validation-*-of-*``) is recognised by
the ImageFolder builder too (:mod:`fastvision.data.shards.tfrecord`): its files are read as shards without an index.

A shard set written from one format is read by that format's recipes only. Options that shaped
the source when it was sharded (split folders, val labels, ``invalid``) do not apply to shards.
``skip_unreadable: true`` checks every shard when the dataset is built (fetching remote ones into
the cache) and leaves out the ones that fail, with one warning counting them; without it, a bad
shard stops the run with one line naming it when it is first read.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
from pathlib import Path
from typing import Any

from fastvision.data.formats.base import DatasetSplits
from fastvision.data.formats.shards import ShardCoco, ShardImageFolder
from fastvision.data.shards.reader import ShardReader
from fastvision.data.shards.remote import NotFound
from fastvision.data.shards.store import ShardIndex, ShardStore, is_shard_set, unfinished_set
from fastvision.data.shards.tfrecord import imagenet_members, is_tfrecord_set
from fastvision.errors import ConfigError, DataError
from fastvision.utils.files import atomic_write

log = logging.getLogger(__name__)

SHARD_ARGS: dict[str, tuple[str, Any]] = {  # name: (annotation, default)
    "shard_cache_dir": ("str | None", None), "shard_cache_gb": ("float", 100.0), "shard_retries": ("int", 3),
    "shard_timeout_s": ("float", 30.0), "shard_verify": ("bool", True), "shard_window": ("int", 2),
    "tfrecord_label_offset": ("int", 1),
}
ITEM_ARGS = {  # the source builder's item arguments -> the shard dataset's
    "imagefolder": {"image_size": "image_size", "resize_size": "resize_size", "scale": "scale", "ratio": "ratio",
                    "hflip": "hflip"},
    "coco": {"image_size": "image_size", "crop": "crop", "flip": "flip", "color_jitter": "jitter"},
}


def _readers(store: ShardStore, index: ShardIndex, verify: bool, skip: bool) -> dict[str, ShardReader]:
    """One reader per split; a shard whose file disagrees with the index (size, or under ``skip`` any
    check) is an error naming it, or is left out with one counted warning."""
    readers, bad, lost = {}, [], 0
    for split, shards in index.splits.items():
        good = []
        for shard in shards:
            try:
                if not store.remote:
                    _check_size(Path(store.base) / shard.url, shard.filesize, store.name(shard.url))
                if skip:
                    ShardReader(store, [shard], verify).check(0)
                good.append(shard)
            except DataError as e:
                if not skip:
                    raise
                bad.append(str(e))
                lost += shard.nsamples
        readers[split] = ShardReader(store, good, verify)
    if bad:
        log.warning("%s: skipped %d unreadable shard(s), %d samples (data.args.skip_unreadable=true); first: %s",
                    store.base, len(bad), lost, bad[0])
    return readers


def _check_size(path: Path, size: int, name: str) -> None:
    try:
        found = path.stat().st_size
    except OSError as e:
        raise DataError(f"{name}: shard listed in the index not found ({e.strerror})") from e
    if found != size:
        raise DataError(f"{name}: {found} bytes, the index says {size}: a truncated or replaced shard "
                        f"(the index disagrees with its shards)")


def check_shard_args(shard_window: int = 2, shard_cache_gb: float = 100.0, shard_retries: int = 3,
                     shard_timeout_s: float = 30.0) -> None:
    """The shard arguments in range, one ConfigError naming the key: before, a negative cache limit or
    retry count and a zero timeout failed at the first shard fetched (after the run folder was made), a
    retry count below 0 as a traceback."""
    for key, value, ok, want in (("shard_window", shard_window, shard_window >= 1, "at least 1"),
                                 ("shard_cache_gb", shard_cache_gb, 0 < shard_cache_gb < math.inf,
                                  "a positive number of GB"),
                                 ("shard_retries", shard_retries, shard_retries >= 0, "0 or more"),
                                 ("shard_timeout_s", shard_timeout_s, 0 < shard_timeout_s < math.inf,
                                  "a positive number of seconds")):
        if not ok:
            raise ConfigError(f"data.args.{key}: {want}, got {value}")


def build_shards(path: str, fmt: str, item_args: dict[str, Any], skip_unreadable: bool = False,
                 shard_cache_dir: str | None = None, shard_cache_gb: float = 100.0, shard_retries: int = 3,
                 shard_timeout_s: float = 30.0, shard_verify: bool = True, shard_window: int = 2,
                 tfrecord_label_offset: int = 1) -> DatasetSplits:
    """Train/val splits of the shard set at ``path`` for a ``fmt`` recipe (see the module docstring)."""
    check_shard_args(shard_window, shard_cache_gb, shard_retries, shard_timeout_s)
    store = ShardStore(path, shard_cache_dir, shard_cache_gb, shard_retries, shard_timeout_s)
    if store.cache is not None:  # a file where the cache is to be: one line now, not at the first shard
        try:
            store.cache.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"data.args.shard_cache_dir: cannot make the shard cache {store.cache} "
                              f"({e.strerror or e})") from None
    try:
        index = store.index()
    except NotFound as missing:
        if fmt != "imagefolder" or not store.remote:
            raise
        try:  # a URL of DLE ImageNet TFRecords has no shards.json
            return build_tfrecords(store, item_args, skip_unreadable, shard_window, shard_verify,
                                   tfrecord_label_offset)
        except NotFound as e:
            raise DataError(f"{missing}; not a TFRecord folder either: {e}") from None
    if index.source != fmt:
        raise ConfigError(f"{store.name('shards.json')}: a shard set of {index.source} data; this recipe "
                          f"reads {fmt}")
    if set(index.splits) != {"train", "val"}:
        raise DataError(f"{store.name('shards.json')}: splits {sorted(index.splits)}, expected train and val")
    readers = _readers(store, index, shard_verify, skip_unreadable)
    kw = {ITEM_ARGS[fmt][k]: v for k, v in item_args.items() if k in ITEM_ARGS[fmt]}
    facts = {"shards": {s: len(r.shards) for s, r in readers.items()}, "shard_set": store.base,
             "train_images": len(readers["train"]), "val_images": len(readers["val"])}
    if fmt == "imagefolder":
        info = {**index.info, **facts}
        return DatasetSplits(ShardImageFolder(readers["train"], True, shard_window, **kw),
                             ShardImageFolder(readers["val"], False, shard_window, **kw), info)
    cat_ids = index.info["cat_ids"]
    info = {**index.info, **facts, "image_size": kw.get("image_size", 320), "val_ann_file": _val_ann(store, index)}
    return DatasetSplits(ShardCoco(readers["train"], cat_ids, True, shard_window, **kw),
                         ShardCoco(readers["val"], cat_ids, False, shard_window, **kw), info)


def build_tfrecords(store: ShardStore, item_args: dict[str, Any], skip_unreadable: bool = False,
                    shard_window: int = 2, shard_verify: bool = True, tfrecord_label_offset: int = 1) -> DatasetSplits:
    """Train/val splits of a folder of DLE ImageNet TFRecords, local or at a URL without a
    ``shards.json`` (:mod:`fastvision.data.shards.tfrecord`): each file is a shard whose record
    offsets come from one pass over its headers (a remote file fetched into the cache for it)."""
    from fastvision.data.shards import tfrecord

    check_shard_args(shard_window)
    convert = functools.partial(imagenet_members, label_offset=tfrecord_label_offset)
    splits, bad = tfrecord.split_shards(store, shard_verify and store.remote, skip_unreadable)
    readers = {split: ShardReader(store, shards, shard_verify, scan=tfrecord.scan, convert=convert)
               for split, shards in splits.items()}
    if bad:
        log.warning("%s: skipped %d unreadable TFRecord file(s) (data.args.skip_unreadable=true); first: %s",
                    store.base, len(bad), bad[0])
    kw = {k: v for k, v in item_args.items() if k in ITEM_ARGS["imagefolder"]}
    info = {"shards": {s: len(r.shards) for s, r in readers.items()}, "shard_set": f"{store.base} (TFRecords)",
            "train_images": len(readers["train"]), "val_images": len(readers["val"])}
    return DatasetSplits(ShardImageFolder(readers["train"], True, shard_window, **kw),
                         ShardImageFolder(readers["val"], False, shard_window, **kw), info)


def _val_ann(store: ShardStore, index: ShardIndex) -> str:
    """A local copy of the set's validation annotation file (the COCO evaluator reads it)."""
    rel = index.files.get("val_ann_file")
    if rel is None:
        raise DataError(f"{store.name('shards.json')}: no val_ann_file (a COCO shard set copies its annotations)")
    if not store.remote:
        return str(Path(store.base) / rel)
    assert store.cache is not None
    local = store.cache / rel
    data = store.read_small(rel)
    atomic_write(local, lambda f: f.write(data))
    return str(local)


def recognise(registry, name: str) -> None:
    """Make registered builder ``name`` read a shard set when its ``path`` is one (module docstring)."""
    fn = registry.get(name)
    if getattr(fn, "reads_shards", False):
        return

    @functools.wraps(fn)
    def builder(*, path: str, **kwargs: Any) -> DatasetSplits:
        shard = {k: kwargs.pop(k, default) for k, (_, default) in SHARD_ARGS.items()}
        if name == "imagefolder":  # the folder's builder checks them too; shard sets and TFRecords here
            from fastvision.data.formats.imagefolder import check_crop_args

            check_crop_args(**kwargs)
        if name == "imagefolder" and is_tfrecord_set(path):
            remote = ("shard_cache_dir", "shard_cache_gb", "shard_retries", "shard_timeout_s")
            return build_tfrecords(ShardStore(path), kwargs, kwargs.get("skip_unreadable", False),
                                   **{k: v for k, v in shard.items() if k not in remote})
        if not is_shard_set(path):
            if unfinished := unfinished_set(path):
                raise DataError(unfinished)
            return fn(path=path, **kwargs)
        if kwargs.get("backend", "pillow") != "pillow":
            raise ConfigError(f"data.args.backend={kwargs['backend']}: shard sets are read by the pillow backend")
        return build_shards(path, name, kwargs, kwargs.get("skip_unreadable", False), **shard)

    sig = inspect.signature(fn)
    extra = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=d) for k, (_, d) in SHARD_ARGS.items()]
    builder.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *extra])
    builder.__annotations__ = {**fn.__annotations__, **{k: a for k, (a, _) in SHARD_ARGS.items()}}
    builder.reads_shards = True
    registry.replace(name, builder)


def inspect_set(path: str | Path) -> dict[str, Any]:
    """``data inspect`` of a shard set (a folder or a URL): source, splits, and every shard read in
    full (sha256, tar structure, sample count against the index; a remote shard is fetched into the
    default cache for it); a bad shard is listed as unusable."""
    store = ShardStore(path)
    index = store.index()
    report: dict[str, Any] = {"detected": f"WebDataset tar shards of {index.source} data",
                              "shard size": f"{index.writer.get('shard_size', 0) / 1e6:.3g} MB (target)"}
    bad: list[str] = []
    for split, shards in index.splits.items():
        report[split] = (f"{sum(s.nsamples for s in shards)} samples in {len(shards)} shard(s), "
                         f"{sum(s.filesize for s in shards) / 1e6:.1f} MB")
        for shard in shards:
            try:
                if not store.remote:
                    _check_size(Path(store.base) / shard.url, shard.filesize, store.name(shard.url))
                ShardReader(store, [shard]).check(0)
            except DataError as e:
                bad.append(str(e))
    report.update({k: v for k, v in index.info.items() if k in ("num_classes", "classes", "class_names")})
    return _with_anomalies(report, "unreadable shards", bad)


def _with_anomalies(report: dict[str, Any], kind: str, bad: list[str]) -> dict[str, Any]:
    if bad:
        from fastvision.data.formats.anomalies import first_few

        report["anomalies"] = {kind: f"{len(bad)} ({first_few(bad, 3)})"}
        report["unusable"] = {bad[0]: len(bad)}
    return report


def inspect_tfrecords(path: str | Path, label_offset: int = 1) -> dict[str, Any]:
    """``data inspect`` of a TFRecord folder (local, or at a URL that lists its files): records per
    split (every record's framing and, with ``crc32c`` installed, its data CRC checked), the first
    record's features, the label range."""
    from fastvision.data.shards import tfrecord

    store = ShardStore(path)
    report: dict[str, Any] = {"detected": "TFRecords (tf.train.Example; no index: one pass per file)"}
    splits, bad = tfrecord.split_shards(store, True, skip=True)
    labels: set[int] = set()
    for split, shards in splits.items():
        for shard in shards:
            reader = ShardReader(store, [shard], False, scan=tfrecord.scan)
            for i in range(min(shard.nsamples, 50)):  # a sample of each file's labels
                name, members = reader.sample(i)
                ex = tfrecord.parse_example(members["rec"])
                report.setdefault("features", ", ".join(sorted(ex)))
                labels.update(int(v) for v in ex.get("image/class/label", []))
        report[split] = f"{sum(s.nsamples for s in shards)} records in {len(shards)} readable file(s)"
    if labels:
        report["image/class/label (sampled)"] = f"{min(labels)}-{max(labels)} (minus {label_offset}: class index)"
    return _with_anomalies(report, "unreadable files", bad)
