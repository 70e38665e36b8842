"""Helpers shared by the test suite: role processes, summaries and Kafka probes through the
plain client (``tests.support.kafka``); free ports and deadline polls, re-exported from
``testbed`` (which bench/ uses too)."""

from testbed.ports import free_port, free_port_pair, free_ports
from tests.support.procs import Procs, Role, http_json, summary_from_text, summary_of
from testbed.wait import wait_for

__all__ = ["Procs", "Role", "free_port", "free_port_pair", "free_ports", "http_json", "summary_from_text",
           "summary_of", "wait_for"]
