"""Parameter server (§5.4): exact combination of complete, partial and fallback packets."""

from __future__ import annotations

import numpy as np
import pytest

from atp_pipeline.ina.job import JobLayout, racks_layout
from atp_pipeline.ina.packet import PacketFormat
from atp_pipeline.ina.ps import ParameterServer, SGDUpdate

K = 2
FMT = PacketFormat(payload_k=K)
MC = 1000


def layout(**kw):
    kw.setdefault("worker_hosts", [10, 11, 12, 13])
    kw.setdefault("ps_hosts", [20])
    return racks_layout(1, [2, 2], mcast_addr=MC, **kw)


def g(w, val, seq=0, bm0=None, agg1=0, bm1=None, ecn=0, fan1=0, ps_index=0):
    L = layout()
    grp = L.group_of[w]
    return FMT.packet(job=1, seq=seq, worker_id=w, fan_in0=2, fan_in1=fan1,
                      bitmap0=bm0 if bm0 is not None else 1 << L.child0[w],
                      bitmap1=bm1 if bm1 is not None else 1 << grp, agg1=agg1, ecn=ecn, ps_index=ps_index,
                      payload=np.full(K, val, dtype=np.int32))


def ps(L=None, shard=0, **kw):
    s = ParameterServer(FMT, 20, shard)
    s.add_job(L or layout(), **kw)
    return s


def test_individual_fallback_packets_are_summed_once():
    s = ps()
    assert s.on_packet(g(0, 1)) == []
    assert s.on_packet(g(0, 1)) == []  # duplicate
    s.on_packet(g(1, 2))
    s.on_packet(g(2, 3))
    out = s.on_packet(g(3, 4, ecn=1))
    assert len(out) == 1
    p = out[0]
    assert p.is_param and p.dst == MC and p.payload.tolist() == [10, 10] and p.ecn == 1 and p.watermark == 1
    assert s.stats.duplicates == 1 and s.stats.completed == 1


def test_group_aggregates_and_partial_flushes_combine():
    s = ps()
    s.on_packet(g(0, 5, bm0=0b11))  # group 0 complete (workers 0+1)
    s.on_packet(g(2, 7))  # worker 2 by fallback
    out = s.on_packet(g(3, 100, bm0=0b11))  # flush of group 1 = {2, 3}: contains the piece {2}
    assert out and out[0].payload.tolist() == [105, 105]  # 5 + 100, the {2} piece replaced
    assert s.stats.pieces_merged == 1


def test_partial_overlap_is_dropped_and_later_resolved():
    L = racks_layout(1, [3], worker_hosts=[1, 2, 3], ps_hosts=[20], mcast_addr=MC)
    s = ps(L)
    def mk(bm, v):
        return FMT.packet(job=1, worker_id=0, fan_in0=3, bitmap0=bm, bitmap1=1,
                          payload=np.full(K, v, dtype=np.int32))

    s.on_packet(mk(0b011, 3))
    assert s.on_packet(mk(0b110, 5)) == [] and s.stats.overlaps == 1
    out = s.on_packet(mk(0b100, 4))
    assert out[0].payload.tolist() == [7, 7]


def test_level1_aggregates_map_to_whole_groups():
    L = JobLayout(job=1, groups=[[0, 1], [2], [3]], two_level=True, group_start_edge=[0, 1, 1],
                  worker_hosts=[10, 11, 12, 13], ps_hosts=[20], mcast_addr=MC)
    s = ps(L)
    p = FMT.packet(job=1, worker_id=3, fan_in0=1, fan_in1=3, bitmap0=1, bitmap1=0b101, agg1=1,
                   payload=np.full(K, 9, dtype=np.int32))
    assert s.on_packet(p) == []
    assert s.jobs[1].open[0].have == 0b1011  # groups 0 and 2 = workers 0, 1, 3
    q = FMT.packet(job=1, worker_id=2, fan_in0=1, fan_in1=3, bitmap0=1, bitmap1=0b010, payload=np.ones(K, np.int32))
    assert s.on_packet(q)[0].payload.tolist() == [10, 10]


def test_answer_retransmissions_after_completion():
    s = ps()
    for w in range(4):
        s.on_packet(g(w, 1))
    uni = s.on_packet(g(2, 1))  # worker 2 lost its parameter packet
    assert len(uni) == 1 and uni[0].dst == 12 and uni[0].payload.tolist() == [4, 4]
    multi = s.on_packet(g(0, 2, bm0=0b11))
    assert multi[0].dst == MC and s.stats.resent_params == 2


def test_shards_split_the_sequence_space():
    L = layout(ps_hosts=[20, 21], n_ps=2)
    s0, s1 = ps(L, 0), ps(L, 1)
    for w in range(4):
        s1.on_packet(g(w, w, seq=1, ps_index=1))
    assert s1.stats.completed == 1 and s1.jobs[1].watermark == 3
    assert s0.on_packet(g(0, 1, seq=1, ps_index=1)) == [] and s0.stats.malformed == 1
    assert s0.jobs[1].watermark == 0


def test_watermark_advances_over_contiguous_completions_only():
    s = ps()
    for seq in (1, 2):
        for w in range(4):
            s.on_packet(g(w, 1, seq=seq))
    assert s.jobs[1].watermark == 0
    for w in range(4):
        out = s.on_packet(g(w, 1, seq=0))
    assert out[0].watermark == 3


def test_retain_prunes_old_results():
    s = ps(retain=2)
    for seq in range(400):
        for w in range(4):
            s.on_packet(g(w, 1, seq=seq))
    assert len(s.jobs[1].done) < 400
    assert s.on_packet(g(0, 1, seq=0)) == []  # long gone: nobody can still wait for it


def test_sgd_update_ships_parameters():
    L = layout()
    upd = SGDUpdate(np.array([1.0, 2.0]), lr=0.5, grad_scale=10.0, param_scale=100.0, k=K)
    s = ps(L, update=upd)
    out = []
    for w in range(4):
        out += s.on_packet(g(w, 10))
    # θ -= 0.5 * 40 / 10 = 2  →  [-1, 0] shipped ×100
    assert out[0].payload.tolist() == [-100, 0]
    assert np.allclose(upd.params[:2], [-1.0, 0.0])


def test_unknown_job_and_parameter_packets_are_rejected():
    s = ps()
    assert s.on_packet(FMT.packet(job=2, fan_in0=1, bitmap0=1)) == [] and s.stats.unknown_job == 1
    assert s.on_packet(FMT.packet(job=1, is_param=1)) == [] and s.stats.malformed == 1
    with pytest.raises(ValueError):
        ParameterServer(FMT, 1, shard=3).add_job(layout())


def test_ps_role_tells_a_stalled_worker_whether_its_job_is_still_installed():
    """The PS role's ``missing`` (a stalled worker's diagnosis, ``engine._stalled``): the
    workers whose contribution has not arrived while the job is installed; once a rank of the
    run failed and tore the job down, ``installed`` is false — so a rank stalling later says
    that, instead of naming every worker as silent."""
    from atp_pipeline.ina.live.nodes import PSNode

    node = PSNode(FMT)
    try:
        workers = [["127.0.0.1", 40000 + w] for w in range(4)]
        node.op_add_job(3, workers, ["127.0.0.1", 41000])
        assert node.op_missing(3, 7) == {"installed": True, "missing": None}  # nothing of seq 7 yet
        node.handle(FMT.encode(FMT.packet(job=3, seq=7, worker_id=1, fan_in0=4, bitmap0=1 << 1,
                                          payload=np.zeros(K, dtype=np.int32))))
        assert node.op_missing(3, 7) == {"installed": True, "missing": 0b1101}
        assert node.op_remove_job(3)
        assert node.op_missing(3, 7) == {"installed": False, "missing": None}
    finally:
        node.close()
