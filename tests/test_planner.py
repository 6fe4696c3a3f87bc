"""ATP's planner: Eq. 2-4 on the paper's worked examples, §5.3, §5.4 and Table 2."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atp_pipeline.config.schema import (
    DType,
    MeshConfig,
    ModelConfig,
    PlannerConfig,
    Routing,
)
from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.bandwidth import dimension_bandwidth, rabenseifner
from atp_pipeline.planning.cost import eq2_terms
from atp_pipeline.planning.search import candidate_meshes, evaluate, make_plan
from atp_pipeline.planning.shape import ModelShape
from atp_pipeline.run.resolve import model_shape as model_summary
from atp_pipeline.run.resolve import plan_from_config
from atp_pipeline.topology.builders import ring_matrix, switched, torus2d
from atp_pipeline.topology.model import Topology

#: the paper's settings: one data-parallel replica over every device, no chunked overlap (ATP §5):
#: the whole-layout search then chooses the 2D mesh alone, as §3.5 does
PAPER = ("mesh.dp=1", "overlap=chunk1")


def summary(hidden=2048, heads=16, layers=1, b=4, s=2048, dtype=DType.fp16) -> ModelShape:
    return ModelShape.of(ModelConfig(name="x", hidden=hidden, heads=heads, layers=layers,
                                       seq_len=s, batch_size=b, dtype=dtype))


# ---------------------------------------------------------------- §3.5 worked example
def test_fig7a_mesh_8x2_worked_example(compose_cfg):
    plan = plan_from_config(compose_cfg("topology=fig7a", "model=m1", *PAPER))
    c = plan.candidate((8, 2))
    assert c.dim1.B_prime_GBps == 12.5
    assert c.dim2.B_prime_GBps == 200.0
    # dim 1 crosses the node level (2 groups share a node's 25 GB/s) and the GPU level
    # (two GPUs of a node, P2P-limited); dim 2 only the GPU level, P2P-limited to 200.
    node, gpu = c.dim1.crossings
    assert (node.level, node.groups_sharing, node.GBps, node.limited_by) == ("node", 2, 12.5, "group")
    assert (gpu.level, gpu.units_per_group, gpu.GBps, gpu.limited_by) == ("gpu", 2, 200.0, "p2p")
    (only,) = c.dim2.crossings
    assert (only.level, only.GBps, only.limited_by) == ("gpu", 200.0, "p2p")
    # Eq. 4
    assert c.dim1.B_GBps == pytest.approx(8 / 14 * 12.5)
    assert c.dim2.B_GBps == pytest.approx(200.0)


def test_eq4_rabenseifner():
    assert rabenseifner(2, 10.0) == 10.0
    assert rabenseifner(4, 6.0) == 4.0
    assert rabenseifner(8, 14.0) == 8.0
    with pytest.raises(ValueError):
        rabenseifner(1, 1.0)


def test_eq2_by_hand():
    """A 4x2 mesh on IC3-like uniform bandwidth: every term checked against Eq. 2."""
    topo = Topology.from_config(switched(8, 600))
    m = summary(layers=2)
    c = evaluate(topo, m, (4, 2))
    B1, B2 = 4 / 6 * 600e9, 600e9
    h, L, b, s, q = 2048, 2, 4, 2048, 2
    expected = 2 * L * b * s * (7 * h / (4 * B2) + 2 * h / (2 * B1)) * q
    assert c.t_comm_s == pytest.approx(expected, rel=1e-12)
    ops = {t.term.op: t for t in c.terms}
    assert ops["f1"].term.elements_per_token == Fraction(3 * h, 4) and ops["f1"].term.dim == 2
    assert ops["f2"].term.elements_per_token == Fraction(h, 2) and ops["f2"].term.dim == 1
    assert ops["f3"].term.elements_per_token == Fraction(4 * h, 4)
    assert sum(t.seconds for t in c.terms) == pytest.approx(c.t_comm_s)


def test_megatron_is_four_allreduces_of_bsh():
    """On (N,1) the dimension-2 terms vanish: 4*L*b*s*h*q / B1 (§2.3)."""
    topo = Topology.from_config(switched(8, 300))
    m = summary(layers=3)
    c = evaluate(topo, m, (8, 1))
    assert [t.term.op for t in c.terms] == ["f2", "f4"]
    assert c.dim2.B_GBps is None and c.dim2.B_prime_GBps is None
    assert c.t_comm_s == pytest.approx(4 * 3 * 4 * 2048 * 2048 * 2 / (8 / 14 * 300e9), rel=1e-12)
    assert [t.op for t in eq2_terms(64, (1, 8))] == ["f1", "f3"]


# ---------------------------------------------------------------- §5.3 calibrated IC1
def test_ic1_calibrated_2x4_is_46_percent_below_8x1(compose_cfg):
    plan = plan_from_config(compose_cfg("topology=ic1", "model=m3", *PAPER))
    t24 = plan.candidate((2, 4)).t_comm_s
    t81 = plan.candidate((8, 1)).t_comm_s
    assert 1 - t24 / t81 == pytest.approx(0.46, abs=0.01)
    assert plan.candidate((2, 4)).dim1.B_GBps == 1.20 and plan.candidate((2, 4)).dim2.B_GBps == 4.95
    assert plan.candidate((8, 1)).dim1.B_GBps == 0.97
    assert plan.selected == (2, 4)
    assert plan.candidate((4, 2)).source == "model"
    assert any("listed but not selected" in n for n in plan.notes)


def test_select_uncalibrated_lets_the_matrix_estimate_compete(compose_cfg):
    plan = plan_from_config(compose_cfg("topology=ic1", "model=m3", "planner.select_uncalibrated=true", *PAPER))
    best = min(plan.candidates, key=lambda c: c.t_comm_s)
    assert plan.selected == best.mesh


# ---------------------------------------------------------------- §5.4 IC5, IC6, Figure 12
def _sizes():
    return [2**k for k in range(2, 11)]  # N = 4 ... 1024


def _ic5(n):
    return Topology.from_config(switched(n, 900, name="ic5"))


def _ic6(n):
    k = int(math.log2(n))
    return Topology.from_config(torus2d(2 ** (k // 2), n // 2 ** (k // 2), 25, name="ic6"))


@pytest.mark.parametrize("build", [_ic5, _ic6], ids=["ic5", "ic6"])
def test_ic5_ic6_tcomm_over_delta_is_the_closed_form(build):
    m = summary(hidden=12288, heads=96)
    opt_curve, atp1_curve = [], []
    for n in _sizes():
        topo = build(n)
        gbw = topo.levels[-1].group_GBps
        delta = 2 * m.layers * m.batch_size * m.seq_len * m.hidden * m.bytes_per_element / (gbw * 1e9)
        plan = make_plan(topo, m, MeshConfig(), PlannerConfig(require_divisible=False))
        for c in plan.candidates:
            d1, d2 = c.mesh
            assert c.dim1.B_prime_GBps in (None, gbw) and c.dim2.B_prime_GBps in (None, gbw)
            assert c.t_comm_s / delta == pytest.approx((14 * d2 + 4 * d1 - 18) / (d1 * d2), rel=1e-12)
        opt_curve.append(plan.candidate(plan.selected).t_comm_s / delta)
        atp1_curve.append(plan.megatron.t_comm_s / delta)
        if n >= 8:
            assert plan.selected != (n, 1), f"N={n}: ATP should leave (N,1)"
    # Figure 12: ATP-1 rises with N; ATP-OPT falls once it leaves (N,1) (3.0 at N=4 on
    # (4,1), 3.25 at N=8 on (4,2), then down to (14*16+4*64-18)/1024 = 0.451 at N=1024).
    assert atp1_curve == sorted(atp1_curve) and atp1_curve[-1] > atp1_curve[0]
    assert opt_curve[1:] == sorted(opt_curve[1:], reverse=True)
    assert opt_curve[-1] == pytest.approx(462 / 1024)


@pytest.mark.parametrize("name", ["ic5", "ic6"])
def test_ic5_ic6_presets_satisfy_the_closed_form(compose_cfg, name):
    plan = plan_from_config(compose_cfg(f"topology={name}", "model=m4", "planner.require_divisible=false", *PAPER))
    gbw = plan.topology.levels[-1].group_GBps
    m = plan.model
    delta = 2 * m.layers * m.batch_size * m.seq_len * m.hidden * 2 / (gbw * 1e9)
    for c in plan.candidates:
        d1, d2 = c.mesh
        assert c.t_comm_s / delta == pytest.approx((14 * d2 + 4 * d1 - 18) / (d1 * d2), rel=1e-12)


# ---------------------------------------------------------------- Table 2
@pytest.mark.parametrize("model, tflops, params", [
    ("m1", 2.625, 0.048), ("m2", 9.75, 0.192), ("m3", 37.5, 0.768), ("m4", 83.25, 1.728)])
def test_flops_per_layer_match_table2(compose_cfg, model, tflops, params):
    s = model_summary(compose_cfg(f"model={model}"))
    assert s.flops_per_layer == tflops * 2**40  # exact: Table 2 counts 2^40 FLOPs per TFLOP
    assert round(s.weights_per_layer / (1000 * 2**20), 3) == params
    assert s.params_per_layer == 12 * s.hidden**2 + 13 * s.hidden


def test_plan_json_has_the_documented_fields(compose_cfg):
    plan = plan_from_config(compose_cfg("topology=fig7a", "model=m1", *PAPER))
    d = plan.to_dict()
    assert d["topology"]["name"] == "fig7a" and d["world_size"] == 16
    assert d["model"]["flops_per_layer"] == 2.625 * 2**40
    assert d["selected"] == list(plan.selected)
    for c in d["candidates"]:
        assert set(c) >= {"mesh", "B1_prime_GBps", "B2_prime_GBps", "B1_GBps", "B2_GBps", "t_comm_s"}
    megatron = next(c for c in d["candidates"] if c["mesh"] == [16, 1])
    assert megatron["B2_prime_GBps"] is None and megatron["B2_GBps"] is None


# ---------------------------------------------------------------- selection rules
def test_strategies_fixed_megatron_and_bad_meshes(compose_cfg):
    assert plan_from_config(compose_cfg("topology=ic3", "model=m1", "mesh=megatron", *PAPER)).selected == (8, 1)
    assert plan_from_config(compose_cfg("topology=ic3", "model=m1", "mesh=2x4")).selected == (2, 4)
    with pytest.raises(ConfigError, match=r"^mesh 3x3 needs 9 devices but topology 'ic1' has 8$"):
        plan_from_config(compose_cfg("topology=ic1", "model=m1", "mesh=3x3"))
    # tiny has 8 heads: a fixed mesh of 16 devices cannot split them
    with pytest.raises(ConfigError, match="8 heads of model 'tiny' do not split over d1\\*d2 = 4x4"):
        plan_from_config(compose_cfg("topology=fig7a", "model=tiny", "mesh=4x4"))
    # one replica of 16 devices cannot split them; two replicas of 8 can (the whole-layout search)
    with pytest.raises(ConfigError, match="no 2D mesh of 16 devices splits the 8 heads"):
        plan_from_config(compose_cfg("topology=fig7a", "model=tiny", "mesh.dp=1"))
    assert plan_from_config(compose_cfg("topology=fig7a", "model=tiny")).whole_layout.dp >= 2


def test_auto_selects_the_cheapest_feasible_candidate(compose_cfg):
    for topology in ("ic2", "ic3", "ic4", "fig7a", "fig7b", "local"):
        # no calibration: a stage=calibrate file in the working tree (outputs/calibration/profiles/local.yaml)
        # would have 'local' select by its predicted step instead of T_comm
        plan = plan_from_config(compose_cfg(f"topology={topology}", "model=m3", "calibration.use=false", *PAPER))
        best = min((c for c in plan.candidates if c.infeasible is None), key=lambda c: c.t_comm_s)
        assert plan.selected == best.mesh


def test_candidates_are_every_factorization():
    assert candidate_meshes(8) == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert candidate_meshes(12) == [(12, 1), (6, 2), (4, 3), (3, 4), (2, 6), (1, 12)]
    assert len(candidate_meshes(65536)) == 17


# ---------------------------------------------------------------- Eq. 3 against a brute force
def reference_b_prime(topo: Topology, mesh, dim):
    """Eq. 3 as documented in planning/bandwidth.py, by plain loops over every group."""
    d1, d2 = mesh
    n = topo.world_size
    size = d1 if dim == 1 else d2
    if size == 1:
        return None
    groups = defaultdict(list)
    for r in range(n):
        groups[r // d2 if dim == 2 else r % d2].append(r)
    sizes = topo.unit_sizes
    best = math.inf
    for li, level in enumerate(topo.levels):
        unit_size, parent_size = sizes[li + 1], sizes[li]
        touched = defaultdict(set)
        for g, ranks in groups.items():
            for r in ranks:
                touched[(g, r // parent_size)].add(r // unit_size)
        crossing = {k: v for k, v in touched.items() if len(v) >= 2}
        share = Counter(u for units in crossing.values() for u in units)
        m = level.p2p_matrix()
        for units in crossing.values():
            for u in units:
                cap = math.inf if level.routing == Routing.routed else sum(
                    m[u % level.count][v % level.count] for v in units if v != u)
                best = min(best, min(level.group_GBps, cap) / share[u])
    return best


@st.composite
def hierarchies(draw):
    n_levels = draw(st.integers(1, 3))
    levels = []
    for i in range(n_levels):
        count = draw(st.integers(1, 4))
        routed = draw(st.booleans())
        if routed and count > 2:
            p2p = ring_matrix(count, draw(st.sampled_from([5.0, 25.0])))
        elif draw(st.booleans()) and count > 1:
            p2p = [[0.0 if a == b else float(draw(st.integers(1, 9))) for b in range(count)]
                   for a in range(count)]
        else:
            p2p = float(draw(st.integers(1, 9)))
        row_sums = ([sum(r) for r in p2p] if isinstance(p2p, list) else [p2p * (count - 1)])
        cap = min(row_sums) if count > 1 else 10.0
        group = float(draw(st.integers(1, max(1, int(cap))))) if cap >= 1 else cap
        levels.append({"name": f"l{i}", "count": count, "p2p_GBps": p2p, "group_GBps": group,
                       "routing": "routed" if routed and count > 1 else "direct"})
    return Topology.from_config({"name": "h", "levels": levels})


@settings(max_examples=150, deadline=None)
@given(hierarchies())
def test_eq3_matches_brute_force_on_any_hierarchy(topo):
    for mesh in candidate_meshes(topo.world_size):
        for dim in (1, 2):
            got = dimension_bandwidth(topo, mesh, dim).B_prime_GBps
            want = reference_b_prime(topo, mesh, dim)
            assert (got is None) == (want is None)
            if want is not None:
                assert got == pytest.approx(want, rel=1e-12)


def test_unaligned_mesh_takes_the_slowest_group():
    """2 nodes x 3 GPUs with d2 = 2: the block {2, 3} straddles the nodes."""
    topo = Topology.from_config({"name": "u", "levels": [
        {"name": "node", "count": 2, "p2p_GBps": 10.0, "group_GBps": 10.0},
        {"name": "gpu", "count": 3, "p2p_GBps": 100.0, "group_GBps": 200.0}]})
    d = dimension_bandwidth(topo, (3, 2), 2)
    assert [c.level for c in d.crossings] == ["node", "gpu"]
    assert d.B_prime_GBps == 10.0


def test_plan_png_title_fits_and_report_sizes_read_in_human_units():
    """plan.png's title wraps to its axes instead of running off the figure; memory reads in
    units that show a small model's bytes (not "~0.0 GB")."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from atp_pipeline.figures import fit_titles
    from atp_pipeline.planning.fmt import human_bytes

    fig = Figure(figsize=(4.0, 3.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title("local, tiny: selected 4x1 green, (N,1) orange, hatched = calibrated " * 2, fontsize=9)
    fit_titles(fig)
    renderer = fig.canvas.get_renderer()
    assert "\n" in ax.get_title()
    assert ax.title.get_window_extent(renderer).width <= ax.get_window_extent(renderer).width
    assert fig.get_tightbbox(renderer).width <= fig.bbox.width / fig.dpi + 1e-6  # nothing outside the figure
    assert [human_bytes(x) for x in (812, 3_400, 804_400, 1.2e6, 80e9)] == \
        ["812 B", "3.4 kB", "804.4 kB", "1.2 MB", "80.0 GB"]


def test_a_plan_says_what_its_communication_estimate_omits():
    """A layout the runtime cost model does not count (a per-head output gate) is named in the
    plan's notes instead of being mispredicted silently."""
    from dataclasses import replace

    m = summary(hidden=256, heads=16)
    assert not any("omits" in n for n in make_plan(_ic6(4), m, MeshConfig(), PlannerConfig()).notes)
    plan = make_plan(_ic6(4), replace(m, unmodelled="per-head output gates"), MeshConfig(), PlannerConfig())
    assert any("omits its per-head output gates" in n for n in plan.notes), plan.notes


# ---------------------------------------------------------------- per-replica pricing (issue 63)
@pytest.mark.parametrize("dp", [1, 2, 8, 32])
def test_tp_comm_is_priced_on_the_replica_batch(compose_cfg, dp):
    """The global batch is kept (per replica: batch / dp): a replica's tensor-parallel
    communication at dp replicas is the one replica's of the same local batch at dp=1."""
    def t_comm(*overrides):
        return plan_from_config(compose_cfg("topology=ic5", "model=llama3_8b", "model.seq_len=2048", "mesh=4x2",
                                            *overrides)).predicted_comm_s

    one = t_comm("mesh.dp=1", "model.batch_size=1", "trainer.devices=8")
    many = t_comm(f"mesh.dp={dp}", f"model.batch_size={dp}")
    assert one == pytest.approx(3.281e-3, rel=1e-3)
    assert many == pytest.approx(one, rel=0.01)


# ---------------------------------------------------------------- the whole-layout search (issue 63)
PAPER_MESHES = {"ic1": (2, 4), "ic2": (4, 2), "ic3": (4, 2), "ic4": (4, 4)}  # before the whole-layout search


@pytest.mark.parametrize("objective", ["step", "comm"])
def test_paper_settings_select_the_meshes_they_did(compose_cfg, objective):
    """ATP-TP Table 2's models on IC1-IC4 with one replica and no chunks: the mesh the 2D search
    selected before dp, FSDP, chunks and aggregation were searched with it."""
    for topology, mesh in PAPER_MESHES.items():
        for model in ("m1", "m2", "m3", "m4"):
            plan = plan_from_config(compose_cfg(f"topology={topology}", f"model={model}", "calibration.use=false",
                                                f"planner.objective={objective}", *PAPER))
            assert plan.selected == mesh, (topology, model)


def _layouts(compose_cfg, *overrides):
    return plan_from_config(compose_cfg("topology=ic5", "model=llama3_8b", "model.batch_size=32", *overrides))


def test_ic5_llama3_8b_runs_as_data_parallel_replicas_of_a_tensor_parallel_mesh(compose_cfg):
    plan = _layouts(compose_cfg)
    lay = plan.whole_layout
    assert lay.devices == 256 and lay.dp > 1 and plan.topology.world_size == 256 // lay.dp
    assert plan.layouts[0].lost == "chosen" and plan.layouts[0].layout == lay
    lost = {c.lost for c in plan.layouts}
    assert {"chosen", "slower", "divisibility"} <= lost
    seen = {(c.layout.fsdp, c.layout.chunks) for c in plan.layouts}
    assert {(False, 1), (True, 1), (False, 2), (True, 4)} <= seen
    priced = [c for c in plan.layouts if c.lost in ("chosen", "slower")]
    assert all(c.step is not None and c.memory_bytes <= 80e9 for c in priced)
    assert min(c.step.step_s for c in priced) == plan.layouts[0].step.step_s
    # a replica's step is its mesh's step under the chosen setting (the TP table beside the layouts)
    assert plan.candidate(plan.selected).step.step_s == plan.layouts[0].step.step_s
    d = plan.to_dict()
    assert d["layout"] == lay.to_dict() and len(d["layout_search"]["candidates"]) == len(plan.layouts)
    assert d["layout_search"]["lost"]["chosen"] == 1


@pytest.mark.parametrize("override, holds", [
    ("mesh=4x2", lambda c: c.layout.mesh == (4, 2)),
    ("mesh.dp=16", lambda c: c.layout.dp == 16),
    ("mesh.fsdp=true", lambda c: c.layout.fsdp),
    ("overlap=chunk2", lambda c: c.layout.chunks == 2),
    ("aggregation=ring", lambda c: c.layout.aggregation == "ring"),
    ("mesh=megatron", lambda c: c.layout.mesh[1] == 1),
])
def test_a_fixed_field_constrains_the_search(compose_cfg, override, holds):
    plan = _layouts(compose_cfg, override, "topology.levels.0.aggregates=true")
    assert plan.layouts and all(holds(c) for c in plan.layouts)
    assert holds(plan.layouts[0]) and plan.layouts[0].lost == "chosen"


def test_aggregating_switches_add_the_in_network_modes(compose_cfg):
    plain = _layouts(compose_cfg, "mesh.dp=32", "overlap=chunk1", "mesh.fsdp=false")
    assert {c.layout.aggregation for c in plain.layouts} == {"ring"}
    agg = _layouts(compose_cfg, "mesh.dp=32", "overlap=chunk1", "mesh.fsdp=false", "topology.levels.0.aggregates=true")
    assert {c.layout.aggregation for c in agg.layouts} == {"ring", "atp", "ps", "switchml"}
    # the gradient sync of each mode as gradsync prices it, added to one replica's step
    by = {(c.layout.mesh, c.layout.aggregation): c for c in agg.layouts if c.step is not None}
    ring, ps = by[((4, 2), "ring")], by[((4, 2), "ps")]
    assert ps.step.step_s - ring.step.step_s == pytest.approx(ps.sync_s - ring.sync_s, rel=1e-9)
    assert ps.lost == "slower"


def test_fsdp_is_priced_as_two_all_gathers_and_a_reduce_scatter():
    from atp_pipeline.planning.gradsync import dp_bucket, estimate, link_params
    from atp_pipeline.planning.layout import fsdp_seconds

    world = Topology.from_config(switched(64, 100))
    params, dp, tp, q = 1e9, 8, 8, 2
    a, bw = link_params(world, dp, tp)
    one = a * (dp - 1) + (dp - 1) / dp * params * q / (bw * 1e9)
    assert fsdp_seconds(world, params, dp, tp, q) == pytest.approx(3 * one, rel=1e-12)
    ring = estimate(world, [dp_bucket(params, dp, tp)], q).mode("ring").seconds  # reduce-scatter + all-gather
    assert fsdp_seconds(world, params, dp, tp, q) == pytest.approx(1.5 * ring, rel=1e-9)


def test_a_dp_that_does_not_divide_the_batch_is_named(compose_cfg):
    plan = _layouts(compose_cfg, "model.batch_size=24")
    named = [c for c in plan.layouts if c.layout.dp == 16]
    assert named and all(c.lost == "divisibility" and c.why == "global batch 24 does not split over dp=16"
                         for c in named)
    assert plan.whole_layout.dp in (8,)  # 24 splits over 8 of the divisors of 256 that leave <= 32-way TP
