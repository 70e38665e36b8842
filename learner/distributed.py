"""Data-parallel learner ranks over ``torch.distributed`` (gloo on CPU, nccl on CUDA).

    group = DataParallel.from_env(algo, Environment.read().rank())   # RANK, WORLD_SIZE, MASTER_ADDR/PORT
    learner = Learner(config, algo, events, snapshots=store, parallel=group)   # alone: SingleRank

The agents stay pure torch and unaware of ranks: ``GradSync`` hooks the policy's parameters and,
once per backward pass, all-reduces every gradient in one flat buffer before the algorithm clips
and steps (so clipping sees the global gradient), through torch's DDP communication hooks
(``allreduce`` or the ``fp16``/``bf16`` compress hooks).

Batch agreement (docs/explanation/learner-ranks.md): every poll of every rank is one collective round, an
all-gather of (transitions buffered, paused, stop requested). An update starts on all ranks at
once when the ranks together hold ``train_batch_size`` transitions; each rank trains exactly what
it holds (possibly nothing: its partitions were quiet), and gradients are weighted by each rank's
share of the global batch, so the result is that of one learner on the union of the fragments.
"""

from __future__ import annotations

import datetime
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from config.env import RankEnv
from learner.ranks import Agreement
from streams.bus.base import EXIT_FENCED

COMPRESSION = ("none", "fp16", "bf16")
#: Seconds a collective waits for a peer before the rank gives up (a peer that died).
DEFAULT_TIMEOUT_S = 60.0
#: Exit code of a rank whose peer is gone: the group stopped without a snapshot.
EXIT_PEER_LOST = 3


class PeerLost(RuntimeError):
    """A collective failed: another rank died or stopped answering. Nothing is committed or
    snapshotted after it; a restart resumes the group from its last snapshot."""


def parse_devices(spec: str, learners: int | None) -> list[str]:
    """``cpu``, ``cuda``, ``cuda:1`` or ``cuda:0,1,2,3`` -> one device per rank.

    A list gives one rank per device (``learners`` must match or be None); a single device is
    shared by every rank (CPU only: nccl refuses two ranks on one GPU); ``cuda`` alone is
    ``cuda:0..N-1``."""
    spec = spec.strip()
    if spec.startswith("cuda:") and "," in spec:
        devs = [f"cuda:{i.strip()}" for i in spec[5:].split(",") if i.strip()]
    elif spec == "cuda":
        devs = [f"cuda:{i}" for i in range(learners or 1)]
    else:
        devs = [spec]
    n = learners or len(devs)
    if n < 1:
        raise ValueError(f"--learner.learners must be at least 1, not {n}")
    if len(devs) == 1:
        if devs[0].startswith("cuda") and n > 1:
            raise ValueError(f"{n} learner ranks on the one device {devs[0]}: nccl needs one GPU per rank; "
                             f"list them, e.g. --learner.device cuda:{','.join(map(str, range(n)))}")
        return devs * n
    if len(devs) != n:
        raise ValueError(f"--learner.device lists {len(devs)} devices but --learner.learners is {n}")
    return devs


def missing_devices(devices: list[str], cuda_count: int | None = None) -> list[str]:
    """The CUDA devices of ``devices`` (``parse_devices``) this machine does not have
    (``cuda_count``: how many it has; None: ask torch)."""
    cuda = [d for d in devices if d.startswith("cuda")]
    if not cuda:
        return []
    have = torch.cuda.device_count() if cuda_count is None else cuda_count
    index = [d.partition(":")[2] or "0" for d in cuda]
    bad = [d for d, i in zip(cuda, index) if not i.isdigit()]
    if bad:
        raise ValueError(f"--learner.device: {', '.join(bad)} is not a device (cpu, cuda, cuda:N or cuda:0,1,...)")
    return [d for d, i in zip(cuda, index) if int(i) >= have]


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"




class GradSync:
    """All-reduce the gradients of ``params`` once per backward pass, weighted by ``weight``
    (this rank's share of the global batch), with a DDP communication hook.

    The flat buffer ends with one flag (1: this rank is inside its update). A rank that has
    finished its update while others still step keeps answering with zeros (``finish``), as
    DDP's ``Join`` does, and the update is marked ``uneven``: rank 0's state is then broadcast."""

    def __init__(self, params: Iterable[torch.nn.Parameter], compression: str = "none",
                 group: Any = None) -> None:
        if compression not in COMPRESSION:
            raise ValueError(f"grad compression must be one of {COMPRESSION}, not {compression!r}")
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world = dist.get_world_size(group)
        self.hook = {"none": None, "fp16": default_hooks.fp16_compress_hook,
                     "bf16": default_hooks.bf16_compress_hook}[compression]
        self.weight = 1.0 / self.world
        self.reductions = 0
        self.uneven = False
        self._queued = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _p: torch.Tensor) -> None:
        if not self._queued:  # once per backward, after every gradient is accumulated
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._queued = False
        active = self._reduce(active=True)
        if active < self.world:
            self.uneven = True

    def _reduce(self, active: bool) -> int:
        """One collective; returns how many ranks were inside their update."""
        p0 = self.params[0]
        scale = self.world * self.weight if active else 0.0
        parts = [(p.grad * scale if (active and p.grad is not None) else torch.zeros_like(p)).reshape(-1)
                 for p in self.params]
        flag = torch.full((1,), 1.0 if active else 0.0, dtype=p0.dtype, device=p0.device)
        flat = torch.cat(parts + [flag])  # every hook averages: the result is sum(weight_r * grad_r)
        try:
            if self.hook is None:
                dist.all_reduce(flat, group=self.group)
                flat /= self.world
            else:
                flat = self.hook(self.group, (flat,)).wait()
        except Exception as e:  # gloo/nccl: the peer closed its connection or timed out
            raise PeerLost(f"gradient all-reduce failed: {e}") from e
        self.reductions += 1
        if active:
            offset = 0
            for p in self.params:
                n = p.numel()
                g = flat[offset:offset + n].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                offset += n
        return int(round(float(flat[-1]) * self.world))

    def finish(self) -> None:
        """After this rank's update: answer the others' reductions until none is left."""
        while self._reduce(active=False) > 0:
            self.uneven = True


class DataParallel:
    """The collective side of a learner rank: batch agreement, gradient sync, gathering what
    rank 0 publishes, and the start-up settling of the consumer group (``learner.ranks.Ranks``;
    a learner alone has ``SingleRank``)."""

    follows_foreign_versions = False  # stop the group, roll back, restart it (docs/explanation/learner-ranks.md)

    def __init__(self, algo: Any, rank: int, world: int, compression: str = "none",
                 stop: Callable[[], bool] | None = None, group: Any = None) -> None:
        self.algo, self.rank, self.world, self.group = algo, rank, world, group
        self.sync = GradSync(algo.policy.parameters(), compression, group)
        self.stop_requested = stop or (lambda: False)
        self.stopping = False
        self.broken = False
        self.uneven_updates = 0
        self.device = next(algo.policy.parameters()).device

    @classmethod
    def from_env(cls, algo: Any, env: RankEnv, compression: str = "none", stop: Callable[[], bool] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> "DataParallel":
        """Rank ``env`` of the group (torchrun's variables, ``config.Environment.rank()``)."""
        device = str(next(algo.policy.parameters()).device)
        init_group(env, backend_for(device), timeout_s)
        return cls(algo, env.rank, env.world_size, compression, stop)

    @property
    def publisher(self) -> bool:
        return self.rank == 0

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except PeerLost:
            self.broken = True
            raise
        except Exception as e:  # a collective with a dead peer: connection reset, timeout
            self.broken = True
            raise PeerLost(f"{what} failed: {e}") from e

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (a small pickled control message, never topic data)."""
        out: list[Any] = [None] * self.world

        def run() -> list[Any]:
            dist.all_gather_object(out, obj, group=self.group)
            return out
        return self._guard("all-gather", run)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        box = [obj]

        def run() -> Any:
            dist.broadcast_object_list(box, src=src, group=self.group)
            return box[0]
        return self._guard("broadcast", run)

    def agree(self, pending: int, paused: bool, train_batch_size: int) -> Agreement:
        """One collective round per poll; see the module docstring."""
        t = torch.tensor([pending, int(paused), int(self.stop_requested())], dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            t = t.to(self.device)
        parts = [torch.zeros_like(t) for _ in range(self.world)]
        self._guard("batch agreement", lambda: dist.all_gather(parts, t, group=self.group))
        rows = torch.stack(parts).cpu()
        stop = bool(rows[:, 2].any())
        self.stopping = self.stopping or stop
        train = not stop and not bool(rows[:, 1].any()) and int(rows[:, 0].sum()) >= max(1, train_batch_size)
        return Agreement(train, stop)

    def update(self, batch: Any, n_local: int) -> dict[str, float]:
        """``algo.update`` on this rank's share (``batch`` is None when it holds nothing), gradients
        weighted by ``n_local`` over the global count; identical state on every rank afterwards."""
        totals = getattr(self.algo, "weight_totals", None)  # AGRO/TBA: the step's lr follows the mean weight
        mine = totals(batch) if totals is not None and batch is not None and n_local else None
        shares = self.gather((n_local, mine))
        counts = [n for n, _ in shares]
        src = max(range(self.world), key=lambda r: (counts[r], -r))  # the rank that trained most
        self.sync.weight = n_local / max(1, sum(counts))
        self.sync.uneven = False
        weighted = [t for _, t in shares if t is not None]
        if weighted:  # every rank steps with the group's mean weight, as one learner on the union
            total, count = sum(t[0] for t in weighted), sum(t[1] for t in weighted)
            self.algo.group_weight_mean = total / count if count > 0 else 0.0
        try:
            metrics = self.algo.update(batch) if n_local else {}
            self.sync.finish()
        except PeerLost:
            self.broken = True
            raise
        finally:
            if weighted:
                self.algo.group_weight_mean = None
        if self.sync.uneven:  # different numbers of optimizer steps: the state of rank src wins
            self.uneven_updates += 1
            state, metrics = self.broadcast((self.algo.state_dict(), metrics) if self.rank == src else None, src)
            if self.rank != src:
                self.algo.load_state_dict(state)
        self._broadcast_buffers(src)
        return metrics

    def _broadcast_buffers(self, src: int) -> None:
        """Running statistics (observation normaliser) follow rank ``src``'s, as DDP's broadcast_buffers."""
        def run() -> None:
            for b in self.algo.policy.buffers():
                dist.broadcast(b, src=src, group=self.group)
        self._guard("buffer broadcast", run)

    def settle(self, consumer: Any, topic: str, partitions: Callable[[], int], explicit: dict | None) -> None:
        """Start-up: poll until the group's assignment covers ``partitions()`` with a non-empty,
        disjoint share per rank, then seek each owned partition back to where it starts
        (``explicit`` snapshot offsets > the group's commit > the log start): records fetched
        while members were still joining are not kept, so none is trained by two ranks."""
        partitions = partitions()
        if partitions < self.world:
            raise ValueError(f"{topic} has {partitions} partition(s) for {self.world} learner ranks; "
                             f"create it with at least {self.world} (--partitions)")
        while True:
            consumer.poll(0.2, max_records=500)  # joins the group; what it returns is dropped
            mine = sorted(p for t, p in consumer.raw.assignment() if t == topic)
            shares = self.gather(mine)
            seen = [p for s in shares for p in s]
            if all(shares) and len(seen) == len(set(seen)) == partitions:
                break
        committed = consumer.raw.committed()
        starts = {}
        for p in mine:
            tp = (topic, p)
            off = (explicit or {}).get(tp, committed.get(tp, 0))
            consumer.raw.seek(topic, p, off)
            starts[tp] = off
        consumer.ledger.clear()  # what was polled while joining is read again from here
        for tp, off in starts.items():
            consumer.ledger.start(tp, off)
        self.gather(None)  # every rank has settled before anyone trains


def init_group(env: RankEnv, backend: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    if dist.is_initialized():
        return
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank % max(1, torch.cuda.device_count()))
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def close_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group with a dead peer may not close cleanly; the process ends anyway
            pass


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(argv: list[str], world: int, env: dict[str, str], grace_s: float = 30.0) -> int:
    """Start ``world`` copies of ``argv`` as ranks (torchrun's variables) with environment ``env``
    (``config.Environment.child()``) and wait for them. When one exits non-zero the others are
    told to stop (SIGTERM, then SIGKILL after ``grace_s``); the first non-zero exit code is returned,
    but ``EXIT_FENCED`` where any rank was fenced (its peers, which lost it, exit ``EXIT_PEER_LOST``
    first): a newer learner took over, and the caller must not start the ranks again."""
    base = dict(env)
    base.setdefault("MASTER_ADDR", "127.0.0.1")
    base.setdefault("MASTER_PORT", str(free_port()))
    procs = []
    for r in range(world):
        e = {**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world)}
        procs.append(subprocess.Popen([sys.executable, *argv], env=e))
    first_bad = 0
    stopped_at = None

    def forward(signum, _frame) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(p.poll() is None for p in procs):
            for p in procs:
                code = p.poll()
                if code not in (None, 0) and not first_bad:
                    first_bad = code
                    stopped_at = time.monotonic()
                    forward(signal.SIGTERM, None)
            if stopped_at is not None and time.monotonic() - stopped_at > grace_s:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if any(p.returncode == EXIT_FENCED for p in procs):
        return EXIT_FENCED
    return first_bad or next((p.returncode for p in procs if p.returncode), 0)
