"""Replay the ATP trace corpus on BMv2 and compare frame by frame and counter by counter.

The trace corpus (``p4/traces/atp.jsonl``, :mod:`atp_pipeline.ina.p4.traces`) holds input
frames and the frames the Python switch function (:func:`atp_pipeline.ina.switch.process`, via
:func:`atp_pipeline.ina.p4.traces.run_step`) emits for them. This module feeds the same inputs
through the v1model program (``p4/v1model/atp.p4``, ATP §5.3) running on BMv2
``simple_switch`` and checks that the program emits the same frames on the ports the
control plane predicts:

1. compile the program with ``p4c-bm2-ss`` (:mod:`.toolchain`: the tools are found on ``PATH``
   or in ``/opt/p4tools/bin``);
2. start one ``simple_switch`` in a network namespace of its own, its ports reached through
   BMv2's nanomsg packet interface
   (:class:`~atp_pipeline.ina.p4.simple_switch.SimpleSwitch`: needs root, touches no
   address or interface of the machine, and everything is gone when it stops);
3. per scenario: ``reset_state`` (every scenario starts from an empty switch, as in the
   trace), install the scenario's control-plane entries through one persistent
   ``simple_switch_CLI`` session — the entries :func:`atp_pipeline.ina.p4.control.compute_plan`
   computes for the replay fabric (:data:`REPLAY_TOPOLOGY`), translated by
   :func:`cli_commands` — send the input frames to :data:`INJECT_PORT`, then an end marker,
   and collect what the switch sends on every port;
4. compare every frame, field for field, and the program's ``stats`` counter with the Python
   switch's :class:`~atp_pipeline.ina.switch.SwitchStats` after the same frames.

Replay fabric: two racks of one host. The trace's worker (10.0.0.1) is host 0 in rack 0,
its PS (10.0.1.1) host 1 in rack 1; the switch under test is the PS's ToR :data:`DUT`
(``tor1``): the PS on port 1, the uplink toward rack 0 on port 2, every trace job two-level
so the ⑦ flush clone session exists. Trace frames enter on :data:`INJECT_PORT` (0), which
no entry forwards to (v1model's ``egress_spec`` defaults to 0, so a forgotten forwarding
decision shows up there). The expected port of an expected frame is what the program's
forwarding stage does with it under the plan (:func:`forward_ports`): parameter packets →
the job's multicast group, other IPv4 → ``ipv4_route`` (LPM), non-IPv4 → ``l2_forward``.

Ordering (how state evolves): BMv2 ``simple_switch`` runs its ingress pipeline — where every
register is read and written — in a single thread in arrival order, so the register state
evolves exactly as the trace's sequence through one ``SwitchState``. Each egress port's
queue is FIFO, so on one port the outputs appear in input order; outputs of one input
(multicast replicas, the ⑦ clone and its original) may come out in any order. The
comparison therefore walks each port's output stream in step order, takes as many frames as
the step expects on that port and compares them as a multiset (:func:`compare`). A run ends
when its end marker (a filler frame toward the uplink, sent after the inputs) has come back,
every expected frame has come and the switch has been quiet for a moment: frames beyond the
expected ones are mismatches too.

ECN (§5.4): the program marks in egress when ``enq_qdepth`` (the queue depth before the
packet was enqueued) is above the ``ecn_threshold`` register. Trace steps with a congested
``egress`` state are checked twice: in the scenario's main run (threshold from the plan,
never reached by a handful of frames) with the ECN bit masked, and in an extra run that
replays the steps before it unchecked, then :data:`ECN_FILLERS` filler frames to each of
the step's output ports (rate-limited to :data:`ECN_QUEUE_RATE_PPS` with
``set_queue_rate``), then the step itself with ``ecn_threshold`` = 0 — so its outputs are
enqueued behind waiting fillers and must be marked — compared exactly. These runs go last.

Usage, from the repository root, as root (``--trace`` and ``--p4`` default to
``p4/traces/atp.jsonl`` and ``p4/v1model/atp.p4`` under the current directory)::

    python -m atp_pipeline.ina.p4.bmv2                  # compile, replay, compare
    python -m atp_pipeline.ina.p4.bmv2 --json atp.json  # an already compiled program
    python -m atp_pipeline.ina.p4.bmv2 --scenario ecn --keep --log --workdir /tmp/replay
    python -m atp_pipeline.ina.p4.bmv2 --dry-run        # commands + expectations, no BMv2

Exit status: 0 all frames and counters match, 1 a mismatch (the first one is printed in
detail), 2 the tools are missing or a run failed.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf

from atp_pipeline.ina.p4 import control as cp
from atp_pipeline.ina.p4 import traces
from atp_pipeline.ina.p4.codegen import N_AGGREGATORS, STATS
from atp_pipeline.ina.p4.simple_switch import CLI, SimpleSwitch, parse_counter
from atp_pipeline.ina.p4.toolchain import P4ToolError, compile_v1model, why_missing
from atp_pipeline.ina.packet import PacketFormat
from atp_pipeline.ina.switch import SwitchState

LAZY_STATS = ("stale_reclaimed",)  # counted when the program frees lazily (p4/README.md)

# CLI defaults, relative to the current directory (the repository root)
DEFAULT_V1MODEL_P4 = Path("p4") / "v1model" / "atp.p4"
DEFAULT_TRACE_FILE = traces.DEFAULT_TRACE_FILE
# The replay's aggregation config (conf/aggregation/atp.yaml): the control plane only needs mode atp
REPLAY_AGGREGATION = {"mode": "atp"}

# The replay fabric: rack 0 = the trace's worker, rack 1 = its PS (see the module docstring).
REPLAY_TOPOLOGY = {
    "name": "bmv2_replay",
    "description": "two racks of one host: the trace's worker (rack 0) and PS (rack 1)",
    "levels": [
        {"name": "rack", "count": 2, "p2p_GBps": 1.0, "group_GBps": 1.0},
        {"name": "host", "count": 1, "p2p_GBps": 1.0, "group_GBps": 1.0},
    ],
}
WORKER_HOST, PS_HOST = 0, 1
DUT = cp.tor_name(1)
INJECT_PORT = 0
BROADCAST_MAC = "ff:ff:ff:ff:ff:ff"
FILLER_ETHERTYPE = 0x88B5  # IEEE 802 local experimental: never ATP, never IPv4
ECN_FILLERS = 8
ECN_QUEUE_RATE_PPS = 10

FMT = PacketFormat()
L2L4 = 42  # Ethernet 14 + IPv4 20 + UDP 8: where the ATP header starts in a trace frame
_LAYOUT = {name: (off, bits) for name, off, bits in FMT.layout()}



class ReplayError(RuntimeError):
    """A replay run could not be carried out (tool failure, timeout); not a mismatch."""


# -- frames -----------------------------------------------------------------------------------
def atp_field(frame: bytes, name: str) -> Optional[int]:
    """Header field ``name`` of an ATP frame (``None`` if the frame is not ATP)."""
    atp = traces.atp_payload(frame)
    if atp is None or len(atp) < FMT.header_bytes:
        return None
    off, bits = _LAYOUT[name]
    h = int.from_bytes(atp[:FMT.header_bytes], "big")
    return (h >> (FMT.header_bits - off - bits)) & ((1 << bits) - 1)


def _ecn_byte_mask() -> Tuple[int, int]:
    off, bits = _LAYOUT["ecn"]
    assert bits == 1
    return L2L4 + off // 8, 0x80 >> (off % 8)


def mask_ecn(frame: bytes) -> bytes:
    """The frame with the ATP ECN bit cleared (non-ATP frames unchanged)."""
    if traces.atp_payload(frame) is None:
        return frame
    i, m = _ecn_byte_mask()
    b = bytearray(frame)
    b[i] &= ~m & 0xFF
    return bytes(b)


def mac_bytes(mac: str) -> bytes:
    return bytes(int(x, 16) for x in mac.split(":"))


def filler_mac(port: int) -> str:
    return "02:ff:00:00:%02x:%02x" % (port >> 8, port & 0xFF)


def filler_frame(port: int, n: int) -> bytes:
    """A filler frame toward ``port`` (``l2_forward`` on its MAC), numbered ``n``."""
    return mac_bytes(filler_mac(port)) + traces.WORKER_MAC + struct.pack("!HI", FILLER_ETHERTYPE, n) + bytes(42)


def is_filler(frame: bytes) -> bool:
    return len(frame) >= 14 and struct.unpack("!H", frame[12:14])[0] == FILLER_ETHERTYPE


# -- the control plane of the switch under test ----------------------------------------------
def replay_plan(jobs: Sequence[int]) -> cp.SwitchPlan:
    """The DUT's entries from :func:`control.compute_plan`: every job two-level, its
    worker on host 0 (rack 0), its PS on host 1 (rack 1)."""
    specs = [{"job": int(j), "worker_hosts": [WORKER_HOST], "ps_hosts": [PS_HOST], "two_level": True} for j in jobs]
    plan = cp.compute_plan(OmegaConf.create(REPLAY_TOPOLOGY), OmegaConf.create(REPLAY_AGGREGATION), specs)
    hosts = {h.index: h for h in plan.hosts}
    if (ipaddress.IPv4Address(hosts[WORKER_HOST].ipv4).packed != traces.WORKER_IP
            or ipaddress.IPv4Address(hosts[PS_HOST].ipv4).packed != traces.PS_IP):
        raise ReplayError("the replay fabric's host addresses no longer match the trace's WORKER_IP/PS_IP")
    return plan.switch(DUT)


def replay_extras(sw: cp.SwitchPlan) -> List[cp.TableEntry]:
    """Entries the replay adds to the plan: the trace forwards a broadcast ARP frame (non-ATP
    traffic passes untouched), but the plan installs no flooding, so broadcast → uplink."""
    return [cp.TableEntry(cp.T_L2_FORWARD, {"hdr.ethernet.dst_addr": BROADCAST_MAC}, cp.A_SET_PORT,
                          {"port": int(sw.uplink_port)})]


def ports_of(sw: cp.SwitchPlan) -> List[int]:
    """Every port the DUT can send to under the plan, plus :data:`INJECT_PORT`."""
    ports = {INJECT_PORT}
    for t in sw.tables:
        if "port" in t.params:
            ports.add(int(t.params["port"]))
    for m in sw.multicast:
        ports.update(m.ports)
    for c in sw.clone_sessions:
        ports.add(c.port)
    if sw.uplink_port is not None:
        ports.add(sw.uplink_port)
    return sorted(ports)


def forward_ports(frame: bytes, sw: cp.SwitchPlan, extras: Sequence[cp.TableEntry] = ()) -> List[int]:
    """The ports the program sends ``frame`` to after its ATP stage, under the plan's entries:
    parameter packets to the job's multicast group (one replica per port), other IPv4 by
    ``ipv4_route`` (longest prefix), non-IPv4 by ``l2_forward``; ``[]`` = dropped."""
    tables = list(sw.tables) + list(extras)
    if len(frame) >= 34 and frame[12:14] == b"\x08\x00":
        if atp_field(frame, "is_param") == 1:
            job = atp_field(frame, "job")
            grp = next((t.params["grp"] for t in tables
                        if t.table == cp.T_ATP_JOB and t.match["hdr.atp.job"] == job), None)
            if grp is None:
                return []
            return sorted(p for m in sw.multicast if m.group == grp for p in m.ports)
        dst = ipaddress.IPv4Address(frame[30:34])
        best: Optional[Tuple[int, int]] = None
        for t in tables:
            if t.table != cp.T_IPV4_ROUTE:
                continue
            net = ipaddress.IPv4Network(t.match["hdr.ipv4.dst_addr"], strict=False)
            if dst in net and (best is None or net.prefixlen > best[0]):
                best = (net.prefixlen, int(t.params["port"]))
        return [best[1]] if best else []
    dmac = frame[0:6]
    for t in tables:
        if t.table == cp.T_L2_FORWARD and mac_bytes(str(t.match["hdr.ethernet.dst_addr"])) == dmac:
            return [int(t.params["port"])]
    return []


def cli_commands(sw: cp.SwitchPlan, extras: Sequence[cp.TableEntry] = ()) -> List[str]:
    """``simple_switch_CLI`` commands installing ``sw`` (BMv2 names are the control-qualified
    P4 names). ``mc_node_associate G n`` names the ``n``-th node created by these commands;
    :func:`install` substitutes the handle BMv2 reports for it."""
    cmds: List[str] = []
    for t in list(sw.tables) + list(extras):
        match = " ".join(str(v) for v in t.match.values())
        params = " ".join(str(v) for v in t.params.values())
        cmds.append(f"table_add {t.qualified_table} {t.qualified_action} {match} => {params}".rstrip())
    for n, m in enumerate(sw.multicast):
        cmds.append(f"mc_mgrp_create {m.group}")
        cmds.append(f"mc_node_create 0 {' '.join(str(p) for p in m.ports)}")
        cmds.append(f"mc_node_associate {m.group} {n}")
    for c in sw.clone_sessions:
        cmds.append(f"mirroring_add {c.session} {c.port}")
    for r in sw.registers:
        cmds.append(f"register_write {r.qualified_register} {r.index} {r.value}")
    return cmds


def ecn_commands(ports: Iterable[int]) -> List[str]:
    """Extra commands of an ECN run (fillers are forwarded by :func:`filler_commands`):
    threshold 0, rate-limited queues."""
    cmds = [f"register_write {cp.EGRESS}.{cp.R_ECN_THRESHOLD} 0 0"]
    cmds += [f"set_queue_rate {ECN_QUEUE_RATE_PPS} {p}" for p in ports]
    return cmds


_CLI_ERROR = re.compile(r"(?:^|RuntimeCmd:\s*)((?:Error|Invalid|Exception)\b.*)")


def check_cli_output(commands: Sequence[str], output: str) -> None:
    """Raise :class:`ReplayError` unless ``simple_switch_CLI`` accepted every command: no line
    (after the ``RuntimeCmd:`` prompts it prints when reading stdin) starting with
    ``Error``/``Invalid``/``Exception``, one "Entry has been added with handle" per
    ``table_add`` and one "node was created with handle" per ``mc_node_create``."""
    for ln in output.splitlines():
        m = _CLI_ERROR.search(ln.strip())
        if m:
            raise ReplayError(f"simple_switch_CLI: {m.group(1).strip()}")
    for cmd, said in (("table_add", "Entry has been added with handle"),
                      ("mc_node_create", "node was created with handle")):
        n = sum(1 for c in commands if c.split()[0] == cmd)
        got = output.count(said)
        if got != n:
            raise ReplayError(f"simple_switch_CLI confirmed {got} of {n} {cmd} commands")


# -- the trace as replay steps ----------------------------------------------------------------
@dataclass
class Step:
    scenario: str
    index: int  # step number within the scenario
    frame: bytes
    expected: Dict[int, List[bytes]]  # port -> frames
    congested: bool  # the trace's egress queue was above threshold: Python marked ECN

    @property
    def label(self) -> str:
        return f"{self.scenario}[{self.index}]"

    def n_expected(self) -> int:
        return sum(len(v) for v in self.expected.values())


@dataclass
class Scenario:
    name: str
    jobs: List[int]
    steps: List[Step]
    switch: Optional[cp.SwitchPlan]
    extras: List[cp.TableEntry] = field(default_factory=list)
    skip: Optional[str] = None  # why it is not replayed
    stats: Dict[str, int] = field(default_factory=dict)  # the Python switch's counters after the steps


def load_scenarios(records: Sequence[dict]) -> List[Scenario]:
    """Scenarios of a trace corpus (:func:`traces.load`) with each expected frame placed on its port."""
    out: List[Scenario] = []
    cur: Optional[Scenario] = None
    for r in records:
        if "step" not in r:
            skip = None
            if not r.get("p4_replay", True):
                skip = f"p4_replay false: {r.get('p4_replay_reason') or 'no reason given in the corpus'}"
            elif r["payload_k"] != FMT.payload_k or r["bitmap_bits"] != FMT.bitmap_bits:
                skip = f"format K={r['payload_k']}, bitmap {r['bitmap_bits']} differs from the generated header"
            elif r["n_aggregators"] != N_AGGREGATORS:
                skip = f"{r['n_aggregators']} aggregators, the program has ATP_N_AGG={N_AGGREGATORS}"
            sw = replay_plan(r["jobs"]) if skip is None else None
            cur = Scenario(r["scenario"], list(r["jobs"]), [], sw, replay_extras(sw) if sw else [], skip)
            out.append(cur)
            state = SwitchState(r["n_aggregators"], r["payload_k"], r["bitmap_bits"], jobs=r["jobs"])
            continue
        assert cur is not None and r["scenario"] == cur.name, f"step line before its scenario: {r['scenario']}"
        eg = r.get("egress")
        congested = bool(eg) and eg["backlog_bytes"] > eg["threshold_bytes"]
        expected: Dict[int, List[bytes]] = {}
        if cur.switch is not None:
            for o in r["out"]:
                frame = bytes.fromhex(o)
                for p in forward_ports(frame, cur.switch, cur.extras):
                    expected.setdefault(p, []).append(frame)
        cur.steps.append(Step(cur.name, int(r["step"]), bytes.fromhex(r["in"]), expected, congested))
        traces.run_step(state, bytes.fromhex(r["in"]), eg)
        cur.stats = state.stats.as_dict()
    return out


# -- comparison ---------------------------------------------------------------------------------
@dataclass
class Check:
    """One step of a run: its expected frames per port; ``check`` False = replayed only to
    build state (outputs consumed, not compared); ``ignore_ecn`` = compare with ECN masked."""

    step: Step
    check: bool = True
    ignore_ecn: bool = False


@dataclass
class Mismatch:
    label: str
    port: int
    expected: List[bytes]
    actual: List[bytes]
    note: str = ""

    def describe(self) -> str:
        lines = [f"MISMATCH at {self.label}, port {self.port}: expected {len(self.expected)} frame(s), "
                 f"got {len(self.actual)}" + (f" ({self.note})" if self.note else "")]
        e_list = _unmatched(self.expected, self.actual)
        a_list = _unmatched(self.actual, self.expected)
        for i in range(max(len(e_list), len(a_list))):
            e = e_list[i] if i < len(e_list) else None
            a = a_list[i] if i < len(a_list) else None
            if e is not None and a is not None:
                lines.append(f"  frame {i}: differs")
                lines += ["    " + d for d in frame_diff(e, a)]
            elif e is not None:
                lines.append(f"  frame {i}: MISSING  expected {describe_frame(e)}")
                lines.append(f"    {e.hex()}")
            else:
                lines.append(f"  frame {i}: UNEXPECTED  got {describe_frame(a)}")
                lines.append(f"    {a.hex()}")
        return "\n".join(lines)


def _unmatched(frames: Sequence[bytes], other: Sequence[bytes]) -> List[bytes]:
    """``frames`` minus ``other`` as multisets, in ``frames``' order."""
    left = Counter(other)
    out = []
    for f in frames:
        if left[f] > 0:
            left[f] -= 1
        else:
            out.append(f)
    return out


def describe_frame(f: bytes) -> str:
    if is_filler(f):
        return f"filler ({len(f)} B)"
    if traces.atp_payload(f) is not None:
        keys = ("job", "seq", "is_param", "edge", "resend", "collision", "agg1", "ecn", "bitmap0", "bitmap1")
        return "ATP " + " ".join(f"{k}={atp_field(f, k)}" for k in keys) + f" ({len(f)} B)"
    if len(f) >= 14 and f[12:14] == b"\x08\x00" and len(f) >= 34:
        return (f"IPv4 proto {f[23]} {ipaddress.IPv4Address(f[26:30])} -> "
                f"{ipaddress.IPv4Address(f[30:34])} ({len(f)} B)")
    return f"ethertype {f[12:14].hex() if len(f) >= 14 else '?'} to {f[:6].hex(':')} ({len(f)} B)"


def frame_diff(exp: bytes, act: bytes) -> List[str]:
    """Field-level differences of two frames (ATP header fields and lanes by name)."""
    out: List[str] = []
    if len(exp) != len(act):
        out.append(f"length: expected {len(exp)} B, got {len(act)} B")
    regions = [("ethernet dst", 0, 6), ("ethernet src", 6, 12), ("ethertype", 12, 14)]
    if exp[12:14] == b"\x08\x00":
        regions += [("ipv4 header", 14, 34), ("udp header", 34, 42)]
    for name, a, b in regions:
        if exp[a:b] != act[a:b]:
            out.append(f"{name}: expected {exp[a:b].hex()}, got {act[a:b].hex()}")
    if traces.atp_payload(exp) is not None and traces.atp_payload(act) is not None and len(act) >= len(exp):
        for name in _LAYOUT:
            e, g = atp_field(exp, name), atp_field(act, name)
            if e != g:
                out.append(f"atp.{name}: expected {e}, got {g}")
        base = L2L4 + FMT.header_bytes
        fmt = f"!{FMT.payload_k}i"
        ev = struct.unpack(fmt, exp[base:base + FMT.payload_bytes])
        av = struct.unpack(fmt, act[base:base + FMT.payload_bytes])
        lanes = [(i, e, g) for i, (e, g) in enumerate(zip(ev, av)) if e != g]
        if lanes:
            shown = ", ".join(f"d{i:02d} {e} -> {g}" for i, e, g in lanes[:6]) + (", ..." if len(lanes) > 6 else "")
            out.append(f"payload lanes differing: {len(lanes)} of {FMT.payload_k} ({shown})")
    else:
        n = min(len(exp), len(act))
        first = next((i for i in range(n) if exp[i] != act[i]), None)
        if first is not None:
            out.append(f"first differing byte at offset {first}: expected {exp[first:first + 16].hex()}, "
                       f"got {act[first:first + 16].hex()}")
    if len(exp) != len(act):
        out.append(f"expected {exp.hex()}")
        out.append(f"got      {act.hex()}")
    return out or ["(identical bytes)"]


@dataclass
class RunResult:
    checked_steps: int
    checked_frames: int
    mismatches: List[Mismatch]


def compare(checks: Sequence[Check], outputs: Dict[int, List[bytes]]) -> RunResult:
    """Walk each port's output stream in step order (per-port FIFO), give each step as many
    frames as it expects on that port and compare them as a multiset; fillers are skipped.
    Frames left over on a port after the last step are a mismatch too. Mismatches come back
    ordered by step, so the first is the earliest divergence."""
    streams = {p: [f for f in fs if not is_filler(f)] for p, fs in outputs.items()}
    pos = {p: 0 for p in streams}
    order: List[Tuple[int, Mismatch]] = []
    frames = 0
    ports = sorted(set(streams) | {p for c in checks for p in c.step.expected})
    for i, c in enumerate(checks):
        for p in ports:
            exp = c.step.expected.get(p, [])
            stream = streams.get(p, [])
            got = stream[pos.get(p, 0):pos.get(p, 0) + len(exp)]
            pos[p] = pos.get(p, 0) + len(exp)
            if not c.check:
                continue
            frames += len(exp)
            norm = mask_ecn if c.ignore_ecn else (lambda f: f)
            if Counter(map(norm, exp)) != Counter(map(norm, got)):
                note = "ECN bit ignored in this run" if c.ignore_ecn else ""
                if len(got) < len(exp):
                    note = "; ".join(x for x in (note, "port stream ended early") if x)
                order.append((i, Mismatch(c.step.label, p, exp, got, note)))
    for p in ports:
        extra = streams.get(p, [])[pos.get(p, 0):]
        if extra:
            last = checks[-1].step.label if checks else "?"
            order.append((len(checks), Mismatch(f"after {last}", p, [], extra,
                                                 "frames beyond every expected one on this port")))
    order.sort(key=lambda t: t[0])
    return RunResult(sum(1 for c in checks if c.check), frames, [m for _, m in order])


# -- runs -----------------------------------------------------------------------------------------
@dataclass
class Run:
    """One pass of a scenario through the switch: the state reset, the entries, the input
    frames (in order) and what to compare."""

    name: str
    scenario: Scenario
    commands: List[str]
    inputs: List[bytes]
    checks: List[Check]
    rate_limited: Dict[int, int] = field(default_factory=dict)  # port -> frames queued at ECN_QUEUE_RATE_PPS
    count_stats: bool = False  # compare the program's stats counter with SwitchStats afterwards

    def expected_frames(self) -> int:
        """Frames to wait for: every expected output plus the fillers."""
        return sum(c.step.n_expected() for c in self.checks) + sum(1 for f in self.inputs if is_filler(f))


def marker_frame(sw: cp.SwitchPlan, n: int) -> bytes:
    """The frame that ends a run's inputs: a filler toward the uplink (:func:`filler_commands`).
    The ingress handles frames in arrival order, so once it is out every input has passed."""
    return filler_frame(marker_port(sw), n)


def marker_port(sw: cp.SwitchPlan) -> int:
    return int(sw.uplink_port) if sw.uplink_port is not None else max(ports_of(sw))


def filler_commands(sw: cp.SwitchPlan) -> List[str]:
    """``l2_forward`` entries for the filler MAC of every port (fillers and the end marker)."""
    return [f"table_add {cp.INGRESS}.{cp.T_L2_FORWARD} {cp.INGRESS}.{cp.A_SET_PORT} {filler_mac(p)} => {p}"
            for p in ports_of(sw) if p != INJECT_PORT]


def plan_runs(sc: Scenario) -> List[Run]:
    """The main run of a scenario, plus one ECN run per congested step."""
    assert sc.switch is not None
    base = cli_commands(sc.switch, sc.extras) + filler_commands(sc.switch)
    runs = [Run(sc.name, sc, base, [s.frame for s in sc.steps],
                [Check(s, True, ignore_ecn=s.congested) for s in sc.steps], count_stats=True)]
    for k, s in enumerate(sc.steps):
        if not s.congested:
            continue
        ports = sorted(s.expected)
        fillers = [filler_frame(p, n) for n in range(ECN_FILLERS) for p in ports]
        inputs = [t.frame for t in sc.steps[:k]] + fillers + [s.frame]
        checks = [Check(t, False) for t in sc.steps[:k]] + [Check(s, True)]
        queued = {p: ECN_FILLERS + sum(len(t.expected.get(p, [])) for t in sc.steps[:k + 1]) for p in ports}
        runs.append(Run(f"{sc.name}/ecn@{s.index}", sc, base + ecn_commands(ports), inputs, checks, queued))
    return runs


def install(cli: CLI, commands: Sequence[str]) -> str:
    """Run ``commands`` (from :func:`cli_commands`) in the CLI session; multicast nodes are
    associated by the handles BMv2 reports (``mc_node_associate`` names the n-th created
    node). Raises :class:`ReplayError` unless every command was accepted."""
    outs, batch, handles = [], [], []
    for c in commands:
        w = c.split()
        if w[0] == "mc_node_associate":
            c = f"mc_node_associate {w[1]} {handles[int(w[2])]}"
        batch.append(c)
        if w[0] == "mc_node_create":
            out = _cli(cli, batch)
            outs.append(out)
            batch = []
            m = re.search(r"node was created with handle (\d+)", out)
            if not m:
                raise ReplayError(f"simple_switch_CLI reported no handle for '{c}': {out.strip()[-300:]}")
            handles.append(int(m.group(1)))
    outs.append(_cli(cli, batch))
    text = "".join(outs)
    check_cli_output(commands, text)
    return text


def _cli(cli: CLI, commands: Sequence[str]) -> str:
    try:
        return cli.run(commands)
    except P4ToolError as e:
        raise ReplayError(str(e)) from None


def read_stats(cli: CLI) -> Dict[str, int]:
    """The program's ``stats`` counter by :class:`SwitchStats` field name."""
    out = _cli(cli, [f"counter_read {cp.INGRESS}.stats {i}" for i in range(len(STATS))])
    got = parse_counter(out)
    if sorted(got) != list(range(len(STATS))):
        raise ReplayError(f"counter_read {cp.INGRESS}.stats: {out.strip()[-300:]}")
    return {name: got[i] for i, name in enumerate(STATS)}


def compare_stats(python: Dict[str, int], p4: Dict[str, int]) -> List[str]:
    """Differences between the Python switch's counters and the program's, except
    ``stale_reclaimed`` (the program frees stale aggregators lazily, when a packet touches
    them; p4/README.md)."""
    return [f"{k}: Python {python.get(k, 0)}, P4 {p4.get(k, 0)}" for k in STATS
            if k not in LAZY_STATS and python.get(k, 0) != p4.get(k, 0)]


def execute(run: Run, ss: SimpleSwitch, reset: bool = True, timeout_s: float = 10.0,
            quiet_s: float = 0.2) -> Dict[int, List[bytes]]:
    """Reset the switch's state, install ``run``'s entries, send its inputs then the end
    marker on :data:`INJECT_PORT`, and collect every frame the switch sends until the
    marker, the expected frames and a quiet period of ``quiet_s`` have passed."""
    assert ss.cli is not None
    sw = run.scenario.switch
    assert sw is not None
    if reset:
        _cli(ss.cli, ["reset_state"])
    install(ss.cli, run.commands)
    left = ss.recv_ready()
    if left:
        raise ReplayError(f"{len(left)} frame(s) from before this run were still arriving (first on port {left[0][0]})")
    marker = marker_frame(sw, 1 << 31)
    for f in run.inputs + [marker]:
        ss.send(INJECT_PORT, f)
    want = run.expected_frames()
    drain = max(run.rate_limited.values(), default=0) / ECN_QUEUE_RATE_PPS
    deadline = time.monotonic() + timeout_s + drain
    outputs: Dict[int, List[bytes]] = {}
    got, seen_marker = 0, False
    while time.monotonic() < deadline:
        r = ss.recv(quiet_s if (seen_marker and got >= want) else 0.05)
        if r is None:
            if seen_marker and got >= want:
                break
            continue
        p, f = r
        if f == marker:
            seen_marker = True
            continue
        outputs.setdefault(p, []).append(f)
        got += 1
    if not seen_marker:
        raise ReplayError(f"the end-of-run marker never came back from port {marker_port(sw)} within "
                          f"{timeout_s + drain:.0f} s: the switch did not process the inputs")
    return outputs


def replay(scenarios: Sequence[Scenario], json_path: Path, workdir: Path, timeout_s: float = 10.0,
           log: bool = False, out=None) -> int:
    """Run every scenario through one ``simple_switch`` (its state reset between runs); print
    one line per run, the first mismatch in detail, a summary. Returns the exit status
    (0 match, 1 mismatch, 2 a run could not be carried out)."""
    out = out or sys.stdout
    first: Optional[Mismatch] = None
    n_runs = n_steps = n_frames = n_bad = n_counted = 0
    skipped, errors = [], []
    todo = [sc for sc in scenarios if not sc.skip]
    skipped = [f"{sc.name} ({sc.skip})" for sc in scenarios if sc.skip]
    runs = [r for sc in todo for r in plan_runs(sc)]
    runs.sort(key=lambda r: bool(r.rate_limited))  # rate-limited ECN runs last
    if runs:
        try:
            ss = SimpleSwitch(json_path, workdir, log_file=workdir / "bmv2.log" if log else None)
        except P4ToolError as e:
            print(f"error: {e}", file=out)
            return 2
        try:
            for k, run in enumerate(runs):
                try:
                    outputs = execute(run, ss, reset=k > 0, timeout_s=timeout_s)
                    counters = read_stats(ss.cli) if run.count_stats else None  # type: ignore[arg-type]
                except ReplayError as exc:
                    errors.append(f"{run.name}: {exc}")
                    print(f"{run.name:<40} ERROR: {exc}", file=out)
                    if not ss.alive():
                        break
                    continue
                res = compare(run.checks, outputs)
                stat_diff = compare_stats(run.scenario.stats, counters) if counters is not None else []
                n_runs += 1
                n_steps += res.checked_steps
                n_frames += res.checked_frames
                n_counted += counters is not None
                status = ("ok" if not res.mismatches
                          else f"{len(res.mismatches)} MISMATCH(ES), first at {res.mismatches[0].label}")
                if stat_diff:
                    status += "; COUNTERS differ: " + ", ".join(stat_diff)
                print(f"{run.name:<40} {res.checked_steps:3d} steps {res.checked_frames:3d} frames  {status}", file=out)
                if res.mismatches or stat_diff:
                    n_bad += 1
                    if first is None and res.mismatches:
                        first = res.mismatches[0]
        finally:
            ss.close()
    if first is not None:
        print("", file=out)
        print(first.describe(), file=out)
        print("(outputs are attributed to steps by their order on each port: a missing or extra frame "
              "earlier on the same port shifts the attribution)", file=out)
    print("", file=out)
    print(f"summary: {len(todo)} scenario(s) replayed in {n_runs} run(s), {n_steps} step(s), {n_frames} expected "
          f"frame(s) compared, counters compared for {n_counted} scenario(s); {n_bad} run(s) with mismatches; "
          f"{len(skipped)} scenario(s) not replayable", file=out)
    for s in skipped:
        print(f"not replayable: {s}", file=out)
    if errors:
        print(f"{len(errors)} run(s) failed to run (not compared): {'; '.join(errors)}", file=out)
    return 2 if errors else 1 if n_bad else 0


# -- command line ---------------------------------------------------------------------------------
def dry_run(scenarios: Sequence[Scenario], out=None) -> None:
    out = out or sys.stdout
    for sc in scenarios:
        if sc.skip:
            print(f"# {sc.name}: not replayable ({sc.skip})", file=out)
            continue
        for run in plan_runs(sc):
            print(f"# run {run.name}: reset_state, then {len(run.inputs)} input frame(s) on port {INJECT_PORT}",
                  file=out)
            for c in run.commands:
                print(c, file=out)
            for c in run.checks:
                s = c.step
                tag = "" if c.check else " (state only, not compared)"
                tag += " (ECN bit ignored)" if c.ignore_ecn else ""
                print(f"#   {s.label}{tag}: in {describe_frame(s.frame)}", file=out)
                for p, fs in sorted(s.expected.items()):
                    for f in fs:
                        print(f"#     -> port {p}: {describe_frame(f)}", file=out)
                if not s.expected:
                    print("#     -> (no output)", file=out)
            if run.count_stats:
                nz = {k: v for k, v in sc.stats.items() if v}
                print(f"#   counters after the run: {nz}", file=out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m atp_pipeline.ina.p4.bmv2", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE_FILE,
                    help=f"trace corpus (default {DEFAULT_TRACE_FILE}, relative to the current directory)")
    ap.add_argument("--p4", type=Path, default=DEFAULT_V1MODEL_P4,
                    help=f"the v1model program to compile (default {DEFAULT_V1MODEL_P4}; unused with --json)")
    ap.add_argument("--scenario", action="append", help="replay only this scenario (repeatable)")
    ap.add_argument("--json", type=Path, help="an already compiled BMv2 JSON (skips p4c)")
    ap.add_argument("--workdir", type=Path, help="where the JSON and the switch's output go (default: a "
                                                   "temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    ap.add_argument("--log", action="store_true", help="BMv2 packet log in <workdir>/bmv2.log (slow)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a run's outputs")
    ap.add_argument("--dry-run", action="store_true", help="print the runs, commands and expected outputs; no BMv2")
    a = ap.parse_args(argv)
    try:
        scenarios = load_scenarios(traces.load(a.trace))
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: cannot read {a.trace}: {exc}", file=sys.stderr)
        return 2
    if a.scenario:
        unknown = sorted(set(a.scenario) - {s.name for s in scenarios})
        if unknown:
            print(f"error: unknown scenario(s) {', '.join(unknown)} (have: {', '.join(s.name for s in scenarios)})",
                  file=sys.stderr)
            return 2
        scenarios = [s for s in scenarios if s.name in a.scenario]
    if a.dry_run:
        dry_run(scenarios)
        return 0
    why = why_missing(("simple_switch", "simple_switch_CLI") + (() if a.json else ("p4c-bm2-ss",)))
    if why:
        print(f"error: {why}; or use --dry-run", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("error: the replay runs simple_switch on veth pairs in a network namespace of its own: it needs root",
              file=sys.stderr)
        return 2
    if a.json is None and not a.p4.is_file():
        print(f"error: no P4 program at {a.p4} (run from the repository root, or pass --p4 or --json)",
              file=sys.stderr)
        return 2
    tmp = None
    workdir = a.workdir
    if workdir is None:
        tmp = tempfile.mkdtemp(prefix="atp-bmv2-replay-")
        workdir = Path(tmp)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        if a.json is None:
            json_path = workdir / "atp.json"
            compile_v1model(a.p4.resolve(), json_path).check()
        else:
            json_path = a.json
        return replay(scenarios, json_path.resolve(), workdir.resolve(), a.timeout, a.log)
    except (ReplayError, P4ToolError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if tmp is not None:
            if a.keep:
                print(f"work directory kept: {tmp}")
            else:
                shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
