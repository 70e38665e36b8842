"""``open_store``: the snapshot store a URL names (``file://`` or a path, ``redis://``,
``s3://``), with its retention from the query."""

from __future__ import annotations

import os
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from config.storage import ObjectStoreConfig
from learner.snapshots.base import SnapshotStore
from learner.snapshots.local_dir import LocalDirSnapshotStore
from learner.snapshots.object_store import ObjectSnapshotStore
from learner.snapshots.redis_store import RedisSnapshotStore


def open_store(url: str | os.PathLike[str], keep_last: int | None = 10, *, keep_timed: int | None = 7,
               object_store: ObjectStoreConfig | None = None) -> SnapshotStore:
    """Open a store from ``$RLSTREAM_SNAPSHOT_STORE``-style URL.

    * ``file:///abs/path``, or a plain path: ``LocalDirSnapshotStore``;
    * ``redis://``, ``rediss://``, ``unix://``: ``RedisSnapshotStore``; the query
      parameter ``prefix`` sets the key prefix (default ``rlstream:snapshots``);
    * ``s3://bucket/prefix``: ``ObjectSnapshotStore`` at the endpoint, with the
      credentials, of ``object_store`` (None: AWS, the SDK's own credential chain).

    ``keep_last`` and ``keep_timed`` query parameters override the arguments (``keep_last=0``
    keeps everything), for example ``redis://redis:6379/0?prefix=run42&keep_last=20&keep_timed=30``.
    """
    text = os.fspath(url)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        if scheme == "file":
            query = parse_qs(parts.query)
            path = (parts.netloc + parts.path) if parts.netloc not in ("", "localhost") else parts.path
        else:
            query, path = {}, text
        return LocalDirSnapshotStore(path, keep_last=_keep_last(query, keep_last),
                                     keep_timed=_keep_timed(query, keep_timed))
    if scheme in ("redis", "rediss", "unix"):
        query = parse_qs(parts.query)
        prefix = query.pop("prefix", ["rlstream:snapshots"])[-1]
        keep, keep_t = _keep_last(query, keep_last), _keep_timed(query, keep_timed)
        query.pop("keep_last", None)
        query.pop("keep_timed", None)
        clean = urlunsplit(parts._replace(query=urlencode(query, doseq=True)))
        return RedisSnapshotStore(clean, prefix=prefix, keep_last=keep, keep_timed=keep_t)
    if scheme == "s3":
        query = parse_qs(parts.query)
        unknown = set(query) - {"keep_last", "keep_timed"}
        if unknown:
            raise ValueError(f"snapshot store URL {text!r}: unknown parameters {sorted(unknown)}")
        return ObjectSnapshotStore(urlunsplit(parts._replace(query="")), keep_last=_keep_last(query, keep_last),
                                   keep_timed=_keep_timed(query, keep_timed), object_store=object_store)
    raise ValueError(f"unsupported snapshot store URL {text!r} (use file://, a path, redis:// or s3://)")


def _keep_last(query: dict[str, list[str]], default: int | None) -> int | None:
    if "keep_last" not in query:
        return default
    n = int(query["keep_last"][-1])
    return None if n == 0 else n


def _keep_timed(query: dict[str, list[str]], default: int | None) -> int | None:
    return int(query["keep_timed"][-1]) if "keep_timed" in query else default
