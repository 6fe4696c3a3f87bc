"""The worker end-host stack in a training rank: ATP all-reduce off the autograd thread.

:class:`Engine` owns one UDP socket and one protocol :class:`~atp_pipeline.ina.worker.Worker`
(window, ACKs, retransmission, AIMD — §5.4, unchanged from the simulator) and runs them on
a background thread. :meth:`Engine.all_reduce_async` queues a tensor and returns a
``torch.futures.Future`` that completes with the tensor overwritten by the sum over the
job's workers, so a DDP communication hook or the strategy's ``post_backward`` can wait
on it. Requests are served in order; every worker of a job issues the same sequence of
buffer sizes (DDP's buckets, or one flat bucket per step), so sequence numbers agree.

Quantization (§5.4, :mod:`atp_pipeline.ina.quant`): all workers of a job must use the same
scale. It is derived from data every worker already shares — the previous result for the
same buffer size — never from local values. Each packet has its own scale (one
scale for a whole flat gradient left the small gradients of some layers a few quanta, and
Adam amplifies that noise): ``s_p = safe_scale(bound_p, W)`` with ``bound_p = 16·max|Σ_p|``
over packet ``p``'s lanes, the largest over the last :data:`BOUND_MEMORY` rounds of that
buffer size (DDP may sync several buckets of one size per step; the whole tensor's bound
where a sum was 0; ``initial_bound`` before the first round). A lane that saturates sets the ``overflow`` flag,
which the switch and the PS OR into the parameter packet, so every worker sees it on the
same sequences; all of them then redo the round with ``bound_p × 1024`` for those packets
(at most ``max_rescale`` times). Integer sums are exact, the scale
is a function of earlier results only, so the result is bit-identical whatever the loss,
duplication or reordering on the way; nothing wraps: a gradient that still saturates
after every rescaling (NaN/inf, or beyond ``2^(10·max_rescale)·bound``) raises.

Liveness: a round that makes no progress (no new parameter packet) for
``stall_timeout_s`` raises :class:`~.rpc.AggregationError` naming the workers whose
contributions are missing for the oldest unfinished sequence (asked of the switch, which
holds the aggregator's bitmap, and of the PS), i.e. the rank that died or hangs.
"""

from __future__ import annotations

import queue
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from atp_pipeline.ina.job import JobLayout
from atp_pipeline.ina.live.frames import (
    MAX_DATAGRAM,
    datagrams,
    drain,
    keep_freed_memory,
    poller_for,
    spin_budget,
    spin_drain,
    wait_readable,
)
from atp_pipeline.ina.live.rpc import Addr, AggregationError, Peer
from atp_pipeline.ina.live.shm import lanes_of, release
from atp_pipeline.ina.packet import PacketFormat
from atp_pipeline.ina.quant import safe_scales
from atp_pipeline.ina.worker import Worker, WorkerConfig

SEQ_LIMIT = 1 << 32
INITIAL_RTO_S = 1.0
PAD_SIZES = 4  # buffer sizes whose padded buffers an engine keeps (DDP: a few bucket sizes)
BOUND_MEMORY = 4  # rounds of one buffer size whose per-packet bounds the next one takes the max of
UDP_INFLIGHT_BYTES = 1 << 20  # SwitchML over UDP: lane bytes a worker keeps in flight (SMLEngine)


@dataclass
class EngineConfig:
    """Knobs of the live end-host stack (times in seconds)."""

    stall_timeout_s: float = 10.0
    initial_bound: float = 1.0
    headroom: float = 16.0
    max_rescale: int = 6
    worker: WorkerConfig = field(default_factory=lambda: WorkerConfig(rto=0.05, max_window_bytes=2e6))
    pool: int = 64  # SwitchML: slots of the job's partition (:class:`SMLEngine`)
    #: SwitchML's shared-memory transport (:mod:`.shm`): this worker's lane segment and the
    #: switch's register segment (the engine releases both at :meth:`Engine.close`)
    shm: Optional[Tuple[Any, Any]] = None


@dataclass
class EngineStats:
    """Cumulative counters of one engine (deltas per step are logged)."""

    rounds: int = 0
    bytes: int = 0  # gradient bytes synchronized (float32-equivalent: 4 per element)
    sync_s: float = 0.0
    rescales: int = 0
    packets: int = 0
    retransmits: int = 0
    timeouts: int = 0
    window_bytes: float = 0.0
    send_errors: int = 0  # datagrams the socket refused (recovered as losses)

    def as_dict(self) -> Dict[str, float]:
        return dict(self.__dict__)


class Engine:
    """Worker ``worker_id`` of ATP job ``job`` (``n_workers`` workers, ``n_ps`` PS shards)."""

    def __init__(self, fmt: PacketFormat, job: int, worker_id: int, n_workers: int, sock: socket.socket,
                 switch: Addr, switch_control: Peer, ps_controls: Sequence[Peer], n_ps: int = 1,
                 ranks: Optional[Sequence[int]] = None, cfg: Optional[EngineConfig] = None, racks: int = 1) -> None:
        if fmt.atp_bytes > MAX_DATAGRAM:
            raise AggregationError(f"{fmt.payload_k} values per packet make {fmt.atp_bytes}-byte datagrams; "
                                   f"UDP carries at most {MAX_DATAGRAM}")
        self.fmt, self.job, self.wid, self.n_workers = fmt, job, worker_id, n_workers
        self.cfg = cfg or EngineConfig()
        self.sock, self.switch = sock, tuple(switch)
        # the control channels of its (rack) switch and the PS shards, with the job's tenant token
        self.switch_control, self.ps_controls = switch_control, list(ps_controls)
        self.ranks = list(ranks) if ranks is not None else list(range(n_workers))
        self.racks, self.per_rack, self.n_ps = racks, n_workers // racks, n_ps
        self.worker = self._new_worker()
        self.stats = EngineStats()
        self._poller = poller_for(sock)
        self.seq = 0
        self._bound: Dict[int, Deque[np.ndarray]] = {}  # buffer size -> per-packet bounds of its last rounds
        self._pads: Dict[Tuple[int, str], Tuple[np.ndarray, np.ndarray]] = {}  # see _padded
        keep_freed_memory()  # the round's temporaries are reused from the heap, not faulted in again
        self._q: "queue.Queue[Any]" = queue.Queue()
        #: requests queued and not finished (under ``_mu``); ``_busy`` is held while one runs, in the
        #: engine thread or inline in :meth:`all_reduce`'s caller: requests run one at a time, in order
        self._mu, self._busy, self._pending = threading.Lock(), threading.Lock(), 0
        #: an inline sync (its caller waits anyway) busy-polls the socket this long before blocking,
        #: where the host has cores to spare (:func:`~.frames.spin_budget`: the workers and the roles)
        self._spin_s, self._inline = spin_budget(n_workers + racks + (racks > 1) + n_ps), False
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"atp-worker-{job}.{worker_id}", daemon=True)
        self._thread.start()

    def _new_worker(self) -> Any:
        """This worker's protocol stack: ATP's :class:`~atp_pipeline.ina.worker.Worker` over the
        job's layout (racks of consecutive workers; more than one: two-level, §4.1)."""
        per = self.per_rack
        layout = JobLayout(job=self.job, groups=[list(range(r * per, (r + 1) * per)) for r in range(self.racks)],
                           two_level=self.racks > 1, n_ps=self.n_ps, bitmap_bits=self.fmt.bitmap_bits)
        # first round: ranks start it at different times (lazy initialization, uneven first
        # steps) and early packets wait in aggregators for late workers; a conservative
        # initial timeout (RFC 6298 §2.1: 1 s) keeps them from being resent past the switch
        return Worker(self.fmt, layout, self.wid, host=self.wid,
                      cfg=replace(self.cfg.worker, rto=max(self.cfg.worker.rto, INITIAL_RTO_S)))

    # ------------------------------------------------------------------ API
    def all_reduce_async(self, tensor: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
        """Sum ``tensor`` (contiguous, CPU) over the job's workers, in place; a Future of it."""
        fut: "torch.futures.Future[torch.Tensor]" = torch.futures.Future()
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            fut.set_exception(AggregationError("ATP all-reduce needs a contiguous CPU tensor"))
            return fut
        with self._mu:
            self._pending += 1
            self._q.put((tensor, fut))
        return fut

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """:meth:`all_reduce_async` and wait. When nothing is queued the sync runs in the caller's thread:
        handing it to the engine thread and the result back costs two thread wake-ups a sync (0.4–0.9 ms of
        a 4.4 ms `tiny` sync on a 2-core host). Same code, same order: the engine thread's requests and an
        inline one never overlap (``_busy``), and one is inline only when none is queued."""
        inline = False
        if tensor.is_contiguous() and tensor.device.type == "cpu":
            with self._mu:
                inline = self._pending == 0 and self._busy.acquire(blocking=False)
        if not inline:
            return self.all_reduce_async(tensor).wait()
        try:
            if self.error is not None:  # a failed job stays failed
                raise self.error
            self._inline = True
            try:
                self._sync(tensor)
            except BaseException as e:  # noqa: BLE001 - as the engine thread: the job is failed
                self.error = e
                raise
        finally:
            self._inline = False
            self._busy.release()
        return tensor

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)
        try:
            self.sock.close()
        except OSError:
            pass
        if self.cfg.shm is not None:  # the worker's arrays over the segments go first
            self.worker = None
            own, peer = self.cfg.shm
            release(peer, unlink=False)
            release(own, unlink=True)

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            tensor, fut = item
            err: Optional[BaseException] = None
            with self._busy:  # (an inline all_reduce that started first finishes first)
                if self.error is not None:  # a failed job stays failed: never hang the caller
                    err = self.error
                else:
                    try:
                        self._sync(tensor)
                    except BaseException as e:  # noqa: BLE001 - delivered through the future
                        self.error = err = e
            with self._mu:
                self._pending -= 1
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(tensor)

    def _sync(self, tensor: torch.Tensor) -> None:
        t0 = time.perf_counter()
        x = tensor.detach().reshape(-1).numpy()
        if x.dtype not in (np.float32, np.float64):
            x = x.astype(np.float64)
        res = self._sum(x)
        if res.ctypes.data != tensor.data_ptr() or x.ctypes.data != tensor.data_ptr():
            tensor.view(-1).copy_(torch.from_numpy(res))  # (SwitchML writes the result into the tensor itself)
        s, ws = self.stats, self.worker.stats
        s.rounds += 1
        s.bytes += 4 * x.size
        s.sync_s += time.perf_counter() - t0
        s.packets, s.retransmits, s.timeouts = ws.sent, ws.retransmits, ws.timeouts
        s.window_bytes = getattr(self.worker, "wnd", 0.0)

    def _sum(self, x: np.ndarray) -> np.ndarray:
        """The sum of ``x`` over the job's workers, through ATP (§5.4 quantization, one scale per
        packet: module docstring), in ``x``'s float type: the scales are powers of two, so
        float32 quantizes to the very integers float64 would, and a float32 sum ``Σq / s`` is
        the float32 rounding of the exact value either way (fewer and smaller temporaries:
        at a few MB per round their page faults cost more than the protocol)."""
        n, k = x.size, self.fmt.payload_k
        npk = max(1, -(-n // k))
        xp, scratch = self._padded(n, npk, x.dtype)  # a row per packet; the tail stays 0
        xp.reshape(-1)[:n] = x
        past = self._bound.get(n)
        bound = np.full(npk, self.cfg.initial_bound) if not past else np.max(past, axis=0)
        w = self.worker
        for attempt in range(self.cfg.max_rescale + 1):
            scale = safe_scales(bound, self.n_workers).astype(x.dtype)[:, None]
            if self.seq + npk >= SEQ_LIMIT:
                raise AggregationError(f"ATP job {self.job}: 32-bit sequence space exhausted")
            base = self.seq
            pkts = w.start_float(xp, scale, base, time.monotonic(), scratch=scratch)
            self.seq += w.n
            self._send(pkts)
            self._run_round()
            if not w.overflow_seqs:
                break
            if attempt == self.cfg.max_rescale:
                local = "" if np.isfinite(x).all() else f"; rank {self.ranks[self.wid]} has NaN/inf gradients"
                raise AggregationError(f"ATP job {self.job}: gradient lanes still saturate after "
                                       f"{self.cfg.max_rescale} rescalings (bound {bound.max():.3g}){local}")
            bound = bound.copy()
            bound[np.asarray(w.overflow_seqs, dtype=np.int64) - base] *= 1024.0  # the packets that saturated
            self.stats.rescales += 1
        if self.stats.rounds == 0:
            w.set_rto(self.cfg.worker.rto)
        self.last_scale = scale  # what the last round's integers mean, per packet (tests check Σ of them)
        res = np.array(w.rows, dtype=x.dtype)  # one pass from the received lanes (wire order)
        res /= scale
        peak = np.maximum(res.max(axis=1), -res.min(axis=1))
        whole = max(self.cfg.headroom * float(peak.max()), 1e-12)
        # a packet whose sum was 0 (e.g. embedding rows no token used) gets the whole tensor's bound
        self._bound.setdefault(n, deque(maxlen=BOUND_MEMORY)).append(
            np.where(peak > 0, np.maximum(self.cfg.headroom * peak, 1e-12), whole))
        return res.reshape(-1)[:n]

    def _padded(self, n: int, npk: int, dtype: Any) -> Tuple[np.ndarray, np.ndarray]:
        """The padded ``(packets, K)`` buffer and the quantization scratch of buffers of ``n``
        values (kept per size: DDP syncs the same bucket sizes every step; a fresh array per
        round costs its page faults and zeroing). Only the first ``n`` values of the
        buffer are ever written, so its padding stays 0."""
        key = (n, np.dtype(dtype).str)
        got = self._pads.pop(key, None)
        if got is None:
            got = (np.zeros((npk, self.fmt.payload_k), dtype=dtype), np.empty((npk, self.fmt.payload_k), dtype=dtype))
            if len(self._pads) >= PAD_SIZES:  # the least recently used size goes
                del self._pads[next(iter(self._pads))]
        self._pads[key] = got  # (re)inserted last: dicts keep insertion order
        return got

    def _send(self, pkts: List[Any]) -> None:
        """Encode and send, as few datagrams as fit (:mod:`.frames`)."""
        if not pkts:
            return
        enc, put = self.fmt.encode, self._put
        if len(pkts) == 1:
            put(enc(pkts[0]))
            return
        for data in datagrams([enc(p) for p in pkts]):
            put(data)

    def _put(self, data: bytes) -> None:
        """One datagram to the switch; a full send buffer is waited out (briefly), any other
        error is a loss the protocol recovers from."""
        try:
            self.sock.sendto(data, self.switch)
        except BlockingIOError:
            select.select([], [self.sock], [], 0.05)
            try:
                self.sock.sendto(data, self.switch)
            except OSError:
                self.stats.send_errors += 1
        except OSError:
            self.stats.send_errors += 1

    def _run_round(self) -> None:
        w, sock, poller = self.worker, self.sock, self._poller
        stall = self.cfg.stall_timeout_s
        last_progress = time.monotonic()
        acked = self._progress()
        while not w.done:
            now = time.monotonic()
            d = w.next_deadline()
            wait = 0.05 if d is None else min(max(d - now, 0.0), 0.05)
            got = spin_drain(sock, min(wait, self._spin_s), 1 << 20) if self._inline and self._spin_s else []
            if not got:
                got = drain(sock, 1 << 20) if wait_readable(poller, wait) else []
            now = time.monotonic()
            if got:  # everything queued, answered in one batch
                self._send(self._receive([buf for buf, _ in got], now))
            if d is not None and now >= d:
                self._send(w.poll(now))
            if self._progress() != acked:
                acked, last_progress = self._progress(), now
            elif now - last_progress > stall:
                raise self._stalled(now - last_progress)

    def _receive(self, bufs: List[bytes], now: float) -> List[Any]:
        """The datagrams drained, packet by packet through the protocol: the packets to send."""
        out: List[Any] = []
        split, on_bytes = self.fmt.split, self.worker.on_bytes
        for buf in bufs:
            for pkt in split(buf):
                out += on_bytes(pkt, now)
        return out

    def _progress(self) -> int:
        """Results received so far this round (a stall is a round where this stops growing)."""
        return self.worker.n_acked

    def _stalled(self, waited: float) -> AggregationError:
        """Name the workers whose contribution to the oldest unfinished sequence is missing
        (switch ∪ PS view)."""
        seq = self.worker.base + self.worker.una
        full = (1 << self.n_workers) - 1
        seen, notes = 0, []
        try:  # this worker's (rack) switch: its level-0 bitmap names workers of this rack
            bm = self.switch_control.call("aggregator", timeout=3.0, job=self.job, seq=seq)
            seen |= (bm or 0) << (self.wid // self.per_rack * self.per_rack)
        except AggregationError as e:
            notes.append(str(e))
        shard = seq % len(self.ps_controls)
        head = f"ATP gradient sync of job {self.job} made no progress for {waited:.0f} s at sequence {seq}"
        try:
            ps = self.ps_controls[shard].call("missing", timeout=3.0, job=self.job, seq=seq)
            if not ps["installed"]:  # torn down: another rank of the run failed first (close(ok=False))
                return AggregationError(f"{head}: the job was torn down meanwhile — another rank of this run "
                                        f"failed first (its error names the cause)")
            if ps["missing"] is not None:
                seen |= full & ~ps["missing"]
        except AggregationError as e:
            notes.append(str(e))
        missing = [i for i in range(self.n_workers) if not seen >> i & 1]
        who = ", ".join(f"worker {i} (rank {self.ranks[i]})" for i in missing) or "none identified"
        msg = f"{head}: no contribution from {who} — that process stopped or is unreachable"
        if notes:
            msg += "; " + "; ".join(notes)
        return AggregationError(msg)



class SMLEngine(Engine):
    """Worker ``worker_id`` of a SwitchML job: the same thread, Future API, batching and
    receive loop as :class:`Engine`; the protocol is :class:`~atp_pipeline.ina.switchml.SMLFloatWorker`
    (slots with shadow copies, per-packet shared exponents, per-slot timeouts) and the
    switch is the aggregation endpoint (no PS)."""

    def _new_worker(self) -> Any:
        from atp_pipeline.ina.switchml import SMLFloatWorker

        lanes = results = None
        if self.cfg.shm is not None:  # the shared-memory transport (:mod:`.shm`)
            lanes, results = (lanes_of(s, self.cfg.pool, self.fmt.payload_k) for s in self.cfg.shm)
        # over UDP every chunk in flight is a datagram queued at the switch: the workers' windows
        # together stay within its receive buffer (64 slots of 64 KiB from each of 4
        # workers overflowed it, and SwitchML recovers a drop by a timeout only)
        window = None if lanes is not None else max(1, UDP_INFLIGHT_BYTES // self.fmt.atp_bytes)
        w = SMLFloatWorker(self.job, self.wid, self.n_workers, self.cfg.pool, self.fmt.payload_k,
                           max(self.cfg.worker.rto, INITIAL_RTO_S), lanes=lanes, results=results, window=window)
        w.keep_ints = False  # each chunk's result goes straight into the tensor (start_float's out)
        return w

    def _sum(self, x: np.ndarray) -> np.ndarray:
        """The sum over the job's workers: ``Σq · 2^(e−B)`` per chunk (exact integer sums)."""
        w = self.worker
        try:
            pkts = w.start_float(x, time.monotonic(), out=x, headers=True)  # results overwrite x chunk by chunk
        except ValueError as e:
            who = f"rank {self.ranks[self.wid]} has " if "NaN/inf" in str(e) else ""
            raise AggregationError(f"SwitchML job {self.job}: {who}{e}") from None
        self._send(pkts)
        self._run_round()
        if self.stats.rounds == 0:
            w.rto = self.cfg.worker.rto
        return x

    def _receive(self, bufs: List[bytes], now: float) -> List[Any]:
        if self.fmt.shm:  # headers in, headers out: the array form
            return self.worker.on_headers(bufs, now)  # type: ignore[return-value]
        return self.worker.on_datagrams(bufs, now)  # the whole batch at once

    def _send(self, pkts: Any) -> None:
        if not len(pkts):
            return
        if not self.fmt.shm:
            super()._send(pkts)
            return
        hdr = pkts if isinstance(pkts, np.ndarray) else self.fmt.header_array(pkts)
        data = hdr.tobytes()  # headers only: encoded as one array
        step = MAX_DATAGRAM // self.fmt.header_bytes * self.fmt.header_bytes
        for i in range(0, len(data), step):
            self._put(data[i:i + step])

    def _progress(self) -> int:
        return self.worker.n_got

    def _stalled(self, waited: float) -> AggregationError:
        w = self.worker
        item = w.got.find(0)
        return AggregationError(f"SwitchML gradient sync of job {self.job} made no progress for {waited:.0f} s "
                                f"(slot {item % w.stride}, item {item}): some worker of the job stopped or is "
                                f"unreachable")
