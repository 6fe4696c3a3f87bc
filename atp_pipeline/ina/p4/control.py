"""Control plane of the ATP switch programs (§5.1 job setup, §5.3 data plane, §5.4 ECN).

The P4 programs in ``p4/`` carry no per-job aggregation state in tables: fan-in degrees,
bitmaps and the PS shard travel in every packet header (§5.3), and the aggregator registers
are claimed and freed by packets. What a switch *does* need from a controller is computed
here, purely, from the same Hydra configs the rest of the project uses (``conf/topology``,
``conf/aggregation``) plus job descriptions:

* ``ipv4_route`` (``set_port``): one ``/32`` per host of the switch's rack to its port, one
  ``/24`` per other rack to the uplink — gradients toward the PS and every non-ATP IPv4 packet.
* ``l2_forward`` (``set_port``): every host MAC (local port or uplink) for non-IPv4 frames.
* ``atp_job`` (``set_job(grp)``): the job table of §5.1 — one entry per job whose traffic
  crosses this switch (its workers or its PS shards sit in this rack); the programs drop
  ATP packets of unknown jobs, so a job must be installed on every ToR it crosses.
* multicast groups (the PRE, not a P4 table): group ``grp`` of a job replicates its parameter
  packets (§5.1) to the job's workers in this rack, plus the uplink on the PS's ToR when
  workers sit in other racks.
* clone session ``ATP_FLUSH_SESSION`` (v1model): the ⑦ flush of a two-level job leaves the
  second-level switch (the PS's ToR) toward the PS. TNA mirrors to the recirculation port.
* register ``ecn_threshold`` (v1model, index 0) / table ``ecn_threshold`` (TNA, per egress
  port): §5.4 marking threshold in packets of the full ATP frame, from the byte threshold the
  simulator uses (``Fabric`` ``ecn_threshold_bytes``).
* register ``wm`` (index ``job ++ ps_index``): reset to 0 at job setup, so a reused job id
  does not inherit the previous job's watermark (a gradient below it would never aggregate).
* the ATP UDP port: compile-time in both parsers (``ATP_UDP_PORT`` in ``p4/generated``), so it
  is reported for host configuration and checked against :mod:`atp_pipeline.ina.p4.codegen`.

Network model: a unit of the topology's outermost level is a rack behind one ToR switch
running ``atp.p4``; a unit of ``FabricConfig.host_level`` is a host with one NIC (default:
every device). With one level there is one rack. Racks are joined by a plain L3 spine (not
an ATP switch, since ``atp.p4`` would aggregate there at the wrong level); it must route the
rack ``/24``s and replicate each job's multicast address to the racks in
:attr:`SwitchPlan.spine_mcast`. The job layout (groups, fan-ins, first level) follows
:mod:`atp_pipeline.ina.job` and the simulator (``ina/sim/atp_job.py``) with every ToR
programmable.

``python -m atp_pipeline.ina.p4.control --topology ... --aggregation ... --jobs ...``
prints (or writes) the plan as JSON; ``p4/control/bmv2_install.py`` applies it to BMv2.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from atp_pipeline.config.schema import AggregationConfig, AggregationMode
from atp_pipeline.errors import ConfigError, describe_omegaconf
from atp_pipeline.ina.job import JobLayout
from atp_pipeline.ina.packet import ATP_UDP_PORT, PacketFormat

# Names in p4/v1model/atp.p4 (tests/p4/test_control_plane.py parses the source and fails on drift).
INGRESS = "AtpIngress"
EGRESS = "AtpEgress"
T_IPV4_ROUTE = "ipv4_route"
T_L2_FORWARD = "l2_forward"
T_ATP_JOB = "atp_job"
A_SET_PORT = "set_port"
A_SET_JOB = "set_job"
R_ECN_THRESHOLD = "ecn_threshold"
R_WM = "wm"
ATP_FLUSH_SESSION = 1  # const ATP_FLUSH_SESSION in p4/v1model/atp.p4
# p4/tna/atp.p4
TNA_RECIRC_PORT = 68  # the ⑦ flush copy's recirculation port the TNA egress assumes
TNA_ECN_ACTION = "set_threshold"
WM_SHARDS = 4  # 2-bit ps_index
QDEPTH_MAX = (1 << 19) - 1  # bit<19> enq_qdepth / threshold

Json = Dict[str, Any]


@dataclass(frozen=True)
class FabricConfig:
    """How the topology's levels map onto racks, hosts, ports and addresses."""

    host_level: int = -1  # topology level whose units are NIC hosts (-1: innermost = every device)
    first_port: int = 1  # ToR port of a rack's host 0; host i is on first_port + i
    uplink_port: Optional[int] = None  # ToR port toward the spine; default first_port + hosts/rack
    subnet: str = "10.0.0.0/16"  # host i of rack r: subnet + 256 r + i + 1 (one /24 per rack)
    mcast_subnet: str = "239.1.0.0/16"  # job j's parameter-packet group address: + j
    mcast_group_base: int = 1  # PRE multicast group of job j: base + j (0 means "no multicast")
    ecn_threshold_bytes: int = 64_000  # §5.4; the simulator's Fabric default
    payload_k: int = 62  # lanes per packet (the generated header's ATP_K)
    bitmap_bits: int = 32


@dataclass(frozen=True)
class JobSpec:
    """One ATP job: id, the hosts of its workers (worker w on ``worker_hosts[w]``) and PS shards."""

    job: int
    worker_hosts: Tuple[int, ...]
    ps_hosts: Tuple[int, ...]
    two_level: bool = False


@dataclass(frozen=True)
class Host:
    index: int  # global host index (rack-major)
    rack: int
    port: int  # port on its rack's ToR
    ipv4: str
    mac: str


@dataclass(frozen=True)
class TableEntry:
    """One P4 table entry: ``table``/``action`` are the names in the P4 source (unqualified);
    ``match`` maps the key expression to a value (``"a.b.c.d/len"`` for lpm, int for exact)."""

    table: str
    match: Dict[str, Union[int, str]]
    action: str
    params: Dict[str, int]
    control: str = INGRESS

    @property
    def qualified_table(self) -> str:
        return f"{self.control}.{self.table}"

    @property
    def qualified_action(self) -> str:
        return f"{self.control}.{self.action}"


@dataclass(frozen=True)
class MulticastGroup:
    """A PRE multicast group: ``ports`` get one replica each (rid 0)."""

    group: int
    job: int
    ports: Tuple[int, ...]


@dataclass(frozen=True)
class CloneSession:
    session: int
    port: int
    why: str


@dataclass(frozen=True)
class RegisterWrite:
    register: str
    index: int
    value: int
    control: str = INGRESS

    @property
    def qualified_register(self) -> str:
        return f"{self.control}.{self.register}"


@dataclass
class JobPlan:
    """What the switches do for one job, and the per-packet header values its workers use."""

    job: int
    group: int  # PRE multicast group id
    mcast_ipv4: str  # destination of its parameter packets
    ps_rack: int
    worker_racks: List[int]
    level0_switches: List[str]  # first-level aggregation (edge 0)
    level1_switch: Optional[str]  # second-level aggregation (edge 1), two-level jobs only
    fan_in0: List[int]  # per worker
    fan_in1: int
    bitmap0: List[int]  # per worker
    bitmap1: List[int]  # per worker
    start_edge: List[int]  # per worker: 1 = first aggregation at the second level


@dataclass
class SwitchPlan:
    """Everything to install on one ToR switch running ``atp.p4``."""

    name: str
    rack: int
    uplink_port: Optional[int]
    tables: List[TableEntry] = field(default_factory=list)
    multicast: List[MulticastGroup] = field(default_factory=list)
    clone_sessions: List[CloneSession] = field(default_factory=list)
    registers: List[RegisterWrite] = field(default_factory=list)
    tna_ecn_threshold: List[TableEntry] = field(default_factory=list)  # TNA: per egress port
    tna_mirror_sessions: List[CloneSession] = field(default_factory=list)


@dataclass
class ControlPlan:
    atp_udp_port: int
    ecn_threshold_pkts: int
    hosts: List[Host]
    switches: List[SwitchPlan]
    jobs: List[JobPlan]
    spine_mcast: Dict[int, List[int]]  # job -> racks the spine must replicate its group to

    def switch(self, name: str) -> SwitchPlan:
        for s in self.switches:
            if s.name == name:
                return s
        raise ConfigError(f"no switch '{name}' in the plan (have: {', '.join(s.name for s in self.switches)})")

    def to_json(self) -> Json:
        return asdict(self)


def tor_name(rack: int) -> str:
    return f"tor{rack}"


def _aggregation(cfg: Any) -> AggregationConfig:
    try:
        typed = OmegaConf.merge(OmegaConf.structured(AggregationConfig), cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"aggregation: {describe_omegaconf(exc)}") from None
    mode = typed.mode
    if mode != AggregationMode.atp:
        raise ConfigError(f"aggregation.mode is '{getattr(mode, 'value', mode)}': "
                          "the ATP switch control plane needs mode 'atp'")
    return typed  # type: ignore[return-value]


def _racks(topology_cfg: Any, fabric: FabricConfig) -> Tuple[int, int]:
    """``(racks, hosts per rack)`` from a topology config (validated by ``Topology.from_config``)."""
    from atp_pipeline.topology.model import Topology

    topo = Topology.from_config(topology_cfg)
    n = len(topo.levels)
    hl = fabric.host_level + n if fabric.host_level < 0 else fabric.host_level
    if not 0 <= hl < n:
        raise ConfigError(f"fabric.host_level={fabric.host_level} is outside topology '{topo.name}' levels 0..{n - 1}")
    counts = [lv.count for lv in topo.levels]
    if n == 1 or hl == 0:  # one rack: the units of the host level are its hosts
        return 1, counts[0]
    per_rack = 1
    for c in counts[1:hl + 1]:
        per_rack *= c
    racks = counts[0]
    return racks, per_rack


def _addresses(fabric: FabricConfig, racks: int, per_rack: int) -> List[Host]:
    try:
        net = ipaddress.IPv4Network(fabric.subnet)
    except ValueError as exc:
        raise ConfigError(f"fabric.subnet '{fabric.subnet}': {exc}") from None
    if per_rack > 254:
        raise ConfigError(f"{per_rack} hosts per rack do not fit one /24 per rack (at most 254)")
    if racks * 256 > net.num_addresses:
        raise ConfigError(f"fabric.subnet {net} has no room for {racks} racks of one /24 each")
    hosts = []
    for r in range(racks):
        for i in range(per_rack):
            ip = net.network_address + (r << 8) + i + 1
            mac = "02:00:00:%02x:%02x:%02x" % ((r >> 8) & 0xFF, r & 0xFF, i + 1)
            hosts.append(Host(index=r * per_rack + i, rack=r, port=fabric.first_port + i, ipv4=str(ip), mac=mac))
    return hosts


def _job_spec(j: Union[JobSpec, Mapping[str, Any]]) -> JobSpec:
    if isinstance(j, JobSpec):
        return j
    try:
        return JobSpec(job=int(j["job"]), worker_hosts=tuple(int(h) for h in j["worker_hosts"]),
                       ps_hosts=tuple(int(h) for h in j["ps_hosts"]), two_level=bool(j.get("two_level", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"job entry {dict(j)}: needs job, worker_hosts, ps_hosts ({exc!r})") from None


def job_layout(spec: JobSpec, hosts: Sequence[Host], bitmap_bits: int = 32) -> JobLayout:
    """The §5.1 aggregation hierarchy of a job with every ToR programmable (as the simulator's
    ``AtpJob._layout``): one group per worker rack (sorted by rack); with two-level aggregation
    the PS rack's own workers are singleton groups entering at the second level."""
    rack = lambda h: hosts[h].rack  # noqa: E731
    ps_racks = {rack(h) for h in spec.ps_hosts}
    if len(ps_racks) != 1:
        raise ConfigError(f"job {spec.job}: PS shards in racks {sorted(ps_racks)}; the programs' parameter multicast "
                          "(no source pruning) needs all shards under one ToR")
    ps_rack = rack(spec.ps_hosts[0])
    by_rack: Dict[int, List[int]] = {}
    for w, h in enumerate(spec.worker_hosts):
        by_rack.setdefault(rack(h), []).append(w)
    groups: List[List[int]] = []
    start: List[int] = []
    for r in sorted(by_rack):
        if spec.two_level and r == ps_rack:
            for w in by_rack[r]:
                groups.append([w])
                start.append(1)
        else:
            groups.append(by_rack[r])
            start.append(0)
    return JobLayout(job=spec.job, groups=groups, two_level=spec.two_level, group_start_edge=start,
                     n_ps=len(spec.ps_hosts), worker_hosts=list(spec.worker_hosts),
                     ps_hosts=list(spec.ps_hosts), bitmap_bits=bitmap_bits)


def ecn_threshold_packets(threshold_bytes: int, frame_bytes: int) -> int:
    """Queue depth in packets (``enq_qdepth``) above which the program marks: marking at
    ``depth > t`` equals the simulator's ``backlog > threshold_bytes`` for full ATP frames."""
    if threshold_bytes < 0:
        raise ConfigError(f"fabric.ecn_threshold_bytes={threshold_bytes} must be >= 0")
    return min(threshold_bytes // frame_bytes, QDEPTH_MAX)


def compute_plan(topology_cfg: Any, aggregation_cfg: Any, jobs: Sequence[Union[JobSpec, Mapping[str, Any]]],
                 fabric: Optional[FabricConfig] = None) -> ControlPlan:
    """All entries for every ToR switch of the topology. Raises one-line ``ConfigError``s."""
    fabric = fabric or FabricConfig()
    _aggregation(aggregation_cfg)
    racks, per_rack = _racks(topology_cfg, fabric)
    hosts = _addresses(fabric, racks, per_rack)
    uplink = fabric.uplink_port if fabric.uplink_port is not None else fabric.first_port + per_rack
    if fabric.first_port <= uplink < fabric.first_port + per_rack:
        raise ConfigError(f"fabric.uplink_port={uplink} collides with a host port "
                          f"({fabric.first_port}..{fabric.first_port + per_rack - 1})")
    if not 0 <= uplink < 511 or fabric.first_port < 0:
        raise ConfigError(f"ports must fit bit<9> (uplink {uplink}, first_port {fabric.first_port})")
    has_uplink = racks > 1
    fmt = PacketFormat(payload_k=fabric.payload_k, bitmap_bits=fabric.bitmap_bits)
    thr = ecn_threshold_packets(fabric.ecn_threshold_bytes, fmt.wire_bytes)
    mnet = ipaddress.IPv4Network(fabric.mcast_subnet)
    switches = [SwitchPlan(name=tor_name(r), rack=r, uplink_port=uplink if has_uplink else None) for r in range(racks)]

    # forwarding: every host, every rack (§5.3: ATP gradients and non-ATP traffic use plain routing)
    for sw in switches:
        for h in hosts:
            port = h.port if h.rack == sw.rack else uplink
            if h.rack == sw.rack:
                sw.tables.append(TableEntry(T_IPV4_ROUTE, {"hdr.ipv4.dst_addr": f"{h.ipv4}/32"}, A_SET_PORT,
                                            {"port": port}))
            sw.tables.append(TableEntry(T_L2_FORWARD, {"hdr.ethernet.dst_addr": h.mac}, A_SET_PORT, {"port": port}))
        for r in range(racks):
            if r != sw.rack:
                prefix = ipaddress.IPv4Network(f"{hosts[r * per_rack].ipv4}/24", strict=False)
                sw.tables.append(TableEntry(T_IPV4_ROUTE, {"hdr.ipv4.dst_addr": str(prefix)}, A_SET_PORT,
                                            {"port": uplink}))
        sw.registers.append(RegisterWrite(R_ECN_THRESHOLD, 0, thr, control=EGRESS))
        ports = [fabric.first_port + i for i in range(per_rack)] + ([uplink] if has_uplink else [])
        sw.tna_ecn_threshold = [TableEntry(R_ECN_THRESHOLD, {"eg_md.egress_port": p}, TNA_ECN_ACTION, {"t": thr},
                                           control="Eg")
                                for p in ports]
        sw.tna_mirror_sessions = [CloneSession(ATP_FLUSH_SESSION, TNA_RECIRC_PORT,
                                               "⑦ flush copy to the recirculation port (second pass)")]

    specs = [_job_spec(j) for j in jobs]
    seen: Dict[int, int] = {}
    job_plans: List[JobPlan] = []
    spine: Dict[int, List[int]] = {}
    flush_port: Dict[int, Tuple[int, int]] = {}  # rack -> (PS port, job) of the ⑦ clone session
    for spec in specs:
        if spec.job in seen:
            raise ConfigError(f"job id {spec.job} is listed twice")
        seen[spec.job] = 1
        if not spec.worker_hosts or not spec.ps_hosts:
            raise ConfigError(f"job {spec.job}: needs at least one worker host and one PS host")
        for h in (*spec.worker_hosts, *spec.ps_hosts):
            if not 0 <= h < len(hosts):
                raise ConfigError(f"job {spec.job}: host {h} does not exist (hosts 0..{len(hosts) - 1})")
        if len(set(spec.worker_hosts)) != len(spec.worker_hosts):
            raise ConfigError(f"job {spec.job}: one worker per host (worker_hosts repeats a host)")
        ps_racks = sorted({hosts[h].rack for h in spec.ps_hosts})
        if len(ps_racks) != 1:
            raise ConfigError(f"job {spec.job}: PS shards in racks {ps_racks}; the programs' parameter multicast "
                              "(no source pruning) needs all shards under one ToR")
        group = fabric.mcast_group_base + spec.job
        if not 1 <= group < 1 << 16:
            raise ConfigError(f"job {spec.job}: multicast group {group} does not fit bit<16> (1..65535)")
        if spec.job >= mnet.num_addresses:
            raise ConfigError(f"job {spec.job}: no address left in fabric.mcast_subnet {mnet}")
        layout = job_layout(spec, hosts, fabric.bitmap_bits)
        ps_rack = ps_racks[0]
        w_racks = sorted({hosts[h].rack for h in spec.worker_hosts})
        if spec.two_level:
            ps_ports = {hosts[h].port for h in spec.ps_hosts}
            if len(ps_ports) != 1:
                raise ConfigError(f"job {spec.job}: two-level with PS shards on ports {sorted(ps_ports)}; the v1model "
                                  "⑦ flush clone session has one egress port")
            port = ps_ports.pop()
            prev = flush_port.get(ps_rack)
            if prev is not None and prev[0] != port:
                raise ConfigError(f"jobs {prev[1]} and {spec.job}: two-level jobs on {tor_name(ps_rack)} with PS on "
                                  f"ports {prev[0]} and {port}; the v1model flush session reaches one port")
            flush_port[ps_rack] = (port, spec.job)
        for r in sorted(set(w_racks) | {ps_rack}):
            sw = switches[r]
            sw.tables.append(TableEntry(T_ATP_JOB, {"hdr.atp.job": spec.job}, A_SET_JOB, {"grp": group}))
            ports = sorted(hosts[spec.worker_hosts[w]].port for w in range(layout.n_workers)
                           if hosts[spec.worker_hosts[w]].rack == r)
            if r == ps_rack and any(x != ps_rack for x in w_racks):
                ports.append(uplink)
            sw.multicast.append(MulticastGroup(group=group, job=spec.job, ports=tuple(ports)))
            if r == ps_rack:
                sw.registers += [RegisterWrite(R_WM, (spec.job << 2) | p, 0) for p in range(WM_SHARDS)]
        remote = [r for r in w_racks if r != ps_rack]
        if remote:
            spine[spec.job] = remote
        fan0 = [len(layout.groups[layout.group_of[w]]) for w in range(layout.n_workers)]
        level0 = [tor_name(r) for r in w_racks if not (spec.two_level and r == ps_rack)]
        job_plans.append(JobPlan(
            job=spec.job, group=group, mcast_ipv4=str(mnet.network_address + spec.job), ps_rack=ps_rack,
            worker_racks=w_racks, level0_switches=level0,
            level1_switch=tor_name(ps_rack) if spec.two_level else None, fan_in0=fan0, fan_in1=layout.fan_in1,
            bitmap0=[1 << layout.child0[w] for w in range(layout.n_workers)],
            bitmap1=[1 << layout.group_of[w] if spec.two_level else 0 for w in range(layout.n_workers)],
            start_edge=[layout.group_start_edge[layout.group_of[w]] for w in range(layout.n_workers)]))
    for r, (port, job) in sorted(flush_port.items()):
        switches[r].clone_sessions.append(CloneSession(ATP_FLUSH_SESSION, port, f"⑦ flush toward the PS (job {job})"))
    return ControlPlan(atp_udp_port=ATP_UDP_PORT, ecn_threshold_pkts=thr, hosts=hosts, switches=switches,
                       jobs=job_plans, spine_mcast=spine)


def _load_yaml(path: str) -> Any:
    try:
        return OmegaConf.load(path)
    except (OSError, OmegaConfBaseException) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m atp_pipeline.ina.p4.control", description=__doc__.splitlines()[0])
    ap.add_argument("--topology", required=True, help="conf/topology/<name>.yaml")
    ap.add_argument("--aggregation", default="conf/aggregation/atp.yaml",
                    help="aggregation config (default conf/aggregation/atp.yaml, relative to the current directory)")
    ap.add_argument("--jobs", required=True,
                    help="YAML: {fabric: {...}, jobs: [{job, worker_hosts, ps_hosts, two_level}]}")
    ap.add_argument("--out", help="write the plan as JSON here (default: stdout)")
    a = ap.parse_args(argv)
    try:
        jobs_cfg = OmegaConf.to_container(_load_yaml(a.jobs), resolve=True)
        if not isinstance(jobs_cfg, dict) or "jobs" not in jobs_cfg:
            raise ConfigError(f"{a.jobs}: expected a mapping with a 'jobs' list")
        try:
            fabric = FabricConfig(**(jobs_cfg.get("fabric") or {}))
        except TypeError as exc:
            raise ConfigError(f"{a.jobs}: fabric: {exc}") from None
        plan = compute_plan(_load_yaml(a.topology), _load_yaml(a.aggregation), jobs_cfg["jobs"], fabric)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(plan.to_json(), indent=1, ensure_ascii=False)
    if a.out:
        Path(a.out).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
