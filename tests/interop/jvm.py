"""Run a small Java program kept in the repo against jars fetched from Maven Central.

``java_program(source, coordinates, what)`` fetches the jars (``localkafka.fetch.fetch_maven``,
cached), compiles ``source`` with ``javac`` into the cache (once per source content) and returns
``run(*args) -> stdout``. Without java/javac/mvn the test is skipped, except under ``CI=true``,
where it fails.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from localkafka.fetch import fetch_maven, maven_is_fetched
from localkafka.paths import cache_root

JAVA_SRC = Path(__file__).parent


def need(tool: str) -> str:
    """Path of ``tool``; skips the test when missing (fails it when CI=true)."""
    found = shutil.which(tool)
    if found is None:
        msg = f"{tool} not found (install a JDK 17 and Maven: apt-get install openjdk-17-jdk-headless maven)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return found


def kafka_tools_ready():
    """``localkafka.kafka_tools`` with Kafka's tools jars fetched (Java needed; Maven to fetch)."""
    from localkafka import kafka_tools
    from localkafka.fetch import MARKER
    from localkafka.paths import default_version

    need("java")
    if not (kafka_tools.tools_home(default_version()) / "lib" / MARKER).is_file():
        need("mvn")
    kafka_tools.fetch_tools(quiet=True)
    return kafka_tools


def java_program(source: Path, coordinates, what: str, expect: str | None = None):
    java, javac = need("java"), need("javac")
    if not maven_is_fetched(cache_root() / "interop" / _slug(coordinates) / "lib", coordinates):
        need("mvn")
    lib = fetch_maven(cache_root() / "interop" / _slug(coordinates), coordinates,
                      what=what, expect=expect, quiet=True)
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    classes = cache_root() / "interop" / f"{source.stem}-{digest}"
    if not (classes / f"{source.stem}.class").is_file():
        staging = classes.with_name(classes.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        res = subprocess.run([javac, "-d", str(staging), "-cp", f"{lib}/*", str(source)],
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"javac {source.name} failed:\n{res.stdout}{res.stderr}"
        shutil.rmtree(classes, ignore_errors=True)
        os.replace(staging, classes)

    def run(*args) -> str:
        res = subprocess.run([java, "-cp", f"{classes}{os.pathsep}{lib}/*", source.stem, *map(str, args)],
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"{source.stem} {args} failed:\n{res.stdout}{res.stderr}"
        return res.stdout

    return run


def _slug(coordinates) -> str:
    return "_".join(f"{a}-{v}" for _, a, v in coordinates)
