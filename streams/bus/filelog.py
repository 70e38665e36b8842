"""An append-only file per topic partition, so the in-memory bus can outlive its process.

A co-located run keeps its whole event history (policy versions, samples, gradient steps)
in ``<run>/log`` and its consumer groups' commits beside it: a restarted run resumes from
committed offsets, and ``rlstream replay`` reads the topics back for offline training.

Record frame (little-endian)::

    u32 magic "RLG1" | u32 body_len | u32 crc32(body) | body
    body = i64 offset | i64 timestamp_ms | i32 key_len (-1: none) | key
           | u32 value_len | value | u16 n_headers | (u16 name_len, name, u32 len, bytes)*

A torn last frame (crash mid-write) is cut off on open; a frame with a bad CRC elsewhere is
corruption and refuses to open, with the file and byte position in the error.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

from streams.bus.base import BusError, Record

MAGIC = b"RLG1"
_FRAME = struct.Struct("<4sII")
_HEAD = struct.Struct("<qqi")


class LogCorruptError(BusError):
    """A partition file holds a damaged record before its end."""


def encode_frame(r: Record) -> bytes:
    parts = [_HEAD.pack(r.offset, r.timestamp_ms, -1 if r.key is None else len(r.key))]
    if r.key is not None:
        parts.append(r.key)
    parts.append(struct.pack("<I", len(r.value)))
    parts.append(r.value)
    parts.append(struct.pack("<H", len(r.headers)))
    for name, v in r.headers.items():
        n = name.encode()
        parts += [struct.pack("<H", len(n)), n, struct.pack("<I", len(v)), bytes(v)]
    body = b"".join(parts)
    return _FRAME.pack(MAGIC, len(body), zlib.crc32(body)) + body


def _decode_body(topic: str, partition: int, body: bytes) -> Record:
    offset, ts, klen = _HEAD.unpack_from(body, 0)
    pos = _HEAD.size
    key = None
    if klen >= 0:
        key = body[pos:pos + klen]
        pos += klen
    (vlen,) = struct.unpack_from("<I", body, pos)
    pos += 4
    value = body[pos:pos + vlen]
    pos += vlen
    (nh,) = struct.unpack_from("<H", body, pos)
    pos += 2
    headers = {}
    for _ in range(nh):
        (nl,) = struct.unpack_from("<H", body, pos)
        pos += 2
        name = body[pos:pos + nl].decode()
        pos += nl
        (hl,) = struct.unpack_from("<I", body, pos)
        pos += 4
        headers[name] = body[pos:pos + hl]
        pos += hl
    return Record(topic, partition, offset, key, value, headers, ts)


def read_partition(path: Path, topic: str, partition: int) -> Iterator[Record]:
    """Every complete record; cuts a torn tail off the file."""
    data = path.read_bytes()
    pos, good = 0, 0
    while pos + _FRAME.size <= len(data):
        magic, blen, crc = _FRAME.unpack_from(data, pos)
        end = pos + _FRAME.size + blen
        if magic != MAGIC:
            raise LogCorruptError(f"{path}: bad record magic at byte {pos}")
        if end > len(data):
            break  # torn tail
        body = data[pos + _FRAME.size:end]
        if zlib.crc32(body) != crc:
            if end == len(data):
                break  # torn tail whose length made it in but not all bytes
            raise LogCorruptError(f"{path}: CRC mismatch in the record at byte {pos}")
        yield _decode_body(topic, partition, body)
        pos = good = end
    if good < len(data):
        with path.open("r+b") as f:
            f.truncate(good)


class FileLog:
    """The files of one bus directory: ``<dir>/<topic>/<partition>.log`` and ``<dir>/_groups.json``."""

    def __init__(self, directory: Path, fsync: bool = False) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._files: dict[tuple[str, int], object] = {}
        self._topics_path = self.dir / "_topics.json"

    def topics(self) -> dict[str, dict]:
        if not self._topics_path.exists():
            return {}
        return json.loads(self._topics_path.read_text())

    def add_topic(self, name: str, partitions: int, max_bytes: int | None) -> None:
        topics = self.topics()
        if name not in topics:
            topics[name] = {"partitions": partitions, "max_message_bytes": max_bytes}
            self._write_json(self._topics_path, topics)

    def records(self, topic: str, partition: int) -> Iterator[Record]:
        path = self._path(topic, partition)
        if path.exists():
            yield from read_partition(path, topic, partition)

    def append(self, r: Record) -> None:
        f = self._files.get((r.topic, r.partition))
        if f is None:
            path = self._path(r.topic, r.partition)
            path.parent.mkdir(parents=True, exist_ok=True)
            f = self._files[(r.topic, r.partition)] = path.open("ab")
        f.write(encode_frame(r))

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    def groups(self) -> dict[str, dict[tuple[str, int], int]]:
        path = self.dir / "_groups.json"
        if not path.exists():
            return {}
        raw = json.loads(path.read_text())
        return {g: {(t, int(p)): int(o) for t, p, o in offs} for g, offs in raw.items()}

    def save_groups(self, groups: dict[str, dict[tuple[str, int], int]]) -> None:
        self._write_json(self.dir / "_groups.json",
                         {g: [[t, p, o] for (t, p), o in sorted(offs.items())] for g, offs in groups.items()})

    def close(self) -> None:
        self.flush()
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _path(self, topic: str, partition: int) -> Path:
        return self.dir / topic / f"{partition}.log"

    @staticmethod
    def _write_json(path: Path, obj) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, path)
