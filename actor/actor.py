"""The actor: steps vector envs with the newest policy and publishes SampleBatch events.

    actor = Actor(config, subscriber, events, flow=flow)
    while not stop.is_set():
        actor.step()          # adopt a newer policy if one arrived, collect, publish

``flow`` (``actor.flow``; decoupled mode) decides when the next fragment may be collected and
how long it is: on-policy algorithms wait for a newer version after their share of a learner
batch, off-policy ones pause while the stream processors' backlog is high. ``step`` returns
None while held back, after waiting up to ``flow.poll_s`` for a version (or room).

Each SampleBatch is tagged with its behaviour policy version, the sampled (unclipped) actions
and their log-probs, and a per-actor ``seq``. A free-running actor (``swap_every``) adopts a
newer version between env steps, within the fragment (in-flight weight updates, as PipelineRL
does): each step's behaviour version is then in ``step_versions`` and each log-prob is the one
of the version that acted; ``policy_version`` is the first (oldest) one. Otherwise a fragment
has one version (swapped only between fragments; co-located runs always). NaN/inf from an env never reaches a topic: the fragment is discarded,
the envs reset, and the rejection counted and logged.

The actor keeps its own account of what the bus acknowledged (``Acknowledgements``: each
published batch's delivery report, by ``seq``), in its summary: a fault ledger compares it with
what the samples topic holds, so "produced" never means only "what reached the topic".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actor.backoff import DeliveryBackoff
from actor.envs import NonFiniteEnvError
from actor.flow import Flow
from actor.policy_client import PolicySubscriber
from actor.rollout import Rollout
from schemas.events import SampleBatch
from streams.bus.kafka.produce_errors import PRODUCE_ERRORS
from streams.events import EventBus
from streams.topics import SAMPLES_RAW


class Acknowledgements:
    """This actor's batches by ``seq``: published and not yet settled (``pending``), acknowledged
    by the bus (Kafka: the broker, at ``acks=all``), or failed for good with the error's text.
    Settled from the bus's delivery reports (``Bus.produce``'s ``on_delivery``), which run inside
    the actor's own produce and flush calls."""

    def __init__(self) -> None:
        self.pending: set[int] = set()
        self.acknowledged: list[int] = []
        self.failed: dict[int, str] = {}

    def sent(self, seq: int) -> Callable[[str | None], None]:
        """Record ``seq`` as published; the callback that settles it."""
        self.pending.add(seq)

        def settle(error: str | None) -> None:
            self.pending.discard(seq)
            if error is None:
                self.acknowledged.append(seq)
            else:
                self.failed[seq] = error
        return settle

    def summary(self) -> dict:
        """``acknowledged`` (count), ``acknowledged_seqs`` (sorted inclusive ``[first, last]``
        ranges: ``[[0, 41]]`` for 42 batches without a gap), ``unacknowledged`` (published, no
        report yet) and ``delivery_failed`` (seq -> error)."""
        ranges: list[list[int]] = []
        for s in sorted(self.acknowledged):
            if ranges and s == ranges[-1][1] + 1:
                ranges[-1][1] = s
            else:
                ranges.append([s, s])
        return {"acknowledged": len(self.acknowledged), "acknowledged_seqs": ranges,
                "unacknowledged": len(self.pending),
                "delivery_failed": {str(s): e for s, e in sorted(self.failed.items())}}


@dataclass(frozen=True)
class ActorConfig:
    actor_id: str = "actor-0"
    """Stable id; the record key of this actor's batches (per-actor order) and reorder key."""
    env_id: str = "HalfCheetah-v5"
    """Gymnasium env id."""
    num_envs: int = 1
    """Vector env width N."""
    fragment_steps: int = 2048
    """Steps per env in one SampleBatch (T); the batch holds T*N transitions."""
    seed: int = 0
    """Base seed of env resets and action noise."""
    group_size: int = 0
    """>0: group mode (GRPO/DAPO): each fragment resets all envs with one seed per group of this
    many envs, so a group's rollouts share a start state; group_ids are set. A column is one
    rollout: the fragment ends as soon as every column has finished its first episode (or after
    ``fragment_steps``), and only those first episodes are reported in the episode stats."""
    max_nonfinite: int = 10
    """Give up (raise) after this many consecutive fragments rejected for NaN/inf env output."""
    vector_mode: str = "sync"
    """gymnasium vectorization mode: sync or async (subprocess envs)."""
    wrappers: tuple[str, ...] = ()
    """Per-env wrappers by name (``actor.envs.WRAPPERS``)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """``gymnasium.make`` keyword arguments of each env."""
    swap_every: int = 0
    """>0 (free-running off-policy actors): look for a newer policy between env steps, every this
    many steps and whenever ``swap_every_s`` has passed since the last look, and act with it from
    the next step (``inflight``). Policy latency is then bounded by the time of one look, not by a
    fragment, whatever the env width. 0: swap only between fragments (one version per fragment)."""
    swap_every_s: float = 0.002
    """With ``swap_every``: the longest time between two looks (one look, an empty consumer poll,
    costs ~10 us; a vector step of 8 MuJoCo envs ~1 ms, so the look is cheap either way)."""
    inflight: bool = True
    """With ``swap_every``: a newer version is adopted within the fragment, whose steps then carry
    their own behaviour versions (``SampleBatch.step_versions``) and log-probs; the fragment keeps
    its length, and its ``policy_version`` is its first (oldest) step's. False: the fragment ends
    at the swap, so each one has a single version (more, shorter fragments)."""


class Actor:
    """``rollout``: where the envs run (``actor.rollout``; default: a ``Rollout`` in this process
    over ``env``, or a new vector env); ``backoff``: its waits for acknowledgements
    (``actor.backoff``; its process's harness observes them)."""

    def __init__(self, config: ActorConfig, subscriber: PolicySubscriber, events: EventBus,
                 on_batch: Callable[[SampleBatch, float], None] | None = None,
                 on_reject: Callable[[NonFiniteEnvError], None] | None = None,
                 env=None, flow: Flow | None = None, rollout=None, backoff: DeliveryBackoff | None = None) -> None:
        self.config = config
        self.flow = flow
        self.subscriber = subscriber
        self.events = events
        self.on_batch = on_batch
        self.on_reject = on_reject
        self.rollout = rollout if rollout is not None else Rollout(config, env)
        self.spec = self.rollout.spec
        self.seq = 0
        self.acks = Acknowledgements()
        self.backoff = backoff or DeliveryBackoff()
        self.rejected = 0
        self._consecutive_rejects = 0
        self.steps = 0
        self.fragment_steps = config.fragment_steps

    @property
    def cut_fragments(self) -> int:
        """Fragments ended early for a new policy (``swap_every`` without ``inflight``)."""
        return self.rollout.cut_fragments

    @property
    def inflight_swaps(self) -> int:
        """Newer versions adopted within a fragment (``swap_every`` with ``inflight``)."""
        return getattr(self.rollout, "inflight_swaps", 0)

    def adopt(self, timeout: float = 0.0) -> bool:
        """Adopt the newest policy version that arrived (waiting up to ``timeout`` for one); True
        if one was. ``step`` does it itself unless ``pinned``."""
        return self.subscriber.poll(timeout)

    def step(self, policy_timeout: float = 0.0, pinned: bool = False) -> SampleBatch | None:
        """Adopt a newer policy if any (waiting up to ``policy_timeout`` for the first one),
        collect one fragment and publish it (None: no policy yet, or the flow holds the actor
        back). The role protocol's step (``runtime.roles.Role``). ``pinned``: act with the
        version adopted already (co-located ``--overlap`` adopts between rounds, with ``adopt``,
        so a fragment's version never depends on when the learner's thread publishes)."""
        if not pinned or self.subscriber.policy is None:
            self._poll(policy_timeout if self.subscriber.policy is None else 0.0, "fragment")
        if self.subscriber.policy is None:
            return None
        flow = self.flow
        if flow is not None and not flow.allow(self.subscriber.version):
            self._poll(flow.poll_s, "held")  # a newer version ends the wait at once
            if not flow.allow(self.subscriber.version):
                return None
        steps = flow.fragment_steps(self.fragment_steps) if flow is not None else self.fragment_steps
        t0 = time.perf_counter()
        try:
            batch = self.collect(steps)
        except NonFiniteEnvError as e:
            self.rejected += 1
            self._consecutive_rejects += 1
            if self.on_reject is not None:
                self.on_reject(e)
            self.rollout.reset()
            if self._consecutive_rejects >= self.config.max_nonfinite:
                raise RuntimeError(
                    f"{self.config.env_id}: {self._consecutive_rejects} consecutive fragments had "
                    f"non-finite env output; last: {e}"
                ) from e
            return None
        self._consecutive_rejects = 0
        self.events.publish(SAMPLES_RAW, batch, key=self.config.actor_id, on_delivery=self.acks.sent(batch.seq))
        self.seq += 1
        if flow is not None:
            flow.on_published(batch.num_steps, batch.newest_version)
        if self.on_batch is not None:
            self.on_batch(batch, time.perf_counter() - t0)
        return batch

    def collect(self, T: int) -> SampleBatch:
        """One fragment of ``T`` steps per env with the adopted version (not published); with
        ``swap_every``, newer versions are looked for between env steps (``ActorConfig``)."""
        batch = self.rollout.collect(self.subscriber.policy, self.subscriber.version, T, self.seq,
                                     newer=self._newer if self.config.swap_every else None)
        self.steps += batch.size
        return batch

    def _newer(self) -> tuple | None:
        """A newer policy, if one arrived: ``(module, version)`` (the rollout's ``newer``)."""
        if self._poll(0.0, "step"):
            return self.subscriber.policy, self.subscriber.version
        return None

    def _poll(self, timeout: float, where: str) -> bool:
        self.subscriber.where = where  # the label of the latency parts (actor.policy_client)
        return self.subscriber.poll(timeout)

    def close(self) -> None:
        self.rollout.close()
        self.subscriber.close()

    def summary(self) -> dict:
        """What this actor did (the role protocol's summary)."""
        return {"role": "actor", "actor_id": self.config.actor_id, "steps": self.steps, "seq": self.seq,
                **self.acks.summary(), "backoff": self.backoff.stats(),
                "produce_errors": PRODUCE_ERRORS.counts(),  # this process's, by code
                "rejected_fragments": self.rejected, "policy_versions_adopted": self.subscriber.adopted,
                "cut_fragments": self.cut_fragments, "inflight_swaps": self.inflight_swaps,
                "policy_latency_parts_ms": getattr(self.subscriber, "parts_ms", dict)(),
                "startup_adoption_ms": None if (lat := self.subscriber.startup_latency_s) is None else round(lat * 1e3, 3)}
