"""``rlstream rollback --to K``: republish snapshot K as the newest policy version.

    result = rollback(BusConfig(kind="kafka"), "runs/latest/snapshots", 2)
    # {"new_version": 5, "from_snapshot": 2, "parent_version": 2, "seconds": 0.04, ...}

Versions are immutable: a rollback never rewrites version K, it publishes a NEW version
(number = max(newest published, K) + 1, so it is newer than everything on the topic and than
its parent) whose weights are snapshot K's and whose ``parent_version`` is K. Every actor,
subscriber and inference server adopts it like any new version.

The module architecture comes from the newest published version (the fleet's current
architecture, in its safetensors metadata) when the snapshot's weights fit it; otherwise it is
inferred from the snapshot's tensor shapes with the activation of ``algo``'s default config.

Run it with the learner stopped (or let the learner roll back itself: ``Learner.rollback``):
a running learner keeps its own version counter and weights, so its next update would publish
a version number that collides with the rollback's, from weights that are not the snapshot's.
"""

from __future__ import annotations

import os
import time
from typing import Any
from urllib.parse import urlsplit

from agents.networks import Policy
from learner.snapshots.format import SnapshotError
from learner.snapshots.schedule import rollback as snapshot_rollback
from learner.snapshots.url import open_store
from config import BusConfig
from config.storage import ObjectStoreConfig
from logtools.subscribe import open_events
from schemas.errors import CodecError
from schemas.weights import decode_weights, sha256
from streams.bus.base import Bus
from streams.events import EventBus
from streams.policies import (
    BlobStore,
    arch_of,
    load_state,
    make_policy_version,
    newest_version,
    publish_policy_version,
    weights_bytes,
)

__all__ = ["RollbackError", "rollback"]


class RollbackError(RuntimeError):
    """The rollback cannot be done (no such snapshot, weights that fit no architecture...)."""


def _local_path(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme == "file":
        return (parts.netloc + parts.path) if parts.netloc not in ("", "localhost") else parts.path
    if parts.scheme == "" or (len(parts.scheme) == 1 and os.name == "nt"):
        return url
    return None


def _infer_arch(weights: dict, algo: str) -> dict[str, Any]:
    """Architecture from the tensor shapes of a Policy state_dict (activation: algo's default)."""
    from agents.registry import make_config

    try:
        obs_dim = int(weights["obs_rms.mean"].shape[0])
        act_dim = int(weights["net.actor_logstd"].shape[-1])
        layers = sorted(int(k.split(".")[2]) for k in weights
                        if k.startswith("net.actor_mean.") and k.endswith(".weight"))
        hidden = [int(weights[f"net.actor_mean.{i}.weight"].shape[0]) for i in layers[:-1]]
    except (KeyError, IndexError, ValueError) as e:
        raise RollbackError(f"snapshot weights are not a Policy state_dict ({type(e).__name__}: {e}); "
                            f"keys: {sorted(weights)[:8]}...") from e
    cfg = make_config(algo)
    return {"kind": "gaussian_mlp", "obs_dim": obs_dim, "act_dim": act_dim, "hidden": hidden,
            "activation": cfg.activation, "normalize_obs": cfg.normalize_obs, "obs_clip": cfg.obs_clip}


def _build(weights: dict, candidates: list[tuple[str, dict]]) -> tuple[Policy, str]:
    errors = []
    for source, arch in candidates:
        try:
            return load_state(weights, arch, what=f"snapshot weights ({source})"), source
        except CodecError as e:
            errors.append(f"{source} {arch}: {str(e).splitlines()[0]}")
    raise RollbackError("snapshot weights fit no known architecture: " + "; ".join(errors))


def rollback(bus_config: BusConfig | Bus | EventBus, store_url: str, to_version: int, algo: str = "ppo",
             env_id: str | None = None, *, policy_id: str = "policy", learner_id: str = "rollback",
             blob_store: BlobStore | None = None, object_store: ObjectStoreConfig | None = None) -> dict[str, Any]:
    """Publish snapshot ``to_version`` of ``store_url`` as a new version of ``policy_id``.

    Returns ``{new_version, from_snapshot, parent_version, previous_version, policy_id,
    weights_sha256, arch_source, seconds}``; raises RollbackError when the store or the
    snapshot does not exist (saying which versions do). ``env_id``, when given, is checked
    against the ``env_id`` the snapshot recorded, if it recorded one. ``object_store``: the
    endpoint and credentials of an ``s3://`` store.
    """
    t0 = time.perf_counter()
    path = _local_path(str(store_url))
    if path is not None and not os.path.isdir(path):
        raise RollbackError(f"snapshot store {store_url} does not exist")
    try:
        store = open_store(str(store_url), keep_last=None, object_store=object_store)  # never prune from here
        available = store.versions()
    except (SnapshotError, ValueError, OSError) as e:
        raise RollbackError(f"snapshot store {store_url} cannot be read: {e}") from e
    if to_version not in available:
        listing = ", ".join(map(str, available)) if available else "none"
        raise RollbackError(f"no snapshot of version {to_version} in {store.url}; snapshots there: {listing}")
    try:  # the rolled-back snapshot is pinned: the learner continuing from it never prunes it
        snap = snapshot_rollback(store, to_version, pin=True)
        weights, meta = snap.weights, snap.meta
    except SnapshotError as e:
        raise RollbackError(f"snapshot {to_version} in {store.url} is unreadable: {e}") from e
    if env_id and meta.get("env_id") and meta["env_id"] != env_id:
        raise RollbackError(f"snapshot {to_version} is of env {meta['env_id']}, not {env_id}")
    algo = str(meta.get("algo") or algo)

    events, owned = open_events(bus_config)
    try:
        newest = newest_version(events, policy_id)
        candidates: list[tuple[str, dict]] = []
        if isinstance(meta.get("arch"), dict):
            candidates.append(("snapshot meta", meta["arch"]))
        if newest is not None:
            try:  # claim-checked weights too, when a blob store is given
                candidates.append((f"version {newest.version}", decode_weights(weights_bytes(newest, blob_store))[1]))
            except CodecError:
                pass
        candidates.append((f"shapes + {algo} defaults", _infer_arch(weights, algo)))
        policy, arch_source = _build(weights, candidates)
        previous = -1 if newest is None else newest.version
        new_version = max(previous, to_version) + 1
        pv = make_policy_version(policy, policy_id=policy_id, version=new_version, parent_version=to_version,
                                 learner_id=learner_id, algo=algo,
                                 metrics={"rollback_from_snapshot": float(to_version)}, blob_store=blob_store)
        publish_policy_version(events, pv)
    finally:
        if owned is not None:
            owned.close()
    data = pv.weights if pv.weights is not None else None
    return {"new_version": new_version, "from_snapshot": to_version, "parent_version": to_version,
            "previous_version": previous, "policy_id": policy_id, "algo": algo,
            "weights_sha256": sha256(data) if data is not None else pv.weights_ref.sha256,
            "arch_source": arch_source, "arch": arch_of(policy), "seconds": round(time.perf_counter() - t0, 4)}
