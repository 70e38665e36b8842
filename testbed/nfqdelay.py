"""A packet delayer for kernels without ``sch_netem``: nftables queues a host's outgoing packets
(``queue num N``) to this process over netfilter's queue netlink protocol (NFQUEUE), which holds
each one ``--delay-ms`` and then gives the kernel its verdict (accept). The packets themselves
never leave the kernel (metadata copy only); order is kept (one constant delay, FIFO).

Raw netlink, standard library only. Verdicts are batched: an accept for packet id ``i``
accepts every queued id up to ``i`` (``NFQNL_MSG_VERDICT_BATCH``), so a notification the
socket dropped under load cannot strand its packet. Run inside the namespace whose nftables
queue it serves (``testbed.netns.Host.delay``)::

    python -m testbed.nfqdelay --queue 0 --delay-ms 2

Prints one JSON line ``{"nfqdelay": {...}}`` when bound and, on SIGTERM, its counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NETLINK_NO_ENOBUFS = 5
SOL_NETLINK = 270
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQA_CFG_F_GSO = 1 << 2  # take GSO packets whole (64 KiB), as the stack sends them: far fewer to handle
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _msg(kind: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body


def _attrs(data: bytes):
    """(type, payload) of each netlink attribute in ``data``."""
    at = 0
    while at + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, at)
        if length < 4:
            return
        yield kind & 0x3FFF, data[at + 4:at + length]
        at += (length + 3) & ~3


class Delayer:
    def __init__(self, queue: int, delay_s: float, maxlen: int = 16384) -> None:
        self.queue, self.delay_s = queue, delay_s
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        self.sock.bind((0, 0))
        self.held: collections.deque[tuple[float, int]] = collections.deque()  # (release at, id)
        self.seen = self.released = 0
        self.max_held = 0
        self._config(_attr(NFQA_CFG_CMD, struct.pack("=BxH", NFQNL_CFG_CMD_BIND, 0)), 1)
        self._config(_attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META))
                     + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", maxlen))
                     + _attr(NFQA_CFG_MASK, struct.pack(">I", NFQA_CFG_F_GSO))
                     + _attr(NFQA_CFG_FLAGS, struct.pack(">I", NFQA_CFG_F_GSO)), 2)

    def _config(self, attrs: bytes, seq: int) -> None:
        self.sock.send(_msg(NFQNL_MSG_CONFIG, self.queue, attrs, NLM_F_REQUEST | NLM_F_ACK, seq))
        data = self.sock.recv(65536)
        _, kind, _, _, _ = struct.unpack_from("=IHHII", data)
        if kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, 16)
            if err:
                raise OSError(-err, f"NFQUEUE config of queue {self.queue}: {os.strerror(-err)}")

    def _receive(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            now = time.monotonic()
            at = 0
            while at + 16 <= len(data):
                length, kind, _, _, _ = struct.unpack_from("=IHHII", data, at)
                if length < 16:
                    break
                if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    for a, payload in _attrs(data[at + 20:at + length]):
                        if a == NFQA_PACKET_HDR:
                            (pid,) = struct.unpack_from(">I", payload)
                            self.held.append((now + self.delay_s, pid))
                            self.seen += 1
                at += (length + 3) & ~3
            self.max_held = max(self.max_held, len(self.held))

    def _release_due(self) -> None:
        now = time.monotonic()
        last = None
        while self.held and self.held[0][0] <= now:
            last = self.held.popleft()[1]
            self.released += 1
        if last is not None:  # accepts every id up to ``last``
            self.sock.send(_msg(NFQNL_MSG_VERDICT_BATCH, self.queue,
                                _attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, last))))

    def run(self, stop) -> None:
        while not stop():
            wait = max(0.0, self.held[0][0] - time.monotonic()) if self.held else 0.5
            ready, _, _ = select.select([self.sock], [], [], wait)
            if ready:
                self._receive()
            self._release_due()

    def release_all(self) -> None:
        """Accept everything held (on the way out: an unbound queue would drop it)."""
        if self.held:
            last = self.held[-1][1]
            self.released += len(self.held)
            self.held.clear()
            self.sock.send(_msg(NFQNL_MSG_VERDICT_BATCH, self.queue,
                                _attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, last))))

    def counts(self) -> dict:
        return {"queue": self.queue, "delay_ms": self.delay_s * 1000, "packets": self.seen,
                "released": self.released, "max_held": self.max_held}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queue", type=int, default=0)
    p.add_argument("--delay-ms", type=float, required=True)
    args = p.parse_args(argv)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    d = Delayer(args.queue, args.delay_ms / 1000)
    print(json.dumps({"nfqdelay": {"bound": True, **d.counts()}}), flush=True)
    try:
        d.run(lambda: bool(stopping))
    finally:
        d.release_all()
        print(json.dumps({"nfqdelay": d.counts()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
