"""Publishing: a policy's weights as a PolicyVersion event, inline or by claim check."""

from __future__ import annotations

import logging
import time
from typing import Any


from agents.networks import Policy
# Weights above DEFAULT_INLINE_LIMIT must go to the blob store (the event carries a claim check);
# above DEFAULT_CLAIM_CHECK_ABOVE they go there when one is configured: one tiny record fans out
# to every reader instead of the weights, and a process of many readers fetches them once.
from config.limits import DEFAULT_CLAIM_CHECK_ABOVE, DEFAULT_INLINE_LIMIT
from schemas.events import ClaimCheck, PolicyVersion, now_ms
from schemas.weights import encode_weights, sha256
from streams.topics import POLICY_VERSIONS, PUBLISHED_NS_HEADER

from streams.policy.arch import arch_of
from streams.policy.blobs import BlobStore, HostCachedStore

log = logging.getLogger(__name__)


# -- publishing ----------------------------------------------------------------------------------

def make_policy_version(
    policy: Policy, *, policy_id: str, version: int, parent_version: int | None, learner_id: str,
    algo: str, metrics: dict[str, float] | None = None, blob_store: BlobStore | None = None,
    inline_limit: int = DEFAULT_INLINE_LIMIT, claim_check_above: int = DEFAULT_CLAIM_CHECK_ABOVE,
) -> PolicyVersion:
    """The event of ``policy``'s weights: inline, or by claim check when they are over
    ``claim_check_above`` and ``blob_store`` is given (they must be over ``inline_limit``)."""
    data = encode_weights(policy.state_dict(), arch_of(policy))
    weights, ref = data, None
    if len(data) > inline_limit or (blob_store is not None and len(data) > claim_check_above):
        if blob_store is None:
            raise ValueError(
                f"weights of {len(data)} bytes exceed the inline limit {inline_limit}; configure a blob store"
            )
        digest = sha256(data)
        key = f"rlstream:weights:{policy_id}:{version}:{digest[:16]}"  # a republished version never clobbers
        blob_store.put(key, data)
        if isinstance(blob_store, HostCachedStore):  # readers on this host need not fetch it
            blob_store.cache.put(digest, data)
        weights, ref = None, ClaimCheck(store=blob_store.url, key=key, sha256=digest, size=len(data))
    return PolicyVersion(
        policy_id=policy_id, version=version, created_at_ms=now_ms(), learner_id=learner_id, algo=algo,
        weights=weights, weights_ref=ref, parent_version=parent_version, metrics=dict(metrics or {}),
    )


def publish_policy_version(events: Any, pv: PolicyVersion, flush: bool = True) -> None:
    """Put ``pv`` on rl.policy.versions (key: policy_id) with the publish-time header, and flush
    (``flush=False``: the caller's next flush does, with what it writes meanwhile: on a
    transactional bus, one transaction)."""
    events.bus.produce(
        POLICY_VERSIONS, events.codec.encode(pv), key=pv.policy_id.encode(),
        headers={**events.codec.headers_for(pv), PUBLISHED_NS_HEADER: str(time.time_ns()).encode()},
    )
    if flush:
        events.flush()
