"""Packet-trace corpus of the ATP switch function, for P4 replay (§5.3 Figure 4).

Crafted packet sequences drive :func:`atp_pipeline.ina.switch.process` through every
branch of Figure 4 (allocation, ① hit / collision, ② deallocation on parameter packets,
③ per-level fan-in, ④ duplicate, ⑥ completion, ⑦ second-level resend flush, ⑧/⑨/⑩
first-level resend, ECN marking, stale watermarks, malformed and unknown-job drops) plus
non-ATP frames, which a switch must forward untouched. Inputs and the Python switch's
outputs are written as whole Ethernet/IPv4/UDP frames in hex to a JSON-lines file (the
checkout's ``p4/traces/atp.jsonl``) so that a BMv2 run can inject the inputs and compare its outputs packet by packet.

Format (JSON lines): a scenario line ``{"scenario", "n_aggregators", "jobs",
"payload_k", "bitmap_bits", "p4_replay", "p4_replay_reason", "doc"}`` followed by its step lines
``{"scenario", "step", "in", "out", "egress"}``; ``in`` is one frame, ``out`` the list of
frames the switch emits in order, ``egress`` (or null) the queue state
``{"backlog_bytes", "threshold_bytes"}`` under which :func:`ecn_mark` ran on each output.
Each scenario starts from an empty switch. ``p4_replay`` is false, with the reason in
``p4_replay_reason``, where the Python state has no P4 equivalent (a switch with zero
aggregators); every other scenario is replayed on BMv2 (:mod:`atp_pipeline.ina.p4.bmv2`).

Usage, from the repository root: ``python -m atp_pipeline.ina.p4.traces`` (rewrite) /
``--check`` (exit 1 if stale); ``--out FILE`` (default ``p4/traces/atp.jsonl`` under the
current directory).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from atp_pipeline.ina.p4.codegen import N_AGGREGATORS
from atp_pipeline.ina.packet import ATP_UDP_PORT, DecodeError, PacketFormat
from atp_pipeline.ina.switch import SwitchState, agg_hash, agg_slot, ecn_mark, process_batch, process_bytes

DEFAULT_TRACE_FILE = Path("p4") / "traces" / "atp.jsonl"  # CLI default, relative to the current directory
WORKER_MAC, PS_MAC = bytes.fromhex("020000000001"), bytes.fromhex("020000000002")
WORKER_IP, PS_IP = bytes([10, 0, 0, 1]), bytes([10, 0, 1, 1])
FMT = PacketFormat()


def _ip_checksum(hdr: bytes) -> int:
    s = sum(struct.unpack("!10H", hdr))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def udp_frame(payload: bytes, smac: bytes, dmac: bytes, sip: bytes, dip: bytes, dport: int = ATP_UDP_PORT,
              proto: int = 17) -> bytes:
    """Ethernet/IPv4/UDP encapsulation of ``payload`` as a host's NIC sends it (source port
    ``ATP_UDP_PORT``, UDP checksum 0); ``proto`` != 17 carries ``payload`` directly."""
    l4 = struct.pack("!HHHH", ATP_UDP_PORT, dport, 8 + len(payload), 0) + payload if proto == 17 else payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 0, 0, 64, proto, 0, sip, dip)
    ip = ip[:10] + struct.pack("!H", _ip_checksum(ip)) + ip[12:]
    return dmac + smac + b"\x08\x00" + ip + l4


def frame(payload: bytes, dport: int = ATP_UDP_PORT, to_ps: bool = True, proto: int = 17) -> bytes:
    """A trace frame: gradients go worker → PS, parameter packets PS → workers."""
    smac, dmac = (WORKER_MAC, PS_MAC) if to_ps else (PS_MAC, WORKER_MAC)
    sip, dip = (WORKER_IP, PS_IP) if to_ps else (PS_IP, WORKER_IP)
    return udp_frame(payload, smac, dmac, sip, dip, dport, proto)


def atp_payload(buf: bytes) -> Optional[bytes]:
    """The ATP bytes of a frame, or ``None`` if it is not ATP (the switch's classifier)."""
    if len(buf) < 42 or buf[12:14] != b"\x08\x00" or buf[23] != 17:
        return None
    if struct.unpack("!H", buf[36:38])[0] != ATP_UDP_PORT:
        return None
    return buf[42:]


@dataclass
class Scenario:
    name: str
    doc: str
    frames: List[bytes]
    n_aggregators: int = N_AGGREGATORS
    jobs: Tuple[int, ...] = (1,)
    egress: List[Optional[Dict[str, int]]] = field(default_factory=list)
    p4_replay_reason: Optional[str] = None  # why BMv2 cannot replay it (None: it can)


def _colliding_seq(job: int, seq: int, n: int, other_job: Optional[int] = None) -> int:
    """A sequence number of ``other_job`` (default ``job``) hashing to ``seq``'s aggregator."""
    oj = job if other_job is None else other_job
    target = agg_slot(agg_hash(job, seq), n)
    s = seq + 1
    while agg_slot(agg_hash(oj, s), n) != target:
        s += 1
    return s


def scenarios() -> List[Scenario]:
    """The crafted corpus (deterministic)."""
    rng = np.random.default_rng(7)

    def g(**kw) -> bytes:  # gradient frame
        kw.setdefault("job", 1)
        kw.setdefault("fan_in0", 2)
        kw.setdefault("payload", rng.integers(-1000, 1000, FMT.payload_k, dtype=np.int32))
        return frame(FMT.encode(FMT.packet(**kw)))

    def par(**kw) -> bytes:  # parameter frame
        kw.setdefault("job", 1)
        kw.setdefault("fan_in0", 2)
        kw.setdefault("bitmap0", 3)
        return frame(FMT.encode(FMT.packet(is_param=1, **kw)), to_ps=False)

    N = N_AGGREGATORS
    s_col = _colliding_seq(1, 100, N)
    s_col2 = _colliding_seq(1, 300, N, other_job=2)
    s_sweep = _colliding_seq(1, 20, N, other_job=2)  # job 2's sequence on job 1's seq-20 slot
    s_sweep2 = _colliding_seq(1, 40, N, other_job=2)
    udp_other = frame(b"not atp", dport=53)
    tcp = frame(bytes(20) + b"tcp bytes", proto=6)
    raw = bytes.fromhex("ffffffffffff020000000009") + b"\x08\x06" + bytes(28)
    good = FMT.encode(FMT.packet(job=1, seq=17, fan_in0=1, bitmap0=1,
                                 payload=rng.integers(-1000, 1000, FMT.payload_k, dtype=np.int32)))
    return [
        Scenario("aggregate_complete_dealloc", "allocation, ① hit + ④ merge, ⑤⑥ completion at fan-in 2 "
                 "(level 0), ② deallocation and multicast by the parameter packet",
                 [g(seq=1, worker_id=0, bitmap0=1), g(seq=1, worker_id=1, bitmap0=2), par(seq=1, watermark=1)]),
        Scenario("fan_in_one", "allocation that completes at once (fan-in 1), at level 0 and at level 1",
                 [g(seq=2, fan_in0=1, bitmap0=1),
                  g(seq=3, fan_in0=2, bitmap0=3, fan_in1=1, bitmap1=1, edge=1)]),
        Scenario("duplicate", "④ already aggregated and not a retransmission: dropped; a new bit merges "
                 "without completing (⑥ consumed)",
                 [g(seq=4, bitmap0=1, fan_in0=3), g(seq=4, bitmap0=1, fan_in0=3), g(seq=4, bitmap0=2, fan_in0=3)]),
        Scenario("collision", "① occupied by another ⟨job, seq⟩ (same job; other job at level 1): "
                 "forwarded with resend + collision, edge flipped",
                 [g(seq=100, bitmap0=1), g(seq=s_col, bitmap0=1),
                  g(seq=300, fan_in0=2, bitmap0=3, fan_in1=2, bitmap1=1, edge=1),
                  g(job=2, seq=s_col2, fan_in0=2, bitmap0=3, fan_in1=2, bitmap1=2, edge=1)], jobs=(1, 2)),
        Scenario("resend_level0", "first-level resend: ④ merge a new bit then ⑨ carry value+bitmap and ⑩ "
                 "deallocate; ⑧ bit already set: carry without merging",
                 [g(seq=5, fan_in0=3, bitmap0=1, ecn=1), g(seq=5, fan_in0=3, bitmap0=2, resend=1),
                  g(seq=6, fan_in0=3, bitmap0=4, overflow=1), g(seq=6, fan_in0=3, bitmap0=4, resend=1)]),
        Scenario("resend_level1", "second-level resend hitting its aggregator: ⑦ forward the "
                 "retransmission and flush the partial level-1 aggregate in a clone, ⑩ deallocate",
                 [g(seq=7, fan_in0=2, bitmap0=3, fan_in1=3, bitmap1=1, edge=1, agg1=0, ecn=1, overflow=1),
                  g(seq=7, fan_in0=2, bitmap0=1, fan_in1=3, bitmap1=2, edge=1, resend=1)]),
        Scenario("resend_miss", "resend without an aggregator of its own: upstream untouched, never "
                 "allocates (collision flag when the slot is occupied)",
                 [g(seq=8, bitmap0=1, resend=1), g(seq=100, bitmap0=1), g(seq=s_col, bitmap0=2, resend=1)]),
        Scenario("level1_complete", "two-level aggregation: two level-0 aggregates merge at level 1 and "
                 "complete with agg1",
                 [g(seq=9, fan_in0=2, bitmap0=3, fan_in1=2, bitmap1=1, edge=1),
                  g(seq=9, fan_in0=2, bitmap0=3, fan_in1=2, bitmap1=2, edge=1, ecn=1)]),
        Scenario("stale_watermark", "parameter packets raise the shard watermark and sweep the "
                 "aggregators of the sequences it crossed; a gradient below it is forwarded without "
                 "allocating; the swept slots are allocated again by the job's later sequences (same "
                 "outputs as the v1model program's lazy sweep)",
                 [g(seq=20, bitmap0=1), g(seq=40, bitmap0=1), par(seq=21, watermark=50), par(seq=21, watermark=3),
                  g(seq=10, bitmap0=1), g(seq=_reclaim_seq(1, 20, 50, N), bitmap0=1),
                  par(seq=_reclaim_seq(1, 40, 50, N), watermark=50)]),
        Scenario("ecn", "ECN: a congested egress queue marks a forwarded packet (§5.4); an ECN bit is OR-ed "
                 "through aggregation",
                 [g(seq=11, fan_in0=1, bitmap0=1), g(seq=12, bitmap0=1, ecn=1), g(seq=12, bitmap0=2)],
                 egress=[{"backlog_bytes": 100_000, "threshold_bytes": 64_000}, None, None]),
        Scenario("malformed_and_service", "no aggregation service at a level (fan-in 0): plain forward; "
                 "malformed headers dropped; unknown job dropped",
                 [g(seq=13, fan_in0=2, bitmap0=1, edge=1), g(seq=13, fan_in0=2, bitmap0=4, edge=1),
                  g(seq=14, bitmap0=3), g(seq=14, fan_in0=0, bitmap0=1, fan_in1=2, bitmap1=1, edge=1),
                  g(job=9, seq=15, bitmap0=1)]),
        Scenario("malformed_frames", "frames to the ATP port that are not well-formed ATP packets are "
                 "dropped (wrong app type, reserved bits set, truncated, oversized); the aggregator "
                 "they hash to is untouched, so a valid packet of the same sequence then completes",
                 [frame(b"\xa6" + good[1:]), frame(good[:FMT.header_bytes - 1] + bytes([good[FMT.header_bytes - 1] | 1])
                                                    + good[FMT.header_bytes:]),
                  frame(good[:-4]), frame(good + bytes(4)), frame(good)]),
        Scenario("non_atp", "non-ATP traffic (other UDP port, TCP, ARP) passes untouched",
                 [udp_other, tcp, raw]),
        Scenario("no_aggregators", "a switch with zero aggregators treats every gradient as a collision",
                 [g(seq=16, bitmap0=1)], n_aggregators=0,
                 p4_replay_reason="a switch with zero aggregators has no P4 equivalent: a P4 register array "
                                  "has at least one entry (ATP_N_AGG >= 1), so the program always has an "
                                  "aggregator to hash to"),
        Scenario("watermark_sweep", "a parameter packet that raises the watermark frees its ⟨job, shard⟩'s "
                 "aggregators below it wherever they hash (here: another job then allocates the slot "
                 "instead of colliding), and a jump longer than the array walks the array. The v1model "
                 "program applies the sweep lazily (a touched aggregator below its own job's watermark "
                 "is free to any job's packet): the same outputs",
                 [g(seq=20, bitmap0=1), g(seq=40, bitmap0=1, ps_index=1), par(seq=21, watermark=50),
                  g(job=2, seq=s_sweep, bitmap0=1), g(job=2, seq=s_sweep, bitmap0=2),
                  par(seq=41, watermark=100_001, ps_index=1),
                  g(job=2, seq=s_sweep2, bitmap0=1)], jobs=(1, 2)),
    ]


def _reclaim_seq(job: int, seq: int, floor: int, n: int) -> int:
    """A sequence ≥ ``floor`` of ``job`` hashing to ``seq``'s aggregator."""
    s = _colliding_seq(job, seq, n)
    while s < floor:
        s = _colliding_seq(job, s, n)
    return s


def run_step(st: SwitchState, buf: bytes, egress: Optional[Dict[str, int]]) -> List[bytes]:
    """One frame through the switch: classifier, :func:`process`, egress ECN marking."""
    atp = atp_payload(buf)
    if atp is None:
        return [buf]  # non-ATP traffic is forwarded untouched
    _, outs = process_bytes(st, FMT, atp)  # a malformed ATP payload is dropped (and counted)
    return _frames(buf, outs, egress)


def _frames(buf: bytes, outs: Sequence[object], egress: Optional[Dict[str, int]]) -> List[bytes]:
    """The switch's output packets for input frame ``buf`` as frames: its headers, each packet
    marked by the egress (ECN) and encoded."""
    res = []
    for o in outs:
        if egress is not None:
            o = ecn_mark(o, egress["backlog_bytes"], egress["threshold_bytes"])
        res.append(buf[:42] + FMT.encode(o))
    return res


def generate() -> Iterator[dict]:
    """The corpus records (scenario line, then its steps), outputs from :func:`process`."""
    for sc in scenarios():
        yield {"scenario": sc.name, "n_aggregators": sc.n_aggregators, "jobs": list(sc.jobs),
               "payload_k": FMT.payload_k, "bitmap_bits": FMT.bitmap_bits,
               "p4_replay": sc.p4_replay_reason is None, "p4_replay_reason": sc.p4_replay_reason, "doc": sc.doc}
        st = SwitchState(sc.n_aggregators, FMT.payload_k, FMT.bitmap_bits, jobs=sc.jobs)
        eg = sc.egress or [None] * len(sc.frames)
        for i, (buf, e) in enumerate(zip(sc.frames, eg)):
            outs = run_step(st, buf, e)
            yield {"scenario": sc.name, "step": i, "in": buf.hex(), "out": [o.hex() for o in outs], "egress": e}


def render() -> str:
    return "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in generate())


def load(path: Path) -> List[dict]:
    """The records of a trace file written by :func:`render`."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def replay(records: Sequence[dict], batched: bool = False) -> List[Tuple[dict, List[str]]]:
    """Re-run every step's input through a fresh Python switch per scenario:
    ``[(step_record, actual_output_hex), ...]``. ``batched``: each run of well-formed ATP
    frames goes through :func:`~atp_pipeline.ina.switch.process_batch` at once (the live
    emulator's batch form), flushed before a frame the classifier forwards or drops — the
    outputs must be the per-frame ones."""
    out: List[Tuple[dict, List[str]]] = []
    st: Optional[SwitchState] = None
    pending: List[Tuple[dict, bytes, object]] = []

    def flush() -> None:
        if pending:
            assert st is not None
            outs = process_batch(st, [p for _, _, p in pending])
            for (r, buf, _), os_ in zip(pending, outs):
                out.append((r, [f.hex() for f in _frames(buf, os_, r["egress"])]))
            pending.clear()

    for r in records:
        if "step" not in r:
            flush()
            st = SwitchState(r["n_aggregators"], r["payload_k"], r["bitmap_bits"], jobs=r["jobs"])
            continue
        assert st is not None
        buf = bytes.fromhex(r["in"])
        if batched:
            atp = atp_payload(buf)
            try:
                pkt = FMT.decode(atp) if atp is not None else None
            except DecodeError:
                pkt = None
            if pkt is not None:
                pending.append((r, buf, pkt))
                continue
            flush()
        out.append((r, [o.hex() for o in run_step(st, buf, r["egress"])]))
    flush()
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m atp_pipeline.ina.p4.traces", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the trace file is stale")
    ap.add_argument("--out", "--trace", dest="trace", type=Path, default=DEFAULT_TRACE_FILE,
                    help=f"trace file to write or check (default {DEFAULT_TRACE_FILE}, relative to the "
                         "current directory: run from the repository root)")
    a = ap.parse_args(argv)
    path: Path = a.trace
    text = render()
    if a.check:
        ok = path.is_file() and path.read_text(encoding="utf-8") == text
        if not ok:
            state = "stale" if path.is_file() else "missing"
            print(f"{state}: {path} (run python -m atp_pipeline.ina.p4.traces --out {path}, from the repository "
                  "root)", file=sys.stderr)
        return 0 if ok else 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
