"""Snapshots as files in a local directory, each written to a temporary name, fsynced and
renamed into place."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path

from learner.snapshots.base import _BaseStore
from learner.snapshots.format import _RECORD_RE, _canonical, _Encoded, _parse_marks


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
