"""Listeners of a local Kafka node beside its PLAINTEXT one: TLS (``SSL``), SASL over TLS
(``SASL_SSL``) and SASL without it (``SASL_PLAINTEXT``), with SCRAM-SHA-512 and PLAIN accounts.

``Security`` says which listeners and accounts a node has; ``security_properties`` renders them as
``server.properties`` entries (``render.server_properties`` merges them), and ``scram_format_args``
are the ``StorageTool format --add-scram`` arguments that store the SCRAM accounts in the cluster's
metadata when the node is formatted (KRaft keeps SCRAM credentials there; the broker needs no
JAAS list of them). Certificates are PEM files (Kafka >= 2.7: ``ssl.keystore.type=PEM``), made by
``testbed.tls`` in the tests or by any CA. The inter-broker and controller listeners stay
PLAINTEXT on 127.0.0.1. Standard library only.

    sec = Security(ssl_port=19094, sasl_ssl_port=19095, keystore="server-keystore.pem",
                   truststore="ca.pem", client_auth="required",
                   scram_users={"svc": "svc-secret"}, plain_users={"svc": "svc-secret"})
    LocalKafka(port=19092, security=sec).start()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from localkafka.paths import BrokerError

#: The SCRAM mechanism the accounts are made for (the stronger of Kafka's two).
SCRAM_MECHANISM = "SCRAM-SHA-512"
CLIENT_AUTH = ("none", "requested", "required")


@dataclass(frozen=True)
class Security:
    """Listeners and accounts of one node (a port of None: no such listener).

    ``keystore``: one PEM file with the server's private key (PKCS#8, unencrypted) and its
    certificate chain, for both TLS listeners; ``truststore``: the PEM CA that client
    certificates must be signed by; ``client_auth``: whether the ``SSL`` listener asks clients for
    a certificate (``none``, ``requested``, ``required``: mutual TLS; the SASL listeners log in by
    password and never ask). ``scram_users`` log in with SCRAM-SHA-512, ``plain_users`` with
    PLAIN, on either SASL listener."""

    ssl_port: int | None = None
    sasl_ssl_port: int | None = None
    sasl_plaintext_port: int | None = None
    keystore: str | None = None
    truststore: str | None = None
    client_auth: str = "none"
    scram_users: Mapping[str, str] = field(default_factory=dict)
    plain_users: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.client_auth not in CLIENT_AUTH:
            raise BrokerError(f"client_auth must be one of {', '.join(CLIENT_AUTH)}, not {self.client_auth!r}")
        if (self.ssl_port or self.sasl_ssl_port) and not self.keystore:
            raise BrokerError("a TLS listener needs a keystore (the server's PEM key and certificate chain)")
        if self.client_auth != "none" and not self.truststore:
            raise BrokerError(f"client_auth={self.client_auth} needs a truststore (the CA of the client certificates)")
        if (self.sasl_ssl_port or self.sasl_plaintext_port) and not (self.scram_users or self.plain_users):
            raise BrokerError("a SASL listener needs accounts (scram_users or plain_users)")
        for users in (self.scram_users, self.plain_users):
            for name, password in users.items():
                for what, text in (("name", name), ("password", password)):
                    if not text or any(c in text for c in '"\\=,[]\n\r'):
                        raise BrokerError(f"SASL account {name!r}: its {what} must be non-empty, without "
                                          "quotes, backslashes, '=', ',', brackets or line breaks")

    def listeners(self) -> dict[str, int]:
        """Listener name (= its security protocol) -> port, for the listeners this node has."""
        ports = {"SSL": self.ssl_port, "SASL_SSL": self.sasl_ssl_port, "SASL_PLAINTEXT": self.sasl_plaintext_port}
        return {name: port for name, port in ports.items() if port}

    def mechanisms(self) -> list[str]:
        return ([SCRAM_MECHANISM] if self.scram_users else []) + (["PLAIN"] if self.plain_users else [])


def _jaas_plain(users: Mapping[str, str]) -> str:
    # PlainLoginModule wants a login of the broker's own (unused: the inter-broker listener is
    # PLAINTEXT); user_<name>="<password>" are the accounts clients may use.
    first, password = next(iter(users.items()))
    accounts = " ".join(f'user_{u}="{p}"' for u, p in users.items())
    return ('org.apache.kafka.common.security.plain.PlainLoginModule required '
            f'username="{first}" password="{password}" {accounts};')


def security_properties(sec: Security, host: str) -> dict[str, str]:
    """``sec``'s listeners as ``server.properties`` entries: ``listeners``, ``advertised.listeners``
    and ``listener.security.protocol.map`` *additions* (``render.server_properties`` appends them to
    its own), the PEM key and trust stores, and each SASL listener's mechanisms and logins."""
    listeners = sec.listeners()
    if not listeners:
        return {}
    out: dict[str, str] = {
        "+listeners": ",".join(f"{n}://{host}:{p}" for n, p in listeners.items()),
        "+listener.security.protocol.map": ",".join(f"{n}:{n}" for n in listeners),
    }
    if sec.keystore:
        out.update({"ssl.keystore.type": "PEM", "ssl.keystore.location": str(sec.keystore)})
    if sec.truststore:
        out.update({"ssl.truststore.type": "PEM", "ssl.truststore.location": str(sec.truststore)})
    if "SSL" in listeners:
        out["listener.name.ssl.ssl.client.auth"] = sec.client_auth
    if sec.sasl_ssl_port or sec.sasl_plaintext_port:
        out["sasl.enabled.mechanisms"] = ",".join(sec.mechanisms())
    for name in ("SASL_SSL", "SASL_PLAINTEXT"):
        if name not in listeners:
            continue
        prefix = f"listener.name.{name.lower()}"
        out[f"{prefix}.sasl.enabled.mechanisms"] = ",".join(sec.mechanisms())
        if sec.scram_users:
            out[f"{prefix}.{SCRAM_MECHANISM.lower()}.sasl.jaas.config"] = \
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        if sec.plain_users:
            out[f"{prefix}.plain.sasl.jaas.config"] = _jaas_plain(sec.plain_users)
        if name == "SASL_SSL":
            out[f"{prefix}.ssl.client.auth"] = "none"
    return out


def scram_format_args(sec: Security | None) -> list[str]:
    """``--add-scram`` arguments of ``StorageTool format`` for ``sec``'s SCRAM accounts."""
    if sec is None:
        return []
    out: list[str] = []
    for name, password in sec.scram_users.items():
        out += ["--add-scram", f'{SCRAM_MECHANISM}=[name={name},password="{password}"]']
    return out
