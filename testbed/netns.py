"""Simulated hosts: Linux network namespaces on one private switch, with loss, delay and
partitions applied by the kernel.

``Network`` makes a *switch* namespace holding a bridge, and one namespace per ``Host``, each
joined to the bridge by a veth pair, each with its own address in a private /24
(``10.213.X.0/24``, X picked so no address or route of this machine overlaps). This process
(the test, in the root namespace) gets a port on the switch too (``.1``), so it reaches every
host, and only those addresses: nothing else is ever contacted. A process runs on a host as
``host.cmd(argv)`` (``ip netns exec NS argv``: the same pid, so the caller's process group and
the reaper's mark hold).

Impairments, each on the wire or in the host's kernel, never inside a role:

* ``host.loss(pct)``: nftables on the switch drops ``pct``% of the frames leaving and of those
  reaching the host's port (``numgen random mod 100 < pct``);
* ``host.partition()`` / ``host.heal()``: the switch drops every frame from and to the host's port
  (a pulled cable: the host's own stack sees no error, only silence);
* ``host.delay(ms)``: ``tc netem`` on the host's interface where the kernel has ``sch_netem``;
  else the host's outgoing packets go to an NFQUEUE (iptables, ``-j NFQUEUE --queue-bypass``)
  served by ``testbed.nfqdelay``, which holds each ``ms`` in the host's namespace and
  then accepts it. ``DELAY_METHOD`` says which; ``None`` when neither works.

Names carry this process's pid (``rls<pid>-<host>``), so parallel sessions never clash.
``close`` kills every process left in the namespaces (they are this test's) and deletes them;
deleting the switch removes every veth. ``reap_stale`` removes what a session that died left
behind (namespaces whose pid is no longer running), and runs before each new ``Network``.
``unavailable()`` says why namespaces cannot be made here (not root, no ``ip``/``nft``), or None.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from config.env import Environment

PREFIX = "rls"  # namespace names: rls<pid>-<host>; the switch is rls<pid>-sw
SUBNET_BASE = "10.213"
CLONE_NEWNET = 0x40000000
ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str, check: bool = True, ns: str | None = None, input: str | None = None) -> str:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    res = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {res.returncode}: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


def unavailable() -> str | None:
    """Why simulated hosts cannot be made on this machine, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"no `{tool}` binary (apt-get install iproute2 nftables)"
    name = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run("ip", "netns", "add", name)
    except (RuntimeError, OSError) as e:
        return f"cannot create a network namespace: {e}"
    try:
        _run("ip", "netns", "del", name)
    except (RuntimeError, OSError):
        pass
    return None


def has_netem() -> bool:
    """Whether the kernel has ``sch_netem`` (tried on a throwaway namespace's loopback)."""
    name = f"{PREFIX}{os.getpid()}-netem"
    _run("ip", "netns", "add", name)
    try:
        res = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                              "delay", "1ms"], capture_output=True, text=True, timeout=30)
        return res.returncode == 0
    finally:
        _run("ip", "netns", "del", name, check=False)


def has_nfqueue() -> bool:
    """Whether an NFQUEUE rule can be set (iptables with the kernel's NFQUEUE target)."""
    if shutil.which("iptables") is None:
        return False
    name = f"{PREFIX}{os.getpid()}-nfq"
    _run("ip", "netns", "add", name)
    try:
        res = subprocess.run(["ip", "netns", "exec", name, "iptables", "-A", "OUTPUT", "-o", "lo", "-j", "NFQUEUE",
                              "--queue-num", "0", "--queue-bypass"], capture_output=True, text=True, timeout=30)
        return res.returncode == 0
    finally:
        _run("ip", "netns", "del", name, check=False)


def delay_method() -> str | None:
    """``netem``, ``nfqueue`` or None (see the module docstring)."""
    if has_netem():
        return "netem"
    if has_nfqueue():
        return "nfqueue"
    return None


def enter(ns: str) -> None:
    """Move the calling thread (and the threads and processes it starts later) into namespace
    ``ns``. Call it first thing in a fresh process, before any socket or thread exists."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _pid_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone): localkafka's own check."""
    from localkafka.broker import _pid_alive

    return _pid_alive(pid)


def _kill_in(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` and wait until none is left."""
    deadline = time.monotonic() + 30
    while True:
        pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes in {ns} survive SIGKILL: {pids}")
        time.sleep(0.05)


def _delete(ns: str) -> None:
    _kill_in(ns)
    _run("ip", "netns", "del", ns, check=False)


def reap_stale() -> list[str]:
    """Delete the namespaces of sessions that are gone (``rls<pid>-*`` whose pid is not running)."""
    gone = []
    for line in _run("ip", "netns", "list", check=False).splitlines():
        m = re.match(rf"({PREFIX}(\d+)-\S+)", line)
        if m and not _pid_running(int(m.group(2))):
            _delete(m.group(1))
            gone.append(m.group(1))
    return gone


def _free_subnet() -> int:
    """X of a 10.213.X.0/24 no address or route of this namespace touches (from the pid on)."""
    used = _run("ip", "-o", "addr") + _run("ip", "route")
    taken = {int(m) for m in re.findall(rf"{re.escape(SUBNET_BASE)}\.(\d+)\.", used)}
    start = os.getpid() % 250 + 1
    for i in range(250):
        x = (start + i) % 250 + 1
        if x not in taken:
            return x
    raise RuntimeError(f"no free {SUBNET_BASE}.X.0/24")


class Host:
    """One simulated host: a namespace with ``eth0`` at ``address`` on the switch's port ``port``."""

    def __init__(self, net: Network, name: str, address: str, port: str) -> None:
        self.net, self.name, self.address, self.port = net, name, address, port
        self.ns = f"{net.tag}-{name}"
        self.delayer: subprocess.Popen | None = None
        self.delay_ms = 0.0
        self.loss_pct = 0
        self.partitioned = False
        self._cut_dropped = 0  # frames the partitions healed so far dropped

    def cmd(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def run(self, *argv: str, check: bool = True) -> str:
        return _run(*argv, check=check, ns=self.ns)

    # -- impairments (rules on the switch, see the module docstring)
    def loss(self, pct: int) -> None:
        """Drop ``pct``% of the frames in each direction of this host's link (0: none)."""
        self.net.nft(f"flush chain bridge {self.net.table} loss-{self.name}")
        if pct:
            self.net.nft(f"add rule bridge {self.net.table} loss-{self.name} numgen random mod 100 < {int(pct)} "
                         f"counter drop")
        self.loss_pct = int(pct)

    def partition(self) -> None:
        """Cut this host off the switch: every frame from or to it is dropped."""
        self.net.nft(f"add rule bridge {self.net.table} cut-{self.name} counter drop")
        self.partitioned = True

    def heal(self) -> int:
        """Reconnect this host; the frames the partition dropped."""
        dropped = self.dropped()["partition"] - self._cut_dropped
        self.net.nft(f"flush chain bridge {self.net.table} cut-{self.name}")
        self._cut_dropped += dropped
        self.partitioned = False
        return dropped

    def dropped(self) -> dict[str, int]:
        """Frames dropped so far on this host's port: ``{"loss": n, "partition": n}``."""
        out = {}
        for kind, chain in (("loss", f"loss-{self.name}"), ("partition", f"cut-{self.name}")):
            text = self.net.nft(f"list chain bridge {self.net.table} {chain}")
            out[kind] = sum(int(n) for n in re.findall(r"counter packets (\d+)", text))
        out["partition"] += self._cut_dropped
        return out

    def delay(self, ms: float) -> str:
        """Delay every packet this host sends by ``ms`` (see the module docstring); the method used."""
        method = self.net.delay_method
        if method == "netem":
            self.run("tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{ms}ms")
        elif method == "nfqueue":
            self.delayer = subprocess.Popen(
                self.cmd([sys.executable, "-m", "testbed.nfqdelay", "--queue", "0", "--delay-ms", str(ms)]),
                cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                env=Environment.read().child({"PYTHONPATH": str(ROOT)}))
            line = self.delayer.stdout.readline()  # bound first: no packet waits on a queue nobody reads
            if '"bound": true' not in line:
                raise RuntimeError(f"nfqdelay on {self.ns} did not bind: {line}{self.delayer.stdout.read()}")
            self.run("iptables", "-A", "OUTPUT", "-o", "eth0", "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass")
        else:
            raise RuntimeError("delay: unavailable (kernel lacks sch_netem and NFQUEUE)")
        self.delay_ms = ms
        return method

    def delay_counts(self) -> dict:
        """The NFQUEUE delayer's counts (packets held and released), ending it; {} without one."""
        if self.delayer is None:
            return {}
        if self.delayer.poll() is None:
            self.delayer.send_signal(signal.SIGTERM)
        out, _ = self.delayer.communicate(timeout=30)
        self.delayer = None
        lines = [ln for ln in out.splitlines() if ln.startswith('{"nfqdelay"')]
        return json.loads(lines[-1])["nfqdelay"] if lines else {}

    def enter(self) -> None:
        """``enter(self.ns)``: this thread onto this host."""
        enter(self.ns)

    def start_kafka(self, data_dir: Path, port: int = 9092, timeout: float = 180) -> str:
        """A ``LocalKafka`` on this host, listening on and advertising its address; its bootstrap."""
        script = (f"from localkafka.broker import LocalKafka\n"
                  f"k = LocalKafka(port={port}, controller_port={port + 1}, data_dir={str(data_dir)!r}, "
                  f"host={self.address!r}, quiet=True, heap=('-Xms128m', '-Xmx512m'))\n"
                  f"k.start(timeout={timeout})\nprint(k.bootstrap)\n")
        res = subprocess.run(self.cmd([sys.executable, "-c", script]), capture_output=True, text=True,
                             timeout=timeout + 60, cwd=str(ROOT))
        if res.returncode != 0:
            raise RuntimeError(f"no Kafka broker on {self.ns}: {(res.stderr or res.stdout).strip()[-2000:]}")
        return res.stdout.strip().splitlines()[-1]

    def start_redis(self, port: int = 6379, timeout: float = 30) -> str:
        """A throwaway ``redis-server`` on this host's address (no persistence); its URL."""
        subprocess.Popen(self.cmd(["redis-server", "--bind", self.address, "--port", str(port), "--save", "",
                                   "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no"]),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((self.address, port), timeout=1) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return f"redis://{self.address}:{port}/0"
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {self.ns} did not answer within {timeout:.0f}s")
            time.sleep(0.1)

    def impairments(self) -> dict:
        return {"host": self.name, "address": self.address, "loss_pct": self.loss_pct, "delay_ms": self.delay_ms,
                "delay_method": self.net.delay_method if self.delay_ms else None, **self.dropped()}


class Network:
    """A switch namespace with a bridge, this process's port on it, and ``Host``s (see the module
    docstring). Use as a context manager, or call ``close``."""

    def __init__(self) -> None:
        reap_stale()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.table = "rlnet"
        self.x = _free_subnet()
        self.subnet = ipaddress.ip_network(f"{SUBNET_BASE}.{self.x}.0/24")
        self.gateway = str(self.subnet.network_address + 1)  # this process's address on the switch
        self.hosts: dict[str, Host] = {}
        self.delay_method = delay_method()
        self._root_link = f"{self.tag}r"[:15]
        try:
            _run("ip", "netns", "add", self.switch)
            self.sw("ip", "link", "add", "br0", "type", "bridge")
            self.sw("ip", "link", "set", "br0", "up")
            self.nft(f"add table bridge {self.table}")
            self.nft(f"add chain bridge {self.table} forward {{ type filter hook forward priority 0; }}")
            _run("ip", "link", "add", self._root_link, "type", "veth", "peer", "name", "p0", "netns", self.switch)
            self.sw("ip", "link", "set", "p0", "master", "br0", "up")
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self._root_link)
            _run("ip", "link", "set", self._root_link, "up")
        except Exception:
            self.close()
            raise

    def sw(self, *argv: str) -> str:
        return _run(*argv, ns=self.switch)

    def nft(self, command: str) -> str:
        return _run("nft", command, ns=self.switch)

    def add(self, name: str) -> Host:
        """A new host ``name`` on the switch."""
        i = len(self.hosts) + 1
        host = Host(self, name, str(self.subnet.network_address + 10 + i), f"p{i}")
        _run("ip", "netns", "add", host.ns)
        self.sw("ip", "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        self.sw("ip", "link", "set", host.port, "master", "br0", "up")
        host.run("ip", "addr", "add", f"{host.address}/24", "dev", "eth0")
        host.run("ip", "link", "set", "eth0", "up")
        host.run("ip", "link", "set", "lo", "up")
        for chain, match in ((f"cut-{name}", None), (f"loss-{name}", None)):
            self.nft(f"add chain bridge {self.table} {chain}")
            for direction in ("iifname", "oifname"):
                self.nft(f'add rule bridge {self.table} forward {direction} "{host.port}" jump {chain}')
        self.hosts[name] = host
        return host

    def close(self) -> None:
        """Kill whatever runs on the hosts, delete every namespace (and so every link)."""
        for host in self.hosts.values():
            with contextlib.suppress(Exception):
                host.delay_counts()
        for ns in [h.ns for h in self.hosts.values()] + [self.switch]:
            with contextlib.suppress(Exception):
                _delete(ns)
        with contextlib.suppress(Exception):
            _run("ip", "link", "del", self._root_link, check=False)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
