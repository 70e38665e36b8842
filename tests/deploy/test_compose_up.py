"""compose up, for real: docker-compose.yml with docker-compose.host.yml under podman-compose, on
ports of its own. Kafka, Redis, Prometheus, the Faust worker, the learner, an actor and serve
run as containers of the images compose/build-images.sh builds; a decoupled PPO run trains to its
budget while the test

- SIGKILLs the learner's process (its container restarts it, ``--resume``: snapshot + offsets);
- scales the actors from 1 to 3 (actor-1, actor-2 join, each registering an id of its own);
- reads Prometheus' targets (``up == 1`` for every role) and asks serve's ``/act``;
- stops the Faust worker's container and reads ``RlstreamRoleDown`` firing from ``/api/v1/alerts``,
  then starts it again;

then reads the ledger from the topics: the final policy's lineage (versions back through
``parent_version``) trained every batch at most once, and every produced batch is trained or is
still waiting, uncommitted, at the head of a topic (none lost). ``down -v`` leaves no container,
volume, network or pod of the project behind."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from schemas.codec import Codec
from schemas.events import DeadLetter, GradientStep, PolicyVersion, PreparedBatch, SampleBatch
from streams.bus.kafka import KafkaBus
from streams.topics import DEADLETTER, LEARNER_STEPS, POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW, STREAMS_GROUP
from tests.support.kafka import committed
from testbed.ports import free_ports

from .conftest import COMPOSE, wait_for

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(1500)]
CODEC = Codec()
FRAGMENT = 32
LEARNER_STEPS_BUDGET = FRAGMENT * 3200  # the learner's --total-steps (a few minutes here)
ACTOR_STEPS = FRAGMENT * 1600  # each actor's: one alone cannot finish the run, three can
LEARNER_GROUP = "rl-trainers"


def get_json(url: str, data: dict | None = None, timeout: float = 5.0):
    req = urllib.request.Request(url, data=None if data is None else json.dumps(data).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def try_json(url: str, data: dict | None = None):
    try:
        return get_json(url, data)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def read_topics(bootstrap: str) -> dict[str, list]:
    out: dict[str, list] = {}
    with KafkaBus(bootstrap, client_id="deploy-ledger", auto_create=False) as bus:
        for topic in (SAMPLES_RAW, SAMPLES_PREPARED, LEARNER_STEPS, POLICY_VERSIONS, DEADLETTER):
            out[topic] = [(r.partition, r.offset, CODEC.decode(r.value)) for r in bus.read_all(topic)]
    return out


def count(bootstrap: str, topic: str) -> int:
    from tests.support.kafka import end_offsets

    try:
        return sum(end_offsets(bootstrap, topic).values())
    except Exception:  # not created yet
        return 0


def prometheus_config(ports: dict[str, int], path: Path) -> Path:
    """compose/podman/prometheus.host.yml with this stack's ports."""
    text = (COMPOSE / "podman" / "prometheus.host.yml").read_text()
    for default, port in (("9101", ports["actor"]), ("9111", ports["actor1"]), ("9121", ports["actor2"]),
                          ("9102", ports["streams"]), ("9103", ports["learner"]), ("8080", ports["serve"]),
                          ("9090", ports["prometheus"])):
        text = text.replace(f'"127.0.0.1:{default}"', f'"127.0.0.1:{port}"')
    path.write_text(text)
    path.chmod(0o644)
    return path


def summary_of(log: str) -> dict | None:
    """The learner's last ``{"summary": ...}`` line (the log may interleave other output)."""
    for line in reversed(log.splitlines()):
        i = line.find('{"summary"')
        if i >= 0:
            return json.loads(line[i:])["summary"]
    return None


def lineage(versions: list[PolicyVersion]) -> set[int]:
    """The final version and its ancestors, through parent_version (a resumed learner's first
    version names the snapshot it restored, skipping the updates lost with the killed one)."""
    parent = {v.version: v.parent_version for v in versions}
    v = max(parent)
    out = {v}
    while parent.get(v) is not None and parent[v] in parent:
        v = parent[v]
        out.add(v)
    return out


def test_compose_up_trains_to_its_budget_through_a_learner_kill_and_a_scale_up(stack_factory, tmp_path):
    names = ["kafka", "controller", "redis", "prometheus", "actor", "actor1", "actor2", "streams", "learner", "serve"]
    ports = dict(zip(names, free_ports(len(names))))
    bootstrap = f"127.0.0.1:{ports['kafka']}"
    prom = f"http://127.0.0.1:{ports['prometheus']}"
    role_args = (f"--algo ppo --env Pendulum-v1 --total-steps {LEARNER_STEPS_BUDGET} --actor.num-actors 3 "
                 f"--learner.train-batch-size {FRAGMENT} --actor.fragment-steps {FRAGMENT} --actor.num-envs 1 --learner.snapshot-every 3 "
                 "--set update_epochs=1 --set num_minibatches=1 --deploy.torch-threads 1 --log-every 2")
    env = {
        "RLSTREAM_KAFKA_PORT": str(ports["kafka"]), "RLSTREAM_KAFKA_CONTROLLER_PORT": str(ports["controller"]),
        "RLSTREAM_REDIS_PORT": str(ports["redis"]), "RLSTREAM_PROMETHEUS_PORT": str(ports["prometheus"]),
        "RLSTREAM_ACTOR_PORT": str(ports["actor"]), "RLSTREAM_ACTOR1_PORT": str(ports["actor1"]),
        "RLSTREAM_ACTOR2_PORT": str(ports["actor2"]), "RLSTREAM_STREAMS_PORT": str(ports["streams"]),
        "RLSTREAM_LEARNER_PORT": str(ports["learner"]), "RLSTREAM_SERVE_PORT": str(ports["serve"]),
        "RLSTREAM_PROMETHEUS_CONFIG": str(prometheus_config(ports, tmp_path / "prometheus.yml")),
        "RLSTREAM_ROLE_ARGS": role_args, "RLSTREAM_ACTOR_ARGS": f"--actor.actor-steps {ACTOR_STEPS}",
        "RLSTREAM_ALGO": "ppo",
    }
    stack = stack_factory(env)
    report: dict = {"ports": ports}

    # -- infrastructure first (podman runs no healthchecks without systemd: poll from here) --
    stack.compose("up", "-d", "--no-deps", "kafka", "redis", "prometheus")
    from localkafka.probe import probe

    wait_for(lambda: probe("127.0.0.1", ports["kafka"], timeout=5).get("ready"), 180, "Kafka in its container",
             every=2, on_timeout=stack.all_logs)
    wait_for(lambda: try_json(f"{prom}/-/ready") is not None or _ready(f"{prom}/-/ready"), 120,
             "Prometheus ready", on_timeout=stack.all_logs)

    # -- the roles: one actor --
    stack.compose("--profile", "serve", "up", "-d", "--no-deps", "streams", "learner", "actor", "serve")
    wait_for(lambda: count(bootstrap, LEARNER_STEPS) >= 6, 600, "6 updates of the learner", every=2,
             on_timeout=stack.all_logs)

    # -- scale the actors from 1 to 3 --
    stack.compose("--profile", "scale", "up", "-d", "--no-deps", "actor-1", "actor-2")

    def three_actors():
        with KafkaBus(bootstrap, client_id="deploy-actors", auto_create=False) as bus:
            ids = {CODEC.decode(r.value).actor_id for r in bus.read_all(SAMPLES_RAW)}
        return ids if len(ids) >= 3 else None
    actor_ids = wait_for(three_actors, 300, "batches from 3 actors", every=3, on_timeout=stack.all_logs)
    report["actor_ids"] = sorted(actor_ids)

    # -- Prometheus scrapes every role: up == 1 for each target --
    def all_up():
        res = try_json(f"{prom}/api/v1/query?query=up")
        if not res:
            return None
        up = {(r["metric"]["job"], r["metric"]["instance"]): r["value"][1] for r in res["data"]["result"]}
        return up if len(up) == 7 and set(up.values()) == {"1"} else None
    up = wait_for(all_up, 120, "up == 1 for all 7 targets",
                  on_timeout=lambda: json.dumps(try_json(f"{prom}/api/v1/targets"))[:3000])
    assert {job for job, _ in up} == {"actor", "streams", "learner", "serve", "prometheus"}
    report["prometheus_up"] = sorted(f"{j} {i}" for j, i in up)

    # -- serve answers /act from the newest policy --
    newest_before = max(v.version for _, _, v in read_topics(bootstrap)[POLICY_VERSIONS]
                        if isinstance(v, PolicyVersion))

    def acted():
        got = try_json(f"http://127.0.0.1:{ports['serve']}/act", {"obs": [0.0, 0.0, 0.0]})
        return got if got and got.get("policy_version", -1) >= newest_before else None
    act = wait_for(acted, 60, f"/act from version >= {newest_before}", on_timeout=lambda: stack.logs("serve"))
    assert len(act["actions"]) == 1 and -2.5 < act["actions"][0] < 2.5, act
    report["serve_act"] = act

    # -- SIGKILL the learner's process: restart policy on-failure starts it again, --resume --
    first = stack.inspect("learner")["State"]
    steps_before_kill = count(bootstrap, LEARNER_STEPS)
    os.kill(first["Pid"], signal.SIGKILL)

    def restarted():
        st = stack.inspect("learner")["State"]
        return st["Running"] and st["Pid"] not in (0, first["Pid"])
    wait_for(restarted, 120, "the learner's container to restart it", on_timeout=lambda: stack.logs("learner"))
    wait_for(lambda: count(bootstrap, LEARNER_STEPS) >= steps_before_kill + 3, 300,
             "3 updates of the resumed learner", every=2, on_timeout=stack.all_logs)
    resumed_log = stack.logs("learner", 400)
    report["learner_kill"] = {"steps_before_kill": steps_before_kill,
                              "restart_count": stack.inspect("learner").get("RestartCount")}

    # -- a role down fires its alert: stop the Faust worker's container, then start it again --
    streams_id = stack.container("streams")["Id"]
    stack.compose("stop", "-t", "10", "streams")

    def fired():
        res = try_json(f"{prom}/api/v1/alerts")
        alerts = (res or {}).get("data", {}).get("alerts", [])
        return [a for a in alerts if a["labels"].get("alertname") == "RlstreamRoleDown"
                and a["labels"].get("job") == "streams" and a["state"] == "firing"] or None
    alert = wait_for(fired, 180, "RlstreamRoleDown{job=streams} firing", every=2,
                     on_timeout=lambda: json.dumps(try_json(f"{prom}/api/v1/alerts"))[:3000])
    report["alert"] = {k: alert[0][k] for k in ("labels", "state", "activeAt")}
    stack.compose("start", "streams")
    assert stack.container("streams")["Id"] == streams_id

    # -- the learner trains to its budget and exits 0 (and stays down: on-failure) --
    def learner_done():
        st = stack.inspect("learner")["State"]
        return st if st["Status"] == "exited" else None
    st = wait_for(learner_done, 900, f"the learner to reach --total-steps {LEARNER_STEPS_BUDGET}", every=3,
                  on_timeout=stack.all_logs)
    assert st["ExitCode"] == 0, stack.logs("learner")
    learner_log = stack.logs("learner", 100000)

    # -- the ledger, from the topics --
    topics = read_topics(bootstrap)
    raw = [e for _, _, e in topics[SAMPLES_RAW] if isinstance(e, SampleBatch)]
    steps = [e for _, _, e in topics[LEARNER_STEPS] if isinstance(e, GradientStep)]
    versions = [e for _, _, e in topics[POLICY_VERSIONS] if isinstance(e, PolicyVersion)]
    dead = [e for _, _, e in topics[DEADLETTER] if isinstance(e, DeadLetter)]
    produced = [b.batch_id for b in raw]
    size = {b.batch_id: b.num_steps for b in raw}
    assert len(produced) == len(set(produced)), "an actor published a batch id twice"
    numbers = [v.version for v in versions]
    assert numbers == sorted(set(numbers)), f"versions not strictly increasing: {numbers}"
    keep = lineage(versions)
    line = [s for s in steps if s.to_version in keep]
    trained = [b for s in line for b in s.batch_ids]
    twice = {b: n for b, n in Counter(trained).items() if n > 1}
    assert not twice, f"trained twice in the final policy's lineage: {twice}"
    assert set(trained) <= set(produced), "trained on batches that are not in rl.samples.raw"
    # the budget holds: the learner stops at the first update that reaches --total-steps
    biggest = max(s.num_samples for s in line)
    assert LEARNER_STEPS_BUDGET <= sum(size[b] for b in trained) < LEARNER_STEPS_BUDGET + biggest
    summary = summary_of(learner_log)
    assert summary is not None, f"the learner printed no summary:\n{learner_log[-3000:]}"
    assert summary["samples_trained"] == sum(size[b] for b in trained) == sum(s.num_samples for s in line)
    superseded = [s for s in steps if s.to_version not in keep]  # the killed learner's updates past its snapshot
    # at most one gap in the chain: the resumed learner's first version names its snapshot (none
    # when the kill fell right after a snapshot); the lineage above covers the rest
    resumed_at = [v for v in versions if v.parent_version is not None and v.parent_version != v.version - 1]
    assert len(resumed_at) <= 1, [(v.version, v.parent_version) for v in resumed_at] or resumed_log[-3000:]

    # none lost: what is not trained is still waiting at the head of its topic, uncommitted
    learner_commits = committed(bootstrap, LEARNER_GROUP, SAMPLES_PREPARED)
    streams_commits = committed(bootstrap, STREAMS_GROUP, SAMPLES_RAW)
    first_prepared: dict[str, tuple[int, int]] = {}
    for p, o, e in topics[SAMPLES_PREPARED]:
        if isinstance(e, PreparedBatch):
            first_prepared.setdefault(e.sample.batch_id, (p, o))
    raw_at = {e.batch_id: (p, o) for p, o, e in topics[SAMPLES_RAW] if isinstance(e, SampleBatch)}
    untrained = set(produced) - set(trained)
    waiting_prepared = {b for b in untrained if b in first_prepared
                        and first_prepared[b][1] >= learner_commits.get(first_prepared[b][0], 0)}
    waiting_raw = {b for b in untrained - set(first_prepared)
                   if raw_at[b][1] >= streams_commits.get(raw_at[b][0], 0)}
    reasons = Counter(d.reason for d in dead)
    # dropped with a reason: the stream worker dead-letters a raw batch it refuses (stale_versions:
    # a policy more than K versions old), naming the record it came from
    raw_by_position = {pos: b for b, pos in raw_at.items()}
    dead_lettered = {raw_by_position[(d.partition, d.offset)] for d in dead
                     if d.topic == SAMPLES_RAW and d.reason != "duplicate" and (d.partition, d.offset) in raw_by_position}
    lost = untrained - waiting_prepared - waiting_raw - dead_lettered
    ledger = {"produced": len(produced), "produced_steps": sum(size.values()),
              "by_actor": dict(Counter(b.actor_id for b in raw)), "updates": len(steps),
              "updates_in_lineage": len(line), "superseded_updates": len(superseded),
              "retrained_after_resume": len({b for s in superseded for b in s.batch_ids}),
              "trained": len(trained), "trained_steps": sum(size[b] for b in trained),
              "waiting_prepared": len(waiting_prepared), "waiting_raw": len(waiting_raw),
              "dead_lettered": len(dead_lettered), "lost": len(lost),
              "versions": len(versions), "resumed_from": [(v.version, v.parent_version) for v in resumed_at],
              "dead_letters": dict(reasons)}
    report["ledger"] = ledger
    print("DEPLOY compose:", json.dumps(report, sort_keys=True, default=str))
    assert not lost, f"{len(lost)} batches neither trained, dead-lettered nor waiting: {ledger}\n{learner_log}"
    assert not dead_lettered & set(trained), "a dead-lettered batch was trained"
    assert len(set(b.actor_id for b in raw)) == 3

    # -- down leaves nothing behind --
    stack.compose("--profile", "serve", "--profile", "scale", "down", "-v", "-t", "10", timeout=300)
    assert stack.containers() == []
    assert stack.volumes() == [] and stack.networks() == [] and stack.pods() == []


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False
