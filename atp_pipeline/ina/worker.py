"""ATP worker stack (§5.4): tensors → gradient packets, sliding window, reliability, AIMD.

Event-driven and transport-free: :meth:`Worker.start` begins one tensor (one round of
push/pull), :meth:`Worker.on_packet` consumes a parameter packet, :meth:`Worker.poll`
fires timers, :meth:`Worker.next_deadline` tells the driver when to call it. Each returns
the gradient packets to transmit. The simulator and a live UDP transport drive the same
object.

* Window (§5.4 "Worker pushing gradients"): ``una`` is the lowest unacknowledged
  sequence, ``nxt`` (the paper's INF) the next never-sent one; the worker sends while
  ``nxt − una < ⌈wnd / packet_bytes⌉``. The window ``wnd`` is counted in bytes.
* ACKs (§5.4 "Worker pulling parameters"): a parameter packet acknowledges its sequence
  and carries its result; an ACK equal to ``una`` advances ``una`` to the next
  unacknowledged sequence; other ACKs are recorded but leave ``una`` alone.
* Fast retransmission (§5.4 "Worker retransmitting lost packets"): every three
  consecutive parameter packets whose sequence is not ``una`` trigger a retransmission.
  ``recovery="paper"`` resends ``una`` only, exactly as §5.4 says. The default
  ``recovery="rack"`` resends every hole below the highest ACK that is lost by RACK's
  rules (RFC 8985): a packet sent more than a reordering window (``min RTT / 4``) after
  the hole's last transmission has been acknowledged, or the hole is older than that
  packet's RTT plus the window (a reordering timer re-checks). A parameter packet names
  its sequence exactly — it is a selective ACK — so the worker knows every hole; with
  ``una`` alone a second loss in one window (the common case with hundreds of packets in
  flight) waits for the timeout while every worker of the job stalls on it, and a lost
  retransmission is never detected early. The send-time rule never repeats a fresh
  retransmission before it could have been answered. RTT samples follow Karn's rule
  (first transmissions only). One trigger resends at most ``fast_retransmit_burst``.
* Timeout (``rto``, configurable): a packet unacknowledged ``rto`` after its last
  transmission times out; expired packets are resent oldest first, at most
  ``timeout_burst`` per expiry, and the timeout backs off exponentially (×2, ≤ 64×) until
  the next new ACK (RFC 6298 §5.5). Most expired packets of a stalled job are not lost but
  parked in aggregators waiting for one slow worker: resending whole windows of them
  every ``rto`` flooded the PS link until the job collapsed (measured before adding the
  cap and the backoff). Retransmissions carry the ``resend`` flag (§5.3).
* Congestion control (§5.4 "Rate control"): ``wnd`` starts at 50 packets; +1 MTU per ACK
  while below ``ssthresh`` (slow start; initial ``ssthresh`` ≈ RTT·bytes), then +1 MTU
  per window; an ECN-marked parameter packet or a loss (fast retransmission or timeout)
  halves ``wnd`` (not below ``min_window_pkts``) and sets ``ssthresh`` to it — at most
  once per smoothed ACK delay ``srtt``, i.e. once per window (the DCTCP-style guard:
  one congestion event marks a whole window of packets). The window is capped at
  ``max_window_bytes``. With ``cc=False`` it stays at ``fixed_window_pkts`` (the released
  code ships congestion control compiled out).
* Quantization: :meth:`Worker.start_float` converts with :mod:`atp_pipeline.ina.quant`
  and sets the ``overflow`` flag on packets with a saturated lane; sequences whose result
  carries the flag are listed in :attr:`Worker.overflow_seqs`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Tuple, Union

import numpy as np

from atp_pipeline.ina.counters import Counters
from atp_pipeline.ina.job import JobLayout
from atp_pipeline.ina.packet import ATP_APP_TYPE, DecodeError, Packet, PacketFormat
from atp_pipeline.ina.quant import quantize_mask


@dataclass
class WorkerConfig:
    """End-host stack knobs (§5.4); times in seconds, sizes in bytes."""

    cc: bool = True
    initial_window_pkts: int = 50
    mtu: int = 1500
    ssthresh: float = 64e3  # initial slow-start threshold: ≈ RTT·bytes at 100 Gbit/s (§5.4)
    max_window_bytes: float = 256e3
    fixed_window_pkts: int = 800  # window when cc is off (= max_window_bytes in packets)
    rto: float = 1e-3
    dupack_threshold: int = 3
    fast_retransmit_burst: int = 64  # one out-of-order trigger resends at most this many holes
    timeout_burst: int = 64  # a timeout resends at most this many expired packets (oldest first)
    min_window_pkts: int = 16  # multiplicative decrease never goes below this
    #: ``rack``: out-of-order ACKs trigger RACK-style loss detection over every hole (ours);
    #: ``paper``: every three consecutive out-of-order ACKs resend UNA only (§5.4 as written);
    #: ``released``: the authors' released code — any out-of-order ACK resends every hole
    #: below it at once, once per episode (see :meth:`Worker._released_retransmit`)
    recovery: str = "rack"


class WorkerStats(Counters):
    __slots__ = ("sent", "retransmits", "fast_retransmits", "timeouts", "acks", "dup_acks",
                 "ecn_acks", "decreases", "unknown_job", "malformed")


class Worker:
    """One worker of one job."""

    def __init__(self, fmt: PacketFormat, layout: JobLayout, worker_id: int, host: int,
                 cfg: Optional[WorkerConfig] = None) -> None:
        self.fmt = fmt
        self.layout = layout
        self.wid = worker_id
        self.host = host
        self.cfg = cfg or WorkerConfig()
        self.k = fmt.payload_k
        self.pkt_bytes = fmt.wire_bytes
        g = layout.group_of[worker_id]
        self._n_ps = layout.n_ps
        self._ps_dst = list(layout.ps_hosts) if layout.ps_hosts else [-1] * layout.n_ps
        self._hdr = (layout.job, worker_id, len(layout.groups[g]), layout.fan_in1,
                     1 << layout.child0[worker_id], 1 << g, layout.group_start_edge[g])
        self.stats = WorkerStats()
        c = self.cfg
        self.wnd = (float(c.initial_window_pkts * self.pkt_bytes) if c.cc
                    else float(c.fixed_window_pkts * self.pkt_bytes))
        self.ssthresh = c.ssthresh
        self._cc, self._mtu, self._max_wnd = c.cc, c.mtu, c.max_window_bytes
        self._job, self._rto, self._dupthresh = layout.job, c.rto, c.dupack_threshold
        if c.recovery not in ("rack", "paper", "released"):
            raise ValueError(f"recovery must be 'rack', 'paper' or 'released', got {c.recovery!r}")
        self._rack = c.recovery == "rack"
        self._released = c.recovery == "released"
        self._payload_bytes = 4 * self.k
        self.rto_cur = c.rto
        self.min_rtt = float("inf")
        self.srtt = 0.0  # smoothed ACK delay (RFC 6298 gain 1/8): one decrease per srtt
        self.done = True
        self.n = 0
        self.overflow_seqs: List[int] = []
        self._last_decrease = -1.0

    # ----------------------------------------------------------------------------- API
    def start_float(self, grads: np.ndarray, scale: Union[float, np.ndarray], base_seq: int, now: float,
                    scratch: Optional[np.ndarray] = None) -> List[Packet]:
        """Quantize (headroom scheme; one scale, or one per element) and start; packets with a
        saturated lane carry ``overflow``. The integers come out in the wire's byte order when
        the format decodes to views (the live path: no second conversion); ``scratch``: a
        float buffer like ``grads`` to quantize in (:func:`~atp_pipeline.ina.quant.quantize_mask`)."""
        dtype = self.fmt.wire_dtype if self.fmt.views else np.int32
        q, sat = quantize_mask(grads, scale, self.layout.n_workers, dtype=dtype, scratch=scratch)
        return self.start(q, base_seq, now, saturated=sat)

    def start(self, tensor: np.ndarray, base_seq: int, now: float,
              saturated: Optional[np.ndarray] = None) -> List[Packet]:
        """Begin pushing ``tensor`` (int32; 1-D, or 2-D with a row of ``K`` lanes per packet) as
        sequences ``base_seq …``; returns packets.

        ``saturated`` (bool per element) marks lanes clamped by quantization."""
        k = self.k
        # in the wire's byte order when the format decodes to views (live): encoding is one copy
        dtype = self.fmt.wire_dtype if self.fmt.views else np.int32
        if np.ndim(tensor) == 2 and np.shape(tensor)[1] == k:  # already a row per packet (live engine)
            buf = np.asarray(tensor).astype(dtype, copy=False).reshape(-1)
            n = len(buf) // k
            t = buf
        else:
            t = np.asarray(tensor, dtype=np.int32).ravel()
            n = max(1, -(-len(t) // k))
            buf = np.zeros(n * k, dtype=dtype)
            buf[: len(t)] = t
        self.length = len(t)
        self.chunks = buf.reshape(n, k)
        self.chunk_rows = list(self.chunks)  # row views: list indexing is cheaper per packet
        self.n = n
        self.base = base_seq
        self.rows: List[Optional[np.ndarray]] = [None] * n
        self.acked = bytearray(n)
        self.n_acked = 0
        self.una = 0
        self.nxt = 0
        self.ooo = 0
        self.high = 0
        self._resend_waiting = -1  # recovery="released": holes up to here were resent
        self.rack_ts = -1.0
        self.rack_rtt = 0.0
        self.reo_deadline: Optional[float] = None
        self.last_sent: List[float] = [0.0] * n
        self.was_resent = bytearray(n)
        # (deadline, seq, sent) in transmission order; deadlines are non-decreasing because
        # the timeout only grows during a backoff and a reset re-stamps the list
        self.timers: Deque[Tuple[float, int, float]] = deque()
        self.done = False
        self.overflow_seqs = []
        self._ovf = None
        if saturated is not None and np.any(saturated):
            m = np.zeros(n * k, dtype=bool)
            m[: len(t)] = np.asarray(saturated, dtype=bool).ravel()[: len(t)]
            self._ovf = [int(x) for x in m.reshape(n, k).any(axis=1)]
        self.t_start = now
        self.t_done: Optional[float] = None
        return self._fill(now)

    def on_bytes(self, buf: bytes, now: float) -> List[Packet]:
        try:
            p = self.fmt.decode(buf)
        except DecodeError:
            self.stats.malformed += 1
            return []
        return self.on_packet(p, now)

    def on_packet(self, p: Packet, now: float) -> List[Packet]:
        S = self.stats
        if p.job != self._job:
            S.unknown_job += 1
            return []
        if not p.is_param or p.app_type != ATP_APP_TYPE:  # (decode guarantees K lanes)
            S.malformed += 1
            return []
        r = p.seq - self.base
        acked = self.acked
        # (once done, every acked[r] is set: no separate ``done`` test is needed)
        if not 0 <= r < self.n or acked[r]:
            S.dup_acks += 1
            return []
        S.acks += 1
        sent = self.last_sent[r]
        if not self.was_resent[r]:  # Karn: RTT samples from first transmissions only
            rtt = now - sent
            self.srtt += (rtt - self.srtt) * 0.125
            if rtt < self.min_rtt:
                self.min_rtt = rtt
            if sent > self.rack_ts:  # the most recently sent packet known delivered (RACK)
                self.rack_ts, self.rack_rtt = sent, rtt
        if self.rto_cur != self._rto:
            self._reset_backoff()  # progress ends the timeout backoff
        acked[r] = 1
        self.n_acked += 1
        self.rows[r] = p.payload  # never mutated once sent: keep a reference
        if p.overflow:
            self.overflow_seqs.append(p.seq)
        if self._cc:
            wnd = self.wnd
            if p.ecn:
                S.ecn_acks += 1
                self._decrease(now)
                wnd = self.wnd
            elif wnd < self.ssthresh:
                wnd += self._mtu
            else:
                wnd += self._mtu * self.pkt_bytes / wnd
            self.wnd = wnd if wnd < self._max_wnd else self._max_wnd
        out: List[Packet] = []
        if r == self.una:
            una = r + 1
            n = self.n
            while una < n and acked[una]:
                una += 1
            self.una = una
            self.ooo = 0
        else:
            self.ooo += 1
            if r > self.high:
                self.high = r
            if self._released:
                if self.una > self._resend_waiting:
                    out = self._released_retransmit(now)
            elif self.ooo >= self._dupthresh:
                self.ooo = 0
                if self._rack:
                    out = self._fast_retransmit(now)
                elif self.una < self.nxt:  # the paper's literal rule: resend UNA
                    self._decrease(now)
                    S.fast_retransmits += 1
                    out = [self._packet(self.una, now, resend=1)]
        if self.n_acked == self.n:
            self.done = True
            self.t_done = now
            self.timers.clear()
            return out
        # send new packets while INF − UNA < ⌈wnd / packet⌉ (inlined _fill)
        nxt = self.nxt
        limit = self.una - (-self.wnd // self.pkt_bytes)
        if limit > self.n:
            limit = self.n
        while nxt < limit:
            out.append(self._packet(nxt, now, 0))
            nxt += 1
        self.nxt = nxt
        return out

    def set_rto(self, rto: float) -> None:
        """Change the base retransmission timeout (e.g. from a conservative initial value
        before the first RTT samples, RFC 6298 §2.1, to the configured one)."""
        self.cfg.rto = self._rto = self.rto_cur = float(rto)

    def _reset_backoff(self) -> None:
        """Back to the base timeout; pending deadlines are re-stamped so the timer list
        stays sorted (entries are in transmission order)."""
        self.rto_cur = self._rto
        self.timers = deque((sent + self._rto, r, sent) for _, r, sent in self.timers)

    def next_deadline(self) -> Optional[float]:
        """The earliest retransmission timeout or reordering-timer expiry, if any."""
        t = self.timers
        acked, last = self.acked, self.last_sent
        while t and (acked[t[0][1]] or last[t[0][1]] != t[0][2]):
            t.popleft()
        d = t[0][0] if t else None
        reo = self.reo_deadline
        if reo is not None and (d is None or reo < d):
            return reo
        return d

    def poll(self, now: float) -> List[Packet]:
        """Timeout (§5.4): retransmit expired packets, oldest first, at most
        ``timeout_burst``; the timeout doubles (up to 64×) until the next new ACK, and
        expired packets beyond the burst wait one more (backed-off) timeout. Most expired
        packets of a stalled job are not lost but parked in aggregators waiting for one
        slow worker; resending a whole window of them floods the PS link."""
        out: List[Packet] = []
        if self.reo_deadline is not None and now >= self.reo_deadline and not self.done:
            out = self._fast_retransmit(now)  # RACK reordering timer
        t = self.timers
        expired: List[int] = []
        while t and t[0][0] <= now:
            _, r, sent = t.popleft()
            if not self.acked[r] and self.last_sent[r] == sent:
                expired.append(r)
        if not expired:
            return out
        expired.sort()
        self.stats.timeouts += 1
        self._decrease(now)
        self.rto_cur = min(self.rto_cur * 2, self.cfg.rto * 64)
        limit = self.cfg.timeout_burst
        out += [self._packet(r, now, resend=1) for r in expired[:limit]]
        for r in expired[limit:]:
            self.last_sent[r] = now  # not resent yet: wait another timeout
            t.append((now + self.rto_cur, r, now))
        return out

    @property
    def delivered_bytes(self) -> int:
        """Result payload bytes received so far (all rounds): the worker's goodput."""
        return self.stats.acks * self._payload_bytes

    @property
    def result(self) -> np.ndarray:
        """Received parameter payloads, ``(packets, K)`` int32 (zeros where none yet)."""
        if not self.n:
            return np.zeros((0, self.k), np.int32)
        if self.n_acked == self.n:  # every row present: one C-level copy
            return np.array(self.rows, dtype=np.int32)
        z = np.zeros(self.k, dtype=np.int32)
        return np.stack([z if x is None else x for x in self.rows])

    @property
    def result_tensor(self) -> np.ndarray:
        return self.result.ravel()[: self.length]

    # ------------------------------------------------------------------------ internals
    def _fast_retransmit(self, now: float) -> List[Packet]:
        """Retransmit the holes below the highest ACK that are lost by RACK's rules
        (RFC 8985): sent ``reo`` before the most recently sent packet known delivered, or
        older than that packet's RTT plus ``reo`` (``reo`` = min RTT / 4); ``una`` first,
        at most ``fast_retransmit_burst``. Holes not yet lost arm the reordering timer."""
        out: List[Packet] = []
        acked, last = self.acked, self.last_sent
        cap = self.cfg.fast_retransmit_burst
        hi = min(self.high, self.nxt)
        reo = self.min_rtt * 0.25
        lost_sent_before = self.rack_ts - reo
        wait = self.rack_rtt + reo
        first_pending = None
        r = acked.find(0, self.una, hi)
        while r != -1:
            t = last[r]
            if t < lost_sent_before or now >= t + wait:
                if not out:
                    self._decrease(now)
                out.append(self._packet(r, now, resend=1))
                if len(out) >= cap:
                    break
            elif first_pending is None or t + wait < first_pending:
                first_pending = t + wait
            r = acked.find(0, r + 1, hi)
        self.reo_deadline = first_pending
        self.stats.fast_retransmits += len(out)
        return out

    def _released_retransmit(self, now: float) -> List[Packet]:
        """The authors' released host stack (``client/p4ml_manager.cc``, loss recovery on):
        on an out-of-order parameter packet, unless the holes are already being resent,
        resend every sequence from ``una`` up to the earliest out-of-order ACK still
        outstanding (all unacknowledged), at once and without a cap, and do not resend
        again until ``una`` passes the last of them."""
        una = self.una
        front = self.acked.find(1, una, self.nxt)
        if front == -1:
            return []
        self._decrease(now)
        out = [self._packet(r, now, resend=1) for r in range(una, front)]
        self._resend_waiting = front - 1
        self.stats.fast_retransmits += len(out)
        return out

    def _decrease(self, now: float) -> None:
        """Multiplicative decrease, at most once per smoothed ACK delay (one window)."""
        if not self.cfg.cc or now - self._last_decrease < self.srtt:
            return
        self.wnd = max(float(self.pkt_bytes * self.cfg.min_window_pkts), self.wnd / 2)
        self.ssthresh = self.wnd
        self._last_decrease = now
        self.stats.decreases += 1

    def _fill(self, now: float) -> List[Packet]:
        limit = min(self.n, self.una + math.ceil(self.wnd / self.pkt_bytes))
        nxt = self.nxt
        if nxt >= limit:
            return []
        out = []
        while nxt < limit:
            out.append(self._packet(nxt, now, 0))
            nxt += 1
        self.nxt = nxt
        return out

    def _packet(self, r: int, now: float, resend: int) -> Packet:
        seq = self.base + r
        p = Packet.__new__(Packet)
        p.job, p.worker_id, p.fan_in0, p.fan_in1, p.bitmap0, p.bitmap1, p.edge = self._hdr
        p.app_type = ATP_APP_TYPE
        p.seq = seq
        p.agg_index = p.watermark = p.agg1 = p.is_param = p.collision = p.ecn = p.reserved = 0
        p.ps_index = ps = seq % self._n_ps
        p.overflow = self._ovf[r] if self._ovf is not None else 0
        p.resend = resend
        p.payload = self.chunk_rows[r]
        p.src = self.host
        p.dst = self._ps_dst[ps]
        p.size = self.pkt_bytes
        self.last_sent[r] = now
        self.timers.append((now + self.rto_cur, r, now))
        self.stats.sent += 1
        if resend:
            self.stats.retransmits += 1
            self.was_resent[r] = 1
        return p
