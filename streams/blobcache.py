"""One copy of each claim-checked blob per host, shared by every process on it.

Without it, each actor process fetches and hashes every claim-checked version itself: at 10M
parameters, four processes on one host are four 40 MB reads queued on one single-threaded Redis
and four sha256s. With it, the first process to want a blob takes the host's lock for that digest,
streams the blob from the store into a file under the cache directory, hashing it on the way,
and renames it into place only once its sha256 and size match the claim check; the others wait on
the lock. Every process then maps the verified file copy-on-write and decodes views of it: one
copy in memory per host, and adopting a version costs no copy at all.

* Named by the claim check's sha256 (content addressed), so a file is never stale: the same
  digest is the same bytes. A digest that is not 64 hex digits is refused (it comes from an event).
* The lock is ``fcntl.flock`` on a per-digest lock file: the kernel drops it when its holder
  dies, and a half-written ``.part`` file is never read (only a rename publishes a blob).
* The directory is the user's own (created 0700; one that another user owns or may write is
  refused), under ``/dev/shm`` by default: ``RLSTREAM_BLOB_CACHE`` names another, or ``off``.
* Only the newest ``keep`` blobs stay (older ones go first when a new one would not fit); a
  reader that has mapped one keeps its bytes. A blob the cache cannot take even empty (a
  container's ``/dev/shm`` is 64 MB by default) is fetched by each process alone, as without a
  cache, and nothing is written for it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
import torch

from schemas.errors import InvalidEventError

log = logging.getLogger(__name__)
_DIGEST = re.compile(r"[0-9a-f]{64}")
_STALE_PART_S = 600.0

#: ``stream(on_chunk)``: fetch the blob, calling ``on_chunk`` on each part of it in order.
Stream = Callable[[Callable[[memoryview], None]], None]


class BlobCacheError(InvalidEventError, ValueError):
    """A fetched blob does not match its claim check (size or sha256), or the digest is not one."""


def new_buffer(size: int) -> np.ndarray:
    """A writable uint8 array of ``size`` bytes for a blob. Torch's allocator, not numpy's: numpy
    asks for transparent huge pages on large arrays, and on a host with little free contiguous
    memory the kernel then compacts memory on the first touch (~140 ms for 40 MB here, against
    ~20 ms on small pages)."""
    return torch.empty(size, dtype=torch.uint8).numpy()


def map_file(path: str) -> mmap.mmap:
    """The file at ``path`` mapped copy-on-write: tensors decoded from it are views of the host's
    one copy in memory (pages are shared until written; a write stays in this process)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _write_all(f, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view):]


class CacheWriteError(OSError):
    """The cache cannot take a blob (a full or unwritable directory): fetch it without the cache."""


@contextmanager
def _part_file(path: str):
    """``(file, part path)``: a new file beside ``path`` that only a rename to ``path`` publishes;
    removed on the way out unless renamed. CacheWriteError if it cannot be created."""
    part = f"{path}.{os.getpid()}.{threading.get_ident()}.part"
    try:
        f = open(part, "wb", buffering=0)
    except OSError as e:
        raise CacheWriteError(f"{part}: {e}") from e
    try:
        with f:
            yield f, part
    finally:
        if os.path.exists(part):
            os.unlink(part)


class HostBlobCache:
    """The verified blobs of one host under ``root`` (module doc). ``fills``: blobs this process
    fetched into the cache; ``hits``: blobs it found there; ``write_errors``: blobs it could not
    store."""

    def __init__(self, root: str, keep: int = 4) -> None:
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.stat(root)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:  # nobody else may plant a blob there
            raise PermissionError(f"blob cache {root} must be this user's own and writable by no one else (0700)")
        self.root, self.keep = root, max(1, keep)
        self.fills = self.hits = self.write_errors = 0
        self._count = threading.Lock()

    def path(self, digest: str) -> str:
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise BlobCacheError(f"claim-check sha256 {str(digest)[:80]!r} is not 64 hex digits")
        return os.path.join(self.root, digest)

    def get(self, digest: str, size: int, stream: Stream) -> mmap.mmap:
        """The blob of ``digest``, mapped from the cache; fetched first (once per host) with
        ``stream``, checked against ``size`` and ``digest``. BlobCacheError when the fetched bytes
        do not match; CacheWriteError when the cache cannot take the blob (a full /dev/shm)."""
        path = self.path(digest)
        if size < 1:
            raise BlobCacheError(f"claim check of {size} bytes: no weights are that small")
        hit = self._map(path)
        if hit is None:
            try:
                with self._locked(path + ".lock"):
                    hit = self._map(path)  # filled while this process waited for the lock
                    if hit is None:
                        return self._fill(path, digest, size, stream)
            except CacheWriteError as e:
                self._uncached(e)
                raise
        with self._count:
            self.hits += 1
        return hit

    def put(self, digest: str, data: bytes | bytearray | memoryview) -> None:
        """Cache ``data`` as the blob of ``digest``, which the caller computed from it (the
        publisher: readers on its host then never fetch it). A failed write costs the cache only."""
        path = self.path(digest)
        try:
            self._make_room(len(data))
            with _part_file(path) as (f, part):
                _write_all(f, data)
                os.replace(part, path)
        except OSError as e:
            self._uncached(e)
            return
        self._prune()

    @staticmethod
    def _map(path: str) -> mmap.mmap | None:
        try:
            return map_file(path)
        except FileNotFoundError:
            return None

    @contextmanager
    def _locked(self, lock_path: str):
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise CacheWriteError(f"{lock_path}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks without the GIL; released if the holder dies
            yield
        finally:
            os.close(fd)

    def _free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _make_room(self, size: int) -> None:
        """Evict the oldest blobs until ``size`` bytes fit; CacheWriteError, before anything is
        fetched or written, when even an empty cache would not hold it."""
        free = self._free_bytes()
        if free >= size:
            return
        blobs = sorted(self._blobs())
        held = sum(n for _, _, n in blobs)
        if free + held < size:  # evicting would not help: keep what is there
            raise CacheWriteError(f"{self.root} holds {free + held} bytes at most, the blob needs {size}")
        for _, name, _ in blobs:
            self._drop(name)
            if self._free_bytes() >= size:
                return

    def _fill(self, path: str, digest: str, size: int, stream: Stream) -> mmap.mmap:
        self._make_room(size)
        h, got = hashlib.sha256(), 0
        with _part_file(path) as (f, part):
            def on_chunk(chunk: memoryview) -> None:
                nonlocal got
                h.update(chunk)
                try:
                    _write_all(f, chunk)
                except OSError as e:  # not the store's failure: fetch it without the cache
                    raise CacheWriteError(f"{part}: {e}") from e
                got += len(chunk)

            stream(on_chunk)
            if got != size or h.hexdigest() != digest:
                raise BlobCacheError(f"fetched blob of {got} bytes does not match its claim check "
                                     f"({size} bytes, sha256 {digest[:16]}...)")
            mapped = map_file(part)  # before the rename: another process may prune it at once
            os.replace(part, path)
        with self._count:
            self.fills += 1
        self._prune()
        return mapped

    def _uncached(self, e: OSError) -> None:
        with self._count:
            self.write_errors += 1
            first = self.write_errors == 1
        if first:
            log.warning("blob cache %s cannot take a blob (%s): this host fetches it per process", self.root, e)

    def _prune(self) -> None:
        """Keep the newest ``keep`` blobs; drop ``.part`` files their writers left long ago."""
        for _, name, _ in sorted(self._blobs(stale_parts=True), reverse=True)[self.keep:]:
            self._drop(name)

    def _blobs(self, stale_parts: bool = False) -> list[tuple[float, str, int]]:
        """``(mtime, name, size)`` of the cached blobs (removing stale ``.part`` files if asked)."""
        now, out = time.time(), []
        for e in os.scandir(self.root):
            try:
                if _DIGEST.fullmatch(e.name):
                    st = e.stat()
                    out.append((st.st_mtime, e.name, st.st_size))
                elif stale_parts and e.name.endswith(".part") and now - e.stat().st_mtime > _STALE_PART_S:
                    os.unlink(e.path)
            except FileNotFoundError:  # another process removed it first
                pass
        return out

    def _drop(self, name: str) -> None:
        """Remove a blob (a process that mapped it keeps its pages) and its lock file."""
        for p in (name, name + ".lock"):
            try:
                os.unlink(os.path.join(self.root, p))
            except FileNotFoundError:
                pass
