"""``rlstream verify``: retrain a run from its recorded PreparedBatch stream and check every
PolicyVersion it produces against the recorded one, bit for bit.

The replay starts from the recorded initial state: the algorithm rebuilt from the first
version's provenance (its full config and seed), or, for a fork or a resumed run, the snapshot
of that version; either must match the recorded ``state_sha256`` before anything is trained.
Then, per GradientStep in log order, it trains on the step's ``batch_ids`` in that order and
compares the weights (and the whole state) with the recorded version. The first version that
differs is reported with the cause the log shows: a missing record, a record that is not the
one the learner trained on (``batch_digests``), a broken batch order (a step that does not
start where the previous one ended), or -- inputs and starting state identical -- a
non-deterministic kernel, with the largest weight difference.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agents.core import Algorithm
from learner.batching import StreamIds, to_trajectory_batch
from learner.provenance import determinism, digest, record_digest
from streams.policies import Blobs, weights_bytes
from logtools.timetravel.record import Recorded
from schemas.errors import CodecError
from schemas.events import GradientStep, PolicyVersion
from schemas.weights import decode_weights

# why a version diverged
MISSING = "missing record"
ALTERED = "record altered"
ORDER = "batch order"
KERNEL = "non-deterministic kernel"
INITIAL = "initial state"


@dataclass
class Divergence:
    version: int
    reason: str
    detail: str
    max_abs_diff: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "reason": self.reason, "detail": self.detail,
                "max_abs_diff": self.max_abs_diff}


@dataclass
class VerifyReport:
    run_id: str
    source: str
    initial_version: int
    checked: list[int] = field(default_factory=list)  # versions reproduced bit for bit
    divergence: Divergence | None = None
    exact_possible: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "run_id": self.run_id, "source": self.source,
                "initial_version": self.initial_version, "versions_reproduced": len(self.checked),
                "last_reproduced": self.checked[-1] if self.checked else None,
                "first_divergent": None if self.divergence is None else self.divergence.as_dict(),
                "exact_reproduction_possible": self.exact_possible, "notes": self.notes}


class ReplayError(RuntimeError):
    """The run cannot be replayed from its log (a v1 log, no snapshot for a fork's start)."""


def build_from_provenance(prov: dict[str, Any], overrides: dict[str, Any] | None = None,
                          device: str = "cpu") -> Algorithm:
    """The algorithm a version's provenance describes, freshly initialised (its seed)."""
    from agents.registry import make_algorithm

    if not prov.get("algo") or "config" not in prov:
        raise ReplayError("the run's versions record no provenance (written before PolicyVersion v2); "
                          "it cannot be replayed")
    config = {**prov["config"], **(overrides or {})}
    return make_algorithm(prov["algo"], prov["obs_dim"], prov["act_dim"], config, device)


def recorded_weights(pv: PolicyVersion, blobs: Blobs = None) -> dict[str, torch.Tensor]:
    state, _ = decode_weights(weights_bytes(pv, blobs))
    return state


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    diffs = [float((a[k].double() - b[k].double()).abs().max()) for k in a if k in b and a[k].numel()]
    return max(diffs, default=float("inf"))


def environment_differences(recorded: dict[str, Any]) -> list[str]:
    """Determinism settings of the recording that this process does not share."""
    now = determinism(recorded.get("device", "cpu"))
    out = [f"{k}: recorded {recorded[k]!r}, now {now[k]!r}" for k in ("algorithm_code", "torch", "threads")
           if k in recorded and recorded[k] != now[k]]
    if "algorithm_code" not in recorded:  # recorded before the digest: the code cannot be ruled out
        out.insert(0, f"algorithm_code: not recorded (the run predates the digest), now {now['algorithm_code']!r}: "
                      "the update's code may have changed since")
    return out


@contextlib.contextmanager
def recorded_threads(recorded: dict[str, Any]):
    """Run with the recording's intra-op thread count (a CPU reduction may split by it)."""
    before = torch.get_num_threads()
    n = recorded.get("threads")
    if n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Replay:
    """The learner's state, rebuilt from the log, advanced one recorded GradientStep at a time."""

    def __init__(self, run: Recorded, snapshots: str | Path | None = None, device: str = "cpu",
                 blobs: Blobs = None) -> None:
        self.run, self.blobs = run, blobs
        self.version = run.first_version
        self.prov = run.provenance(self.version)
        with recorded_threads(self.prov.get("determinism", {})):  # init kernels (QR) split by threads too
            self.algo = self._initial(snapshots, device)
        self.stream_ids = StreamIds()

    def _initial(self, snapshots: str | Path | None, device: str) -> Algorithm:
        algo = build_from_provenance(self.prov, device=device)
        pv = self.run.versions[self.version][1]
        if pv.parent_version is not None or self.prov.get("fork_of"):
            # a fork or a resumed run: its first version is a snapshot's state, not a fresh init
            from learner.snapshots.url import open_store

            store = open_store(snapshots, keep_last=None) if snapshots else None
            # a fork's first version is V itself; a resumed run's republishes its parent's snapshot
            wanted = [self.version] if self.prov.get("fork_of") else [self.version, pv.parent_version]
            have = [v for v in wanted if store is not None and v in store.versions()]
            state = store.load_state(have[0]) if have else None
            if state is None:
                raise ReplayError(f"version {self.version} starts from a snapshot "
                                  f"(parent {pv.parent_version}, fork_of {self.prov.get('fork_of')}); "
                                  f"no snapshot {self.version} in {snapshots}")
            algo.load_state_dict(state)
        return algo

    def check_initial(self) -> Divergence | None:
        pv = self.run.versions[self.version][1]
        return self.compare(pv, None)

    def compare(self, pv: PolicyVersion, altered: str | None) -> Divergence | None:
        """None if the replayed state is the recorded version's, else why not."""
        mine = self.algo.policy.state_dict()
        try:
            theirs = recorded_weights(pv, self.blobs)
        except CodecError as e:
            return Divergence(pv.version, MISSING, f"recorded weights unreadable: {e}")
        same_weights = digest(mine) == digest(theirs)
        same_state = pv.state_sha256 is None or digest(self.algo.state_dict()) == pv.state_sha256
        if same_weights and same_state:
            return None
        diff = 0.0 if same_weights else max_abs_diff(mine, theirs)
        what = "weights" if not same_weights else "optimiser/normaliser/RNG state (weights equal)"
        if altered:
            return Divergence(pv.version, ALTERED, f"{what} differ: {altered}", diff)
        if pv.version == self.run.first_version:
            env = environment_differences(self.prov.get("determinism", {}))
            return Divergence(pv.version, INITIAL, f"{what} of the rebuilt initial state differ"
                              + (f" ({'; '.join(env)})" if env else ""), diff)
        env = environment_differences(self.prov.get("determinism", {}))
        cause = f"; the environment differs: {'; '.join(env)}" if env else ""
        return Divergence(pv.version, KERNEL, f"{what} differ though inputs and starting state are "
                          f"identical{cause}", diff)

    def step(self, s: GradientStep) -> tuple[Divergence | None, str | None]:
        """Train on the step's batches in the recorded order. Returns (a reason it could not,
        a note that an input differs from what the learner trained on)."""
        if s.from_version != self.version:
            return Divergence(s.to_version, ORDER, f"step {s.step} trains from version {s.from_version}, "
                              f"but the recorded line is at {self.version} (a version in between "
                              "came from elsewhere: a rollback or another learner)"), None
        if s.losses.get("replay_samples", 0.0) > 0:
            return Divergence(s.to_version, MISSING, f"step {s.step} also trained on "
                              f"{int(s.losses['replay_samples'])} transitions replayed from the learner's "
                              "sample cache (--replay.enabled); the log does not say which"), None
        batches, altered = [], []
        for i, bid in enumerate(s.batch_ids):
            found = self.run.prepared_batch(bid)
            if found is None:
                why = "not in the log" if bid not in self.run.prepared else "no record of it decodes"
                return Divergence(s.to_version, MISSING, f"batch {bid} of step {s.step}: {why}"), None
            rec, pb = found
            if i < len(s.batch_digests) and record_digest(rec.value) != s.batch_digests[i]:
                altered.append(f"batch {bid} ({pb.sample.actor_id} seq {pb.sample.seq}, "
                               f"{rec.topic}[{rec.partition}]@{rec.offset}) is not the record step "
                               f"{s.step} trained on (sha256 differs)")
            batches.append(pb)
        if "minibatch_size" in s.losses and hasattr(self.algo, "minibatch_size"):  # --dynamic-batch chose it
            self.algo.minibatch_size = int(s.losses["minibatch_size"])
        self.algo.update(to_trajectory_batch(batches, self.stream_ids))
        self.version = s.to_version
        return None, "; ".join(altered) or None

    def run_to(self, stop_after: int | None = None, report: VerifyReport | None = None) -> VerifyReport:
        """Replay every recorded step (or up to version ``stop_after``), checking each version."""
        run = self.run
        report = report or VerifyReport(run.run_id, run.source, self.version)
        det = self.prov.get("determinism", {})
        if str(det.get("device", "cpu")).startswith("cuda") and not det.get("deterministic_algorithms"):
            report.exact_possible = False
            report.notes.append("recorded on CUDA without deterministic algorithms: some kernels "
                                "(atomics in reductions) are not bit-reproducible; differences are reported")
        with recorded_threads(det):
            div = self.check_initial()
            if div is None:
                report.checked.append(self.version)
            for _, s in run.steps:
                if div is not None or (stop_after is not None and self.version >= stop_after):
                    break
                div, altered = self.step(s)
                if div is None:
                    pv = run.versions.get(s.to_version)
                    if pv is None:
                        div = Divergence(s.to_version, MISSING, f"step {s.step}'s PolicyVersion is not in the log")
                    else:
                        div = self.compare(pv[1], altered)
                if div is None:
                    report.checked.append(self.version)
        report.divergence = div
        trained = {s.to_version for _, s in run.steps}
        unreached = sorted(v for v in run.versions if v not in trained and v != run.first_version)
        if unreached and div is None:
            report.notes.append(f"versions {unreached} were published without a recorded step "
                                "(a resume or a rollback republished a snapshot); not replayed")
        return report


def verify(run: Recorded, snapshots: str | Path | None = None, blobs: Blobs = None) -> VerifyReport:
    """Replay ``run`` from its log and compare every version (see the module docstring);
    ``blobs``: where claim-checked weights are."""
    try:
        replay = Replay(run, snapshots, blobs=blobs)
    except ReplayError as e:
        report = VerifyReport(run.run_id, run.source, run.first_version)
        report.divergence = Divergence(run.first_version, MISSING, str(e))
        return report
    return replay.run_to()


def format_report(r: VerifyReport) -> str:
    lines = [f"run {r.run_id or '(no id)'} from {r.source}: initial version {r.initial_version}"]
    if r.ok:
        lines.append(f"OK: {len(r.checked)} versions reproduced bit for bit "
                     f"({r.checked[0]}..{r.checked[-1]})" if r.checked else "OK: nothing to check")
    else:
        d = r.divergence
        lines.append(f"DIVERGED at version {d.version} ({d.reason}): {d.detail}")
        if d.max_abs_diff is not None:
            lines.append(f"largest weight difference: {d.max_abs_diff:.3g}")
        lines.append(f"versions reproduced before it: {len(r.checked)}")
    if not r.exact_possible:
        lines.append("exact reproduction is not possible for this run")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)
