"""TLS and SCRAM-SHA-512 on real listeners (issue 39.4): one broker of this module's own with a
CA and certificates the test makes (``testbed.tls``), an ``SSL`` listener that requires a client
certificate (mutual TLS) and a ``SASL_SSL`` listener whose accounts log in with SCRAM-SHA-512
(stored when the node is formatted) or PLAIN, each with its own password.

Settings come from the environment as in production (``RLSTREAM_KAFKA_*``, ``Environment``):

* every client the roles and the in-process shell use (librdkafka: producer, consumer group,
  admin, group lag) and the Faust shell's (aiokafka: its policy reader's arguments, and what
  Faust's own transport makes of the app's credentials) exchange records over each;
* the roles and both processor shells, as processes of the real entry points, train over each
  (``test_roles_and_both_shells_train_over``);
* a wrong password, an untrusted certificate and a missing client certificate fail fast: the
  bus's first call raises ``BusAuthenticationError`` naming what was refused (never the password),
  aiokafka refuses to start, and the real ``rlstream`` commands say it in one line, exit 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from config import Environment

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
USER = "svc"
SCRAM_PASSWORD = "svc-scram-secret"
PLAIN_PASSWORD = "svc-plain-secret"  # another password: SCRAM must not accept PLAIN's
KINDS = ("ssl", "scram")


@dataclass
class SecureKafka:
    kafka: object  # localkafka.broker.LocalKafka
    certs: object  # testbed.tls.Certs

    @property
    def plaintext(self) -> str:
        return self.kafka.bootstrap

    def bootstrap(self, kind: str) -> str:
        return self.kafka.listener({"ssl": "SSL", "scram": "SASL_SSL", "plain": "SASL_SSL"}[kind])

    def env(self, kind: str, **override: str | None) -> dict[str, str]:
        """The ``RLSTREAM_KAFKA_*`` variables of a client of listener ``kind`` (``ssl``: CA, client
        certificate and key; ``scram`` / ``plain``: SASL_SSL with the CA and that mechanism's
        password); ``override``: variables (without the prefix) changed, None removes one."""
        c = self.certs
        if kind == "ssl":
            out = {"SECURITY_PROTOCOL": "SSL", "SSL_CA_LOCATION": str(c.ca),
                   "SSL_CERTIFICATE_LOCATION": str(c.client_cert), "SSL_KEY_LOCATION": str(c.client_key)}
        else:
            out = {"SECURITY_PROTOCOL": "SASL_SSL", "SSL_CA_LOCATION": str(c.ca), "SASL_USERNAME": USER,
                   "SASL_MECHANISM": "SCRAM-SHA-512" if kind == "scram" else "PLAIN",
                   "SASL_PASSWORD": SCRAM_PASSWORD if kind == "scram" else PLAIN_PASSWORD}
        for k, v in override.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = v
        return {f"RLSTREAM_KAFKA_{k}": v for k, v in out.items()}

    def environment(self, kind: str, **override: str | None) -> Environment:
        """This process's environment with ``env(kind)`` instead of any ``RLSTREAM_KAFKA_*``."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_KAFKA_")}
        return Environment({**base, "KAFKA_BROKERS": self.bootstrap(kind), **self.env(kind, **override)})


@pytest.fixture(scope="module")
def secure_kafka(tmp_path_factory):
    """The module's broker (see the module docstring); skipped where none can start (no java,
    jars or openssl), failed instead when ``CI=true``."""
    from localkafka.broker import LocalKafka
    from localkafka.paths import BrokerError
    from localkafka.security import Security
    from testbed.tls import TlsError, make_certs
    from tests.support import free_ports

    root = tmp_path_factory.mktemp("secure-kafka")
    port, controller, ssl_port, sasl_port = free_ports(4)
    kafka = None
    try:
        certs = make_certs(root / "tls")
        security = Security(ssl_port=ssl_port, sasl_ssl_port=sasl_port, keystore=str(certs.server_pem),
                            truststore=str(certs.ca), client_auth="required",
                            scram_users={USER: SCRAM_PASSWORD}, plain_users={USER: PLAIN_PASSWORD})
        kafka = LocalKafka(port=port, controller_port=controller, data_dir=root / "data", security=security,
                           extra_properties={"group.min.session.timeout.ms": 1000}, quiet=True,
                           heap=("-Xms128m", "-Xmx512m"))
        kafka.start(timeout=180)
    except (BrokerError, TlsError, OSError) as e:
        if kafka is not None:
            with contextlib.suppress(Exception):
                kafka.kill()
        msg = f"no TLS/SCRAM Kafka broker: {str(e).splitlines()[0]}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    try:
        yield SecureKafka(kafka, certs)
    finally:
        kafka.kill()  # the data dir is thrown away: no need for a graceful stop


# -- clients ---------------------------------------------------------------------------------------

async def aiokafka_round_trip(bootstrap: str, topic: str, kwargs: dict, value: bytes) -> list[bytes]:
    """Produce ``value`` to ``topic`` and read the topic back with aiokafka clients of ``kwargs``."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **kwargs)
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=b"k")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                                enable_auto_commit=False, **kwargs)
    await consumer.start()
    try:
        got: list[bytes] = []
        deadline = time.monotonic() + 20
        while value not in got and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=200, max_records=10)
            got += [m.value for msgs in batches.values() for m in msgs]
        return got
    finally:
        await consumer.stop()


async def aiokafka_start(bootstrap: str, kwargs: dict) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=5000, **kwargs)
    try:
        await producer.start()
    finally:
        await producer.stop()


@pytest.mark.parametrize("kind", [*KINDS, "plain"])
def test_bus_and_faust_clients_exchange_records_over(secure_kafka, kind):
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    from config import BusConfig
    from rlstream.wiring import kafka_bus
    from streams.faust_app.clients import aiokafka_security, faust_credentials
    from streams.settings import StreamsSettings
    from streams.topics import TopicSpec

    env = secure_kafka.environment(kind)
    bootstrap = secure_kafka.bootstrap(kind)
    cfg = BusConfig.from_environment(env, kind="kafka")
    assert cfg.bootstrap == bootstrap and cfg.security["security.protocol"] in ("SSL", "SASL_SSL")
    topic, group = f"tls-{kind}-{uuid.uuid4().hex[:8]}", f"tls-{kind}-group"
    bus = kafka_bus(cfg, f"tls-{kind}")
    try:
        bus.create_topics([TopicSpec(topic, key="k")])
        for i in range(3):
            bus.produce(topic, f"v{i}".encode(), key=b"k", headers={"h": b"1"})
        bus.flush()
        assert [r.value for r in bus.read_all(topic)] == [b"v0", b"v1", b"v2"]
        with bus.consumer(group, [topic]) as c:
            got, deadline = [], time.monotonic() + 30
            while len(got) < 3 and time.monotonic() < deadline:
                got += c.poll(0.5)
            c.commit(got)
        assert [r.value for r in got] == [b"v0", b"v1", b"v2"] and got[0].headers == {"h": b"1"}
        assert bus.group_lag(group, topic) == 0
    finally:
        bus.close(timeout=5)

    settings = StreamsSettings.from_environment(env)
    assert settings.brokers == bootstrap and dict(settings.client_config) == cfg.security
    # the Faust shell's policy reader, and what Faust's transport makes of the app's credentials
    for n, kwargs in enumerate((aiokafka_security(settings.client_config),
                                dict(credentials_to_aiokafka_auth(faust_credentials(settings.client_config))))):
        assert kwargs["ssl_context"] is not None
        if kind != "ssl":
            assert (kwargs["sasl_mechanism"], kwargs["sasl_plain_username"]) == (
                "SCRAM-SHA-512" if kind == "scram" else "PLAIN", USER)
        value = f"from-faust-{n}".encode()
        assert value in asyncio.run(aiokafka_round_trip(bootstrap, topic, kwargs, value))


#: What a client gets wrong (the listener, changes to its settings), and what the refusal says.
REFUSALS = {
    "wrong-password": ("scram", {"SASL_PASSWORD": "not-the-password"}, "invalid credentials"),
    "plain-password-for-scram": ("scram", {"SASL_PASSWORD": PLAIN_PASSWORD}, "SCRAM-SHA-512"),
    "untrusted-certificate-sasl": ("scram", {"SSL_CA_LOCATION": "ROGUE"}, "certificate verify failed"),
    "untrusted-certificate": ("ssl", {"SSL_CA_LOCATION": "ROGUE"}, "certificate verify failed"),
    # the broker's alert: "certificate required" (116) or, from some Java builds, "bad certificate" (42)
    "no-client-certificate": ("ssl", {"SSL_CERTIFICATE_LOCATION": None, "SSL_KEY_LOCATION": None},
                              ("certificate required", "bad certificate")),
}


def refusal_env(secure_kafka, case: str) -> Environment:
    kind, override, _ = REFUSALS[case]
    override = {k: str(secure_kafka.certs.rogue_ca) if v == "ROGUE" else v for k, v in override.items()}
    return secure_kafka.environment(kind, **override)


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refused_login_or_certificate_is_a_clear_error_within_seconds(secure_kafka, case):
    from aiokafka.errors import KafkaError as AIOKafkaError

    from config import BusConfig
    from rlstream.wiring import kafka_bus
    from streams.bus.base import BusAuthenticationError
    from streams.bus.kafka.clients import AUTH_GRACE_S
    from streams.faust_app.clients import aiokafka_security
    from streams.settings import StreamsSettings
    from streams.topics import TopicSpec

    kind, _, says = REFUSALS[case]
    env = refusal_env(secure_kafka, case)
    bus = kafka_bus(BusConfig.from_environment(env, kind="kafka"), f"tls-refused-{case}")
    t0 = time.monotonic()
    try:
        with pytest.raises(BusAuthenticationError) as info:  # the refusal itself, not a timeout
            bus.create_topics([TopicSpec(f"tls-refused-{uuid.uuid4().hex[:8]}", key="k")], timeout=60)
        took = time.monotonic() - t0
        msg = str(info.value)
        assert any(text in msg for text in ((says,) if isinstance(says, str) else says)), msg
        assert secure_kafka.bootstrap(kind) in msg, msg
        assert "\n" not in msg and "not-the-password" not in msg and PLAIN_PASSWORD not in msg, msg
        assert took < AUTH_GRACE_S + 10, took
        if "certificate" in case:
            assert "RLSTREAM_KAFKA_SSL_" in msg, msg
        else:
            assert f"sasl.username={USER}" in msg and "RLSTREAM_KAFKA_SASL_" in msg, msg
    finally:
        bus.close(timeout=1)

    settings = StreamsSettings.from_environment(env)
    t0 = time.monotonic()
    with pytest.raises(AIOKafkaError):
        asyncio.run(aiokafka_start(secure_kafka.bootstrap(kind), aiokafka_security(settings.client_config)))
    assert time.monotonic() - t0 < 15


# -- the real commands -----------------------------------------------------------------------------

#: The commands that reach Kafka first thing, as a user types them (after ``python``), and the
#: name their error line starts with (``rlstream NAME: error: ``).
COMMANDS = {
    "learner": ["-m", "rlstream.cli", "learner", "--metrics-port", "-1", "--env", "Pendulum-v1"],
    "actor": ["-m", "rlstream.cli", "actor", "--metrics-port", "-1", "--env", "Pendulum-v1"],
    "train": ["-m", "rlstream.cli", "train", "--mode", "decoupled", "--metrics-port", "-1", "--env", "Pendulum-v1"],
    "lag": ["-m", "rlstream.cli", "lag"],
    "worker": ["-m", "rlstream.entry", "worker"],  # the in-process shell
}


@pytest.mark.parametrize("case", ["wrong-password", "untrusted-certificate"])
def test_rlstream_commands_refuse_a_wrong_password_or_an_untrusted_certificate(secure_kafka, case, tmp_path):
    """Each command ends within seconds with one line on stderr, exit 2, no traceback; the
    Faust shell (Faust's own command line) ends as quickly, non-zero, with aiokafka's reason."""
    from tests.support import free_port

    kind, _, says = REFUSALS[case]
    env = dict(refusal_env(secure_kafka, case).values)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("RLSTREAM_NAMESPACE", None)
    env.pop("RLSTREAM_METRICS_PORT", None)
    faust_reason = "SaslAuthenticationFailed" if case == "wrong-password" else "CERTIFICATE_VERIFY_FAILED"
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, argv in {**COMMANDS, "faust": ["-m", "faust", "-A", "streams", "--datadir", str(tmp_path / "fd"),
                                                  "worker", "-l", "info", "--web-port", str(free_port())]}.items():
            cwd = tmp_path / name
            cwd.mkdir()
            procs[name] = subprocess.Popen([sys.executable, *argv], cwd=cwd, stdout=subprocess.PIPE,
                                           env={**env, "RLSTREAM_METRICS_PORT": str(free_port())},  # the shells'
                                           stderr=subprocess.PIPE, text=True, start_new_session=True)
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            assert "not-the-password" not in err + out
            if name == "faust":  # not a hang: it stops, saying why
                assert proc.returncode != 0 and faust_reason in err + out, (proc.returncode, err[-3000:])
                continue
            assert proc.returncode == 2, (name, proc.returncode, out[-2000:], err[-3000:])
            assert "Traceback" not in err, err[-3000:]
            # that line alone (train's info line "preset" aside): librdkafka's retries are not logged
            said = [line for line in err.strip().splitlines() if "[info" not in line]
            assert len(said) == 1 and said[0].startswith(f"rlstream {name}: error: "), err[-3000:]
            assert says in said[0] and secure_kafka.bootstrap(kind) in said[0], said[0]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


# -- the roles and both shells, as processes -------------------------------------------------------

@pytest.mark.slow  # ~45-90 s each on two shared cores
@pytest.mark.parametrize("kind", KINDS)
def test_roles_and_both_shells_train_over(secure_kafka, kind, tmp_path):
    """Learner, actor and the Faust shell, each a process of its real entry point with the
    settings in ``RLSTREAM_KAFKA_*`` and only the secure listener as bootstrap, train; then the
    in-process shell takes the Faust shell's place and training goes on. The topics are read back
    through the PLAINTEXT listener: every produced batch trained once."""
    from schemas.codec import Codec
    from schemas.events import now_ms
    from streams.topics import LEARNER_STEPS, SAMPLES_RAW

    from .conftest import Ledger, Rig, TopicCounter, all_trained, check_acknowledged, check_trained_once, wait_for

    codec = Codec()
    rig = Rig(secure_kafka.bootstrap(kind), tmp_path)
    rig.env = {k: v for k, v in rig.env.items() if not k.startswith("RLSTREAM_KAFKA_")}
    rig.env.update(secure_kafka.env(kind))
    steps = TopicCounter(secure_kafka.plaintext, LEARNER_STEPS, codec.decode)
    raw = TopicCounter(secure_kafka.plaintext, SAMPLES_RAW, codec.decode)
    started_ms = now_ms()  # the broker holds the other kind's run too, under the same actor id
    try:
        streams = rig.start_streams("faust")
        learner = rig.learner()
        actor = rig.actor(0)
        wait_for(lambda: steps.poll() >= 2, 180, f"2 updates over {kind} with the Faust shell", on_timeout=rig.logs)
        # (TopicCounter reads through the PLAINTEXT listener; the roles were given only the secure one)
        assert not streams.errors, streams.errors
        faust_summary = streams.stop()
        rig.start_streams("worker")  # the in-process shell, in the same group, picks up where it left
        n = steps.poll()
        wait_for(lambda: steps.poll() >= n + 2, 180, f"2 updates over {kind} with the in-process shell",
                 on_timeout=rig.logs)
        actor_summary = actor.stop()
        wait_for(lambda: all_trained(raw, steps), 120, "every produced batch trained", on_timeout=rig.logs)
        learner.stop()
        assert not rig.streams.errors, rig.streams.errors
        worker_summary = rig.streams.stop()
    finally:
        steps.close()
        raw.close()
        rig.close()
    # the updates before the swap came from what the Faust shell prepared (nothing else prepares)
    assert worker_summary.get("published", 0) >= 1, (faust_summary, worker_summary)
    ledger = Ledger.read(secure_kafka.plaintext)
    counts = check_trained_once(ledger)
    counts["actors"] = check_acknowledged(ledger, [actor_summary], since_ms=started_ms)  # acknowledged = in the topic
    assert counts["lost"] == 0 and counts["duplicates_trained"] == 0, counts
