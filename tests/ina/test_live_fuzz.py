"""Must-show (issue 62): a data plane that survives its input — against the RUNNING roles.

The ATP switch emulator, a parameter-server shard and two SwitchML switches (lanes over UDP, and in
shared memory) run as processes, started as a training run starts them (:meth:`Services.start`). Three
honest jobs — ATP through the switch and the PS, SwitchML over each transport — all-reduce known
integer vectors the whole time through the real worker stack
(:class:`~atp_pipeline.ina.live.engine.Engine`, :class:`~atp_pipeline.ina.live.engine.SMLEngine`),
while hypothesis sprays the roles' UDP data ports with random bytes, huge datagrams, truncated,
oversized, bit-flipped and replayed genuine packets (captured from the honest workers' sends, or made
by the protocol's own workers for a second job whose members are the sprayer's sockets), packets
rewritten to a foreign job id, another sequence or slot, or into parameter packets — from a stranger's
socket and from a member of the second job — and their control ports with failed handshakes, garbage
and oversized frames and authenticated requests of arbitrary shape.

Asserted: no role dies and each still serves (a last all-reduce per job, ``info`` per role); every
aggregate of the honest jobs equals the integer sum, bit for bit; every datagram that must be dropped
is counted in a role counter (malformed, unknown job, foreign sender, out of window, or the kernel's
drops the role reports), and every refused control message in the control counters; the roles' peak
resident memory (``VmHWM``) stays below :data:`RSS_BOUND`. ``pytest -s`` prints the figures.
Also here: the memory bound's refusals (a role's ``--max-bytes``, a job over a shard's bound, resolve's
``aggregation.role_max_bytes``) and the parameter server's byte-bounded retransmission store.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from atp_pipeline.config.schema import AggregationConfig, AggregationMode, Transport
from atp_pipeline.errors import ConfigError
from atp_pipeline.ina import budget
from atp_pipeline.ina.job import JobLayout
from atp_pipeline.ina.live import auth, rpc, wire
from atp_pipeline.ina.live.engine import Engine, EngineConfig, SMLEngine
from atp_pipeline.ina.live.role import udp_socket
from atp_pipeline.ina.live.rpc import AggregationError
from atp_pipeline.ina.live.services import Services, add_job, remove_job
from atp_pipeline.ina.live.shm import attach, create_lanes, lanes_of, release
from atp_pipeline.ina.packet import DecodeError, PacketFormat
from atp_pipeline.ina.ps import ParameterServer
from atp_pipeline.ina.switchml import SMLFloatWorker, SMLFormat
from atp_pipeline.ina.worker import Worker, WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
K = 256  # values a packet (ATP and SwitchML)
N = 16 * K  # values an honest all-reduce sums (16 packets)
POOL = 16  # SwitchML slots of a job
MAX_BYTES = 64 << 20  # every role's --max-bytes (aggregation.role_max_bytes): two jobs of 2 workers fit a PS
RSS_BOUND = 128 << 20  # a role's peak resident memory, interpreter and numpy included
GROWTH_BOUND = 16 << 20  # ... and how much it may rise while the roles are sprayed (after the honest jobs' first round)
ATP_FMT, SML_FMT, SHM_FMT = PacketFormat(K), SMLFormat(K), SMLFormat(K, shm=True)
ROLES = ("switch", "ps", "sml", "shm")  # ATP switch and PS; SwitchML switch over UDP and over shared memory
FMTS: Dict[str, Any] = {"switch": ATP_FMT, "ps": ATP_FMT, "sml": SML_FMT, "shm": SHM_FMT}
HONEST = {"switch": 0, "ps": 0, "sml": 1, "shm": 2}  # the honest job each role serves (Roles.honest)
MAX_DATAGRAM = 65507
EXAMPLES = 25  # hypothesis examples, each a few hundred datagrams and a few control messages


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (exists and is no zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _vm(pid: int, key: str) -> int:
    """``VmHWM``/``VmRSS`` of process ``pid``, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} for pid {pid}")


class Honest:
    """Two workers of one job in this process, all-reducing known integer vectors (exact sums expected)
    on a thread of their own until stopped; their first datagrams are kept (``captured``) for replays."""

    def __init__(self, svc: Services, sml: bool, seed: int, shm: bool = False) -> None:
        """As :meth:`ATPSync.setup` sets a job up (``shm``: SwitchML's shared-memory transport)."""
        socks = [udp_socket() for _ in range(2)]
        self.svc = svc
        lanes = [create_lanes(POOL, K)[0] for _ in range(2)] if shm else None
        self.job = add_job(svc, [s.getsockname() for s in socks], pool=POOL if sml else 0,
                           shm=[seg.name for seg in lanes] if lanes else None)
        regs = svc.peer(svc.switch).call("shm", job=self.job) if lanes else None
        fmt, kind = (SMLFormat(K, shm=shm), SMLEngine) if sml else (PacketFormat(K, views=True), Engine)
        cfgs = [EngineConfig(stall_timeout_s=10.0, pool=POOL, shm=(lanes[w], attach(regs)) if lanes else None,
                             worker=WorkerConfig(rto=0.2, max_window_bytes=budget.LIVE_WINDOW_BYTES,
                                                 mtu=max(1500, fmt.wire_bytes))) for w in range(2)]
        self.engines = [kind(fmt, self.job, w, 2, socks[w], svc.switch.data, svc.peer(svc.switch),
                             [svc.peer(e) for e in svc.ps], n_ps=len(svc.ps), cfg=cfgs[w]) for w in range(2)]
        self.captured: List[bytes] = []
        for e in self.engines:
            e._put = self._capturing(e._put)  # type: ignore[method-assign]
        self.rng = np.random.default_rng(seed)
        self.rounds = self.corrupted = 0
        self.error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _capturing(self, put: Any) -> Any:
        def send(data: bytes) -> None:
            if len(self.captured) < 64:
                self.captured.append(bytes(data))
            put(data)
        return send

    def all_reduce(self) -> None:
        xs = [self.rng.integers(-1000, 1001, N).astype(np.float64) for _ in range(2)]
        ts = [torch.from_numpy(x.copy()) for x in xs]
        fut = self.engines[0].all_reduce_async(ts[0])
        self.engines[1].all_reduce(ts[1])
        fut.wait()
        want = xs[0] + xs[1]
        self.rounds += 1
        self.corrupted += sum(not np.array_equal(t.numpy(), want) for t in ts)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.all_reduce()
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.error = e
                return
            time.sleep(0.005)  # (the sprayer and the roles share the two cores)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def close(self) -> None:
        for e in self.engines:
            e.close()
        remove_job(self.svc, self.job)


@dataclass
class Tally:
    """What the sprayer sent, per role: datagrams, those that must be dropped, stranger replays of
    intact honest packets (dropped as ``foreign``), control messages and those that must be refused."""

    datagrams: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    bad: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    spoofed: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    control: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    rejected: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    malformed: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))


class Roles:
    """The running roles, the sprayer's sockets and the genuine packets it mutates."""

    def __init__(self) -> None:
        common = dict(payload_k=K, role_max_bytes=MAX_BYTES)
        self.atp = Services.start(AggregationConfig(mode=AggregationMode.atp, n_ps=1, aggregators=64, **common))
        self.sml = self.shm = None
        try:
            self.sml = Services.start(AggregationConfig(mode=AggregationMode.switchml, pool=POOL, **common))
            self.shm = Services.start(AggregationConfig(mode=AggregationMode.switchml, pool=POOL,
                                                        transport=Transport.shm, **common))
        except BaseException:
            for svc in (self.atp, self.sml):
                if svc is not None:
                    svc.stop()
            raise
        self.eps = {"switch": self.atp.switch, "ps": self.atp.ps[0], "sml": self.sml.switch, "shm": self.shm.switch}
        self.stranger = udp_socket()
        self.members = [udp_socket() for _ in range(2)]
        for s in (self.stranger, *self.members):
            s.setblocking(False)
        addrs = [s.getsockname() for s in self.members]
        self.fuzz_atp = add_job(self.atp, addrs)  # the second job: its members are the sprayer's sockets
        self.fuzz_sml = add_job(self.sml, addrs, pool=POOL)
        self.lanes = [create_lanes(POOL, K) for _ in range(2)]  # the second job's lane segments (shm)
        self.fuzz_shm = add_job(self.shm, addrs, pool=POOL, shm=[seg.name for seg, _ in self.lanes])
        self.regs = attach(self.shm.peer(self.shm.switch).call("shm", job=self.fuzz_shm))
        self.own = {"switch": {self.fuzz_atp}, "ps": {self.fuzz_atp}, "sml": {self.fuzz_sml}, "shm": {self.fuzz_shm}}
        layout = JobLayout(job=self.fuzz_atp, groups=[[0, 1]])
        self.genuine_atp = [ATP_FMT.encode(p) for w in range(2) for p in Worker(ATP_FMT, layout, w, w).start(
            np.arange(8 * K, dtype=np.int32) * (w + 1), 0, 0.0)]
        self.genuine_sml = [SML_FMT.encode(p) for w in range(2) for p in SMLFloatWorker(
            self.fuzz_sml, w, 2, POOL, K, rto=1.0).start_float(np.arange(8.0 * K) - w, 0.0)]
        hb = SHM_FMT.header_bytes
        hdrs = [SMLFloatWorker(self.fuzz_shm, w, 2, POOL, K, rto=1.0, lanes=self.lanes[w][1],
                               results=lanes_of(self.regs, POOL, K)).start_float(
            np.arange(8.0 * K) - w, 0.0, headers=True).tobytes() for w in range(2)]
        self.genuine_shm = [h[i:i + hb] for h in hdrs for i in range(0, len(h), hb)]
        self.genuine = {"switch": self.genuine_atp, "ps": self.genuine_atp, "sml": self.genuine_sml,
                        "shm": self.genuine_shm}
        self.honest: List[Honest] = []

    def dead(self) -> Dict[str, str]:
        """Roles whose process has exited: the last lines of what it wrote to stderr."""
        out = {}
        for svc in (self.atp, self.sml, self.shm):
            for p in svc._procs:
                if p.poll() is not None:
                    name = next((n for n, ep in self.eps.items() if ep.pid == p.pid), str(p.pid))
                    out[name] = f"exit {p.returncode}: " + "".join((p.stderr.read() or "").splitlines(True)[-12:])
        return out

    def pids(self) -> Dict[str, int]:
        return {name: ep.pid for name, ep in self.eps.items()}

    def stats(self, name: str) -> Dict[str, Any]:
        ep = self.eps[name]
        return ep.peer(ep.owner).call("stats")

    def drops(self, name: str) -> int:
        """The role's counters of dropped datagrams (kernel drops on a full buffer included)."""
        s = self.stats(name)
        own = {"switch": lambda: s["switch"]["malformed"] + s["switch"]["unknown_job"],
               "ps": lambda: s["ps"]["malformed"] + s["ps"]["unknown_job"] + s["ps"]["out_of_window"],
               "sml": lambda: s["malformed"] + s["unknown"], "shm": lambda: s["malformed"] + s["unknown"]}[name]()
        return own + s["foreign"] + s["socket_drops"]

    def control_counters(self, name: str) -> Dict[str, int]:
        return self.stats(name)["control"]

    def drain_members(self) -> None:
        for s in self.members:
            while True:
                try:
                    s.recv(65536)
                except OSError:
                    break

    def stop(self) -> None:
        for h in self.honest:
            h.close()
        for s in (self.stranger, *self.members):
            s.close()
        release(self.regs, unlink=False)
        for seg, _ in self.lanes:
            release(seg, unlink=True)
        for svc in (self.atp, self.sml, self.shm):
            svc.stop()


@pytest.fixture(scope="module")
def roles() -> Iterator[Roles]:
    r = Roles()
    try:
        yield r
    finally:
        r.stop()


# ------------------------------------------------------------------------------------------ data plane
KINDS = ("random", "huge", "truncated", "oversized", "bitflip", "replay", "datagram", "job", "seq", "param", "forge")
shots = st.tuples(st.sampled_from(ROLES), st.sampled_from(("member", "stranger")),
                  st.sampled_from(KINDS), st.integers(0, 2**32 - 1), st.integers(8, 64), st.binary(max_size=48))


def _flip(buf: bytes, r: random.Random) -> bytes:
    b = bytearray(buf)
    for _ in range(r.randint(1, 8)):
        i = r.randrange(len(b) * 8)
        b[i // 8] ^= 1 << (i % 8)
    return bytes(b)


def _rewrite(target: str, buf: bytes, r: random.Random, roles: Roles, kind: str) -> bytes:
    """A genuine packet with its job (an honest job's, or one installed nowhere), its sequence / slot,
    or its direction (a parameter packet / a result) changed; or (``forge``) an honest job's packet for
    a sequence (slot) it is about to aggregate, with other values: still well formed."""
    fmt, sml = FMTS[target], target in ("sml", "shm")
    p = fmt.decode(buf)
    if kind == "forge":
        h = roles.honest[HONEST[target]]
        p.job, w = h.job, r.randrange(2)
        if sml:
            p.slot, p.ver, p.worker = r.randrange(POOL), r.randrange(2), w
        else:
            p.seq, p.worker_id, p.bitmap0 = h.engines[0].seq + r.randrange(32), w, 1 << w
        if p.payload is not None and p.payload.size:
            p.payload = np.array([r.randrange(-1000, 1000) for _ in range(K)], dtype=np.int32)
    elif kind == "job":
        honest = [h.job for h in roles.honest if sml == isinstance(h.engines[0], SMLEngine)]
        p.job = r.choice([*honest, r.randrange(1 << 16)])
    elif kind == "seq" and sml:
        p.slot = r.randrange(1 << 16)
    elif kind == "seq":
        p.seq = r.randrange(1 << 32)
    elif sml:
        p.is_result = 1
    else:
        p.is_param = 1
    if sml and p.payload is None:  # (lanes in shared memory: the header alone, as the workers send it)
        return fmt.header_array([p]).tobytes()
    return fmt.encode(p)


def _datagram(target: str, kind: str, r: random.Random, extra: bytes, roles: Roles) -> bytes:
    fmt = FMTS[target]
    honest = roles.honest[HONEST[target]].captured
    pool = roles.genuine[target]
    if kind == "datagram":
        return r.choice(honest)  # a whole captured datagram (several packets), as sent
    singles = [bytes(b) for d in honest[:4] for b in fmt.split(d)]
    base = r.choice(singles + pool)
    if kind == "random":
        return extra + r.randbytes(r.randrange(2 * fmt.atp_bytes))
    if kind == "huge":
        return extra + r.randbytes(r.randrange(fmt.atp_bytes, MAX_DATAGRAM - len(extra)))
    if kind == "truncated":
        return base[:r.randrange(len(base))]
    if kind == "oversized":
        return base + extra + r.randbytes(r.randrange(1, fmt.atp_bytes // 2))
    if kind == "bitflip":
        return _flip(base, r)
    if kind == "replay":
        return base
    return _rewrite(target, base, r, roles, kind)


def _must_drop(target: str, sender: str, buf: bytes, roles: Roles) -> bool:
    """Whether the role must drop (and count) this datagram: anything from a stranger; from a member of
    the second job, a datagram whose packets all fail to decode or name another job, or (at the PS) a
    parameter packet."""
    if sender == "stranger":
        return True
    fmt = FMTS[target]
    try:
        pkts = [fmt.decode(bytes(b)) for b in fmt.split(buf)]
    except DecodeError:
        return len(fmt.split(buf)) == 1
    return all(p.job not in roles.own[target] or (target == "ps" and p.is_param) for p in pkts)


def _spray(roles: Roles, shot: Tuple[Any, ...], tally: Tally) -> None:
    target, sender, kind, seed, repeat, extra = shot
    r = random.Random(seed)
    addr = tuple(roles.eps[target].data)
    sock = roles.stranger if sender == "stranger" else roles.members[seed % 2]
    for _ in range(1 if kind == "huge" else repeat):
        buf = _datagram(target, kind, r, extra, roles)
        try:
            sock.sendto(buf, addr)
        except BlockingIOError:  # (our send buffer is full: let the role catch up)
            time.sleep(0.01)
            continue
        tally.datagrams[target] += 1
        tally.bad[target] += _must_drop(target, sender, buf, roles)
        tally.spoofed[target] += sender == "stranger" and kind in ("replay", "datagram")
        if len(buf) > 8192:
            time.sleep(0.002)  # (large datagrams: keep within the role's receive buffer)


# ------------------------------------------------------------------------------------------ control
json_leaf = (st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=12)
             | st.floats(allow_nan=False, allow_infinity=False))
addr_v = st.tuples(st.just("127.0.0.1"), st.integers(0, 65535)).map(list)
json_value = st.recursive(json_leaf | addr_v | st.lists(addr_v, max_size=3),
                          lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                          max_leaves=8)
request = st.fixed_dictionaries(
    {"op": st.sampled_from(sorted(rpc.OPS)) | st.text(max_size=10),
     "args": st.dictionaries(st.sampled_from(sorted(rpc.ARGS)) | st.text(max_size=6), json_value, max_size=5)},
    optional={"token": st.none() | st.text("0123456789abcdef", min_size=30, max_size=40) | json_leaf,
              "extra": json_value})
controls = st.tuples(st.sampled_from(ROLES),
                     st.sampled_from(("noauth", "badauth", "length", "garbage", "request")),
                     st.binary(max_size=300), request, st.integers(0, 2**32 - 1))


def _authenticated(roles: Roles, target: str) -> socket.socket:
    ep = roles.eps[target]
    sock = socket.create_connection(tuple(ep.control), timeout=10)
    auth.join_handshake(sock, ep.secret)
    return sock


def _answer(sock: socket.socket) -> Optional[Dict[str, Any]]:
    """The role's reply frame, or None when it closed the connection without one."""
    try:
        return wire.recv(sock)
    except (EOFError, OSError, wire.FrameError):
        return None


def _send(sock: socket.socket, data: bytes) -> None:
    """``sendall``, where the role may close the connection before it has read everything."""
    try:
        sock.sendall(data)
    except OSError:
        pass


def _control(roles: Roles, c: Tuple[Any, ...], tally: Tally) -> None:
    target, kind, raw, req, n = c
    tally.control[target] += 1
    ep = roles.eps[target]
    if kind in ("noauth", "badauth"):  # refused at the handshake
        with socket.create_connection(tuple(ep.control), timeout=10) as sock:
            try:  # (the role may have closed the connection already: what it read was enough to refuse)
                if kind == "noauth":
                    sock.sendall(raw)
                else:
                    challenge = wire.recv(sock)
                    assert set(challenge) == {"challenge"}
                    sock.sendall(wire.encode({"response": raw.hex()[:64] or "00", "challenge": "ab" * 16}))
                sock.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass
            assert _answer(sock) is None if kind == "badauth" else True
        tally.rejected[target] += 1
        return
    with _authenticated(roles, target) as sock:
        if kind == "length":  # 0 or beyond the frame limit: refused before anything is allocated
            _send(sock, struct.pack("!I", 0 if n % 3 == 0 else wire.MAX_FRAME + 1 + n % (1 << 31)) + raw[:16])
            assert _answer(sock) is None
            tally.malformed[target] += 1
        elif kind == "garbage":  # a frame whose body is no JSON object
            body = raw if not raw.lstrip().startswith(b"{") else b"]" + raw
            _send(sock, struct.pack("!I", len(body) or 1) + (body or b"x"))
            assert _answer(sock) is None
            tally.malformed[target] += 1
        else:  # an arbitrary request: refused (counted) where it breaks the schema, else answered
            try:
                rpc.check_request(req)
                refused = False
            except rpc.RequestError:
                refused = True
            sock.sendall(wire.encode(req))
            reply = _answer(sock)
            assert reply is not None and set(reply) <= {"ok", "value", "error"}, reply
            assert reply["ok"] is not True or not refused
            assert req.get("op") != "shutdown" or reply["ok"] is False  # only the owner may
            tally.malformed[target] += refused


# ------------------------------------------------------------------------------------------ the test
def _settle(roles: Roles, want: Dict[str, int], before: Dict[str, int], timeout: float = 15.0) -> Dict[str, int]:
    """Per role, drops counted since ``before`` once they reach ``want`` (or at ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        got = {n: roles.drops(n) - before[n] for n in want}
        if all(got[n] >= want[n] for n in want) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_running_roles_survive_arbitrary_datagrams_and_control_messages(roles: Roles) -> None:
    t0 = time.monotonic()
    roles.honest = [Honest(roles.atp, False, 1), Honest(roles.sml, True, 2), Honest(roles.shm, True, 3, shm=True)]
    for h in roles.honest:
        h.all_reduce()  # (the first round finds the scale: a few rescaling rounds)
    pids = roles.pids()
    warm = {n: _vm(pid, "VmHWM") for n, pid in pids.items()}
    before = {n: roles.drops(n) for n in pids}
    ctl_before = {n: roles.control_counters(n) for n in pids}
    tally = Tally()
    for h in roles.honest:
        h.start()

    # (no shrinking: the roles' state carries over from one example to the next, so a failure is reported
    # as found, with the roles' last words where one exited)
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              phases=(Phase.explicit, Phase.reuse, Phase.generate), report_multiple_bugs=False)
    @given(st.lists(shots, min_size=8, max_size=40), st.lists(controls, min_size=4, max_size=12))
    def spray(batch: List[Tuple[Any, ...]], ctl: List[Tuple[Any, ...]]) -> None:
        try:
            for shot in batch:
                _spray(roles, shot, tally)
            for c in ctl:
                _control(roles, c, tally)
            roles.drain_members()
            for name, pid in pids.items():  # alive and serving its control channel
                assert roles.eps[name].peer(None).call("info")["pid"] == pid
        except (OSError, EOFError, AggregationError, AssertionError) as e:
            dead = roles.dead()  # (a role that died: its last words)
            raise AssertionError(f"{e}; roles that exited: {dead}") if dead else e
        assert all(h.error is None for h in roles.honest), [h.error for h in roles.honest]

    try:
        spray()
    finally:
        for h in roles.honest:
            h.stop()
    errors = [h.error for h in roles.honest if h.error is not None]
    assert not errors, errors
    for h in roles.honest:  # still serving: one more exact all-reduce each
        h.all_reduce()
    dropped = _settle(roles, tally.bad, before)
    time.sleep(0.5)  # (the last refused handshakes and frames are counted by their connections' threads)
    ctl = {n: roles.control_counters(n) for n in pids}
    crashes = sum(not _alive(pid) for pid in pids.values())
    assert crashes == 0, (roles.atp.dead_role(), roles.sml.dead_role())
    peak = {n: _vm(pid, "VmHWM") for n, pid in pids.items()}
    stats = {n: roles.stats(n) for n in pids}
    elapsed = time.monotonic() - t0
    print(f"\nlive fuzz: {sum(tally.datagrams.values())} datagrams {tally.datagrams}, of which must-drop "
          f"{tally.bad}, counted dropped {dropped}; {sum(tally.control.values())} control messages "
          f"{tally.control}; honest all-reduces {[h.rounds for h in roles.honest]}, corrupted "
          f"{[h.corrupted for h in roles.honest]}; role crashes {crashes}; peak RSS (VmHWM) MiB "
          f"{ {n: round(v / 2**20, 1) for n, v in peak.items()} } (before spraying "
          f"{ {n: round(v / 2**20, 1) for n, v in warm.items()} }); foreign "
          f"{ {n: s['foreign'] for n, s in stats.items()} }; kernel drops "
          f"{ {n: s['socket_drops'] for n, s in stats.items()} }; {elapsed:.1f} s")
    assert [h.corrupted for h in roles.honest] == [0, 0, 0]
    assert all(h.rounds >= 3 for h in roles.honest), [h.rounds for h in roles.honest]
    for n in pids:
        assert dropped[n] >= tally.bad[n], (n, dropped[n], tally.bad[n])
        assert stats[n]["foreign"] >= tally.spoofed[n] - stats[n]["socket_drops"], (n, stats[n], tally.spoofed)
        assert ctl[n]["rejected"] - ctl_before[n]["rejected"] >= tally.rejected[n], (n, ctl[n], tally.rejected)
        assert ctl[n]["malformed"] - ctl_before[n]["malformed"] >= tally.malformed[n], (n, ctl[n], tally.malformed)
        assert peak[n] < RSS_BOUND and peak[n] - warm[n] < GROWTH_BOUND, (n, warm[n], peak[n])
        assert stats[n]["state_bytes"] <= stats[n]["max_bytes"] == MAX_BYTES
    assert sum(tally.datagrams.values()) >= 200 and sum(tally.control.values()) >= 20


# ------------------------------------------------------------------------------------------ the bound
def test_a_job_over_a_shards_bound_is_refused_naming_both_figures(roles: Roles) -> None:
    """Two jobs of two workers fit the PS's 64 MiB; one of 32 workers does not: refused at setup, in
    one line naming what it needs and the bound, and nothing of it is left installed."""
    need = budget.ps_job_bytes(32, K, ATP_FMT.wire_bytes)
    installed = {n: roles.stats(n)["installed" if n == "switch" else "jobs"] for n in ("switch", "ps")}
    with pytest.raises(AggregationError) as e:
        add_job(roles.atp, [("127.0.0.1", 1 + i) for i in range(32)])
    msg = str(e.value)
    assert f"{need:,} bytes" in msg and f"--max-bytes={MAX_BYTES:,}" in msg and "\n" not in msg, msg
    assert installed == {n: roles.stats(n)["installed" if n == "switch" else "jobs"] for n in ("switch", "ps")}


def test_a_role_over_its_bound_exits_with_one_line() -> None:
    """``--max-bytes`` below what the switch's aggregators need: exit 2, one line naming both."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), auth.ENV: auth.new_secret()}
    p = subprocess.run([sys.executable, "-m", "atp_pipeline.ina.live.nodes", "switch", "--aggregators", "4096",
                        "--payload-k", "16000", "--max-bytes", "1000000"], env=env, capture_output=True, text=True,
                       timeout=60)
    need = budget.switch_bytes(4096, 16000)
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error: "), p.stderr
    assert f"{need:,} bytes" in p.stderr and "--max-bytes=1,000,000" in p.stderr, p.stderr


def test_resolve_refuses_a_run_whose_roles_exceed_the_bound() -> None:
    """Before any process starts: ``aggregation.role_max_bytes`` against each role's need."""
    from atp_pipeline.run.resolve import check_aggregation

    small = 4 << 20
    cases = [(AggregationConfig(mode=AggregationMode.atp, aggregators=4096, payload_k=16000, role_max_bytes=small),
              budget.switch_bytes(4096, 16000)),
             (AggregationConfig(mode=AggregationMode.ps, payload_k=2048, role_max_bytes=small),
              2 * budget.ps_job_bytes(4, 2048, PacketFormat(2048).wire_bytes)),
             (AggregationConfig(mode=AggregationMode.switchml, pool=512, payload_k=2048, role_max_bytes=small),
              2 * budget.sml_job_bytes(512, 2048))]
    for cfg, need in cases:
        with pytest.raises(ConfigError) as e:
            check_aggregation(cfg, 4, jobs=2)
        msg = str(e.value)
        assert f"{need:,} bytes" in msg and f"aggregation.role_max_bytes={small:,}" in msg, msg
    check_aggregation(AggregationConfig(mode=AggregationMode.atp), 4, jobs=2)  # the defaults fit


def test_parameter_server_store_is_bounded_in_bytes_and_exact() -> None:
    """With a horizon and answer window of one worker window, a shard holds at most
    ``ps_job_bytes`` worth of packets whatever arrives: sequences beyond the horizon are refused
    (``out_of_window``), old results forgotten; an honest job in order stays exact throughout."""
    fmt = PacketFormat(K)
    window = 40 * fmt.wire_bytes
    h = budget.ps_horizon(window, fmt.wire_bytes)
    layout = JobLayout(job=3, groups=[[0, 1]])
    ps = ParameterServer(fmt, host=0)
    ps.add_job(layout, retain=h, horizon=h)
    workers = [Worker(fmt, layout, w, w, WorkerConfig(max_window_bytes=window)) for w in range(2)]
    rng = np.random.default_rng(0)
    stored_max = 0
    r = random.Random(1)
    for rnd in range(6):
        xs = [rng.integers(-1000, 1000, (300, K), dtype=np.int32) for _ in range(2)]
        base = rnd * 300
        flight = [p for w in range(2) for p in workers[w].start(xs[w], base, 0.0)]
        while flight:
            p = flight.pop(r.randrange(len(flight)))
            junk = p.copy()
            junk.seq = ps.jobs[3].watermark + h + r.randrange(1 << 20)
            assert ps.on_packet(junk) == []  # a member's packet beyond any honest window: refused
            for q in ps.on_packet(p):
                for w in range(2):
                    flight += workers[w].on_packet(q, 0.0)
            js = ps.jobs[3]
            stored_max = max(stored_max, len(js.done) + sum(len(s.pieces) for s in js.open.values()))
        for w in range(2):
            assert np.array_equal(np.array(workers[w].rows).reshape(300, K), xs[0].astype(np.int64) + xs[1])
    assert ps.stats.out_of_window > 0
    assert stored_max * (4 * K + budget.ENTRY_OVERHEAD) <= budget.ps_job_bytes(2, K, fmt.wire_bytes, window)
