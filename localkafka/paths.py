"""Where a Kafka version lives and what every ``localkafka`` module shares: the pinned versions and
their Maven coordinates, the cache directories (``<cache>/kafka-<ver>``), the errors, and the small
file helpers (a lock, an atomic write, a log's tail). Standard library only."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path
from typing import Iterator

from config.env import Environment  # standard library only: this runs before the package is installed

KAFKA_VERSION = "3.9.1"
SCALA_BINARY = "2.13"
# Kafka 3.x ships no logging backend at runtime; slf4j 1.7 + reload4j is what
# its own distribution uses.
LOGGING_DEPS_3X = (
    ("org.slf4j", "slf4j-reload4j", "1.7.36"),
    ("ch.qos.reload4j", "reload4j", "1.2.25"),
)
# Kafka 4.x moved to log4j2; kafka-server brings log4j-api/-core but the code
# still logs through slf4j 1.7, so the binding is log4j-slf4j-impl.
LOGGING_DEPS_4X = (
    ("org.apache.logging.log4j", "log4j-slf4j-impl", "2.24.3"),
    ("org.apache.logging.log4j", "log4j-core", "2.24.3"),
)

DEFAULT_PORT = 9092
HOST = "127.0.0.1"


class BrokerError(RuntimeError):
    """Any failure to fetch, start or stop the local broker (message is user-facing)."""


class PortBusyError(BrokerError):
    """The port is held by something that is not a Kafka broker we manage."""

    def __init__(self, message: str, *, is_kafka: bool) -> None:
        super().__init__(message)
        self.is_kafka = is_kafka


def default_version(env: Environment | None = None) -> str:
    return (env or Environment.read()).kafka_version or KAFKA_VERSION


def cache_root(env: Environment | None = None) -> Path:
    """``RLSTREAM_CACHE``, else ``~/.cache/rlstream`` (``env`` None: this process's environment)."""
    given = (env or Environment.read()).cache_dir
    if given:
        return Path(given).expanduser()
    return Path.home() / ".cache" / "rlstream"


def kafka_home(version: str) -> Path:
    """``<cache>/kafka-<version>``: pom.xml, lib/, log4j config, default data dirs."""
    return cache_root() / f"kafka-{version}"


def major_version(version: str) -> int:
    try:
        return int(version.split(".", 1)[0])
    except ValueError:
        raise BrokerError(f"cannot parse Kafka version {version!r}") from None


def maven_coordinates(version: str) -> list[tuple[str, str, str]]:
    logging_deps = LOGGING_DEPS_4X if major_version(version) >= 4 else LOGGING_DEPS_3X
    return [("org.apache.kafka", f"kafka_{SCALA_BINARY}", version), *logging_deps]


def lib_dir(version: str) -> Path:
    return kafka_home(version) / "lib"


def log_config_path(version: str) -> Path:
    name = "log4j2.properties" if major_version(version) >= 4 else "log4j.properties"
    return kafka_home(version) / name


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(_ANSI.sub("", text).rstrip().splitlines()[-lines:])


def tail_file(path: Path, lines: int = 60) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            return _tail(f.read().decode("utf-8", "replace"), lines)
    except OSError:
        return f"(no log at {path})"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
