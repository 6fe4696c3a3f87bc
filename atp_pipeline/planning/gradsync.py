"""Per-step data-parallel gradient synchronization under each aggregation mode.

The plan report shows tensor-parallel communication (ATP Eq. 2, or the SBP search's
collectives) next to what the data-parallel gradient sync of the same step costs under
each ``aggregation`` mode, so a user sees which mode pays off on their topology.

**What is synchronized.** A :class:`GradBucket` is one gradient summed over ``workers``
ranks ``stride`` apart on the row-major device mesh, ``elements`` per worker. Under ATP's
mesh ``dp × d1 × d2`` (dp outermost) there is one bucket: the ``d1·d2`` data-parallel
groups (one per tensor-parallel shard, all at once) each sum the shard's gradients,
``W = dp`` workers, stride ``d1·d2``. An SBP plan has one bucket per layer whose weight is
replicated over its ``b`` role (AutoDDL §4.4.1). Buckets run one after another.

**Links.** Every worker (and every parameter-server host) reaches the others over the
level the group spans, at ``B′`` of that group from ATP's Eq. 3 (the mesh dimension the
group forms, so concurrent groups sharing a unit divide its bandwidth;
:func:`link_params`); α is the topology's fitted latency where it is calibrated
(``alpha_beta``, AutoDDL §3.2) and ``alpha_s`` (default 5 µs) otherwise. All times are
bandwidth terms ``bytes / B′`` plus latency terms ``α·steps``:

=========  ===============================================================  ==================
mode       busiest link carries (per bucket)                               latency steps
=========  ===============================================================  ==================
ring       ``2(W−1)/W · E·q`` — AutoDDL Table 2's ring all-reduce           ``2(W−1)``
           (= ATP Eq. 4: ``E·q / B`` with ``B = W/(2(W−1))·B′``)
ps         ``W · E·q`` into (and out of) the PS's link: every worker        2
           sends its gradient and receives the parameters (ATP §2.1:
           ``2|M||W|`` in total, the N-to-1 bottleneck of §7.2.4)
atp        ``(1 − f + f·W) · P·wire``: the switch aggregates the W          2
           packet streams so the PS link carries one (1/W of the
           workers' traffic, ATP §2.1 "best case 2|M|", §4.1); a
           fraction ``f`` of packets that find no aggregator is
           forwarded unaggregated (§7.2.4's forwarding rate). ``P`` =
           ⌈E / K⌉ packets of ``wire`` bytes: ``K`` int32 lanes plus the
           ATP header and L2–L4 encapsulation (§5.2,
           :class:`PacketGeometry`) — gradients
           travel as int32 whatever the training dtype
switchml   ``P_s·wire_s`` per worker link: the ToR switch is the PS          2
           (SwitchML, ATP §3), 32 int32 lanes per 180-byte packet (§6);
           it needs all workers in one rack (not checked here)
=========  ===============================================================  ==================

(``E`` elements per worker, ``q`` bytes per element of the gradient dtype.) The model is
bandwidth-bound and lossless; windowing, loss recovery and the PS's compute are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.alphabeta import AlphaBeta, Collective, steps, volume
from atp_pipeline.topology.model import Topology

MODES = ("ring", "ps", "atp", "switchml")
DEFAULT_ALPHA_S = 5e-6
SWITCHML_LANES = 32  # SwitchML's 180-byte packets (ATP §6): 32 int32 values


@dataclass(frozen=True)
class GradBucket:
    """A gradient summed over ``workers`` ranks ``stride`` apart, ``elements`` per worker."""

    workers: int
    stride: int
    elements: float
    name: str = "gradients"


@dataclass(frozen=True)
class ModeEstimate:
    """One aggregation mode: seconds per step, bytes each worker sends, bytes over the
    busiest link (the PS's, or a worker's), and the formula used."""

    mode: str
    seconds: float
    worker_bytes: float
    bottleneck_bytes: float
    formula: str
    note: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return {"mode": self.mode, "seconds": self.seconds, "worker_bytes": self.worker_bytes,
                "bottleneck_bytes": self.bottleneck_bytes, "formula": self.formula,
                **({"note": self.note} if self.note else {})}


@dataclass(frozen=True)
class GradSyncReport:
    """Every mode's estimate for a step's buckets; ``best`` is the fastest mode."""

    buckets: Tuple[GradBucket, ...]
    bytes_per_element: int
    link_GBps: Tuple[float, ...]  # B′ per bucket
    alpha_s: Tuple[float, ...]  # α per bucket
    modes: Tuple[ModeEstimate, ...]
    packet: Dict[str, int] = field(default_factory=dict)
    forwarding_rate: float = 0.0
    configured: Optional[str] = None  # the run's aggregation.mode
    tp_comm_s: Optional[float] = None  # the plan's tensor-parallel communication per step

    def mode(self, name: str) -> ModeEstimate:
        for m in self.modes:
            if m.mode == name:
                return m
        raise KeyError(name)

    @property
    def best(self) -> str:
        active = [m for m in self.modes if m.seconds > 0]
        return min(active, key=lambda m: m.seconds).mode if active else "ring"

    @property
    def synchronizes(self) -> bool:
        return any(b.workers > 1 and b.elements > 0 for b in self.buckets)

    def to_dict(self) -> Dict[str, Any]:
        ring = self.mode("ring").seconds
        return {
            "buckets": [{"name": b.name, "workers": b.workers, "stride": b.stride,
                         "elements_per_worker": b.elements} for b in self.buckets],
            "bytes_per_element": self.bytes_per_element,
            "link_GBps": list(self.link_GBps), "alpha_s": list(self.alpha_s),
            "packet": dict(self.packet), "forwarding_rate": self.forwarding_rate,
            "modes": [{**m.to_dict(), "ratio_to_ring": m.seconds / ring if ring > 0 else None,
                       **({"step_comm_s": m.seconds + self.tp_comm_s}
                          if self.tp_comm_s is not None else {})}
                      for m in self.modes],
            "best": self.best, "configured": self.configured, "tp_comm_s": self.tp_comm_s,
        }


def link_params(topo: Topology, workers: int, stride: int, alpha_s: Optional[float] = None
                ) -> Tuple[float, float]:
    """``(α, B′ in GB/s)`` of a group of ``workers`` ranks ``stride`` apart.

    ``B′`` is ATP's Eq. 3 for the mesh dimension the group forms: dimension 1 of
    ``(workers, stride)`` when that tiles the world (the data-parallel groups of
    ``dp × d1 × d2``), dimension 2 of ``(world/workers, workers)`` for consecutive ranks,
    else the alpha-beta model's level of the group's span. ``α`` is the fitted latency of
    that level in a calibrated topology, else ``alpha_s``.
    """
    memo = topo.__dict__.setdefault("_link_params_memo", {})  # a search asks for the same groups often
    key = (workers, stride, alpha_s)
    if key not in memo:
        memo[key] = _link_params(topo, workers, stride, alpha_s)
    return memo[key]


def _link_params(topo: Topology, workers: int, stride: int, alpha_s: Optional[float]) -> Tuple[float, float]:
    from atp_pipeline.planning.bandwidth import dimension_bandwidth

    world = topo.world_size
    if workers < 1 or stride < 1 or workers * stride > world:
        raise ConfigError(f"gradient sync: a group of {workers} workers {stride} ranks apart does not "
                          f"fit topology '{topo.name}' ({world} devices)")
    default = DEFAULT_ALPHA_S if alpha_s is None else float(alpha_s)
    if workers == 1:
        return default, math.inf
    ab = AlphaBeta.from_topology(topo, alpha=default)
    a = ab.params(workers, stride, Collective.all_reduce)[0] if topo.alpha_beta else default
    if workers * stride == world:
        bw = dimension_bandwidth(topo, (workers, stride), 1).B_prime_GBps
    elif stride == 1 and world % workers == 0:
        bw = dimension_bandwidth(topo, (world // workers, workers), 2).B_prime_GBps
    else:
        bw = 1e-9 / ab.params(workers, stride, Collective.all_reduce)[1]
    assert bw is not None
    return a, float(bw)


@dataclass(frozen=True)
class PacketGeometry:
    """The wire format the estimate counts, given as data (the protocol's own
    :class:`~atp_pipeline.ina.packet.PacketFormat` supplies it: ``run.report``): ``payload_k``
    int32 lanes per ATP packet after ``header_bytes`` of ATP header, ``l2l4_bytes`` of
    Ethernet/IPv4/UDP, and SwitchML's header. The defaults are the 62-lane hardware format."""

    payload_k: int = 62
    header_bytes: int = 29
    l2l4_bytes: int = 42
    switchml_header_bytes: int = 10

    @property
    def wire_bytes(self) -> int:
        return self.l2l4_bytes + self.header_bytes + 4 * self.payload_k


def estimate(topo: Topology, buckets: Sequence[GradBucket], bytes_per_element: int,
             alpha_s: Optional[float] = None, payload_k: Optional[int] = None, forwarding_rate: float = 0.0,
             configured: Optional[str] = None, tp_comm_s: Optional[float] = None,
             packets: Optional[PacketGeometry] = None) -> GradSyncReport:
    """Seconds per step of every aggregation mode (see the module docstring)."""
    if bytes_per_element < 1:
        raise ConfigError(f"gradient sync: bytes_per_element must be >= 1, got {bytes_per_element}")
    if not 0.0 <= forwarding_rate <= 1.0:
        raise ConfigError(f"gradient sync: forwarding_rate must be in [0, 1], got {forwarding_rate}")
    if configured is not None and configured not in MODES:
        raise ConfigError(f"gradient sync: unknown aggregation mode '{configured}' "
                          f"(one of {', '.join(MODES)})")
    fmt = packets or PacketGeometry()
    if payload_k is not None and payload_k != fmt.payload_k:
        if packets is not None:
            raise ConfigError(f"gradient sync: payload_k={payload_k} but the packet geometry has {fmt.payload_k}")
        fmt = PacketGeometry(payload_k=payload_k)
    if fmt.payload_k < 1:
        raise ConfigError(f"gradient sync: payload_k must be >= 1, got {fmt.payload_k}")
    sml_wire = fmt.switchml_header_bytes + 4 * SWITCHML_LANES + fmt.l2l4_bytes
    q = bytes_per_element
    f = forwarding_rate
    totals = {m: [0.0, 0.0, 0.0] for m in MODES}  # seconds, worker bytes, bottleneck bytes
    links, alphas = [], []
    for b in buckets:
        if b.elements < 0:
            raise ConfigError(f"gradient sync: bucket '{b.name}' has {b.elements} elements")
        a, bw = link_params(topo, b.workers, b.stride, alpha_s)
        links.append(bw)
        alphas.append(a)
        W, E = b.workers, float(b.elements)
        if W <= 1 or E == 0:
            continue
        beta = 1.0 / (bw * 1e9)
        ring_bytes = volume(Collective.all_reduce, W, E * q)  # 2(W-1)/W · E·q
        packets = math.ceil(E / fmt.payload_k)
        atp_worker = packets * fmt.wire_bytes
        atp_ps = (1.0 - f + f * W) * atp_worker
        sml_worker = math.ceil(E / SWITCHML_LANES) * sml_wire
        rows = {
            "ring": (a * steps(Collective.all_reduce, W) + beta * ring_bytes, ring_bytes, ring_bytes),
            "ps": (2 * a + beta * W * E * q, E * q, W * E * q),
            "atp": (2 * a + beta * atp_ps, atp_worker, atp_ps),
            "switchml": (2 * a + beta * sml_worker, sml_worker, sml_worker),
        }
        for m, (t, wb, bb) in rows.items():
            totals[m][0] += t
            totals[m][1] += wb
            totals[m][2] += bb
    formulas = {
        "ring": "α·2(W−1) + 2(W−1)/W·E·q / B′ (Table 2 ring all-reduce)",
        "ps": "2α + W·E·q / B′ (N-to-1: the PS link carries every worker's gradient)",
        "atp": f"2α + (1−f+f·W)·⌈E/{fmt.payload_k}⌉·{fmt.wire_bytes} B / B′ (switch aggregates; "
               f"PS link carries 1/W)",
        "switchml": f"2α + ⌈E/{SWITCHML_LANES}⌉·{sml_wire} B / B′ (switch is the PS)",
    }
    notes = {"atp": f"int32 lanes: {fmt.payload_k}·4 payload bytes in {fmt.wire_bytes} wire bytes "
                    f"({fmt.wire_bytes / (4 * fmt.payload_k):.3f}x)" + (
                        f"; forwarding rate {f:g}" if f else ""),
             "switchml": "needs all workers in one rack (static switch memory)"}
    modes = tuple(ModeEstimate(m, *totals[m], formula=formulas[m], note=notes.get(m, ""))
                  for m in MODES)
    packet = {"payload_k": fmt.payload_k, "header_bytes": fmt.header_bytes,
              "wire_bytes": fmt.wire_bytes, "switchml_lanes": SWITCHML_LANES,
              "switchml_wire_bytes": sml_wire}
    return GradSyncReport(tuple(buckets), q, tuple(links), tuple(alphas), modes, packet, f,
                          configured, tp_comm_s)


def dp_bucket(params_per_device: float, dp: int, tp: int) -> GradBucket:
    """The one bucket of ATP's ``dp × d1 × d2`` mesh: every tensor-parallel shard's
    gradients summed over its ``dp`` replicas, ``d1·d2`` ranks apart."""
    return GradBucket(workers=dp, stride=tp, elements=float(params_per_device),
                      name=f"{dp} replicas of each of {tp} shards")


def print_gradsync(report: GradSyncReport, console: Any = None) -> None:
    """The report's table: each mode's gradient-sync time beside the TP communication."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=160)
    b = report.buckets[0] if len(report.buckets) == 1 else None
    head = (f"{b.workers} workers x {b.elements:.4g} elements ({report.bytes_per_element} B), "
            f"B′ {report.link_GBps[0]:.4g} GB/s, α {report.alpha_s[0] * 1e6:.3g} us"
            if b else f"{len(report.buckets)} buckets")
    if not report.synchronizes:
        console.print(f"gradient sync: none ({head}: no data-parallel replicas; set mesh.dp > 1 "
                      f"to compare aggregation modes)")
        return
    table = Table(title=f"data-parallel gradient sync per step ({head})", title_justify="left")
    for col in ("mode", "grad sync", "vs ring", "worker sends", "busiest link", "TP + sync", ""):
        table.add_column(col, justify="left" if col in ("mode", "") else "right")
    ring = report.mode("ring").seconds
    for m in report.modes:
        mark = []
        if m.mode == report.best:
            mark.append("fastest")
        if m.mode == report.configured:
            mark.append("configured")
        table.add_row(m.mode, _t(m.seconds), f"{m.seconds / ring:.3f}" if ring > 0 else "-",
                      _b(m.worker_bytes), _b(m.bottleneck_bytes),
                      _t(m.seconds + report.tp_comm_s) if report.tp_comm_s is not None else "-",
                      ", ".join(mark), style="bold green" if m.mode == report.best else None)
    console.print(table)
    if report.tp_comm_s is not None:
        console.print(f"tensor-parallel communication {_t(report.tp_comm_s)} per step; gradient sync "
                      f"pays off most with '{report.best}'"
                      + (f" (configured: '{report.configured}')" if report.configured else ""))


def _t(s: float) -> str:
    if s == 0:
        return "0"
    return f"{s:.3f} s" if s >= 1 else (f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us")


def _b(x: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= k:
            return f"{x / k:.3f} {unit}"
    return f"{x:.0f} B"


def sbp_buckets(problem: Any, assign: Sequence[int]) -> List[GradBucket]:
    """The weight-gradient buckets of an SBP plan (AutoDDL §4.4.1): per layer whose weight
    ``W`` (n×m) is replicated over the ``b`` role, ``n·m/(pm·pn)`` elements per worker per
    instance, summed over the ``pb`` ranks of that role."""
    out = []
    for v, i in zip(problem.vars, assign):
        s = v.strategies[i]
        if s.pb > 1:
            L = v.layer
            out.append(GradBucket(workers=s.pb, stride=s.stride("b"),
                                  elements=float(L.n * L.m / (s.pm * s.pn) * v.count), name=v.name))
    return out or [GradBucket(workers=1, stride=1, elements=0.0, name="none")]
