"""The local broker's TLS and SASL listeners as rendered (``localkafka.security``), the SCRAM
accounts given to ``StorageTool format``, and the Kafka client security settings the environment
may hold (``config.env.check_kafka_security``). No broker: tests/faults/test_tls_scram.py starts
one with these listeners and logs in."""

from __future__ import annotations

import pytest

from config.env import Environment, check_kafka_security
from localkafka.paths import BrokerError
from localkafka.render import server_properties
from localkafka.security import Security, scram_format_args


def test_tls_and_sasl_listeners_are_appended_to_the_plaintext_one(tmp_path):
    sec = Security(ssl_port=9094, sasl_ssl_port=9095, sasl_plaintext_port=9096, keystore="/k/server.pem",
                   truststore="/k/ca.pem", client_auth="required", scram_users={"svc": "s1"},
                   plain_users={"svc": "p1", "admin": "a1"})
    props = server_properties(port=9092, controller_port=9093, log_dir=tmp_path, security=sec)
    assert props["listeners"] == ("PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093,SSL://127.0.0.1:9094,"
                                  "SASL_SSL://127.0.0.1:9095,SASL_PLAINTEXT://127.0.0.1:9096")
    assert props["advertised.listeners"] == ("PLAINTEXT://127.0.0.1:9092,SSL://127.0.0.1:9094,"
                                             "SASL_SSL://127.0.0.1:9095,SASL_PLAINTEXT://127.0.0.1:9096")
    assert props["listener.security.protocol.map"].endswith(",SSL:SSL,SASL_SSL:SASL_SSL,SASL_PLAINTEXT:SASL_PLAINTEXT")
    assert props["inter.broker.listener.name"] == "PLAINTEXT"  # brokers and controllers talk as before
    assert (props["ssl.keystore.type"], props["ssl.keystore.location"]) == ("PEM", "/k/server.pem")
    assert (props["ssl.truststore.type"], props["ssl.truststore.location"]) == ("PEM", "/k/ca.pem")
    assert props["listener.name.ssl.ssl.client.auth"] == "required"
    assert props["listener.name.sasl_ssl.ssl.client.auth"] == "none"  # a password is the login there
    for listener in ("sasl_ssl", "sasl_plaintext"):
        assert props[f"listener.name.{listener}.sasl.enabled.mechanisms"] == "SCRAM-SHA-512,PLAIN"
        assert "ScramLoginModule" in props[f"listener.name.{listener}.scram-sha-512.sasl.jaas.config"]
        assert 'user_admin="a1"' in props[f"listener.name.{listener}.plain.sasl.jaas.config"]
    assert scram_format_args(sec) == ["--add-scram", 'SCRAM-SHA-512=[name=svc,password="s1"]']
    assert scram_format_args(None) == []
    plain = server_properties(port=9092, controller_port=9093, log_dir=tmp_path)
    assert "ssl.keystore.location" not in plain and plain["listeners"].count("://") == 2


@pytest.mark.parametrize("kwargs, says", [
    ({"ssl_port": 1}, "needs a keystore"),
    ({"client_auth": "required"}, "needs a truststore"),
    ({"client_auth": "maybe"}, "client_auth must be one of"),
    ({"sasl_plaintext_port": 1}, "needs accounts"),
    ({"sasl_plaintext_port": 1, "scram_users": {"svc": 'a"b'}}, "without quotes"),
])
def test_a_listener_that_could_not_work_is_refused(kwargs, says):
    with pytest.raises(BrokerError, match=says):
        Security(**kwargs)


def test_the_environment_passes_tls_and_scram_settings_and_refuses_what_no_client_speaks(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    env = Environment({"RLSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "RLSTREAM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
                       "RLSTREAM_KAFKA_SASL_USERNAME": "svc", "RLSTREAM_KAFKA_SASL_PASSWORD": "pw",
                       "RLSTREAM_KAFKA_SSL_CA_LOCATION": str(ca), "RLSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION": str(ca),
                       "RLSTREAM_KAFKA_SSL_KEY_LOCATION": str(ca)})
    conf = env.kafka_security()
    assert conf == {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "svc",
                    "sasl.password": "pw", "ssl.ca.location": str(ca), "ssl.certificate.location": str(ca),
                    "ssl.key.location": str(ca)}
    check_kafka_security(conf)  # complete: what a client is made with
    for bad, says in (({"RLSTREAM_KAFKA_SECURITY_PROTOCOL": "TLS"}, "RLSTREAM_KAFKA_SECURITY_PROTOCOL='TLS': use one of"),
                      ({"RLSTREAM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-1"}, "RLSTREAM_KAFKA_SASL_MECHANISM='SCRAM-SHA-1'")):
        with pytest.raises(ValueError, match=says):
            Environment({**env.values, **bad}).kafka_security()
    # a file that is not there, or a login without its password: refused where a client is made
    missing = {**conf, "ssl.ca.location": str(tmp_path / "nope.pem")}
    Environment({"RLSTREAM_KAFKA_SSL_CA_LOCATION": missing["ssl.ca.location"]}).kafka_security()  # passes here
    with pytest.raises(ValueError, match=r"RLSTREAM_KAFKA_SSL_CA_LOCATION=.*nope\.pem: no such file"):
        check_kafka_security(missing)
    with pytest.raises(ValueError, match="logs in with a password: set RLSTREAM_KAFKA_SASL_PASSWORD") as info:
        check_kafka_security({k: v for k, v in conf.items() if k != "sasl.password"})
    assert "pw" not in str(info.value).replace("password", "")


def test_a_bus_with_settings_no_client_could_use_says_which_before_connecting(tmp_path):
    from streams.bus.base import BusAuthenticationError
    from streams.bus.kafka import KafkaBus
    from streams.topics import TopicSpec

    bus = KafkaBus("127.0.0.1:1", config={"security.protocol": "SSL", "ssl.ca.location": str(tmp_path / "ca.pem")})
    try:
        with pytest.raises(BusAuthenticationError, match=r"RLSTREAM_KAFKA_SSL_CA_LOCATION=.*ca\.pem: no such file"):
            bus.create_topics([TopicSpec("t", key="k")], timeout=5)
    finally:
        bus.close(timeout=0)
