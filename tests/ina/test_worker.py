"""Worker stack (§5.4): window in bytes, UNA/INF, ACKs, retransmission, AIMD."""

from __future__ import annotations

import math

import numpy as np
from pytest import approx

from atp_pipeline.ina.job import racks_layout
from atp_pipeline.ina.packet import PacketFormat
from atp_pipeline.ina.worker import Worker, WorkerConfig

K = 4
FMT = PacketFormat(payload_k=K)
PB = FMT.wire_bytes
L = racks_layout(1, [2], worker_hosts=[0, 1], ps_hosts=[9], mcast_addr=99)


def worker(n_packets=400, **cfg):
    w = Worker(FMT, L, 0, 0, WorkerConfig(**cfg))
    out = w.start(np.arange(n_packets * K, dtype=np.int32), 1000, 0.0)
    return w, out


def ack(seq, t, ecn=0, val=None):
    return FMT.packet(job=1, seq=seq, is_param=1, ecn=ecn,
                      payload=np.full(K, seq if val is None else val, dtype=np.int32))


def test_initial_window_is_50_packets_counted_in_bytes():
    w, out = worker()
    assert len(out) == 50 and w.wnd == 50 * PB
    assert [p.seq for p in out] == list(range(1000, 1050))
    assert all(p.bitmap0 == 1 and p.fan_in0 == 2 and p.dst == 9 and not p.resend for p in out)


def test_slow_start_adds_one_mtu_per_ack_then_one_mtu_per_window():
    w, _ = worker(ssthresh=60 * PB)
    out = w.on_packet(ack(1000, 1e-6), 1e-6)
    assert w.wnd == 50 * PB + 1500
    assert len(out) == math.ceil(w.wnd / PB) - 49  # INF − UNA = ⌈wnd / packet⌉
    while w.wnd < w.ssthresh:
        w.on_packet(ack(w.una + 1000, 2e-6), 2e-6)
    before = w.wnd
    w.on_packet(ack(w.una + 1000, 3e-6), 3e-6)
    assert math.isclose(w.wnd - before, 1500 * PB / before)


def test_ecn_halves_once_per_window():
    w, _ = worker()
    w.on_packet(ack(1000, 5e-6), 5e-6)  # srtt sample 5 µs·1/8
    wnd = w.wnd
    w.on_packet(ack(1001, 6e-6, ecn=1), 6e-6)
    assert w.wnd == wnd / 2 and w.ssthresh == w.wnd
    w.on_packet(ack(1002, 6.1e-6, ecn=1), 6.1e-6)  # same window: no second halving
    assert w.wnd == wnd / 2 and w.stats.decreases == 1


def test_paper_recovery_three_out_of_order_acks_resend_una():
    w, _ = worker(cc=False, fixed_window_pkts=10, recovery="paper")
    t = 50e-6
    w.on_packet(ack(1001, t), t)
    assert w.una == 0 and w.nxt == 10  # UNA stays, window blocked at INF − UNA = 10
    w.on_packet(ack(1002, t), t)
    out = w.on_packet(ack(1003, t), t)
    assert [p.seq for p in out if p.resend] == [1000]  # UNA retransmitted, resend flag set
    out = w.on_packet(ack(1000, t), t)  # UNA acked: jumps over 1001..1003
    assert w.una == 4 and w.nxt == 14 and len(out) == 4


def test_released_recovery_resends_every_hole_below_the_first_out_of_order_ack_once():
    """The authors' released stack: one out-of-order ACK resends all holes below it at
    once; no more until UNA passes them."""
    w, _ = worker(cc=False, fixed_window_pkts=10, recovery="released")
    out = w.on_packet(ack(1003, 1e-6), 1e-6)  # 1000-1002 missing
    rs = [p for p in out if p.resend]
    assert [p.seq for p in rs] == [1000, 1001, 1002] and w.stats.fast_retransmits == 3
    assert not any(p.resend for p in w.on_packet(ack(1005, 2e-6), 2e-6))  # same episode
    for s in (1000, 1001, 1002):
        w.on_packet(ack(s, 3e-6), 3e-6)
    assert w.una == 4  # 1003 acked already; 1004 is the next hole
    out = w.on_packet(ack(1006, 4e-6), 4e-6)  # a new episode: resend 1004 only
    assert [p.seq for p in out if p.resend] == [1004]


def test_rack_recovery_resends_every_hole_once_it_is_lost():
    w = Worker(FMT, L, 0, 0, WorkerConfig(cc=False, fixed_window_pkts=10))
    w.start(np.zeros(40 * K, dtype=np.int32), 0, 0.0)  # seqs 0..9 sent at t=0
    w.rack_ts = -1.0
    # seqs 0 and 2 are missing; 1, 3, 4 acked 10 µs later: same send time, so not yet
    # provably lost (reordering window) -> the reordering timer is armed
    for s in (1, 3, 4):
        out = w.on_packet(ack(s, 10e-6), 10e-6)
    assert out == [] and w.reo_deadline == approx(10e-6 + 2.5e-6)
    assert w.next_deadline() == approx(12.5e-6)
    rt = w.poll(12.5e-6)  # the timer fires: both holes resent, UNA first
    assert [p.seq for p in rt] == [0, 2] and all(p.resend for p in rt)
    # a packet sent after the retransmissions is acked: they are not resent again yet
    w.on_packet(ack(5, 13e-6), 13e-6)
    w.on_packet(ack(6, 13e-6), 13e-6)
    assert w.on_packet(ack(7, 13e-6), 13e-6) == []


def test_timeout_retransmits_and_backs_off_until_progress():
    w, out = worker(n_packets=3, rto=100e-6)
    assert w.next_deadline() == approx(100e-6)
    assert w.poll(50e-6) == []
    rt = w.poll(100e-6)
    assert sorted(p.seq for p in rt) == [1000, 1001, 1002] and all(p.resend for p in rt)
    assert w.rto_cur == approx(200e-6) and w.next_deadline() == approx(300e-6)
    w.on_packet(ack(1000, 120e-6), 120e-6)
    assert w.rto_cur == approx(100e-6) and w.next_deadline() == approx(200e-6)  # re-stamped with the base timeout


def test_results_are_written_and_done():
    w, out = worker(n_packets=3)
    for s in (1002, 1000, 1001):
        w.on_packet(ack(s, 1e-6, val=s - 1000), 1e-6)
    assert w.done and w.result_tensor.tolist() == [0] * K + [1] * K + [2] * K
    assert w.on_packet(ack(1001, 2e-6), 2e-6) == [] and w.stats.dup_acks == 1


def test_fixed_window_without_congestion_control():
    w, out = worker(cc=False, fixed_window_pkts=7)
    assert len(out) == 7
    w.on_packet(ack(1000, 1e-6, ecn=1), 1e-6)
    assert w.wnd == 7 * PB and w.stats.decreases == 0
