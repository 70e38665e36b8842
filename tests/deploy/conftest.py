"""The deployment, run for real: images built with podman, compose up, pods from the Kubernetes
manifests, Prometheus and its alerts (marker ``deploy``; the deploy stage of .ci/run runs
``pytest -m deploy``).

Tests marked ``deploy`` run only when asked for by ``-m`` (an expression naming ``deploy``); the
default suite and the slow stage leave them out. Without podman they skip with the reason, and
fail under ``CI=true``. podman gets this repository's settings (compose/podman/containers.conf:
runc, cgroupfs, explicit ulimits) through ``CONTAINERS_CONF``, never /etc."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
CONTAINERS_CONF = COMPOSE / "podman" / "containers.conf"
IMAGES = {
    "rlstream": "localhost/rlstream:latest",
    "kafka": "localhost/rlstream-kafka:3.9.1",
    "redis": "localhost/rlstream-redis:latest",
    "prometheus": "localhost/rlstream-prometheus:latest",
}


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "deploy: builds and runs the images with podman (compose up, pods, alerts); "
                                       "only with -m naming deploy (the deploy stage of .ci/run)")


def pytest_collection_modifyitems(config, items) -> None:
    if "deploy" in (config.option.markexpr or ""):
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("deploy") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def missing(what: str) -> None:
    """Skip with the reason; under CI=true a missing tool is a failure."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{what} (CI=true: the deploy stage installs it)")
    pytest.skip(what)


def podman_env() -> dict[str, str]:
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    env.pop("DOCKER_HOST", None)
    return env


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env=podman_env(), capture_output=True, text=True,
                          check=check, timeout=timeout)


def wait_for(pred: Callable[[], object], timeout: float, what: str, every: float = 1.0,
             on_timeout: Callable[[], str] | None = None):
    """Poll ``pred`` until it returns something truthy, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}"
                        + (f"\n{on_timeout()}" if on_timeout else ""))
        time.sleep(every)


@pytest.fixture(scope="session")
def podman_ready() -> None:
    if shutil.which("podman") is None:
        missing("podman is not installed (apt-get install podman runc catatonit debootstrap)")
    res = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False)
    if res.returncode != 0:
        missing(f"podman does not work here: {res.stderr.strip()[-500:]}")


@pytest.fixture(scope="session")
def images(podman_ready) -> dict[str, str]:
    """The images compose/build-images.sh builds (cached: a no-op when their inputs are unchanged)."""
    if shutil.which("debootstrap") is None and podman("image", "exists", "localhost/rlstream-base:bookworm",
                                                      check=False).returncode != 0:
        missing("debootstrap is not installed and there is no base image")
    res = subprocess.run(["bash", str(COMPOSE / "build-images.sh"), *IMAGES], env=podman_env(),
                         capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, f"build-images.sh failed:\n{res.stderr[-4000:]}"
    return dict(IMAGES)


def compose_cmd() -> list[str]:
    """podman-compose from this Python (the pinned PyPI one: Debian's 1.0.3 predates profiles,
    env_file's `required` and --scale)."""
    try:
        import podman_compose  # noqa: F401
    except ImportError:
        missing("podman-compose is not installed in this Python (pip install podman-compose)")
    return [sys.executable, "-m", "podman_compose"]


class Stack:
    """One compose project (docker-compose.yml + docker-compose.host.yml) on ports of its own."""

    def __init__(self, project: str, env: dict[str, str], workdir: Path) -> None:
        self.project = project
        self.env = {**podman_env(), **env}
        self.workdir = workdir
        self.files = ["-f", str(COMPOSE / "docker-compose.yml"), "-f", str(COMPOSE / "docker-compose.host.yml")]
        self.log = workdir / "compose.log"

    def compose(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        cmd = [*compose_cmd(), "-p", self.project, *self.files, *args]
        res = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        with self.log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{res.stdout}\n{res.stderr}\n")
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
        return res

    def containers(self, all_: bool = True) -> list[dict]:
        res = podman("ps", *(["-a"] if all_ else []), "--format", "json",
                     "--filter", f"label=io.podman.compose.project={self.project}")
        return json.loads(res.stdout or "[]")

    def container(self, service: str) -> dict | None:
        for c in self.containers():
            if c.get("Labels", {}).get("com.docker.compose.service") == service:
                return c
        return None

    def inspect(self, service: str) -> dict:
        c = self.container(service)
        assert c is not None, f"no container for {service}"
        return json.loads(podman("inspect", c["Id"]).stdout)[0]

    def logs(self, service: str, tail: int = 60) -> str:
        c = self.container(service)
        if c is None:
            return f"(no {service} container)"
        res = podman("logs", "--tail", str(tail), c["Id"], check=False)
        return res.stdout + res.stderr

    def all_logs(self) -> str:
        names = sorted({c.get("Labels", {}).get("com.docker.compose.service", "?") for c in self.containers()})
        return "\n".join(f"--- {n} ---\n{self.logs(n, 30)}" for n in names)

    def down(self) -> None:
        with contextlib.suppress(Exception):
            self.compose("--profile", "serve", "--profile", "scale", "down", "-v", "-t", "5", check=False, timeout=240)
        for c in self.containers():  # whatever compose did not remove
            podman("rm", "-f", "-v", c["Id"], check=False)
        for v in self.volumes():
            podman("volume", "rm", "-f", v, check=False)

    def volumes(self) -> list[str]:
        res = podman("volume", "ls", "--format", "{{.Name}}", check=False)
        return [v for v in res.stdout.split() if v.startswith(f"{self.project}_")]

    def networks(self) -> list[str]:
        res = podman("network", "ls", "--format", "{{.Name}}", check=False)
        return [n for n in res.stdout.split() if n.startswith(f"{self.project}_")]

    def pods(self) -> list[str]:
        res = podman("pod", "ps", "--format", "{{.Name}}", check=False)
        return [p for p in res.stdout.split() if self.project in p]


@pytest.fixture
def stack_factory(images, tmp_path) -> Iterator[Callable[[dict[str, str]], Stack]]:
    made: list[Stack] = []

    def make(env: dict[str, str]) -> Stack:
        s = Stack(f"rlsdeploy{os.getpid()}x{len(made)}", env, tmp_path)
        made.append(s)
        return s

    yield make
    for s in made:
        s.down()


@pytest.fixture(scope="session")
def docker_api(podman_ready, tmp_path_factory) -> Iterator[str]:
    """podman's Docker-compatible API on a socket of this session (for testcontainers and
    docker-py), with Ryuk (the reaper, an image that cannot be pulled here) off: the fixtures
    that start containers stop them."""
    sock = tmp_path_factory.mktemp("podman-api") / "podman.sock"
    url = f"unix://{sock}"
    proc = subprocess.Popen(["podman", "system", "service", "--time", "0", url], env=podman_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    saved = {k: os.environ.get(k) for k in ("DOCKER_HOST", "TESTCONTAINERS_RYUK_DISABLED")}
    try:
        wait_for(lambda: sock.exists() or proc.poll() is not None, 30, "podman's API socket", every=0.2)
        assert proc.poll() is None, proc.stderr.read().decode(errors="replace")
        os.environ["DOCKER_HOST"] = url
        os.environ["TESTCONTAINERS_RYUK_DISABLED"] = "true"
        yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
