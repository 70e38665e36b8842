"""Actor ids without hand-set indices: ``<host>-<generation>``.

    ident = register(bus, env.hostname)   # ActorIdentity(actor_id="pod-7f9c-12", host="pod-7f9c", generation=12)

``register`` appends a claim (key: the host or pod name; value: a random token) to the
single-partition, compacted ``rl.actors`` topic and reads it back: the claim's offset is the
generation. Kafka hands out each offset of a partition once, so two actors -- on one host or on
many, started at the same instant -- never get one id, and a restarted actor (a new pod, or the
same pod's container again) gets a new generation: a fresh record key whose ``seq`` starts at 0,
which the reorder stage takes as a new actor (first contact), neither a duplicate nor late.
Compaction keeps the newest claim per host; it never renumbers offsets.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from streams.bus.base import Bus, BusError
from streams.topics import ACTORS


@dataclass(frozen=True)
class ActorIdentity:
    actor_id: str
    """``<host>-<generation>``: the record key of the actor's batches."""
    host: str
    """Host or pod name (``HOSTNAME``, else the socket's host name), as an id-safe string
    (``config.Environment.hostname``)."""
    generation: int
    """Offset of this actor's claim on ``rl.actors``: unique, increasing across restarts."""


def register(bus: Bus, host: str, timeout: float = 30.0) -> ActorIdentity:
    """Claim a generation on ``rl.actors`` for ``host`` (the pod or host name,
    ``config.Environment.hostname``)."""
    token = uuid.uuid4().hex.encode()
    bus.produce(ACTORS, token, key=host.encode())
    bus.flush()
    for rec in bus.read_all(ACTORS, timeout=timeout):
        if rec.value == token:
            return ActorIdentity(f"{host}-{rec.offset}", host, rec.offset)
    raise BusError(f"actor registration on {ACTORS}: our claim was not read back")


def actor_seed(run_seed: int, index: int) -> int:
    """Base seed of actor ``index``'s env resets and action noise (``rlstream lineage`` reports it)."""
    return run_seed * 7919 + index
