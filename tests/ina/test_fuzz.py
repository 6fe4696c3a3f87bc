"""Must-show: bad input is dropped and counted, never crashes a role.

Truncated, oversized, random and bit-flipped buffers, and well-formed packets of unknown
jobs, are fed to the switch, the parameter server and a worker through their byte entry
points. No call may raise; every input must land in exactly one of the role's outcome
counters; unknown jobs and undecodable buffers must not change any state.
"""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atp_pipeline.ina.job import racks_layout
from atp_pipeline.ina.packet import PacketFormat
from atp_pipeline.ina.ps import ParameterServer
from atp_pipeline.ina.switch import SwitchState, process_bytes
from atp_pipeline.ina.worker import Worker

FMT = PacketFormat()
JOB = 5
LAYOUT = racks_layout(JOB, [3, 2], two_level=True, worker_hosts=[0, 1, 2, 3, 4], ps_hosts=[9], mcast_addr=99)


def _valid_buffers():
    """A handful of genuine packets of every kind, as bytes."""
    out = []
    for w in range(5):
        wk = Worker(FMT, LAYOUT, w, w)
        for p in wk.start(np.arange(62 * 3, dtype=np.int32) * (w + 1), 0, 0.0):
            out.append(FMT.encode(p))
    ps = ParameterServer(FMT, 9)
    ps.add_job(LAYOUT)
    for b in out[:]:
        for q in ps.on_bytes(b):
            q.dst = 0
            out.append(FMT.encode(q))
    return out


VALID = _valid_buffers()


def _roles():
    sw = SwitchState(4, FMT.payload_k, jobs=[JOB])
    ps = ParameterServer(FMT, 9)
    ps.add_job(LAYOUT)
    wk = Worker(FMT, LAYOUT, 0, 0)
    wk.start(np.zeros(62 * 8, dtype=np.int32), 0, 0.0)
    return sw, ps, wk


def _feed(sw, ps, wk, buf):
    process_bytes(sw, FMT, buf)
    ps.on_bytes(buf)
    wk.on_bytes(buf, 1e-6)


def _counts(sw, ps, wk):
    P, W = ps.stats, wk.stats
    return (sw.stats.packets(), P.gradients + P.unknown_job + P.malformed,
            W.acks + W.dup_acks + W.unknown_job + W.malformed)


mutations = st.one_of(
    st.binary(min_size=0, max_size=400).map(lambda b: ("random", b)),
    st.tuples(st.sampled_from(range(len(VALID))), st.integers(0, FMT.atp_bytes - 1)).map(
        lambda t: ("truncated", VALID[t[0]][: t[1]])),
    st.tuples(st.sampled_from(range(len(VALID))), st.binary(min_size=1, max_size=64)).map(
        lambda t: ("oversized", VALID[t[0]] + t[1])),
    st.tuples(st.sampled_from(range(len(VALID))),
              st.lists(st.integers(0, FMT.atp_bytes * 8 - 1), min_size=1, max_size=8)).map(
        lambda t: ("bitflip", bytes(_flip(VALID[t[0]], t[1])))),
)


def _flip(buf, bits):
    b = bytearray(buf)
    for i in bits:
        b[i // 8] ^= 1 << (7 - i % 8)
    return b


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutations, min_size=1, max_size=30))
def test_no_role_crashes_and_every_input_is_counted(inputs):
    sw, ps, wk = _roles()
    before = _counts(sw, ps, wk)
    for _, buf in inputs:
        _feed(sw, ps, wk, buf)
    after = _counts(sw, ps, wk)
    assert [a - b for a, b in zip(after, before)] == [len(inputs)] * 3


@settings(max_examples=100, deadline=None)
@given(st.integers(0, FMT.atp_bytes - 1), st.binary(min_size=1, max_size=40), st.sampled_from(range(len(VALID))))
def test_truncated_and_oversized_are_dropped_without_state_change(cut, extra, i):
    sw, ps, wk = _roles()
    snap = (copy.deepcopy(sw.valid), sw.values.copy(), copy.deepcopy(ps.jobs[JOB].open), wk.n_acked, wk.result.copy())
    for buf in (VALID[i][:cut], VALID[i] + extra):
        _feed(sw, ps, wk, buf)
    assert sw.stats.malformed == 2 and ps.stats.malformed == 2 and wk.stats.malformed == 2
    assert snap[0] == sw.valid and (snap[1] == sw.values).all()
    assert ps.jobs[JOB].open == snap[2] and wk.n_acked == snap[3] and (wk.result == snap[4]).all()


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(range(len(VALID))), st.integers(0, 2**16 - 1).filter(lambda j: j != JOB))
def test_unknown_job_ids_are_dropped_and_counted(i, job):
    sw, ps, wk = _roles()
    p = FMT.decode(VALID[i])
    p.job = job
    buf = FMT.encode(p)
    _, outs = process_bytes(sw, FMT, buf)
    assert outs == () and sw.stats.unknown_job == 1 and not any(sw.valid)
    assert ps.on_bytes(buf) == [] and ps.stats.unknown_job == 1 and not ps.jobs[JOB].open
    assert wk.on_bytes(buf, 0.0) == [] and wk.stats.unknown_job == 1 and wk.n_acked == 0


def test_explicit_malformed_headers():
    """Decodable headers with impossible contents (each named)."""
    base = FMT.decode(VALID[0])
    cases = {
        "wrong app_type": dict(app_type=0x11),
        "fan-in 0": dict(fan_in0=0),
        "fan-in beyond bitmap": dict(fan_in0=40),
        "bitmap outside fan-in": dict(bitmap0=1 << 7),
        "empty bitmap": dict(bitmap0=0),
    }
    for name, fields in cases.items():
        p = base.copy()
        for k, v in fields.items():
            setattr(p, k, v)
        sw, ps, wk = _roles()
        buf = FMT.encode(p)
        _feed(sw, ps, wk, buf)
        assert not any(sw.valid), name
        assert ps.stats.gradients == 0, name
        assert sw.stats.packets() == 1 and ps.stats.malformed + ps.stats.unknown_job == 1, name


def test_switch_rejects_a_multi_child_packet_at_an_aggregation_level():
    """Only the PS may receive multi-contributor level-0 content (a flushed partial
    aggregate); a switch aggregating at level 0 only accepts one child per packet."""
    p = FMT.decode(VALID[0])
    p.bitmap0 = 0b11
    sw, ps, wk = _roles()
    _, outs = process_bytes(sw, FMT, FMT.encode(p))
    assert outs == () and sw.stats.malformed == 1 and not any(sw.valid)
    assert ps.on_bytes(FMT.encode(p)) == [] and ps.stats.pieces_added == 1  # legitimate at the PS


def test_ps_rejects_a_packet_for_another_shard():
    """The switch is job-agnostic (it cannot know a job's shard count); the PS can."""
    p = FMT.decode(VALID[0])
    p.ps_index = 2
    sw, ps, wk = _roles()
    assert ps.on_bytes(FMT.encode(p)) == [] and ps.stats.malformed == 1 and not ps.jobs[JOB].open
