"""The SwitchML worker's stream protocol (Sapio et al., NSDI'21, §3).

:class:`SMLWorker` streams a tensor's chunks through the job's slots: chunk ``i`` in slot
``i mod pool``, a new chunk of a slot when the slot's previous result arrives (the result is the
ACK), version ``uses mod 2`` (the shadow copy), per-slot timeout retransmission, no congestion
control. :class:`~.float_worker.SMLFloatWorker` adds SwitchML's quantization on top.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, List, Optional

import numpy as np

from atp_pipeline.ina.counters import Counters
from atp_pipeline.ina.packet import L2L4_OVERHEAD_BYTES
from atp_pipeline.ina.switchml.wire import SML_HEADER_BYTES, SMLPacket


class SMLWorkerStats(Counters):
    """A SwitchML worker's packet counters."""

    __slots__ = ("sent", "retransmits", "timeouts", "acks", "dup_acks")


class SMLWorker:
    """SwitchML worker: one outstanding chunk per slot, per-slot timeout retransmission."""

    reo_deadline = None  # no reordering timer (only ATP workers have one)

    def __init__(self, job: int, wid: int, host: int, tor: Any, pool: int, k: int, rto: float) -> None:
        self.job, self.wid, self.host, self.pool, self.k, self.rto = job, wid, host, pool, k, rto
        self.tor_addr = tor
        self.size = SML_HEADER_BYTES + 4 * k + L2L4_OVERHEAD_BYTES
        self.stats = SMLWorkerStats()
        self.uses = [0] * pool  # chunks sent through each slot so far (all rounds): version
        self.stride = pool  # items between two uses of one slot
        self.done = True

    def start(self, tensor: np.ndarray, base_seq: int, now: float) -> List[SMLPacket]:
        t = np.asarray(tensor, dtype=np.int32)
        n = max(1, -(-len(t) // self.k))
        buf = np.zeros(n * self.k, dtype=np.int32)
        buf[: len(t)] = t
        self.length, self.n = len(t), n
        self.chunks = buf.reshape(n, self.k)
        self.result = np.zeros((n, self.k), dtype=np.int32)
        self.got = bytearray(n)
        self.n_got = 0
        self.deadline: List[Optional[float]] = [None] * self.pool
        self.cur: List[int] = list(range(min(self.pool, n))) + [-1] * max(0, self.pool - n)
        self.ver: List[int] = [0] * self.pool
        self.timers: Deque[tuple] = deque()
        self.done = False
        return [self._send(i, self.cur[i], now, 0) for i in range(min(self.pool, n))]

    def _send(self, slot: int, chunk: int, now: float, resend: int) -> SMLPacket:
        if not resend:  # a new chunk in this slot flips the slot's version
            self.ver[slot] = self.uses[slot] & 1
            self.uses[slot] += 1
        p = SMLPacket.__new__(SMLPacket)
        p.job, p.slot, p.ver, p.is_result, p.worker, p.off = self.job, slot, self.ver[slot], 0, self.wid, chunk
        p.exp = 0
        p.payload = self.chunks[chunk]
        p.src, p.dst, p.size, p.ecn, p.is_param = self.host, self.tor_addr, self.size, 0, 0
        self.deadline[slot] = now + self.rto
        self.timers.append((now + self.rto, slot, chunk))
        self.stats.sent += 1
        if resend:
            self.stats.retransmits += 1
        return p

    def on_packet(self, p: SMLPacket, now: float) -> List[SMLPacket]:
        if p.job != self.job or not p.is_result:
            return []
        return self._result(p.slot, p.off, p.ver, p.exp, p.payload, now)

    def _result(self, slot: int, c: int, ver: int, exp: int, payload: Optional[np.ndarray],
                now: float) -> List[SMLPacket]:
        """The result of item ``c`` through ``slot`` (version ``ver``): the packets it lets go."""
        if self.done or not 0 <= c < self.n or self.got[c] or not 0 <= slot < self.pool or self.cur[slot] != c:
            self.stats.dup_acks += 1
            return []
        self.stats.acks += 1
        self.got[c] = 1
        self.n_got += 1
        self._store(c, ver, slot, exp, payload)
        nxt = c + self.stride  # the slot's next item
        if self.n_got == self.n:
            self.done = True
            self.timers.clear()
            return []
        if nxt < self.n:
            self.cur[slot] = nxt
            return [self._send(slot, nxt, now, 0)]
        self.cur[slot] = -1
        self.deadline[slot] = None
        return []

    def _store(self, c: int, ver: int, slot: int, exp: int, payload: Optional[np.ndarray]) -> None:
        """Keep the result of chunk ``c``."""
        self.result[c] = payload

    def _valid(self, e: tuple) -> bool:
        d, slot, chunk = e
        return self.cur[slot] == chunk and self.deadline[slot] == d and not self.got[chunk]

    def next_deadline(self) -> Optional[float]:
        t = self.timers
        while t and not self._valid(t[0]):
            t.popleft()
        return t[0][0] if t else None

    def poll(self, now: float) -> List[SMLPacket]:
        """Per-slot timeout: resend the slot's outstanding chunk."""
        out = []
        t = self.timers
        while t and t[0][0] <= now:
            e = t.popleft()
            if self._valid(e):
                self.stats.timeouts += 1
                out.append(self._send(e[1], e[2], now, 1))
        return out

    @property
    def delivered_bytes(self) -> int:
        return self.stats.acks * 4 * self.k

    @property
    def result_tensor(self) -> np.ndarray:
        return self.result.ravel()[: self.length]
