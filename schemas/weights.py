"""Policy weights on the wire: safetensors bytes (raw tensors + a JSON-able str metadata map).

Never pickle: ``safetensors`` parses a JSON header and raw buffers only, so a hostile payload
cannot run code. Architecture facts the receiver needs to rebuild the module (obs_dim, act_dim,
hidden sizes) travel in the metadata.
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


def decode_weights(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict, arch). Raises InvalidEventError on anything that is not safetensors."""
    if not isinstance(data, (bytes, bytearray)) or len(data) < 8:
        raise InvalidEventError("weights payload is not safetensors bytes")
    try:
        header_len = int.from_bytes(data[:8], "little")
        if header_len <= 0 or 8 + header_len > len(data):
            raise InvalidEventError("weights payload has a bad safetensors header length")
        header = json.loads(bytes(data[8:8 + header_len]))
        meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
        if not isinstance(meta, dict):
            raise InvalidEventError("weights payload has a safetensors header that is not an object")
        arch = json.loads(meta.get(ARCH_KEY, "{}"))
        if not isinstance(arch, dict):
            raise InvalidEventError(f"weights architecture metadata is not an object: {arch!r}"[:200])
        tensors = st_load(bytes(data))
    except InvalidEventError:
        raise
    except (SafetensorError, ValueError, UnicodeDecodeError, TypeError) as e:
        raise InvalidEventError(f"weights payload is not valid safetensors: {e}") from e
    return tensors, arch


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
