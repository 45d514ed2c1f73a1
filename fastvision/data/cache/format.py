"""The cache file format: one item dict per file, no pickle.

Layout: ``b"FVC1"``, a little-endian u64 header length, a JSON header, zero padding to 64 bytes,
then the raw bytes of every tensor. The header lists each key as a tensor (dtype, shape, offset,
nbytes) or a JSON value (str, int, float, bool, list) and a CRC32 of the data, so a truncated or
damaged file is detected. Tensors decode as views of the buffer: from a memory-mapped file they
share the page cache, which is what the node-shared cache relies on.
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastvision.utils.files import atomic_write

MAGIC = b"FVC1"
_ALIGN = 64


class CorruptEntry(ValueError):
    """The bytes are not a complete, intact cache entry."""


def _as_tensor(v: Any) -> torch.Tensor | None:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().contiguous()
    if isinstance(v, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(v))
    return None


def write_item(path: Path, item: dict[str, Any]) -> int:
    """Write ``item`` atomically (temp file in the same folder, fsync, rename); returns bytes written.

    Tensors and numpy arrays are stored raw (arrays come back as tensors); other values must be
    JSON-serialisable.
    """
    fields, blobs, offset = {}, [], 0
    for key, v in item.items():
        t = _as_tensor(v)
        if t is None:
            fields[key] = {"json": v}
            continue
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        pad = -offset % _ALIGN
        blobs += [b"\0" * pad, raw]
        offset += pad
        fields[key] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                       "offset": offset, "nbytes": raw.nbytes}
        offset += raw.nbytes
    crc = 0
    for b in blobs:
        crc = zlib.crc32(b, crc)
    header = json.dumps({"fields": fields, "crc": crc, "size": offset}).encode()
    head = MAGIC + struct.pack("<Q", len(header)) + header
    head += b"\0" * (-len(head) % _ALIGN)
    atomic_write(path, lambda f: [f.write(b) for b in (head, *blobs)])
    return len(head) + offset


def decode(buf: Any, verify: bool = True) -> dict[str, Any]:
    """Item from a writable buffer (bytearray or ACCESS_COPY mmap); tensors are views of it."""
    mv = memoryview(buf)
    if len(mv) < 12 or bytes(mv[:4]) != MAGIC:
        raise CorruptEntry("bad magic")
    (hlen,) = struct.unpack("<Q", mv[4:12])
    try:
        header = json.loads(bytes(mv[12:12 + hlen]))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptEntry(f"bad header: {e}") from None
    start = 12 + hlen + (-(12 + hlen) % _ALIGN)
    if len(mv) != start + header["size"]:
        raise CorruptEntry(f"size {len(mv)} != {start + header['size']}")
    if verify and zlib.crc32(mv[start:]) != header["crc"]:
        raise CorruptEntry("checksum mismatch")
    out = {}
    for key, f in header["fields"].items():
        if "json" in f:
            out[key] = f["json"]
            continue
        dtype = getattr(torch, f["dtype"])
        if f["nbytes"] == 0:
            out[key] = torch.empty(f["shape"], dtype=dtype)
            continue
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=f["nbytes"], offset=start + f["offset"])
        out[key] = raw.view(dtype).reshape(f["shape"])
    return out


def read_item(path: Path, verify: bool = True) -> dict[str, Any]:
    """Load an entry into private memory; raises :class:`CorruptEntry` if it is damaged."""
    with open(path, "rb") as f:
        buf = bytearray(f.read())
    return decode(buf, verify)
