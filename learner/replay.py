"""The learner node's sample cache: the last ``capacity`` transitions it trained on, which the
off-policy learners (AGRO, TBA) replay from, under a rate limiter in the spirit of Reverb's
``SampleToInsertRatio``. Pure: no I/O, no clock; its randomness is one seeded generator.

    cache = ReplayCache(ReplayConfig(capacity=1000, samples_per_insert=2.0), seed=0)
    cache.insert_count(n_fresh)                  # the fresh transitions of this update (the limiter)
    replayed = cache.draw(model_version, retag)  # fragments to train on again, beside the fresh ones
    ...update on fresh + replayed...
    cache.add(fresh_fragments)                   # then they become replayable

Units: a *sample* is a transition, as everywhere in rlstream (``samples_trained``, samples/s).
The cache keeps and replays whole fragments (a fragment's bootstrap and episode ends stay whole)
and counts them by their transitions: it evicts the oldest fragments first until what it holds
fits ``capacity``; a fragment larger than ``capacity`` is never cached (``oversize``).

Rate limiter (``SamplesPerInsert``): every inserted transition is trained once fresh; replay
may add at most ``(samples_per_insert - 1) * inserted + error_buffer`` transitions in all, so
``trained <= samples_per_insert * inserted + error_buffer`` holds after every draw (Reverb's
upper bound on samples; inserts are never blocked: the stream does not wait for the learner).
No replay until ``min_size`` transitions are held. Each fragment is replayed at most
``max_reuse`` times, then dropped from the cache; within one update a fragment appears once.

Importance weights of a replayed fragment: its behaviour log-probs are the ones the actor
recorded, untouched; ``retag`` (``replayed_batch``) restates what the stream processor had
computed against the policy *of that time* for the policy the update now starts from: the lag
in versions (TBA's staleness decay) and the truncated IS weights ``is_rho``/``is_c`` from the
current policy's log-probs. AGRO and TBA compute their V-trace weights from the behaviour
log-probs and the current policy inside the update in any case.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from schemas.events import PreparedBatch

#: The actor-id prefix of replayed fragments: their columns get their own reward streams
#: (``learner.batching.StreamIds``), so replay never breaks the running return of a live env.
REPLAY_STREAM_PREFIX = "replay/"


@dataclass(frozen=True)
class ReplayConfig:
    capacity: int = 1000
    """Transitions held (the deployment guide's 1,000 samples per training node)."""
    samples_per_insert: float = 2.0
    """Trainings per inserted transition, fresh one included (Reverb's SPI); 1: no replay."""
    error_buffer: float = 0.0
    """Transitions replay may run ahead of the SPI bound."""
    min_size: int = 0
    """Transitions held before any replay (0: ``capacity // 2``)."""
    max_reuse: int = 2
    """Times one fragment may be replayed."""

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"replay capacity must be >= 1 transition, got {self.capacity}")
        if not (self.samples_per_insert >= 1.0 and math.isfinite(self.samples_per_insert)):
            raise ValueError(f"samples_per_insert must be finite and >= 1, got {self.samples_per_insert}")
        if self.error_buffer < 0 or self.min_size < 0 or self.max_reuse < 1:
            raise ValueError("error_buffer and min_size must be >= 0, max_reuse >= 1")

    @property
    def min_to_replay(self) -> int:
        return self.min_size or self.capacity // 2


class SamplesPerInsert:
    """Counts transitions inserted and replayed; ``allows(n)`` says whether ``n`` more may be
    replayed without passing ``samples_per_insert * inserted + error_buffer`` trainings."""

    def __init__(self, samples_per_insert: float, error_buffer: float = 0.0) -> None:
        self.spi, self.error_buffer = float(samples_per_insert), float(error_buffer)
        self.inserted = 0
        self.replayed = 0

    @property
    def trained(self) -> int:
        return self.inserted + self.replayed

    def insert(self, n: int) -> None:
        self.inserted += int(n)

    def allows(self, n: int) -> bool:
        return self.trained + n <= self.spi * self.inserted + self.error_buffer

    def replay(self, n: int) -> None:
        if not self.allows(n):
            raise ValueError(f"replaying {n} passes the samples-per-insert bound")
        self.replayed += int(n)

    def ratio(self) -> float:
        """Trainings per inserted transition so far (1.0 before any insert)."""
        return self.trained / self.inserted if self.inserted else 1.0


@dataclass
class _Entry:
    fragment: Any
    size: int
    reuse: int = 0


@dataclass
class ReplayStats:
    cached: int = 0
    evicted: int = 0
    exhausted: int = 0
    """Fragments dropped after their ``max_reuse``-th replay."""
    oversize: int = 0
    replayed_fragments: int = 0
    last_replayed: int = 0
    """Transitions replayed in the last update."""


class ReplayCache:
    """See the module docstring. Entries are ``learner.core.Fragment``-like: ``.batch`` a
    PreparedBatch."""

    def __init__(self, config: ReplayConfig, seed: int = 0) -> None:
        self.config = config
        self.limiter = SamplesPerInsert(config.samples_per_insert, config.error_buffer)
        self.rng = random.Random(seed)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self.held = 0
        self.stats = ReplayStats()

    def __len__(self) -> int:
        return len(self._entries)

    def batch_ids(self) -> list[str]:
        """Ids of the fragments held, oldest first."""
        return list(self._entries)

    def reuse(self, batch_id: str) -> int:
        return self._entries[batch_id].reuse

    def clear(self) -> None:
        """Forget every fragment held (a rollback abandons the line they were trained on); the
        limiter's counts stay."""
        self._entries.clear()
        self.held = 0

    def insert_count(self, n: int) -> None:
        """``n`` fresh transitions are trained in this update (before ``draw``)."""
        self.limiter.insert(n)

    def add(self, fragments: list[Any]) -> None:
        """Cache ``fragments`` (newest last), evicting the oldest to stay within ``capacity``."""
        cap = self.config.capacity
        for f in fragments:
            size = f.batch.sample.size
            if size > cap:
                self.stats.oversize += 1
                continue
            while self._entries and self.held + size > cap:
                _, old = self._entries.popitem(last=False)
                self.held -= old.size
                self.stats.evicted += 1
            self._entries[f.batch.sample.batch_id] = _Entry(f, size)
            self.held += size
            self.stats.cached += 1

    def draw(self, retag: Callable[[Any], Any] | None = None) -> list[Any]:
        """Fragments to replay in this update, uniformly at random among those held, as many as
        the limiter allows; each one's reuse count goes up (and it leaves at ``max_reuse``).
        ``retag`` maps each drawn fragment to what is trained (``replayed_batch``)."""
        self.stats.last_replayed = 0
        if self.held < self.config.min_to_replay or not self._entries:
            return []
        order = list(self._entries)
        self.rng.shuffle(order)
        out = []
        for bid in order:
            e = self._entries[bid]
            if not self.limiter.allows(e.size):
                continue
            self.limiter.replay(e.size)
            e.reuse += 1
            self.stats.last_replayed += e.size
            self.stats.replayed_fragments += 1
            out.append(retag(e.fragment) if retag is not None else e.fragment)
            if e.reuse >= self.config.max_reuse:
                del self._entries[bid]
                self.held -= e.size
                self.stats.exhausted += 1
        return out

    def metrics(self) -> dict[str, float]:
        """``replay_cache_samples`` held, ``replay_samples`` of the last update,
        ``replay_ratio`` (replayed / trained so far) and ``replay_spi`` (trained / inserted)."""
        lim = self.limiter
        return {"replay_cache_samples": float(self.held), "replay_samples": float(self.stats.last_replayed),
                "replay_ratio": lim.replayed / lim.trained if lim.trained else 0.0,
                "replay_spi": lim.ratio()}


def replayed_batch(pb: PreparedBatch, model_version: int, current_logp: np.ndarray | None,
                   weights: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None) -> PreparedBatch:
    """``pb`` as it is replayed by a learner that holds ``model_version``: the lag in versions
    and ``current_version`` restated against it, the IS weights recomputed from ``current_logp``
    (the current policy's log-probs of the fragment's actions, ``[T, N]``) against the behaviour
    log-probs the fragment carries (``weights(log_ratio) -> (rho, c)``, the algorithm's cap
    rule), and its columns moved to their own reward streams (``REPLAY_STREAM_PREFIX``)."""
    s = pb.sample
    lag = max(0, model_version - s.policy_version)
    out = replace(pb, current_version=model_version, staleness_versions=lag,
                  sample=replace(s, actor_id=REPLAY_STREAM_PREFIX + s.actor_id))
    if current_logp is not None and weights is not None:
        rho, c = weights(np.asarray(current_logp, np.float32) - s.behaviour_logp)
        out = replace(out, is_rho=np.asarray(rho, np.float32), is_c=np.asarray(c, np.float32))
    return out
