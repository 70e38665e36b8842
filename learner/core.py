"""The pure learner: fragments in, a GradientStep and the new weights out. No bus, no
snapshot store, no clock but the step's timestamps; its process shell (``learner.learner``)
consumes, commits, publishes, snapshots and pauses.

    core = LearnerCore(config, algo)              # ranks=DataParallel(...) for one rank of N
    refused = core.refuse(pb)                     # (reason, error class, detail) or None
    core.add(Fragment(pb, digest, source))
    if core.ready(paused=False):
        upd = core.update()                       # one update on every fragment buffered
        upd.step(finished_at_ms)                  # its GradientStep; core.policy holds the weights

With a sample cache (``replay=learner.replay.ReplayCache``, off-policy algorithms only) each
update also trains on fragments replayed from it, as many as its samples-per-insert limiter
allows, restated for the current policy (``learner.replay.replayed_batch``); the GradientStep
lists the fresh fragments only, and ``replay_samples`` among its losses (``rlstream verify``
cannot rebuild such a step from the log). The cache is not snapshotted (a resumed learner starts
with it empty) and an adopted foreign version (a rollback) empties it.

Versions: ``version`` is the newest version allocated (published by the shell), and
``model_version`` the one whose weights the algorithm holds. Duplicate batch ids are told by the
one dedup store (``streams.dedup.SeenIds``) of the ids trained, and the ids buffered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from agents.core import Algorithm
from agents.registry import SPECS, algorithm_spec
from config.limits import DEFAULT_CLAIM_CHECK_ABOVE
from learner.batching import StreamIds, to_device, to_trajectory_batch
from learner.ranks import Ranks, SingleRank
from learner.replay import ReplayCache, replayed_batch
from schemas.events import GradientStep, PreparedBatch, now_ms
from streams.dedup import SeenIds

REASON_INCOMPATIBLE = "incompatible"
REASON_DUPLICATE = "duplicate"
#: Batch ids of trained fragments remembered (and kept in snapshots).
SEEN_IDS_KEPT = 20_000


@dataclass(frozen=True)
class LearnerConfig:
    learner_id: str = "learner-0"
    """Key of this learner's GradientStep events."""
    policy_id: str = "policy"
    """Key of the PolicyVersion events it publishes."""
    algo: str = "ppo"
    """Algorithm name (recorded on every event)."""
    train_batch_size: int = 2048
    """Transitions per update; fragments are accumulated until at least this many arrived."""
    snapshot_every: int = 10
    """Snapshot the full learner state every this many updates (0: never)."""
    snapshot_interval_s: float = 86_400.0
    """Also snapshot once this many seconds passed since the store's newest time-based snapshot
    (daily by default; kept by the store's ``keep_timed``); 0: never."""
    group: str = "learner"
    """Consumer group on rl.samples.prepared."""
    max_updates: int | None = None
    """Stop (``done``) after this many updates; None: run until stopped."""
    total_samples: int | None = None
    """The run's budget: once the samples trained and buffered reach it, the remainder is
    trained as a last, smaller update rather than waited on (None: no budget)."""
    env_id: str = ""
    """Recorded in snapshots, so a rollback can check it restores a policy of the same env."""
    run_id: str = ""
    """Recorded in each PolicyVersion's provenance (``rlstream verify``/``lineage`` select by it)."""
    fork_of: dict | None = None
    """``{"run_id", "version", "source"}`` of the parent when this learner continues a fork
    (``rlstream fork``); recorded in the provenance of its versions."""
    claim_check_above: int = DEFAULT_CLAIM_CHECK_ABOVE
    """Weights over this many bytes go by claim check when a blob store is configured."""


@dataclass
class LearnerStats:
    updates: int = 0
    samples_trained: int = 0
    duplicates_skipped: int = 0
    redelivered_skipped: int = 0
    """Records handled already, read again at the same offset (Kafka redelivers from the last
    commit after a rebalance or a broker restart): skipped, not dead-lettered, as not bad input."""
    paused_polls: int = 0
    lag_signal_errors: int = 0
    adopted_versions: int = 0
    policy_lag: int = 0
    """The learner's version minus the newest behaviour version of the last records read."""
    policy_lag_holds: int = 0
    """Steps in which the policy-lag breaker held back an update that was ready."""
    policy_lag_overrides: int = 0
    """Updates taken with the policy-lag breaker open because ``hold_cap`` transitions waited."""
    last_metrics: dict[str, float] = field(default_factory=dict)


PHASES = ("decode", "copy", "update", "publish")


@dataclass
class RoundTiming:
    """Where the learner's rounds spend their time, in seconds: ``decode`` (fragments to one
    batch), ``copy`` (onto the device; on CUDA the copy is non-blocking, so the part that overlaps
    shows in ``update``), ``update`` (the algorithm, compiles included), ``publish`` (the new
    version and GradientStep, by the shell). ``last``: the last round's; ``total``: all rounds'."""

    last: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    total: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add(self, phase: str, seconds: float) -> None:
        self.last[phase] = seconds
        self.total[phase] += seconds

    def summary(self, compile_s: float = 0.0) -> dict[str, float]:
        """Totals by phase, with the compile seconds inside ``update`` also shown apart."""
        return {**{k: round(v, 4) for k, v in self.total.items()}, "compile": round(compile_s, 4)}


@dataclass(frozen=True)
class Fragment:
    """One PreparedBatch waiting for an update, with its record's digest (provenance) and the
    shell's handle of its record (``source``; opaque here)."""

    batch: PreparedBatch
    digest: str
    source: Any = None


@dataclass(frozen=True)
class Update:
    """What one update did: its metrics, the fragments it trained, and the GradientStep's fields."""

    metrics: dict[str, float]
    fragments: list[Fragment]
    """The fresh fragments trained (replayed ones are in ``replayed``)."""
    batch_ids: list[str]
    """Of the whole group (rank 0 gathers every rank's)."""
    digests: list[str]
    num_samples: int
    step_no: int
    from_version: int
    to_version: int
    started_at_ms: int
    learner_id: str
    algo: str
    replayed: list[Fragment] = field(default_factory=list)
    """Fragments replayed from the sample cache in this update (as trained: restated)."""

    def step(self, finished_at_ms: int | None = None) -> GradientStep:
        """The GradientStep event of this update."""
        return GradientStep(
            learner_id=self.learner_id, step=self.step_no, from_version=self.from_version,
            to_version=self.to_version, algo=self.algo,
            losses={k: float(v) for k, v in self.metrics.items()},
            grad_norm=float(self.metrics.get("grad_norm", 0.0)), batch_ids=self.batch_ids,
            num_samples=self.num_samples, started_at_ms=self.started_at_ms,
            finished_at_ms=now_ms() if finished_at_ms is None else finished_at_ms, batch_digests=self.digests,
        )


class LearnerCore:
    """See the module docstring.

    Args:
        config: the learner's settings.
        algo: the algorithm (pure torch).
        ranks: ``learner.ranks.Ranks``; None: a learner alone (``SingleRank``).
        stream_ids: numbering of the actors' streams (a fork passes the parent's, replayed).
        replay: the learner node's sample cache (``learner.replay``); None: no replay.
    """

    def __init__(self, config: LearnerConfig, algo: Algorithm, ranks: Ranks | None = None,
                 stream_ids: StreamIds | None = None, replay: ReplayCache | None = None) -> None:
        if replay is not None and getattr(algo, "is_on_policy", True):
            offp = ", ".join(n for n, s in SPECS.items() if not s.defaults.on_policy and s.defaults.online)
            raise ValueError(f"sample replay needs an off-policy algorithm ({offp}), not {config.algo!r}")
        self.replay = replay
        self.config = config
        self.algo = algo
        self.ranks: Ranks = ranks if ranks is not None else SingleRank(algo)
        self.stats = LearnerStats()
        self.version = -1  # newest version allocated (published by the shell)
        self.model_version = -1  # version whose weights the algorithm holds
        self.seen = SeenIds(SEEN_IDS_KEPT)  # batch ids trained
        self.pending: list[Fragment] = []  # waiting for the next update, of any lengths, in arrival order
        self._pending_ids: set[str] = set()
        self.buffered = 0  # transitions in ``pending``
        self.stream_ids = stream_ids or StreamIds()
        self.timing = RoundTiming()

    @property
    def policy(self) -> Any:
        """The weights (the algorithm's policy network)."""
        return self.algo.policy

    # -- input ----------------------------------------------------------------------------
    def trained(self, batch_id: str) -> bool:
        """``batch_id`` is among the ids trained (remembered)."""
        return batch_id in self.seen

    def refuse(self, pb: PreparedBatch) -> tuple[str, str, str] | None:
        """Why ``pb`` is not taken: (reason, error class, detail) -- a batch id trained or
        buffered already, or observation/action sizes the model does not have -- or None."""
        bid = pb.sample.batch_id
        if bid in self.seen or bid in self._pending_ids:
            return REASON_DUPLICATE, "DuplicateBatch", f"batch_id {bid} already trained"
        policy = self.algo.policy
        obs, act = pb.sample.obs.shape[2:], pb.sample.actions.shape[2:]
        if obs != (policy.obs_dim,) or act != (policy.act_dim,):
            detail = (f"batch {bid} of {pb.sample.env_id}: observations {obs} / actions {act} "
                      f"do not fit the model's ({policy.obs_dim},) / ({policy.act_dim},)")
            return REASON_INCOMPATIBLE, "IncompatibleBatch", detail
        return None

    def add(self, fragment: Fragment) -> None:
        self.pending.append(fragment)
        self._pending_ids.add(fragment.batch.sample.batch_id)
        self.buffered += fragment.batch.sample.size

    def take(self) -> list[Fragment]:
        """Empty the buffer; what it held."""
        taken, self.pending, self.buffered = self.pending, [], 0
        self._pending_ids.clear()
        return taken

    # -- the update -----------------------------------------------------------------------
    def need(self) -> int:
        """Transitions the next update waits for: ``train_batch_size``, or the budget's remainder."""
        need = self.config.train_batch_size
        if self.config.total_samples is not None:
            need = max(1, min(need, self.config.total_samples - self.stats.samples_trained))
        return need

    def ready(self, paused: bool = False) -> bool:
        """An update is due (with ranks: decided by all together, each with its share)."""
        return self.ranks.agree(self.buffered, paused, self.need()).train

    def update(self, started_at_ms: int | None = None) -> Update:
        """One update on every buffered fragment, whatever their lengths (``to_trajectory_batch``
        pads and masks them so each keeps its own returns); allocates the next version."""
        started = now_ms() if started_at_ms is None else started_at_ms
        n_samples = self.buffered
        fragments = self.take()
        batches = [f.batch for f in fragments]
        replayed: list[Fragment] = []
        if self.replay is not None and batches:
            self.replay.insert_count(n_samples)
            replayed = self.replay.draw(self.restate)
        n_replayed = sum(f.batch.sample.size for f in replayed)
        train = batches + [f.batch for f in replayed]
        t0 = time.perf_counter()
        batch = to_trajectory_batch(train, self.stream_ids) if train else None  # None: a rank with no share
        t1 = time.perf_counter()
        if batch is not None:  # onto the device once, here (the algorithm's own move is then a no-op)
            batch = to_device(batch, next(self.algo.policy.parameters()).device)
        t2 = time.perf_counter()
        metrics = self.ranks.update(batch, n_samples + n_replayed)
        self.timing.add("decode", t1 - t0)
        self.timing.add("copy", t2 - t1)
        self.timing.add("update", time.perf_counter() - t2)
        if self.replay is not None:
            self.replay.add(fragments)
            metrics = {**metrics, **self.replay.metrics()}
        shares = self.ranks.gather(([b.sample.batch_id for b in batches], [f.digest for f in fragments], n_samples))
        ids, digests = [i for s in shares for i in s[0]], [d for s in shares for d in s[1]]
        total = sum(s[2] for s in shares)
        self.stats.updates += 1
        self.stats.samples_trained += total
        self.stats.last_metrics = metrics
        for b in batches:
            self.seen.seen_or_add(b.sample.batch_id, 0)
        from_version = self.model_version
        return Update(metrics, fragments, ids, digests, total, self.stats.updates, from_version,
                      self.next_version(), started, self.config.learner_id, self.config.algo, replayed)

    @torch.no_grad()
    def restate(self, f: Fragment) -> Fragment:
        """Cached fragment ``f`` as this update trains on it: restated for the policy the model
        holds now (``learner.replay.replayed_batch``), with its spec's IS rule (``replay_weights``)."""
        s, policy = f.batch.sample, self.algo.policy
        dev = next(policy.parameters()).device
        logp = policy.log_prob(torch.tensor(s.obs, device=dev), torch.tensor(s.actions, device=dev))  # (copies: read-only records)
        cfg, rule = self.algo.config, algorithm_spec(self.algo.name).replay_weights

        def weights(log_ratio: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            rho, c = rule(cfg, torch.as_tensor(log_ratio))
            return rho.numpy(), c.numpy()

        pb = replayed_batch(f.batch, self.model_version, logp.cpu().numpy(), weights)
        return Fragment(pb, f.digest, None)

    def next_version(self) -> int:
        """Allocate the next version number; the algorithm's weights are that version."""
        self.version += 1
        self.model_version = self.version
        return self.version

    # -- state ----------------------------------------------------------------------------
    def restore(self, version: int, state: dict, meta: dict) -> None:
        """The state of snapshot ``version`` (its algorithm state and metadata)."""
        self.algo.load_state_dict(state)
        self.model_version = version
        self.stats.updates = int(meta.get("updates", 0))
        self.stats.samples_trained = int(meta.get("samples_trained", self.stats.updates * self.config.train_batch_size))
        for bid in meta.get("trained_batch_ids", []):
            self.seen.seen_or_add(bid, 0)

    def adopt(self, version: int, state: dict | None = None, weights: dict | None = None) -> list[Fragment]:
        """A newer version of this policy published by someone else: its full ``state`` (a
        snapshot's) or its policy ``weights`` become the model. Returns the fragments buffered,
        collected under the abandoned line of versions (the shell dead-letters them)."""
        if state is not None:
            self.algo.load_state_dict(state)
        else:
            self.algo.policy.load_state_dict(weights)
        self.version = self.model_version = version
        self.stats.adopted_versions += 1
        if self.replay is not None:  # trained under the abandoned line: not replayed on the new one
            self.replay.clear()
        return self.take()

    def snapshot_share(self, offsets: dict) -> tuple[dict, list[str]] | None:
        """With ranks a collective: every rank's ``offsets`` and trained ids, merged on the
        publisher (others get None)."""
        shares = self.ranks.gather((dict(offsets), list(self.seen)[-SEEN_IDS_KEPT:]))
        if not self.ranks.publisher:
            return None
        return {tp: o for s in shares for tp, o in s[0].items()}, [i for s in shares for i in s[1]]
