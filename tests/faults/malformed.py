"""Hypothesis strategies of malformed records, for every processor entry point.

Each strategy draws ``(bytes, kind)`` for a record that is *surely* bad for a reader expecting
one event type, so a test can demand ``dead letters == bad records`` exactly:

* decode level (every reader rejects these): random bytes without the Avro single-object magic,
  the magic plus too few bytes, an unknown writer fingerprint, a valid encoding cut short, a
  valid encoding with trailing bytes, a valid encoding of another event type;
* content level (the event decodes, ``validate`` rejects it): NaN, inf, shapes that disagree,
  negative seq, for SampleBatch / PreparedBatch;
* load level (a PolicyVersion that decodes but whose policy cannot be built): garbage weights,
  a safetensors header that is not an object, an architecture that is not one, negative or
  absurd sizes, tensors that do not fit the architecture, neither weights nor a claim check.
  Only readers that load policies (actors, the server, the learner) can see these.

Bit flips are left out on purpose: a flipped byte can leave a valid event, so the count of bad
records would not be known (``tests/streams`` fuzzes flips for "never raises").
"""

from __future__ import annotations

import json
import struct

import numpy as np
import torch
from hypothesis import strategies as st

from agents.networks import Policy
from streams.policies import make_policy_version
from schemas.codec import MAGIC, Codec
from schemas.events import (
    ClaimCheck,
    DeadLetter,
    GradientStep,
    PolicyVersion,
    PreparedBatch,
    SampleBatch,
)
from schemas.weights import ARCH_KEY

CODEC = Codec()
T, N, OBS, ACT = 4, 2, 3, 1
KNOWN_FPS = {bytes(CODEC.writer_schema(c).fingerprint) for c in (PolicyVersion, SampleBatch, PreparedBatch,
                                                                   GradientStep, DeadLetter)}


def sample_batch(actor: str = "a", seq: int = 0, version: int = 0, created: int = 1_000_000,
                 batch_id: str | None = None, obs_dim: int = OBS, act_dim: int = ACT) -> SampleBatch:
    rng = np.random.default_rng(seq * 7919 + sum(map(ord, actor)))
    return SampleBatch(
        batch_id=batch_id or f"{actor}-{seq}", actor_id=actor, seq=seq, env_id="Test-v0", policy_version=version,
        created_at_ms=created, obs=rng.standard_normal((T, N, obs_dim)).astype(np.float32),
        actions=rng.standard_normal((T, N, act_dim)).astype(np.float32),
        rewards=rng.standard_normal((T, N)).astype(np.float32), terminated=np.zeros((T, N), bool),
        truncated=np.zeros((T, N), bool), behaviour_logp=np.full((T, N), -1.5, np.float32),
        last_obs=np.zeros((N, obs_dim), np.float32), final_obs_index=np.zeros(0, np.int64),
        final_obs=np.zeros((0, obs_dim), np.float32),
    )


def prepared(sb: SampleBatch) -> PreparedBatch:
    ones = np.ones((T, N), np.float32)
    return PreparedBatch(sb, sb.policy_version, 0, 0, ones, ones, sb.created_at_ms)


_POLICIES: dict[int, Policy] = {}


def policy(seed: int = 0) -> Policy:
    if seed not in _POLICIES:
        torch.manual_seed(seed)
        _POLICIES[seed] = Policy(OBS, ACT, hidden=(8,))
    return _POLICIES[seed]


def policy_version(version: int, policy_id: str = "policy", learner_id: str = "learner-test") -> PolicyVersion:
    return make_policy_version(policy(version % 3), policy_id=policy_id, version=version,
                               parent_version=version - 1 if version else None, learner_id=learner_id, algo="ppo")


def _replace(ev, **kw):
    return type(ev)(**{**ev.__dict__, **kw})


# --- decode level -----------------------------------------------------------------------------

def decode_level(good: bytes, wrong_type: bytes) -> st.SearchStrategy:
    """Records no reader of ``good``'s type can decode. ``good``/``wrong_type``: encodings."""
    noise = st.binary(max_size=48).filter(lambda b: not b.startswith(MAGIC)).map(lambda b: (b, "noise"))
    short = st.binary(max_size=7).map(lambda b: (MAGIC + b, "short"))
    unknown = st.tuples(st.binary(min_size=8, max_size=8).filter(lambda f: f not in KNOWN_FPS),
                        st.binary(max_size=32)).map(lambda t: (MAGIC + t[0] + t[1], "unknown_schema"))
    cut = st.integers(0, len(good) - 1).map(lambda k: (good[:k], "truncated"))
    trailing = st.binary(min_size=1, max_size=16).map(lambda b: (good + b, "trailing"))
    other = st.just((wrong_type, "wrong_type"))
    return st.one_of(noise, short, unknown, cut, trailing, other)


# --- content level ----------------------------------------------------------------------------

def _bad_sample(kind: str, seq: int) -> SampleBatch:
    b = sample_batch("z", seq, batch_id=f"bad-{kind}-{seq}")
    if kind == "nan":
        obs = b.obs.copy()
        obs[0, 0, 0] = np.nan
        return _replace(b, obs=obs)
    if kind == "inf":
        return _replace(b, rewards=np.full((T, N), np.inf, np.float32))
    if kind == "shape":
        return _replace(b, behaviour_logp=np.zeros((T + 1, N), np.float32))
    if kind == "last_obs":
        return _replace(b, last_obs=np.zeros((N + 1, OBS), np.float32))
    if kind == "final_index":
        return _replace(b, final_obs_index=np.asarray([T * N], np.int64), final_obs=np.zeros((1, OBS), np.float32))
    if kind == "neg_seq":
        return _replace(b, seq=-1)
    raise ValueError(kind)


SAMPLE_KINDS = ["nan", "inf", "shape", "last_obs", "final_index", "neg_seq"]


def invalid_samples() -> st.SearchStrategy:
    return st.builds(lambda k, s: (CODEC.encode(_bad_sample(k, s)), f"invalid_{k}"),
                     st.sampled_from(SAMPLE_KINDS), st.integers(0, 50))


def invalid_prepared() -> st.SearchStrategy:
    def make(kind: str, seq: int) -> tuple[bytes, str]:
        if kind in SAMPLE_KINDS:
            return CODEC.encode(prepared(_bad_sample(kind, seq))), f"invalid_{kind}"
        pb = prepared(sample_batch("z", seq, batch_id=f"bad-{kind}-{seq}"))
        if kind == "rho_nan":
            pb = _replace(pb, is_rho=np.full((T, N), np.nan, np.float32))
        elif kind == "rho_shape":
            pb = _replace(pb, is_c=np.ones((T, N + 1), np.float32))
        elif kind == "rho_negative":
            pb = _replace(pb, is_rho=-np.ones((T, N), np.float32))
        elif kind == "weight":
            pb = _replace(pb, sample_weight=float("inf"))
        return CODEC.encode(pb), f"invalid_{kind}"

    return st.builds(make, st.sampled_from(SAMPLE_KINDS + ["rho_nan", "rho_shape", "rho_negative", "weight"]),
                     st.integers(0, 50))


def incompatible_prepared() -> st.SearchStrategy:
    """Valid PreparedBatches of another env: observation or action sizes the learner's model
    does not have (a learner must reject them, not crash on them)."""
    return st.builds(
        lambda o, a, s: (CODEC.encode(prepared(sample_batch("w", s, batch_id=f"dims-{o}-{a}-{s}", obs_dim=o,
                                                            act_dim=a))), "incompatible"),
        st.integers(1, 6).filter(lambda o: o != OBS), st.integers(1, 3), st.integers(0, 50))


# --- load level (PolicyVersion) ------------------------------------------------------------------

def _safetensors(header: object, body: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


def _weights_with_arch(arch: object) -> bytes:
    """Real tensors of the test policy, with ``arch`` as the architecture metadata."""
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in policy(0).state_dict().items()},
                metadata={ARCH_KEY: json.dumps(arch)})


def _unloadable(kind: str, version: int, junk: bytes) -> PolicyVersion:
    pv = policy_version(version)
    good_arch = {"kind": "gaussian_mlp", "obs_dim": OBS, "act_dim": ACT, "hidden": [8]}
    if kind == "garbage":
        return _replace(pv, weights=junk)
    if kind == "header_list":
        return _replace(pv, weights=_safetensors([1, 2, 3]))
    if kind == "header_len":
        return _replace(pv, weights=struct.pack("<Q", 1 << 40) + junk)
    if kind == "arch_not_object":
        return _replace(pv, weights=_weights_with_arch([OBS, ACT]))
    if kind == "arch_kind":
        return _replace(pv, weights=_weights_with_arch({**good_arch, "kind": "transformer"}))
    if kind == "arch_negative":
        return _replace(pv, weights=_weights_with_arch({**good_arch, "obs_dim": -3}))
    if kind == "arch_zero_hidden":
        return _replace(pv, weights=_weights_with_arch({**good_arch, "hidden": [0]}))
    if kind == "arch_huge":  # must be refused before anything is allocated
        return _replace(pv, weights=_weights_with_arch({**good_arch, "hidden": [1 << 20, 1 << 20]}))
    if kind == "arch_mismatch":  # tensors of obs_dim 3 under an arch that says 5
        return _replace(pv, weights=_weights_with_arch({**good_arch, "obs_dim": 5}))
    if kind == "arch_activation":
        return _replace(pv, weights=_weights_with_arch({**good_arch, "activation": "no-such"}))
    if kind == "no_weights":
        return _replace(pv, weights=None, weights_ref=None)
    if kind == "claim_check_without_store":
        return _replace(pv, weights=None, weights_ref=ClaimCheck("redis://nowhere:1", "k", "0" * 64, 10))
    raise ValueError(kind)


UNLOADABLE_KINDS = ["garbage", "header_list", "header_len", "arch_not_object", "arch_kind", "arch_negative",
                    "arch_zero_hidden", "arch_huge", "arch_mismatch", "arch_activation", "no_weights",
                    "claim_check_without_store"]


def unloadable_versions(version: st.SearchStrategy) -> st.SearchStrategy:
    """``(PolicyVersion, kind)`` that decode but whose policy cannot be built."""
    return st.builds(lambda k, v, j: (_unloadable(k, v, j), f"unloadable_{k}"),
                     st.sampled_from(UNLOADABLE_KINDS), version, st.binary(max_size=40))


# --- per topic ------------------------------------------------------------------------------------

def bad_samples() -> st.SearchStrategy:
    good = CODEC.encode(sample_batch())
    return st.one_of(decode_level(good, CODEC.encode(policy_version(0))), invalid_samples())


def bad_prepared() -> st.SearchStrategy:
    good = CODEC.encode(prepared(sample_batch()))
    return st.one_of(decode_level(good, CODEC.encode(sample_batch())), invalid_prepared())


def bad_policy_records() -> st.SearchStrategy:
    good = CODEC.encode(policy_version(0))
    return decode_level(good, CODEC.encode(sample_batch()))


def plan(bad: st.SearchStrategy, max_size: int = 12) -> st.SearchStrategy:
    """A list of ``("good", None)`` / ``("bad", (bytes, kind))`` steps with at least one bad."""
    return with_one(st.one_of(st.just(("good", None)), bad.map(lambda b: ("bad", b))), bad.map(lambda b: ("bad", b)),
                    max_size)


def with_one(step: st.SearchStrategy, must: st.SearchStrategy, max_size: int = 12) -> st.SearchStrategy:
    """Lists of ``step`` with one ``must`` inserted somewhere."""
    return st.tuples(st.lists(step, max_size=max_size - 1), must, st.integers(0, max_size)).map(
        lambda t: t[0][:t[2]] + [t[1]] + t[0][t[2]:])
