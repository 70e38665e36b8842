"""The simulated-host harness itself (``testbed.netns``), with plain sockets: hosts reach
each other and this process by their addresses, a partition silences a host and heal brings it
back, loss drops frames, delay holds each packet, and nothing is left behind."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from testbed import netns
from testbed.wait import wait_for
from tests.hosts.conftest import missing

ECHO = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7000)); s.listen(64)
print("up", flush=True)
while True:
    c, _ = s.accept(); c.sendall(c.recv(16)); c.close()
"""
PING = """
import socket, sys, time
t = time.monotonic()
c = socket.create_connection((sys.argv[1], 7000), timeout=3); c.sendall(b"x"); assert c.recv(16) == b"x"; c.close()
print((time.monotonic() - t) * 1000)
"""

SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(50):
    s.sendto(b"x", (sys.argv[1], int(sys.argv[2]))); time.sleep(0.01)
"""


def _ms(address: str, timeout: float = 3.0) -> float:
    """Connect, send a byte, read it back: milliseconds (two round trips). An ``OSError`` if the
    host does not answer within ``timeout``: reaching it is the check, never how fast (a loaded
    machine may take any time)."""
    t = time.monotonic()
    with socket.create_connection((address, 7000), timeout=timeout) as c:
        c.sendall(b"x")
        assert c.recv(16) == b"x"
    return (time.monotonic() - t) * 1000


@pytest.fixture
def net():
    why = netns.unavailable()
    if why is not None:
        missing(f"network namespaces unavailable: {why}")  # under CI=true a failure
    n = netns.Network()
    yield n
    n.close()


def _echo(host: netns.Host) -> subprocess.Popen:
    p = subprocess.Popen(host.cmd([sys.executable, "-c", ECHO]), stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    assert p.stdout.readline().strip() == "up"
    return p


def test_hosts_reach_each_other_partition_and_heal(net):
    a, b = net.add("a"), net.add("b")
    assert a.address != b.address
    assert {netns.ipaddress.ip_address(x) in net.subnet for x in (a.address, b.address)} == {True}
    _echo(b)
    _ms(b.address)  # answers
    a.run(sys.executable, "-c", PING, b.address)  # host to host, across the switch (raises if not)
    b.partition()
    with pytest.raises(OSError):
        _ms(b.address, timeout=1.0)
    res = subprocess.run(a.cmd([sys.executable, "-c", PING, b.address]), capture_output=True, text=True)
    assert res.returncode != 0  # a's frames to b are dropped too
    # and what b sends gets nowhere either (one datagram each 10 ms for 0.5 s, to a UDP socket here)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
        rx.bind((net.gateway, 0))
        rx.settimeout(1.0)
        b.run(sys.executable, "-c", SEND, net.gateway, str(rx.getsockname()[1]))
        with pytest.raises(TimeoutError):
            rx.recv(16)
    dropped = b.heal()
    assert dropped > 0
    _ms(b.address)  # answers again
    assert b.dropped()["partition"] == dropped


def test_loss_drops_frames(net):
    b = net.add("b")
    _echo(b)
    b.loss(50)
    for _ in range(20):
        try:
            _ms(b.address, timeout=0.5)
        except OSError:
            pass
    assert b.dropped()["loss"] > 0
    b.loss(0)
    before = b.dropped()["loss"]
    # ARP lost under 50 % loss can leave the neighbour entry FAILED (EHOSTUNREACH) for a moment
    wait_for(lambda: _ms(b.address, timeout=0.5) is not None, 30, "b to answer once loss is off",
             ignore=(OSError,))
    for _ in range(10):
        _ms(b.address)
    assert b.dropped()["loss"] == 0 <= before  # the chain was emptied with its counter


def test_delay_holds_each_packet(net):
    if net.delay_method is None:
        missing("delay: unavailable (kernel lacks sch_netem and NFQUEUE)")
    b = net.add("b")
    _echo(b)
    _ms(b.address)
    plain = min(_ms(b.address) for _ in range(5))
    assert b.delay(40) == net.delay_method
    delayed = [_ms(b.address) for _ in range(5)]
    # b's SYN-ACK and its echo each wait 40 ms: at least 80 ms more than without
    assert min(delayed) >= 80, (plain, delayed)
    if net.delay_method == "nfqueue":
        counts = b.delay_counts()
        assert counts["packets"] >= 10 and counts["released"] == counts["packets"], counts


def test_close_removes_everything_and_stale_namespaces_are_reaped():
    why = netns.unavailable()
    if why is not None:
        missing(f"network namespaces unavailable: {why}")
    n = netns.Network()
    h = n.add("a")
    _echo(h)
    names = [h.ns, n.switch]
    n.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(x in listed for x in names)
    assert n._root_link not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    # a namespace of a session that died (a pid not running) is removed by the next Network
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.PREFIX}{dead.pid}-left"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in netns.reap_stale()
    assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
