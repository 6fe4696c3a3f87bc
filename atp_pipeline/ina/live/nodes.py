"""The live ATP roles as processes: the switch emulator and the parameter server.

Each role owns one UDP socket for ATP packets (the ATP header and payload are the UDP
payload, exactly the bytes of :meth:`PacketFormat.encode`) and a control server
(:mod:`.rpc`) for job setup/teardown (§5.1) and statistics. The data plane is one thread
that hands every datagram to the protocol's transport-free role — the switch emulator
runs :func:`atp_pipeline.ina.switch.process`, the very function the simulator runs and the
P4 programs mirror, over each drained batch (:func:`~atp_pipeline.ina.switch.process_batch`);
the parameter server runs :class:`~atp_pipeline.ina.ps.ParameterServer`
— and sends what it returns.

Forwarding replaces the fabric of the simulator. The switch keeps, per job, a route
installed at job setup: ``up[shard]`` (where gradients of PS shard ``shard`` go: the PS,
or the next switch for two-level aggregation) and ``down`` (where parameter packets are
multicast: the job's workers, or the first-level switches). On real hardware the same
packets travel as UDP to the PS's address on :data:`~atp_pipeline.ina.packet.ATP_UDP_PORT`
and the switch sits on the path; on loopback the end hosts address the emulator instead.
A parameter packet the PS sends to one worker (the answer to a retransmission of a
completed sequence) goes straight to that worker: on hardware it would cross the switch,
whose ② step finds nothing to deallocate for a completed sequence.

Congestion (§5.4): the emulator's queue is its socket's receive buffer. Every few packets
it reads the buffer's occupancy (``SO_MEMINFO``) and, above ``ecn_threshold`` bytes (default
an eighth of the buffer the kernel granted, at least 256 KiB), marks
the packets it sends with :func:`~atp_pipeline.ina.switch.ecn_mark` — the same egress
marking the simulator's links apply — so the workers' AIMD backs off before the buffer
overflows. Datagrams the kernel drops on a full buffer are counted (``socket_drops``).

Fault injection (the Must-show's "loss at the switch"): every datagram arriving at the
emulator is dropped with probability ``loss`` and delivered twice with probability
``duplicate`` (seeded); both are counted.

Run standalone (e.g. one switch shared by several training runs)::

    python -m atp_pipeline.ina.live.nodes switch --aggregators 4096 --payload-k 1024 --control-port 47000
    python -m atp_pipeline.ina.live.nodes switch --impl bmv2 --aggregators 4096 --p4 p4/v1model/atp.p4

It prints one JSON line — its addresses and its owner token (:mod:`.tenancy`) — and serves until
``shutdown`` or a signal. Its control channel (:mod:`.rpc`) needs a secret (:mod:`.auth`):
``--secret-file PATH`` or ``ATP_AUTHKEY``; without either a role on a loopback address generates
one and writes it to a file of mode 0600 (its path is the line's ``secret_file``), where this
user's clients — ``train.py aggregation.switch=HOST:PORT`` — find it; on any other address
it exits 2 with one line.
``--max-bytes`` bounds what the role stores (:mod:`atp_pipeline.ina.budget`): a switch whose aggregators
need more exits 2 with one line; a job that would take a SwitchML switch or a parameter server beyond
it is refused at setup. A job's packets are taken only from its members (:meth:`Role.admits`).
``--impl bmv2`` runs BMv2 with the compiled v1model program as the data plane instead of the
emulator (:mod:`.bmv2_node`; root and the P4 toolchain needed); on ``shutdown``, SIGTERM,
SIGINT or SIGHUP it stops the switch, whose namespace and veth pairs then go away.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, NoReturn, Optional, Set, Tuple

import numpy as np

from atp_pipeline.ina import budget
from atp_pipeline.ina.job import JobLayout
from atp_pipeline.ina.live import auth
from atp_pipeline.ina.live.frames import MAX_DATAGRAM, drain, spin_budget, sum_threads
from atp_pipeline.ina.live.role import Role, meminfo
from atp_pipeline.ina.live.rpc import Addr
from atp_pipeline.ina.live.shm import SharedLanes
from atp_pipeline.ina.packet import DecodeError, PacketFormat
from atp_pipeline.ina.ps import ParameterServer
from atp_pipeline.ina.switch import (
    SwitchState,
    agg_hash,
    agg_slot,
    allocated,
    ecn_mark,
    live_aggregators,
    process_batch,
)
from atp_pipeline.ina.switchml import SMLFormat, SMLPacket, SMLSwitch, SMLSwitchJob


class SwitchNode(Role):
    """The emulated programmable switch: :func:`process` (over batches: :func:`process_batch`) plus per-job routes."""

    role = "switch"

    def __init__(self, fmt: PacketFormat, n_aggregators: int, loss: float = 0.0, duplicate: float = 0.0,
                 seed: int = 0, ecn_threshold: Optional[int] = None, **kw: Any) -> None:
        budget.check(f"a switch of {n_aggregators:,} aggregators × {fmt.payload_k:,} values",
                     budget.switch_bytes(n_aggregators, fmt.payload_k), kw.get("max_bytes", budget.DEFAULT_MAX_BYTES))
        super().__init__(fmt, **kw)
        self.faults(loss, duplicate, seed)
        if ecn_threshold is None:  # an eighth of the receive buffer the kernel granted (a fixed
            # 256 KiB is four 64 KiB datagrams, so one window of each of 4 workers was marked nearly
            # every round and at 2,048 values a packet held the windows at their 16-packet minimum)
            ecn_threshold = max(256 << 10, self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 8)
        self.state = SwitchState(n_aggregators, fmt.payload_k, fmt.bitmap_bits)
        self.routes: Dict[int, Tuple[List[Addr], List[Addr]]] = {}
        self.unroutable = 0
        self.job_packets: Dict[int, int] = {}
        self.removed: Dict[int, int] = {}  # job -> aggregators freed by its teardown
        self.ecn_threshold, self.backlog, self.ecn_marked = ecn_threshold, 0, 0

    def handle_batch(self, got: List[Tuple[bytes, Addr]]) -> None:
        """Everything drained, through the switch function at once (:func:`process_batch`: the
        decisions packet by packet, the lane work of the whole batch in a few array operations),
        then forwarded. The receive buffer's occupancy (ECN) is read once a batch."""
        self.backlog = meminfo(self.sock)[0]
        fmt, copies, jp, admits = self.fmt, self.copies, self.job_packets, self.admits
        pkts: List[Any] = []
        raws: List[bytes] = []
        for buf, addr in got:
            for raw in fmt.split(buf):
                n = copies()
                if not n:
                    continue
                try:
                    pkt = fmt.decode(raw)
                except DecodeError:
                    self.state.stats.malformed += 1
                    continue
                if not admits(pkt.job, addr):
                    continue
                if pkt.job in jp:  # (installed jobs only: the switch function counts unknown ones)
                    jp[pkt.job] += n
                for c in range(n):
                    pkts.append(pkt.copy() if c + 1 < n else pkt)
                    raws.append(raw)
        forward = self.forward
        for p, raw, out in zip(pkts, raws, process_batch(self.state, pkts)):
            for q in out:
                # a parameter packet leaves as it came (② only frees an aggregator): its
                # received bytes are forwarded, not encoded again
                forward(q, raw if q is p and p.is_param else None)

    def forward(self, p: Any, raw: Optional[bytes] = None) -> None:
        """Route ``p`` (``raw``: its bytes, when the switch did not change it)."""
        route = self.routes.get(p.job)
        if route is None:
            self.unroutable += 1
            return
        if self.backlog > self.ecn_threshold and not p.ecn:
            p = ecn_mark(p, self.backlog, self.ecn_threshold)
            self.ecn_marked += 1
            raw = None
        data = self.fmt.encode(p) if raw is None else raw
        up, down = route
        put = self.outbox.put
        if p.is_param:
            for a in down:
                put(data, a)
        else:
            put(data, up[p.ps_index])

    # ------------------------------------------------------------------ control (§5.1)
    def op_add_job(self, up: List[List[Any]], down: List[List[Any]], job: Optional[int] = None) -> int:
        """Install a job: its routes and its table entry; ``job=None`` picks a free id."""
        if job is None:
            job = self.new_job_id(self.state.jobs | set(self.routes))
        elif job in self.routes:
            raise ValueError(f"job {job} is already installed on this switch")
        self.routes[job] = ([tuple(a) for a in up], [tuple(a) for a in down])  # type: ignore[misc]
        self.admit(job, [*up, *down])  # its workers (or rack switches) and its PS shards (or next switch)
        self.job_packets.setdefault(job, 0)
        self.state.add_job(job)
        return job

    def op_remove_job(self, job: int) -> int:
        """Job teardown: routes, table entry and every aggregator the job still holds."""
        self.routes.pop(job, None)
        self.members.pop(job, None)
        freed = self.state.remove_job(job)
        self.removed[job] = self.removed.get(job, 0) + freed
        return freed

    def op_aggregator(self, job: int, seq: int) -> Optional[int]:
        """The level bitmap held for ⟨job, seq⟩ (to name the workers a stalled job waits for), or None."""
        st = self.state
        if not st.n:
            return None
        i = agg_slot(agg_hash(job, seq), st.n)
        return st.bitmap[i] if st.key[i] == (job << 32 | seq) else None

    def op_stats(self, jobs: Optional[Set[int]] = None) -> Dict[str, Any]:
        """The switch's counters; ``allocated``, ``live``, ``installed`` and ``jobs`` only over
        ``jobs`` (None: every job), the others the switch's as a whole."""
        st = self.state
        seen = (lambda j: True) if jobs is None else jobs.__contains__
        held: Dict[int, int] = {}
        for k in st.key:
            if k >= 0:
                held[k >> 32] = held.get(k >> 32, 0) + 1
        ids = sorted(j for j in set(st.job_allocs) | set(self.routes) | set(self.job_packets) if seen(j))
        return {"allocated": allocated(st) if jobs is None else sum(v for j, v in held.items() if seen(j)),
                "live": sum(1 for _, j, _ in live_aggregators(st) if seen(j)), "aggregators": st.n,
                "switch": st.stats.as_dict(), "injected_loss": self.injected_loss,
                "injected_dup": self.injected_dup, "unroutable": self.unroutable,
                "send_errors": self.send_errors, "installed": sorted(j for j in self.routes if seen(j)),
                "ecn_marked": self.ecn_marked, "socket_drops": meminfo(self.sock)[1], "foreign": self.foreign,
                "state_bytes": budget.switch_bytes(st.n, st.k), "max_bytes": self.max_bytes,
                "jobs": {str(j): {"allocs": st.job_allocs.get(j, 0), "held": held.get(j, 0),
                                  "packets": self.job_packets.get(j, 0), "freed_at_teardown": self.removed.get(j, 0),
                                  "complete": st.job_complete.get(j, 0)}
                         for j in ids}}


#: how long the SwitchML switch role waits, from its first drained datagram, for the other workers of a
#: job before it decides a batch (:meth:`SMLSwitchNode.gather`). 0: it takes what is queued by then and
#: does not wait — waiting cuts the batches a sync but puts the decisions and sums after the last worker's
#: packets instead of overlapping the others' quantization, which makes a sync slower on a loaded host
GATHER_S = 0.0


class SMLSwitchNode(Role):
    """The switch role running SwitchML (``--protocol switchml``): :class:`SMLSwitch`, the
    simulator's switch function, over real UDP. Each job is a static partition of ``pool``
    slots × 2 versions installed at job setup and freed at teardown; results are multicast
    to the job's workers (one datagram each on loopback), a retransmission's result is
    unicast. No PS: the switch is the aggregation endpoint (SwitchML's design)."""

    role = "switch"

    def __init__(self, fmt: SMLFormat, loss: float = 0.0, seed: int = 0, **kw: Any) -> None:
        super().__init__(fmt, **kw)  # type: ignore[arg-type]
        self.faults(loss, 0.0, seed)
        self.sml = SMLSwitch()
        self.sml.threads = 1  # (2 where the host has cores to spare: :meth:`_spin_for_routes`)
        self.routes: Dict[int, List[Addr]] = {}  # job -> worker addresses, worker-id order
        self.job_packets: Dict[int, int] = {}
        self.removed: Dict[int, int] = {}  # job -> slots freed at teardown
        self.finished: Dict[int, Dict[str, int]] = {}
        self.shm: Dict[int, SharedLanes] = {}  # job -> its segments (shared-memory transport)

    def info(self) -> Dict[str, Any]:
        return {**super().info(), "protocol": "switchml", "transport": "shm" if self.fmt.shm else "udp"}

    def close(self) -> None:
        """Unlink the segments of jobs still installed."""
        for seg in self.shm.values():
            seg.close()
        self.shm.clear()

    def gather(self, got: List[Tuple[bytes, Addr]]) -> List[Tuple[bytes, Addr]]:
        """Wait (at most :data:`GATHER_S` from now, sleeping in ``select``) until every worker of each job
        the drained datagrams name has sent one, then the whole lot is one batch. A worker packs its packets
        of a round into datagrams of its own, so the first header of each datagram names its job and worker.
        Without this the role woke for about one worker's datagram at a time: ~6 batches a sync, each
        deciding one worker's packets (below the array form's
        :data:`~atp_pipeline.ina.switchml.switch.ARRAY_MIN`) and each paying the role's per-batch costs.
        Only when packets are decided changes: the switch function is the same over any batching
        (tests/ina/test_switchml_live_core.py), loss and retransmissions included — a round where some
        worker sends nothing (its packets lost, or a resend after a timeout) is decided at the deadline."""
        jobs = self.sml.jobs
        seen: Dict[int, int] = {}
        deadline = 0.0
        n = 0
        while True:
            for buf, _ in got[n:]:
                if len(buf) >= 6:
                    j = buf[0] << 8 | buf[1]
                    seen[j] = seen.get(j, 0) | 1 << buf[5]
            n = len(got)
            if all(bin(b).count("1") >= jobs[j].W for j, b in seen.items() if j in jobs):
                return got
            now = time.monotonic()
            if not deadline:
                deadline = now + GATHER_S
            elif now >= deadline:
                return got
            if not select.select([self.sock], [], [], deadline - now)[0]:
                return got
            got += drain(self.sock)

    def handle_batch(self, got: List[Tuple[bytes, Addr]]) -> None:
        """Everything drained, through the switch function :meth:`SMLSwitch.batch` at once (issue
        28). With the shared-memory transport every packet is a 10-byte header: the datagrams are
        read as one array of headers and the results written as one."""
        fmt = self.fmt
        bufs = [b for b, _ in got]
        self.malformed += bufs.count(b"")  # (an empty datagram holds no packet to count)
        # (the array form only where every datagram is whole headers: none straddles two datagrams)
        hdr = fmt.headers(bufs) if fmt.shm and not any(len(b) % fmt.header_bytes for b in bufs) else None
        pkts: Optional[List[SMLPacket]] = None
        if hdr is not None:
            hdr = self._admitted(hdr, got)
        else:  # lanes in the datagrams: packet by packet
            pkts = []
            admits = self.admits
            for buf, addr in got:
                for raw in fmt.split(buf):
                    try:
                        p = fmt.decode(raw)
                    except DecodeError:
                        self.malformed += 1
                        continue
                    if admits(p.job, addr):
                        pkts.append(p)
            hdr = fmt.header_array(pkts)
        if self.loss:  # injected ingress loss, packet by packet
            keep = [i for i in range(len(hdr)) if self.copies()]
            hdr = hdr[keep]
            pkts = [pkts[i] for i in keep] if pkts is not None else None
        if not len(hdr):
            return
        f = fmt.fields(hdr, arrays=True)  # (the switch function decides large batches on arrays)
        jp = self.job_packets
        job_a = f["job"]
        for j, n in zip(*(a.tolist() for a in np.unique(job_a, return_counts=True))):
            if j in jp:  # (installed jobs only: the switch function counts unknown ones)
                jp[j] += n
        payload = [p.payload for p in pkts] if pkts is not None else [None] * len(hdr)
        out = self.sml.batch(job_a, f["slot"], f["ver"], f["is_result"], f["worker"], f["exp"], f["empty"], payload)
        if not out:
            return
        put = self.outbox.put
        if pkts is None:  # headers only: the results as one array, one block per destination (no loop over them)
            ii, dd, ee, _ = zip(*out)
            ia, da = np.array(ii, dtype=np.intp), np.array(dd, dtype=np.int64)
            res = fmt.results(hdr, ia, ee)
            key = job_a[ia] << 9 | (da + 1)  # (job, destination: -1 for the group or a worker id < 255)
            if (key == key[0]).all():
                groups = [(int(key[0]), res)]
            else:
                uk, inv = np.unique(key, return_inverse=True)
                groups = [(int(k_), res[inv == g]) for g, k_ in enumerate(uk.tolist())]
            per = MAX_DATAGRAM // fmt.header_bytes
            for k_, block in groups:
                workers, d = self.routes[k_ >> 9], (k_ & 511) - 1
                for lo in range(0, len(block), per):
                    data = block[lo:lo + per].tobytes()
                    for a in ([workers[d]] if d >= 0 else workers):
                        put(data, a)
            return
        for j, d, e, row in out:
            q = pkts[j]
            q.is_result, q.exp = 1, e
            if row is not None:
                q.payload = row
            workers = self.routes[q.job]
            data = fmt.encode(q)
            for a in ([workers[d]] if d >= 0 else workers):
                put(data, a)

    def _admitted(self, hdr: np.ndarray, got: List[Tuple[bytes, Addr]]) -> np.ndarray:
        """The headers of ``got`` (one array, datagram order) whose sender is a member of their job
        (:meth:`Role.admits`): a datagram whose headers all name one job (a worker's) is decided at
        once from its bytes, any other header by header."""
        hb, keep, lo = self.fmt.header_bytes, None, 0
        for buf, addr in got:
            n = len(buf) // hb
            hi_b, lo_b = buf[0::hb], buf[1::hb]
            if hi_b.count(hi_b[:1]) == n and lo_b.count(lo_b[:1]) == n:
                if not self.admits(buf[0] << 8 | buf[1], addr):
                    self.foreign += n - 1  # (one counted by admits)
                    keep = np.ones(len(hdr), dtype=bool) if keep is None else keep
                    keep[lo:lo + n] = False
            else:
                keep = np.ones(len(hdr), dtype=bool) if keep is None else keep
                for i, j in enumerate(hdr["job"][lo:lo + n].tolist()):
                    keep[lo + i] = self.admits(j, addr)
            lo += n
        return hdr if keep is None else hdr[keep]

    def op_add_job(self, up: List[Any], down: List[List[Any]], job: Optional[int] = None, pool: int = 64,
                   shm: Optional[List[str]] = None) -> int:
        """Install a job: its static partition (``pool`` slots × 2 versions) and multicast group;
        ``shm`` (the shared-memory transport): the workers' lane segments, worker-id order — the
        partition's registers then live in a segment of this switch's (:meth:`op_shm`)."""
        if job is None:
            job = self.new_job_id(self.routes)
        elif job in self.routes:
            raise ValueError(f"job {job} is already installed on this switch")
        if not 1 <= pool <= 1 << 16 or not 1 <= len(down) <= 255:
            raise ValueError(f"SwitchML job: pool={pool} must be 1..65536 and workers {len(down)} 1..255")
        if (shm is not None) != self.fmt.shm or (shm is not None and len(shm) != len(down)):
            raise ValueError("this switch's transport is " + ("shm: one lane segment per worker needed"
                                                              if self.fmt.shm else "udp: no lane segments"))
        budget.check(f"a SwitchML job of {pool:,} slots × 2 versions × {self.fmt.payload_k:,} values",
                     budget.sml_job_bytes(pool, self.fmt.payload_k), self.max_bytes, self.state_bytes())
        values = lanes = None
        if shm is not None:
            seg = self.shm[job] = SharedLanes(shm, pool, self.fmt.payload_k)
            values, lanes = seg.registers, seg.lanes
        self.routes[job] = [tuple(a) for a in down]  # type: ignore[misc]
        self.admit(job, down)
        self.job_packets.setdefault(job, 0)
        self._spin_for_routes()
        self.sml.jobs[job] = SMLSwitchJob(job, len(down), pool, self.fmt.payload_k, -1, list(range(len(down))),
                                          values=values, lanes=lanes)
        return job

    def _spin_for_routes(self) -> None:
        """The data-plane loop's busy-poll budget for the jobs installed
        (:func:`~.frames.spin_budget` over this role and every worker of its jobs; none without a job),
        and the threads that sum the lanes (:func:`~.frames.sum_threads`: the lane sums in two
        halves at once where a core is free for it)."""
        workers = sum(len(r) for r in self.routes.values())
        self.spin_s = spin_budget(1 + workers) if workers else 0.0
        self.sml.threads = sum_threads(1 + workers) if workers else 1

    def op_shm(self, job: int) -> str:
        """The name of the shared-memory segment holding job ``job``'s registers (``(2, pool, K)``
        int32), where its workers read the results."""
        return self.shm[job].name

    def op_remove_job(self, job: int) -> int:
        """Teardown: the job's partition is freed. Returns 0: a static partition holds no
        per-sequence state that could have been left behind (ATP's count of live aggregators)."""
        self.routes.pop(job, None)
        self.members.pop(job, None)
        self._spin_for_routes()
        self.sml.drop(job)  # (lane work carried for slot-versions that never completed)
        js = self.sml.jobs.pop(job, None)
        seg = self.shm.pop(job, None)
        if seg is not None:
            if js is not None:
                js.values, js.lanes = js.values.copy(), None  # (its counters stay readable; the segments go)
            seg.close()
        if js is None:
            return 0
        self.finished[job] = dict(js.stats)
        self.removed[job] = self.removed.get(job, 0) + js.pool
        return 0  # static partitions hold no per-sequence state: nothing was left "allocated"

    def op_aggregator(self, job: int, seq: int) -> Optional[int]:
        return None

    def state_bytes(self) -> int:
        """Bytes the installed jobs' partitions take (:func:`~atp_pipeline.ina.budget.sml_job_bytes`)."""
        return sum(budget.sml_job_bytes(js.pool, js.k) for js in self.sml.jobs.values())

    def op_stats(self, jobs: Optional[Set[int]] = None) -> Dict[str, Any]:
        """The switch's counters; ``allocated``, ``installed`` and ``jobs`` only over ``jobs``
        (None: every job)."""
        seen = (lambda j: True) if jobs is None else jobs.__contains__
        ids = sorted(j for j in set(self.sml.jobs) | set(self.finished) if seen(j))
        return {"allocated": sum(2 * js.pool for j, js in self.sml.jobs.items() if seen(j)),
                "installed": sorted(j for j in self.routes if seen(j)),
                "injected_loss": self.injected_loss, "injected_dup": 0, "unknown": self.sml.unknown,
                "malformed": self.malformed, "send_errors": self.send_errors, "socket_drops": meminfo(self.sock)[1],
                "foreign": self.foreign, "state_bytes": self.state_bytes(), "max_bytes": self.max_bytes,
                "ecn_marked": 0, "jobs": {str(j): {**(dict(self.sml.jobs[j].stats) if j in self.sml.jobs else
                                                      self.finished[j]), "packets": self.job_packets.get(j, 0),
                                                   "allocs": 2 * self.sml.jobs[j].pool if j in self.sml.jobs else
                                                   self.removed.get(j, 0) * 2,
                                                   "held": 0, "slots_freed_at_teardown": self.removed.get(j, 0)}
                                          for j in ids}}


class PSNode(Role):
    """One parameter-server shard (§5.4) serving any number of jobs."""

    role = "ps"

    def __init__(self, fmt: PacketFormat, shard: int = 0, window_bytes: int = budget.LIVE_WINDOW_BYTES,
                 **kw: Any) -> None:
        """``window_bytes``: the workers' largest window; a job's sequences beyond it above the
        watermark are refused and its results kept that far below (:func:`~atp_pipeline.ina.budget.ps_horizon`),
        which bounds what a job holds here in bytes (:func:`~atp_pipeline.ina.budget.ps_job_bytes`)."""
        super().__init__(fmt, **kw)
        self.ps = ParameterServer(fmt, host=-2, shard=shard)
        self.window_bytes = window_bytes
        self.routes: Dict[int, Tuple[List[Addr], Addr]] = {}  # job -> (workers, switch)
        self.need: Dict[int, int] = {}  # job -> the bytes it may hold here
        self.finished: Dict[int, Dict[str, int]] = {}  # counters of jobs torn down

    def handle(self, buf: bytes, addr: Optional[Addr] = None) -> None:
        try:
            p = self.fmt.decode(buf)
        except DecodeError:
            self.ps.stats.malformed += 1
            return
        if not self.admits(p.job, addr):
            return
        if isinstance(buf, memoryview) and buf.nbytes < len(buf.obj):  # type: ignore[arg-type]
            p.payload = p.payload.copy()  # a stored view would pin the whole datagram's other packets
        for p in self.ps.on_packet(p):
            route = self.routes.get(p.job)
            if route is None:
                continue
            workers, down = route
            self.outbox.put(self.fmt.encode(p), workers[p.dst] if p.dst >= 0 else down)

    def op_add_job(self, job: int, workers: List[List[Any]], switch: List[Any], n_ps: int = 1, racks: int = 1) -> int:
        """Register a job: its workers' addresses (worker-id order) and ``switch``, where its
        parameter packets go (the switch's data address); ``racks > 1`` is two-level aggregation
        (§4.1) over racks of consecutive workers, whose bitmaps the PS turns back into worker sets."""
        if job in self.ps.jobs:
            raise ValueError(f"job {job} is already registered at this parameter server")
        w = len(workers)
        if racks < 1 or w % racks:
            raise ValueError(f"{w} workers do not split into {racks} racks")
        per = w // racks
        layout = JobLayout(job=job, groups=[list(range(r * per, (r + 1) * per)) for r in range(racks)],
                           two_level=racks > 1, n_ps=n_ps, worker_hosts=list(range(w)), mcast_addr=-1,
                           bitmap_bits=self.fmt.bitmap_bits)
        fmt = self.fmt
        need = budget.ps_job_bytes(w, fmt.payload_k, fmt.wire_bytes, self.window_bytes)
        budget.check(f"a job of {w} workers at {fmt.payload_k:,} values a packet", need, self.max_bytes,
                     sum(self.need.values()))
        horizon = budget.ps_horizon(self.window_bytes, fmt.wire_bytes)
        self.ps.add_job(layout, retain=horizon, horizon=horizon)
        self.need[job] = need
        self.routes[job] = ([tuple(a) for a in workers], tuple(switch))  # type: ignore[misc]
        self.admit(job, [*workers, switch])  # its switch (every packet on loopback) and its workers
        return job

    def op_remove_job(self, job: int) -> bool:
        self.routes.pop(job, None)
        self.members.pop(job, None)
        self.need.pop(job, None)
        if job in self.ps.jobs:  # its counters stay readable after teardown
            self.finished[job] = self.ps.job_stats(job)
        return self.ps.remove_job(job)

    def op_missing(self, job: int, seq: int) -> Dict[str, Any]:
        """Diagnosis of a stalled job: ``installed`` (false once a rank tore the job down) and
        ``missing``, :meth:`ParameterServer.missing` for ⟨job, seq⟩ (None if not installed)."""
        if job not in self.ps.jobs:
            return {"installed": False, "missing": None}
        return {"installed": True, "missing": self.ps.missing(job, seq)}

    def op_stats(self, jobs: Optional[Set[int]] = None) -> Dict[str, Any]:
        """The shard's counters; ``jobs`` only over ``jobs`` (None: every job, also those torn down)."""
        seen = (lambda j: True) if jobs is None else jobs.__contains__
        per = {**self.finished, **{j: self.ps.job_stats(j) for j in self.ps.jobs}}
        return {"ps": self.ps.stats.as_dict(), "send_errors": self.send_errors,
                "socket_drops": meminfo(self.sock)[1], "foreign": self.foreign,
                "state_bytes": sum(self.need.values()), "max_bytes": self.max_bytes,
                "jobs": {str(j): v for j, v in per.items() if seen(j)}}


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent exits (no orphaned roles)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line and exit 2 (not argparse's usage block)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"error: {message} (--help lists the options)\n")


def port(text: str) -> int:
    """A TCP/UDP port number (argparse type: its name is in the message of a bad one)."""
    port = int(text)  # not a number: argparse's one line
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0-65535)")
    return port


def byte_count(text: str) -> int:
    """A positive number of bytes (argparse type)."""
    n = int(text)  # not a number: argparse's one line
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not a positive number of bytes")
    return n


def main(argv: Optional[List[str]] = None) -> int:
    ap = _OneLineParser(prog="python -m atp_pipeline.ina.live.nodes",
                                 description="Run one live ATP role (switch emulator or parameter server).")
    ap.add_argument("role", choices=("switch", "ps"))
    ap.add_argument("--payload-k", type=int, default=62, help="int32 values per packet (62: hardware)")
    ap.add_argument("--bitmap-bits", type=int, default=32)
    ap.add_argument("--aggregators", type=int, default=4096, help="switch: aggregator slots")
    ap.add_argument("--loss", type=float, default=0.0, help="switch: injected ingress loss probability")
    ap.add_argument("--duplicate", type=float, default=0.0, help="switch: injected duplication probability")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard", type=int, default=0, help="ps: shard index (seq mod n_ps)")
    ap.add_argument("--host", default="127.0.0.1", help="address of the data and control sockets; any but a "
                                                          "loopback address needs --secret-file or " + auth.ENV)
    ap.add_argument("--secret-file", help="the control channel's secret (a file of mode 600); default "
                                          f"{auth.ENV}, else (loopback only) a new one written to a file of mode 600")
    ap.add_argument("--port", type=port, default=0, help="UDP data port (0: any free)")
    ap.add_argument("--control-port", type=port, default=0)
    ap.add_argument("--max-bytes", type=byte_count, default=budget.DEFAULT_MAX_BYTES,
                    help="the bound on the state this role stores, bytes (aggregators, SwitchML partitions, "
                         "a PS's open and answered sequences); what needs more is refused (default 1 GiB)")
    ap.add_argument("--die-with-parent", action="store_true")
    ap.add_argument("--protocol", choices=("atp", "switchml"), default="atp",
                    help="switch: ATP (the switch function of ina/switch.py) or SwitchML (ina/switchml/)")
    ap.add_argument("--transport", choices=("udp", "shm"), default="udp",
                    help="switch --protocol switchml: lanes in the datagrams (udp) or in shared memory (shm)")
    ap.add_argument("--impl", choices=("python", "bmv2"), default="python",
                    help="switch: the emulator (python) or BMv2 running the compiled P4 program (bmv2)")
    ap.add_argument("--p4", default="p4/v1model/atp.p4", help="switch --impl bmv2: the v1model program")
    ap.add_argument("--json", help="switch --impl bmv2: an already compiled BMv2 JSON (with --aggregators "
                                   "registers); default: compile --p4 (cached)")
    a = ap.parse_args(argv)
    try:
        secret = auth.role_secret(a.host, a.secret_file)
    except auth.SecretError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parent = os.getppid() if a.die_with_parent else None
    if a.die_with_parent:
        _die_with_parent()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(0))
    node: Optional[Role] = None
    key_file: Optional[Path] = None
    generated = secret is None
    secret = secret or auth.new_secret()
    try:
        try:
            fmt = PacketFormat(a.payload_k, a.bitmap_bits, views=a.impl == "python")  # BMv2 node: no payloads
            common = dict(host=a.host, port=a.port, control_port=a.control_port, parent_pid=parent, secret=secret,
                          max_bytes=a.max_bytes)
            if a.role == "ps":
                node = PSNode(fmt, shard=a.shard, **common)
            elif a.protocol == "switchml":
                if a.impl != "python" or a.duplicate:
                    raise ValueError("SwitchML runs on the emulator only and injects loss only")
                node = SMLSwitchNode(SMLFormat(a.payload_k, shm=a.transport == "shm"), a.loss, a.seed, **common)
            elif a.transport != "udp":
                raise ValueError("--transport shm is SwitchML's (--protocol switchml)")
            elif a.impl == "bmv2":
                node = _bmv2_node(a, fmt, common)
            else:
                node = SwitchNode(fmt, a.aggregators, a.loss, a.duplicate, a.seed, **common)
            line = node.start_line()
            if generated:  # (loopback only: auth.role_secret) where this user's clients find it
                key_file = auth.write_key_file(node.control.address, secret)
                line["secret_file"] = str(key_file)
        except (ValueError, OSError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(line), flush=True)
        node.serve()
    finally:
        if node is not None:
            node.close()
        if key_file is not None:
            auth.remove_key_file(key_file, secret)
    return 0


def _bmv2_node(a: argparse.Namespace, fmt: PacketFormat, common: Dict[str, Any]) -> Role:
    from atp_pipeline.ina.live.bmv2_node import BMv2SwitchNode
    from atp_pipeline.ina.p4.toolchain import cached_v1model_json, n_agg_defines

    json_path = Path(a.json) if a.json else cached_v1model_json(Path(a.p4), n_agg_defines(a.aggregators))
    return BMv2SwitchNode(fmt, a.aggregators, json_path, a.loss, a.duplicate, a.seed, **common)


if __name__ == "__main__":
    sys.exit(main())
