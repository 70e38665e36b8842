"""Policy snapshot stores: versioned weights (+ optional learner state), no pickle.

A snapshot is one policy version::

    store = open_store("file:///data/snapshots")      # or "redis://redis:6379/0", "s3://bucket/prefix"
    ref = store.save(7, model.state_dict(), {"algo": "ppo", "step": 700},
                     state={"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 700})
    weights, meta = store.load(7)                      # sha256-verified
    state = store.load_state(7)                        # nested dict, tensors restored
    snap = rollback(store, 5)                          # weights of a known-good version

Format (identical on every backend):

* weights: ``safetensors`` bytes (``safetensors.torch.save``), tensors moved to
  CPU and made contiguous; tensors sharing storage are copied (tying is not
  preserved in the file; ``load_state_dict`` restores it).
* state (optional): the learner's full resume state, any nesting of
  dict/list/tuple over tensors, ``None``, bool, int, float, str and
  ``torch.dtype``: e.g. ``{"model": ..., "optimizer": opt.state_dict(),
  "step": 700, "rng": torch.get_rng_state()}``. Tensors go into a second
  safetensors blob, the nesting into a JSON structure (``flatten_state`` /
  ``unflatten_state``); int dict keys (optimizer ``state``) survive. Anything
  else raises ``TypeError``: nothing is ever pickled. This is the chosen design
  (not opaque ``save_blob`` bytes), so every backend stores the same verifiable
  format and the learner needs no encoder of its own.
* record: JSON with ``meta`` (JSON-serialisable, checked at save), sha256 and
  size of each blob, the state structure, ``created_at_ms``, and a sha256 of the
  record itself. Every read verifies the checksums; a mismatch, a truncated
  blob or an unparsable record raises ``SnapshotCorruptError``. A save whose backend fails
  (store down, no answer within ``S3_TIMEOUT_S``, disk full) raises ``SnapshotWriteError`` and
  leaves the store's newest version as it was: the record, written last, is what commits one.

Retention: after each ``save`` the store keeps the newest ``keep_last`` versions,
the newest ``keep_timed`` of the versions saved as time-based (``save(..., timed=True)``:
the learner's daily snapshots, ``SnapshotSchedule``), and every pinned version
(``pin``), and deletes the rest. Pins and time-based marks are stored with the
snapshots, so they survive restarts and are shared by every process using the
store. ``delete`` refuses a pinned version.

Backends: a local directory, Redis, and S3-compatible object storage
(``ObjectSnapshotStore``, fsspec with s3fs; endpoint and credentials in a
``config.storage.ObjectStoreConfig``).

One writer (the learner) per store; any number of readers.

``SnapshotRef.key`` (a file path or Redis key) plus ``sha256`` is what a
``PolicyVersion`` claim check needs when the weights are too big to inline.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import safetensors.torch
import torch

from config.storage import ObjectStoreConfig

__all__ = [
    "FORMAT_VERSION",
    "LocalDirSnapshotStore",
    "ObjectSnapshotStore",
    "RedisSnapshotStore",
    "Snapshot",
    "SnapshotCorruptError",
    "SnapshotError",
    "SnapshotNotFoundError",
    "SnapshotPinnedError",
    "SnapshotRef",
    "SnapshotSchedule",
    "SnapshotWriteError",
    "ResumeError",
    "SnapshotStore",
    "flatten_state",
    "newest_timed_ms",
    "open_store",
    "rollback",
    "unflatten_state",
]

FORMAT_VERSION = 1
#: Seconds one S3 request may take (connect, then each read) before it fails; with the tries
#: below, what bounds a save to a store that holds the connection but does not answer.
S3_TIMEOUT_S = 20.0
S3_TRIES = 2

log = logging.getLogger(__name__)


class SnapshotError(Exception):
    """Base class of snapshot store errors."""


class SnapshotNotFoundError(SnapshotError, KeyError):
    """No snapshot with that version."""


class SnapshotCorruptError(SnapshotError):
    """A snapshot failed verification (checksum, size or format)."""


class SnapshotPinnedError(SnapshotError):
    """The version is pinned; unpin it before deleting."""


class SnapshotWriteError(SnapshotError, OSError):
    """A save did not complete (store down, disk full, timeout): the version is not visible, and
    the store's newest version is what it was before. An ``OSError`` too: it is one."""


class ResumeError(SnapshotError, ValueError):
    """A resume that cannot go on as asked (no intact snapshot, or input it points to is gone):
    one line saying what to do."""


@dataclass(frozen=True)
class SnapshotRef:
    """Where a saved snapshot lives.

    Attributes:
        version: policy version.
        store_url: URL of the store (``file:///...``, ``redis://...`` or ``s3://...``).
        key: file path, Redis key or ``s3://`` object of the weights blob (claim-check reference).
        sha256: hex sha256 of the weights blob.
        nbytes: size of the weights blob.
        created_at_ms: wall-clock save time.
        has_state: whether learner state was saved alongside.
    """

    version: int
    store_url: str
    key: str
    sha256: str
    nbytes: int
    created_at_ms: int
    has_state: bool


@dataclass(frozen=True)
class Snapshot:
    version: int
    weights: dict[str, torch.Tensor]
    meta: dict[str, Any]
    state: Any | None = None


@runtime_checkable
class SnapshotStore(Protocol):
    """What the learner, ``rlstream serve`` and ``rlstream rollback`` use."""

    keep_last: int | None
    keep_timed: int | None
    url: str

    def save(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] | None = None,
        state: Any | None = None,
        timed: bool = False,
    ) -> SnapshotRef: ...
    def load(self, version: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...
    def load_state(self, version: int) -> Any | None: ...
    def ref(self, version: int) -> SnapshotRef: ...
    def versions(self) -> list[int]: ...
    def latest(self) -> int | None: ...
    def delete(self, version: int) -> None: ...
    def pin(self, version: int) -> None: ...
    def unpin(self, version: int) -> None: ...
    def pinned(self) -> set[int]: ...
    def timed(self) -> set[int]: ...
    def prune(self) -> list[int]: ...


# ---------------------------------------------------------------------------
# Encoding (shared by all backends)
# ---------------------------------------------------------------------------


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _cpu_tensor(t: torch.Tensor, seen_storage: set[int]) -> torch.Tensor:
    if t.is_sparse or t.layout is not torch.strided:
        raise TypeError(f"only dense tensors can be saved, got layout {t.layout}")
    out = t.detach().to("cpu").contiguous()
    if out.numel() == 0:
        return out
    ptr = out.untyped_storage().data_ptr()
    if ptr in seen_storage:
        out = out.clone()  # safetensors refuses tensors sharing memory
    else:
        seen_storage.add(ptr)
    return out


def _encode_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    seen: set[int] = set()
    prepared: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
        prepared[name] = _cpu_tensor(t, seen)
    return safetensors.torch.save(prepared)


def _decode_tensors(data: bytes, what: str, version: int) -> dict[str, torch.Tensor]:
    try:
        return dict(safetensors.torch.load(data))
    except Exception as exc:  # SafetensorError, ValueError, ...
        raise SnapshotCorruptError(f"v{version} {what}: not a valid safetensors blob ({exc})") from exc


def flatten_state(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state into ``(tensors, structure)``: tensors by key, nesting as JSON.

    The same tensor object reached twice is stored once and restored as one object.
    """
    tensors: dict[str, torch.Tensor] = {}
    by_id: dict[int, str] = {}

    def enc(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            key = by_id.get(id(obj))
            if key is None:
                key = f"t{len(tensors)}"
                by_id[id(obj)] = key
                tensors[key] = obj
            return {"T": key}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return {"V": obj}
        if isinstance(obj, torch.dtype):
            return {"dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, Mapping):
            items = []
            for k, v in obj.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(f"state dict keys must be str or int, got {k!r}")
                items.append([k if isinstance(k, str) else {"i": k}, enc(v)])
            return {"D": items}
        if isinstance(obj, tuple):
            return {"U": [enc(v) for v in obj]}
        if isinstance(obj, list):
            return {"L": [enc(v) for v in obj]}
        raise TypeError(f"cannot store {type(obj).__name__} in learner state (no pickle)")

    structure = enc(state)
    return tensors, structure


def unflatten_state(tensors: Mapping[str, torch.Tensor], structure: Any) -> Any:
    """Inverse of ``flatten_state``."""

    def dec(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise ValueError(f"bad state structure node {node!r}")
        (tag, val), = node.items()
        if tag == "T":
            return tensors[val]
        if tag == "V":
            return val
        if tag == "dtype":
            dtype = getattr(torch, val, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {val!r}")
            return dtype
        if tag == "D":
            return {(k["i"] if isinstance(k, dict) else k): dec(v) for k, v in val}
        if tag == "U":
            return tuple(dec(v) for v in val)
        if tag == "L":
            return [dec(v) for v in val]
        raise ValueError(f"unknown state structure tag {tag!r}")

    return dec(structure)


@dataclass(frozen=True)
class _Encoded:
    weights: bytes
    state: bytes | None
    record: dict[str, Any]


def _encode(
    version: int, weights: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None, state: Any | None
) -> _Encoded:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an int >= 0, got {version!r}")
    meta_d = dict(meta or {})
    try:
        json.dumps(meta_d)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"meta must be JSON-serialisable: {exc}") from exc
    wbytes = _encode_tensors(weights)
    sbytes: bytes | None = None
    state_rec: dict[str, Any] | None = None
    if state is not None:
        tensors, structure = flatten_state(state)
        sbytes = _encode_tensors(tensors)
        state_rec = {"sha256": _sha256(sbytes), "nbytes": len(sbytes), "structure": structure}
    record: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "version": version,
        "created_at_ms": int(time.time() * 1000),
        "meta": meta_d,
        "weights": {"sha256": _sha256(wbytes), "nbytes": len(wbytes)},
        "state": state_rec,
    }
    record["checksum"] = _sha256(_canonical(record))
    return _Encoded(wbytes, sbytes, record)


def _parse_record(raw: bytes, version: int) -> dict[str, Any]:
    try:
        record = json.loads(raw)
        body = {k: v for k, v in record.items() if k != "checksum"}
        ok = record.get("checksum") == _sha256(_canonical(body))
    except (ValueError, AttributeError, UnicodeDecodeError) as exc:
        raise SnapshotCorruptError(f"v{version} record: unreadable ({exc})") from exc
    if not ok:
        raise SnapshotCorruptError(f"v{version} record: checksum mismatch")
    if record.get("format") != FORMAT_VERSION:
        raise SnapshotCorruptError(f"v{version} record: unsupported format {record.get('format')!r}")
    if record.get("version") != version:
        raise SnapshotCorruptError(f"v{version} record: holds version {record.get('version')!r}")
    return record


def _verify_blob(data: bytes | None, expect: Mapping[str, Any], what: str, version: int) -> bytes:
    if data is None:
        raise SnapshotCorruptError(f"v{version} {what}: blob missing")
    if len(data) != expect["nbytes"]:
        raise SnapshotCorruptError(f"v{version} {what}: {len(data)} bytes, expected {expect['nbytes']}")
    if _sha256(data) != expect["sha256"]:
        raise SnapshotCorruptError(f"v{version} {what}: sha256 mismatch")
    return data


# ---------------------------------------------------------------------------
# Backend-independent store logic
# ---------------------------------------------------------------------------


class _BaseStore:
    """Save/load/retention on top of a few backend primitives."""

    url: str
    keep_last: int | None
    keep_timed: int | None

    def __init__(self, keep_last: int | None, keep_timed: int | None = 7) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 (or None to keep everything)")
        if keep_timed is not None and keep_timed < 0:
            raise ValueError("keep_timed must be >= 0 (or None to keep every time-based snapshot)")
        self.keep_last = keep_last
        self.keep_timed = keep_timed

    # backend primitives ------------------------------------------------
    def _write(self, version: int, enc: _Encoded) -> str:
        """Store all parts of ``version`` (record last / atomically); return the weights key."""
        raise NotImplementedError

    def _read_record(self, version: int) -> bytes | None:
        raise NotImplementedError

    def _read_blobs(self, version: int, state: bool) -> tuple[bytes | None, bytes | None]:
        """``(weights, None)`` or, with ``state``, ``(None, state)``; ``None`` where missing."""
        raise NotImplementedError

    def _weights_key(self, version: int) -> str:
        raise NotImplementedError

    def _remove(self, version: int) -> None:
        raise NotImplementedError

    def versions(self) -> list[int]:
        """Stored versions, ascending."""
        raise NotImplementedError

    def _marks(self, kind: str) -> set[int]:
        """The versions marked ``kind`` (``pins``, ``timed``)."""
        raise NotImplementedError

    def _mark(self, kind: str, add: set[int] = frozenset(), remove: set[int] = frozenset()) -> None:
        raise NotImplementedError

    # public API ---------------------------------------------------------
    def save(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] | None = None,
        state: Any | None = None,
        timed: bool = False,
    ) -> SnapshotRef:
        """Store ``weights`` (+ ``meta``, + optional learner ``state``) as ``version``, then prune.

        ``timed``: a time-based snapshot, kept by ``keep_timed`` besides ``keep_last``. Saving an
        existing version replaces it (a time-based mark it had stays).
        """
        enc = _encode(version, weights, meta, state)
        try:
            key = self._write(version, enc)
            if timed:
                self._mark("timed", add={version})
        except Exception as exc:  # the backend's I/O errors (OSError, botocore, redis...): nothing committed
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else "no answer in time"
            raise SnapshotWriteError(f"v{version} not saved to {self.url}: {type(exc).__name__}: {why}") from exc
        try:
            self.prune()
        except Exception as exc:  # noqa: BLE001 - saved; retention runs again after the next save
            log.warning("snapshot retention in %s failed (%s: %s); the next save prunes again", self.url,
                        type(exc).__name__, exc)
        return self._make_ref(version, key, enc.record)

    def load(self, version: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Verified ``(weights, meta)`` of ``version``."""
        record = self._record(version)
        wbytes, _ = self._read_blobs(version, state=False)
        wbytes = _verify_blob(wbytes, record["weights"], "weights", version)
        return _decode_tensors(wbytes, "weights", version), record["meta"]

    def load_state(self, version: int) -> Any | None:
        """Verified learner state of ``version``, or ``None`` if it was saved without one."""
        record = self._record(version)
        srec = record["state"]
        if srec is None:
            return None
        _, sbytes = self._read_blobs(version, state=True)
        sbytes = _verify_blob(sbytes, srec, "state", version)
        tensors = _decode_tensors(sbytes, "state", version)
        try:
            return unflatten_state(tensors, srec["structure"])
        except (KeyError, ValueError, TypeError) as exc:
            raise SnapshotCorruptError(f"v{version} state: bad structure ({exc})") from exc

    def meta(self, version: int) -> dict[str, Any]:
        """``meta`` of ``version`` without reading the weights."""
        return self._record(version)["meta"]

    def ref(self, version: int) -> SnapshotRef:
        return self._make_ref(version, self._weights_key(version), self._record(version))

    def latest(self) -> int | None:
        vs = self.versions()
        return vs[-1] if vs else None

    def delete(self, version: int) -> None:
        """Remove ``version``; raises ``SnapshotPinnedError`` if pinned, not-found if absent."""
        if version in self.pinned():
            raise SnapshotPinnedError(f"v{version} is pinned; unpin it first")
        if version not in self.versions():
            raise SnapshotNotFoundError(version)
        self._remove(version)
        if version in self._marks("timed"):
            self._mark("timed", remove={version})

    def pin(self, version: int) -> None:
        """Keep ``version`` regardless of ``keep_last``."""
        if version not in self.versions():
            raise SnapshotNotFoundError(version)
        self._mark("pins", add={version})

    def unpin(self, version: int) -> None:
        self._mark("pins", remove={version})

    def pinned(self) -> set[int]:
        return self._marks("pins")

    def timed(self) -> set[int]:
        """Stored versions saved as time-based snapshots."""
        return self._marks("timed") & set(self.versions())

    def prune(self) -> list[int]:
        """Apply retention now; returns the deleted versions (oldest first)."""
        if self.keep_last is None:
            return []
        vs = self.versions()
        timed = sorted(self._marks("timed") & set(vs))
        keep_timed = timed if self.keep_timed is None else timed[len(timed) - self.keep_timed :]
        keep = set(vs[-self.keep_last :]) | set(keep_timed) | self.pinned()
        doomed = [v for v in vs if v not in keep]
        for v in doomed:
            self._remove(v)
        if doomed and set(doomed) & set(timed):
            self._mark("timed", remove=set(doomed) & set(timed))
        return doomed

    # helpers -------------------------------------------------------------
    def _record(self, version: int) -> dict[str, Any]:
        raw = self._read_record(version)
        if raw is None:
            raise SnapshotNotFoundError(version)
        return _parse_record(raw, version)

    def _make_ref(self, version: int, key: str, record: Mapping[str, Any]) -> SnapshotRef:
        return SnapshotRef(
            version=version,
            store_url=self.url,
            key=key,
            sha256=record["weights"]["sha256"],
            nbytes=record["weights"]["nbytes"],
            created_at_ms=record["created_at_ms"],
            has_state=record["state"] is not None,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, keep_last={self.keep_last}, keep_timed={self.keep_timed})"


# ---------------------------------------------------------------------------
# Local directory
# ---------------------------------------------------------------------------

_RECORD_RE = re.compile(r"^v(\d{8,})\.json$")


class LocalDirSnapshotStore(_BaseStore):
    """Snapshots as files in a directory.

    Per version: ``v{version:08d}.safetensors`` (weights), ``v{version:08d}.state.safetensors``
    (optional learner state) and ``v{version:08d}.json`` (the record, written
    last: its presence commits the version). Pins in ``pins.json``, time-based marks in
    ``timed.json``. Every file is
    written to a temporary name in the same directory, fsynced, then
    ``os.replace``-d into place, so a crash never leaves a half-written file
    under a real name.
    """

    def __init__(self, path: str | os.PathLike[str], keep_last: int | None = 10, fsync: bool = True,
                 keep_timed: int | None = 7) -> None:
        super().__init__(keep_last, keep_timed)
        self.path = Path(path).expanduser().resolve()
        self.path.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.url = self.path.as_uri()

    def _file(self, version: int, suffix: str) -> Path:
        return self.path / f"v{version:08d}{suffix}"

    def _atomic_write(self, target: Path, data: bytes) -> None:
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        if self.fsync:
            self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write(self, version: int, enc: _Encoded) -> str:
        wfile = self._file(version, ".safetensors")
        sfile = self._file(version, ".state.safetensors")
        self._atomic_write(wfile, enc.weights)
        if enc.state is not None:
            self._atomic_write(sfile, enc.state)
        else:
            with contextlib.suppress(FileNotFoundError):
                sfile.unlink()
        self._atomic_write(self._file(version, ".json"), _canonical(enc.record))
        return str(wfile)

    def _weights_key(self, version: int) -> str:
        return str(self._file(version, ".safetensors"))

    @staticmethod
    def _read(path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def _read_record(self, version: int) -> bytes | None:
        return self._read(self._file(version, ".json"))

    def _read_blobs(self, version: int, state: bool) -> tuple[bytes | None, bytes | None]:
        if state:
            return None, self._read(self._file(version, ".state.safetensors"))
        return self._read(self._file(version, ".safetensors")), None

    def _remove(self, version: int) -> None:
        # Record first: from then on the version no longer exists for readers.
        for suffix in (".json", ".safetensors", ".state.safetensors"):
            with contextlib.suppress(FileNotFoundError):
                self._file(version, suffix).unlink()

    def versions(self) -> list[int]:
        out = []
        for entry in os.scandir(self.path):
            m = _RECORD_RE.match(entry.name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def _marks(self, kind: str) -> set[int]:
        return _parse_marks(self._read(self.path / f"{kind}.json"), kind)

    def _mark(self, kind: str, add: set[int] = frozenset(), remove: set[int] = frozenset()) -> None:
        marks = (self._marks(kind) | set(add)) - set(remove)
        self._atomic_write(self.path / f"{kind}.json", json.dumps(sorted(marks)).encode())


def _parse_marks(raw: bytes | None, kind: str) -> set[int]:
    if raw is None:
        return set()
    try:
        return {int(v) for v in json.loads(raw)}
    except (ValueError, TypeError) as exc:
        raise SnapshotCorruptError(f"{kind}.json unreadable ({exc})") from exc


# ---------------------------------------------------------------------------
# Redis
# ---------------------------------------------------------------------------


class RedisSnapshotStore(_BaseStore):
    """Snapshots in Redis (redis-py).

    Keys, for ``prefix`` ``P`` and version ``V``:

    * ``P:weights:V``: weights safetensors bytes (the claim-check key);
    * ``P:state:V``: learner state safetensors bytes (optional);
    * ``P:meta:V``: hash with ``record`` (the JSON record), plus ``sha256`` and
      ``created_at_ms`` for people and other tools reading Redis directly;
    * ``P:versions``: sorted set of versions (score = version);
    * ``P:pins``: set of pinned versions; ``P:timed``: set of time-based ones.

    Writes and deletes run in one MULTI/EXEC transaction, reads in another, so a
    reader never sees a half-written version. A Redis string holds at most
    512 MB: fine for policies, not for very large models.
    """

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        prefix: str = "rlstream:snapshots",
        keep_last: int | None = 10,
        client: Any | None = None,
        keep_timed: int | None = 7,
    ) -> None:
        super().__init__(keep_last, keep_timed)
        import redis  # local import: only this backend needs it

        self.prefix = prefix.rstrip(":")
        self._r = client if client is not None else redis.Redis.from_url(url)
        # Never carry a password into refs, events or logs.
        self.url = _with_query(_redact(url), {"prefix": self.prefix})
        self._versions_key = f"{self.prefix}:versions"

    def _k(self, kind: str, version: int) -> str:
        return f"{self.prefix}:{kind}:{version}"

    def _write(self, version: int, enc: _Encoded) -> str:
        pipe = self._r.pipeline(transaction=True)
        pipe.set(self._k("weights", version), enc.weights)
        if enc.state is not None:
            pipe.set(self._k("state", version), enc.state)
        else:
            pipe.delete(self._k("state", version))
        meta_key = self._k("meta", version)
        pipe.delete(meta_key)
        pipe.hset(
            meta_key,
            mapping={
                "record": _canonical(enc.record),
                "sha256": enc.record["weights"]["sha256"],
                "created_at_ms": enc.record["created_at_ms"],
            },
        )
        pipe.zadd(self._versions_key, {str(version): version})
        pipe.execute()
        return self._k("weights", version)

    def _weights_key(self, version: int) -> str:
        return self._k("weights", version)

    def _read_record(self, version: int) -> bytes | None:
        raw = self._r.hget(self._k("meta", version), "record")
        return None if raw is None else bytes(raw)

    def _read_blobs(self, version: int, state: bool) -> tuple[bytes | None, bytes | None]:
        key = self._k("state" if state else "weights", version)
        data = self._r.get(key)
        data = None if data is None else bytes(data)
        return (None, data) if state else (data, None)

    def _remove(self, version: int) -> None:
        pipe = self._r.pipeline(transaction=True)
        pipe.zrem(self._versions_key, str(version))
        pipe.delete(self._k("meta", version), self._k("weights", version), self._k("state", version))
        pipe.execute()

    def versions(self) -> list[int]:
        return [int(v) for v in self._r.zrange(self._versions_key, 0, -1)]

    def _marks(self, kind: str) -> set[int]:
        return {int(v) for v in self._r.smembers(f"{self.prefix}:{kind}")}

    def _mark(self, kind: str, add: set[int] = frozenset(), remove: set[int] = frozenset()) -> None:
        if add:
            self._r.sadd(f"{self.prefix}:{kind}", *map(str, add))
        if remove:
            self._r.srem(f"{self.prefix}:{kind}", *map(str, remove))

    def iter_keys(self) -> Iterator[bytes]:
        """Every Redis key under the prefix (tests and cleanup)."""
        yield from self._r.scan_iter(match=f"{self.prefix}:*")

    def close(self) -> None:
        self._r.close()


# ---------------------------------------------------------------------------
# S3-compatible object storage
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Factory, schedule and rollback
# ---------------------------------------------------------------------------


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


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))


def _with_query(url: str, extra: Mapping[str, str]) -> str:
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    query.update({k: [v] for k, v in extra.items()})
    return urlunsplit(parts._replace(query=urlencode(query, doseq=True)))


def _keep_last(query: dict[str, list[str]], default: int | None) -> int | None:
    if "keep_last" not in query:
        return default
    n = int(query["keep_last"][-1])
    return None if n == 0 else n


def _keep_timed(query: dict[str, list[str]], default: int | None) -> int | None:
    return int(query["keep_timed"][-1]) if "keep_timed" in query else default


def newest_timed_ms(store: SnapshotStore) -> int | None:
    """Save time (wall clock, ms) of the store's newest time-based snapshot; None if it has none."""
    for version in sorted(store.timed(), reverse=True):
        with contextlib.suppress(SnapshotError):  # an unreadable record: the one before it
            return store.ref(version).created_at_ms
    return None


class SnapshotSchedule:
    """When the learner snapshots: every ``every`` updates (0: never), and once ``interval_s``
    seconds of ``clock`` have passed since the last time-based one (0: never). The first
    time-based snapshot is due ``interval_s`` after ``last_timed_s`` (the store's newest, so a
    restart keeps the cadence; None: from now).
    """

    def __init__(self, every: int, interval_s: float, clock: Callable[[], float] = time.time,
                 last_timed_s: float | None = None) -> None:
        if every < 0 or interval_s < 0:
            raise ValueError("snapshot every and interval must be >= 0")
        self.every, self.interval_s, self.clock = every, interval_s, clock
        self.last_timed_s = clock() if last_timed_s is None else last_timed_s

    def due(self, updates: int) -> tuple[bool, bool]:
        """``(by updates, by time)`` after update number ``updates``."""
        by_count = bool(self.every) and updates % self.every == 0
        by_time = bool(self.interval_s) and self.clock() - self.last_timed_s >= self.interval_s
        return by_count, by_time

    def taken(self, timed: bool) -> None:
        """A snapshot was saved now (``timed``: as a time-based one)."""
        if timed:
            self.last_timed_s = self.clock()


def rollback(store: SnapshotStore, to_version: int, *, with_state: bool = False, pin: bool = False) -> Snapshot:
    """Weights (and meta) of ``to_version``, verified, for republishing a known-good policy.

    The learner republishes them as a *new* version (versions stay monotonic;
    ``parent_version=to_version``). ``with_state`` also loads the learner state
    (slower); ``pin`` protects ``to_version`` from retention.
    """
    weights, meta = store.load(to_version)
    state = store.load_state(to_version) if with_state else None
    if pin:
        store.pin(to_version)
    return Snapshot(to_version, weights, meta, state)
