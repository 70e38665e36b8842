"""The policy layer every role shares: PolicyVersion events out of a learner, into a module elsewhere.

    pv = make_policy_version(policy, policy_id="policy", version=3, ..., blob_store=blobs)
    publish_policy_version(events, pv)

    policy = load_policy(pv, blobs)                       # THE loader: inline or claim-checked weights
    follower = PolicyFollower(events, "policy", StartRule.back(4), blobs=blobs)
    for update in follower.poll(0.1):                     # decoded versions of this policy, in log order
        window.add(update.event, update.record)           # PolicyWindow: the last N, with log-prob functions

In the spirit of Acme's VariableSource / VariableClient: the learner is the source, every other
reader (actor, stream processors, inference server, subscriber, rollback) a client that follows
``rl.policy.versions`` with an explicit start rule (``StartRule``):

* ``newest()``: the newest record of THIS policy now on the topic (read back from the log end,
  not replayed), then every later one;
* ``back(k)``: the newest ``k + 1`` records of this policy (what a staleness window of K needs);
* ``at_version(v)``: every version >= v, replayed from the start of the topic, then live ones.

The architecture travels in the safetensors metadata, so any process rebuilds the exact module
from the event alone. Weights go by claim check (Redis, or any ``BlobStore``) with a sha256 the
loader verifies when they are over ``claim_check_above`` and a store is configured (a tiny record
fans out to every reader; each host fetches the blob once), and must when they are over the
inline limit. A fetch that fails is retried with backoff (``FetchRetry``). Inference-only readers
(actors) share one fetch and decode per version and process (``SharedWeights``) and adopt by
reference, not by copy; behind ``open_blob_store`` each host fetches a blob once
(``streams.blobcache``). This module sits below every role: it imports ``schemas``,
``streams.bus``/``streams.topics``/``streams.events``/``streams.blobcache`` and ``agents`` only.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

import numpy as np
import torch

from agents.networks import Policy
from schemas.errors import CodecError, InvalidEventError
from schemas.events import ClaimCheck, PolicyVersion, now_ms
from schemas.weights import decode_weights, encode_weights, sha256
from streams.blobcache import (
    BlobCacheError,
    CacheWriteError,
    HostBlobCache,
    default_cache_dir,
    new_buffer,
)
from streams.bus.base import Consumer, Record
from streams.events import EventBus
from streams.topics import POLICY_VERSIONS, PUBLISHED_NS_HEADER

log = logging.getLogger(__name__)

# Weights above this size must go to the blob store (the event carries a claim check).
DEFAULT_INLINE_LIMIT = 4 * 1024 * 1024
# Weights above this size go to the blob store when one is configured: one tiny record fans out
# to every reader instead of the weights, and a process of many readers fetches them once.
DEFAULT_CLAIM_CHECK_ABOVE = 1024 * 1024
ENV_REDIS_URL = "REDIS_URL"


class PolicyLoadError(InvalidEventError, ValueError):
    """A PolicyVersion's weights cannot become a module (missing, unfetchable, wrong sha256,
    unknown or misfitting architecture). A CodecError: its record can be dead-lettered."""


class BlobWriteError(RuntimeError):
    """A claim-check write failed every try: the store is down. Not a CodecError (nothing is wrong
    with a record), so it is never dead-lettered; the learner that publishes fails and restarts."""


# -- architecture <-> module ----------------------------------------------------------------------

def arch_of(policy: Policy) -> dict[str, Any]:
    body = policy.net.actor_body
    hidden = [m.out_features for m in body if isinstance(m, torch.nn.Linear)][:-1]
    act_name = next((type(m).__name__.lower() for m in body if not isinstance(m, torch.nn.Linear)), "tanh")
    extra = {"nvec": list(policy.nvec)} if policy.nvec else {}
    return {
        "kind": "categorical_mlp" if policy.nvec else "gaussian_mlp",
        **extra,
        "obs_dim": policy.obs_dim,
        "act_dim": policy.act_dim,
        "hidden": hidden,
        "activation": act_name,
        "normalize_obs": policy.normalize_obs,
        "obs_clip": policy.obs_clip,
    }


def _arch_dims(arch: Any) -> tuple[str, list[int]]:
    """``(kind, [obs_dim, *hidden, actor outputs])`` of a gaussian_mlp (the default kind; outputs:
    act_dim) or categorical_mlp (outputs: sum(nvec)) architecture; PolicyLoadError otherwise."""
    if not isinstance(arch, dict):
        raise PolicyLoadError(f"policy architecture must be an object, not {type(arch).__name__}")
    kind = arch.get("kind", "gaussian_mlp")
    if kind not in ("gaussian_mlp", "categorical_mlp"):
        raise PolicyLoadError(f"unsupported policy architecture {kind!r}")
    try:
        out = sum(int(n) for n in arch["nvec"]) if kind == "categorical_mlp" else int(arch["act_dim"])
        dims = [int(arch["obs_dim"]), *(int(h) for h in arch.get("hidden", (64, 64))), out]
    except (KeyError, TypeError, ValueError) as e:
        raise PolicyLoadError(f"bad policy architecture {arch}: {type(e).__name__}: {e}") from e
    if any(d <= 0 for d in dims):
        raise PolicyLoadError(f"bad policy architecture {arch}: sizes must be positive")
    return kind, dims


def policy_from_arch(arch: dict[str, Any], max_params: int | None = None) -> Policy:
    """Build the module of ``arch``. ``max_params``: refuse (before allocating anything) an
    architecture whose actor layers alone hold more parameters than this -- the weights that
    come with it: an event must not make a reader allocate what its payload cannot fill."""
    kind, dims = _arch_dims(arch)
    need = sum(a * b for a, b in itertools.pairwise(dims))
    if max_params is not None and need > max_params:
        raise PolicyLoadError(f"policy architecture {arch} needs {need} parameters; its weights hold {max_params}")
    try:
        return Policy(
            obs_dim=dims[0],
            act_dim=int(arch["act_dim"]),
            hidden=tuple(dims[1:-1]),
            activation=str(arch.get("activation", "tanh")),
            normalize_obs=bool(arch.get("normalize_obs", True)),
            obs_clip=arch.get("obs_clip", 10.0),
            nvec=arch.get("nvec") if kind == "categorical_mlp" else None,
        )
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise PolicyLoadError(f"bad policy architecture {arch}: {e}") from e


# -- the blob store (claim checks) ------------------------------------------------------------------

class BlobStore(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes | bytearray: ...


#: Where claim-checked weights come from: a BlobStore, or a function of the claim check.
Blobs = Union[BlobStore, Callable[[ClaimCheck], bytes], None]


@dataclass(frozen=True)
class FetchRetry:
    """How a blob-store call that fails (timeout, dropped connection, store restarting) is
    retried: ``attempts`` tries in all, ``base_s`` doubled after each failure (at most ``cap_s``)
    between them. A ``CodecError`` (the key is gone) is final at once."""

    attempts: int = 4
    base_s: float = 0.1
    cap_s: float = 2.0

    def call(self, fn: Callable[[], Any], what: str, error: type[Exception] = PolicyLoadError) -> Any:
        """``fn()``, retried; ``error`` (PolicyLoadError: a read) naming ``what`` once every
        attempt failed."""
        for attempt in range(self.attempts):
            try:
                return fn()
            except CodecError:
                raise
            except Exception as e:  # the store is down, slow, or restarting
                if attempt + 1 >= self.attempts:
                    raise error(f"{what} failed {self.attempts} times; last: {type(e).__name__}: {e}") from e
                time.sleep(min(self.cap_s, self.base_s * 2 ** attempt))
        raise error(f"{what}: no attempt made (attempts={self.attempts})")


#: The retry of blob-store calls unless told otherwise.
DEFAULT_RETRY = FetchRetry()


def _resp(*args: str | bytes) -> bytes:
    """One Redis command in RESP."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out += [b"$%d\r\n" % len(a), a, b"\r\n"]
    return b"".join(out)


class _RespReader:
    """Replies off one socket: status lines, and a bulk string read straight into one buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, bytearray()

    def line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("redis closed the connection")
            self.buf += chunk
        line, self.buf = bytes(self.buf[:i]), self.buf[i + 2:]
        if line[:1] == b"-":
            raise ConnectionError(f"redis: {line[1:].decode(errors='replace')}")
        return line

    #: Bytes per part when a bulk string is streamed.
    CHUNK = 1 << 20

    def bulk(self) -> np.ndarray | None:
        """The bulk string (None: nil), received straight into one new buffer."""
        n = self._bulk_len()
        if n < 0:
            return None
        out = new_buffer(n + 2)  # the value and its CRLF
        view = memoryview(out)
        got = min(len(self.buf), n + 2)
        view[:got] = self.buf[:got]
        while got < n + 2:
            got += self._recv_into(view[got:])
        return out[:n]

    def stream(self, on_chunk: Callable[[memoryview], None]) -> int:
        """Hand the bulk string to ``on_chunk`` in parts of at most ``CHUNK`` bytes, in order,
        through one reused buffer; its length (-1: nil)."""
        n = self._bulk_len()
        if n < 0:
            return n
        scratch = memoryview(bytearray(self.CHUNK))
        head = min(len(self.buf), n)  # what came with the reply's first line
        with memoryview(self.buf) as buf:
            for i in range(0, head, self.CHUNK):
                on_chunk(buf[i:min(i + self.CHUNK, head)])
        got, self.buf = head, self.buf[head:]
        while got < n:
            r = self._recv_into(scratch[:min(self.CHUNK, n - got)])
            on_chunk(scratch[:r])
            got += r
        return n  # its CRLF is left unread: the connection serves one read

    def _bulk_len(self) -> int:
        head = self.line()
        if head[:1] != b"$":
            raise ConnectionError(f"redis: unexpected reply {head[:40]!r}")
        return int(head[1:])

    def _recv_into(self, view: memoryview) -> int:
        r = self.sock.recv_into(view)
        if not r:
            raise ConnectionError("redis closed the connection")
        return r


@dataclass
class RedisBlobStore:
    """Claim-check store on Redis. One call waits up to ``timeout_s``; a failed one is retried by
    the caller's ``FetchRetry`` (the loader's for reads, ``retry`` here for writes), so the
    retries are counted in one place. A read goes straight from the socket into one buffer the
    loader decodes in place (redis-py's parser copies a reply of tens of MB several times)."""

    url: str
    timeout_s: float = 30.0
    retry: FetchRetry = DEFAULT_RETRY

    def __post_init__(self) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.connection import parse_url
        from redis.retry import Retry

        self._r = redis.Redis.from_url(self.url, socket_timeout=self.timeout_s, socket_connect_timeout=10.0,
                                       retry=Retry(NoBackoff(), 0))  # FetchRetry is the one retry
        self._at = parse_url(self.url)

    def put(self, key: str, data: bytes) -> None:
        self.retry.call(lambda: self._r.set(key, data), f"writing claim-check key {key} to {self.url}",
                        error=BlobWriteError)

    def get(self, key: str) -> np.ndarray | bytearray:
        """The value of ``key``, a writable buffer (decoded in place)."""
        at = self._at
        data = self._r.get(key) if "connection_class" in at else self._read(key, at, lambda r: r.bulk())
        if data is None:
            raise PolicyLoadError(f"claim-check key {key} not found in {self.url}")
        return data if isinstance(data, (bytearray, np.ndarray)) else bytearray(data)

    def stream(self, key: str, on_chunk: Callable[[memoryview], None]) -> None:
        """Hand the value of ``key`` to ``on_chunk`` in parts as it arrives (whole over redis-py:
        TLS, unix sockets)."""
        if "connection_class" in self._at:
            on_chunk(memoryview(self.get(key)))
        elif self._read(key, self._at, lambda r: r.stream(on_chunk)) < 0:
            raise PolicyLoadError(f"claim-check key {key} not found in {self.url}")

    def _read(self, key: str, at: dict, take: Callable[[_RespReader], Any]) -> Any:
        pre = []
        if at.get("password"):
            pre.append(("AUTH", *([at["username"]] if at.get("username") else []), at["password"]))
        if at.get("db"):
            pre.append(("SELECT", at["db"]))
        with socket.create_connection((at.get("host", "localhost"), at.get("port", 6379)), timeout=self.timeout_s) as s:
            s.sendall(b"".join(_resp(*c) for c in (*pre, ("GET", key))))
            reader = _RespReader(s)
            for _ in pre:
                reader.line()
            return take(reader)


@dataclass
class HostCachedStore:
    """``store`` with one verified copy of each blob per host (``streams.blobcache``): a reader
    fetches a claim check from the store only when no process on its host has yet, and a
    publisher leaves a copy of what it writes there."""

    store: RedisBlobStore
    cache: HostBlobCache

    @property
    def url(self) -> str:
        return self.store.url

    def put(self, key: str, data: bytes) -> None:
        self.store.put(key, data)

    def get(self, key: str) -> np.ndarray | bytearray:
        return self.store.get(key)

    def fetch_verified(self, ref: ClaimCheck) -> mmap.mmap | np.ndarray | bytearray:
        """The bytes of ``ref``, checked against its size and sha256 (PolicyLoadError if not): the
        host's copy, mapped; fetched alone where the cache cannot take it."""
        try:
            return self.cache.get(ref.sha256, ref.size, lambda on_chunk: self.store.stream(ref.key, on_chunk))
        except BlobCacheError as e:
            raise PolicyLoadError(f"claim-checked weights {ref.key}: {e}") from e
        except CacheWriteError:
            return _checked(self.store.get(ref.key), ref, f"claim-checked weights {ref.key}")


def open_blob_store(url: str | None, cache_dir: str | None = None) -> RedisBlobStore | HostCachedStore | None:
    """The claim-check store at ``url`` (None: none), behind the host cache at ``cache_dir``
    (None: no host cache; see ``streams.blobcache.default_cache_dir``)."""
    if not url:
        return None
    store = RedisBlobStore(url)
    if not cache_dir:
        return store
    try:
        return HostCachedStore(store, HostBlobCache(cache_dir))
    except OSError as e:  # not creatable, not ours: every process fetches for itself
        log.warning("no host blob cache at %s (%s): each process fetches claim-checked weights itself", cache_dir, e)
        return store


def blob_store_from_env(env: Any = None) -> RedisBlobStore | HostCachedStore | None:
    """The Redis claim-check store ``REDIS_URL`` names (None when unset) behind the host cache
    ``RLSTREAM_BLOB_CACHE`` names: for processes, such as the Faust worker, that get their
    settings from the environment."""
    env = os.environ if env is None else env
    return open_blob_store(env.get(ENV_REDIS_URL, "").strip(), default_cache_dir(env))


# -- publishing ----------------------------------------------------------------------------------

def make_policy_version(
    policy: Policy, *, policy_id: str, version: int, parent_version: int | None, learner_id: str,
    algo: str, metrics: dict[str, float] | None = None, blob_store: BlobStore | None = None,
    inline_limit: int = DEFAULT_INLINE_LIMIT, claim_check_above: int = DEFAULT_CLAIM_CHECK_ABOVE,
) -> PolicyVersion:
    """The event of ``policy``'s weights: inline, or by claim check when they are over
    ``claim_check_above`` and ``blob_store`` is given (they must be over ``inline_limit``)."""
    data = encode_weights(policy.state_dict(), arch_of(policy))
    weights, ref = data, None
    if len(data) > inline_limit or (blob_store is not None and len(data) > claim_check_above):
        if blob_store is None:
            raise ValueError(
                f"weights of {len(data)} bytes exceed the inline limit {inline_limit}; configure a blob store"
            )
        digest = sha256(data)
        key = f"rlstream:weights:{policy_id}:{version}:{digest[:16]}"  # a republished version never clobbers
        blob_store.put(key, data)
        if isinstance(blob_store, HostCachedStore):  # readers on this host need not fetch it
            blob_store.cache.put(digest, data)
        weights, ref = None, ClaimCheck(store=blob_store.url, key=key, sha256=digest, size=len(data))
    return PolicyVersion(
        policy_id=policy_id, version=version, created_at_ms=now_ms(), learner_id=learner_id, algo=algo,
        weights=weights, weights_ref=ref, parent_version=parent_version, metrics=dict(metrics or {}),
    )


def publish_policy_version(events: Any, pv: PolicyVersion) -> None:
    """Put ``pv`` on rl.policy.versions (key: policy_id) with the publish-time header, and flush."""
    events.bus.produce(
        POLICY_VERSIONS, events.codec.encode(pv), key=pv.policy_id.encode(),
        headers={**events.codec.headers_for(pv), PUBLISHED_NS_HEADER: str(time.time_ns()).encode()},
    )
    events.flush()


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
    return _checked(data, ref, f"claim-checked weights of version {pv.version}")


def _checked(data: Any, ref: ClaimCheck, what: str) -> Any:
    """``data`` if it is the claim check's bytes (its size and sha256); PolicyLoadError naming
    ``what`` if not."""
    if len(data) != ref.size or sha256(data) != ref.sha256:
        raise PolicyLoadError(f"{what} fail their size or sha256")
    return data


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
        into = policy_from_arch(arch, max_params=sum(t.numel() for t in state.values()))
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


# -- reading the topic back from its end --------------------------------------------------------------

def _read_range(bus: Any, topic: str, partition: int, start: int, stop: int, ends: dict[int, int],
                timeout: float) -> list[Record]:
    """Records of ``topic[partition]`` with ``start <= offset < stop`` (ephemeral reader)."""
    offsets = {(topic, p): (start if p == partition else e) for p, e in ends.items()}
    c = bus.consumer(None, [topic], start=offsets)
    out: list[Record] = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recs = c.poll(0.2, max_records=1000)
            done = False
            for r in recs:
                if r.partition != partition:
                    continue
                if r.offset >= stop:
                    done = True
                    break
                if r.offset >= start:
                    out.append(r)
                if r.offset >= stop - 1:
                    done = True
            if done:
                break
            if recs:
                deadline = time.monotonic() + timeout
    finally:
        c.close()
    return out


def tail_offsets(bus: Any, topic: str, matches: Callable[[Record], bool], timeout: float = 10.0,
                 count: int = 1) -> dict[tuple[str, int], int]:
    """Per partition, the offset of the ``count``-th newest record for which ``matches`` holds
    (the oldest match where fewer do; the log end where none does). Reads back from the end in
    growing windows (count, 4 count, ...), so it costs a few records, not a replay of the topic."""
    ends = bus.end_offsets(topic)
    out: dict[tuple[str, int], int] = {}
    for p, end in ends.items():
        hits: list[int] = []
        stop, window = end, max(1, count)
        while stop > 0 and len(hits) < count:
            start = max(0, stop - window)
            recs = _read_range(bus, topic, p, start, stop, ends, timeout)
            hits.extend(sorted((r.offset for r in recs if matches(r)), reverse=True))
            if start == 0 or not recs:
                break
            stop, window = start, window * 4
        out[(topic, p)] = hits[:count][-1] if hits else end
    return out


def decodes_as(events: EventBus, cls: type, pred: Callable[[Any], bool] | None = None) -> Callable[[Record], bool]:
    """A record predicate: it decodes as ``cls`` and ``pred`` holds of the event."""
    def matches(rec: Record) -> bool:
        try:
            ev = events.codec.decode(rec.value)
        except CodecError:
            return False
        return isinstance(ev, cls) and (pred is None or pred(ev))

    return matches


def newest_version(events: EventBus, policy_id: str = "policy", topic: str = POLICY_VERSIONS,
                   timeout: float = 10.0) -> PolicyVersion | None:
    """The newest PolicyVersion of ``policy_id`` on ``topic`` (None if there is none)."""
    match = decodes_as(events, PolicyVersion, lambda pv: pv.policy_id == policy_id)
    best: PolicyVersion | None = None
    ends = events.bus.end_offsets(topic)
    for (t, p), off in tail_offsets(events.bus, topic, match, timeout).items():
        if off >= ends.get(p, 0):
            continue
        for rec in _read_range(events.bus, t, p, off, off + 1, ends, timeout):
            pv = events.codec.decode(rec.value)
            if best is None or pv.version > best.version:
                best = pv
    return best


# -- one decoded version --------------------------------------------------------------------------

@dataclass(frozen=True)
class PolicyUpdate:
    """One policy version, as a follower hands it back. ``policy`` is loaded on first use."""

    policy_id: str
    version: int
    parent_version: int | None
    created_at_ms: int
    algo: str
    learner_id: str
    metrics: dict[str, float]
    published_ns: int | None
    """When the learner produced it (``rl-published-ns`` header), if it said."""
    partition: int
    offset: int
    event: PolicyVersion = field(repr=False)
    record: Record | None = field(default=None, repr=False, compare=False)
    """The bus record it came from (for a dead letter when its weights do not load)."""
    blob_store: Blobs = field(default=None, repr=False, compare=False)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, rec: Record, pv: PolicyVersion, blob_store: Blobs = None) -> "PolicyUpdate":
        sent = rec.headers.get(PUBLISHED_NS_HEADER)
        try:
            published = int(sent) if sent else None
        except ValueError:
            published = None
        return cls(policy_id=pv.policy_id, version=pv.version, parent_version=pv.parent_version,
                   created_at_ms=pv.created_at_ms, algo=pv.algo, learner_id=pv.learner_id,
                   metrics=dict(pv.metrics), published_ns=published, partition=rec.partition,
                   offset=rec.offset, event=pv, record=rec, blob_store=blob_store)

    @property
    def policy(self) -> Policy:
        """The torch module of this version (loaded once, then cached; eval mode).
        Raises ``PolicyLoadError`` if the weights do not load."""
        if "policy" not in self._cache:
            self._cache["policy"] = load_policy(self.event, self.blob_store)
        return self._cache["policy"]

    def load(self, into: Policy | None = None) -> Policy:
        """Load the weights into ``into`` (rebuilt if None or of another architecture)."""
        return self.policy if into is None else load_policy(self.event, self.blob_store, into)

    @property
    def weights_size(self) -> int:
        pv = self.event
        return len(pv.weights) if pv.weights is not None else (pv.weights_ref.size if pv.weights_ref else 0)

    @property
    def weights_sha256(self) -> str:
        if "sha" not in self._cache:
            pv = self.event
            self._cache["sha"] = sha256(pv.weights) if pv.weights is not None else (
                pv.weights_ref.sha256 if pv.weights_ref else "")
        return self._cache["sha"]

    def latency_s(self, now_ns: int | None = None) -> float | None:
        """Seconds from the learner publishing it to now (None if it did not say when)."""
        if self.published_ns is None:
            return None
        return max(0.0, ((now_ns or time.time_ns()) - self.published_ns) / 1e9)

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (no weights: their size and sha256)."""
        pv = self.event
        weights: dict[str, Any] = {"format": pv.weights_format, "bytes": self.weights_size,
                                   "sha256": self.weights_sha256, "inline": pv.weights is not None}
        if pv.weights_ref is not None:
            weights["claim_check"] = {"store": pv.weights_ref.store, "key": pv.weights_ref.key}
        lat = self.latency_s()
        return {"event": "policy_version", "policy_id": self.policy_id, "version": self.version,
                "parent_version": self.parent_version, "created_at_ms": self.created_at_ms,
                "algo": self.algo, "learner_id": self.learner_id, "metrics": self.metrics,
                "weights": weights, "partition": self.partition, "offset": self.offset,
                "latency_s": None if lat is None else round(lat, 6)}


# -- THE follower -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class StartRule:
    """Where a follower starts (see the module docstring). Build with the class methods."""

    records_back: int = 0
    from_version: int | None = None

    @classmethod
    def newest(cls) -> "StartRule":
        return cls()

    @classmethod
    def back(cls, k: int) -> "StartRule":
        if k < 0:
            raise ValueError(f"k must be >= 0, not {k}")
        return cls(records_back=int(k))

    @classmethod
    def at_version(cls, v: int) -> "StartRule":
        if v < 0:
            raise ValueError(f"from_version must be >= 0, not {v}")
        return cls(from_version=int(v))


class PolicyFollower:
    """Follows PolicyVersion records of ``policy_id`` (None: of every policy) from ``start``.

    ``read(timeout)`` returns ``(record, PolicyUpdate | CodecError)`` pairs in log order;
    ``poll(timeout)`` the updates only. Other policies' records are skipped (``ignored``);
    with ``monotonic`` (default) a version not newer than the last one handed out for its
    policy is skipped too (``skipped``). A record that does not decode is dead-lettered by
    ``events.dead_letters`` under ``stage`` (which only counts it where another role owns the
    topic's dead letters; ``dead_letter=False``: never) and counted in ``undecodable``.
    ``group``: read under this consumer group; its committed offset wins over ``start``.
    """

    def __init__(self, events: EventBus, policy_id: str | None = "policy", start: StartRule = StartRule(), *,
                 blobs: Blobs = None, topic: str = POLICY_VERSIONS, stage: str = "policy-follower",
                 dead_letter: bool = True, monotonic: bool = True, group: str | None = None,
                 join_timeout: float = 30.0) -> None:
        self.events = events
        self.policy_id = policy_id
        self.start = start
        self.blobs = blobs
        self.topic = topic
        self.stage = stage
        self.dead_letter_bad = dead_letter
        self.monotonic = monotonic
        self.group = group
        self.last_version: dict[str, int] = {}
        self.delivered = self.skipped = self.ignored = self.undecodable = 0
        self.last_error: CodecError | None = None
        self._buffer: list[Record] = []
        self.consumer: Consumer = self._open(join_timeout)

    def _mine(self, pv: PolicyVersion) -> bool:
        return self.policy_id is None or pv.policy_id == self.policy_id

    def start_offsets(self) -> dict[tuple[str, int], int]:
        """Per partition, where ``start`` says to begin (newest / back rules)."""
        return tail_offsets(self.events.bus, self.topic, decodes_as(self.events, PolicyVersion, self._mine),
                            count=self.start.records_back + 1)

    def _open(self, join_timeout: float) -> Consumer:
        bus = self.events.bus
        replay = self.start.from_version is not None
        if self.group is None:
            return bus.consumer(None, [self.topic], start="earliest" if replay else self.start_offsets())
        if replay:
            return bus.consumer(self.group, [self.topic], start="earliest")
        # the group's committed offset wins; a partition without one starts as ``start`` says,
        # which is known once the group assigned its partitions
        c = bus.consumer(self.group, [self.topic], start="latest")
        deadline = time.monotonic() + join_timeout
        while not c.assignment():
            if time.monotonic() > deadline:
                c.close()
                raise TimeoutError(f"consumer group {self.group} got no partition of {self.topic} "
                                   f"within {join_timeout:.0f}s")
            self._buffer.extend(c.poll(0.1, max_records=1000))
        committed = c.committed()
        fresh = [tp for tp in c.assignment() if tp not in committed]
        if fresh:
            starts = self.start_offsets()
            for tp in fresh:
                c.seek(tp[0], tp[1], starts[tp])
            self._buffer = [r for r in self._buffer if (r.topic, r.partition) not in fresh]
        return c

    def read(self, timeout: float = 0.0, max_records: int = 1000) -> list[tuple[Record, PolicyUpdate | CodecError]]:
        """Decoded updates and decode failures that arrived within ``timeout`` s, in log order."""
        recs, self._buffer = self._buffer, []
        if not recs:
            recs = self.consumer.poll(timeout, max_records=max_records)
        out: list[tuple[Record, PolicyUpdate | CodecError]] = []
        for rec in recs:
            try:
                pv = self.events.codec.decode_valid(rec.value, PolicyVersion, rec.topic)
            except CodecError as e:
                self.undecodable += 1
                self.last_error = e
                if self.dead_letter_bad:
                    self.events.dead_letters.send(rec, e.reason, e, self.stage)
                out.append((rec, e))
                continue
            if not self._mine(pv):
                self.ignored += 1
                continue
            if self.start.from_version is not None and pv.version < self.start.from_version:
                continue
            if self.monotonic and pv.version <= self.last_version.get(pv.policy_id, -1):
                self.skipped += 1
                continue
            self.last_version[pv.policy_id] = max(pv.version, self.last_version.get(pv.policy_id, -1))
            out.append((rec, PolicyUpdate.of(rec, pv, self.blobs)))
        return out

    def poll(self, timeout: float = 0.0) -> list[PolicyUpdate]:
        """Updates that arrived within ``timeout`` s (possibly none), oldest first."""
        ups = [x for _, x in self.read(timeout) if isinstance(x, PolicyUpdate)]
        self.delivered += len(ups)
        return ups

    def dead_letter(self, update: PolicyUpdate, error: CodecError) -> bool:
        """Dead-letter the record of a version whose weights do not load (or count it, where
        another role owns the topic's dead letters)."""
        if update.record is None:
            return False
        return self.events.dead_letters.send(update.record, error.reason, error, self.stage)

    def close(self) -> None:
        self.consumer.close()


# -- the window of recent versions -----------------------------------------------------------------

LogpFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


class PolicyWindow:
    """The last ``size`` versions of one policy with their records and log-prob functions
    (built on first use by ``logp_factory``, default: ``PolicyLogpFn`` over ``load_policy``
    with ``blobs``, so claim-checked weights get importance weights too).

        window = PolicyWindow("policy", size=16, blobs=store)
        window.add(pv, record)                  # True if it is the newest version so far
        version, logp = window.newest_logp()    # the newest that loads (None if none does)
        for version, error, record in window.take_failures():
            ...                                 # dead-letter (or count) each record
    """

    def __init__(self, policy_id: str | None, size: int = 16, *, blobs: Blobs = None,
                 logp_factory: Callable[[PolicyVersion], LogpFn] | None = None) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, not {size}")
        self.policy_id = policy_id
        self.size = size
        self.logp_factory = logp_factory or PolicyLogpFn.factory(blobs)
        self._pvs: OrderedDict[int, tuple[PolicyVersion, Record | None]] = OrderedDict()
        self._fns: dict[int, LogpFn] = {}
        self._failed: dict[int, BaseException] = {}
        self._failures: list[tuple[int, BaseException, Record | None]] = []

    def add(self, pv: PolicyVersion, record: Record | None = None) -> bool:
        """Keep ``pv`` (another policy's, or a version held already, is ignored); True if it is
        the newest version in the window."""
        if (self.policy_id is not None and pv.policy_id != self.policy_id) or pv.version in self._pvs:
            return False
        self._pvs[pv.version] = (pv, record)
        self._pvs = OrderedDict(sorted(self._pvs.items()))
        while len(self._pvs) > self.size:
            old, _ = self._pvs.popitem(last=False)
            self._fns.pop(old, None)
            self._failed.pop(old, None)
        return pv.version == self.newest

    @property
    def newest(self) -> int | None:
        return next(reversed(self._pvs)) if self._pvs else None

    def versions(self) -> list[int]:
        return list(self._pvs)

    def __contains__(self, version: int) -> bool:
        return version in self._pvs

    def __len__(self) -> int:
        return len(self._pvs)

    def record(self, version: int) -> Record | None:
        item = self._pvs.get(version)
        return None if item is None else item[1]

    def logp(self, version: int) -> LogpFn:
        """The log-prob function of ``version`` (KeyError if not held; its load error if it
        does not load, which is also queued once for ``take_failures``)."""
        if version in self._fns:
            return self._fns[version]
        if version in self._failed:
            raise self._failed[version]
        pv, rec = self._pvs[version]
        try:
            fn = self._fns[version] = self.logp_factory(pv)
        except Exception as e:
            self._failed[version] = e
            self._failures.append((version, e, rec))
            raise
        return fn

    def newest_logp(self) -> tuple[int, LogpFn] | None:
        """``(version, logp)`` of the newest version whose weights load, or None."""
        for version in reversed(self._pvs):
            try:
                return version, self.logp(version)
            except Exception:
                continue
        return None

    def take_failures(self) -> list[tuple[int, BaseException, Record | None]]:
        """Versions whose weights did not load since the last call, with their records."""
        out, self._failures = self._failures, []
        return out
