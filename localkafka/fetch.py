"""Getting Kafka onto this machine: the jars from Maven Central with ``mvn`` (once, under a lock,
a marker after success), the log config beside them, and finding ``java`` (checked against the
version) and ``mvn``. Standard library only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from config.env import Environment
from localkafka.paths import (
    SCALA_BINARY,
    BrokerError,
    _atomic_write,
    _file_lock,
    _tail,
    default_version,
    kafka_home,
    lib_dir,
    log_config_path,
    major_version,
    maven_coordinates,
)
from localkafka.render import render_log4j, render_log4j2, render_maven_pom

DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
MARKER = ".rlstream-complete"


def find_java(env: Environment | None = None) -> str:
    home = (env or Environment.read()).java_home
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if not java:
        raise BrokerError(
            "java not found: install a JDK/JRE 17+ "
            "(e.g. `apt-get install -y openjdk-17-jre-headless`) or set JAVA_HOME"
        )
    return java


def java_major(java: str) -> int | None:
    try:
        res = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in (res.stderr + res.stdout).splitlines():
        if "version" in line and '"' in line:
            ver = line.split('"')[1]
            head = ver.split(".")
            try:
                return int(head[1]) if head[0] == "1" else int(head[0].split("-")[0])
            except (ValueError, IndexError):
                return None
    return None


def check_java(version: str) -> str:
    java = find_java()
    need = 17 if major_version(version) >= 4 else 11
    have = java_major(java)
    if have is not None and have < need:
        raise BrokerError(f"{java} is Java {have}; Kafka {version} needs Java {need}+")
    return java


def find_mvn() -> str:
    mvn = shutil.which("mvn")
    if not mvn:
        raise BrokerError(
            "mvn not found: install Maven (e.g. `apt-get install -y maven`) "
            "to fetch the Kafka jars"
        )
    return mvn


def is_fetched(version: str) -> bool:
    return maven_is_fetched(lib_dir(version), maven_coordinates(version))


def maven_is_fetched(lib: Path, coordinates: Sequence[tuple[str, str, str]]) -> bool:
    """Whether ``lib`` holds a complete earlier fetch of exactly ``coordinates``."""
    try:
        info = json.loads((lib / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if info.get("coordinates") != [":".join(c) for c in coordinates]:
        return False
    return all((lib / j).is_file() for j in info.get("jars", []))


def write_log_config(version: str) -> Path:
    path = log_config_path(version)
    text = render_log4j2() if major_version(version) >= 4 else render_log4j()
    if not path.is_file() or path.read_text() != text:
        _atomic_write(path, text)
    return path


def fetch(version: str | None = None, *, quiet: bool = False) -> Path:
    """Download Kafka ``version`` and its runtime deps into ``<cache>/kafka-<ver>/lib``.

    Idempotent: a marker written after success makes later calls return at once."""
    version = version or default_version()
    write_log_config(version)
    return fetch_maven(kafka_home(version), maven_coordinates(version), what=f"Kafka {version}",
                       expect=f"kafka_{SCALA_BINARY}-{version}", quiet=quiet)


def fetch_maven(home: Path, coordinates: Sequence[tuple[str, str, str]], *, what: str,
                expect: str | None = None, quiet: bool = False) -> Path:
    """Download Maven ``coordinates`` (group, artifact, version) and their runtime deps from
    Maven Central into ``home/lib`` with ``mvn`` and the pinned dependency plugin; returns the
    lib dir. Idempotent and safe across processes (a lock, a marker written after success).
    ``expect``: a jar name prefix that must be among the jars; ``what`` names it in messages."""
    home = Path(home)
    lib = home / "lib"
    with _file_lock(home / ".fetch.lock"):
        if maven_is_fetched(lib, coordinates):
            return lib
        mvn = find_mvn()
        (home / "pom.xml").write_text(render_maven_pom(f"{home.name}-runtime", coordinates))
        staging = home / "lib.partial"
        shutil.rmtree(staging, ignore_errors=True)
        cmd = [
            mvn, "-B", "-q", "-f", str(home / "pom.xml"),
            # -U: retry artifacts whose earlier download failed (cached misses)
            "-U", "-Dstyle.color=never",
            f"{DEPENDENCY_PLUGIN}:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={staging}",
        ]
        if not quiet:
            print(f"rlstream broker: fetching {what} jars with mvn into {lib} ...",
                  file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            res = subprocess.run(cmd, cwd=home, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired as exc:
            raise BrokerError(f"mvn timed out after {exc.timeout:.0f}s: {' '.join(cmd)}") from None
        if res.returncode != 0:
            raise BrokerError(
                f"mvn failed (exit {res.returncode}) fetching {what}:\n"
                f"  {' '.join(cmd)}\n{_tail(res.stdout + res.stderr)}"
            )
        jars = sorted(p.name for p in staging.glob("*.jar"))
        if expect and not any(j.startswith(expect) for j in jars):
            raise BrokerError(f"mvn succeeded but no {expect} jar in {staging}")
        shutil.rmtree(lib, ignore_errors=True)
        os.replace(staging, lib)
        info = {
            "what": what,
            "coordinates": [":".join(c) for c in coordinates],
            "jars": jars,
            "bytes": sum((lib / j).stat().st_size for j in jars),
            "fetch_seconds": round(time.monotonic() - t0, 1),
        }
        (lib / MARKER).write_text(json.dumps(info, indent=1) + "\n")
        if not quiet:
            print(f"rlstream broker: {len(jars)} jars, {info['bytes'] / 1e6:.1f} MB "
                  f"in {info['fetch_seconds']}s", file=sys.stderr, flush=True)
        return lib
