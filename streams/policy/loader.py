"""THE loader: a PolicyVersion's weights (inline or claim-checked) into a module, shared per
process for inference-only readers (``SharedWeights``), and the log-prob function of the
importance weights (``PolicyLogpFn``)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from agents.networks import Policy
from schemas.errors import CodecError
from schemas.events import PolicyVersion
from schemas.weights import decode_weights

from streams.policy.errors import PolicyLoadError
from streams.policy.arch import arch_of, policy_from_arch
from streams.policy.blobs import DEFAULT_RETRY, Blobs, FetchRetry, HostCachedStore, verify_claim_check

log = logging.getLogger(__name__)


# -- THE loader ----------------------------------------------------------------------------------

def weights_bytes(pv: PolicyVersion, blobs: Blobs = None,
                  retry: FetchRetry = DEFAULT_RETRY) -> bytes | bytearray:
    """The safetensors bytes of ``pv``: inline, or fetched from ``blobs`` (a failed fetch retried
    as ``retry`` says) and checked by sha256."""
    if pv.weights is not None:
        return pv.weights
    ref = pv.weights_ref
    if ref is None:
        raise PolicyLoadError(f"policy version {pv.version} has neither weights nor a claim check")
    if blobs is None:
        raise PolicyLoadError(f"policy version {pv.version} is a claim check ({ref.store}:{ref.key}) "
                              "but no blob store is configured")
    what = f"fetching the claim-checked weights of version {pv.version}"
    if isinstance(blobs, HostCachedStore):  # checked as they stream into the host's cache
        return retry.call(lambda: blobs.fetch_verified(ref), what)
    data = retry.call(lambda: blobs(ref) if callable(blobs) else blobs.get(ref.key), what)
    return verify_claim_check(data, ref, f"claim-checked weights of version {pv.version}")


def decode_version(pv: PolicyVersion, blobs: Blobs = None,
                   retry: FetchRetry = DEFAULT_RETRY) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(state_dict, arch)`` of ``pv``'s weights; PolicyLoadError when they do not decode."""
    if pv.weights_format != "safetensors":
        raise PolicyLoadError(f"weights format {pv.weights_format!r} is not supported (safetensors only)")
    try:
        return decode_weights(weights_bytes(pv, blobs, retry))
    except PolicyLoadError:
        raise
    except CodecError as e:
        raise PolicyLoadError(f"weights of version {pv.version} do not decode: {e}") from e


class _Flight:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        self.error: CodecError | None = None


class SharedWeights:
    """The decoded claim-checked weights of one process's readers (actors as threads): per content
    digest (the claim check's sha256) the first reader to ask fetches, checks and decodes them,
    the others wait for that one flight and get the same tensors, which they must only read.
    Keeps the newest ``size`` digests, failures included (a version that did not load is not
    fetched again by every reader)."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._flights: OrderedDict[str, _Flight] = OrderedDict()
        self.fills = self.hits = self.failures = 0

    def decoded(self, pv: PolicyVersion, blobs: Blobs,
                retry: FetchRetry = DEFAULT_RETRY) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``decode_version(pv, blobs, retry)``, once per digest in this process."""
        if pv.weights_ref is None:  # inline: the bytes came with this reader's own record
            return decode_version(pv, blobs, retry)
        key = pv.weights_ref.sha256
        with self._lock:
            flight = self._flights.get(key)
            owner = flight is None
            if owner:
                flight = self._flights[key] = _Flight()
                while len(self._flights) > self.size:
                    self._flights.popitem(last=False)
                self.fills += 1
            else:
                self._flights.move_to_end(key)
                self.hits += 1
        if owner:
            try:
                flight.value = decode_version(pv, blobs, retry)
            except CodecError as e:
                flight.error = e
            except Exception as e:  # never leave the waiters hanging
                flight.error = PolicyLoadError(f"weights of version {pv.version}: {type(e).__name__}: {e}")
            finally:
                if flight.error is not None:
                    self.failures += 1
                flight.done.set()
        flight.done.wait()
        if flight.error is not None:
            raise flight.error
        return flight.value


#: The process's shared decoded weights (``PolicySubscriber``'s default).
PROCESS_WEIGHTS = SharedWeights()


def load_policy(pv: PolicyVersion, blobs: Blobs = None, into: Policy | None = None, *,
                shared: SharedWeights | None = None, retry: FetchRetry = DEFAULT_RETRY) -> Policy:
    """The module of ``pv`` (eval mode): its weights loaded into ``into``, or into a new module
    when ``into`` is None or of another architecture. PolicyLoadError when they do not load;
    a module is never left half-loaded. With ``shared`` (inference-only readers), the weights
    come from that cache and the module references the decoded tensors instead of copying them:
    its tensors are replaced, never written."""
    state, arch = decode_version(pv, blobs, retry) if shared is None else shared.decoded(pv, blobs, retry)
    return load_state(state, arch, into, f"weights of version {pv.version}", assign=shared is not None)


def load_state(state: dict[str, torch.Tensor], arch: dict[str, Any], into: Policy | None = None,
               what: str = "weights", assign: bool = False) -> Policy:
    """``state`` (a Policy state_dict) loaded into ``into``, or into a new module of ``arch``
    when ``into`` is None or of another architecture; eval mode. PolicyLoadError if it does
    not fit (checked before anything is copied: a module is never left half-loaded).
    ``assign``: the module takes ``state``'s tensors themselves (no copy)."""
    if into is None or arch_of(into) != arch:
        # uninitialised: the strict, shape-checked load below fills every tensor
        into = policy_from_arch(arch, max_params=sum(t.numel() for t in state.values()), empty=True)
    # check every name and shape first: torch copies matching tensors before it raises
    expected = {k: tuple(v.shape) for k, v in into.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if expected != got:
        diff = sorted(set(expected.items()) ^ set(got.items()))[:4]
        raise PolicyLoadError(f"{what} do not fit the architecture: {diff}")
    try:
        into.load_state_dict(state, strict=True, assign=assign)
    except RuntimeError as e:
        raise PolicyLoadError(f"{what} do not fit the architecture: {e}") from e
    into.eval()
    return into


class PolicyLogpFn:
    """``logp(obs [T, N, obs_dim], actions [T, N, act_dim]) -> [T, N]`` of a module with
    ``log_prob``; no grad, CPU. ``from_policy_version`` builds one with ``load_policy``."""

    def __init__(self, policy: Any, version: int | None = None) -> None:
        self.policy = policy
        self.version = version
        if hasattr(policy, "eval"):
            policy.eval()

    def __call__(self, obs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        o = torch.from_numpy(np.array(obs, dtype=np.float32, copy=True))
        a = torch.from_numpy(np.array(actions, dtype=np.float32, copy=True))
        with torch.inference_mode():
            lp = self.policy.log_prob(o, a)
        out = lp.detach().to("cpu").numpy()
        expected = tuple(np.shape(obs)[:2])
        if out.shape != expected:
            raise ValueError(f"policy log_prob returned shape {out.shape}, expected {expected}")
        return out

    @classmethod
    def from_policy_version(cls, pv: PolicyVersion, fetch: Blobs = None) -> "PolicyLogpFn":
        """The log-prob function of ``pv``'s module; ``fetch``: where claim-checked weights are."""
        return cls(load_policy(pv, fetch), pv.version)

    @classmethod
    def factory(cls, blobs: Blobs = None) -> Callable[[PolicyVersion], "PolicyLogpFn"]:
        """A ``logp_factory`` for the processors that fetches claim-checked weights from ``blobs``."""
        return lambda pv: cls.from_policy_version(pv, blobs)
