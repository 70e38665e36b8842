"""A real S3-compatible server for the tests and bench/: moto's server mode (``python -m moto.server``)
as its own process, in its own session, on a free port of 127.0.0.1.

    with MotoServer() as s3:            # ended (the whole process group) pass or fail
        cfg = s3.config()               # ObjectStoreConfig: endpoint and test credentials
        s3.make_bucket("snaps")
        store = open_store("s3://snaps/run1", object_store=cfg)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from config.env import Environment
from config.storage import ObjectStoreConfig
from testbed.ports import free_port
from testbed.wait import wait_for

#: moto takes any credentials; these are what every client of the server signs with.
ACCESS_KEY, SECRET_KEY, REGION = "testing-key", "testing-secret", "eu-west-1"


def moto_available() -> bool:
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return True


class MotoServer:
    """``moto.server`` on a free port; ``stop`` (or leaving the ``with``) kills its process group."""

    def __init__(self, log: Path | None = None, start_timeout_s: float = 60.0) -> None:
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.log = log or Path(tempfile.mkdtemp(prefix="moto-")) / "moto.log"
        self._out = self.log.open("ab")
        env = {k: v for k, v in Environment.read().values.items() if not k.startswith("AWS_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_for(self._up, start_timeout_s, f"moto server (S3) on {self.endpoint_url}",
                     every=0.05, on_timeout=self.tail)
        except BaseException:
            self.stop()
            raise

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"moto server (S3) exited with {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(self.endpoint_url + "/moto-api/", timeout=1.0) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def config(self) -> ObjectStoreConfig:
        return ObjectStoreConfig(endpoint_url=self.endpoint_url, region=REGION, access_key_id=ACCESS_KEY,
                                 secret_access_key=SECRET_KEY)

    def env(self) -> dict[str, str]:
        """The AWS variables of a process that should use this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_REGION": REGION, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

    def filesystem(self):
        """An s3fs filesystem on this server (to make buckets, or to look behind a store's back)."""
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint_url, key=ACCESS_KEY, secret=SECRET_KEY,
                                 client_kwargs={"region_name": REGION}, use_listings_cache=False,
                                 skip_instance_cache=True)

    def make_bucket(self, name: str) -> None:
        self.filesystem().mkdir(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._out.close()

    def __enter__(self) -> "MotoServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
