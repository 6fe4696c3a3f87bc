"""Gradient-sync estimates per aggregation mode: exact numbers.

Flat topology: 8 hosts behind one switch, 10 GB/s each, so B′ = 10 GB/s and β = 1e-10 s/B.
E = 6,200 fp32 elements per worker = 100 ATP packets of 62 lanes (319 wire bytes each).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atp_pipeline.errors import ConfigError
from atp_pipeline.ina.packet import PacketFormat
from atp_pipeline.planning.gradsync import GradBucket, estimate, link_params, sbp_buckets
from atp_pipeline.planning.sbp import AlphaBeta, MemoryModel, compile_problem, mlp
from atp_pipeline.topology.model import Topology

FLAT = Topology.from_config({"name": "flat", "levels": [
    {"name": "host", "count": 8, "p2p_GBps": 10, "group_GBps": 10}]})
TWO = Topology.from_config({"name": "two", "levels": [
    {"name": "node", "count": 2, "p2p_GBps": 25, "group_GBps": 25},
    {"name": "gpu", "count": 4, "p2p_GBps": 100, "group_GBps": 300}]})


def test_wire_format_numbers() -> None:
    fmt = PacketFormat()
    assert (fmt.payload_k, fmt.wire_bytes) == (62, 319)


def test_each_mode_exact_without_latency() -> None:
    gs = estimate(FLAT, [GradBucket(8, 1, 6200)], bytes_per_element=4, alpha_s=0.0)
    ring, ps, atp, sml = (gs.mode(m) for m in ("ring", "ps", "atp", "switchml"))
    assert ring.bottleneck_bytes == pytest.approx(2 * 7 / 8 * 6200 * 4)  # 43,400 B
    assert ring.seconds == pytest.approx(43400e-10)
    assert (ps.worker_bytes, ps.bottleneck_bytes) == (24800, 8 * 24800)  # N-to-1
    assert ps.seconds == pytest.approx(198400e-10)
    assert atp.worker_bytes == atp.bottleneck_bytes == 100 * 319  # PS link carries 1/W
    assert atp.seconds == pytest.approx(31900e-10)
    assert sml.worker_bytes == 194 * 180  # ceil(6200/32) SwitchML packets of 180 B
    assert sml.seconds == pytest.approx(34920e-10)
    assert gs.best == "atp"
    assert gs.link_GBps == (10.0,)


def test_latency_terms_and_forwarding_rate() -> None:
    gs = estimate(FLAT, [GradBucket(8, 1, 6200)], 4, alpha_s=1e-6, forwarding_rate=0.5)
    assert gs.mode("ring").seconds == pytest.approx(14e-6 + 43400e-10)  # 2(W-1) steps
    assert gs.mode("ps").seconds == pytest.approx(2e-6 + 198400e-10)
    # half the packets find no aggregator: the PS link carries (1 - f + f W) streams
    assert gs.mode("atp").bottleneck_bytes == pytest.approx(4.5 * 31900)
    assert gs.mode("atp").seconds == pytest.approx(2e-6 + 4.5 * 31900e-10)


def test_two_workers_fp16_ring_wins() -> None:
    # ring moves 2(W-1)/W = 1x the fp16 gradient; INA sends int32 lanes plus headers
    gs = estimate(FLAT, [GradBucket(2, 1, 6200)], 2, alpha_s=0.0)
    assert gs.mode("ring").seconds == pytest.approx(6200 * 2e-10)
    assert gs.mode("atp").seconds == pytest.approx(31900e-10)
    assert gs.best == "ring"


def test_dp_groups_share_the_node_uplink() -> None:
    # dp=2 over tp=4: the 4 data-parallel groups cross the nodes and share each 25 GB/s
    assert link_params(TWO, 2, 4, alpha_s=3e-6) == (3e-6, pytest.approx(6.25))
    assert link_params(TWO, 4, 1)[1] == pytest.approx(300.0)  # inside a node
    assert link_params(TWO, 1, 8)[1] == float("inf")


def test_calibrated_alpha_is_used() -> None:
    topo = Topology.from_config({"name": "cal", "levels": [
        {"name": "host", "count": 4, "p2p_GBps": 2, "group_GBps": 2}],
        "alpha_beta": [{"level": "host", "alpha_us": 50, "GBps": 1.5,
                        "collectives": {"all_reduce": {"alpha_us": 40, "GBps": 2}}}]})
    a, bw = link_params(topo, 4, 1, alpha_s=1e-6)
    assert a == pytest.approx(40e-6) and bw == pytest.approx(2.0)


def test_sbp_buckets_are_replicated_weights() -> None:
    layers = mlp([64, 128, 32], 32)
    problem = compile_problem(layers, 4, AlphaBeta.uniform(1e-6, 1e-9), MemoryModel())
    idx = [next(i for i, s in enumerate(v.strategies) if (s.pb, s.pm, s.pn) == (2, 2, 1))
           for v in problem.vars]
    buckets = sbp_buckets(problem, idx)
    assert [(b.workers, b.stride, b.elements) for b in buckets] == [(2, 2, 64 * 128 / 2),
                                                                     (2, 2, 128 * 32 / 2)]
    gs = estimate(FLAT.restrict(4), buckets, 4, alpha_s=0.0)
    total = sum(b.elements for b in buckets)
    assert gs.mode("ps").bottleneck_bytes == pytest.approx(2 * total * 4)


def test_bad_input_is_one_config_error() -> None:
    with pytest.raises(ConfigError, match="forwarding_rate"):
        estimate(FLAT, [GradBucket(8, 1, 10)], 4, forwarding_rate=2)
    with pytest.raises(ConfigError, match="unknown aggregation mode 'nccl'"):
        estimate(FLAT, [GradBucket(8, 1, 10)], 4, configured="nccl")
    with pytest.raises(ConfigError, match="does not fit topology 'flat'"):
        estimate(FLAT, [GradBucket(16, 1, 10)], 4)


def test_plan_report_shows_gradsync(compose_cfg, tmp_path, capsys) -> None:
    from atp_pipeline.run import run

    cfg = compose_cfg("stage=plan", "mesh=1x1", "mesh.dp=4", "planner.plot=false")
    row = run(cfg, output_dir=tmp_path)
    plan = json.loads((tmp_path / "plan.json").read_text())
    gs = plan["gradient_sync"]
    assert [m["mode"] for m in gs["modes"]] == ["ring", "ps", "atp", "switchml"]
    assert gs["buckets"][0]["workers"] == 4 and gs["configured"] == "ring"
    assert row["gradsync_best"] == gs["best"] == "atp"  # fp32, 4 workers: INA pays off
    assert json.loads((tmp_path / "summary.json").read_text())["gradsync_atp_s"] > 0
    out = capsys.readouterr().out
    assert "data-parallel gradient sync per step" in out and "fastest" in out


def test_packet_geometry_defaults_are_the_protocols() -> None:
    """planning/ gets the wire format as data; its defaults are the protocol's own format."""
    from atp_pipeline.planning.gradsync import PacketGeometry
    from atp_pipeline.run.report import packet_geometry

    assert packet_geometry(62) == PacketGeometry()
    assert packet_geometry(2048).wire_bytes == PacketFormat(2048).wire_bytes


def test_a_calibrated_topology_plans_a_mesh_of_one_device(compose_cfg, tmp_path) -> None:
    """After ``stage=calibrate`` (here: a calibration of ``local`` from tests/data), ``mesh=1x1
    mesh.dp=4`` plans: its tensor-parallel group is one device, no collective to time with the
    fitted alpha-beta, and it does not stop with 'a single device has no collectives'."""
    import shutil

    from atp_pipeline.run import run

    profiles = tmp_path / "profiles"
    profiles.mkdir()
    shutil.copy(Path(__file__).resolve().parent / "data" / "step_calibration.yaml", profiles / "local.yaml")
    cfg = compose_cfg("stage=plan", "mesh=1x1", "mesh.dp=4", "planner.plot=false", f"calibration.dir={profiles}",
                      "calibration.stale_days=0")  # another host's calibration: priced as it is, not re-timed
    run(cfg, output_dir=tmp_path / "run")
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["selected"] == [1, 1] and plan["gradient_sync"]["buckets"][0]["workers"] == 4
    assert plan["candidates"][0]["step"]["step_s"] > 0  # the step model ran on the calibration
