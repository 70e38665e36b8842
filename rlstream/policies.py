"""PolicyVersion <-> torch Policy: how weights leave a learner and become a module elsewhere.

The architecture travels in the safetensors metadata, so any process (actor, stream processor,
inference server, subscriber) rebuilds the exact module from the event alone. Large weights go
by claim check (Redis or a file store) with a sha256 the receiver verifies.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from agents.networks import Policy
from schemas.errors import InvalidEventError
from schemas.events import ClaimCheck, PolicyVersion, now_ms
from schemas.weights import decode_weights, encode_weights, sha256
from streams.topics import POLICY_VERSIONS, PUBLISHED_NS_HEADER

# Weights above this size go to the blob store and the event carries a claim check.
DEFAULT_INLINE_LIMIT = 4 * 1024 * 1024


def arch_of(policy: Policy) -> dict[str, Any]:
    body = policy.net.actor_body
    hidden = [m.out_features for m in body if isinstance(m, torch.nn.Linear)][:-1]
    act_name = next((type(m).__name__.lower() for m in body if not isinstance(m, torch.nn.Linear)), "tanh")
    extra = {"nvec": list(policy.nvec)} if policy.nvec else {}
    return {
        "kind": "categorical_mlp" if policy.nvec else "gaussian_mlp",
        **extra,
        "obs_dim": policy.obs_dim,
        "act_dim": policy.act_dim,
        "hidden": hidden,
        "activation": act_name,
        "normalize_obs": policy.normalize_obs,
        "obs_clip": policy.obs_clip,
    }


def _arch_dims(arch: Any) -> list[int]:
    """[obs_dim, *hidden, actor outputs] of a gaussian_mlp (outputs: act_dim) or categorical_mlp
    (outputs: sum(nvec)) architecture; InvalidEventError if it is neither."""
    if not isinstance(arch, dict):
        raise InvalidEventError(f"policy architecture must be an object, not {type(arch).__name__}")
    if arch.get("kind") not in ("gaussian_mlp", "categorical_mlp"):
        raise InvalidEventError(f"unsupported policy architecture {arch.get('kind')!r}")
    try:
        out = sum(int(n) for n in arch["nvec"]) if arch["kind"] == "categorical_mlp" else int(arch["act_dim"])
        dims = [int(arch["obs_dim"]), *(int(h) for h in arch["hidden"]), out]
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidEventError(f"bad policy architecture {arch}: {e}") from e
    if any(d <= 0 for d in dims):
        raise InvalidEventError(f"bad policy architecture {arch}: sizes must be positive")
    return dims


def policy_from_arch(arch: dict[str, Any], max_params: int | None = None) -> Policy:
    """Build the module of ``arch``. ``max_params``: refuse (before allocating anything) an
    architecture whose actor layers alone hold more parameters than this -- the weights that
    come with it: an event must not make a reader allocate what its payload cannot fill."""
    dims = _arch_dims(arch)
    need = sum(a * b for a, b in itertools.pairwise(dims))
    if max_params is not None and need > max_params:
        raise InvalidEventError(f"policy architecture {arch} needs {need} parameters; "
                                f"its weights hold {max_params}")
    try:
        return Policy(
            obs_dim=dims[0],
            act_dim=int(arch["act_dim"]),
            hidden=tuple(dims[1:-1]),
            activation=str(arch.get("activation", "tanh")),
            normalize_obs=bool(arch.get("normalize_obs", True)),
            obs_clip=arch.get("obs_clip", 10.0),
            nvec=arch.get("nvec") if arch["kind"] == "categorical_mlp" else None,
        )
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise InvalidEventError(f"bad policy architecture {arch}: {e}") from e


class BlobStore(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...


def make_policy_version(
    policy: Policy, *, policy_id: str, version: int, parent_version: int | None, learner_id: str,
    algo: str, metrics: dict[str, float] | None = None, blob_store: BlobStore | None = None,
    inline_limit: int = DEFAULT_INLINE_LIMIT,
) -> PolicyVersion:
    data = encode_weights(policy.state_dict(), arch_of(policy))
    weights, ref = data, None
    if len(data) > inline_limit:
        if blob_store is None:
            raise ValueError(
                f"weights of {len(data)} bytes exceed the inline limit {inline_limit}; configure a blob store"
            )
        key = f"rlstream:weights:{policy_id}:{version}"
        blob_store.put(key, data)
        weights, ref = None, ClaimCheck(store=blob_store.url, key=key, sha256=sha256(data), size=len(data))
    return PolicyVersion(
        policy_id=policy_id, version=version, created_at_ms=now_ms(), learner_id=learner_id, algo=algo,
        weights=weights, weights_ref=ref, parent_version=parent_version, metrics=dict(metrics or {}),
    )


def publish_policy_version(events: Any, pv: PolicyVersion) -> None:
    """Put ``pv`` on rl.policy.versions (key: policy_id) with the publish-time header, and flush."""
    events.bus.produce(
        POLICY_VERSIONS, events.codec.encode(pv), key=pv.policy_id.encode(),
        headers={**events.codec.headers_for(pv), PUBLISHED_NS_HEADER: str(time.time_ns()).encode()},
    )
    events.flush()


def weights_bytes(pv: PolicyVersion, blob_store: BlobStore | None = None) -> bytes:
    if pv.weights is not None:
        return pv.weights
    if pv.weights_ref is None:
        raise InvalidEventError(f"policy version {pv.version} has neither weights nor a claim check")
    if blob_store is None:
        raise InvalidEventError(f"policy version {pv.version} is a claim check but no blob store is configured")
    data = blob_store.get(pv.weights_ref.key)
    if sha256(data) != pv.weights_ref.sha256:
        raise InvalidEventError(f"claim-checked weights of version {pv.version} fail their sha256")
    return data


def load_into(policy: Policy | None, pv: PolicyVersion, blob_store: BlobStore | None = None) -> Policy:
    """Load the version's weights into ``policy`` (rebuilt if None or of another shape)."""
    state, arch = decode_weights(weights_bytes(pv, blob_store))
    if policy is None or arch_of(policy) != arch:
        policy = policy_from_arch(arch, max_params=sum(t.numel() for t in state.values()))
    # check every name and shape first: torch copies matching tensors before it raises, and a
    # half-loaded module must never act
    expected = {k: tuple(v.shape) for k, v in policy.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if expected != got:
        diff = sorted(set(expected.items()) ^ set(got.items()))[:4]
        raise InvalidEventError(f"weights of version {pv.version} do not fit the architecture: {diff}")
    try:
        policy.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise InvalidEventError(f"weights of version {pv.version} do not fit the architecture: {e}") from e
    policy.eval()
    return policy


@dataclass
class RedisBlobStore:
    """Claim-check store on Redis (weights over the inline limit)."""

    url: str

    def __post_init__(self) -> None:
        import redis

        self._r = redis.Redis.from_url(self.url)

    def put(self, key: str, data: bytes) -> None:
        self._r.set(key, data)

    def get(self, key: str) -> bytes:
        data = self._r.get(key)
        if data is None:
            raise InvalidEventError(f"claim-check key {key} not found in {self.url}")
        return data
