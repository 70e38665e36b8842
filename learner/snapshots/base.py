"""The store every backend shares: the ``SnapshotStore`` protocol, and ``_BaseStore``'s save,
load (verified), pins and retention over a few backend primitives.

Retention: after each ``save`` the store keeps the newest ``keep_last`` versions,
the newest ``keep_timed`` of the versions saved as time-based (``save(..., timed=True)``:
the learner's daily snapshots, ``SnapshotSchedule``), and every pinned version
(``pin``), and deletes the rest. Pins and time-based marks are stored with the
snapshots, so they survive restarts and are shared by every process using the
store. ``delete`` refuses a pinned version.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from learner.snapshots.format import (
    SnapshotCorruptError,
    SnapshotNotFoundError,
    SnapshotPinnedError,
    SnapshotRef,
    SnapshotWriteError,
    _decode_tensors,
    _encode,
    _Encoded,
    _parse_record,
    _verify_blob,
    unflatten_state,
)

log = logging.getLogger(__name__)


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
