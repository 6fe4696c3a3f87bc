"""Background traffic (ATP §7.4): long-lived window-based bulk flows.

A :class:`BulkFlow` sends MTU-sized packets from ``src`` to ``dst`` between ``start`` and
``stop``; the receiver acknowledges every packet and echoes its ECN mark. With
``cc=True`` the sender runs a DCTCP-like AIMD window (slow start, +1 packet per window,
halve at most once per smoothed RTT on an ECN echo or a loss; loss = no ACK within
``rto``); with ``cc=False`` it keeps ``cwnd`` packets in flight regardless. Delivered
bytes are binned over time for goodput plots (Figure 12).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict


class BgPacket:
    __slots__ = ("flow", "seq", "is_ack", "ecn", "src", "dst", "size", "is_param")

    def copy(self) -> "BgPacket":
        p = BgPacket.__new__(BgPacket)
        for s in BgPacket.__slots__:
            setattr(p, s, getattr(self, s))
        return p


@dataclass
class BulkFlowSpec:
    flow: int
    src: int
    dst: int
    start: float = 0.0
    stop: float = 1.0
    cc: bool = True
    cwnd: float = 10.0
    max_cwnd: float = 1000.0
    mtu: int = 1500
    rto: float = 200e-6
    bin: float = 20e-6

    def build(self, fab: Any) -> "BulkFlow":
        return BulkFlow(self, fab)


class _Demux:
    def __init__(self) -> None:
        self.flows: Dict[int, Any] = {}

    def __call__(self, p: BgPacket) -> None:
        f = self.flows.get(p.flow)
        if f is not None:
            (f.on_ack if p.is_ack else f.on_data)(p)


class BulkFlow:
    def __init__(self, spec: BulkFlowSpec, fab: Any) -> None:
        self.s = spec
        self.fab = fab
        self.eng = fab.eng
        self.cwnd = spec.cwnd
        self.ssthresh = float("inf")
        self.inflight: Dict[int, float] = {}
        self.next = 0
        self.srtt = 0.0
        self.last_dec = -1.0
        self.stopped = False
        self.delivered: Dict[int, int] = {}  # bin -> bytes at the receiver
        self.acked_bytes = 0
        for h in (spec.src, spec.dst):
            fab.hosts[h].other.setdefault(BgPacket, _Demux()).flows[spec.flow] = self
        self.eng.at(spec.start, self._send)
        self.eng.at(spec.start + spec.rto, self._timer)

    def stop(self) -> None:
        self.stopped = True

    def _active(self) -> bool:
        return not self.stopped and self.eng.now < self.s.stop

    def _send(self) -> None:
        if not self._active():
            return
        host = self.fab.hosts[self.s.src]
        now = self.eng.now
        while len(self.inflight) < int(self.cwnd):
            p = BgPacket.__new__(BgPacket)
            p.flow, p.seq, p.is_ack, p.ecn, p.src, p.dst, p.size, p.is_param = (
                self.s.flow, self.next, 0, 0, self.s.src, self.s.dst, self.s.mtu, 0)
            self.inflight[self.next] = now
            self.next += 1
            host.send(p)

    def on_data(self, p: BgPacket) -> None:
        b = int(self.eng.now / self.s.bin)
        self.delivered[b] = self.delivered.get(b, 0) + p.size
        a = BgPacket.__new__(BgPacket)
        a.flow, a.seq, a.is_ack, a.ecn, a.src, a.dst, a.size, a.is_param = (
            p.flow, p.seq, 1, p.ecn, self.s.dst, self.s.src, 64, 0)
        self.fab.hosts[self.s.dst].send(a)

    def on_ack(self, p: BgPacket) -> None:
        t = self.inflight.pop(p.seq, None)
        if t is None:
            return
        now = self.eng.now
        self.srtt += (now - t - self.srtt) * 0.125
        self.acked_bytes += self.s.mtu
        if self.s.cc:
            if p.ecn:
                self._decrease(now)
            elif self.cwnd < self.ssthresh:
                self.cwnd += 1
            else:
                self.cwnd += 1 / self.cwnd
            self.cwnd = min(self.cwnd, self.s.max_cwnd)
        self._send()

    def _decrease(self, now: float) -> None:
        if now - self.last_dec >= self.srtt:
            self.cwnd = max(1.0, self.cwnd / 2)
            self.ssthresh = self.cwnd
            self.last_dec = now

    def _timer(self) -> None:
        if self.stopped:
            return
        now = self.eng.now
        lost = [s for s, t in self.inflight.items() if now - t > self.s.rto]
        for s in lost:
            del self.inflight[s]
        if lost and self.s.cc:
            self._decrease(now)
        self._send()
        if self._active() or self.inflight:
            self.eng.after(self.s.rto, self._timer)

    def goodput_gbps(self, t0: float, t1: float) -> float:
        b0, b1 = int(t0 / self.s.bin), int(t1 / self.s.bin)
        return sum(v for k, v in self.delivered.items() if b0 <= k < b1) * 8 / (t1 - t0) / 1e9
