"""Must-show: traffic reduction — 1/W with aggregators, all of it without, and
two-level aggregation of 1,024 workers in 32 racks with 32-bit bitmaps per level."""

from __future__ import annotations

import pytest

from atp_pipeline.ina.sim.atp_job import AtpJobSpec
from atp_pipeline.ina.sim.fabric import FabricConfig
from atp_pipeline.ina.sim.scenario import run

LOSSLESS = dict(buffer_bytes=10**12)  # no queue ever drops: "no loss"


def _worker_bytes(res, job):
    return sum(res.link(f"h{h}->tor{h // res.fabric.cfg.hosts_per_rack}").tx_bytes for h in job.spec.worker_hosts)


def _ps_link_bytes(res, job):
    h = job.spec.ps_hosts[0]
    return res.link(f"tor{h // res.fabric.cfg.hosts_per_rack}->h{h}").tx_bytes


@pytest.mark.parametrize("ps_host", [8, 20])  # PS in the workers' rack / in another rack
def test_ps_link_carries_one_over_w_with_enough_aggregators(ps_host):
    W = 8
    job = AtpJobSpec(job=1, worker_hosts=list(range(W)), ps_hosts=[ps_host], tensor_elems=62 * 300, rounds=2)
    res = run(FabricConfig(n_racks=2, hosts_per_rack=16, n_aggregators=65536, **LOSSLESS), [job])
    j = res.jobs[0]
    assert j.finished and j.mismatches == 0
    wb, pb = _worker_bytes(res, j), _ps_link_bytes(res, j)
    assert j.worker_stats()["retransmits"] == 0
    assert pb * W == wb  # exactly 1/W
    assert sum(sw.stats.collision for sw in res.fabric.switches()) == 0


def test_ps_link_carries_everything_with_zero_aggregators():
    W = 8
    job = AtpJobSpec(job=1, worker_hosts=list(range(W)), ps_hosts=[20], tensor_elems=62 * 300, rounds=2)
    res = run(FabricConfig(n_racks=2, hosts_per_rack=16, n_aggregators=0, **LOSSLESS), [job])
    j = res.jobs[0]
    assert j.finished and j.mismatches == 0
    assert j.worker_stats()["retransmits"] == 0
    assert _ps_link_bytes(res, j) == _worker_bytes(res, j)


def test_two_level_aggregation_of_1024_workers_in_32_racks():
    from benchmarks.ina_experiments import two_level_comparison

    rep = two_level_comparison(tensor_packets=4)
    two, one = rep["two_level"], rep["single_level_at_ps_tor"]
    assert two["exact"] and one["exact"]
    assert two["bitmap_bits"] == 32 and two["groups"] == 32 and two["max_group"] == 32
    # the PS's link carries exactly 1/1024 of the workers' traffic
    assert two["ps_link_bytes"] * 1024 == two["worker_bytes"]
    assert two["ps_link_packets"] * 1024 == two["worker_packets"]
    # inter-rack traffic into the PS's ToR: one packet per rack vs one per worker
    assert two["core_to_ps_tor_packets"] * 32 == one["core_to_ps_tor_packets"]
    assert one["ps_link_packets"] * 1024 == one["worker_packets"]
    assert one["header_bytes"] > two["header_bytes"]  # a 1,024-bit bitmap per packet
    assert two["leaked_aggregators"] == 0 and one["leaked_aggregators"] == 0
