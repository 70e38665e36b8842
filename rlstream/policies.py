"""Moved to ``streams.policies`` (the policy layer below every role); kept as a re-export for
the tools and scripts that import it from here. ``load_into(policy, pv, blobs)`` is
``streams.policies.load_policy(pv, blobs, into=policy)``."""

from __future__ import annotations

from typing import Any

from streams.policies import (  # noqa: F401
    DEFAULT_INLINE_LIMIT,
    BlobStore,
    PolicyLoadError,
    RedisBlobStore,
    arch_of,
    load_policy,
    make_policy_version,
    policy_from_arch,
    publish_policy_version,
    weights_bytes,
)


def load_into(policy: Any, pv: Any, blob_store: Any = None) -> Any:
    """``load_policy(pv, blob_store, into=policy)``."""
    return load_policy(pv, blob_store, into=policy)
