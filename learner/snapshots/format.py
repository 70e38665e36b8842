"""What a snapshot is, the same on every backend: the errors, ``SnapshotRef`` and ``Snapshot``,
and the bytes.

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
  (store down, no answer in time, disk full) raises ``SnapshotWriteError`` and
  leaves the store's newest version as it was: the record, written last, is what commits one.
* file layout (a directory or an object prefix): ``v{version:08d}.json`` per record,
  ``pins.json`` and ``timed.json`` for the marks.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch

FORMAT_VERSION = 1


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


_RECORD_RE = re.compile(r"^v(\d{8,})\.json$")


def _parse_marks(raw: bytes | None, kind: str) -> set[int]:
    if raw is None:
        return set()
    try:
        return {int(v) for v in json.loads(raw)}
    except (ValueError, TypeError) as exc:
        raise SnapshotCorruptError(f"{kind}.json unreadable ({exc})") from exc
