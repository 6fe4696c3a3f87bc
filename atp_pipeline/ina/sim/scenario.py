"""Build-and-run helpers: one fabric, several tenant jobs, optional background traffic.

:func:`run` is the single entry point used by the tests, experiments and the speed
benchmark: it builds the engine and fabric, adds the jobs (ATP, SwitchML, ring
all-reduce) and background flows, runs until every job has finished, then drains the
network (no timers left, every in-flight packet delivered or dropped) and returns a
:class:`Result` with per-job metrics, traffic counters and switch state.
:func:`pin_aggregators` (a ``setup`` for :func:`run`) emulates contention for switch memory.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from atp_pipeline.ina.packet import PacketFormat
from atp_pipeline.ina.sim.atp_job import AtpJob, AtpJobSpec
from atp_pipeline.ina.sim.engine import make_engine
from atp_pipeline.ina.sim.fabric import Fabric, FabricConfig, LinkFaults
from atp_pipeline.ina.switch import live_aggregators


@dataclass
class Result:
    fabric: Fabric
    jobs: List[Any]
    background: List[Any]
    sim_time: float
    wall_time: float
    events: int
    hops: int
    drained: bool
    cpu_time: float = 0.0  # CPU seconds of this process over the same interval as wall_time

    def link(self, name: str):
        for lk in self.fabric.links:
            if lk.name == name:
                return lk
        raise KeyError(name)

    def forwarding_rate(self) -> float:
        """Fraction of the gradient packets arriving at the switches that found their
        aggregator held by another ⟨job, seq⟩ and were forwarded to the PS (§7.2.4)."""
        arrivals = coll = 0
        for st in self.fabric.switches():
            S = st.stats
            coll += S.collision
            arrivals += S.alloc + S.merged + S.collision + S.dup_dropped
        return coll / arrivals if arrivals else 0.0

    def live_aggregators(self, ignore_jobs=None) -> List[Any]:
        out = []
        for t in self.fabric.tors:
            if t.state is not None:
                out += [(t.name,) + x for x in live_aggregators(t.state, ignore_jobs)]
        return out


def pin_aggregators(fabric: Fabric, fraction: float, foreign_job: int = 0xFFFF) -> None:
    """Occupy ``fraction`` of every ToR's aggregators with a foreign job that never frees them
    (§7.2.4's emulated contention: packets hashing there are forwarded to the PS). Pass it to
    :func:`run` as ``setup=lambda fab: pin_aggregators(fab, 0.5)``."""
    for st in fabric.switches():
        n = int(round(fraction * st.n))
        for i in range(n):
            st.pin(i * st.n // n if n else i, foreign_job, i)


def run(fabric: FabricConfig, jobs: Sequence[Any], faults: Optional[LinkFaults] = None,
        background: Sequence[Any] = (), engine: str = "heap", until: float = 10.0,
        drain: bool = True, setup=None) -> Result:
    """Simulate ``jobs`` (specs: :class:`AtpJobSpec`, SwitchML or ring specs) on a fabric."""
    eng = make_engine(engine)
    fab = Fabric(fabric, eng)
    if faults is not None:
        fab.set_faults(faults)
    fmt = PacketFormat(fabric.payload_k, fabric.bitmap_bits)
    built: List[Any] = []
    pending = [len(jobs)]
    bgs: List[Any] = []

    def finished(_job):
        pending[0] -= 1
        if pending[0] == 0:
            for b in bgs:
                b.stop()
            eng.stop()

    for spec in jobs:
        if isinstance(spec, AtpJobSpec):
            built.append(AtpJob(spec, fab, fmt, on_finish=finished))
        else:
            built.append(spec.build(fab, on_finish=finished))
    for b in background:
        bgs.append(b.build(fab))
    if setup is not None:
        setup(fab)
    # the simulation allocates millions of short-lived acyclic objects (packets, event
    # tuples); CPython's cyclic collector would scan them every few hundred allocations
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        c0 = time.process_time()
        eng.run(until=until)
        drained = False
        if drain:
            for b in bgs:
                b.stop()
            eng.run(until=eng.now + 1.0)
            drained = True
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
    finally:
        if gc_was_enabled:
            gc.enable()
    return Result(fab, built, bgs, eng.now, wall, eng.events, fab.packet_hops(), drained, cpu)
