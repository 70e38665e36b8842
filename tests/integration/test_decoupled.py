"""Decoupled mode end to end on the real broker: ``rlstream learner`` and ``faust -A streams
worker`` as processes, and an injecting test actor in this process.

The test actor is a real actor (InvertedPendulum-v5, the learner's newest policy, two fragments
per version = one learner batch), but it publishes by hand so it can misbehave on purpose:

* version 1: the two fragments reordered (seq n+1 before n) -> buffered, then released in order;
* version 2: the first fragment twice (same batch_id) -> one ``duplicate`` drop, not dead-lettered;
* version 3: seq n held back until the processor's reorder timeout skips past it, then sent
  -> ``late`` (dead-lettered); a third fragment completes the learner's batch;
* version 7: an extra copy tagged with version 0 -> ``stale_versions`` (dead-lettered).

Checked: the learner's policy improves (first vs last PolicyVersion, evaluated deterministically),
and the processors' counters, the dead letters and the learner's stats match the injection
exactly. Then ``rlstream train --mode decoupled`` runs with a tiny budget, and ``rlstream validate``
reads its go-live table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections import Counter
from dataclasses import replace

import gymnasium as gym
import numpy as np
import pytest
import torch

from actor.actor import Actor, ActorConfig
from config.bus import run_namespace
from runtime import golive
from actor.policy_client import PolicySubscriber
from streams.policies import load_policy
from schemas.codec import Codec
from schemas.events import DeadLetter, PolicyVersion, PreparedBatch, new_id
from streams.bus.kafka import KafkaBus
from streams.events import EventBus
from streams.topics import DEADLETTER, POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW, STREAMS_GROUP, Namespace
from tests.support import Procs, free_port, http_json, summary_of, wait_for
from tests.support.kafka import GroupGenerations, end_offsets, handed_again_at_most
from tests.support.procs import ROOT

pytestmark = pytest.mark.kafka

ENV_ID = "InvertedPendulum-v5"
T = 1024  # steps per fragment (one env)
BATCH = 2 * T  # learner batch: two fragments per version
UPDATES = 8
K = 4  # PPO's staleness window (PrepareConfig.for_algo("ppo"))
PLAN = {1: "reorder", 2: "duplicate", 3: "late", 7: "stale"}
ACTOR_ID = "actor-inject"


def wait_until(pred, timeout: float, what: str, procs: Procs):
    """``pred()`` once truthy (connection errors count as not yet); fails at the deadline, or
    as soon as a role process has exited and one more look still finds nothing."""
    def check():
        if procs.dead():  # it may have exited right after its last event: one last look
            value = pred()
            assert value, f"{procs.dead()} exited while waiting for {what}:\n{procs.logs()}"
            return value
        return pred()

    return wait_for(check, timeout, what, on_timeout=procs.logs, ignore=(OSError, ValueError, KeyError))


def evaluate(pv: PolicyVersion, episodes: int = 3) -> float:
    """Mean return of the version's deterministic (mean-action) policy."""
    policy = load_policy(pv)
    env = gym.make(ENV_ID)
    low, high = env.action_space.low, env.action_space.high
    total = 0.0
    for ep in range(episodes):
        obs, _ = env.reset(seed=1000 + ep)
        done = False
        while not done:
            a, _, _ = policy.act(torch.as_tensor(obs, dtype=torch.float32)[None], deterministic=True)
            obs, r, term, trunc, _ = env.step(np.clip(a[0].numpy(), low, high))
            total += float(r)
            done = term or trunc
    env.close()
    return total / episodes


class InjectingActor:
    """A real actor whose publishing follows ``PLAN`` (see the module docstring)."""

    def __init__(self, bootstrap: str, policy_id: str, healthz: str, procs: Procs) -> None:
        self.bus = KafkaBus(bootstrap, client_id="rlstream-test-actor")
        self.events = EventBus(self.bus, Codec())
        sub = PolicySubscriber(self.events, policy_id=policy_id, stage="test-actor")
        self.actor = Actor(ActorConfig(actor_id=ACTOR_ID, env_id=ENV_ID, fragment_steps=T, seed=11), sub,
                           self.events)
        self.healthz, self.procs = healthz, procs
        self.sent = 0
        self.returns: dict[int, list[float]] = {}

    def collect(self):
        b = self.actor.collect(T)
        self.returns.setdefault(b.policy_version, []).extend(b.episode_returns)
        return b

    def send(self, batch, seq: int | None = None) -> None:
        if seq is not None:
            batch = replace(batch, seq=seq)
        self.events.publish(SAMPLES_RAW, batch, key=ACTOR_ID)
        self.bus.flush()
        self.sent += 1

    def stats(self) -> dict:
        return http_json(self.healthz)["stats"]

    def run(self) -> None:
        sub = self.actor.subscriber
        wait_until(lambda: sub.wait_for(0, 0.5), 180, "the learner's first policy version", self.procs)
        seq = 0
        while sub.version < UPDATES:
            version = sub.version
            plan = PLAN.get(version, "normal")
            a, b = self.collect(), self.collect()
            if plan == "normal":
                self.send(a, seq)
                self.send(b, seq + 1)
                seq += 2
            elif plan == "reorder":
                self.send(b, seq + 1)
                self.send(a, seq)
                seq += 2
            elif plan == "duplicate":
                a = replace(a, seq=seq)
                self.send(a)
                self.send(a)  # the same batch_id again
                self.send(b, seq + 1)
                seq += 2
            elif plan == "late":
                c = self.collect()
                self.send(b, seq + 1)  # seq is missing: the processor holds b, then skips past seq
                wait_until(lambda: self.stats()["reorder"]["timeouts"] >= 1, 120, "the reorder timeout", self.procs)
                self.send(a, seq)  # now behind: late
                self.send(c, seq + 2)
                seq += 3
            elif plan == "stale":
                self.send(a, seq)
                # version 0 is 7 behind, past K=4 even if the processor has not seen version 7 yet
                self.send(replace(b, batch_id=new_id(), seq=seq + 1, policy_version=0))
                self.send(b, seq + 2)
                seq += 3
            wait_until(lambda v=version + 1: sub.wait_for(v, 0.5), 180, f"policy version {version + 1}", self.procs)

    def close(self) -> None:
        self.actor.close()
        self.bus.close()


@pytest.mark.slow
def test_decoupled_learns_and_counts_every_injected_fault(rl_topics, tmp_path):
    torch.set_num_threads(1)
    bootstrap = rl_topics
    policy_id = f"it-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {**os.environ, "KAFKA_BROKERS": bootstrap, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RLSTREAM_METRICS_PORT", None)
    procs = Procs(tmp_path, env)
    actor = None
    generations = GroupGenerations(bootstrap, STREAMS_GROUP)  # the worker's group, from the broker
    try:
        procs.start("streams", [sys.executable, "-m", "faust", "-A", "streams", "--datadir", str(tmp_path / "faust"),
                                "worker", "-l", "warn", "--web-port", str(port)],
                    env={"RLSTREAM_POLICY_ID": policy_id, "RLSTREAM_ALGO": "ppo", "RLSTREAM_METRICS_PORT": str(port)})
        procs.start("learner", [sys.executable, "-m", "rlstream.cli", "learner", "--bootstrap", bootstrap,
                                "--algo", "ppo", "--env", ENV_ID, "--total-steps", str(UPDATES * BATCH),
                                "--train-batch-size", str(BATCH), "--policy-id", policy_id, "--seed", "1",
                                "--run-dir", str(tmp_path / "learner"), "--snapshot-every", "0",
                                "--metrics-port", "-1", "--log-json", "--log-every", "5"])
        healthz = f"http://127.0.0.1:{port}/healthz"
        wait_until(lambda: http_json(healthz)["ok"], 120, "the Faust worker's web server", procs)
        actor = InjectingActor(bootstrap, policy_id, healthz, procs)
        actor.run()
        learner_rc = procs.roles["learner"].proc.wait(60)
        assert learner_rc == 0, procs.log("learner")
        learner = summary_of(tmp_path / "learner.log")
        stats = actor.stats()
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        assert procs.roles["streams"].terminate() == 0, procs.log("streams")
    finally:
        if actor is not None:
            actor.close()
        procs.close()
    streams = summary_of(tmp_path / "streams.log")
    assert streams is not None, procs.log("streams")

    # (b) the processors' counters match the injection exactly
    # a batch handed to the worker again is a duplicate, only that; handed again only as a copy the
    # producer retried onto the topic, or by a reassignment the broker recorded or a seek back the
    # worker logged, each at most once per raw record
    again = stats["received_batches"] - actor.sent
    raw_records = sum(end_offsets(bootstrap, SAMPLES_RAW).values())  # rl_topics: ours alone
    moves = (generations.reassignments(), (tmp_path / "streams.log").read_text().count("seeking back to"))
    assert raw_records >= actor.sent, (raw_records, actor.sent)
    assert 0 <= again <= raw_records - actor.sent + handed_again_at_most(*moves, raw_records), (again, moves, stats)
    assert stats["drops"] == {"duplicate": 1 + again, "late": 1, "stale_versions": 1}, stats
    r = stats["reorder"]
    assert (r["reordered"], r["timeouts"], r["skipped_seqs"], r["overflows"], r["restarts"]) == (2, 1, 1, 0, 0), r
    assert actor.sent == 2 * UPDATES + 1 + 1 + 1
    assert stats["emitted_batches"] == 2 * UPDATES and stats["policy_ignored"] == 0
    assert stats["latest_version"] == UPDATES and streams["emitted_batches"] == 2 * UPDATES
    codec = Codec()
    with KafkaBus(bootstrap, client_id="rlstream-test-reader") as bus:
        dead = [codec.decode(rec.value, DeadLetter) for rec in bus.read_all(DEADLETTER)]
        versions = [codec.decode(rec.value, PolicyVersion) for rec in bus.read_all(POLICY_VERSIONS)]
        prepared = [codec.decode(rec.value, PreparedBatch) for rec in bus.read_all(SAMPLES_PREPARED)]
    assert Counter(d.reason for d in dead) == {"late": 1, "stale_versions": 1}  # duplicates are not dead-lettered
    by_reason = {d.reason: codec.decode(d.value) for d in dead}
    assert by_reason["late"].policy_version == 3 and by_reason["stale_versions"].policy_version == 0
    assert {d.topic for d in dead} == {SAMPLES_RAW} and {d.stage for d in dead} == {"streams.faust"}
    for reason in ("late", "stale_versions"):
        line = next(ln for ln in metrics.splitlines()
                    if ln.startswith("rlstream_dead_letters_total") and f'reason="{reason}"' in ln)
        assert line.endswith(" 1.0"), line
    assert 'rlstream_drops_total{reason="duplicate",role="streams"}' in metrics
    assert len(prepared) == 2 * UPDATES and all(p.staleness_versions == 0 for p in prepared)
    assert learner["updates"] == UPDATES and learner["samples_trained"] == UPDATES * BATCH
    assert learner["duplicates_skipped"] == 0  # the processors dropped the copy before it got there

    # (a) the policy improved
    ours = sorted((v for v in versions if v.policy_id == policy_id), key=lambda v: v.version)
    assert [v.version for v in ours] == list(range(UPDATES + 1))
    first, last = evaluate(ours[0]), evaluate(ours[-1])
    early = np.mean(actor.returns[0]) if actor.returns.get(0) else float("nan")
    late = np.mean(actor.returns[UPDATES - 1]) if actor.returns.get(UPDATES - 1) else float("nan")
    print(f"decoupled: deterministic return v0 {first:.1f} -> v{UPDATES} {last:.1f}; "
          f"actor episodes v0 {early:.1f} -> v{UPDATES - 1} {late:.1f}")
    assert last > 2 * first and last > first + 30, (first, last)


def test_train_decoupled_smoke(rl_topics, tmp_path):
    """``rlstream train --mode decoupled`` with a tiny budget: every process exits 0, a summary."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RLSTREAM_METRICS_PORT", None)
    generations = GroupGenerations(rl_topics, STREAMS_GROUP)  # from now on; scoped below, once the run names it
    p = subprocess.Popen([sys.executable, "-m", "rlstream.cli", "train", "--mode", "decoupled", "--algo", "ppo",
                          "--env", ENV_ID, "--total-steps", "2048", "--train-batch-size", "1024",
                          "--bootstrap", rl_topics, "--run-dir", str(run_dir), "--metrics-port", "-1",
                          "--log-every", "2", "--policy-id", f"smoke-{uuid.uuid4().hex[:8]}"],
                         cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        # every child exports its metrics on its own port, listed for Prometheus' file_sd
        def scrape_targets():
            assert p.poll() is None, f"rlstream train exited {p.returncode} early: {p.stderr.read()[-2000:]}"
            return json.loads((run_dir / "prometheus.targets.json").read_text())

        targets = wait_for(scrape_targets, 120, "the run's scrape targets", ignore=(OSError, ValueError))
        by_process = {t["labels"]["process"]: t["targets"][0] for t in targets}
        assert set(by_process) == {"learner", "streams", "actor-0"}
        assert {t["labels"]["role"] for t in targets} == {"learner", "streams", "actor"}
        assert len(set(by_process.values())) == 3

        def scraped(addr: str) -> str:
            with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
                return r.read().decode()

        pages: dict[str, str] = {}

        def all_scraped() -> bool:  # each in turn, every round: none may end before it is asked
            for name, addr in by_process.items():
                if name not in pages:
                    try:
                        pages[name] = scraped(addr)
                    except OSError:
                        pass
            return len(pages) == len(by_process)

        wait_for(all_scraped, 180, "every child's /metrics", on_timeout=lambda: f"answered: {sorted(pages)}")
        for name, text in pages.items():
            assert "rlstream_" in text, (name, text[:500])
        out, err = p.communicate(timeout=420)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mode"] == "decoupled" and summary["learner_exit"] == 0
    assert summary["exit_codes"] == {"learner": 0, "streams": 0, "actor-0": 0}
    procs = summary["processes"]
    assert procs["learner"]["updates"] == 2 and procs["learner"]["samples_trained"] == 2048
    assert procs["actor-0"]["flow"]["flow"] == "on_policy_sync" and procs["actor-0"]["flow"]["timeouts"] == 0
    # nothing dropped; a record handed again is only a duplicate, and handed again only by a
    # reassignment the broker recorded or a seek back of the worker's, once per raw record each
    assert procs["streams"]["freshness"] == 1.0 and set(procs["streams"]["drops"]) <= {"duplicate"}
    ns = Namespace(run_namespace(run_dir) or "")
    generations.group = ns.group(STREAMS_GROUP)
    raw_records = sum(end_offsets(rl_topics, ns.topic(SAMPLES_RAW)).values())
    moves = (generations.reassignments(), procs["streams"].get("consumer_rewinds", 0))
    duplicates = procs["streams"]["drops"].get("duplicate", 0)
    assert duplicates <= handed_again_at_most(*moves, raw_records), (duplicates, moves, raw_records)
    # every child was probed (liveness, as the manifests' probe) and none was restarted
    assert summary["restarts"] == {} and summary["restart_reasons"] == []
    assert "liveness_probe_failed" not in err, err[-3000:]  # a clean finish is no failed probe
    assert out.strip().splitlines()[-1].startswith("verdict: ") and '"summary"' not in out, out[-3000:]

    # the supervisor's progress lines over time: each window's latency (every actor's adoptions
    # in it) and freshness (the stream workers' checked samples in it), in timeline.json
    timeline = json.loads((run_dir / "timeline.json").read_text())
    assert len(timeline) >= 2 and all(b["t_s"] > a["t_s"] for a, b in zip(timeline, timeline[1:]))
    p99s = [ln["policy_latency_p99_ms"] for ln in timeline if ln["policy_latency_p99_ms"] is not None]
    assert p99s and max(p99s) == procs["actor-0"]["policy_latency_ms"]["max"]  # no adoption lost
    assert [ln["freshness"] for ln in timeline if ln["freshness"] is not None] != []
    assert all(ln["freshness"] == 1.0 for ln in timeline if ln["freshness"] is not None)

    # the go-live report of this real decoupled run: every row filled, or absent only for want of a GPU
    report = golive.check(run_dir)
    assert report["mode"] == "decoupled"
    assert report["plot"] == str(run_dir / golive.PLOT_FILE) and (run_dir / golive.PLOT_FILE).stat().st_size > 0
    got = {r["metric"]: r for r in report["rows"]}
    assert set(got) == set(golive.THRESHOLDS)
    for metric in ("policy_latency_p99_ms", "throughput_sps", "freshness_pct"):
        assert isinstance(got[metric]["value"], float) and got[metric]["status"] in ("pass", "fail"), got[metric]
    assert got["policy_latency_p99_ms"]["value"] == procs["actor-0"]["policy_latency_ms"]["p99"]
    assert got["policy_latency_p99_ms"]["source"] == "actor-0.summary.json policy_latency_ms.p99"
    assert got["throughput_sps"]["value"] == pytest.approx(2048 / procs["learner"]["wall_s"], abs=5e-4)  # 3 decimals
    assert got["freshness_pct"] == {**got["freshness_pct"], "value": 100.0, "status": "pass"}
    gpu = got["gpu_utilization_pct"]
    if procs["learner"]["gpu"].get("status") == "ok":
        assert isinstance(gpu["value"], float) and gpu["status"] in ("pass", "fail"), gpu
    else:  # no GPU: said, with the reason
        assert gpu["value"] == "no GPU" and gpu["status"] == "absent" and gpu["note"], gpu
    print(golive.render(report))
