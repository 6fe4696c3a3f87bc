"""Quantization (§5.4): the headroom scheme never overflows; error bound; saturation flagged."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from atp_pipeline.ina.job import racks_layout
from atp_pipeline.ina.packet import PacketFormat
from atp_pipeline.ina.ps import ParameterServer
from atp_pipeline.ina.quant import (
    INT32_MAX,
    aggregate_error_bound,
    dequantize,
    lane_limit,
    quantize,
    quantize_mask,
    safe_scale,
)
from atp_pipeline.ina.switch import SwitchState, process
from atp_pipeline.ina.worker import Worker


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1024), st.lists(st.floats(-1e12, 1e12, allow_nan=False), min_size=1, max_size=50),
       st.floats(1e-3, 1e9))
def test_any_sum_of_w_quantized_lanes_fits_int32(W, xs, scale):
    q, _ = quantize(np.array(xs), scale, W)
    assert q.dtype == np.int32
    assert np.abs(q.astype(np.int64)).max() <= lane_limit(W)
    assert W * lane_limit(W) <= INT32_MAX  # worst-case aggregate of W lanes


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.floats(1e-6, 1e6), st.integers(0, 2**32 - 1))
def test_error_bound_with_safe_scale(W, M, seed):
    rng = np.random.default_rng(seed)
    xs = rng.uniform(-M, M, size=(W, 40))
    s = safe_scale(M, W)
    assert M * s <= lane_limit(W) < 2 * M * s + 1
    qs = []
    for x in xs:
        q, sat = quantize(x, s, W)
        assert sat == 0  # safe_scale makes saturation impossible
        assert np.all(np.abs(x - dequantize(q, s)) <= 0.5 / s * (1 + 1e-12))
        qs.append(q.astype(np.int64))
    total = np.sum(qs, axis=0)
    assert np.abs(total).max() <= INT32_MAX
    assert np.all(np.abs(xs.sum(axis=0) - dequantize(total, s)) <= aggregate_error_bound(W, s) * (1 + 1e-9))


def test_saturation_is_counted_and_never_wraps():
    q, sat = quantize(np.array([1e30, -1e30, np.nan, np.inf, 1.0]), 1e6, 8)
    assert sat == 4
    assert q.tolist()[:2] == [lane_limit(8), -lane_limit(8)] and q[2] == 0 and q[4] == 1_000_000
    _, mask = quantize_mask(np.array([0.0, 1e30]), 1.0, 2)
    assert mask.tolist() == [False, True]


def test_overflow_flag_travels_switch_ps_and_reaches_every_worker():
    fmt = PacketFormat(payload_k=4)
    L = racks_layout(3, [3], worker_hosts=[0, 1, 2], ps_hosts=[5], mcast_addr=77)
    sw = SwitchState(16, 4, jobs=[3])
    ps = ParameterServer(fmt, 5)
    ps.add_job(L)
    workers = [Worker(fmt, L, w, w) for w in range(3)]
    grads = [np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]) for _ in range(3)]
    grads[1][5] = 1e30  # one lane of one worker saturates (second packet)
    params = []
    for w, g in zip(workers, grads):
        for p in w.start_float(g, 1e6, 0, 0.0):
            for q in process(sw, p)[1]:
                params += ps.on_packet(q)
    assert len(params) == 2
    for w in workers:
        for p in params:
            w.on_packet(p, 1e-6)
        assert w.done and w.overflow_seqs == [1]  # flagged on the packet with the clamped lane
        assert w.result_tensor[:4].tolist() == [3_000_000, 6_000_000, 9_000_000, 12_000_000]
