"""The events, as frozen dataclasses. Arrays are numpy; on the wire they are ``rlstream.Tensor``
records (packed bytes + dtype + shape). ``schemas.codec`` maps these to and from Avro.

Each class names its Avro record in ``AVRO_NAME``; fields typed ``np.ndarray`` (or optional
arrays) travel as Tensors. Decoded arrays are read-only views onto the message bytes.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from schemas.errors import InvalidEventError

_DTYPES = {"float32", "float64", "int64", "int32", "uint8", "bool"}


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_id() -> str:
    return uuid.uuid4().hex


def tensor_to_record(a: np.ndarray) -> dict[str, Any]:
    a = np.asarray(a)
    if a.dtype.name not in _DTYPES:
        raise InvalidEventError(f"unsupported tensor dtype {a.dtype.name}; use one of {sorted(_DTYPES)}")
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": np.ascontiguousarray(a).tobytes()}


def tensor_from_record(r: dict[str, Any]) -> np.ndarray:
    dtype = r["dtype"]
    if dtype not in _DTYPES:
        raise InvalidEventError(f"tensor dtype {dtype!r} not allowed")
    shape = tuple(int(s) for s in r["shape"])
    if any(s < 0 for s in shape):
        raise InvalidEventError(f"negative tensor dimension in shape {shape}")
    dt = np.dtype(dtype).newbyteorder("<")
    # Python ints: np.prod(int64) wraps (2**32 * 2**32 -> 0) and a hostile shape would pass.
    expected = math.prod(shape) * dt.itemsize
    data = r["data"]
    if len(data) != expected:
        raise InvalidEventError(f"tensor of shape {shape} {dtype} needs {expected} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=dt).reshape(shape)


@dataclass(frozen=True)
class ClaimCheck:
    """Reference to a payload kept outside the log."""

    AVRO_NAME: ClassVar[str] = "rlstream.ClaimCheck"
    store: str
    key: str
    sha256: str
    size: int


@dataclass(frozen=True)
class PolicyVersion:
    AVRO_NAME: ClassVar[str] = "rlstream.PolicyVersion"
    policy_id: str
    version: int
    created_at_ms: int
    learner_id: str
    algo: str
    weights: bytes | None = None
    weights_ref: ClaimCheck | None = None
    parent_version: int | None = None
    weights_format: str = "safetensors"
    metrics: dict[str, float] = field(default_factory=dict)
    state_sha256: str | None = None  # v2: the learner's whole state after this version
    provenance: str = ""  # v2: JSON of what a replay needs (``learner.provenance``)


@dataclass(frozen=True)
class SampleBatch:
    """A time-major rollout fragment: arrays are [T, N, ...] (T steps of N envs)."""

    AVRO_NAME: ClassVar[str] = "rlstream.SampleBatch"
    batch_id: str
    actor_id: str
    seq: int
    env_id: str
    policy_version: int
    created_at_ms: int
    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    behaviour_logp: np.ndarray
    last_obs: np.ndarray
    final_obs_index: np.ndarray
    final_obs: np.ndarray
    group_ids: np.ndarray | None = None
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    step_versions: np.ndarray | None = None
    """[T] int64: each step's behaviour version when the actor adopted a newer one within the
    fragment (in-flight weight updates); non-decreasing, first = ``policy_version``. None: every
    step is ``policy_version``. ``behaviour_logp`` is always the acting version's."""

    def versions(self) -> np.ndarray:
        """[T] int64 behaviour version of each step (``step_versions``, or ``policy_version``)."""
        if self.step_versions is not None:
            return self.step_versions
        return np.full(self.num_steps, self.policy_version, np.int64)

    @property
    def newest_version(self) -> int:
        """The newest behaviour version in the fragment (its last step's)."""
        return int(self.step_versions[-1]) if self.step_versions is not None and self.step_versions.size else int(
            self.policy_version)

    @property
    def num_steps(self) -> int:
        return int(self.rewards.shape[0])

    @property
    def num_envs(self) -> int:
        return int(self.rewards.shape[1])

    @property
    def size(self) -> int:
        """Number of transitions."""
        return int(self.rewards.size)

    def validate(self) -> None:
        """Shapes agree and every float is finite; raises InvalidEventError otherwise."""
        if self.rewards.ndim != 2:
            raise InvalidEventError(f"rewards must be [T, N], got shape {self.rewards.shape}")
        t, n = self.rewards.shape
        for name in ("terminated", "truncated", "behaviour_logp"):
            if getattr(self, name).shape != (t, n):
                raise InvalidEventError(f"{name} shape {getattr(self, name).shape} != {(t, n)}")
        if self.obs.shape[:2] != (t, n) or self.actions.shape[:2] != (t, n):
            raise InvalidEventError(
                f"obs {self.obs.shape} / actions {self.actions.shape} do not start with {(t, n)}"
            )
        if self.last_obs.shape != (n, *self.obs.shape[2:]):
            raise InvalidEventError(f"last_obs shape {self.last_obs.shape} != {(n, *self.obs.shape[2:])}")
        if self.final_obs.shape[0] != self.final_obs_index.shape[0]:
            raise InvalidEventError("final_obs and final_obs_index lengths differ")
        if self.final_obs_index.size and (
            self.final_obs_index.min() < 0 or self.final_obs_index.max() >= t * n
        ):
            raise InvalidEventError("final_obs_index out of range")
        if self.seq < 0 or self.policy_version < 0:
            raise InvalidEventError("seq and policy_version must be >= 0")
        sv = self.step_versions
        if sv is not None:
            if sv.shape != (t,) or sv.dtype != np.int64:
                raise InvalidEventError(f"step_versions must be [T] = [{t}] int64, got {sv.shape} {sv.dtype}")
            if t and (sv[0] != self.policy_version or (np.diff(sv) < 0).any()):
                raise InvalidEventError("step_versions must start at policy_version and never decrease")
        for name in ("obs", "actions", "rewards", "behaviour_logp", "last_obs", "final_obs"):
            a = getattr(self, name)
            if a.size and not np.isfinite(a).all():
                bad = int((~np.isfinite(a)).sum())
                raise InvalidEventError(f"{name} has {bad} non-finite values (NaN/inf)")


@dataclass(frozen=True)
class PreparedBatch:
    AVRO_NAME: ClassVar[str] = "rlstream.PreparedBatch"
    sample: SampleBatch
    current_version: int
    staleness_versions: int
    staleness_ms: int
    is_rho: np.ndarray
    is_c: np.ndarray
    prepared_at_ms: int
    sample_weight: float = 1.0
    source_partition: int = -1
    source_offset: int = -1

    def validate(self) -> None:
        self.sample.validate()
        shape = self.sample.rewards.shape
        for name in ("is_rho", "is_c"):
            a = getattr(self, name)
            if a.shape != shape:
                raise InvalidEventError(f"{name} shape {a.shape} != {shape}")
            if a.size and not (np.isfinite(a).all() and (a >= 0).all()):
                raise InvalidEventError(f"{name} must be finite and >= 0")
        if not (np.isfinite(self.sample_weight) and self.sample_weight >= 0):
            raise InvalidEventError(f"sample_weight {self.sample_weight} must be finite and >= 0")


@dataclass(frozen=True)
class GradientStep:
    AVRO_NAME: ClassVar[str] = "rlstream.GradientStep"
    learner_id: str
    step: int
    from_version: int
    to_version: int
    algo: str
    losses: dict[str, float]
    grad_norm: float
    batch_ids: list[str]
    num_samples: int
    started_at_ms: int
    finished_at_ms: int
    batch_digests: list[str] = field(default_factory=list)  # v2: sha256 of each consumed record


@dataclass(frozen=True)
class PreferencePair:
    AVRO_NAME: ClassVar[str] = "rlstream.PreferencePair"
    pair_id: str
    env_id: str
    policy_version: int
    obs_w: np.ndarray
    act_w: np.ndarray
    obs_l: np.ndarray
    act_l: np.ndarray
    return_w: float
    return_l: float
    source_batch_ids: list[str]
    created_at_ms: int


@dataclass(frozen=True)
class DeadLetter:
    AVRO_NAME: ClassVar[str] = "rlstream.DeadLetter"
    topic: str
    partition: int
    offset: int
    value: bytes
    reason: str
    error_class: str
    stage: str
    occurred_at_ms: int
    key: bytes | None = None
    headers: dict[str, bytes] = field(default_factory=dict)
    detail: str = ""


EVENT_TYPES: dict[str, type] = {
    c.AVRO_NAME: c
    for c in (ClaimCheck, PolicyVersion, SampleBatch, PreparedBatch, GradientStep, PreferencePair, DeadLetter)
}


# --- dataclass <-> Avro datum -------------------------------------------------------------

def _field_plan(cls: type) -> list[tuple[str, str]]:
    """(name, kind) per field; kind is 'tensor', 'opt_tensor', 'event:<Name>', 'opt_event:<Name>' or 'plain'."""
    plan = []
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    for name, hint in hints.items():
        h = str(hint).replace(" ", "")
        if h == "np.ndarray":
            plan.append((name, "tensor"))
        elif h in ("np.ndarray|None", "None|np.ndarray"):
            plan.append((name, "opt_tensor"))
        else:
            base = h.replace("|None", "")
            nested = next((c for c in EVENT_TYPES.values() if c.__name__ == base), None)
            if nested is not None:
                plan.append((name, ("opt_event:" if "None" in h else "event:") + nested.AVRO_NAME))
            else:
                plan.append((name, "plain"))
    return plan


_PLANS: dict[type, list[tuple[str, str]]] = {}


def _plan(cls: type) -> list[tuple[str, str]]:
    p = _PLANS.get(cls)
    if p is None:
        p = _PLANS[cls] = _field_plan(cls)
    return p


def to_datum(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, kind in _plan(type(event)):
        v = getattr(event, name)
        if kind == "tensor" or (kind == "opt_tensor" and v is not None):
            out[name] = tensor_to_record(v)
        elif kind.startswith(("event:", "opt_event:")) and v is not None:
            out[name] = to_datum(v)
        else:
            out[name] = v
    return out


def from_datum(cls: type, datum: dict[str, Any]) -> Any:
    kwargs: dict[str, Any] = {}
    for name, kind in _plan(cls):
        if name not in datum:
            continue  # reader-side default of the dataclass applies
        v = datum[name]
        if kind == "tensor" or (kind == "opt_tensor" and v is not None):
            v = tensor_from_record(v)
        elif kind.startswith(("event:", "opt_event:")) and v is not None:
            v = from_datum(EVENT_TYPES[kind.split(":", 1)[1]], v)
        kwargs[name] = v
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise InvalidEventError(f"{cls.__name__}: {e}") from e
