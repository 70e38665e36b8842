"""The ``kafka`` and ``redis`` markers follow the fixtures, and under ``CI=true`` a test skipped
for a missing broker, Redis or Java fails (a pytest plugin, loaded by ``tests/conftest.py``).

* A test whose fixtures (directly or through other fixtures) include one of ``KAFKA_FIXTURES``
  gets the ``kafka`` mark, one with ``REDIS_FIXTURES`` the ``redis`` mark, before ``-m``
  selects: ``-m 'not kafka'`` leaves out every test that needs a broker. A fixture asked for
  by ``request.getfixturevalue`` is not seen: such a test (the ``bus`` parameter ``kafka``)
  carries the mark itself.
* ``KAFKA_BROKERS`` is removed from the environment at the start: a role a test starts without
  naming a broker must not reach a developer's own (``tests/conftest.py`` says which the tests use).
* ``CI=true``: a skip whose reason names a missing service (``MISSING_SERVICE``: a broker,
  Redis, Java, the S3 server moto, network namespaces) is reported as
  a failure, whichever fixture or helper raised it.
"""

from __future__ import annotations

import os
import re

import pytest

KAFKA_FIXTURES = frozenset({"kafka_bootstrap", "suite_kafka", "rl_kafka", "rl_topics", "private_kafka"})
REDIS_FIXTURES = frozenset({"redis_server_url", "redis_url", "redis_prefix"})
MISSING_SERVICE = re.compile(r"kafka|broker|redis|java|javac|mvn|maven|jars|moto|s3fs|network namespace",
                             re.IGNORECASE)


def pytest_configure(config) -> None:
    os.environ.pop("KAFKA_BROKERS", None)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & KAFKA_FIXTURES and item.get_closest_marker("kafka") is None:
            item.add_marker(pytest.mark.kafka)
        if names & REDIS_FIXTURES and item.get_closest_marker("redis") is None:
            item.add_marker(pytest.mark.redis)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.skipped and in_ci() and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if MISSING_SERVICE.search(reason):
            rep.outcome = "failed"
            rep.longrepr = f"CI=true: a test skipped for a missing service fails the run: {reason}"
    return rep
