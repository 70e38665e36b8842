"""``rlstream replay``: rebuild preference pairs from a recorded sample topic, publish them to
``rl.preferences`` and (``--train-dpo``) train a DPO policy on them, offline.

    summary = run_replay(BusConfig(kind="kafka"), topic="rl.samples.raw", segment=32,
                         train=True, beta=0.1, epochs=20, out=Path("runs/dpo"))

1. Replay ``topic`` from offset 0 (``bus.read_all``). Each record must decode as a SampleBatch
   (or a PreparedBatch, whose sample is used) and validate; one that does not is dead-lettered
   with its reason (stage ``replay``) and skipped. A batch_id met twice is used once.
2. Segments: each env column of a batch is cut at episode ends (terminated | truncated) and
   every episode into consecutive, non-overlapping windows of ``segment`` steps; a remainder
   shorter than that is not used. A segment's return is the sum of its rewards.
3. Pairs: segments are only compared with comparable ones, bucketed by
   * batches with ``group_ids`` (GRPO/DAPO actors reset a group's envs to one start state at
     the start of each fragment): the first episode of each column, by (batch, group, start
     step): the same start state and policy, so the return gap is down to the actions;
   * otherwise: (env_id, behaviour policy version).
   In a bucket, segments are sorted by return (ties broken by their ids, so the pairing is
   deterministic) and the i-th best is paired with the i-th of the lower half: each segment is
   used once, gaps are large. A pair is kept when its gap is above ``margin`` and above
   ``margin_std`` times the bucket's return std (ties and tiny gaps are noise, not preference).
4. Publish PreferencePair events, keyed by env_id. ``pair_id`` is a hash of the two source
   segments (batch_id, column, start, length), and the ids already on ``rl.preferences`` are
   read first (from the ``rl-pair-id`` header, else the event), so replaying the same records
   twice publishes nothing new. (A replay of a topic that has grown since may pair some
   segments differently; those pairs have new ids and are published.) Dead letters are
   deduplicated the same way, by (topic, partition, offset).
5. ``train``: DPO (agents/dpo.py) against a frozen reference, which is the policy version that
   generated most of the pairs when it is on ``rl.policy.versions`` (else a fresh policy whose
   observation normaliser is set from the replayed observations). A deterministic ``heldout``
   fraction of the pairs (by pair_id) is kept out of training and evaluated before and after.
   Written to ``out``: ``policy.safetensors`` (the PolicyVersion weights format: the
   architecture travels in its metadata, so ``streams.policies`` can load or publish it) and
   ``summary.json``.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agents.dpo import PreferenceBatch
from config import BusConfig
from streams.policies import Blobs, arch_of, load_policy
from logtools.subscribe import _decode, open_events
from runtime.rundir import write_json_atomic
from schemas.errors import CodecError
from schemas.events import DeadLetter, PolicyVersion, PreferencePair, PreparedBatch, SampleBatch, now_ms
from schemas.weights import encode_weights
from streams.bus.base import Bus, Record
from streams.events import EventBus
from streams.topics import DEADLETTER, POLICY_VERSIONS, PREFERENCES, SAMPLES_RAW

__all__ = ["Segment", "build_segments", "pair_segments", "run_replay", "PAIR_ID_HEADER", "ReplayError"]

PAIR_ID_HEADER = "rl-pair-id"
STAGE = "replay"


class ReplayError(ValueError):
    """The replayed topic cannot give what was asked (too few preference pairs to train on)."""


@dataclass(frozen=True)
class Segment:
    batch_id: str
    env_id: str
    policy_version: int
    column: int
    t0: int
    ret: float
    obs: np.ndarray
    """[L, obs_dim]"""
    act: np.ndarray
    """[L, act_dim]"""
    bucket: tuple

    @property
    def key(self) -> str:
        return f"{self.batch_id}/{self.column}/{self.t0}/{len(self.obs)}"


def build_segments(batch: SampleBatch, length: int) -> tuple[list[Segment], int]:
    """Segments of ``length`` steps within episodes of each column; also the steps left over."""
    if length <= 0:
        raise ValueError(f"segment length must be > 0, not {length}")
    T, N = batch.rewards.shape
    done = np.logical_or(batch.terminated, batch.truncated)
    out: list[Segment] = []
    unused = 0
    for col in range(N):
        start = 0
        ends = list(np.flatnonzero(done[:, col])) + ([T - 1] if not done[T - 1, col] else [])
        for episode, end in enumerate(ends):
            n_full = (end - start + 1) // length
            unused += (end - start + 1) - n_full * length
            for k in range(n_full):
                t0 = start + k * length
                if batch.group_ids is not None and episode == 0:
                    bucket: tuple = ("group", batch.batch_id, int(batch.group_ids[col]), t0)
                else:
                    bucket = ("version", batch.env_id, int(batch.policy_version))
                out.append(Segment(
                    batch_id=batch.batch_id, env_id=batch.env_id, policy_version=int(batch.policy_version),
                    column=col, t0=t0, ret=float(batch.rewards[t0:t0 + length, col].astype(np.float64).sum()),
                    obs=np.asarray(batch.obs[t0:t0 + length, col], np.float32),
                    act=np.asarray(batch.actions[t0:t0 + length, col], np.float32), bucket=bucket))
            start = end + 1
    return out, unused


def pair_id(w: Segment, l: Segment) -> str:
    return hashlib.sha256(f"{w.key}|{l.key}".encode()).hexdigest()[:32]


def pair_segments(segments: list[Segment], margin: float = 0.0,
                  margin_std: float = 0.1) -> tuple[list[tuple[Segment, Segment]], Counter]:
    """(winner, loser) pairs within buckets (see the module docstring) and skip counts."""
    buckets: dict[tuple, list[Segment]] = defaultdict(list)
    for s in segments:
        buckets[s.bucket].append(s)
    pairs: list[tuple[Segment, Segment]] = []
    skipped: Counter = Counter()
    for key in sorted(buckets, key=repr):
        segs = sorted(buckets[key], key=lambda s: (-s.ret, s.key))
        half = len(segs) // 2
        skipped["unpaired_segment"] += len(segs) - 2 * half
        if half == 0:
            continue
        threshold = max(margin, margin_std * float(np.std([s.ret for s in segs])))
        for i in range(half):
            w, l = segs[i], segs[i + half]
            if w.ret - l.ret <= threshold:
                skipped["small_gap"] += 1
                continue
            pairs.append((w, l))
    return pairs, skipped


def _to_pair(w: Segment, l: Segment) -> PreferencePair:
    return PreferencePair(
        pair_id=pair_id(w, l), env_id=w.env_id, policy_version=w.policy_version, obs_w=w.obs, act_w=w.act,
        obs_l=l.obs, act_l=l.act, return_w=w.ret, return_l=l.ret,
        source_batch_ids=[w.batch_id] if w.batch_id == l.batch_id else [w.batch_id, l.batch_id],
        created_at_ms=now_ms())


def _existing_pair_ids(events: EventBus, skipped: Counter) -> set[str]:
    ids: set[str] = set()
    for rec in events.bus.read_all(PREFERENCES):
        pid = rec.headers.get(PAIR_ID_HEADER)
        if pid:
            ids.add(pid.decode())
            continue
        try:
            ids.add(_decode(events, rec, PreferencePair).pair_id)
        except CodecError:
            skipped["undecodable_existing_pair"] += 1
    return ids


def _dead_lettered_here(events: EventBus) -> set[tuple[str, int, int]]:
    seen: set[tuple[str, int, int]] = set()
    for rec in events.bus.read_all(DEADLETTER):
        try:
            dl = events.codec.decode(rec.value)
        except CodecError:
            continue
        if isinstance(dl, DeadLetter) and dl.stage == STAGE:
            seen.add((dl.topic, dl.partition, dl.offset))
    return seen


def _find_version(events: EventBus, policy_id: str, version: int) -> tuple[PolicyVersion, Record] | None:
    for rec in events.bus.read_all(POLICY_VERSIONS):
        try:
            pv = events.codec.decode(rec.value)
        except CodecError:
            continue
        if isinstance(pv, PolicyVersion) and pv.policy_id == policy_id and pv.version == version:
            return pv, rec
    return None


def _stack(pairs: list[tuple[Segment, Segment]]) -> PreferenceBatch:
    def arr(get):
        return np.ascontiguousarray(np.stack([get(p) for p in pairs], axis=1))  # [L, B, dim]

    return PreferenceBatch.from_numpy(obs_w=arr(lambda p: p[0].obs), act_w=arr(lambda p: p[0].act),
                                      obs_l=arr(lambda p: p[1].obs), act_l=arr(lambda p: p[1].act))


@torch.no_grad()
def _preference_stats(algo, batch: PreferenceBatch) -> dict[str, float]:
    """DPO loss/implicit-reward metrics, and how often each policy itself prefers the winner."""
    from agents.dpo import segment_log_prob

    out = algo.evaluate(batch)
    b = batch.to(algo.device)
    for name, pol in (("policy", algo.policy), ("reference", algo.ref_policy)):
        margin = segment_log_prob(pol, b.obs_w, b.act_w, None) - segment_log_prob(pol, b.obs_l, b.act_l, None)
        out[f"logp_margin_{name}"] = float(margin.mean())
        out[f"prefers_winner_{name}"] = float((margin > 0).float().mean())
    return out


def _train_dpo(events: EventBus, pairs: list[tuple[Segment, Segment]], *, beta: float, epochs: int,
               heldout: float, policy_id: str, out: Path, lr: float, minibatch: int, seed: int,
               hidden: tuple[int, ...] | None, blob_store: Blobs = None) -> dict[str, Any]:
    from agents.registry import make_algorithm

    t0 = time.perf_counter()
    by_env = Counter(w.env_id for w, _ in pairs)
    env_id = by_env.most_common(1)[0][0]
    pairs = [p for p in pairs if p[0].env_id == env_id]
    obs_dim, act_dim = pairs[0][0].obs.shape[-1], pairs[0][0].act.shape[-1]
    version = Counter(w.policy_version for w, _ in pairs).most_common(1)[0][0]
    overrides: dict[str, Any] = {"beta": beta, "learning_rate": lr, "seed": seed}
    reference: dict[str, Any] = {"source": "fresh", "version": None}
    ref_policy = None
    found = _find_version(events, policy_id, version)
    if found is not None:
        pv, rec = found
        try:
            ref_policy = load_policy(pv, blob_store)
        except CodecError as e:
            events.dead_letters.send(rec, e.reason, e, STAGE)
            reference["why_not_version"] = f"version {version} does not load: {e}"
        else:
            if (ref_policy.obs_dim, ref_policy.act_dim) != (obs_dim, act_dim):
                reference["why_not_version"] = (f"version {version} is {ref_policy.obs_dim}x{ref_policy.act_dim}, "
                                                f"the data {obs_dim}x{act_dim}")
                ref_policy = None
    else:
        reference["why_not_version"] = f"version {version} of {policy_id!r} is not on {POLICY_VERSIONS}"
    if ref_policy is not None:
        arch = arch_of(ref_policy)
        overrides.update(hidden=tuple(arch["hidden"]), activation=arch["activation"],
                         normalize_obs=arch["normalize_obs"], obs_clip=arch["obs_clip"])
        reference = {"source": POLICY_VERSIONS, "version": version}
    elif hidden is not None:
        overrides["hidden"] = tuple(hidden)

    def is_heldout(p) -> bool:
        return int(pair_id(*p)[:8], 16) % 10_000 < heldout * 10_000

    test = [p for p in pairs if is_heldout(p)]
    train = [p for p in pairs if not is_heldout(p)] or test
    overrides["num_minibatches"] = max(1, len(train) // max(1, minibatch))
    algo = make_algorithm("dpo", obs_dim, act_dim, overrides)
    if ref_policy is not None:
        algo.init_from_policy(ref_policy.state_dict())
    else:
        algo.policy.obs_rms.update(torch.from_numpy(np.concatenate(
            [np.concatenate([w.obs, l.obs]) for w, l in pairs])))
        algo.sync_reference()
    train_batch = _stack(train)
    test_batch = _stack(test) if test else None
    before = _preference_stats(algo, test_batch) if test_batch is not None else {}
    history = [algo.update(train_batch) for _ in range(max(1, epochs))]
    after = _preference_stats(algo, test_batch) if test_batch is not None else {}
    train_eval = algo.evaluate(train_batch)
    out.mkdir(parents=True, exist_ok=True)
    weights_path = out / "policy.safetensors"
    weights_path.write_bytes(encode_weights(algo.policy.state_dict(), arch_of(algo.policy)))
    return {
        "env_id": env_id, "envs": dict(by_env), "obs_dim": obs_dim, "act_dim": act_dim, "beta": beta,
        "epochs": len(history), "learning_rate": lr, "pairs_train": len(train), "pairs_heldout": len(test),
        "reference": reference,
        "loss_first": history[0]["loss_dpo"], "loss_last": history[-1]["loss_dpo"],
        "reward_accuracy": train_eval["reward_accuracy"], "reward_margin": train_eval["reward_margin"],
        "heldout_before": before, "heldout_after": after,
        "heldout_reward_accuracy": after.get("reward_accuracy"),
        "weights": str(weights_path), "seconds": round(time.perf_counter() - t0, 3),
    }


def run_replay(bus_config: BusConfig | Bus | EventBus, topic: str = SAMPLES_RAW, segment: int = 32,
               train: bool = False, beta: float = 0.1, epochs: int = 20, out: Path | str = Path("runs/dpo"), *,
               margin: float = 0.0, margin_std: float = 0.1, publish: bool = True, heldout: float = 0.2,
               policy_id: str = "policy", lr: float = 3e-4, minibatch: int = 64, seed: int = 0,
               hidden: tuple[int, ...] | None = None, blob_store: Blobs = None) -> dict[str, Any]:
    """Replay ``topic``, rebuild and publish preference pairs, optionally train DPO (module docstring);
    ``blob_store``: where the reference version's claim-checked weights are.

    Returns ``{records, batches, segments, pairs_built, pairs_published, pairs_existing,
    skipped: {reason: n}, dead_lettered, seconds, dpo: {...} | None}``.
    """
    t0 = time.perf_counter()
    out = Path(out)
    events, owned = open_events(bus_config, need=(topic,))
    try:
        skipped: Counter = Counter()
        already_dead = _dead_lettered_here(events)
        dead = 0
        seen_batches: set[str] = set()
        segments: list[Segment] = []
        records = batches = 0
        for rec in events.bus.read_all(topic):
            records += 1
            try:
                ev = _decode(events, rec, (SampleBatch, PreparedBatch))
            except CodecError as e:
                skipped[f"bad_record_{e.reason}"] += 1
                if (rec.topic, rec.partition, rec.offset) not in already_dead:
                    events.dead_letters.send(rec, e.reason, e, STAGE)
                    dead += 1
                continue
            batch = ev.sample if isinstance(ev, PreparedBatch) else ev
            if batch.batch_id in seen_batches:
                skipped["duplicate_batch"] += 1
                continue
            seen_batches.add(batch.batch_id)
            batches += 1
            segs, unused = build_segments(batch, segment)
            segments.extend(segs)
            skipped["steps_outside_segments"] += int(unused)
        pairs, pair_skips = pair_segments(segments, margin, margin_std)
        skipped.update(pair_skips)
        published = existing = 0
        if publish and pairs:
            have = _existing_pair_ids(events, skipped)
            for w, l in pairs:
                pp = _to_pair(w, l)
                if pp.pair_id in have:
                    existing += 1
                    continue
                have.add(pp.pair_id)
                events.bus.produce(PREFERENCES, events.codec.encode(pp), key=pp.env_id.encode(),
                                   headers={**events.codec.headers_for(pp), PAIR_ID_HEADER: pp.pair_id.encode()})
                published += 1
        events.flush()
        dpo = None
        if train:
            if len(pairs) < 2:
                ns = getattr(events.bus, "ns", None)
                where = f"{topic} in namespace {ns.name!r}" if ns is not None else topic
                hint = ("the topic is empty: is this the run's namespace (--namespace, --run-dir)?" if not records
                        else "too few comparable segments: try a shorter --segment")
                raise ReplayError(f"cannot train DPO on {len(pairs)} preference pair(s) from {where} "
                                  f"({records} records, {len(segments)} segments of {segment} steps): {hint}")
            dpo = _train_dpo(events, pairs, beta=beta, epochs=epochs, heldout=heldout, policy_id=policy_id,
                             out=out, lr=lr, minibatch=minibatch, seed=seed, hidden=hidden, blob_store=blob_store)
    finally:
        if owned is not None:
            owned.close()
    summary = {
        "topic": topic, "segment": segment, "records": records, "batches": batches, "segments": len(segments),
        "pairs_built": len(pairs), "pairs_published": published, "pairs_existing": existing,
        "skipped": dict(sorted(skipped.items())), "dead_lettered": dead,
        "seconds": round(time.perf_counter() - t0, 3), "dpo": dpo,
    }
    if train:  # the DPO result is a run of its own (``rlstream eval`` reads policy.safetensors)
        summary.update({"mode": "dpo", "env": dpo["env_id"] if dpo else None})
        write_json_atomic(out / "summary.json", summary)
    return summary
