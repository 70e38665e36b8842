"""Security settings reach every Kafka client, and nothing in the package ever unpickles.

No broker here: the effective configurations are inspected (tests/faults/test_sasl.py logs in
to a real SASL listener). The unpickling check parses every source file of the package (an AST
scan, so docstrings that say "no pickle" do not count and aliases do).
"""

from __future__ import annotations

import ast
import os
from dataclasses import replace
from pathlib import Path

import pytest

from config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("config", "rlstream", "streams", "actor", "learner", "agents", "schemas", "runtime", "logtools")
SASL_ENV = {
    "RLSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
    "RLSTREAM_KAFKA_SASL_MECHANISM": "PLAIN",
    "RLSTREAM_KAFKA_SASL_USERNAME": "svc-learner",
    "RLSTREAM_KAFKA_SASL_PASSWORD": "s3cret",
}
EXPECTED = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "sasl.username": "svc-learner",
            "sasl.password": "s3cret"}


@pytest.fixture
def sasl_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("RLSTREAM_KAFKA_"):
            monkeypatch.delenv(k)
    for k, v in SASL_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("KAFKA_BROKERS", "127.0.0.1:1")  # nothing listens: no client connects


def test_sasl_settings_reach_producer_consumer_admin_and_group_readers(sasl_env):
    from config import BusConfig, Environment
    from rlstream.wiring import kafka_bus
    from streams.bus.kafka import KafkaBus

    cfg = BusConfig.from_environment(Environment.read(), kind="kafka")
    assert cfg.security == EXPECTED and cfg.bootstrap == "127.0.0.1:1"
    assert "s3cret" not in repr(cfg) and "security" not in TrainConfig(bus=cfg).to_dict()["bus"]  # never in a file
    bus = kafka_bus(cfg)
    try:
        for name, conf in (("producer", bus.producer_config), ("consumer", bus.consumer_config),
                           ("admin", bus.admin_config)):
            got = {k: conf.get(k) for k in EXPECTED}
            assert got == EXPECTED, f"{name} client config lacks the security settings: {got}"
        # a per-role override does not drop them, and explicit config wins over the environment
        other = KafkaBus(cfg.bootstrap, config={**cfg.security, "sasl.username": "svc-actor"},
                         consumer_config={"fetch.wait.max.ms": 5})
        try:
            assert other.consumer_config["sasl.username"] == "svc-actor"
            assert other.producer_config["security.protocol"] == "SASL_PLAINTEXT"
        finally:
            other.close(timeout=0)
    finally:
        bus.close(timeout=0)


def test_sasl_settings_reach_the_faust_app_and_its_policy_reader(sasl_env):
    import faust
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    from config import Environment
    from rlstream.wiring import build_faust_app
    from streams.faust_app.clients import aiokafka_security
    from streams.settings import StreamsSettings

    settings = StreamsSettings.from_environment(Environment.read())
    assert dict(settings.client_config) == EXPECTED
    sa = build_faust_app(replace(settings, raw_partitions=1))
    creds = sa.app.conf.broker_credentials
    assert isinstance(creds, faust.SASLCredentials)
    assert (creds.username, creds.password, str(creds.mechanism.value)) == ("svc-learner", "s3cret", "PLAIN")
    # what Faust's aiokafka transport makes of them, and the app's own policy reader
    for kwargs in (credentials_to_aiokafka_auth(creds), aiokafka_security(settings.client_config)):
        assert kwargs["security_protocol"] == "SASL_PLAINTEXT"
        assert (kwargs["sasl_mechanism"], kwargs["sasl_plain_username"], kwargs["sasl_plain_password"]) == \
            ("PLAIN", "svc-learner", "s3cret")


def test_sasl_ssl_carries_the_ca_to_both_clients(sasl_env, monkeypatch):
    certifi = pytest.importorskip("certifi")
    import ssl

    from config import BusConfig, Environment
    from rlstream.wiring import kafka_bus
    from streams.faust_app.clients import aiokafka_security, faust_credentials
    from streams.settings import StreamsSettings

    monkeypatch.setenv("RLSTREAM_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("RLSTREAM_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("RLSTREAM_KAFKA_SSL_CA_LOCATION", certifi.where())
    env = Environment.read()
    bus = kafka_bus(BusConfig.from_environment(env, kind="kafka"))
    try:
        assert bus.consumer_config["ssl.ca.location"] == certifi.where()
        assert bus.admin_config["security.protocol"] == "SASL_SSL"
    finally:
        bus.close(timeout=0)
    conf = StreamsSettings.from_environment(env).client_config
    creds = faust_credentials(conf)
    assert isinstance(creds.ssl_context, ssl.SSLContext) and creds.ssl_context.verify_mode == ssl.CERT_REQUIRED
    kw = aiokafka_security(conf)
    assert kw["security_protocol"] == "SASL_SSL" and kw["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kw["ssl_context"] is not None


# --- no unpickling anywhere ----------------------------------------------------------------------

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve", "joblib", "marshal",
                  "copyreg"}


def unpickling_sites(source: str, filename: str = "<src>") -> list[str]:
    """Every place in ``source`` that could deserialise a pickle: imports of the pickle family,
    ``marshal.loads``, ``torch.load`` without ``weights_only=True``, ``allow_pickle=True``,
    ``__import__``/``import_module`` of those modules, ``pickle`` named in code."""
    tree = ast.parse(source, filename)
    found: list[str] = []

    def where(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PICKLE_MODULES:
                    where(node, f"import {a.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in PICKLE_MODULES:
                where(node, f"from {node.module} import ...")
            elif node.module in ("torch", "torch.serialization", "numpy") and any(a.name == "load" for a in node.names):
                where(node, f"from {node.module} import load")
        elif isinstance(node, ast.Name) and node.id in ("pickle", "cloudpickle", "dill", "cPickle", "_pickle"):
            where(node, f"name {node.id}")
        elif isinstance(node, ast.Call):
            f = node.func
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                mod, attr = f.value.id, f.attr
                if mod == "torch" and attr == "load":
                    wo = kw.get("weights_only")
                    if not (isinstance(wo, ast.Constant) and wo.value is True):
                        where(node, "torch.load( without weights_only=True")
                if mod == "marshal" and attr in ("load", "loads"):
                    where(node, f"marshal.{attr}")
            ap = kw.get("allow_pickle")
            if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                where(node, "allow_pickle=")
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in ("__import__", "import_module") and node.args and isinstance(node.args[0], ast.Constant) \
                    and str(node.args[0].value).split(".")[0] in PICKLE_MODULES:
                where(node, f"{name}({node.args[0].value!r})")
    return found


def test_the_scanner_finds_every_kind_of_unpickling():
    src = """import pickle
import cloudpickle as cp
from dill import loads
import marshal
x = marshal.loads(b'')
import torch
torch.load('f')
torch.load('f', weights_only=False)
torch.load('f', weights_only=True)
import numpy as np
np.load('f', allow_pickle=True)
__import__('pickle')
import importlib
importlib.import_module('dill')
from torch import load
safetensors.torch.load(b'')
s = 'no pickle here'
"""
    lines = sorted(int(f.split(":")[1]) for f in unpickling_sites(src))
    assert lines == [1, 2, 3, 4, 5, 7, 8, 11, 12, 14, 15]  # not 9, 16, 17: the safe ones


def test_no_unpickling_anywhere_in_the_package():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 40, f"package sources not found under {ROOT}"
    found = [site for p in files for site in unpickling_sites(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == [], "unpickling in the package:\n" + "\n".join(found)
