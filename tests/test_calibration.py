"""Calibration of the alpha-beta model (AutoDDL §3.2).

The fit is checked exactly on synthetic data; one small real launch (2 gloo processes, a
few seconds) checks the measurement end to end. Wall-clock quality criteria (held-out
error, Spearman) are the benchmark's (``python -m benchmarks.sbp_calibration``),
not asserted here: the machine is shared and noisy.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import yaml

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning import alphabeta_fit as cal
from atp_pipeline.planning.alphabeta_fit import Sample
from atp_pipeline.planning.bandwidth import dimension_bandwidth
from atp_pipeline.planning.lstsq import spearman
from atp_pipeline.planning.sbp import AlphaBeta, Collective, LinkLevel, MemoryModel, compile_problem, transformer
from atp_pipeline.planning.sbp.schedule import schedule
from atp_pipeline.run import calibrate as run_cal
from atp_pipeline.topology.model import Topology

C = list(Collective)
SIZES = (4096, 65536, 1 << 20, 1 << 22)


def synthetic(ab: AlphaBeta, world: int) -> list:
    """Exact Table 2 times of every layout, collective and size under ``ab``."""
    return [Sample(c, g, s, n, ab.cost(c, g, n, s))
            for g, s in run_cal.default_layouts(world) for c in C for n in SIZES]


def test_default_layouts_tile_the_world() -> None:
    assert run_cal.default_layouts(4) == ((2, 1), (2, 2), (4, 1))
    assert run_cal.layout_groups(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert run_cal.layout_groups(4, 4, 1) == [[0, 1, 2, 3]]


def test_fit_recovers_known_alpha_beta_exactly() -> None:
    ab = AlphaBeta.uniform(alpha=3e-4, beta=2e-9)
    a, b = cal.fit_pair(synthetic(ab, 4))
    assert a == pytest.approx(3e-4, rel=1e-9) and b == pytest.approx(2e-9, rel=1e-9)


def test_fit_per_level_and_per_collective() -> None:
    # two levels: pairs of ranks (fast) inside a world of 8 (slow); reduce-scatter and
    # all-to-all with their own parameters on the outer level
    truth = AlphaBeta((LinkLevel(2, 1e-5, 1e-10),
                       LinkLevel(1 << 62, 2e-4, 1e-9, (("all_to_all", 5e-5, 4e-9),
                                                       ("reduce_scatter", 3e-4, 2e-9)))))
    samples = synthetic(truth, 8)
    levels = cal.level_specs(8, [4, 2], ["node", "pair"])
    assert [(lv.name, lv.count, lv.unit) for lv in levels] == [("node", 4, 8), ("pair", 2, 2)]
    fit = cal.fit_model(samples, levels)
    assert fit.pairs["pair"] == (pytest.approx(1e-5, rel=1e-9), pytest.approx(1e-10, rel=1e-9))
    per = fit.per_collective["node"]
    assert per["all_to_all"] == (pytest.approx(5e-5, rel=1e-9), pytest.approx(4e-9, rel=1e-9))
    assert per["reduce_scatter"] == (pytest.approx(3e-4, rel=1e-9), pytest.approx(2e-9, rel=1e-9))
    assert per["all_gather"] == (pytest.approx(2e-4, rel=1e-9), pytest.approx(1e-9, rel=1e-9))
    model = fit.model()
    assert np.max(cal.relative_errors(model, samples)) < 1e-9
    # per-collective pairs are selected by cross-validation; held-out error is zero
    assert cal.select_per_collective(samples, levels)[0] is True
    h = cal.evaluate_holdout(samples, levels)
    assert h["heldout_points"] == round(0.25 * len(samples)) and h["selected"] == "per_collective"
    assert h["selected_median_rel_error"] < 1e-9


def test_fit_is_non_negative() -> None:
    # times that fall with size would need beta < 0: clamp to the best feasible fit
    s = [Sample(Collective.all_gather, 2, 1, n, t) for n, t in ((1000, 2e-3), (100000, 1e-3))]
    a, b = cal.fit_pair(s)
    assert a >= 0 and b == 0.0


def test_a_collective_without_a_per_byte_cost_takes_the_levels_beta() -> None:
    """An all-reduce whose times do not grow with the message (as on a loaded loopback:
    its 1 MiB faster than its 4 KiB on 4 ranks) fits beta = 0; Eq. 3's bandwidth 1/beta would then be infinite
    and the plan's T_comm ~0. It takes the level's shared beta instead, its alpha refitted."""
    truth = AlphaBeta.uniform(alpha=3e-4, beta=2e-9)
    samples = [s if s.collective is not Collective.all_reduce else  # latency only: beta = 0
               Sample(s.collective, s.size, s.stride, s.nbytes, 5e-4 * cal.design_row(s)[0])
               for s in synthetic(truth, 4)]
    assert cal.fit_pair([s for s in samples if s.collective is Collective.all_reduce]) == (pytest.approx(5e-4), 0.0)
    levels = cal.level_specs(4, [4])
    fit = cal.fit_model(samples, levels)
    level_a, level_b = fit.pairs["process"]
    assert level_b > 0 and fit.level_beta == {"process": ["all_reduce"]}
    ar = [s for s in samples if s.collective is Collective.all_reduce]
    assert fit.per_collective["process"]["all_reduce"] == (pytest.approx(cal.fit_alpha(ar, level_b), rel=1e-12),
                                                           level_b)
    # the relative least squares' alpha with beta fixed: its residuals are orthogonal to the steps column
    a = fit.per_collective["process"]["all_reduce"][0]
    x = np.array([cal.design_row(s)[0] / s.seconds for s in ar])
    r = np.array([1 - (a * cal.design_row(s)[0] + level_b * cal.design_row(s)[1]) / s.seconds for s in ar])
    assert abs(x @ r) < 1e-9
    assert fit.per_collective["process"]["all_gather"] == (pytest.approx(3e-4, rel=1e-9), pytest.approx(2e-9, rel=1e-9))
    fit.use_per_collective = True
    topo = cal.topology_config("t", fit)
    assert topo["levels"][0]["p2p_GBps"] == pytest.approx(1e-9 / level_b, rel=1e-5)


def test_calibrated_topology_feeds_both_planners(tmp_path: Path) -> None:
    truth = AlphaBeta((LinkLevel(1 << 62, 4e-4, 2.5e-9, (("reduce_scatter", 8e-4, 5e-9),)),))
    samples = synthetic(truth, 4)
    res = run_cal.calibrate(run_cal.SweepSpec(world=4), "calib_test", cal.level_specs(4, [4]),
                            samples=samples)
    assert res.heldout_median_error < 1e-9
    path = tmp_path / "topology" / "calib_test.yaml"
    cal.write_topology(res.topology, path)
    topo = Topology.from_config(yaml.safe_load(path.read_text()))
    assert topo.name == "calib_test" and topo.world_size == 4
    # SBP planner: the fitted alpha/beta, per collective
    ab = AlphaBeta.from_topology(topo)
    for c, g, s, n in itertools.product(C, (2, 4), (1,), SIZES):
        assert ab.cost(c, g, n, s) == pytest.approx(truth.cost(c, g, n, s), rel=1e-5)
    # ATP mesh planner: Eq. 3's B' is the fitted all-reduce bandwidth 1/beta
    assert dimension_bandwidth(topo, (1, 4), 2).B_prime_GBps == pytest.approx(0.4, rel=1e-5)
    # the report and plot
    paths = cal.write_report(res, tmp_path, "calib_test")
    assert all(p.exists() for p in paths.values())
    assert len(cal.load_samples(paths["json"])) == len(samples)


def test_calibrated_topology_composes_with_hydra(compose_cfg, tmp_path: Path) -> None:
    res = run_cal.calibrate(run_cal.SweepSpec(world=4), "calib_hydra", cal.level_specs(4, [4]),
                            samples=synthetic(AlphaBeta.uniform(1e-4, 1e-9), 4))
    cal.write_topology(res.topology, tmp_path / "topology" / "calib_hydra.yaml")
    cfg = compose_cfg(f"hydra.searchpath=[file://{tmp_path}]", "topology=calib_hydra")
    topo = Topology.from_config(cfg.topology)
    assert topo.alpha_beta[0].alpha_s == pytest.approx(1e-4)


def test_schedule_is_exactly_what_the_model_charges() -> None:
    ab = AlphaBeta((LinkLevel(2, 1e-4, 2e-9, (("reduce_scatter", 3e-4, 5e-9),)),
                    LinkLevel(1 << 62, 3e-4, 4e-9, (("all_to_all", 1e-5, 1e-8),))))
    layers = transformer(2, 64, 8, 16, 4)
    problem = compile_problem(layers, 4, ab, MemoryModel(act_bytes=4.0), orders="all")
    for a in itertools.islice(itertools.product(*[range(k) for k in problem.sizes]), 0, None, 7):
        calls = schedule(problem, a, layers, 4.0)
        assert sum(c.seconds(ab) for c in calls) == pytest.approx(problem.raw_cost(a), rel=1e-12)


def test_spearman_with_ties() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486832980505138)


def test_bad_input_is_one_line(capsys) -> None:
    assert run_cal.main(["--world", "4", "--levels", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: calibrate: --levels 3 must be positive counts (outermost first) whose "
                   "product is --world 4"]
    with pytest.raises(ConfigError, match="does not tile 4 processes"):
        run_cal.SweepSpec(world=4, layouts=((3, 1),))
    with pytest.raises(ConfigError, match="--sizes"):
        run_cal.parse_sizes("4Q")
    with pytest.raises(ConfigError, match="level 'gpu' is not a level"):
        Topology.from_config({"name": "x", "levels": [{"name": "p", "count": 2, "p2p_GBps": 1,
                                                       "group_GBps": 1}],
                              "alpha_beta": [{"level": "gpu", "alpha_us": 1, "GBps": 1}]})


def test_real_calibration_run_on_two_processes(tmp_path: Path) -> None:
    """One launch of 2 gloo processes, tiny sweep: the pipeline works end to end."""
    spec = run_cal.SweepSpec(world=2, sizes=(4096, 262144), passes=3, warmup=1, batch_ms=2.0,
                             max_batch=4)
    res = run_cal.calibrate(spec, "calib_real", cal.level_specs(2, [2]))
    assert len(res.samples) == 4 * 2
    assert all(s.seconds > 0 and len(s.runs) == 3 for s in res.samples)
    a, b = res.fit.pairs["process"]
    assert a >= 0 and b >= 0 and (a > 0 or b > 0)
    cal.write_topology(res.topology, tmp_path / "calib_real.yaml")
    topo = Topology.from_config(yaml.safe_load((tmp_path / "calib_real.yaml").read_text()))
    assert AlphaBeta.from_topology(topo).cost(Collective.all_reduce, 2, 1 << 20) > 0
    print(f"\nreal 2-process calibration: held-out median error {res.heldout_median_error:.1%}")
