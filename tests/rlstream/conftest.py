"""Shared fixtures of the rlstream command tests: ``events`` (a memory bus with every topic) and
``pv`` (make policies, publish them as versions the way the learner does, compare weights)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from agents.networks import Policy
from streams.policies import make_policy_version
from schemas.codec import Codec
from streams.bus.memory import MemoryBus
from streams.events import EventBus
from streams.topics import POLICY_VERSIONS, PUBLISHED_NS_HEADER, all_topics

torch.set_num_threads(1)

OBS, ACT = 3, 2


def make_policy(seed: int, obs_dim: int = OBS, act_dim: int = ACT, hidden=(8, 8)) -> Policy:
    torch.manual_seed(seed)
    p = Policy(obs_dim, act_dim, hidden=hidden)
    with torch.no_grad():
        for prm in p.parameters():
            prm.add_(torch.randn_like(prm) * 0.1)  # the head starts near 0: make versions differ
    return p.eval()


def publish_version(events: EventBus, version: int, policy: Policy | None = None, *,
                    policy_id: str = "policy", topic: str = POLICY_VERSIONS, parent: int | None = -1,
                    algo: str = "ppo") -> Policy:
    policy = policy if policy is not None else make_policy(version)
    pv = make_policy_version(policy, policy_id=policy_id, version=version,
                             parent_version=(version - 1 if version > 0 else None) if parent == -1 else parent,
                             learner_id="learner-test", algo=algo, metrics={"loss": float(version)})
    events.bus.produce(topic, events.codec.encode(pv), key=policy_id.encode(),
                       headers={**events.codec.headers_for(pv), PUBLISHED_NS_HEADER: str(time.time_ns()).encode()})
    events.flush()
    return policy


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def events() -> EventBus:
    bus = MemoryBus()
    bus.create_topics(all_topics())
    return EventBus(bus, Codec())


@pytest.fixture
def pv() -> SimpleNamespace:
    return SimpleNamespace(OBS=OBS, ACT=ACT, make_policy=make_policy, publish=publish_version,
                           same_weights=same_weights)
