"""DLE's ImageNet TFRecords (``train-*-of-*``, ``validation-*-of-*``) read without TensorFlow.

A TFRecord file is a sequence of records: ``uint64 length``, ``uint32 masked crc32c(length)``,
``data``, ``uint32 masked crc32c(data)``; it carries no index. Opening a file is therefore one
pass over its record headers (a 12-byte read and a seek per record) that builds the offsets,
after which the file is read like a shard: record ``i`` by offset, in the shard-aware order.
Each record is a ``tf.train.Example`` protobuf, parsed here by hand (a few wire-format fields):
``image/encoded`` (the JPEG) and ``image/class/label`` (1-1000 in DLE's and TF-slim's ImageNet
files, 0 being "background": ``data.args.tfrecord_label_offset``, default 1, is subtracted).

The length CRC of every record is checked (a corrupt header is one line naming the file and the
byte); with the ``crc32c`` package installed (``pip install -e ".[shards]"``) and
``shard_verify`` on, each record's data CRC is checked too, which reads the whole file once.
"""
from __future__ import annotations

import fnmatch
import struct
from pathlib import Path

from fastvision.data.shards.remote import NotFound
from fastvision.data.shards.store import Shard, ShardStore
from fastvision.errors import DataError

SPLITS = (("train", "train-*-of-*"), ("val", "validation-*-of-*"))

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected
_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)


def _crc32c(data: bytes) -> int:
    try:
        import crc32c

        return crc32c.crc32c(data)
    except ImportError:  # the table: fine for the 8-byte lengths, slow for whole records
        crc = 0xFFFFFFFF
        for b in data:
            crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
        return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _has_fast_crc() -> bool:
    try:
        import crc32c  # noqa: F401
    except ImportError:
        return False
    return True


def scan(path: Path, name: str, verify: bool) -> tuple[list[tuple[str, dict[str, tuple[int, int]]]], None]:
    """The records of ``path`` as samples ``[(str(i), {"rec": (offset, length)})]`` (no checksum file)."""
    size = path.stat().st_size
    check_data = verify and _has_fast_crc()
    out = []
    with open(path, "rb") as f:
        pos = 0
        while pos < size:
            f.seek(pos)
            head = f.read(12)
            if len(head) < 12:
                raise DataError(f"{name}: truncated record header at byte {pos}")
            length, crc = struct.unpack("<QI", head)
            if masked_crc(head[:8]) != crc:
                raise DataError(f"{name}: corrupt record header at byte {pos} (length CRC mismatch)")
            if pos + 16 + length > size:
                raise DataError(f"{name}: record {len(out)} truncated ({length} bytes declared, the file ends first)")
            if check_data:
                data = f.read(length)
                if masked_crc(data) != struct.unpack("<I", f.read(4))[0]:
                    raise DataError(f"{name}: record {len(out)} at byte {pos}: data CRC mismatch")
            out.append((str(len(out)), {"rec": (pos + 12, length)}))
            pos += 16 + length
    return out, None


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes):
    """``(field number, wire type, value)`` of a protobuf message: ints for varints, bytes for
    length-delimited fields (fixed 32/64-bit fields as bytes)."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"wire type {wire}")
        yield field, wire, value


def _feature(buf: bytes) -> list:
    """A ``tf.train.Feature``'s values: bytes, int64 or float32 list."""
    out: list = []
    for kind, _, lst in _fields(buf):
        for _, wire, v in _fields(lst):
            if kind == 1:
                out.append(bytes(v))
            elif kind == 3 and wire == 2:  # packed int64
                j = 0
                while j < len(v):
                    x, j = _varint(v, j)
                    out.append(x - (1 << 64) if x >= 1 << 63 else x)
            elif kind == 3:
                out.append(v - (1 << 64) if v >= 1 << 63 else v)
            elif kind == 2 and wire == 2:
                out += list(struct.unpack(f"<{len(v) // 4}f", v))
            elif kind == 2:
                out.append(struct.unpack("<f", v)[0])
    return out


def parse_example(buf: bytes) -> dict[str, list]:
    """``{feature name: values}`` of a serialized ``tf.train.Example``."""
    features: dict[str, list] = {}
    for field, _, msg in _fields(buf):
        if field != 1:
            continue
        for _, _, entry in _fields(msg):  # map<string, Feature> entries
            key, value = "", b""
            for f, _, v in _fields(entry):
                if f == 1:
                    key = bytes(v).decode()
                elif f == 2:
                    value = v
            features[key] = _feature(value)
    return features


def imagenet_members(name: str, members: dict[str, bytes], label_offset: int = 1) -> dict[str, bytes]:
    """A DLE ImageNet record as an ImageFolder sample: ``{"jpeg", "cls", "id"}``."""
    try:
        ex = parse_example(members["rec"])
        return {"jpeg": ex["image/encoded"][0], "cls": str(int(ex["image/class/label"][0]) - label_offset).encode(),
                "id": name.encode()}
    except (KeyError, IndexError, ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{name}: not an ImageNet tf.train.Example (image/encoded, image/class/label): "
                        f"{type(e).__name__} {e}") from e


def _files(store: ShardStore) -> dict[str, int | None]:
    """``{name: size or None}`` of the files in the set's folder, or listed at its URL."""
    if store.fetch is None:
        return {p.name: p.stat().st_size for p in Path(store.base).iterdir() if p.is_file()}
    return store.fetch.listing()


def split_shards(store: ShardStore, verify: bool, skip: bool) -> tuple[dict[str, list[Shard]], list[str]]:
    """Each split's TFRecord files as shards (no sha256: a TFRecord checks its own CRCs), and the
    one-line errors of the files left out under ``skip`` (otherwise the first one raises). A URL
    without a listing or without TFRecord files in it raises :class:`NotFound`.

    The record count of a file takes one pass over its headers (with ``verify``, its data CRCs
    too); a file at a URL is fetched into the node-local cache for it first (one download per
    node), so building the dataset reads the whole set once and the first epoch reads the cache.
    """
    try:
        names = _files(store)
    except DataError as e:
        raise NotFound(f"no listing of TFRecord files ({e})") from e
    out: dict[str, list[Shard]] = {}
    bad: list[str] = []
    for split, pattern in SPLITS:
        out[split] = []
        for name in sorted(fnmatch.filter(names, pattern)):
            url = store.name(name)
            try:
                size = names[name]
                if size is None:
                    assert store.fetch is not None
                    size = store.fetch.size(url)
                records, _ = scan(store.local(Shard(name, 0, size, "")), url, verify)
                out[split].append(Shard(name, len(records), size, ""))
            except DataError as e:
                if not skip:
                    raise
                bad.append(str(e))
    if store.remote and not (out["train"] or bad):
        raise NotFound(f"{store.base}/ lists no TFRecord files ({', '.join(p for _, p in SPLITS)})")
    return out, bad


def is_tfrecord_set(path: str | Path) -> bool:
    """A folder of DLE ImageNet TFRecords: ``train-*-of-*`` and ``validation-*-of-*`` files."""
    p = Path(path)
    return p.is_dir() and any(p.glob("train-*-of-*")) and any(p.glob("validation-*-of-*"))
