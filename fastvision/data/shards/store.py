"""Where shards come from: the index of a shard set, and its files from a folder or a URL.

A shard set is a folder (or the same folder served over HTTP or held in S3) holding ``shards.json``
and the tar shards it lists. :class:`ShardStore` turns a shard's name into a local file: the file
itself for a folder; for ``http(s)://`` and ``s3://`` a copy in a node-local cache
(``data.args.shard_cache_dir``) kept under a size limit (``shard_cache_gb``), least recently used
evicted first. A download goes to a temporary file, is checked against the index's sha256 (a
TFRecord file, which has no index: against its size) while it streams, and is renamed into place;
an exclusive file lock per shard makes every rank of a node wait for one download instead of
starting its own. A sidecar ``.<name>.sha256`` records what a cached copy was checked against: a
copy serves only an index naming the same sha256 and size (a set rewritten at the same URL is fetched
again). Errors and timeouts are retried ``shard_retries`` times with a doubling pause,
then reported as one line naming the URL (:mod:`.remote`).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastvision.data.shards.remote import Remote, is_remote
from fastvision.errors import DataError
from fastvision.utils.files import atomic_write

INDEX = "shards.json"
SHARD_NAME = re.compile(r"[a-z]+-\d{6}\.tar")  # the writer's shard names: <split>-NNNNNN.tar
CACHE_DIR = re.compile(r"[0-9a-f]{16}")  # a set's folder in the cache: its URL's hash (ShardStore.cache)
FORMAT = "fastvision-shards/v1"


@dataclass
class Shard:
    """One shard of a split: its file name (relative to the set), sample count, size and sha256."""

    url: str
    nsamples: int
    filesize: int
    sha256: str


@dataclass
class ShardIndex:
    """A shard set's ``shards.json``: the source format, its dataset facts, and each split's shards."""

    base: str
    source: str
    info: dict[str, Any]
    splits: dict[str, list[Shard]]
    files: dict[str, str] = field(default_factory=dict)  # other files of the set (COCO's val annotations)
    writer: dict[str, Any] = field(default_factory=dict)


def is_shard_set(path: str | Path | None) -> bool:
    """``path`` is a URL (``http(s)://``, ``s3://``), or a folder holding a shard index: what ``--data``
    recognises as shards (a URL may also be a TFRecord folder: see ``shard_sets``)."""
    if path is None:
        return False
    return is_remote(path) or (Path(path) / INDEX).is_file()


def unfinished_set(path: str | Path | None) -> str | None:
    """The one-line error for a folder holding shards but no ``shards.json`` (a ``data shard`` that was
    stopped: the index is written last) and no ``train/``, else None. Training and ``data inspect`` said
    'no train/ folder' or 'unrecognised dataset layout' there."""
    if path is None or is_remote(path):
        return None
    p = Path(path)
    if not p.is_dir() or (p / INDEX).exists() or (p / "train").exists():
        return None
    n = sum(1 for q in p.iterdir() if SHARD_NAME.fullmatch(q.name))
    if not n:
        return None
    return (f"{p}: an unfinished shard set ({n} shard(s), no {INDEX}: `fastvision data shard` was stopped before "
            f"it ended); rerun `fastvision data shard SRC {p}` with the same --shard-size to finish it")


def parse_index(doc: Any, base: str, where: str) -> ShardIndex:
    """The :class:`ShardIndex` of a loaded ``shards.json``; DataError naming ``where`` if it is not one."""
    try:
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT!r}")
        splits = {name: [Shard(_name(s["url"], False), int(s["nsamples"]), int(s["filesize"]), str(s["sha256"]))
                         for s in entry["shardlist"]] for name, entry in doc["splits"].items()}
        files = {k: _name(v, True) for k, v in dict(doc.get("files", {})).items()}
        return ShardIndex(base, str(doc["source"]), dict(doc["info"]), splits, files, dict(doc.get("writer", {})))
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise DataError(f"{where}: not a fastvision shard index ({type(e).__name__}: {e})") from e


def _name(rel: Any, folder: bool) -> str:
    """A file of the set as the index names it: a plain file name (``folder``: one folder level, as the
    copied ``annotations/x.json``), never absolute or with ``..``: the set's folder and the shard cache
    hold what the index names, and ``../../x.tar`` read (and cached) a file outside them."""
    parts = str(rel).split("/")
    if not isinstance(rel, str) or len(parts) > (2 if folder else 1) or any(
            not p or p.startswith(".") or "\\" in p for p in parts):
        raise ValueError(f"{rel!r} is not a file of the set (a plain name inside its folder)")
    return rel


def index_doc(index: ShardIndex) -> dict[str, Any]:
    """``shards.json``'s content; each split is a WebDataset-style shard list (url, nsamples)."""
    return {"format": FORMAT, "source": index.source, "writer": index.writer, "info": index.info,
            "files": index.files,
            "splits": {name: {"shardlist": [vars(s) for s in shards]} for name, shards in index.splits.items()}}


class ShardStore:
    """Local files of a shard set (see the module docstring).

    Args:
        base: the set's folder or ``http(s)://`` / ``s3://`` URL.
        cache_dir: node-local cache root for a URL (default ``~/.cache/fastvision/shards``).
        cache_gb: cache size limit (GB, 1e9 bytes), every set's copies in ``cache_dir`` together; least
            recently used shards are evicted.
        retries: extra tries after an HTTP / S3 error or timeout.
        timeout_s: per-request timeout (seconds).
    """

    def __init__(self, base: str | Path, cache_dir: str | None = None, cache_gb: float = 100.0, retries: int = 3,
                 timeout_s: float = 30.0):
        self.base = str(base).rstrip("/")
        self.remote = is_remote(self.base)
        self.limit = int(cache_gb * 1e9)
        self.fetch = Remote(self.base, retries, timeout_s) if self.remote else None
        self.downloads = 0  # shards this process fetched (the rest came from the cache)
        root = Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "fastvision" / "shards"
        self.cache = root / hashlib.sha256(self.base.encode()).hexdigest()[:16] if self.remote else None

    def name(self, rel: str) -> str:
        """The shard's name in messages: its URL or path."""
        return f"{self.base}/{rel}"

    def read_small(self, rel: str) -> bytes:
        """A small file of the set (the index), read whole (from a URL with retries)."""
        if not self.remote:
            path = Path(self.base) / rel
            try:
                return path.read_bytes()
            except OSError as e:
                raise DataError(f"{path}: cannot read ({e})") from e
        assert self.fetch is not None
        return self.fetch.get(self.name(rel))

    def index(self) -> ShardIndex:
        where = self.name(INDEX)
        try:
            doc = json.loads(self.read_small(INDEX))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{where}: not JSON ({e})") from e
        return parse_index(doc, self.base, where)

    def local(self, shard: Shard) -> Path:
        """A local file holding ``shard``: the set's own file, or the cached copy (downloaded if absent)."""
        if not self.remote:
            return Path(self.base) / shard.url
        assert self.cache is not None
        self.cache.mkdir(parents=True, exist_ok=True)
        path = self.cache / shard.url
        if self._cached(shard, path):
            os.utime(path)  # the LRU clock: eviction takes the oldest access first
            return path
        with open(self.cache / f".{shard.url}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one download per node: the other ranks wait here
            try:
                if not self._cached(shard, path):
                    self._make_room(shard)
                    self._download(shard, path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return path

    @staticmethod
    def _tag(shard: Shard) -> str:
        return f"{shard.sha256} {shard.filesize}"

    def _cached(self, shard: Shard, path: Path) -> bool:
        """``path`` holds this index's ``shard``: its sidecar names the sha256 and size the copy was
        checked against. A copy of an earlier index's shard of the same name (the set rewritten at the
        same URL) is not, and is fetched again instead of being read as this one."""
        try:
            return path.is_file() and (path.parent / f".{path.name}.sha256").read_text() == self._tag(shard)
        except OSError:
            return False

    def _make_room(self, shard: Shard) -> None:
        """Evict cached shards, least recently used first, until ``shard`` fits under the limit."""
        assert self.cache is not None
        if shard.filesize > self.limit:
            raise DataError(f"{self.name(shard.url)}: shard cache {self.cache} full: the shard needs "
                            f"{shard.filesize / 1e9:.3g} GB, the limit is {self.limit / 1e9:.3g} GB "
                            f"(data.args.shard_cache_gb)")
        # the limit is the cache's, every set's copies together (each set has a folder of its URL's hash)
        files = []
        for d in self.cache.parent.iterdir():
            if d.is_dir() and CACHE_DIR.fullmatch(d.name):
                for p in d.iterdir():
                    with contextlib.suppress(FileNotFoundError):  # another process evicted it meanwhile
                        if not p.name.startswith(".") and p.is_file():
                            st = p.stat()
                            files.append((st.st_mtime, st.st_size, p))
        used = sum(size for _, size, _ in files)
        for _, size, old in sorted(files, key=lambda f: f[0]):
            if used + shard.filesize <= self.limit:
                break
            used -= size
            with contextlib.suppress(FileNotFoundError):  # another process evicted it first
                old.unlink()  # a reader holding it open keeps reading (POSIX)
                (old.parent / f".{old.name}.sha256").unlink()

    def _download(self, shard: Shard, path: Path) -> None:
        url = self.name(shard.url)

        def save(f) -> None:
            def consume(response) -> tuple[str, int]:
                f.seek(0)
                f.truncate()  # a retried GET writes the file from its start again
                digest, n = hashlib.sha256(), 0
                while chunk := response.read(1 << 20):
                    try:
                        f.write(chunk)
                    except OSError as e:  # the disk, not the request: no retry
                        raise DataError(f"{url}: cannot write to the shard cache {self.cache} "
                                        f"({e.strerror or e})") from e
                    digest.update(chunk)
                    n += len(chunk)
                return digest.hexdigest(), n

            assert self.fetch is not None
            sha, n = self.fetch.request(url, consume)
            # raised before the rename: the cache never holds a bad shard. The size first: a truncated
            # file also fails the checksum, but its size says what happened
            if n != shard.filesize:
                raise DataError(f"{url}: {n} bytes arrived, expected {shard.filesize}: a truncated transfer "
                                f"or a replaced file")
            if shard.sha256 and sha != shard.sha256:
                raise DataError(f"{url}: checksum mismatch (sha256 {sha[:12]}..., the index says "
                                f"{shard.sha256[:12]}...): a corrupt or replaced shard")

        tag = path.parent / f".{path.name}.sha256"
        try:
            tag.unlink(missing_ok=True)  # a replaced copy is this index's only once its tag says so
            atomic_write(path, save)
            atomic_write(tag, lambda f: f.write(self._tag(shard).encode()))
        except OSError as e:
            raise DataError(f"{url}: cannot write to the shard cache {self.cache} ({e.strerror or e})") from e
        self.downloads += 1
