"""The policy layer every role shares: PolicyVersion events out of a learner, into a module elsewhere.

    pv = make_policy_version(policy, policy_id="policy", version=3, ..., blob_store=blobs)
    publish_policy_version(events, pv)

    policy = load_policy(pv, blobs)                       # THE loader: inline or claim-checked weights
    follower = PolicyFollower(events, "policy", StartRule.back(4), blobs=blobs)
    for update in follower.poll(0.1):                     # decoded versions of this policy, in log order

In the spirit of Acme's VariableSource / VariableClient: the learner is the source, every other
reader (actor, stream processors, inference server, subscriber, rollback) a client that follows
``rl.policy.versions`` with an explicit start rule (``StartRule``):

* ``newest()``: the newest record of THIS policy now on the topic (read back from the log end,
  not replayed), then every later one;
* ``back(k)``: the newest ``k + 1`` records of this policy (what a staleness window of K needs);
* ``at_version(v)``: every version >= v, replayed from the start of the topic, then live ones.

The architecture travels in the safetensors metadata, so any process rebuilds the exact module
from the event alone. Weights go by claim check (Redis, or any ``BlobStore``) with a sha256 the
loader verifies when they are over ``claim_check_above`` and a store is configured (a tiny record
fans out to every reader; each host fetches the blob once), and must when they are over the
inline limit. A fetch that fails is retried with backoff (``FetchRetry``). Inference-only readers
(actors) share one fetch and decode per version and process (``SharedWeights``) and adopt by
reference, not by copy; behind ``open_blob_store`` each host fetches a blob once
(``streams.blobcache``). The layer sits below every role: it imports ``config``, ``schemas``,
``streams.bus``/``streams.topics``/``streams.events``/``streams.blobcache`` and ``agents`` only.
Its modules (``streams/policy/``): ``errors``, ``arch`` (architecture <-> module), ``blobs`` (the
claim-check store, Redis, retries), ``loader``, ``publish``, ``tail`` (reading back from the log
end) and ``follower``; this module is their public surface.
"""

from __future__ import annotations

from config.limits import DEFAULT_CLAIM_CHECK_ABOVE, DEFAULT_INLINE_LIMIT
from streams.policy.arch import arch_of, policy_from_arch
from streams.policy.blobs import (DEFAULT_RETRY, BlobStore, Blobs, FetchRetry, HostCachedStore, RedisBlobStore,
                                  open_blob_store)
from streams.policy.errors import BlobWriteError, PolicyLoadError
from streams.policy.follower import PolicyFollower, PolicyUpdate, StartRule, start_offsets
from streams.policy.loader import (PROCESS_WEIGHTS, PolicyLogpFn, SharedWeights, decode_version, load_policy,
                                   load_state, weights_bytes)
from streams.policy.publish import make_policy_version, publish_policy_version
from streams.policy.tail import decodes_as, newest_version, tail_offsets

__all__ = ["DEFAULT_CLAIM_CHECK_ABOVE", "DEFAULT_INLINE_LIMIT", "DEFAULT_RETRY", "PROCESS_WEIGHTS", "BlobStore",
           "BlobWriteError", "Blobs", "FetchRetry", "HostCachedStore", "PolicyFollower", "PolicyLoadError",
           "PolicyLogpFn", "PolicyUpdate", "RedisBlobStore", "SharedWeights", "StartRule", "arch_of", "decode_version",
           "decodes_as", "load_policy", "load_state", "make_policy_version", "newest_version", "open_blob_store",
           "policy_from_arch", "publish_policy_version", "start_offsets", "tail_offsets", "weights_bytes"]
