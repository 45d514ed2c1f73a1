"""Files of a shard set at a URL: ``http(s)://`` with urllib, ``s3://`` through fsspec and s3fs.

:class:`Remote` does the requests :class:`~.store.ShardStore` needs (a GET streamed to a consumer,
a file's size, the names in the set's folder), each retried ``retries`` times with a doubling
pause after an error or a timeout and then reported as one line naming the URL. A missing file
(HTTP 404, S3 "no such key") is not retried: it raises :class:`NotFound`.

``s3://`` needs the optional packages fsspec and s3fs (``pip install -e ".[s3]"``); without them
the first request is one line naming the URL and the missing package. The endpoint, credentials
and region come from where boto finds them: ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``),
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``, ``~/.aws/config``; and from
fsspec's configuration (``FSSPEC_S3_ENDPOINT_URL``, ``FSSPEC_S3_ANON=true``, or
``~/.config/fsspec/s3.json`` holding ``{"s3": {"endpoint_url": ...}}``), read when fsspec is
imported. s3fs's and botocore's own retries are turned off so that ``retries`` is the bound.
"""
from __future__ import annotations

import html.parser
import http.client
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from fastvision.errors import DataError

SCHEMES = ("http://", "https://", "s3://")
_HTTP_ERRORS = (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError)


class NotFound(DataError):
    """The URL names no file (HTTP 404, S3 NoSuchKey / NoSuchBucket)."""


def is_remote(path: Any) -> bool:
    return str(path).startswith(SCHEMES)


class _Links(html.parser.HTMLParser):
    """The ``href`` targets of a directory listing page (http.server, nginx autoindex, Apache)."""

    def __init__(self):
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.links += [v for k, v in attrs if k == "href" and v]


class Remote:
    """Requests to the files under URL ``base`` (see the module docstring)."""

    def __init__(self, base: str, retries: int = 3, timeout_s: float = 30.0):
        self.base, self.retries, self.timeout_s = base.rstrip("/"), retries, timeout_s
        self.s3 = self.base.startswith("s3://")
        self.kind = "S3" if self.s3 else "HTTP"
        self._fs: Any = None
        self._fs_pid = 0
        self._errors: tuple[type[BaseException], ...] = _HTTP_ERRORS  # what a request can raise

    def __getstate__(self):  # a worker process makes its own client
        return {**self.__dict__, "_fs": None, "_fs_pid": 0}

    def _filesystem(self):
        """The s3fs filesystem of this process (made on first use; a forked child makes its own)."""
        if self._fs is None or self._fs_pid != os.getpid():
            try:
                import fsspec  # noqa: F401
                import s3fs
            except ImportError as e:
                missing = getattr(e, "name", None) or "s3fs"
                raise DataError(f"{self.base}: s3:// URLs need the {missing} package (and fsspec, s3fs: "
                                f"pip install -e \".[s3]\")") from e
            self._fs = s3fs.S3FileSystem(
                skip_instance_cache=True, config_kwargs={
                    "connect_timeout": self.timeout_s, "read_timeout": self.timeout_s,
                    "retries": {"total_max_attempts": 1}})
            self._fs.retries = 1  # s3fs's own retry loop: one try; ours is the bound
            self._fs_pid = os.getpid()
            import aiohttp
            import botocore.exceptions

            self._errors = (OSError, botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError,
                            aiohttp.ClientError)
        return self._fs

    def _open(self, url: str):
        if self.s3:
            return self._filesystem().open(url, "rb")
        return urllib.request.urlopen(url, timeout=self.timeout_s)

    @staticmethod
    def _retryable(e: BaseException) -> bool:
        """Worth another try: a timeout, a dropped connection, a 5xx, S3 throttling; not a missing
        file or a refused permission."""
        if isinstance(e, (FileNotFoundError, PermissionError)):
            return False
        return not isinstance(e, urllib.error.HTTPError) or e.code not in (401, 403, 404)

    def request(self, url: str, use: Callable[[Any], Any]) -> Any:
        """``use(response)`` of a GET of ``url`` (a file-like object: ``read(n)``), with retries."""

        def get() -> Any:
            with self._open(url) as response:
                return use(response)

        return self._retry(url, get)

    def _retry(self, url: str, action: Callable[[], Any]) -> Any:
        """``action()``, tried again after a retryable request error; the last error as one line
        naming ``url``. A DataError of ``action`` (a failed cache write) and a programming error pass."""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.2 * 2 ** (attempt - 1), 5.0))
            try:
                if self.s3:
                    self._filesystem()  # the S3 client's error types
                return action()
            except DataError:
                raise
            except self._errors as e:
                if self._retryable(e) and attempt < self.retries:
                    continue
                reason = str(getattr(e, "reason", None) or e).strip().splitlines()
                if isinstance(e, FileNotFoundError):  # s3fs: the message is the key alone
                    reason = ["no such object"]
                missing = isinstance(e, FileNotFoundError) or getattr(e, "code", None) == 404
                cls = NotFound if missing else DataError
                raise cls(f"{url}: {self.kind} error after {attempt + 1} tries "
                          f"({reason[0] if reason else type(e).__name__})") from e
        raise AssertionError("unreachable")

    def get(self, url: str) -> bytes:
        return self.request(url, lambda r: r.read())

    def listing(self) -> dict[str, int | None]:
        """``{file name: size or None}`` of the files directly under ``base`` (S3: the prefix's
        objects; HTTP: the links of the server's directory listing page, sizes unknown)."""
        if self.s3:
            try:
                entries = self._retry(self.base + "/", lambda: self._filesystem().ls(self.base, detail=True))
            except NotFound:  # an empty prefix
                return {}
            return {e["name"].rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries
                    if e.get("type") == "file"}
        parser = _Links()
        parser.feed(self.get(self.base + "/").decode("utf-8", "replace"))
        names = {urllib.parse.unquote(h.split("?")[0].split("#")[0]).rstrip("/").rsplit("/", 1)[-1]
                 for h in parser.links}
        return {n: None for n in names if n and not n.startswith(".")}

    def size(self, url: str) -> int:
        """A file's size in bytes (HTTP HEAD's Content-Length; S3 object size)."""
        if self.s3:
            return int(self._retry(url, lambda: self._filesystem().size(url)))

        def head() -> str | None:
            request = urllib.request.Request(url, method="HEAD")
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.headers.get("Content-Length")

        length = self._retry(url, head)
        if length is None:
            raise DataError(f"{url}: the server gives no Content-Length")
        return int(length)
