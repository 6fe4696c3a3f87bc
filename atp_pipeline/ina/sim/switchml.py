"""SwitchML baseline (Sapio et al., NSDI'21) inside the same simulator (ATP §3, §6, §7).

SwitchML uses the ToR switch *as* the parameter server: the control plane statically
gives each job a partition of ``pool`` slots for its lifetime (§3 "static allocation");
each slot has two versions (the shadow copy that makes retransmission safe), so a job's
memory is ``2·pool`` aggregators. Worker ``w`` streams its tensor through the slots — chunk
``i`` goes to slot ``i mod pool`` with version ``(i div pool) mod 2`` — and sends the next
chunk of a slot when that slot's result arrives (the result is the ACK). The switch
aggregates a slot until all ``W`` workers contributed, then multicasts the result;
a retransmitted contribution for a completed slot gets the result by unicast. Loss is
recovered by a per-slot timeout only (1 ms in the ATP paper's comparison, §7.2.3); there is
no congestion control and no fallback. Workers must share one rack. Its fault model is
loss: the two-version scheme assumes no duplication and reordering bounded by one slot
version (a duplicate delayed past the slot's next use is counted again), which is why
the exactness property test of this issue covers ATP, not this baseline.

Packets default to 32 int32 lanes (SwitchML's 180-byte packets, §6).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional

import numpy as np

from atp_pipeline.errors import ConfigError
from atp_pipeline.ina.packet import Field, L2L4_OVERHEAD_BYTES
from atp_pipeline.ina.quant import lane_limit
from atp_pipeline.ina.sim.fabric import Fabric, JobDemux, mcast_addr
from atp_pipeline.ina.sim.rounds import RoundJob
from atp_pipeline.ina.counters import Counters

#: SwitchML's header (as modelled): job, slot, version, worker, offset, result flag.
SML_FIELDS = (Field("job", 16), Field("slot", 16), Field("ver", 1), Field("is_result", 1),
              Field("pad", 6), Field("worker", 8), Field("off", 32))
SML_HEADER_BYTES = sum(f.bits for f in SML_FIELDS) // 8


class SMLPacket:
    __slots__ = ("job", "slot", "ver", "is_result", "worker", "off", "payload", "src", "dst", "size", "ecn", "is_param")

    def copy(self) -> "SMLPacket":
        p = SMLPacket.__new__(SMLPacket)
        for s in SMLPacket.__slots__:
            setattr(p, s, getattr(self, s))
        return p


class SMLSwitchJob:
    """One job's static partition on the switch: ``pool`` slots × 2 versions."""

    def __init__(self, job: int, n_workers: int, pool: int, k: int, mcast: int, worker_hosts: List[int]) -> None:
        self.job, self.W, self.pool, self.k = job, n_workers, pool, k
        self.mcast = mcast
        self.hosts = worker_hosts
        self.values = np.zeros((2, pool, k), dtype=np.int32)
        self.count = np.zeros((2, pool), dtype=np.int64).tolist()
        self.seen = [[0] * pool, [0] * pool]  # bitmaps per version
        self.stats = dict(merged=0, complete=0, result_unicast=0, dropped=0)


class SMLSwitch:
    """The SwitchML data plane of one ToR (SwitchML Algorithm with shadow copies)."""

    def __init__(self) -> None:
        self.jobs: Dict[int, SMLSwitchJob] = {}
        self.unknown = 0

    def __call__(self, p: SMLPacket, link: Any) -> List[SMLPacket]:
        js = self.jobs.get(p.job)
        if js is None or p.is_result or not 0 <= p.slot < js.pool or not 0 <= p.worker < js.W:
            self.unknown += 1
            return []
        v, i, bit = p.ver, p.slot, 1 << p.worker
        if not js.seen[v][i] & bit:
            js.seen[v][i] |= bit
            js.seen[v ^ 1][i] &= ~bit
            c = js.count[v][i] = (js.count[v][i] + 1) % js.W
            row = js.values[v, i]
            if c == 1 or js.W == 1:
                row[:] = p.payload
            else:
                np.add(row, p.payload, out=row)
            js.stats["merged"] += 1
            if c == 0:
                js.stats["complete"] += 1
                p.payload = row.copy()
                p.is_result = 1
                p.dst = js.mcast
                return [p]
            return []
        if js.count[v][i] == 0:  # complete: a retransmission gets the result by unicast
            js.stats["result_unicast"] += 1
            p.payload = js.values[v, i].copy()
            p.is_result = 1
            p.dst = js.hosts[p.worker]
            return [p]
        js.stats["dropped"] += 1
        return []


class SMLWorkerStats(Counters):
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
        p.payload = self.chunks[chunk]
        p.src, p.dst, p.size, p.ecn, p.is_param = self.host, self.tor_addr, self.size, 0, 0
        self.deadline[slot] = now + self.rto
        self.timers.append((now + self.rto, slot, chunk))
        self.stats.sent += 1
        if resend:
            self.stats.retransmits += 1
        return p

    def on_packet(self, p: SMLPacket, now: float) -> List[SMLPacket]:
        if self.done or p.job != self.job or not p.is_result:
            return []
        c = p.off
        if not 0 <= c < self.n or self.got[c] or self.cur[p.slot] != c:
            self.stats.dup_acks += 1
            return []
        self.stats.acks += 1
        self.got[c] = 1
        self.n_got += 1
        self.result[c] = p.payload
        nxt = c + self.pool
        if self.n_got == self.n:
            self.done = True
            self.timers.clear()
            return []
        if nxt < self.n:
            self.cur[p.slot] = nxt
            return [self._send(p.slot, nxt, now, 0)]
        self.cur[p.slot] = -1
        self.deadline[p.slot] = None
        return []

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


@dataclass
class SwitchMLJobSpec:
    job: int
    worker_hosts: List[int]
    pool: int = 64  # slots (memory used: 2·pool aggregators)
    tensor_elems: int = 32 * 256
    rounds: int = 1
    compute_time: float = 0.0
    start_time: float = 0.0
    payload_k: int = 32
    rto: float = 1e-3
    seed: int = 0
    constant: Optional[int] = None
    timeline_bin: Optional[float] = None

    def build(self, fab: Fabric, on_finish: Optional[Callable] = None) -> "SwitchMLJob":
        return SwitchMLJob(self, fab, on_finish)


class SwitchMLJob(RoundJob):
    def __init__(self, spec: SwitchMLJobSpec, fab: Fabric, on_finish: Optional[Callable] = None) -> None:
        W = len(spec.worker_hosts)
        super().__init__(spec.job, fab, spec.tensor_elems, spec.rounds, spec.compute_time, spec.start_time,
                         spec.seed, lane_limit(W), spec.constant, on_finish, spec.timeline_bin)
        self.spec = spec
        racks = {fab.hosts[h].rack for h in spec.worker_hosts}
        if len(racks) != 1:
            raise ConfigError(f"SwitchML job {spec.job}: workers must share one rack (single-rack design)")
        rack = racks.pop()
        tor = fab.tors[rack]
        sml = tor.dataplane.get(SMLPacket)
        if sml is None:
            sml = tor.dataplane[SMLPacket] = SMLSwitch()
        self.switch = sml
        g = mcast_addr(spec.job)
        fab.join_group(g, spec.worker_hosts)
        sml.jobs[spec.job] = SMLSwitchJob(spec.job, W, spec.pool, spec.payload_k, g, list(spec.worker_hosts))
        # packets addressed to the ToR itself: any host address of that rack routes there;
        # the ToR's SwitchML data plane consumes them before routing
        tor_addr = spec.worker_hosts[0]
        self.worker_hosts = list(spec.worker_hosts)
        self.workers = [SMLWorker(spec.job, w, h, tor_addr, spec.pool, spec.payload_k, spec.rto)
                        for w, h in enumerate(spec.worker_hosts)]
        for w, h in enumerate(spec.worker_hosts):
            fab.hosts[h].other.setdefault(SMLPacket, JobDemux())
        self._begin(-(-spec.tensor_elems // spec.payload_k))
        for w, h in enumerate(spec.worker_hosts):
            fab.hosts[h].other[SMLPacket].by_job[spec.job] = self.handler(w)

