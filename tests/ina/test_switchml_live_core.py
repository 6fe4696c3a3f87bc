"""SwitchML's protocol core as the live backend runs it (issue 28), in one process.

* the switch function is one object for simulator and live role;
* per-packet shared exponents: under loss (per-slot timeouts, shadow copies) every chunk's
  aggregated integers equal the exact sum of the workers' quantized integers, every worker
  gets the same bits, and the float result is within the quantization bound;
* the wire format: exponent-only packets carry no lanes; several packets per datagram are
  cut back exactly (ATP's fixed-size and SwitchML's self-delimiting frames), and the
  live path's per-destination batching keeps order and the datagram limit.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from atp_pipeline.ina import switchml as core
from atp_pipeline.ina.live.frames import MAX_DATAGRAM, Outbox
from atp_pipeline.ina.packet import PacketFormat
from atp_pipeline.ina.sim import switchml as sim
from atp_pipeline.ina.switchml import EXP_BIAS, SMLFloatWorker, SMLFormat, SMLSwitch, SMLSwitchJob


def _run(xs: List[np.ndarray], pool: int, k: int, loss: float, seed: int, rounds: int = 2, shm: bool = False
         ) -> Tuple[List[SMLFloatWorker], List[List[np.ndarray]], int]:
    """Drive W float workers and the switch through the wire codec with random loss (``shm``:
    the shared-memory transport, the lanes in arrays the switch and the workers share)."""
    W = len(xs)
    fmt = SMLFormat(k, shm=shm)
    sw = SMLSwitch()
    regs = np.zeros((2, pool, k), dtype=np.int32) if shm else None
    sw.jobs[1] = SMLSwitchJob(1, W, pool, k, -1, list(range(W)), values=regs)
    lanes = [np.zeros((2, pool, k), dtype=np.int32) if shm else None for _ in range(W)]
    ws = [SMLFloatWorker(1, w, W, pool, k, rto=1.0, lanes=lanes[w], results=regs) for w in range(W)]
    rng = np.random.default_rng(seed)

    def decode(buf: bytes) -> core.SMLPacket:  # the switch role's attach (nodes.SMLSwitchNode.handle)
        p = fmt.decode(buf)
        if p.payload is None:
            p.payload = lanes[p.worker][p.ver, p.slot]
        return p

    dropped = 0
    sent_q: List[List[np.ndarray]] = []
    for _ in range(rounds):
        now = 0.0
        up = [fmt.encode(p) for w in range(W) for p in ws[w].start_float(xs[w], now)]
        while not all(w.done for w in ws):
            down: List[Tuple[int, bytes]] = []
            for buf in up:
                if rng.random() < loss:
                    dropped += 1
                    continue
                for r in sw(decode(buf), None):
                    data = fmt.encode(r)
                    down += [(r.dst, data)] if r.dst >= 0 else [(w, data) for w in range(W)]
            up = []
            for w, data in down:
                if rng.random() < loss:
                    dropped += 1
                    continue
                up += [fmt.encode(p) for p in ws[w].on_bytes(data, now)]
            if not up and not all(w.done for w in ws):  # quiet: the earliest per-slot timeout
                now = min(d for w in ws if (d := w.next_deadline()) is not None)
                up = [fmt.encode(p) for w in ws for p in w.poll(now)]
        sent_q = [[w.chunks[w.P + c] for c in range(w.n_chunks)] for w in ws]
    return ws, sent_q, dropped


def test_switch_function_is_shared_with_the_simulator():
    assert sim.SMLSwitch is core.SMLSwitch and sim.SMLWorker is core.SMLWorker
    assert sim.SML_HEADER_BYTES == SMLFormat(8).header_bytes == 10  # as planning/gradsync.py assumes


def test_shared_exponents_give_exact_integer_sums_under_loss():
    rng = np.random.default_rng(3)
    k, pool = 16, 4
    # workers of very different magnitudes, a zero chunk, a tail shorter than a packet
    xs = [rng.normal(size=203) * 10.0 ** e for e in (-4, 0, 3)]
    xs[1][32:48] = 0.0
    ws, sent_q, dropped = _run(xs, pool, k, loss=0.1, seed=1)
    assert dropped > 0 and sum(w.stats.retransmits for w in ws) > 0
    n = ws[0].n_chunks
    for c in range(n):
        exact = np.sum([q[c].astype(np.int64) for q in sent_q], axis=0)
        assert np.array_equal(exact, ws[0].result_q[c])  # integer sums exact
        e = ws[0].shared[c] - EXP_BIAS
        peak = max(float(np.abs(x[c * k:(c + 1) * k]).max(initial=0.0)) for x in xs)
        assert peak < 2.0 ** e and (peak == 0 or peak >= 2.0 ** (e - 1))  # the max exponent of the chunk
    res = [w.result_float for w in ws]
    assert all(np.array_equal(res[0], r) for r in res[1:])  # the same bits everywhere
    total = np.sum(xs, axis=0)
    assert np.abs(res[0] - total).max() <= 3 * 2.0 ** (max(ws[0].shared) - EXP_BIAS - ws[0].bits)
    clean, _, _ = _run(xs, pool, k, loss=0.0, seed=1)
    assert np.array_equal(clean[0].result_float, res[0])  # loss changes nothing, bit for bit


def test_shared_memory_transport_gives_the_same_bits_under_loss():
    """``aggregation.transport=shm``: headers travel (10 bytes), lanes stay in shared arrays;
    the shadow copies keep every slot-version until all workers have read it: under 10% loss
    the results are the UDP path's, bit for bit."""
    rng = np.random.default_rng(5)
    xs = [rng.normal(size=203) * 10.0 ** e for e in (-2, 0, 1)]
    ws, _, dropped = _run(xs, pool=4, k=16, loss=0.1, seed=2, rounds=3, shm=True)
    assert dropped > 0 and sum(w.stats.retransmits for w in ws) > 0
    ref, _, _ = _run(xs, pool=4, k=16, loss=0.0, seed=2, rounds=1)
    assert all(np.array_equal(w.result_float, ref[0].result_float) for w in ws)
    fmt = SMLFormat(16, shm=True)
    p = core.SMLPacket.__new__(core.SMLPacket)
    p.job, p.slot, p.ver, p.is_result, p.worker, p.off, p.exp = 1, 2, 1, 0, 0, 5, 130
    p.payload = np.arange(16, dtype=np.int32)
    data = fmt.encode(p)
    assert len(data) == 10 and fmt.decode(data).payload is None  # the lanes are attached by the receiver
    assert fmt.split(data * 3) == [data] * 3
    try:
        SMLFormat(16).decode(data)  # a UDP receiver refuses a shared-memory header
        raise AssertionError("decoded")
    except core.DecodeError:
        pass


def test_frames_cut_back_exactly_and_batches_keep_order():
    fmt = PacketFormat(62)
    pk = [fmt.encode(fmt.packet(job=1, seq=s, fan_in0=1, bitmap0=1)) for s in range(300)]
    sent: List[bytes] = []
    box = Outbox(lambda data, addr: sent.append(data))
    for b in pk:
        box.put(b, ("127.0.0.1", 1))
    box.flush()
    assert len(sent) == -(-300 // (MAX_DATAGRAM // fmt.atp_bytes)) and all(len(d) <= MAX_DATAGRAM for d in sent)
    assert [bytes(p) for d in sent for p in fmt.split(d)] == pk
    assert [fmt.decode(p).seq for p in fmt.split(sent[0])][:3] == [0, 1, 2]
    sml = SMLFormat(32)
    w = SMLFloatWorker(1, 0, 2, 4, 32, rto=1.0)
    probes = w.start_float(np.arange(200.0), 0.0)  # 4 exponent-only packets
    full = core.SMLPacket.__new__(core.SMLPacket)
    full.job, full.slot, full.ver, full.is_result, full.worker, full.off, full.exp = 1, 2, 1, 1, 0, 9, 130
    full.payload = np.arange(32, dtype=np.int32)
    mixed = [sml.encode(probes[0]), sml.encode(full), sml.encode(probes[1])]
    assert len(mixed[0]) == 10 and len(mixed[1]) == 10 + 128
    back = [sml.decode(p) for p in sml.split(b"".join(mixed))]
    assert [p.payload.size for p in back] == [0, 32, 0] and back[1].exp == 130 and back[1].off == 9
    assert np.array_equal(back[1].payload, full.payload) and back[2].slot == probes[1].slot
