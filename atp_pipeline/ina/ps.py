"""ATP parameter server (§5.4 "PS updating parameters", §2.1, §4.2 fallback).

One :class:`ParameterServer` is one shard: it owns the sequences ``seq ≡ shard (mod n_ps)``
of every job it serves (several shards split a job's sequence space, Figure 1). It is
event-driven and transport-free: :meth:`on_packet` takes a gradient packet and returns the
parameter packets to send, so the simulator and a live UDP transport drive the same code.

Per sequence it keeps the paper's ⟨bitmap, value⟩, generalized to a few disjoint *pieces*
⟨worker set, partial sum⟩ so that every mix of complete, partially aggregated and
individual (fallback) packets is combined exactly once:

* a packet whose worker set is disjoint from what the PS holds is added as a piece;
* a packet contained in what the PS holds is a duplicate and dropped;
* a packet that strictly contains some pieces (and is disjoint from the rest) replaces
  them — e.g. a worker's own packet arrived by the fallback path and later a switch flushed
  an aggregate that also contains it; ``Σ pieces`` stays the exact sum;
* anything else (a partial overlap, impossible to untangle) is dropped and counted; the
  workers' retransmissions (which never allocate aggregators) deliver the missing
  contributions individually.

When the set covers all ``W`` workers the sum is complete: the update is applied
(:class:`SumUpdate` by default — the parameter packet carries the aggregated gradient, i.e.
all-reduce semantics; :class:`SGDUpdate` applies an SGD step and ships parameters) and
one parameter packet is multicast to the job's workers (§5.1). It doubles as the ACK
(§5.2) and carries the shard's low watermark (every sequence of the shard below it is
complete) and the OR of the contributions' ECN bits (§5.4). A gradient for an already
complete sequence is answered again (unicast to a single retransmitting worker, else
multicast) so a lost parameter packet is recovered.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, Optional, Protocol, Tuple

import numpy as np

from atp_pipeline.ina.counters import Counters
from atp_pipeline.ina.job import JobLayout
from atp_pipeline.ina.packet import ATP_APP_TYPE, DecodeError, Packet, PacketFormat, validate_gradient
from atp_pipeline.ina.quant import INT32_MAX


class Update(Protocol):
    def __call__(self, job: int, seq: int, grad_sum: np.ndarray) -> np.ndarray: ...


class SumUpdate:
    """Parameter packet = aggregated gradient (int32)."""

    def __call__(self, job: int, seq: int, grad_sum: np.ndarray) -> np.ndarray:
        return grad_sum


class SGDUpdate:
    """``θ ← θ − lr · Σg / grad_scale`` on the PS's float parameters; ships ``round(θ·param_scale)``.

    ``params`` is the flat parameter vector of one job; sequence ``s`` covers lanes
    ``(s mod packets) · K …`` (a round re-sends the same element order).
    """

    def __init__(self, params: np.ndarray, lr: float, grad_scale: float, param_scale: float, k: int) -> None:
        self.k = k
        n_pk = -(-len(params) // k)
        self.params = np.zeros(n_pk * k, dtype=np.float64)
        self.params[: len(params)] = params
        self.lr, self.grad_scale, self.param_scale = lr, grad_scale, param_scale
        self.packets = n_pk

    def __call__(self, job: int, seq: int, grad_sum: np.ndarray) -> np.ndarray:
        lo = (seq % self.packets) * self.k
        view = self.params[lo: lo + self.k]
        view -= self.lr * grad_sum.astype(np.float64) / self.grad_scale
        return np.clip(np.rint(view * self.param_scale), -INT32_MAX, INT32_MAX).astype(np.int32)


class PSStats(Counters):
    __slots__ = ("gradients", "pieces_added", "pieces_merged", "duplicates", "overlaps",
                 "completed", "resent_params", "unknown_job", "malformed", "int_overflow", "out_of_window")


class _Seq:
    __slots__ = ("have", "pieces", "ecn", "ovf")

    def __init__(self) -> None:
        self.have = 0
        self.pieces: List[Tuple[int, np.ndarray]] = []
        self.ecn = 0
        self.ovf = 0


class _JobState:
    def __init__(self, layout: JobLayout, update: Update, retain: Optional[int], first_seq: int,
                 horizon: Optional[int] = None) -> None:
        self.layout = layout
        self.update = update
        self.retain = retain
        self.horizon = horizon
        #: completed results kept before a full prune; with a horizon, the oldest completions go first
        #: (:meth:`ParameterServer._prune`) and this is only a safety net: 2·(retain + horizon)
        self.cap = (4 * retain + 64 if horizon is None else 2 * (retain + horizon)) if retain is not None else None
        self.order: Deque[int] = deque()  # completed sequences, completion order (with a horizon)
        self.open: Dict[int, _Seq] = {}
        self.done: Dict[int, Tuple[np.ndarray, int, int]] = {}
        self.watermark = first_seq
        self.packets = 0  # gradient packets of this job that reached the PS
        self.completed = 0  # sequences completed
        self.in_switch = 0  # ... of which one fully switch-aggregated packet carried everything


class ParameterServer:
    """One PS shard serving any number of jobs."""

    def __init__(self, fmt: PacketFormat, host: int, shard: int = 0) -> None:
        self.fmt = fmt
        self.host = host
        self.shard = shard
        self.jobs: Dict[int, _JobState] = {}
        self.stats = PSStats()

    def add_job(self, layout: JobLayout, update: Optional[Update] = None, retain: Optional[int] = None,
                horizon: Optional[int] = None) -> None:
        """Register a job (§5.1); ``retain``: keep finished results this many seqs below
        the watermark for answering retransmissions (``None``: keep all); ``horizon``: drop (and
        count ``out_of_window``) gradients for sequences this far or further above the watermark
        (``None``: accept any). With both, the job's stored packets are bounded
        (:func:`atp_pipeline.ina.budget.ps_job_bytes`): an honest worker never sends beyond its window
        above the watermark nor waits for a result further below it, so a horizon and ``retain`` of its
        window (:func:`~atp_pipeline.ina.budget.ps_horizon`) keep every honest job exact."""
        n_ps = layout.n_ps
        if self.shard >= n_ps:
            raise ValueError(f"shard {self.shard} >= n_ps {n_ps}")
        self.jobs[layout.job] = _JobState(layout, update or SumUpdate(), retain, self.shard, horizon)

    # ------------------------------------------------------------------------------
    def on_bytes(self, buf: bytes) -> List[Packet]:
        try:
            p = self.fmt.decode(buf)
        except DecodeError:
            self.stats.malformed += 1
            return []
        return self.on_packet(p)

    def on_packet(self, p: Packet) -> List[Packet]:
        S = self.stats
        js = self.jobs.get(p.job)
        if js is None:
            S.unknown_job += 1
            return []
        L = js.layout
        if p.is_param or p.ps_index != self.shard or p.seq % L.n_ps != self.shard:
            S.malformed += 1
            return []
        if validate_gradient(p, self.fmt.bitmap_bits) is not None:
            S.malformed += 1
            return []
        mask = L.content_mask(p.agg1, p.worker_id, p.bitmap0, p.bitmap1)
        if mask is None:
            S.malformed += 1
            return []
        seq = p.seq
        if js.horizon is not None and seq - js.watermark >= js.horizon:
            S.out_of_window += 1  # beyond any honest worker's window: nothing is stored for it
            return []
        S.gradients += 1
        js.packets += 1
        done = js.done.get(seq)
        if done is not None or seq < js.watermark:
            S.duplicates += 1
            if done is None:
                return []  # pruned long ago: nobody can still be waiting for it
            return [self._param(js, seq, done, unicast_to=mask)]
        st = js.open.get(seq)
        if st is None:
            if mask == L.full_mask:  # the whole sum in one packet (aggregated in the network)
                S.pieces_added += 1
                return [self._complete(js, p.job, seq, [(mask, p.payload)], p.ecn, p.overflow)]
            st = js.open[seq] = _Seq()
        have = st.have
        if mask & have == 0:
            st.pieces.append((mask, p.payload))
            S.pieces_added += 1
        elif mask & ~have == 0:
            S.duplicates += 1
            return []
        else:
            inside = [pc for pc in st.pieces if pc[0] & ~mask == 0]
            if any(pc[0] & mask and pc[0] & ~mask for pc in st.pieces):
                S.overlaps += 1
                return []
            st.pieces = [pc for pc in st.pieces if pc[0] & mask == 0]
            st.pieces.append((mask, p.payload))
            S.pieces_merged += len(inside)
        st.have = have | mask
        st.ecn |= p.ecn
        st.ovf |= p.overflow
        if st.have != L.full_mask:
            return []
        del js.open[seq]
        return [self._complete(js, p.job, seq, st.pieces, st.ecn, st.ovf)]

    def _complete(self, js: _JobState, job: int, seq: int, pieces: List[Tuple[int, np.ndarray]],
                  ecn: int, ovf: int) -> Packet:
        """Every worker's contribution is in: Σ pieces (int64, then proven to fit int32 by
        the quantization headroom), the update, the watermark, the parameter packet."""
        S = self.stats
        L = js.layout
        if len(pieces) == 1:
            total32 = pieces[0][1]
        else:
            total = pieces[0][1].astype(np.int64)
            for _, v in pieces[1:]:
                total += v
            if np.abs(total).max(initial=0) > INT32_MAX:
                S.int_overflow += 1
                ovf = 1
                total = np.clip(total, -INT32_MAX, INT32_MAX)
            total32 = total.astype(np.int32)
        payload = js.update(job, seq, total32)
        res = (payload, ecn, ovf)
        js.done[seq] = res
        S.completed += 1
        js.completed += 1
        if len(pieces) == 1 and L.n_workers > 1:
            js.in_switch += 1
        n_ps = L.n_ps
        while js.watermark in js.done:
            js.watermark += n_ps
        if js.retain is not None:
            self._prune(js, seq)
        return self._param(js, seq, res, unicast_to=None)

    @staticmethod
    def _prune(js: _JobState, seq: int) -> None:
        """Forget completed results more than ``retain`` below the watermark. With a horizon the
        oldest completions go first, one by one (completion order is close to sequence order), so
        at most ``2·(retain + horizon) + 1`` are ever held; a full pass when that is exceeded."""
        done, lim = js.done, js.watermark - js.retain
        if js.horizon is not None:
            order = js.order
            order.append(seq)
            while order and order[0] < lim:
                done.pop(order.popleft(), None)
        if len(done) > js.cap:  # type: ignore[operator]
            for s in [s for s in done if s < lim]:
                del done[s]
            if js.horizon is not None:
                js.order = deque(s for s in js.order if s in done)

    def _param(self, js: _JobState, seq: int, res: Tuple[np.ndarray, int, int], unicast_to: Optional[int]) -> Packet:
        L = js.layout
        payload, ecn, ovf = res
        p = Packet.__new__(Packet)
        p.app_type, p.job, p.seq, p.worker_id = ATP_APP_TYPE, L.job, seq, 0
        p.fan_in0 = p.fan_in1 = p.bitmap0 = p.bitmap1 = p.agg_index = 0
        p.watermark = js.watermark
        p.ps_index = self.shard
        p.edge = p.agg1 = p.resend = p.collision = p.reserved = 0
        p.is_param = 1
        p.ecn, p.overflow = ecn, ovf
        p.payload = payload
        p.src = self.host
        p.size = self.fmt.wire_bytes
        if unicast_to is not None and unicast_to & (unicast_to - 1) == 0 and L.worker_hosts:
            p.dst = L.worker_hosts[unicast_to.bit_length() - 1]
            self.stats.resent_params += 1
        else:
            p.dst = L.mcast_addr
            if unicast_to is not None:
                self.stats.resent_params += 1
        return p

    def open_sequences(self, job: int) -> int:
        return len(self.jobs[job].open)

    def remove_job(self, job: int) -> bool:
        """Job teardown (§5.1): forget the job's state; whether it was registered."""
        return self.jobs.pop(job, None) is not None

    def job_stats(self, job: int) -> Dict[str, int]:
        """Per-job counters: gradient packets that reached this shard, sequences completed,
        and how many of those were completed by one fully switch-aggregated packet."""
        js = self.jobs[job]
        return {"packets": js.packets, "completed": js.completed, "in_switch": js.in_switch,
                "open": len(js.open), "watermark": js.watermark}

    def missing(self, job: int, seq: int) -> Optional[int]:
        """Workers (bit ``w``) whose contribution to ``seq`` has not reached this shard,
        ``0`` when the sequence is complete, ``None`` when nothing of it has arrived."""
        js = self.jobs[job]
        if seq in js.done or seq < js.watermark:
            return 0
        st = js.open.get(seq)
        return None if st is None else js.layout.full_mask & ~st.have
