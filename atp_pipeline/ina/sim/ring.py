"""Ring all-reduce baseline (Horovod/NCCL style, ATP §7.2.2) in the same simulator.

``W`` workers in a ring; the tensor is cut into ``W`` chunks of whole packets. Reduce-
scatter: in step ``s`` worker ``i`` sends chunk ``(i − s) mod W`` to ``i+1``, which adds it
into its copy and forwards the partial sum in step ``s+1``; after ``W−1`` steps each worker
owns one fully reduced chunk. All-gather circulates the reduced chunks for ``W−1`` more
steps. Steps are pipelined per packet (a packet is forwarded as soon as it is reduced),
so the ring streams at line rate. Like RoCE with PFC in the paper's testbed (§7.1) the
ring assumes a lossless fabric: it has no retransmission, and a drop leaves the job
unfinished (the scenario reports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np

from atp_pipeline.errors import ConfigError
from atp_pipeline.ina.packet import L2L4_OVERHEAD_BYTES
from atp_pipeline.ina.quant import lane_limit
from atp_pipeline.ina.sim.fabric import Fabric, JobDemux
from atp_pipeline.ina.sim.rounds import RoundJob

RING_HEADER_BYTES = 12  # job 2, step 2, chunk 4, index 4


class RingPacket:
    __slots__ = ("job", "step", "chunk", "idx", "payload", "src", "dst", "size", "ecn", "is_param")

    def copy(self) -> "RingPacket":
        p = RingPacket.__new__(RingPacket)
        for s in RingPacket.__slots__:
            setattr(p, s, getattr(self, s))
        return p


class RingStats:
    __slots__ = ("sent", "received")

    def __init__(self) -> None:
        self.sent = self.received = 0

    def as_dict(self) -> Dict[str, int]:
        return {"sent": self.sent, "received": self.received}


class RingWorker:
    reo_deadline = None  # no reordering timer (only ATP workers have one)

    def __init__(self, job: int, wid: int, W: int, host: int, next_host: int, k: int) -> None:
        self.job, self.wid, self.W, self.host, self.next_host, self.k = job, wid, W, host, next_host, k
        self.size = RING_HEADER_BYTES + 4 * k + L2L4_OVERHEAD_BYTES
        self.stats = RingStats()
        self.done = True
        self.gathered = 0  # all-gather packets received, all rounds

    def start(self, tensor: np.ndarray, base_seq: int, now: float) -> List[RingPacket]:
        t = np.asarray(tensor, dtype=np.int32)
        W, k = self.W, self.k
        self.length = len(t)
        self.nc = max(1, -(-len(t) // (W * k)))  # packets per chunk
        buf = np.zeros(W * self.nc * k, dtype=np.int32)
        buf[: len(t)] = t
        self.buf = buf.reshape(W, self.nc, k)
        self.need = (W - 1) * self.nc  # all-gather packets to receive
        self.got = 0
        self.done = False
        c = self.wid
        return [self._pkt(0, c, j) for j in range(self.nc)]

    def _pkt(self, step: int, c: int, j: int) -> RingPacket:
        p = RingPacket.__new__(RingPacket)
        p.job, p.step, p.chunk, p.idx = self.job, step, c, j
        p.payload = self.buf[c, j].copy()
        p.src, p.dst, p.size, p.ecn, p.is_param = self.host, self.next_host, self.size, 0, 0
        self.stats.sent += 1
        return p

    def on_packet(self, p: RingPacket, now: float) -> List[RingPacket]:
        if self.done or p.job != self.job:
            return []
        self.stats.received += 1
        W, s, c, j = self.W, p.step, p.chunk, p.idx
        out: List[RingPacket] = []
        if s < W - 1:  # reduce-scatter
            row = self.buf[c, j]
            np.add(row, p.payload, out=row)
            out.append(self._pkt(s + 1, c, j))  # step W-1 starts the all-gather of a reduced chunk
        else:  # all-gather
            self.buf[c, j] = p.payload
            self.got += 1
            self.gathered += 1
            if s + 1 <= 2 * W - 3:
                out.append(self._pkt(s + 1, c, j))
            if self.got == self.need:
                self.done = True
        return out

    def next_deadline(self) -> Optional[float]:
        return None

    def poll(self, now: float) -> List[RingPacket]:
        return []

    @property
    def delivered_bytes(self) -> int:
        return self.gathered * 4 * self.k

    @property
    def result_tensor(self) -> np.ndarray:
        return self.buf.ravel()[: self.length]


@dataclass
class RingJobSpec:
    job: int
    worker_hosts: List[int]
    tensor_elems: int = 62 * 512
    rounds: int = 1
    compute_time: float = 0.0
    start_time: float = 0.0
    payload_k: int = 62
    seed: int = 0
    timeline_bin: Optional[float] = None

    def build(self, fab: Fabric, on_finish: Optional[Callable] = None) -> "RingJob":
        return RingJob(self, fab, on_finish)


class RingJob(RoundJob):
    def __init__(self, spec: RingJobSpec, fab: Fabric, on_finish: Optional[Callable] = None) -> None:
        W = len(spec.worker_hosts)
        if W < 2:
            raise ConfigError("ring all-reduce needs at least 2 workers")
        super().__init__(spec.job, fab, spec.tensor_elems, spec.rounds, spec.compute_time, spec.start_time,
                         spec.seed, lane_limit(W), None, on_finish, spec.timeline_bin)
        self.spec = spec
        self.worker_hosts = list(spec.worker_hosts)
        hs = spec.worker_hosts
        self.workers = [RingWorker(spec.job, w, W, h, hs[(w + 1) % W], spec.payload_k) for w, h in enumerate(hs)]
        for w, h in enumerate(hs):
            fab.hosts[h].other.setdefault(RingPacket, JobDemux())
        self._begin(0)
        for w, h in enumerate(hs):
            fab.hosts[h].other[RingPacket].by_job[spec.job] = self.handler(w)

