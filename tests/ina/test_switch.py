"""Switch data plane (§5.3, Figure 4): each step ①–⑩ on hand-built packets."""

from __future__ import annotations

import numpy as np
import pytest

from atp_pipeline.ina.packet import Packet, PacketFormat
from atp_pipeline.ina.switch import SwitchState, agg_hash, agg_slot, allocated, ecn_mark, live_aggregators, process

K = 4
FMT = PacketFormat(payload_k=K)
JOB = 7


def grad(w, seq=0, fan0=3, fan1=0, edge=0, group=0, resend=0, val=None, ecn=0, job=JOB, bm0=None):
    return FMT.packet(job=job, seq=seq, worker_id=w, fan_in0=fan0, fan_in1=fan1,
                      bitmap0=bm0 if bm0 is not None else 1 << w, bitmap1=1 << group, edge=edge,
                      resend=resend, ecn=ecn,
                      payload=np.full(K, (w + 1) if val is None else val, dtype=np.int32))


def param(seq=0, wm=0, job=JOB):
    return FMT.packet(job=job, seq=seq, is_param=1, watermark=wm)


def sw(n=8):
    return SwitchState(n, K, jobs=[JOB])


def test_allocate_merge_complete_then_parameter_deallocates():
    s = sw()
    assert process(s, grad(0))[1] == () and process(s, grad(1))[1] == ()
    st, out = process(s, grad(2))  # ⑥ third of three: complete
    assert st is s and len(out) == 1
    p = out[0]
    assert p.payload.tolist() == [6] * K and p.bitmap0 == 0b111 and p.edge == 1 and not p.resend
    assert p.agg_index == agg_hash(JOB, 0)
    assert allocated(s) == 1  # kept until the parameter packet (④ needs the bitmap)
    _, out = process(s, param(0))  # ②
    assert out[0].is_param and allocated(s) == 0 and s.stats.dealloc_param == 1


def test_duplicate_contribution_is_dropped():
    s = sw()
    process(s, grad(0))
    assert process(s, grad(0))[1] == ()  # ④ already aggregated, not a retransmission
    process(s, grad(1))
    out = process(s, grad(2))[1]
    assert out[0].payload.tolist() == [6] * K  # counted once
    assert s.stats.dup_dropped == 1


def test_collision_goes_upstream_untouched_with_resend_and_level_flipped():
    s = sw(n=1)
    process(s, grad(0, seq=0))
    g = grad(1, seq=1, val=5)
    out = process(s, g)[1]  # ① another ⟨job, seq⟩ holds the only aggregator
    assert out == (g,) and g.resend and g.collision and g.edge == 1
    assert g.payload.tolist() == [5] * K and g.bitmap0 == 0b10
    assert s.seq[0] == 0 and s.bitmap[0] == 0b1


def test_other_job_parameter_does_not_deallocate():
    s = SwitchState(1, K, jobs=[JOB, 8])
    process(s, grad(0))
    process(s, param(0, job=8))
    process(s, param(5))
    assert allocated(s) == 1


def test_retransmission_merges_flushes_and_deallocates():
    s = sw()
    process(s, grad(0))
    out = process(s, grad(1, resend=1))[1]  # ④ new bit merged, ⑨ copied out, ⑩ freed
    assert len(out) == 1 and out[0].bitmap0 == 0b11 and out[0].payload.tolist() == [3] * K
    assert out[0].resend and out[0].edge == 1 and allocated(s) == 0
    process(s, grad(2))  # a later original allocates afresh
    out = process(s, grad(2, resend=1))[1]  # ⑧ already merged: content flushed, not doubled
    assert out[0].bitmap0 == 0b100 and out[0].payload.tolist() == [3] * K and allocated(s) == 0


def test_retransmission_never_allocates():
    s = sw()
    g = grad(0, resend=1)
    assert process(s, g)[1] == (g,) and allocated(s) == 0 and g.edge == 1


def test_two_level_aggregation_and_level1_retransmission_flush():
    s1 = sw()  # the PS's ToR; each group has its own first-level ToR below
    ups = []
    for grp in (0, 1):
        st = SwitchState(8, K, jobs=[JOB])
        for w in range(2):
            ups += process(st, grad(w, fan0=2, fan1=3, group=grp, val=10 * grp + w))[1]
    assert [u.edge for u in ups] == [1, 1] and [u.bitmap1 for u in ups] == [1, 2]
    for u in ups:
        assert process(s1, u)[1] == ()  # level 1 waits for three children
    # a retransmission from group 2 at level 1: forwarded directly (⑦) + clone flush (⑩)
    r = grad(0, fan0=1, fan1=3, group=2, edge=1, resend=1, val=100)
    out = process(s1, r)[1]
    assert len(out) == 2 and allocated(s1) == 0
    clone, fwd = out
    assert clone.agg1 and clone.bitmap1 == 0b011 and clone.payload.tolist() == [0 + 1 + 10 + 11] * K
    assert fwd is r and not fwd.agg1 and fwd.payload.tolist() == [100] * K


def test_level1_completion_marks_agg1():
    s1 = sw()
    out = []
    for grp in range(2):
        out += process(s1, grad(0, fan0=1, fan1=2, group=grp, edge=1, val=grp + 1))[1]
    assert len(out) == 1 and out[0].agg1 and out[0].bitmap1 == 0b11 and out[0].payload.tolist() == [3] * K


def test_ecn_of_consumed_packets_survives_aggregation():
    s = sw()
    process(s, grad(0))
    process(s, grad(1, ecn=1))
    out = process(s, grad(2))[1]
    assert out[0].ecn == 1


def test_watermark_refuses_stale_allocation_and_sweeps_stale_aggregators():
    s = sw(n=2)  # job 7: seqs 0-3 and 8-11 hash to aggregator 1, seqs 4-7 to aggregator 0
    process(s, grad(0, seq=3))  # will be left behind (e.g. a late duplicate)
    process(s, param(seq=5, wm=5))  # PS: every seq < 5 of shard 0 is complete
    # the watermark crossed seq 3: its aggregator is swept although the packet hashes elsewhere
    assert agg_slot(agg_hash(JOB, 5), 2) != agg_slot(agg_hash(JOB, 3), 2)
    assert allocated(s) == 0 and s.stats.stale_reclaimed == 1 and s.wm(JOB, 0) == 5
    g = grad(1, seq=4)
    assert process(s, g)[1] == (g,) and g.resend and s.stats.stale_forward == 1 and allocated(s) == 0
    process(s, grad(0, seq=8))
    assert s.seq[1] == 8 and live_aggregators(s) == [(1, JOB, 8)]


def test_sweep_frees_only_the_crossed_sequences_of_its_job_and_shard():
    s = SwitchState(4096, K, jobs=[JOB, 8])
    for q, shard in ((3, 0), (10, 0), (11, 1), (21, 1), (30, 0)):
        process(s, FMT.packet(job=JOB, seq=q, worker_id=0, fan_in0=2, bitmap0=1, ps_index=shard,
                              payload=np.ones(K, np.int32)))
    process(s, grad(0, seq=5, job=8))  # another job
    assert allocated(s) == 6
    process(s, FMT.packet(job=JOB, seq=13, is_param=1, watermark=12, ps_index=0))  # shard 0 below 12
    assert sorted(s.seq[i] for i in range(s.n) if s.valid[i]) == [5, 11, 21, 30]
    assert s.stats.stale_reclaimed == 2
    # a jump longer than the array walks the array: shard 1 below 5000 goes; job 8 and shard 0 stay
    process(s, FMT.packet(job=JOB, seq=4999, is_param=1, watermark=5000, ps_index=1))
    assert sorted((s.job[i], s.seq[i]) for i in range(s.n) if s.valid[i]) == [(JOB, 30), (8, 5)]
    assert s.stats.stale_reclaimed == 4 and s.stats.dealloc_param == 0


def test_no_memory_and_no_service():
    s = SwitchState(0, K, jobs=[JOB])
    g = grad(0)
    assert process(s, g)[1] == (g,) and g.collision and g.edge == 1
    s = sw()
    g = grad(0, edge=1, fan1=0)  # single-level job passing the PS's ToR after level 0
    assert process(s, g)[1] == (g,) and s.stats.no_service == 1 and allocated(s) == 0


def test_fan_in_one_completes_immediately():
    s = sw()
    out = process(s, grad(0, fan0=1, val=9))[1]
    assert len(out) == 1 and out[0].payload.tolist() == [9] * K and allocated(s) == 1


def test_outcomes_partition_the_packets():
    s = sw(n=2)
    pkts = [grad(0), grad(0), grad(1, seq=1), grad(1, resend=1), param(0), grad(2, seq=5), grad(0, job=99)]
    for p in pkts:
        process(s, p)
    assert s.stats.packets() == len(pkts)


@pytest.mark.parametrize("backlog,marked", [(10, 0), (100, 1)])
def test_ecn_marking_threshold_copies_on_write(backlog, marked):
    p = Packet()
    q = ecn_mark(p, backlog, 50)
    assert q.ecn == marked and p.ecn == 0 and (q is p) == (not marked)


def test_parameter_packets_sweep_stale_aggregators_of_their_job_and_teardown_clears():
    s = sw(n=1)
    process(s, grad(0, seq=3))  # orphan: a late duplicate after seq 3 completed
    process(s, param(seq=9, wm=5))  # watermark passes 3: swept
    assert allocated(s) == 0 and s.stats.stale_reclaimed == 1
    process(s, grad(0, seq=6))
    assert s.remove_job(JOB) == 1 and allocated(s) == 0 and JOB not in s.jobs and s.watermark == {}


def test_batch_form_equals_the_per_packet_form_on_a_faulty_two_level_run(monkeypatch):
    """:func:`process_batch` (the live emulator's) against :func:`process` one packet at a time,
    on the packets every switch of a simulated run received: two jobs (one two-level across 3
    racks), 4 aggregators per switch (collisions, resends, ⑦ flushes, reallocation within a
    batch), 5% loss, duplication and reordering on every link. Replayed from each switch's
    initial state, in batches of random sizes: the same outputs (headers and payloads), registers,
    watermarks and counters."""
    import copy
    import random

    from atp_pipeline.ina import switch as S
    from atp_pipeline.ina.sim import fabric as F
    from atp_pipeline.ina.sim.atp_job import AtpJobSpec
    from atp_pipeline.ina.sim.fabric import FabricConfig, LinkFaults
    from atp_pipeline.ina.sim.scenario import run
    from atp_pipeline.ina.worker import WorkerConfig

    seen = {}  # switch -> (its state before the first packet, the packets it received)

    def clone(st):  # (the per-aggregator rows are views of the registers: a deep copy must keep them so)
        c = copy.deepcopy(st)
        c.rows = list(c.values)
        return c

    def recording(st, p, plan=None):
        if id(st) not in seen:
            seen[id(st)] = (clone(st), [])
        q = p.copy()
        q.payload = np.array(p.payload)
        seen[id(st)][1].append(q)
        return S.process(st, p, plan)

    monkeypatch.setattr(F, "process", recording)
    jobs = [AtpJobSpec(job=3, worker_hosts=[0, 1, 2, 17, 18, 33], ps_hosts=[40], tensor_elems=62 * 30 + 5, rounds=2,
                       two_level=True, worker=WorkerConfig(rto=100e-6)),
            AtpJobSpec(job=9, worker_hosts=[3, 4, 5], ps_hosts=[41, 42], tensor_elems=62 * 20, rounds=2,
                       worker=WorkerConfig(rto=100e-6))]
    res = run(FabricConfig(n_racks=3, hosts_per_rack=16, n_aggregators=4, seed=5), jobs,
              faults=LinkFaults(loss=0.05, dup=0.05, reorder=0.05, reorder_delay=20e-6))
    assert all(j.finished and j.mismatches == 0 for j in res.jobs)
    rnd = random.Random(0)
    total = 0
    kinds = S.SwitchStats()
    for st0, pkts in seen.values():
        one = clone(st0)
        want = [S.process(one, p.copy())[1] for p in pkts]
        for array_min in (1, S.LANE_ARRAY_MIN):  # every level's lane work as array operations; the default
            monkeypatch.setattr(S, "LANE_ARRAY_MIN", array_min)
            many, got, i = clone(st0), [], 0
            while i < len(pkts):
                n = rnd.choice([1, 2, 7, 40, 200])
                got += S.process_batch(many, [p.copy() for p in pkts[i:i + n]])
                i += n
            assert len(got) == len(want)
            for a, b in zip(want, got):
                assert [(q.header(), q.payload.tolist()) for q in a] == [(q.header(), q.payload.tolist()) for q in b]
            for f in ("key", "bitmap", "count", "flags", "watermark", "job_allocs", "job_complete"):
                assert getattr(one, f) == getattr(many, f), f
            assert np.array_equal(one.values, many.values)
            assert one.stats.as_dict() == many.stats.as_dict()
        total += len(pkts)
        for k, v in one.stats.as_dict().items():
            setattr(kinds, k, getattr(kinds, k) + v)
    # the run exercised what the batch form must get right
    assert total > 2000
    assert min(kinds.collision, kinds.resend_flush, kinds.l1_flush, kinds.merged, kinds.complete, kinds.dup_dropped) > 0
