"""Policy weights on the wire: safetensors bytes (raw tensors + a JSON-able str metadata map).

Never pickle: ``safetensors`` parses a JSON header and raw buffers only, so a hostile payload
cannot run code. Architecture facts the receiver needs to rebuild the module (obs_dim, act_dim,
hidden sizes) travel in the metadata. A writable payload (a buffer the reader owns, such as a
claim-check fetch) decodes in place: its tensors are views of it, not copies.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from schemas.errors import InvalidEventError

ARCH_KEY = "rlstream.arch"


def encode_weights(state_dict: dict[str, torch.Tensor], arch: dict[str, Any] | None = None) -> bytes:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    meta = {ARCH_KEY: json.dumps(arch or {}, sort_keys=True)}
    return st_save(tensors, metadata=meta)


_DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _views(data: memoryview, header: dict, start: int) -> dict[str, torch.Tensor] | None:
    """The tensors of ``header`` as views of ``data`` (body at ``start``), checked as safetensors
    checks them (known dtype, sizes, offsets tiling the body); None where a tensor would be
    misaligned or its dtype is unknown here (the copying loader then decides)."""
    spans, out = [], {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(t.get("dtype")) if isinstance(t, dict) else None
        if dtype is None:
            return None
        shape, (begin, end) = [int(d) for d in t["shape"]], [int(o) for o in t["data_offsets"]]
        itemsize, numel = torch.empty((), dtype=dtype).element_size(), 1
        for d in shape:
            numel *= d
        if min(shape, default=0) < 0 or end - begin != numel * itemsize or (start + begin) % itemsize:
            return None
        spans.append((begin, end))
        out[name] = (torch.frombuffer(data, dtype=dtype, count=numel, offset=start + begin).reshape(shape)
                     if numel else torch.empty(shape, dtype=dtype))
    spans.sort()
    if [b for b, _ in spans] != [0, *(e for _, e in spans[:-1])] or (spans[-1][1] if spans else 0) != len(data) - start:
        raise InvalidEventError("weights payload's tensors do not tile its body")
    return out


def decode_weights(data: bytes | bytearray | memoryview | Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict, arch). Raises InvalidEventError on anything that is not safetensors. The
    tensors of a writable buffer (a ``bytearray``, a uint8 array) are views of it (zero copy):
    it must not change afterwards; ``bytes`` are copied."""
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise InvalidEventError("weights payload is not safetensors bytes") from None
    if len(view) < 8:
        raise InvalidEventError("weights payload is not safetensors bytes")
    try:
        header_len = int.from_bytes(view[:8], "little")
        if header_len <= 0 or 8 + header_len > len(view):
            raise InvalidEventError("weights payload has a bad safetensors header length")
        header = json.loads(bytes(view[8:8 + header_len]))
        meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
        if not isinstance(meta, dict):
            raise InvalidEventError("weights payload has a safetensors header that is not an object")
        arch = json.loads(meta.get(ARCH_KEY, "{}"))
        if not isinstance(arch, dict):
            raise InvalidEventError(f"weights architecture metadata is not an object: {arch!r}"[:200])
        views = None if view.readonly else _views(view, header, 8 + header_len)
        tensors = views if views is not None else st_load(bytes(view))
    except InvalidEventError:
        raise
    except (SafetensorError, ValueError, UnicodeDecodeError, TypeError, KeyError, RuntimeError) as e:
        raise InvalidEventError(f"weights payload is not valid safetensors: {e}") from e
    return tensors, arch


def sha256(data: bytes | bytearray | memoryview | Any) -> str:
    return hashlib.sha256(data).hexdigest()
