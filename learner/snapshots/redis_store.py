"""Snapshots in Redis (redis-py), written and read in MULTI/EXEC transactions."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from learner.snapshots.base import _BaseStore
from learner.snapshots.format import _canonical, _Encoded


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
