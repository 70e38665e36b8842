"""Free TCP ports on 127.0.0.1."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports whose first two are adjacent (LocalKafka's controller is port + 1)."""
    from localkafka.probe import port_is_free

    for _ in range(100):
        base = free_port()
        if base + 1 >= 65535 or not (port_is_free(base) and port_is_free(base + 1)):
            continue
        ports = [base, base + 1]
        while len(ports) < n:
            p = free_port()
            if p not in ports:
                ports.append(p)
        return ports
    raise RuntimeError("no two adjacent free ports on 127.0.0.1")


def free_port_pair() -> int:
    """A port p with p and p + 1 free."""
    return free_ports(2)[0]
