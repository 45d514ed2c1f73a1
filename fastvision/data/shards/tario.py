"""WebDataset tar shards at the byte level: a deterministic writer and a member-table reader.

A shard is a plain POSIX (ustar) tar whose members are ``<key>.<ext>``; consecutive members with
one key form a sample (WebDataset's convention, so ``webdataset.WebDataset(url)`` and ``tar``
read it). Every header has fixed metadata (mtime 0, uid/gid 0, no user or group names, mode
0444), so the same members in the same order give the same bytes. The reader builds the member
table (name -> offset, size) of a shard from its headers in one sequential pass, hashing the
bytes as it goes, so a shard is verified and indexed by the same single read.
"""
from __future__ import annotations

import hashlib
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from fastvision.errors import DataError

BLOCK = 512
END = b"\0" * (2 * BLOCK)  # two zero blocks end a tar archive
CHUNK = 1 << 22  # read size of the sequential pass (4 MiB)


def padded(size: int) -> int:
    """Bytes a member of ``size`` data bytes occupies after its header (rounded up to 512)."""
    return -(-size // BLOCK) * BLOCK


def member_bytes(sizes: Iterable[int]) -> int:
    """Bytes of the members of ``sizes`` in a shard (headers + padded data): the writer's plan."""
    return sum(BLOCK + padded(s) for s in sizes)


def header(name: str, size: int) -> bytes:
    """The 512-byte ustar header of a regular file ``name`` with fixed metadata."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = size, 0, 0o444, 0, 0, "", ""
    try:
        return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")
    except ValueError as e:  # a name over ustar's 255 bytes
        raise DataError(f"{name}: cannot be a tar member name ({e})") from e


def write_member(out: BinaryIO, name: str, data: bytes, digest) -> None:
    """Append one member (header, data, zero padding) to ``out`` and to the running ``digest``."""
    for part in (header(name, len(data)), data, b"\0" * (padded(len(data)) - len(data))):
        out.write(part)
        digest.update(part)


def _parse_header(block: bytes, shard: str, offset: int) -> tuple[str, int] | None:
    """``(name, size)`` of the ustar header ``block`` at ``offset``; None at the end-of-archive block.

    Parsed by hand (a checksum, two fields): ``tarfile.TarInfo.frombuf`` costs ~50 us a header,
    which for a shard of small JPEGs (3 members each) was most of the time to open it.
    """
    if block == b"\0" * BLOCK:
        return None
    try:
        chksum = int(block[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
        size = int(block[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        chksum = size = -1
    if chksum != sum(block) - sum(block[148:156]) + 8 * 32:  # the checksum field counts as spaces
        raise DataError(f"{shard}: corrupt tar header at byte {offset} (bad checksum)")
    name = block[:100].split(b"\0", 1)[0]
    if block[257:262] == b"ustar" and block[345] != 0:
        name = block[345:500].split(b"\0", 1)[0] + b"/" + name
    if block[156:157] not in (b"0", b"\0"):
        raise DataError(f"{shard}: member {name.decode('utf-8', 'replace')!r} at byte {offset} is not a regular "
                        f"file (a fastvision shard holds plain ustar files; pax and GNU headers are not read)")
    return name.decode("utf-8", "replace"), size


def scan(path: Path, shard: str, verify: bool) -> tuple[dict[str, tuple[int, int]], str | None]:
    """The member table of the shard at ``path`` and, with ``verify``, its sha256.

    Args:
        path: the local file.
        shard: the name used in errors (the shard's URL or file name).
        verify: read every byte (one sequential pass, hashing); else only the headers (a seek each).

    Returns:
        ``({member name: (data offset, size)}, sha256 hex or None)``, members in file order.

    Raises:
        DataError: a corrupt header, or a member running past the end of the file (truncated).
    """
    table: dict[str, tuple[int, int]] = {}
    digest = hashlib.sha256() if verify else None
    size = path.stat().st_size
    with open(path, "rb") as f:
        pos, buf, buf_at = 0, b"", 0  # verifying: buf holds the bytes [buf_at, buf_at + len(buf)) read so far
        while True:
            if pos + BLOCK > size:
                raise DataError(f"{shard}: truncated ({size} bytes; the archive's end marker is missing)")
            if digest is not None:
                while buf_at + len(buf) < pos + BLOCK:
                    chunk = f.read(CHUNK)
                    if not chunk:  # the file shrank while being read
                        raise DataError(f"{shard}: truncated while being read")
                    digest.update(chunk)
                    buf += chunk
                    drop = min(max(0, pos - buf_at), len(buf))  # bytes before pos are never needed again
                    buf, buf_at = buf[drop:], buf_at + drop
                block = buf[pos - buf_at: pos - buf_at + BLOCK]
            else:
                f.seek(pos)
                block = f.read(BLOCK)
            entry = _parse_header(block, shard, pos)
            if entry is None:
                break
            name, n = entry
            if pos + BLOCK + n > size:
                raise DataError(f"{shard}: member {name!r} truncated ({n} bytes declared, the file ends first)")
            table[name] = (pos + BLOCK, n)
            pos += BLOCK + padded(n)
        if digest is not None:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
    return table, digest.hexdigest() if digest is not None else None


def samples(table: dict[str, tuple[int, int]]) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """Group a member table into samples: ``[(key, {ext: (offset, size)})]`` in file order (the key is
    the name up to its first dot after the last slash, as WebDataset groups them)."""
    out: list[tuple[str, dict[str, tuple[int, int]]]] = []
    for name, where in table.items():
        slash = name.rfind("/") + 1
        dot = name.find(".", slash)
        key, ext = (name[:dot], name[dot + 1:]) if dot >= 0 else (name, "")
        if not out or out[-1][0] != key:
            out.append((key, {}))
        out[-1][1][ext] = where
    return out
