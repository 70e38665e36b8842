"""Every field of a run's config reaches every role of a decoupled run.

Each field is set to a value that is neither its dataclass default nor the algorithm's; a real
``run_decoupled`` starts its children (learner, two actors, the Faust worker) on the Kafka
broker, and each child's own record of the config it runs with (``<name>.config.json``) must
equal the run's ``config.json``. A field added to the config without a value here fails the test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from rlstream.cli import build_parser, train_config
from config import ENTRY_POINT_FIELDS, BusConfig, PrepareConfig, TrainConfig, read_config, write_config
from config.env import Environment
from config.bus import Replication
from config.runfile import CONFIG_FILE, read_run_config
from config.storage import ObjectStoreConfig
from config.sections import SECTIONS, RunSection, flag_of
from config.train import default_cache_dir
from rlstream.decoupled import child_config, child_env, run_decoupled
from streams.topics import SAMPLES_RAW, Retention
from testbed.wait import wait_for

pytestmark = pytest.mark.kafka

POLICY = "cfg-policy"

PREPARE = dict(max_versions=5, max_ms=7_000, staleness_mode="drop", decay=0.25, min_weight=0.02,
               age_from="policy", reorder_window=7, reorder_timeout_ms=900, dedup_capacity=999, dedup_ttl_ms=5_000,
               max_actors=50, importance=False, rho_bar=0.9, c_bar=0.8, behaviour_cap=3.0, policy_id=POLICY)


#: Fields a decoupled run refuses (``TrainConfig`` in decoupled mode): they have no role process to reach.
COLOCATED_ONLY = ("overlap",)


def every_field_set(tmp_path: Path, bootstrap: str) -> TrainConfig:
    bus = dict(kind="kafka", bootstrap=bootstrap, partitions=2, log_dir=str(tmp_path / "unused-log"),
               retention={SAMPLES_RAW: Retention(ms=3_600_000, bytes=-1)}, namespace=f"cfg{uuid.uuid4().hex[:8]}",
               learner_group="cfg-trainers", replication=Replication(factor=1, min_insync=1))  # one broker here
    sections = {
        "run": dict(algo="tba", env_id="Pendulum-v1", wrappers=("clip_reward",), env_kwargs={"g": 9.5},
                    total_steps=4096, preset="none",
                    seed=7, algo_overrides={"gamma": 0.98}, run_dir=tmp_path / "run", run_id="cfg-run", resume=True,
                    plot=False, tensorboard=str(tmp_path / "tb"), metrics_port=9555, log_every_s=1.5,
                    policy_id=POLICY),
        "actor": dict(num_actors=2, num_envs=2, fragment_steps=16, group_size=2, max_batches_per_version=3,
                      policy_wait_s=7.0, max_backlog=9, fixed_fragments=True, actor_steps=1000, max_steps_ahead=5000,
                      actor_lag_versions=3),
        "learner": dict(train_batch_size=64, snapshot_store=str(tmp_path / "snaps"), snapshot_every=3,
                        snapshot_interval_s=3600.0, snapshot_keep_timed=3, compile_update=False, device="cpu:0",
                        breaker_open_above=100.0, breaker_close_below=10.0, breaker_policy_lag_versions=6,
                        learners=2, grad_compression="bf16", dynamic_batch=True, on_fenced="wait"),
        "replay": dict(enabled=True, capacity=512, samples_per_insert=1.5, max_reuse=3, min_size=64),
        "deploy": dict(torch_threads=2, stream_workers=2, max_restarts=1, liveness_probes=False,
                       claim_check_above=2 << 20, redis_url=os.environ.get("REDIS_URL", "redis://127.0.0.1:1/0"),
                       blob_cache=str(tmp_path / "blobs")),
    }
    top = {"mode", "streams", "bus", "object_store", *SECTIONS}
    assert {f.name for f in dataclasses.fields(TrainConfig)} == top, "a TrainConfig field outside its sections"
    for cls, values in ((BusConfig, bus), (PrepareConfig, PREPARE),
                        *((SECTIONS[name], values) for name, values in sections.items())):
        missing = {f.name for f in dataclasses.fields(cls) if not f.metadata.get("secret")} - set(values)
        missing -= set(COLOCATED_ONLY)
        # (secrets never go into a config file: each process takes them from its environment)
        assert not missing, f"give {cls.__name__} fields {sorted(missing)} a non-default value here"
    plain, algo = TrainConfig(), TrainConfig(run=RunSection(algo="tba"))  # the dataclasses' defaults and the algorithm's
    for section, values in sections.items():
        for name, value in values.items():
            assert value != getattr(getattr(plain, section), name), f"{section}.{name} is at its default"
            assert name == "algo" or value != getattr(getattr(algo, section), name), \
                f"{section}.{name} is at the algorithm's default"
    for name, value in bus.items():  # the broker's address is the test's; CI's may be the default one
        assert name == "bootstrap" or value != getattr(BusConfig(), name), f"bus.{name} is at its default"
    for name, value in PREPARE.items():
        assert value != getattr(PrepareConfig.for_algo("tba"), name), f"streams.{name} is at the algorithm's default"
    return TrainConfig(mode="decoupled", streams=PrepareConfig(**PREPARE), bus=BusConfig(**bus),
                       **{name: SECTIONS[name](**values) for name, values in sections.items()})


def test_every_field_reaches_the_learner_the_actors_and_the_faust_worker(tmp_path, kafka_bootstrap):
    cfg = every_field_set(tmp_path, kafka_bootstrap)
    run_dir = cfg.run.run_dir
    stop, failure, summary = threading.Event(), [], {}

    def run() -> None:
        try:
            summary.update(run_decoupled(cfg, stop=stop))
        except Exception as e:  # ChildExited, or a bug in the parent: the test fails on either
            failure.append(e)

    roles = ["learner", "actor-0", "actor-1"]
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: failure or all((run_dir / f"{n}.config.json").exists() for n in [*roles, "streams"]),
                 300, "every child's effective config", on_timeout=lambda: logs(run_dir))
    finally:
        stop.set()
        thread.join(120)
    assert not thread.is_alive()
    # A child that wrote its config and then crashed is a failure too, whether the supervisor gave
    # up on it (ChildExited) or restarted it (counted in the run's summary).
    assert not failure, f"{failure[0]!r}\n{logs(run_dir)}"
    assert summary["ended"] == "stopped" and summary["restarts"] == {}, f"{summary}\n{logs(run_dir)}"

    written = read_config(run_dir / CONFIG_FILE)
    # The run's file holds what was asked; the parent only turns off the children's metrics servers.
    assert written == replace(cfg, run=replace(cfg.run, metrics_port=-1)) == child_config(cfg)
    ports = {t["labels"]["process"]: int(t["targets"][0].rpartition(":")[2])
             for t in json.loads((run_dir / "prometheus.targets.json").read_text())}
    for name in roles:
        used = read_config(run_dir / f"{name}.config.json")
        assert used.run.metrics_port == ports[name], name  # each child its own, as the run's scrape targets list it
        assert replace(used, run=replace(used.run, metrics_port=-1)) == written, name
        for section in ("mode", "streams", "bus", *SECTIONS):  # (the same, said field by field)
            got, want = getattr(used, section), getattr(written, section)
            if section == "run":
                got = replace(got, metrics_port=-1)
            assert got == want, f"{name}: {section}"
    streams = read_run_config(run_dir / "streams.config.json")
    assert streams["prepare"] == dataclasses.asdict(cfg.streams)
    assert (streams["brokers"], streams["namespace"]["name"]) == (cfg.bus.bootstrap, cfg.bus.namespace)
    assert (streams["topic_partitions"], streams["torch_threads"]) == (cfg.bus.partitions, cfg.deploy.torch_threads)
    assert streams["app_id"].startswith(cfg.bus.namespace)


def test_the_faust_worker_gets_the_claim_check_store_and_the_host_blob_cache_from_its_environment(tmp_path):
    cfg = every_field_set(tmp_path, "127.0.0.1:1")  # the Faust worker reads these two from its environment
    env = child_env(cfg, tmp_path / CONFIG_FILE, Environment.read())
    assert (env["REDIS_URL"], env["RLSTREAM_BLOB_CACHE"]) == (cfg.deploy.redis_url, str(tmp_path / "blobs"))
    off = replace(cfg, deploy=replace(cfg.deploy, blob_cache="off"))
    assert child_env(off, tmp_path / CONFIG_FILE, Environment.read())["RLSTREAM_BLOB_CACHE"] == "off"
    unset = replace(cfg, deploy=replace(cfg.deploy, blob_cache=None))
    assert unset.resolved().deploy.blob_cache == (default_cache_dir() or "off")


def logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(run_dir.glob("*.log")))


def as_flags(cfg: TrainConfig) -> list[str]:
    """``cfg`` as the command line of ``rlstream train``: the shared flags, then one generated flag
    per field of ``TrainConfig``'s sections (``--actor.num-envs``, ``--algo``) and ``PrepareConfig``."""
    run = cfg.run
    argv = ["train", "--mode", cfg.mode, "--run-dir", str(run.run_dir), "--run-id", run.run_id,
            "--bus", cfg.bus.kind, "--bootstrap", cfg.bus.bootstrap, "--namespace", cfg.bus.namespace,
            "--partitions", str(cfg.bus.partitions), "--learner-group", cfg.bus.learner_group,
            "--log-dir", cfg.bus.log_dir, "--metrics-port", str(run.metrics_port), "--tensorboard", run.tensorboard,
            "--wrappers", ",".join(run.wrappers)]
    for k, v in run.algo_overrides.items():
        argv += ["--set", f"{k}={json.dumps(v)}"]
    for k, v in run.env_kwargs.items():
        argv += ["--env-arg", f"{k}={json.dumps(v)}"]
    entry = set(ENTRY_POINT_FIELDS)
    for section, obj in [*((name, getattr(cfg, name)) for name in SECTIONS), ("streams", cfg.streams)]:
        for f in dataclasses.fields(obj):
            if f.name in entry or (section == "streams" and f.name == "policy_id"):
                continue
            value = getattr(obj, f.name)
            flag = "--" + f.name.replace("_", "-") if section == "streams" else flag_of(section, f.name)
            switch = isinstance(value, bool) and f.type in ("bool", bool)  # bool | None takes a value
            prefix, _, bare = flag[2:].rpartition(".")
            off = f"--{prefix}.no-{bare}" if prefix else f"--no-{bare}"
            argv += [flag if value else off] if switch else [flag, str(value)]
    return argv


def test_every_field_is_a_flag_that_parses_back(tmp_path, monkeypatch):
    cfg = every_field_set(tmp_path, "127.0.0.1:1")
    monkeypatch.setenv("RLSTREAM_RETENTION", f"{SAMPLES_RAW}=1h")
    monkeypatch.setenv(Replication.FACTOR_SETTING, "1")  # like retention: the environment's, no flag
    monkeypatch.setenv(Replication.MIN_INSYNC_SETTING, "1")
    parsed = train_config(build_parser().parse_args(as_flags(cfg)))
    assert parsed == cfg
    assert set(ENTRY_POINT_FIELDS) == {"mode", "wrappers", "env_kwargs", "algo_overrides", "run_dir", "run_id",
                                       "tensorboard", "metrics_port", "streams", "bus", "object_store"}
    # each has a shared flag above, but object_store: the AWS variables (a secret, never a flag)


def test_a_config_file_of_another_schema_or_with_unknown_or_missing_fields_is_refused(tmp_path):
    cfg = TrainConfig(run_dir=tmp_path)
    path = write_config(cfg, tmp_path / CONFIG_FILE)
    assert read_config(path) == cfg
    doc = json.loads(path.read_text())
    for change, reason in ((lambda d: d.update(schema=2), "schema 2"),
                           (lambda d: d["config"].update(num_env=3), "unknown fields \\['num_env'\\]"),
                           (lambda d: d["config"]["actor"].update(num_env=3), "unknown fields \\['num_env'\\]"),
                           (lambda d: d["config"]["learner"].pop("device"), "missing fields \\['device'\\]"),
                           (lambda d: d["config"]["bus"].pop("namespace"), "missing fields \\['namespace'\\]")):
        bad = json.loads(json.dumps(doc))
        change(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match=reason):
            read_config(path)


def test_a_config_draws_its_run_id_once():
    """An unset run id is drawn when the config is made and never again (every process that reads
    the config, and every copy of it, agrees); two configs made apart get two ids."""
    cfg = TrainConfig()
    assert cfg.run_id and cfg.effective_run_id() == cfg.effective_run_id() == cfg.run_id
    assert replace(cfg, seed=3).run_id == cfg.run_id == TrainConfig.from_dict(cfg.to_dict()).run_id
    assert TrainConfig().run_id != cfg.run_id and TrainConfig(run_id="given").run_id == "given"


def test_the_object_store_settings_come_from_each_process_environment_never_from_the_file(tmp_path, monkeypatch):
    """The s3 store's endpoint and credentials: from the AWS variables where the command runs
    (``rlstream train``), and where each decoupled child reads the run's file; never in the file."""
    aws = {"AWS_ENDPOINT_URL": "http://s3.test:9000", "AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": "SKEY"}
    for k, v in aws.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    want = ObjectStoreConfig("http://s3.test:9000", None, "AKID", "SKEY")
    cfg = train_config(build_parser().parse_args(["train", "--run-dir", str(tmp_path), "--snapshot-store", "s3://b/p"]))
    assert cfg.object_store == want and cfg.snapshot_store == "s3://b/p"
    path = write_config(cfg, tmp_path / CONFIG_FILE)
    text = path.read_text()
    assert "SKEY" not in text and "AKID" not in text and "s3.test" not in text
    assert read_config(path).object_store == ObjectStoreConfig()
    assert read_config(path, Environment(aws)).object_store == want
