"""An ATP job in the simulator: its workers and PS shards wired to fabric hosts.

The job runs ``rounds`` iterations. In each, every worker pushes one integer tensor
(drawn from a seeded generator within the headroom bound ``±Q(W)`` of
:mod:`atp_pipeline.ina.quant`) and pulls the aggregate; after its own result is complete
the worker computes for ``compute_time`` seconds (the *off* phase of §3) and starts the
next round. Every worker's result is compared with the exact int64 sum of all workers'
tensors of that round.

Aggregation hierarchy (§4.1, §5.1) from placement: a worker's first aggregation service is
its ToR when programmable, else the PS's ToR when programmable. Workers with the same
first switch form a group (level 0). With ``two_level`` the PS's ToR is the second
level: each remote group is one child, and workers whose first switch already is the PS's
ToR are singleton children entering at level 1. Without it, the PS combines the groups'
aggregates itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from atp_pipeline.errors import ConfigError
from atp_pipeline.ina.job import JobLayout
from atp_pipeline.ina.packet import PacketFormat
from atp_pipeline.ina.ps import ParameterServer
from atp_pipeline.ina.quant import lane_limit
from atp_pipeline.ina.sim.fabric import Fabric, mcast_addr
from atp_pipeline.ina.sim.rounds import RoundJob
from atp_pipeline.ina.worker import Worker, WorkerConfig


@dataclass
class AtpJobSpec:
    job: int
    worker_hosts: List[int]
    ps_hosts: List[int]
    tensor_elems: int = 62 * 64
    rounds: int = 1
    compute_time: float = 0.0
    start_time: float = 0.0
    two_level: bool = False
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    seed: int = 0
    value_bound: Optional[int] = None  # |element| ≤ this; default Q(W)
    constant: Optional[int] = None  # every element of every worker = this (counting checks)
    timeline_bin: Optional[float] = None  # record worker 0's goodput per bin (seconds)
    in_network: bool = True  # False: plain N-to-1 PS baseline (same stacks, no switch aggregation)


class AtpJob(RoundJob):
    def __init__(self, spec: AtpJobSpec, fabric: Fabric, fmt: PacketFormat,
                 on_finish: Optional[Callable[["AtpJob"], None]] = None) -> None:
        W = len(spec.worker_hosts)
        super().__init__(spec.job, fabric, spec.tensor_elems, spec.rounds, spec.compute_time, spec.start_time,
                         spec.seed, spec.value_bound if spec.value_bound is not None else lane_limit(W),
                         spec.constant, on_finish, spec.timeline_bin)
        self.spec = spec
        self.fmt = fmt
        if len(set(spec.worker_hosts)) != W:
            raise ConfigError(f"job {spec.job}: one worker per host")
        self.worker_hosts = list(spec.worker_hosts)
        self.layout = self._layout()
        self.ps = [ParameterServer(fmt, h, shard=i) for i, h in enumerate(spec.ps_hosts)]
        n_pk = -(-spec.tensor_elems // fmt.payload_k)
        self.n_packets = n_pk
        for ps in self.ps:
            ps.add_job(self.layout, retain=2 * n_pk)
            fabric.hosts[ps.host].atp_grad[spec.job] = self._ps_handler(ps)
        fabric.join_group(self.layout.mcast_addr, spec.worker_hosts)
        fabric.register_job(spec.job, in_network=spec.in_network)
        self.workers = [Worker(fmt, self.layout, w, h, spec.worker) for w, h in enumerate(spec.worker_hosts)]
        self._begin(n_pk)
        for w, h in enumerate(spec.worker_hosts):
            fabric.hosts[h].atp_param[spec.job] = self.handler(w)

    # ----------------------------------------------------------------------- layout
    def _layout(self) -> JobLayout:
        s, fab = self.spec, self.fab
        rack = lambda h: fab.hosts[h].rack  # noqa: E731
        prog = {t.rack for t in fab.tors if t.state is not None} if s.in_network else set()
        ps_racks = {rack(h) for h in s.ps_hosts}
        ps_rack = rack(s.ps_hosts[0])
        by_first: Dict[Any, List[int]] = {}
        for w, h in enumerate(s.worker_hosts):
            r = rack(h)
            first = r if r in prog else (ps_rack if ps_rack in prog and len(ps_racks) == 1 else ("none", r))
            by_first.setdefault(first, []).append(w)
        groups: List[List[int]] = []
        start_edge: List[int] = []
        two = s.two_level
        if two and (len(ps_racks) != 1 or ps_rack not in prog):
            raise ConfigError(f"job {s.job}: two-level aggregation needs all PS shards under one programmable ToR")
        for first, ws in sorted(by_first.items(), key=lambda kv: str(kv[0])):
            if two and first == ps_rack:
                for w in ws:
                    groups.append([w])
                    start_edge.append(1)
            else:
                groups.append(ws)
                start_edge.append(0)
        return JobLayout(job=s.job, groups=groups, two_level=two, group_start_edge=start_edge,
                         n_ps=len(s.ps_hosts), worker_hosts=list(s.worker_hosts), ps_hosts=list(s.ps_hosts),
                         mcast_addr=mcast_addr(s.job), bitmap_bits=self.fmt.bitmap_bits)

    # ----------------------------------------------------------------------- glue
    def _ps_handler(self, ps: ParameterServer) -> Callable:
        host = self.fab.hosts[ps.host]

        def handle(p):
            for q in ps.on_packet(p):
                host.send(q)
        return handle

