"""The Faust shell's Kafka clients: the run's replication as Faust settings
(``replication_settings``, ``METADATA_MAX_AGE_MS``), broker URLs, and librdkafka's security
settings translated for Faust (``faust_credentials``) and for aiokafka (``aiokafka_security``,
the policy reader's)."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any

import faust

from config.bus import Replication

#: How often the worker's Kafka clients refresh the cluster's metadata (ms) on a replicated
#: cluster. aiokafka's default (5 minutes) kept table recovery waiting on a leader that had moved
#: away after a controlled broker shutdown; errors refresh it sooner, an idle fetch from a stopped
#: leader does not. Nor does a fetch from a SIGKILLed one: aiokafka's fetcher only backs off and
#: tries the dead leader again, so the worker read nothing until this age ran out (15 s: the
#: samples leader's SIGKILL stalled training ~25 s; 3 s: the worker's fetch errors stop ~4 s after
#: the kill). Only where leaders can move (a replication factor above 1): on a single
#: broker the 15 s age made ``tests/faults/test_broker_crash.py`` fail (the learner stopped
#: logging while the broker was down; not understood yet), so one broker keeps aiokafka's default.
METADATA_MAX_AGE_MS = 3_000


def replication_settings(replication: Replication) -> dict[str, Any]:
    """Faust settings for a replicated cluster: the run's replication factor for the topics Faust
    creates (changelogs, repartition topics; ``topic_replication_factor``), its producer at
    ``acks=all`` (-1), and, with more than one copy, a bounded metadata age for the consumer and
    the producer."""
    out: dict[str, Any] = {"producer_acks": -1}
    if replication.factor is not None:
        out["topic_replication_factor"] = replication.factor
    if replication.replicated:
        out["consumer_metadata_max_age_ms"] = out["producer_metadata_max_age_ms"] = METADATA_MAX_AGE_MS
    return out


def broker_urls(brokers: str) -> list[str]:
    hosts = [h.strip() for h in brokers.split(",") if h.strip()]
    if not hosts:
        raise ValueError("no Kafka brokers given")
    return [h if "://" in h else f"kafka://{h}" for h in hosts]


def faust_credentials(conf: Mapping[str, str]) -> Any:
    """librdkafka security settings -> Faust broker_credentials (None for plaintext)."""
    protocol = conf.get("security.protocol", "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        return None
    ctx = None
    if protocol in ("SSL", "SASL_SSL"):
        ctx = ssl.create_default_context(cafile=conf.get("ssl.ca.location") or None)
        if conf.get("ssl.certificate.location"):
            ctx.load_cert_chain(conf["ssl.certificate.location"], conf.get("ssl.key.location") or None,
                                conf.get("ssl.key.password") or None)
        if conf.get("ssl.endpoint.identification.algorithm", "https").lower() == "none":
            ctx.check_hostname = False
    if protocol == "SSL":
        return faust.SSLCredentials(ctx)
    if protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        mech = conf.get("sasl.mechanism", conf.get("sasl.mechanisms", "PLAIN")).upper()
        return faust.SASLCredentials(username=conf.get("sasl.username"), password=conf.get("sasl.password"),
                                     ssl_context=ctx, mechanism=mech)
    raise ValueError(f"unsupported security.protocol {protocol!r}")


def aiokafka_security(conf: Mapping[str, str]) -> dict[str, Any]:
    """librdkafka security settings -> aiokafka client arguments (the policy reader's)."""
    creds = faust_credentials(conf)
    if creds is None:
        return {}
    if isinstance(creds, faust.SSLCredentials):
        return {"security_protocol": "SSL", "ssl_context": creds.context}
    protocol = conf.get("security.protocol", "").upper()
    return {"security_protocol": protocol, "ssl_context": creds.ssl_context,
            "sasl_mechanism": creds.mechanism.value if hasattr(creds.mechanism, "value") else str(creds.mechanism),
            "sasl_plain_username": creds.username, "sasl_plain_password": creds.password}
