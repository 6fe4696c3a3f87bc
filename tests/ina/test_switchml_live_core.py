"""SwitchML's protocol core as the live backend runs it, in one process.

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
from atp_pipeline.ina.switchml import batch as sml_batch
from atp_pipeline.ina.switchml import float_worker as sml_float
from atp_pipeline.ina.switchml import lanes as sml_lanes
from atp_pipeline.ina.switchml import switch as sml_switch


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
            got: List[List[bytes]] = [[] for _ in range(W)]
            for w, data in down:
                if rng.random() < loss:
                    dropped += 1
                    continue
                got[w].append(data)
            for w in range(W):  # shm: each worker's results as one batch, in array form (SMLEngine's path)
                if shm and got[w]:
                    up += fmt.split(ws[w].on_headers(got[w], now).tobytes())
                else:
                    up += [fmt.encode(p) for data in got[w] for p in ws[w].on_bytes(data, now)]
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


def _state(js: SMLSwitchJob) -> tuple:
    return (list(js.seen), list(js.count), list(js.exp), dict(js.stats), js.values.copy())


def test_switch_array_form_equals_the_per_packet_form(monkeypatch):
    """``SMLSwitch.batch`` decides large batches with array operations and
    falls back to its per-packet loop where one packet's decision depends on another's, and sums
    in two threads (the live role's): on random batches — retransmissions, stale versions,
    duplicates, exponent-only and lane packets, unknown slots and workers, UDP payloads and
    shared lanes — the results, the state and the registers equal those of the same packets
    sent one at a time."""
    monkeypatch.setattr(sml_switch, "ARRAY_MIN", 2)
    rng = np.random.default_rng(11)
    W, pool, k = 3, 4, 8
    lanes = [rng.integers(-1000, 1000, size=(2, pool, k), dtype=np.int32) for _ in range(W)]
    ref, arr = SMLSwitch(), SMLSwitch()
    for sw in (ref, arr):
        sw.jobs[1] = SMLSwitchJob(1, W, pool, k, -1, list(range(W)), lanes=lanes)
    arr.threads = 2  # (the live role's: the sums in two halves at once, here from 2 register rows up)
    monkeypatch.setattr(sml_lanes, "SUM_SPLIT_MIN", 2 * k)
    fast = 0
    for step in range(400):
        # the array form reads the registers whole (small partitions) or only the slot-versions touched
        monkeypatch.setattr(sml_batch, "WHOLE_STATE", 0 if step % 4 == 1 else 8)
        m = int(rng.integers(2, 24))
        if step % 2:  # a realistic batch: one version per slot, each worker once, a few retransmissions
            v = int(rng.integers(0, 2))
            cells = [(s, w) for s in range(pool) for w in range(W)]
            pick = rng.permutation(len(cells))[:m]
            f = dict(job=[1] * len(pick), slot=[cells[i][0] for i in pick], ver=[v] * len(pick),
                     is_result=[0] * len(pick), worker=[cells[i][1] for i in pick])
        else:
            f = dict(job=[1 if rng.random() > 0.03 else 2 for _ in range(m)],
                     slot=rng.integers(0, pool + 1, m).tolist(),
                     ver=rng.integers(0, 2, m).tolist(), is_result=(rng.random(m) < 0.03).astype(int).tolist(),
                     worker=rng.integers(0, W + 1, m).tolist())
        n = len(f["job"])
        f["exp"] = rng.integers(100, 160, n).tolist()
        f["empty"] = (rng.random(n) < 0.2).astype(int).tolist()
        udp = step % 5 == 0
        f["payload"] = [rng.integers(-1000, 1000, k, dtype=np.int32) if udp and not e else None for e in f["empty"]]
        before = arr.unknown, dict(arr.jobs[1].stats)
        # (the live role passes the header fields as arrays: SMLFormat.fields(h, arrays=True))
        got = arr.batch(**{x: (np.asarray(v) if step % 3 == 0 and x != "payload" else v) for x, v in f.items()})
        want = []
        for j in range(n):  # one at a time: what the simulator does
            for _, d, e, row in ref.batch(*([f[x][j]] for x in ("job", "slot", "ver", "is_result", "worker", "exp",
                                                                  "empty", "payload"))):
                want.append((j, d, e, row))
        assert [(j, d, e) for j, d, e, _ in got] == [(j, d, e) for j, d, e, _ in want]
        assert all((a is None) == (b is None) and (a is None or np.array_equal(a, b))
                   for (*_, a), (*_, b) in zip(got, want))
        for sw in (arr, ref) if step % 2 else ():  # (the lane work no result has needed yet is carried)
            sw.settle()
        sa, sr = _state(arr.jobs[1]), _state(ref.jobs[1])
        assert sa[:4] == sr[:4] and arr.unknown == ref.unknown
        assert np.array_equal(sa[4], sr[4]) or not step % 2
        fast += step % 2 and (arr.unknown, dict(arr.jobs[1].stats)) != before
    assert fast > 100 and arr.jobs[1].stats["complete"] > 50 and arr.jobs[1].stats["result_unicast"] > 10


def test_worker_array_form_equals_the_per_packet_form(monkeypatch):
    """``SMLFloatWorker.on_headers`` (the engine's shared-memory path: headers in and out as
    arrays) against ``on_datagrams`` (packet by packet) on twin workers fed
    the same batches of a run with 15% loss, per-slot timeouts and duplicated results: the same
    packets to send, the same protocol state, the same lanes quantized and the same results,
    bit for bit."""
    monkeypatch.setattr(sml_float, "WORKER_ARRAY_MIN", 2)
    rng = np.random.default_rng(7)
    W, pool, k = 3, 4, 16
    fmt = SMLFormat(k, shm=True)
    regs = np.zeros((2, pool, k), dtype=np.int32)
    sw = SMLSwitch()
    sw.jobs[1] = SMLSwitchJob(1, W, pool, k, -1, list(range(W)), values=regs)
    lanes = [np.zeros((2, pool, k), dtype=np.int32) for _ in range(W)]
    twin_lanes = [np.zeros((2, pool, k), dtype=np.int32) for _ in range(W)]
    ws = [SMLFloatWorker(1, w, W, pool, k, rto=1.0, lanes=lanes[w], results=regs) for w in range(W)]
    tw = [SMLFloatWorker(1, w, W, pool, k, rto=1.0, lanes=twin_lanes[w], results=regs) for w in range(W)]

    def same(a: SMLFloatWorker, b: SMLFloatWorker) -> None:
        for x in ("cur", "ver", "uses", "deadline", "n_got", "done"):
            assert getattr(a, x) == getattr(b, x), x
        assert list(a.timers) == list(b.timers) and bytes(a.got) == bytes(b.got)
        assert np.array_equal(a.shared, b.shared) and np.array_equal(a.out, b.out)
        assert [getattr(a.stats, s) for s in a.stats.__slots__] == [getattr(b.stats, s) for s in b.stats.__slots__]

    dups = 0
    for rnd in range(3):
        xs = [rng.normal(size=150) * 10.0 ** (w - 1) for w in range(W)]
        now = float(rnd)
        up = []
        for w in range(W):
            h = ws[w].start_float(xs[w], now, out=np.zeros(150), headers=True)
            assert h.tobytes() == fmt.header_array(tw[w].start_float(xs[w], now, out=np.zeros(150))).tobytes()
            up += fmt.split(h.tobytes())
        while not all(w.done for w in ws):
            got: List[List[bytes]] = [[] for _ in range(W)]
            for buf in up:
                if rng.random() < 0.15:
                    continue
                p = fmt.decode(buf)
                if p.payload is None:  # lanes in shared memory (the switch reads them there)
                    p.payload = lanes[p.worker][p.ver, p.slot]
                for r in sw(p, None):
                    for w in ([r.dst] if r.dst >= 0 else range(W)):
                        if rng.random() >= 0.15:
                            got[w] += [fmt.encode(r)] * (2 if rng.random() < 0.05 else 1)
            up = []
            for w in range(W):
                if got[w]:
                    dups += len(got[w]) != len(set(got[w]))
                    h = ws[w].on_headers(got[w], now)
                    assert h.tobytes() == fmt.header_array(tw[w].on_datagrams(got[w], now)).tobytes()
                    assert np.array_equal(lanes[w], twin_lanes[w])
                    same(ws[w], tw[w])
                    up += fmt.split(h.tobytes())
            if not up and not all(w.done for w in ws):
                now = min(d for w in ws if (d := w.next_deadline()) is not None)
                for w in range(W):
                    a, b = ws[w].poll(now), tw[w].poll(now)
                    assert fmt.header_array(a).tobytes() == fmt.header_array(b).tobytes()
                    ws[w].flush(), tw[w].flush()
                    up += [fmt.encode(p) for p in a]
        for w in range(W):
            same(ws[w], tw[w])
    assert dups > 0 and sum(w.stats.timeouts for w in ws) > 0
    total = np.sum(xs, axis=0)
    assert np.abs(ws[0].out - total).max() <= 3 * 2.0 ** (max(ws[0].shared) - EXP_BIAS - ws[0].bits)


def test_switch_role_gathers_every_workers_datagrams_before_deciding(monkeypatch):
    """The SwitchML switch role (``nodes.SMLSwitchNode``) decides a batch once every worker of the
    job has sent (one decision a round instead of one per worker's datagram), and
    at its deadline with what it has when a worker sends nothing (lost packets, a resend): over real
    UDP sockets in one process, the batch handed to the switch function holds every worker's
    datagram, also one sent after the role woke, and deciding it completes every slot at once."""
    import socket
    import threading

    from atp_pipeline.ina.live import nodes
    from atp_pipeline.ina.live.frames import datagrams, drain

    W, pool, k = 3, 8, 4
    fmt = SMLFormat(k)
    node = nodes.SMLSwitchNode(fmt)
    node.sock.setblocking(False)  # (as its serve loop has it)
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(W)]
    try:
        for s_ in socks:
            s_.bind(("127.0.0.1", 0))
            s_.settimeout(5.0)
        node.op_add_job(None, [list(s_.getsockname()) for s_ in socks], job=5, pool=pool)
        ws = [SMLFloatWorker(5, w, W, pool, k, rto=1.0) for w in range(W)]
        sent = [datagrams([fmt.encode(p) for p in ws[w].start_float(np.arange(20.0) + w, 0.0)]) for w in range(W)]
        assert all(len(d) == 1 for d in sent)

        def send(w: int) -> None:
            socks[w].sendto(sent[w][0], node.data_addr)

        monkeypatch.setattr(nodes, "GATHER_S", 0.05)  # the deadline: workers 0 and 1 only
        send(0), send(1)
        got = node.gather(drain(node.sock))
        assert sorted(buf for buf, _ in got) == sorted([sent[0][0], sent[1][0]])
        node.handle_batch(got)
        node.outbox.flush()
        assert node.sml.jobs[5].stats["complete"] == 0  # (worker 2's contributions missing)

        monkeypatch.setattr(nodes, "GATHER_S", 30.0)  # all three, worker 2's after the role woke
        send(0), send(1)
        late = threading.Timer(0.05, send, (2,))
        late.start()
        while not select_readable(node.sock):
            pass
        got = node.gather(drain(node.sock))
        late.join()
        assert sorted(buf for buf, _ in got) == sorted(d[0] for d in sent)
        node.handle_batch(got)
        node.outbox.flush()
        js = node.sml.jobs[5]
        P = ws[0].P
        assert js.stats["complete"] == P and js.stats["result_unicast"] == 0 and js.stats["dropped"] == P * 2
        for s_ in socks:  # one batch of results: every slot's, to every worker
            res = fmt.split(s_.recv(65536))
            assert sorted(fmt.decode(r).slot for r in res) == list(range(P))
    finally:
        node.control.close()
        node.sock.close()
        for s_ in socks:
            s_.close()


def select_readable(sock) -> bool:
    import select

    return bool(select.select([sock], [], [], 5.0)[0])


_TRACKER_SCRIPT = '''
import multiprocessing as mp
from atp_pipeline.ina.live.shm import attach, create_lanes, lanes_of, release

def child(name):
    seg = attach(name)
    a = lanes_of(seg, 2, 4)
    a[0, 0, 0] += 1
    del a
    release(seg, unlink=False)

if __name__ == "__main__":
    own, lanes = create_lanes(2, 4)
    ctx = mp.get_context("spawn")  # children share this process's resource tracker
    ps = [ctx.Process(target=child, args=(own.name,)) for _ in range(3)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    assert lanes[0, 0, 0] == 3, lanes[0, 0, 0]
    del lanes
    release(own, unlink=True)
'''


def test_attached_segments_leave_the_resource_tracker_alone(tmp_path):
    """Processes sharing one resource tracker attach and drop one segment, its owner unlinks it: no
    ``KeyError`` traceback from ``resource_tracker.py``, no leak warning (the ranks
    of every live run attach the switch's registers)."""
    import subprocess
    import sys

    script = tmp_path / "attach.py"
    script.write_text(_TRACKER_SCRIPT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "leaked" not in r.stderr, r.stderr


def test_blocking_all_reduce_runs_inline_only_when_nothing_is_queued():
    """``Engine.all_reduce`` runs the sync in the caller's thread when nothing is queued
    (two thread wake-ups a sync fewer); behind queued requests it waits its turn — requests
    run one at a time, in order — and a failed job stays failed on either path."""
    import queue
    import threading
    import time

    import torch

    from atp_pipeline.ina.live.engine import Engine, EngineConfig

    class Recorder(Engine):
        def __init__(self) -> None:  # the request machinery alone: no sockets, no protocol
            self.cfg, self.error, self.ran = EngineConfig(), None, []
            self._q, self._mu, self._busy, self._pending = queue.Queue(), threading.Lock(), threading.Lock(), 0
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

        def _sync(self, tensor: torch.Tensor) -> None:
            if tensor[0] < 0:
                raise RuntimeError("rank failed")
            time.sleep(0.02)
            self.ran.append((float(tensor[0]), threading.get_ident() == main))
            tensor += 1

    main = threading.get_ident()
    e = Recorder()
    try:
        assert float(e.all_reduce(torch.zeros(1))[0]) == 1.0 and e.ran == [(0.0, True)]  # inline
        fut = e.all_reduce_async(torch.full((1,), 10.0))
        assert float(e.all_reduce(torch.full((1,), 20.0))[0]) == 21.0  # behind the queued one
        assert float(fut.wait()[0]) == 11.0
        assert e.ran[1:] == [(10.0, False), (20.0, False)]
        try:
            e.all_reduce(torch.full((1,), -1.0))
            raise AssertionError("no error")
        except RuntimeError as err:
            assert "rank failed" in str(err)
        try:
            e.all_reduce_async(torch.zeros(1)).wait()
            raise AssertionError("no error")
        except RuntimeError as err:
            assert "rank failed" in str(err)
    finally:
        e._q.put(None)
        e._thread.join(timeout=5)


def test_spin_drain_returns_what_arrives_and_gives_up_in_time():
    """A receiver with cores to spare busy-polls before blocking: ``spin_drain``
    returns a datagram that arrives while it spins, [] once its time is up; hosts with fewer than two
    cores per process of a sync never spin."""
    import socket
    import threading
    import time

    from atp_pipeline.ina.live import frames
    from atp_pipeline.ina.live.role import udp_socket

    rx, tx = udp_socket(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        frames.poller_for(rx)  # (non-blocking)
        t0 = time.perf_counter()
        assert frames.spin_drain(rx, 0.005) == [] and time.perf_counter() - t0 >= 0.005
        threading.Timer(0.005, tx.sendto, (b"hdr", rx.getsockname())).start()
        got = frames.spin_drain(rx, 2.0)
        assert [b for b, _ in got] == [b"hdr"] and time.perf_counter() - t0 < 1.0
    finally:
        rx.close()
        tx.close()
    import os

    cores = len(os.sched_getaffinity(0))
    assert frames.spin_budget(cores // 2 + 1) == 0.0 and frames.spin_budget(max(1, cores // 2)) == frames.SPIN_S
    # the switch role's summing threads: 2 only with a core for every process of the sync and one more
    assert frames.cores() == cores
    assert frames.sum_threads(cores) == 1 and frames.sum_threads(max(1, cores - 1)) == (2 if cores >= 2 else 1)
