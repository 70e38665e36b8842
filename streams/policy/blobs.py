"""The claim-check blob store: a ``BlobStore`` protocol, a small Redis client that streams values,
the host-cached store (``streams.blobcache``), bounded fetch retries, and the size+sha256 check."""

from __future__ import annotations

import logging
import mmap
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, Union

import numpy as np

from schemas.errors import CodecError
from schemas.events import ClaimCheck
from schemas.weights import sha256
from streams.blobcache import (
    BlobCacheError,
    CacheWriteError,
    HostBlobCache,
    new_buffer,
)

from streams.policy.errors import BlobWriteError, PolicyLoadError

log = logging.getLogger(__name__)


# -- the blob store (claim checks) ------------------------------------------------------------------

class BlobStore(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes | bytearray: ...


#: Where claim-checked weights come from: a BlobStore, or a function of the claim check.
Blobs = Union[BlobStore, Callable[[ClaimCheck], bytes], None]


@dataclass(frozen=True)
class FetchRetry:
    """How a blob-store call that fails (timeout, dropped connection, store restarting) is
    retried: ``attempts`` tries in all, ``base_s`` doubled after each failure (at most ``cap_s``)
    between them. A ``CodecError`` (the key is gone) is final at once."""

    attempts: int = 4
    base_s: float = 0.1
    cap_s: float = 2.0

    def call(self, fn: Callable[[], Any], what: str, error: type[Exception] = PolicyLoadError) -> Any:
        """``fn()``, retried; ``error`` (PolicyLoadError: a read) naming ``what`` once every
        attempt failed."""
        for attempt in range(self.attempts):
            try:
                return fn()
            except CodecError:
                raise
            except Exception as e:  # the store is down, slow, or restarting
                if attempt + 1 >= self.attempts:
                    raise error(f"{what} failed {self.attempts} times; last: {type(e).__name__}: {e}") from e
                time.sleep(min(self.cap_s, self.base_s * 2 ** attempt))
        raise error(f"{what}: no attempt made (attempts={self.attempts})")


#: The retry of blob-store calls unless told otherwise.
DEFAULT_RETRY = FetchRetry()


def _resp(*args: str | bytes) -> bytes:
    """One Redis command in RESP."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out += [b"$%d\r\n" % len(a), a, b"\r\n"]
    return b"".join(out)


class _RespReader:
    """Replies off one socket: status lines, and a bulk string read straight into one buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, bytearray()

    def line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("redis closed the connection")
            self.buf += chunk
        line, self.buf = bytes(self.buf[:i]), self.buf[i + 2:]
        if line[:1] == b"-":
            raise ConnectionError(f"redis: {line[1:].decode(errors='replace')}")
        return line

    #: Bytes per part when a bulk string is streamed.
    CHUNK = 1 << 20

    def bulk(self) -> np.ndarray | None:
        """The bulk string (None: nil), received straight into one new buffer."""
        n = self._bulk_len()
        if n < 0:
            return None
        out = new_buffer(n + 2)  # the value and its CRLF
        view = memoryview(out)
        got = min(len(self.buf), n + 2)
        view[:got] = self.buf[:got]
        while got < n + 2:
            got += self._recv_into(view[got:])
        return out[:n]

    def stream(self, on_chunk: Callable[[memoryview], None]) -> int:
        """Hand the bulk string to ``on_chunk`` in parts of at most ``CHUNK`` bytes, in order,
        through one reused buffer; its length (-1: nil)."""
        n = self._bulk_len()
        if n < 0:
            return n
        scratch = memoryview(bytearray(self.CHUNK))
        head = min(len(self.buf), n)  # what came with the reply's first line
        with memoryview(self.buf) as buf:
            for i in range(0, head, self.CHUNK):
                on_chunk(buf[i:min(i + self.CHUNK, head)])
        got, self.buf = head, self.buf[head:]
        while got < n:
            r = self._recv_into(scratch[:min(self.CHUNK, n - got)])
            on_chunk(scratch[:r])
            got += r
        return n  # its CRLF is left unread: the connection serves one read

    def _bulk_len(self) -> int:
        head = self.line()
        if head[:1] != b"$":
            raise ConnectionError(f"redis: unexpected reply {head[:40]!r}")
        return int(head[1:])

    def _recv_into(self, view: memoryview) -> int:
        r = self.sock.recv_into(view)
        if not r:
            raise ConnectionError("redis closed the connection")
        return r


@dataclass
class RedisBlobStore:
    """Claim-check store on Redis. One call waits up to ``timeout_s``; a failed one is retried by
    the caller's ``FetchRetry`` (the loader's for reads, ``retry`` here for writes), so the
    retries are counted in one place. A read goes straight from the socket into one buffer the
    loader decodes in place (redis-py's parser copies a reply of tens of MB several times)."""

    url: str
    """The store's URL as given; after construction, with any password replaced by ``***``: it
    goes into every claim check (``ClaimCheck.store``, on the bus) and every error message."""
    timeout_s: float = 30.0
    retry: FetchRetry = DEFAULT_RETRY

    def __post_init__(self) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.connection import parse_url
        from redis.retry import Retry

        self._r = redis.Redis.from_url(self.url, socket_timeout=self.timeout_s, socket_connect_timeout=10.0,
                                       retry=Retry(NoBackoff(), 0))  # FetchRetry is the one retry
        self._at = parse_url(self.url)
        self.url = redact_url(self.url)

    def put(self, key: str, data: bytes) -> None:
        self.retry.call(lambda: self._r.set(key, data), f"writing claim-check key {key} to {self.url}",
                        error=BlobWriteError)

    def get(self, key: str) -> np.ndarray | bytearray:
        """The value of ``key``, a writable buffer (decoded in place)."""
        at = self._at
        data = self._r.get(key) if "connection_class" in at else self._read(key, at, lambda r: r.bulk())
        if data is None:
            raise PolicyLoadError(f"claim-check key {key} not found in {self.url}")
        return data if isinstance(data, (bytearray, np.ndarray)) else bytearray(data)

    def stream(self, key: str, on_chunk: Callable[[memoryview], None]) -> None:
        """Hand the value of ``key`` to ``on_chunk`` in parts as it arrives (whole over redis-py:
        TLS, unix sockets)."""
        if "connection_class" in self._at:
            on_chunk(memoryview(self.get(key)))
        elif self._read(key, self._at, lambda r: r.stream(on_chunk)) < 0:
            raise PolicyLoadError(f"claim-check key {key} not found in {self.url}")

    def _read(self, key: str, at: dict, take: Callable[[_RespReader], Any]) -> Any:
        pre = []
        if at.get("password"):
            pre.append(("AUTH", *([at["username"]] if at.get("username") else []), at["password"]))
        if at.get("db"):
            pre.append(("SELECT", at["db"]))
        with socket.create_connection((at.get("host", "localhost"), at.get("port", 6379)), timeout=self.timeout_s) as s:
            s.sendall(b"".join(_resp(*c) for c in (*pre, ("GET", key))))
            reader = _RespReader(s)
            for _ in pre:
                reader.line()
            return take(reader)


@dataclass
class HostCachedStore:
    """``store`` with one verified copy of each blob per host (``streams.blobcache``): a reader
    fetches a claim check from the store only when no process on its host has yet, and a
    publisher leaves a copy of what it writes there."""

    store: RedisBlobStore
    cache: HostBlobCache

    @property
    def url(self) -> str:
        return self.store.url

    def put(self, key: str, data: bytes) -> None:
        self.store.put(key, data)

    def get(self, key: str) -> np.ndarray | bytearray:
        return self.store.get(key)

    def fetch_verified(self, ref: ClaimCheck) -> mmap.mmap | np.ndarray | bytearray:
        """The bytes of ``ref``, checked against its size and sha256 (PolicyLoadError if not): the
        host's copy, mapped; fetched alone where the cache cannot take it."""
        try:
            return self.cache.get(ref.sha256, ref.size, lambda on_chunk: self.store.stream(ref.key, on_chunk))
        except BlobCacheError as e:
            raise PolicyLoadError(f"claim-checked weights {ref.key}: {e}") from e
        except CacheWriteError:
            return verify_claim_check(self.store.get(ref.key), ref, f"claim-checked weights {ref.key}")


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user, host = parts.username or "", parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def open_blob_store(url: str | None, cache_dir: str | None = None) -> RedisBlobStore | HostCachedStore | None:
    """The claim-check store at ``url`` (None: none), behind the host cache at ``cache_dir``
    (None: no host cache; see ``config.train.default_cache_dir``)."""
    if not url:
        return None
    store = RedisBlobStore(url)
    if not cache_dir:
        return store
    try:
        return HostCachedStore(store, HostBlobCache(cache_dir))
    except OSError as e:  # not creatable, not ours: every process fetches for itself
        log.warning("no host blob cache at %s (%s): each process fetches claim-checked weights itself", cache_dir, e)
        return store


def verify_claim_check(data: Any, ref: ClaimCheck, what: str) -> Any:
    """``data`` if it is the claim check's bytes (its size and sha256); PolicyLoadError naming
    ``what`` if not."""
    if len(data) != ref.size or sha256(data) != ref.sha256:
        raise PolicyLoadError(f"{what} fail their size or sha256")
    return data
