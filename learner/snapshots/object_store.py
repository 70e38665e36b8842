"""Snapshots in S3-compatible object storage (fsspec with s3fs; endpoint and credentials in a
``config.storage.ObjectStoreConfig``), every request within a deadline."""

from __future__ import annotations

import contextlib
import json
from typing import Any
from urllib.parse import urlsplit

from config.storage import ObjectStoreConfig
from learner.snapshots.base import _BaseStore
from learner.snapshots.format import _RECORD_RE, SnapshotError, _canonical, _Encoded, _parse_marks

#: Seconds one S3 request may take (connect, then each read) before it fails; with the tries
#: below, what bounds a save to a store that holds the connection but does not answer.
S3_TIMEOUT_S = 20.0
S3_TRIES = 2


def _s3_options(cfg: ObjectStoreConfig | None) -> dict[str, Any]:
    """s3fs's keyword arguments for ``cfg`` (None: AWS and the SDK's own credential chain)."""
    cfg = cfg or ObjectStoreConfig()
    opts: dict[str, Any] = {"use_listings_cache": False,
                            "config_kwargs": {"connect_timeout": min(10.0, S3_TIMEOUT_S), "read_timeout": S3_TIMEOUT_S,
                                              "retries": {"max_attempts": S3_TRIES, "mode": "standard"}}}
    if cfg.endpoint_url:
        opts["endpoint_url"] = cfg.endpoint_url
    if cfg.region:
        opts["client_kwargs"] = {"region_name": cfg.region}
    for name, value in (("key", cfg.access_key_id), ("secret", cfg.secret_access_key),
                        ("token", cfg.session_token)):
        if value:
            opts[name] = value
    return opts


class ObjectSnapshotStore(_BaseStore):
    """Snapshots as objects in S3-compatible storage, through fsspec with s3fs.

    Under ``s3://bucket/prefix/`` the layout of ``LocalDirSnapshotStore``: per version
    ``v{version:08d}.safetensors``, ``v{version:08d}.state.safetensors`` (optional) and
    ``v{version:08d}.json``, the record, written last (an object PUT is atomic, so the record's
    presence commits the version); ``pins.json`` and ``timed.json`` hold the marks. Listings are
    never cached: another process's new versions show at once. The bucket must exist.
    """

    def __init__(self, url: str, keep_last: int | None = 10, keep_timed: int | None = 7,
                 object_store: ObjectStoreConfig | None = None, fs: Any | None = None) -> None:
        super().__init__(keep_last, keep_timed)
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"not an s3://bucket[/prefix] URL: {url!r}")
        self.bucket = parts.netloc
        prefix = parts.path.strip("/")
        self.root = f"{self.bucket}/{prefix}" if prefix else self.bucket
        self.url = f"s3://{self.root}"
        self.endpoint_url = object_store.endpoint_url if object_store is not None else None
        if fs is None:
            import fsspec  # local import: only this backend needs it (extra ``s3``)

            try:
                fs = fsspec.filesystem("s3", **_s3_options(object_store))
            except ImportError as exc:
                raise SnapshotError(f"{self.url}: the s3 backend needs s3fs (pip install 'rlstream[s3]')") from exc
            fs.retries = S3_TRIES  # s3fs's own retries of a timed-out call (5 by default), on top of botocore's
        self.fs = fs

    def _call(self, method: str, *args: Any, **kw: Any) -> Any:
        """``fs.<method>(*args)`` within a deadline: botocore's read timeout does not bound every
        wait (a store that accepts the connection and never answers held a save for minutes), so
        an async filesystem's call is given fsspec's own ``timeout`` (``FSTimeoutError``)."""
        if getattr(self.fs, "async_impl", False):
            return getattr(self.fs, method)(*args, timeout=S3_TIMEOUT_S * (S3_TRIES + 1), **kw)
        return getattr(self.fs, method)(*args, **kw)

    def _obj(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _file(self, version: int, suffix: str) -> str:
        return self._obj(f"v{version:08d}{suffix}")

    def _put(self, path: str, data: bytes) -> None:
        try:
            self._call("pipe_file", path, data)
        except FileNotFoundError as exc:
            raise SnapshotError(f"{self.url}: cannot write {path}: no bucket {self.bucket!r} ({exc})") from exc

    def _get(self, path: str) -> bytes | None:
        try:
            return bytes(self._call("cat_file", path))
        except FileNotFoundError:
            return None

    def _write(self, version: int, enc: _Encoded) -> str:
        self._put(self._file(version, ".safetensors"), enc.weights)
        if enc.state is not None:
            self._put(self._file(version, ".state.safetensors"), enc.state)
        else:
            self._rm(self._file(version, ".state.safetensors"))
        self._put(self._file(version, ".json"), _canonical(enc.record))
        return self._weights_key(version)

    def _weights_key(self, version: int) -> str:
        return "s3://" + self._file(version, ".safetensors")

    def _read_record(self, version: int) -> bytes | None:
        return self._get(self._file(version, ".json"))

    def _read_blobs(self, version: int, state: bool) -> tuple[bytes | None, bytes | None]:
        if state:
            return None, self._get(self._file(version, ".state.safetensors"))
        return self._get(self._file(version, ".safetensors")), None

    def _rm(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call("rm_file", path)

    def _remove(self, version: int) -> None:
        for suffix in (".json", ".safetensors", ".state.safetensors"):  # record first, as on disk
            self._rm(self._file(version, suffix))

    def versions(self) -> list[int]:
        try:
            names = self._call("ls", self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            m = _RECORD_RE.match(name.rsplit("/", 1)[-1])
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def _marks(self, kind: str) -> set[int]:
        return _parse_marks(self._get(self._obj(f"{kind}.json")), kind)

    def _mark(self, kind: str, add: set[int] = frozenset(), remove: set[int] = frozenset()) -> None:
        marks = (self._marks(kind) | set(add)) - set(remove)
        self._put(self._obj(f"{kind}.json"), json.dumps(sorted(marks)).encode())
