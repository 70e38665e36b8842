"""Kafka's own command-line tools (the ``kafka-tools`` jar), run against any bootstrap.

What a Kafka user would check rlstream with, so tests can assert against it::

    rows = describe_group("127.0.0.1:9092", "learner")   # kafka-consumer-groups --describe
    rows[0]["CURRENT-OFFSET"], rows[0]["LOG-END-OFFSET"], rows[0]["LAG"]   # ints (None for "-")
    out = run_tool(CONSUMER_GROUPS, "--list", bootstrap=b).stdout
    log_dir_bytes(b, ["t"])                                   # {"t": bytes on the brokers' disks}

The jars (``org.apache.kafka:kafka-tools:<broker version>`` and its runtime deps) are fetched
with mvn into ``<cache>/kafka-tools-<version>/lib`` (``localkafka.fetch_maven``).
``command_config`` (a dict) becomes the tools' ``--command-config`` file (SASL/SSL settings).
Standard library only, like the rest of ``localkafka``.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Mapping

from localkafka.fetch import check_java, fetch_maven
from localkafka.paths import (
    LOGGING_DEPS_3X,
    LOGGING_DEPS_4X,
    BrokerError,
    _tail,
    cache_root,
    default_version,
    major_version,
)

CONSUMER_GROUPS = "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand"
LOG_DIRS = "org.apache.kafka.tools.LogDirsCommand"


class ToolError(BrokerError):
    """A Kafka tool exited non-zero (the message has its output)."""


def tools_home(version: str) -> Path:
    return cache_root() / f"kafka-tools-{version}"


def fetch_tools(version: str | None = None, *, quiet: bool = False) -> Path:
    """The lib dir holding ``kafka-tools`` of ``version`` (the broker's by default) and its deps."""
    version = version or default_version()
    logging_deps = LOGGING_DEPS_4X if major_version(version) >= 4 else LOGGING_DEPS_3X
    coords = [("org.apache.kafka", "kafka-tools", version), *logging_deps]
    lib = fetch_maven(tools_home(version), coords, what=f"Kafka tools {version}",
                             expect=f"kafka-tools-{version}", quiet=quiet)
    conf = tools_home(version) / "tools-log4j.properties"
    if not conf.is_file():  # warnings only, on stderr: stdout is the tool's answer
        conf.write_text("log4j.rootLogger=WARN, stderr\n"
                        "log4j.appender.stderr=org.apache.log4j.ConsoleAppender\n"
                        "log4j.appender.stderr.Target=System.err\n"
                        "log4j.appender.stderr.layout=org.apache.log4j.PatternLayout\n"
                        "log4j.appender.stderr.layout.ConversionPattern=[%d] %p %m (%c)%n\n"
                        "rootLogger.level = WARN\n")
    return lib


def run_tool(main_class: str, *args: str, bootstrap: str | None, version: str | None = None,
             command_config: Mapping[str, str] | None = None, config_flag: str = "--command-config",
             timeout: float = 300.0, check: bool = True) -> subprocess.CompletedProcess:
    """Run one tool's main class with ``--bootstrap-server bootstrap`` (omitted when None) and
    ``args``; ``command_config`` is passed as a properties file after ``config_flag``. Returns the
    finished process (text stdout/stderr); raises ``ToolError`` on a non-zero exit if ``check``."""
    version = version or default_version()
    lib = fetch_tools(version, quiet=True)
    java = check_java(version)
    conf = tools_home(version) / "tools-log4j.properties"
    log_opt = (f"-Dlog4j2.configurationFile={conf}" if major_version(version) >= 4
               else f"-Dlog4j.configuration=file:{conf}")
    cmd = [java, "-Xmx512m", log_opt, "-cp", str(lib / "*"), main_class, *args]
    if bootstrap is not None:
        cmd += ["--bootstrap-server", bootstrap]
    with tempfile.TemporaryDirectory(prefix="rlstream-tools-") as tmp:
        if command_config:
            path = Path(tmp) / "client.properties"
            path.write_text("".join(f"{k}={v}\n" for k, v in command_config.items()))
            cmd += [config_flag, str(path)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise ToolError(f"{main_class.rsplit('.', 1)[-1]} {' '.join(args)} exited {res.returncode}:\n"
                        f"{_tail(res.stdout + res.stderr)}")
    return res


def parse_table(text: str) -> list[dict[str, object]]:
    """Rows of a whitespace-aligned table whose header line starts with GROUP (the output of
    ``--describe``); numeric cells become ints, ``-`` becomes None."""
    rows: list[dict[str, object]] = []
    header: list[str] | None = None
    for line in text.splitlines():
        cells = line.split()
        if not cells:
            continue
        if cells[0] == "GROUP":
            header = cells
            continue
        if header is None or len(cells) < len(header):
            continue
        row: dict[str, object] = {}
        for key, cell in zip(header, cells):
            row[key] = None if cell == "-" else int(cell) if re.fullmatch(r"-?\d+", cell) else cell
        rows.append(row)
    return rows


def describe_group(bootstrap: str, group: str, deadline_s: float = 120.0, **kw) -> list[dict[str, object]]:
    """``kafka-consumer-groups --describe --group group``, parsed: one dict per partition with
    GROUP, TOPIC, PARTITION, CURRENT-OFFSET, LOG-END-OFFSET, LAG, CONSUMER-ID, HOST, CLIENT-ID.
    The raw text is on the returned list's ``text`` attribute. A retriable failure of the tool (its
    admin client timing out on a busy broker, ``TimeoutException``) is run again until
    ``deadline_s``; the tool itself waits 30 s per call instead of its default 5 s."""
    until = time.monotonic() + deadline_s
    while True:
        res = run_tool(CONSUMER_GROUPS, "--describe", "--group", group, "--timeout", "30000",
                       bootstrap=bootstrap, **kw)
        if "TimeoutException" not in res.stdout + res.stderr or time.monotonic() >= until:
            break
    rows = _Rows(parse_table(res.stdout))
    rows.text = res.stdout
    return rows


class _Rows(list):
    text: str = ""


def log_dir_bytes(bootstrap: str, topics: list[str], **kw) -> dict[str, int]:
    """``kafka-log-dirs --describe`` (DescribeLogDirs): bytes each topic takes on the brokers'
    disks, summed over partitions, replicas and log dirs."""
    res = run_tool(LOG_DIRS, "--describe", "--topic-list", ",".join(topics), bootstrap=bootstrap, **kw)
    doc = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("{")))
    out = dict.fromkeys(topics, 0)
    for b in doc["brokers"]:
        for d in b["logDirs"]:
            for p in d["partitions"]:
                topic = p["partition"].rsplit("-", 1)[0]
                if topic in out:
                    out[topic] += int(p["size"])
    return out
