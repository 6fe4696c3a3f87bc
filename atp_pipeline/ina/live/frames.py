"""Several protocol packets per UDP datagram: the live path's batching.

On hardware every ATP (or SwitchML) packet is one Ethernet frame. On loopback each datagram
costs a system call and a wake-up of the receiving process, far more than the packet's
bytes, so the live roles and workers pack the packets they send to one address into as few
datagrams as fit (:data:`MAX_DATAGRAM` bytes each): a datagram is a concatenation of
encoded packets, byte for byte what :meth:`~atp_pipeline.ina.packet.PacketFormat.encode`
writes. The receiver cuts it back into packets (the format's ``split``) and hands each to the
protocol as before, so the switch function, the PS and the worker stacks see one packet at
a time and nothing of the protocol changes; a datagram holding one packet is the old wire
format (what BMv2's ports send).

A receiver also drains its socket before answering (:func:`drain`): the packets that
arrived meanwhile are processed first and their answers leave batched (:class:`Outbox`).
"""

from __future__ import annotations

import ctypes
import os
import select
import socket
import time
from typing import Callable, Dict, List, Optional, Tuple

Addr = Tuple[str, int]
MAX_DATAGRAM = 65507  # IPv4 UDP payload limit
DRAIN = 64  # datagrams read without blocking after a blocking one, before answering


def drain(sock: socket.socket, limit: int = DRAIN) -> List[Tuple[bytes, Addr]]:
    """The datagrams queued on the non-blocking ``sock`` (at most ``limit``); never waits.

    (The socket must have no timeout: CPython polls a timeout socket before every receive,
    ``MSG_DONTWAIT`` or not, so an empty queue would cost the whole timeout.)"""
    out: List[Tuple[bytes, Addr]] = []
    recv = sock.recvfrom
    for _ in range(limit):
        try:
            out.append(recv(65536))
        except (BlockingIOError, InterruptedError):
            break
        except OSError:  # e.g. ICMP unreachable reported on the socket: skip it
            continue
    return out


#: how long a receiver with a core to itself busy-polls its socket before it blocks (:func:`spin_budget`)
SPIN_S = 0.002


def spin_budget(processes: int) -> float:
    """Seconds a receiver may busy-poll its socket before blocking in ``poll``:
    :data:`SPIN_S` where this process may run on at least two cores per process taking part in a
    sync (``processes``: workers and roles), else 0. A blocked receiver pays a wake-up per
    datagram — on the critical path of every round trip —, and a spinning one takes a core:
    on a host with fewer cores than that (the 2-core test host) it would take it from the
    processes it waits for."""
    return SPIN_S if cores() >= 2 * processes else 0.0


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def sum_threads(processes: int) -> int:
    """Threads the SwitchML switch role sums its lanes in (:attr:`~atp_pipeline.ina.switchml.SMLSwitch.threads`):
    2 where the host has a core for every process taking part in a sync (``processes``: workers and
    roles) and one more, else 1. Where a sync's processes already share the cores, a second thread
    only adds CPU (the switch role used 0.3-0.7 ms more a sync with it on a 2-core host)."""
    return 2 if cores() >= processes + 1 else 1


def spin_drain(sock: socket.socket, spin_s: float, limit: int = DRAIN) -> List[Tuple[bytes, Addr]]:
    """:func:`drain` until something arrives or ``spin_s`` has passed (the non-blocking socket polled
    without sleeping); [] when nothing came."""
    end = time.perf_counter() + spin_s
    while True:
        got = drain(sock, limit)
        if got or time.perf_counter() >= end:
            return got


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest M_MMAP_THRESHOLD on 64-bit


def keep_freed_memory() -> bool:
    """Keep freed buffers in this process's heap (glibc): a live role receives, copies and
    joins tens of 64 KiB datagrams per batch, and with glibc's defaults memory freed at the
    top of the heap goes back to the kernel and the next buffer faults its pages in again
    (``perf`` of the switch role at 16,000 values a packet: page faults 7% of its cycles).
    Allocations below 32 MiB come from the heap and up to 256 MiB of free heap is
    kept. Whether glibc accepted it (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and libc.mallopt(M_TRIM_THRESHOLD, 256 << 20))
    except (OSError, AttributeError):
        return False


def wait_readable(poller: "select.poll", timeout_s: float) -> bool:
    """Whether the socket registered with ``poller`` became readable within ``timeout_s``."""
    return bool(poller.poll(max(0, int(timeout_s * 1000 + 0.999))))


def poller_for(sock: socket.socket) -> "select.poll":
    """Make ``sock`` non-blocking and return a poll object watching it for input."""
    sock.setblocking(False)
    p = select.poll()
    p.register(sock, select.POLLIN)
    return p


class Outbox:
    """Encoded packets queued per destination, sent as datagrams of at most
    :data:`MAX_DATAGRAM` bytes by :meth:`flush` (in the order they were queued)."""

    def __init__(self, send: Callable[[bytes, Addr], None], limit: int = MAX_DATAGRAM) -> None:
        self._send = send
        self.limit = limit
        self.pending: Dict[Addr, List[bytes]] = {}
        self.datagrams = 0

    def put(self, data: bytes, addr: Addr) -> None:
        q = self.pending.get(addr)
        if q is None:
            self.pending[addr] = [data]
        else:
            q.append(data)

    def flush(self) -> None:
        if not self.pending:
            return
        pending, self.pending = self.pending, {}
        send = self._send
        for addr, q in pending.items():
            for data in datagrams(q, self.limit):
                send(data, addr)
                self.datagrams += 1


def datagrams(q: List[bytes], limit: int = MAX_DATAGRAM) -> List[bytes]:
    """Encoded packets ``q`` joined, in order, into as few datagrams of at most ``limit`` bytes as
    a greedy fill makes (one packet: itself)."""
    if len(q) == 1:
        return q
    size = len(q[0])
    if all(len(b) == size for b in q):
        per = max(1, limit // size)
        return [b"".join(q[i:i + per]) for i in range(0, len(q), per)]
    out: List[bytes] = []
    batch: List[bytes] = []
    used = 0
    for b in q:  # mixed sizes: greedy fill
        if batch and used + len(b) > limit:
            out.append(b"".join(batch))
            batch, used = [], 0
        batch.append(b)
        used += len(b)
    if batch:
        out.append(b"".join(batch))
    return out


def sender(sock: socket.socket, errors: Optional[List[int]] = None) -> Callable[[bytes, Addr], None]:
    """``sendto`` that counts (in ``errors[0]``) instead of raising when a peer went away."""

    def send(data: bytes, addr: Addr) -> None:
        try:
            sock.sendto(data, addr)
        except OSError:
            if errors is not None:
                errors[0] += 1

    return send
