"""Packet-level model of a multi-rack fabric: hosts, ToR switches, one core switch, links.

Topology: ``n_racks`` racks of ``hosts_per_rack`` hosts; host ``h`` sits in rack
``h // hosts_per_rack`` under that rack's ToR; every ToR has one link pair to a single
(non-programmable) core switch. ToRs are programmable ATP switches
(:func:`atp_pipeline.ina.switch.process` on every ATP packet of a registered job) unless
configured otherwise — a non-programmable ToR just routes (incremental deployment, §1).

Links are directed, with bandwidth, propagation latency and a FIFO output queue of
``buffer_bytes`` with tail drop and ECN marking above ``ecn_threshold_bytes`` (switch
egress only; §5.4). A host's NIC queue is unbounded (the sending stack is backpressured
by its NIC, it does not drop its own packets). A FIFO single-server queue is exact with one number per link, the
time its transmitter becomes idle: the backlog seen by an arrival at ``t`` is
``(busy_until − t)·bandwidth``, so each hop costs one event (the arrival at the next
node). Fault injection per link (independent per packet): loss (the frame is sent and
then discarded, like corruption), duplication (a second copy is delivered) and
reordering (extra delay drawn uniformly from ``[0, reorder_delay]``, so later packets
overtake it).

Packet objects are shared between multicast replicas and treated as immutable after
they leave a switch; the only in-flight mutation, ECN marking, copies on write.

Multicast (§5.1): each job's group address reaches its worker hosts along the tree
PS → PS's ToR → core → workers' ToRs → workers; a switch replicates to the members behind
each of its ports except the ingress port.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass
from heapq import heappush
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

from atp_pipeline.ina.packet import Packet
from atp_pipeline.ina.sim.engine import LINK_ARRIVAL
from atp_pipeline.ina.switch import SwitchState, process

MCAST_BASE = 1 << 24


def mcast_addr(job: int) -> int:
    return MCAST_BASE + job


@dataclass
class LinkFaults:
    loss: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    reorder_delay: float = 20e-6


@dataclass
class FabricConfig:
    """Fabric parameters; rates in Gbit/s, times in seconds, sizes in bytes."""

    n_racks: int = 2
    hosts_per_rack: int = 8
    host_gbps: float = 100.0
    core_gbps: float = 400.0
    latency: float = 1e-6  # per link
    buffer_bytes: int = 512_000
    ecn_threshold_bytes: int = 64_000
    n_aggregators: int = 4096  # per programmable ToR
    programmable_racks: Optional[List[int]] = None  # None: every ToR
    payload_k: int = 62
    bitmap_bits: int = 32
    seed: int = 0


class Link:
    """Directed link with an exact FIFO output queue (see module docstring)."""

    __slots__ = ("name", "src", "dst", "rate", "lat", "buf", "ecn_thr", "mark", "busy", "eng", "rng",
                 "loss", "dup", "reorder", "reorder_delay", "tx_bytes", "tx_pkts", "drops",
                 "lost", "dups", "ecn_marks", "faulty", "recv", "q", "tick", "fifo", "pend")

    def __init__(self, name: str, src: Any, dst: Any, gbps: float, lat: float, buf: int, ecn_thr: float,
                 mark: bool, eng: Any, rng: random.Random) -> None:
        self.name = name
        self.src = src
        self.dst = dst
        self.rate = gbps * 1e9 / 8  # bytes/s
        self.lat = lat
        self.buf = buf
        self.mark = mark
        self.ecn_thr = ecn_thr if mark else math.inf  # (send compares only the threshold)
        self.busy = 0.0
        self.eng = eng
        self.rng = rng
        self.loss = self.dup = self.reorder = 0.0
        self.reorder_delay = 0.0
        self.tx_bytes = self.tx_pkts = self.drops = self.lost = self.dups = self.ecn_marks = 0
        self.faulty = False
        self.recv = dst.receive
        # fast path on the heap engine: push arrivals straight onto its event list; arrivals
        # of one link come in (time, tiebreak) order, so only the earliest sits on the heap
        # and the rest wait in ``fifo`` (see :meth:`send`)
        self.q = getattr(eng, "_q", None)
        cnt = getattr(eng, "_cnt", None)
        self.tick = None if cnt is None else cnt.__next__  # the engine's tiebreak counter
        fifo = getattr(eng, "fifo", None)  # queued arrival events
        self.fifo: Deque[Tuple[float, int, Any, Any, "Link"]] = deque() if fifo is None else fifo()
        self.pend = False  # this link's earliest pending arrival is on the event heap

    def set_faults(self, f: LinkFaults) -> None:
        self.loss, self.dup, self.reorder, self.reorder_delay = f.loss, f.dup, f.reorder, f.reorder_delay
        self.faulty = bool(f.loss or f.dup or f.reorder)

    def send(self, p: Any) -> None:
        """Transmit ``p``: tail drop, ECN marking, faults, then its arrival at ``dst``.

        On the heap engine a link keeps at most one arrival on the event heap: a packet's
        arrival time ``busy + lat`` only grows from one packet to the next (the transmitter
        is a FIFO), so later arrivals wait in the link's ``fifo`` with the tiebreak they
        were given now, and the engine moves the next one onto the heap when the earliest
        is delivered (:data:`~atp_pipeline.ina.sim.engine.LINK_ARRIVAL`). The events
        run in exactly the ``(time, tiebreak)`` order of one global heap, on a heap of
        links rather than of packets (hundreds of times smaller). A reordered packet
        (fault injection) breaks that order and goes onto the heap by itself."""
        now = self.eng.now
        size = p.size
        busy = self.busy
        if busy > now:
            backlog = (busy - now) * self.rate
            if backlog + size > self.buf:
                self.drops += 1
                return
            # switch egress: the data plane's ECN rule (switch.ecn_mark, inlined: copy on
            # write); a link that does not mark has an infinite threshold
            if backlog > self.ecn_thr and not p.ecn:
                p = p.copy()
                p.ecn = 1
                self.ecn_marks += 1
            self.busy = t = busy + size / self.rate
        else:
            self.busy = t = now + size / self.rate
        self.tx_bytes += size
        self.tx_pkts += 1
        t += self.lat
        if self.faulty:
            rng = self.rng
            if self.loss and rng.random() < self.loss:
                self.lost += 1
                return
            if self.dup and rng.random() < self.dup:
                self.dups += 1
                self.eng.at(t + rng.random() * self.reorder_delay, self.dst.receive, p.copy(), self)
            if self.reorder and rng.random() < self.reorder:
                t += rng.random() * self.reorder_delay
                if self.q is not None:  # out of FIFO order: on the heap by itself
                    heappush(self.q, (t, self.tick(), self.recv, p, self))
                    return
        if self.pend:  # (only ever set on the heap engine)
            self.fifo.append((t, self.tick(), LINK_ARRIVAL, p, self))
        elif self.q is None:
            self.eng.at(t, self.recv, p, self)
        else:
            self.pend = True
            heappush(self.q, (t, self.tick(), LINK_ARRIVAL, p, self))


class JobDemux:
    """Hands a packet type's arrivals at a host to the handler of the packet's job (several
    baseline jobs can share a host); registered in ``Host.other`` per packet type."""

    def __init__(self) -> None:
        self.by_job: Dict[int, Callable[[Any], None]] = {}

    def __call__(self, p: Any) -> None:
        handler = self.by_job.get(p.job)
        if handler is not None:
            handler(p)


class Host:
    """An end host: one NIC link to its ToR; dispatches received packets to its roles."""

    def __init__(self, hid: int, rack: int) -> None:
        self.id = hid
        self.rack = rack
        self.uplink: Optional[Link] = None
        self.atp_param: Dict[int, Callable[[Packet], None]] = {}  # job -> worker handler
        self.atp_grad: Dict[int, Callable[[Packet], None]] = {}  # job -> PS handler
        self.other: Dict[type, Callable[[Any], None]] = {}
        self.unknown = 0

    def send(self, p: Any) -> None:
        self.uplink.send(p)

    def receive(self, p: Any, link: Link) -> None:
        if type(p) is Packet:
            h = (self.atp_param if p.is_param else self.atp_grad).get(p.job)
        else:
            h = self.other.get(type(p))
        if h is None:
            self.unknown += 1
            return
        h(p)


class SwitchNode:
    """A ToR (optionally ATP-programmable) or the core switch."""

    def __init__(self, name: str, state: Optional[SwitchState], extra: Optional[Dict[type, Callable]] = None) -> None:
        self.name = name
        self.state = state
        self.host_port: Dict[int, Link] = {}  # ToR: local hosts
        self.up: Optional[Link] = None  # ToR -> core
        self.rack_port: Dict[int, Link] = {}  # core: rack -> link to that ToR
        self.rack_of: Dict[int, int] = {}
        self.is_core = False
        self.rack = -1
        self.mcast_local: Dict[int, List[int]] = {}  # group -> local member hosts
        self.mcast_racks: Dict[int, List[int]] = {}  # group -> racks with members
        self._mcast_ports: Dict[Any, List["Link"]] = {}  # (group, ingress) -> egress links
        self.dataplane: Dict[type, Callable[[Any, Link], List[Any]]] = dict(extra or {})
        self.bypass: Set[int] = set()  # ATP-stack jobs without in-network aggregation (plain PS)
        self.unroutable = 0

    def receive(self, p: Any, link: Link) -> None:
        if type(p) is Packet:
            st = self.state
            if st is not None and p.job not in self.bypass:
                outs = process(st, p)[1]
                if outs:
                    hp = self.host_port
                    for q in outs:
                        lk = hp.get(q.dst)  # fast path: a local host
                        if lk is not None:
                            lk.send(q)
                        else:
                            self.route(q, link)
                return
        else:
            dp = self.dataplane.get(type(p))
            if dp is not None:
                for q in dp(p, link):
                    self.route(q, link)
                return
        self.route(p, link)

    def route(self, p: Any, ingress: Optional[Link]) -> None:
        d = p.dst
        if d >= MCAST_BASE:
            self._mcast(p, ingress)
            return
        if self.is_core:
            r = self.rack_of.get(d)
            if r is None:
                self.unroutable += 1
                return
            self.rack_port[r].send(p)
            return
        lk = self.host_port.get(d)
        if lk is not None:
            lk.send(p)
        elif d in self.rack_of:
            self.up.send(p)
        else:
            self.unroutable += 1

    def _mcast(self, p: Any, ingress: Optional[Link]) -> None:
        key = (p.dst, ingress)
        outs = self._mcast_ports.get(key)
        if outs is None:
            outs = self._mcast_ports[key] = self._mcast_out(p.dst, ingress)
        # replicas share the packet object: nothing downstream mutates a parameter packet
        # except ECN marking, which copies on write (Link.send)
        for lk in outs:
            lk.send(p)

    def _mcast_out(self, g: int, ingress: Optional[Link]) -> List[Link]:
        """The egress links of group ``g`` for a packet that came in on ``ingress``
        (memoized in ``_mcast_ports`` until the groups change, :meth:`Fabric.join_group`)."""
        outs: List[Link] = []
        if self.is_core:
            for r in self.mcast_racks.get(g, ()):
                lk = self.rack_port[r]
                if ingress is None or lk.dst is not ingress.src:
                    outs.append(lk)
        else:
            for h in self.mcast_local.get(g, ()):
                outs.append(self.host_port[h])
            racks = self.mcast_racks.get(g, ())
            from_core = ingress is not None and ingress.src is not None and getattr(ingress.src, "is_core", False)
            if not from_core and any(r != self.rack for r in racks):
                outs.append(self.up)
        return outs


class Fabric:
    """Builds racks, ToRs, the core and all links on an engine."""

    def __init__(self, cfg: FabricConfig, engine: Any) -> None:
        self.cfg = cfg
        self.eng = engine
        self.rng = random.Random(cfg.seed)
        n_hosts = cfg.n_racks * cfg.hosts_per_rack
        self.hosts = [Host(h, h // cfg.hosts_per_rack) for h in range(n_hosts)]
        prog = set(range(cfg.n_racks)) if cfg.programmable_racks is None else set(cfg.programmable_racks)
        self.core = SwitchNode("core", None)
        self.core.is_core = True
        self.tors: List[SwitchNode] = []
        self.links: List[Link] = []
        rack_of = {h.id: h.rack for h in self.hosts}
        self.core.rack_of = rack_of
        for r in range(cfg.n_racks):
            st = SwitchState(cfg.n_aggregators, cfg.payload_k, cfg.bitmap_bits) if r in prog else None
            tor = SwitchNode(f"tor{r}", st)
            tor.rack = r
            tor.rack_of = rack_of
            self.tors.append(tor)
            up = self._link(f"tor{r}->core", tor, self.core, cfg.core_gbps, mark=True)
            down = self._link(f"core->tor{r}", self.core, tor, cfg.core_gbps, mark=True)
            tor.up = up
            self.core.rack_port[r] = down
        for h in self.hosts:
            tor = self.tors[h.rack]
            h.uplink = self._link(f"h{h.id}->tor{h.rack}", h, tor, cfg.host_gbps, mark=False)
            h.uplink.buf = float("inf")  # the host's own send queue backpressures, never drops
            tor.host_port[h.id] = self._link(f"tor{h.rack}->h{h.id}", tor, h, cfg.host_gbps, mark=True)

    def _link(self, name: str, src: Any, dst: Any, gbps: float, mark: bool) -> Link:
        c = self.cfg
        lk = Link(name, src, dst, gbps, c.latency, c.buffer_bytes, c.ecn_threshold_bytes, mark, self.eng, self.rng)
        self.links.append(lk)
        return lk

    def set_faults(self, f: LinkFaults) -> None:
        for lk in self.links:
            lk.set_faults(f)

    def switches(self) -> List[SwitchState]:
        return [t.state for t in self.tors if t.state is not None]

    def join_group(self, group: int, hosts: List[int]) -> None:
        """Install a multicast group (IGMP at job launch, §5.1)."""
        racks = sorted({self.hosts[h].rack for h in hosts})
        self.core.mcast_racks[group] = racks
        self.core._mcast_ports.clear()
        for t in self.tors:
            t._mcast_ports.clear()
            t.mcast_racks[group] = racks
            t.mcast_local[group] = [h for h in hosts if self.hosts[h].rack == t.rack]

    def register_job(self, job: int, in_network: bool = True) -> None:
        """Per-job switch setup (§5.1); ``in_network=False`` makes the job a plain N-to-1
        PS job (its packets are routed around the ATP data plane)."""
        for t in self.tors:
            if in_network:
                if t.state is not None:
                    t.state.add_job(job)
            else:
                t.bypass.add(job)

    def packet_hops(self) -> int:
        return sum(lk.tx_pkts for lk in self.links)
