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

Packets default to 32 int32 lanes (SwitchML's 180-byte packets, §6). The protocol's
switch and worker live in :mod:`atp_pipeline.ina.switchml` (one switch function, also run
by the live switch role); this module puts them into the simulator's fabric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

from atp_pipeline.errors import ConfigError
from atp_pipeline.ina.quant import lane_limit
from atp_pipeline.ina.sim.fabric import Fabric, JobDemux, mcast_addr
from atp_pipeline.ina.sim.rounds import RoundJob
from atp_pipeline.ina.switchml import (  # noqa: F401
    SML_FIELDS,
    SML_HEADER_BYTES,
    SMLPacket,
    SMLSwitch,
    SMLSwitchJob,
    SMLWorker,
    SMLWorkerStats,
)


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

