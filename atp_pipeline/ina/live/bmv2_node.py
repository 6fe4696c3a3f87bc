"""The live switch on BMv2: the compiled v1model program sums the training gradients.

:class:`BMv2SwitchNode` is the ``switch`` role of :mod:`.nodes` with ``--impl bmv2``. It has
the emulator's control operations (``add_job``, ``remove_job``, ``aggregator``, ``stats``)
and the same UDP data address, so workers and parameter-server shards talk to it unchanged;
but no Python code touches an aggregator: every ATP datagram goes through BMv2
``simple_switch`` running ``p4/v1model/atp.p4`` (ATP §5.3, Figure 4), in a network namespace
of its own (:class:`~atp_pipeline.ina.p4.simple_switch.SimpleSwitch`).

The node is the end hosts' network interfaces, nothing more:

* every endpoint (a worker's or a PS shard's UDP address) is a host of a one-rack fabric
  whose ToR is the switch: host ``i`` on port ``FIRST_PORT + i`` (frames reach BMv2's ports
  through its nanomsg packet interface), with the IPv4 and MAC addresses
  :func:`atp_pipeline.ina.p4.control.compute_plan` gives it;
* a datagram from endpoint ``A`` becomes the Ethernet/IPv4/UDP frame ``A``'s NIC would send —
  a gradient to the address of its job's PS shard ``ps_index``, a parameter packet to the
  job's multicast address — and enters the switch on ``A``'s port;
* what the switch sends out of port ``p`` goes, as a datagram, to the endpoint on ``p``
  (so the program's forwarding decides who gets what: aggregates to the PS, parameter
  packets replicated by the job's multicast group to its workers).

Job setup (§5.1) installs the entries ``compute_plan`` computes for the job — ``ipv4_route``
and ``l2_forward`` for new hosts, ``atp_job``, the job's multicast group, the ECN threshold
and the job's watermarks — through one persistent ``simple_switch_CLI`` session. Teardown
removes them and clears every aggregator the job still holds (read from ``agg_key``), as
:meth:`atp_pipeline.ina.switch.SwitchState.remove_job` does. ``stats`` reads the program's
counters and registers: ``stats[]`` (named as :class:`~atp_pipeline.ina.switch.SwitchStats`),
``job_allocs``/``job_complete``/``job_params`` per job — completions over parameter packets
is the fraction of the job's sequences aggregated in the switch — and the aggregators
still allocated. Loss and duplication are injected before the switch, as the emulator does.

Two levels (ATP §4.1, ``aggregation.racks=R``): each rack switch and the second-level switch
is a node of its own, each with its BMv2 running the same program. A rack switch's ``up``
endpoint is the second-level node (a host on one of its ports, where a PS would be); the
second-level node's ``down`` endpoints are the rack nodes, each the one child of level 2 it
sees (``add_job(two_level=True)``: ``compute_plan``'s two-level layout, plus the ⑦ flush clone
session toward the PS's port). Which level a packet is aggregated at is the program's
decision, from the packet's ``edge`` bit, exactly as in ``ina.switch.process``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import select
import shutil
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from omegaconf import OmegaConf

from atp_pipeline.ina.live.role import Role, meminfo
from atp_pipeline.ina.live.rpc import Addr
from atp_pipeline.ina.p4 import control as cp
from atp_pipeline.ina.p4.codegen import STATS
from atp_pipeline.ina.p4.simple_switch import SimpleSwitch, parse_counter, parse_register, parse_register_all
from atp_pipeline.ina.p4.traces import udp_frame
from atp_pipeline.ina.packet import DEFAULT_BITMAP_BITS, DEFAULT_K, PacketFormat
from atp_pipeline.ina.switch import agg_hash, agg_slot, check_pool_size

FIRST_PORT = 1  # host i on switch port FIRST_PORT + i (the control plane's FabricConfig default)
MAX_HOSTS = 254  # one /24: the control plane's address plan for one rack
L2L4 = 42
AGG_REGISTERS = ("agg_key", "agg_shard", "agg_bitmap", "agg_count", "agg_flags")
QUEUE_DEPTH = 1024  # packets per egress queue (BMv2's default is 64)
WORKDIR_PREFIX = "atp-bmv2-switch-"  # + owner pid: <tmp>/atp-bmv2-switch-<pid>-<random>


def _topology(hosts: int) -> Dict[str, Any]:
    return {"name": "bmv2_live", "description": "one rack: the switch and the run's endpoints",
            "levels": [{"name": "host", "count": max(hosts, 1), "p2p_GBps": 1.0, "group_GBps": 1.0}]}


@dataclass
class _Job:
    workers: List[int]  # host indices, worker-id order
    ps: List[int]  # host indices, shard order
    group: int
    mcast_ip: bytes
    table_handle: int
    node_handle: int


class BMv2SwitchNode(Role):
    """The ``switch`` role, with BMv2 running the v1model program as its data plane."""

    role = "switch"

    def __init__(self, fmt: PacketFormat, n_aggregators: int, json_path: Path, loss: float = 0.0,
                 duplicate: float = 0.0, seed: int = 0, workdir: Optional[Path] = None,
                 ecn_threshold: int = 256 << 10, **kw: Any) -> None:
        if fmt.payload_k != DEFAULT_K or fmt.bitmap_bits != DEFAULT_BITMAP_BITS:
            raise ValueError(f"the P4 program's header has {DEFAULT_K} lanes and {DEFAULT_BITMAP_BITS}-bit "
                             f"bitmaps; got payload_k={fmt.payload_k}, bitmap_bits={fmt.bitmap_bits}")
        if check_pool_size(n_aggregators) == 0:
            raise ValueError("the P4 program needs at least one aggregator per register")
        if not (0.0 <= loss < 1.0 and 0.0 <= duplicate < 1.0):
            raise ValueError(f"loss and duplicate must be in [0, 1), got {loss}, {duplicate}")
        compiled = program_aggregators(Path(json_path))
        if compiled != n_aggregators:
            raise ValueError(f"{json_path} was compiled with ATP_N_AGG={compiled}, not {n_aggregators} aggregators")
        super().__init__(fmt, **kw)
        self.n = n_aggregators
        self.json_path = Path(json_path)
        self._own_workdir = workdir is None
        if workdir is None:
            sweep_stale_workdirs(Path(tempfile.gettempdir()))
            workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))
        self.workdir = Path(workdir)
        self.loss, self.duplicate = loss, duplicate
        self.rng = random.Random(seed)
        self.injected_loss = self.injected_dup = self.unroutable = self.delivered = self.ecn_out = 0
        self.ecn_threshold, self.backlog, self.ecn_marked, self._tick = ecn_threshold, 0, 0, 0
        self.job_packets: Dict[int, int] = {}
        self.removed: Dict[int, int] = {}
        self.stale_cleared = 0
        self.hosts: Dict[Addr, int] = {}  # endpoint -> host index
        self.addr_of_port: Dict[int, Addr] = {}
        self.host_info: Dict[int, cp.Host] = {}
        self.routes: Dict[int, _Job] = {}
        self.sessions: Dict[int, int] = {}  # clone session -> egress port (the ⑦ flush toward the PS)
        self.levels: Dict[int, int] = {}  # job -> the aggregation level this switch serves (1, or 2: §4.1)
        self._layout = {name: (off, bits) for name, off, bits in fmt.layout()}
        off = self._layout["ecn"][0]
        self._ecn = (off // 8, 0x80 >> (off % 8))  # byte and bit of the ECN flag in the ATP header
        self.ss = SimpleSwitch(self.json_path, self.workdir)
        try:  # egress queues deeper than the program's ECN threshold (200 packets): mark before dropping (§5.4)
            self._cli([f"set_queue_depth {QUEUE_DEPTH}"])
        except BaseException:
            self.ss.close()
            raise
        self._rx = threading.Thread(target=self._from_switch, name="atp-bmv2-rx", daemon=True)
        self._rx.start()

    def info(self) -> Dict[str, Any]:
        return {**super().info(), "impl": "bmv2", "bmv2_pid": self.ss.pid, "netns_inode": self.ss.inode,
                "aggregators": self.n, "json": str(self.json_path)}

    def close(self) -> None:
        """Stop the switch: its namespace and processes go with it; remove its work directory."""
        self.stop_event.set()
        self.ss.close()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------------ data path
    def _field(self, buf: bytes, name: str) -> int:
        off, bits = self._layout[name]
        first, last = off // 8, (off + bits - 1) // 8
        v = int.from_bytes(buf[first:last + 1], "big")
        return (v >> (8 * (last + 1) - off - bits)) & ((1 << bits) - 1)

    def handle(self, buf: bytes, addr: Optional[Addr] = None) -> None:
        """A datagram from an endpoint: its NIC's frame into the switch on the endpoint's port."""
        self._tick += 1
        if not self._tick & 7:
            self.backlog = meminfo(self.sock)[0]
        h = self.hosts.get(addr) if addr is not None else None
        if h is None or len(buf) < self.fmt.header_bytes:
            self.unroutable += 1
            return
        job = self._field(buf, "job")
        route = self.routes.get(job)
        if route is None:
            self.unroutable += 1
            return
        if self._field(buf, "is_param"):
            dst_ip, dst_mac = route.mcast_ip, b"\x01\x00\x5e" + route.mcast_ip[1:]
        else:
            shard = self._field(buf, "ps_index")
            if shard >= len(route.ps):
                self.unroutable += 1
                return
            ps = self.host_info[route.ps[shard]]
            dst_ip, dst_mac = ipaddress.IPv4Address(ps.ipv4).packed, _mac(ps.mac)
        if self.backlog > self.ecn_threshold and not buf[self._ecn[0]] & self._ecn[1]:
            # the queue in front of the switch's ingress is long: the link marks ECN (§5.4), as
            # the emulator does on its socket backlog; the program ORs it into the aggregate
            b = bytearray(buf)
            b[self._ecn[0]] |= self._ecn[1]
            buf = bytes(b)
            self.ecn_marked += 1
        src = self.host_info[h]
        frame = udp_frame(buf, _mac(src.mac), dst_mac, ipaddress.IPv4Address(src.ipv4).packed, dst_ip)
        if self.loss and self.rng.random() < self.loss:
            self.injected_loss += 1
            return
        copies = 1
        if self.duplicate and self.rng.random() < self.duplicate:
            self.injected_dup += 1
            copies = 2
        self.job_packets[job] = self.job_packets.get(job, 0) + copies
        for _ in range(copies):
            try:
                self.ss.send(src.port, frame)
            except (OSError, AssertionError):  # the switch is stopping
                self.send_errors += 1

    def _from_switch(self) -> None:
        """Frames the switch sends on port p, as datagrams to the endpoint on p."""
        ecn_byte, ecn_mask = L2L4 + self._ecn[0], self._ecn[1]
        fd = self.ss.fileno()
        while not self.stop_event.is_set():
            try:
                select.select([fd], [], [], 0.25)
                frames = self.ss.recv_ready()
            except (OSError, ValueError, AssertionError):  # the switch is stopping
                return
            for port, f in frames:
                addr = self.addr_of_port.get(port)
                if addr is None or len(f) < L2L4 or f[12:14] != b"\x08\x00" or f[23] != 17:
                    self.unroutable += 1
                    continue
                (ulen,) = struct.unpack("!H", f[38:40])
                payload = f[L2L4:L2L4 + ulen - 8]
                self.delivered += 1
                if len(f) > ecn_byte and f[ecn_byte] & ecn_mask:
                    self.ecn_out += 1
                self.send(payload, addr)

    # ------------------------------------------------------------------ control (§5.1)
    def _cli(self, commands: List[str]) -> str:
        assert self.ss.cli is not None
        return self.ss.cli.run(commands)

    def _host(self, addr: Addr) -> int:
        addr = (str(addr[0]), int(addr[1]))
        h = self.hosts.get(addr)
        if h is None:
            h = len(self.hosts)
            if h >= MAX_HOSTS:
                raise ValueError(f"the BMv2 switch serves at most {MAX_HOSTS} endpoints (one /24)")
            self.hosts[addr] = h
            self.addr_of_port[FIRST_PORT + h] = addr
        return h

    def op_add_job(self, up: List[List[Any]], down: List[List[Any]], job: Optional[int] = None,
                   two_level: bool = False) -> int:
        """Install a job: hosts (ports, routes) for new endpoints, the job table entry, its
        multicast group and watermarks — the entries ``compute_plan`` computes.

        ``two_level``: this switch is the job's second level (ATP §4.1, the PS's ToR): ``down``
        are the first-level switches, each a child of this level (``compute_plan``'s two-level
        layout of a one-rack fabric: every child a singleton group entering at edge 1), and
        the ⑦ flush clone session leaves toward the PS's port. A first-level switch is a plain
        one-rack job whose ``up`` is the second-level switch; the packets' ``edge`` bit does the
        rest, in the program as in ``ina.switch.process``."""
        if job is None:
            job = self.new_job_id(self.routes, (1 << 16) - 1)
        elif job in self.routes:
            raise ValueError(f"job {job} is already installed on this switch")
        known = set(self.hosts.values())
        workers = [self._host(tuple(a)) for a in down]  # type: ignore[arg-type]
        ps = [self._host(tuple(a)) for a in up]  # type: ignore[arg-type]
        plan = cp.compute_plan(OmegaConf.create(_topology(len(self.hosts))), OmegaConf.create({"mode": "atp"}),
                               [{"job": job, "worker_hosts": workers, "ps_hosts": ps, "two_level": bool(two_level)}],
                               cp.FabricConfig(first_port=FIRST_PORT))
        for host in plan.hosts:
            self.host_info[host.index] = host
        sw = plan.switch(cp.tor_name(0))
        new_ports = {FIRST_PORT + h for h in set(self.hosts.values()) - known}
        cmds = []
        for t in sw.tables:
            if t.table == cp.T_ATP_JOB or t.params.get("port") in new_ports:
                match = " ".join(str(v) for v in t.match.values())
                params = " ".join(str(v) for v in t.params.values())
                cmds.append(f"table_add {t.qualified_table} {t.qualified_action} {match} => {params}")
        cmds += [f"register_write {r.qualified_register} {r.index} {r.value}" for r in sw.registers]
        for c in sw.clone_sessions:  # switch-wide (v1model has one flush session): installed once
            have = self.sessions.get(c.session)
            if have is None:
                cmds.append(f"mirroring_add {c.session} {c.port}")
                self.sessions[c.session] = c.port
            elif have != c.port:
                raise ValueError(f"job {job}: its ⑦ flush must leave on port {c.port}, but clone session "
                                 f"{c.session} of this switch already reaches port {have}")
        out = self._cli(cmds)
        handles = {m.group(1): int(m.group(2)) for m in re.finditer(
            r"Adding entry to \w+ match table (\S+)[\s\S]*?Entry has been added with handle (\d+)", out)}
        (m,) = sw.multicast
        out = self._cli([f"mc_mgrp_create {m.group}", f"mc_node_create 0 {' '.join(map(str, m.ports))}"])
        node = int(re.search(r"node was created with handle (\d+)", out).group(1))  # type: ignore[union-attr]
        self._cli([f"mc_node_associate {m.group} {node}"])
        jp = plan.jobs[0]
        self.routes[job] = _Job(workers, ps, m.group, ipaddress.IPv4Address(jp.mcast_ipv4).packed,
                                handles[f"{cp.INGRESS}.{cp.T_ATP_JOB}"], node)
        self.levels[job] = 2 if two_level else 1
        return job

    def op_remove_job(self, job: int) -> int:
        """Job teardown: table entry, multicast group, watermarks, and every aggregator the
        job still holds; returns how many of those were live (not below the job's watermark:
        the emulator's sweep has freed those already)."""
        r = self.routes.pop(job, None)
        if r is not None:
            self._cli([f"table_delete {cp.INGRESS}.{cp.T_ATP_JOB} {r.table_handle}",
                       f"mc_node_dissociate {r.group} {r.node_handle}", f"mc_node_destroy {r.node_handle}",
                       f"mc_mgrp_destroy {r.group}"])
        held = self._held()
        wms = self._watermarks({(j, s) for _, j, _, s in held if j == job})
        live = 0
        clear: List[str] = []
        for i, j, seq, shard in held:
            if j != job:
                continue
            live += seq >= wms.get((j, shard), 0)
            clear += [f"register_write {cp.INGRESS}.{reg} {i} 0" for reg in self._agg_registers()]
        self.stale_cleared += sum(1 for _, j, _, _ in held if j == job) - live
        clear += [f"register_write {cp.INGRESS}.{cp.R_WM} {(job << 2) | s} 0" for s in range(cp.WM_SHARDS)]
        self._cli(clear)
        self.removed[job] = self.removed.get(job, 0) + live
        return live

    def _agg_registers(self) -> List[str]:
        return [*AGG_REGISTERS, *(f"lane_d{i:02d}" for i in range(self.fmt.payload_k))]

    def _held(self) -> List[Tuple[int, int, int, int]]:
        """``(index, job, seq, shard)`` of every aggregator whose valid bit is set."""
        keys = parse_register_all(self._cli([f"register_read {cp.INGRESS}.agg_key"]), f"{cp.INGRESS}.agg_key")
        idx = [i for i, k in enumerate(keys) if k >> 48 & 1]
        if not idx:
            return []
        shards = parse_register(self._cli([f"register_read {cp.INGRESS}.agg_shard {i}" for i in idx]))
        return [(i, keys[i] >> 32 & 0xFFFF, keys[i] & 0xFFFFFFFF, shards[i]) for i in idx]

    def _watermarks(self, pairs: Any) -> Dict[Tuple[int, int], int]:
        pairs = sorted(pairs)
        if not pairs:
            return {}
        got = parse_register(self._cli([f"register_read {cp.INGRESS}.{cp.R_WM} {(j << 2) | s}" for j, s in pairs]))
        return {(j, s): got[(j << 2) | s] for j, s in pairs}

    def op_aggregator(self, job: int, seq: int) -> Optional[int]:
        """The level bitmap held for ⟨job, seq⟩ (to name the workers a stalled job waits for), or None."""
        i = agg_slot(agg_hash(job, seq), self.n)
        got = parse_register(self._cli([f"register_read {cp.INGRESS}.agg_key {i}"]))
        if got.get(i) != (1 << 48 | job << 32 | seq):
            return None
        return parse_register(self._cli([f"register_read {cp.INGRESS}.agg_bitmap {i}"]))[i]

    def _counter(self, name: str, indices: List[int]) -> Dict[int, int]:
        if not indices:
            return {}
        return parse_counter(self._cli([f"counter_read {cp.INGRESS}.{name} {i}" for i in indices]))

    def op_stats(self, jobs: Optional[Set[int]] = None) -> Dict[str, Any]:
        """The program's counters and registers, read through ``simple_switch_CLI``;
        ``allocated``, ``live``, ``installed`` and ``jobs`` only over ``jobs`` (None: every job)."""
        seen = (lambda j: True) if jobs is None else jobs.__contains__
        held = [h for h in self._held() if seen(h[1])]
        wms = self._watermarks({(j, s) for _, j, _, s in held})
        live = sum(1 for _, j, seq, s in held if seq >= wms.get((j, s), 0))
        per_job: Dict[int, int] = {}
        for _, j, _, _ in held:
            per_job[j] = per_job.get(j, 0) + 1
        stats = self._counter("stats", list(range(len(STATS))))
        ids = sorted(j for j in set(self.routes) | set(self.job_packets) | set(self.removed) | set(per_job) if seen(j))
        allocs, complete, params = (self._counter(c, ids) for c in ("job_allocs", "job_complete", "job_params"))
        return {"allocated": len(held), "live": live, "aggregators": self.n,
                "switch": {name: stats.get(i, 0) for i, name in enumerate(STATS)},
                "injected_loss": self.injected_loss, "injected_dup": self.injected_dup, "unroutable": self.unroutable,
                "send_errors": self.send_errors, "installed": sorted(j for j in self.routes if seen(j)),
                "ecn_marked": self.ecn_marked,
                "ecn_out": self.ecn_out,
                "socket_drops": meminfo(self.sock)[1], "delivered": self.delivered,
                "stale_cleared_at_teardown": self.stale_cleared,
                "bmv2": {"pid": self.ss.pid, "netns_inode": self.ss.inode, "json": str(self.json_path)},
                "jobs": {str(j): {"allocs": allocs.get(j, 0), "held": per_job.get(j, 0),
                                  "packets": self.job_packets.get(j, 0), "freed_at_teardown": self.removed.get(j, 0),
                                  "complete": complete.get(j, 0), "params": params.get(j, 0),
                                  "level": self.levels.get(j, 1)} for j in ids},
                "clone_sessions": {str(k): v for k, v in self.sessions.items()}}


def program_aggregators(json_path: Path) -> int:
    """The register size a compiled program has (``AtpIngress.agg_key`` in its BMv2 JSON)."""
    prog = json.loads(Path(json_path).read_text())
    return next(r["size"] for r in prog["register_arrays"] if r["name"] == f"{cp.INGRESS}.agg_key")


def sweep_stale_workdirs(base: Path) -> List[Path]:
    """Remove the work directories (the switch's IPC sockets and log) of BMv2 switch roles that
    were killed before they could clean up (SIGKILL): those whose process is gone. Their
    ``simple_switch`` died with them and the kernel freed its namespace; only these files stay."""
    gone = []
    for d in base.glob(f"{WORKDIR_PREFIX}*"):
        pid = d.name[len(WORKDIR_PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def _mac(text: str) -> bytes:
    return bytes(int(x, 16) for x in text.split(":"))

