"""The step-time model: its collectives are the runtime cost model's, its overlap
is the runtime's, objective=comm keeps today's selections, calibration round trip, report."""

from __future__ import annotations

import dataclasses
import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf
from rich.console import Console

from atp_pipeline.config.schema import CostModel, MeshConfig, ModelConfig, PlannerConfig
from atp_pipeline.errors import ConfigError
from atp_pipeline.planning import comm_clock as cc
from atp_pipeline.planning import compute_profile as cp
from atp_pipeline.planning import kernels as kn
from atp_pipeline.planning import step_program as sp
from atp_pipeline.planning import steptime as st
from atp_pipeline.planning.cost import ALL_REDUCE, CommTerm, comm_terms, predicted_elements
from atp_pipeline.planning.search import make_plan
from atp_pipeline.planning.shape import ModelShape
from atp_pipeline.topology.model import Topology

from .conftest import CONF, run_train

DATA = Path(__file__).resolve().parent / "data"
GPT = ModelShape(name="gpt", hidden=64, heads=8, layers=2, seq_len=16, vocab_size=256, ffn=256, batch_size=4)
LLAMA = ModelShape(name="llama", hidden=64, heads=8, kv_heads=2, layers=2, seq_len=16, vocab_size=256, ffn=96,
                   gated=True, norm="rmsnorm", bias=False, position="rotary", norm_layout="gathered",
                   head_layout="gathered", qkv_fused=False,
                   batch_size=4)
TIED_OPT = ModelShape(name="opt", hidden=64, heads=8, layers=1, seq_len=16, vocab_size=256, ffn=256,
                      tied_embeddings=True, norm_layout="gathered", qkv_fused=True, gathered_embeddings=1,
                      batch_size=2)


def _flat(us: float) -> cp.ComputeProfile:
    """Every kernel ``us`` microseconds, whatever its size."""
    fit = cp.KindFit(us * 1e-6, 0.0)
    return cp.ComputeProfile("flat", "test", {k: fit for k in kn.KINDS}, peak_flops=1e9)


@pytest.mark.parametrize("shape, meshes, chunks", [
    (GPT, [(8, 1), (4, 2), (2, 4), (1, 8), (2, 2)], [1, 2, 4]),
    (LLAMA, [(4, 1), (2, 2), (1, 4), (2, 1), (8, 1)], [1]),  # kv heads scattered, picked, gathered
    (TIED_OPT, [(4, 1), (2, 2), (1, 4)], [1]),
    # heads split by vocabulary over d1 x d2 (model.vocab_parallel_loss), untied and tied; a head run whole
    (dataclasses.replace(LLAMA, head_layout="vocab_split"), [(4, 1), (2, 2), (1, 4)], [1, 2]),
    (dataclasses.replace(TIED_OPT, head_layout="vocab_split"), [(4, 1), (2, 2), (1, 4)], [1]),
    (dataclasses.replace(LLAMA, head_layout="whole"), [(4, 1), (2, 2), (1, 4)], [1]),
    (dataclasses.replace(TIED_OPT, head_layout="whole"), [(2, 2)], [1]),
])
def test_schedule_sends_exactly_the_runtime_cost_models_collectives(shape, meshes, chunks):
    for mesh in meshes:
        terms = comm_terms(CostModel.runtime, shape, mesh)
        want = predicted_elements(terms, shape.tokens_per_step, shape.layers)
        for c in chunks:
            prog, _ = sp.build_program(shape, mesh, shape.batch_size, c)
            assert sp.placed_elements(prog) == want, (shape.name, mesh, c)


def test_a_term_the_schedule_does_not_place_is_an_error():
    extra = CommTerm("f9", "a collective the runtime does not send", ALL_REDUCE, 1, Fraction(1), 1, "fwd")
    terms = comm_terms(CostModel.runtime, GPT, (2, 2)) + [extra]
    with pytest.raises(ValueError, match="not placed exactly once: f9/fwd/d1"):
        sp.build_program(GPT, (2, 2), GPT.batch_size, 1, terms)


def test_backward_all_reduce_hides_behind_the_weight_gradient_gemm():
    """§4.2: dgrad GEMM, all-reduce launched, wgrad GEMM, join — exposed only past the wgrad."""
    topo = Topology.from_config({"name": "t", "levels": [{"name": "p", "count": 2, "p2p_GBps": 1,
                                                          "group_GBps": 1}]})
    term = CommTerm("f1", "x", ALL_REDUCE, 1, Fraction(1), 1, "bwd")
    gemm = kn.Kernel(kn.GEMM, (10, 10, 10))
    # 4000 B (4 us at 1 GB/s) hides behind the 5-us wgrad; 32000 B (32 us) shows 27 us of it
    for elements, want in ((1000, 10e-6), (8000, 5e-6 + 32e-6)):
        tl = st._Timeline(cc.CommClock(topo, (2, 1), 4), _flat(5.0), 4)
        tl.run([("k", gemm), ("linear", sp.Coll(term, Fraction(1), elements)), ("k", gemm), ("join",)], [])
        assert tl.now == pytest.approx(want)
        assert tl.compute == pytest.approx(10e-6)


def test_chunks_hide_forward_collectives_behind_the_next_chunks_compute():
    """§4.1: with compute free, the step is the collectives one after another on their links;
    with communication free, it is the compute; chunks hide part of a mixed step."""
    topo = Topology.from_config(OmegaConf.load(CONF / "topology" / "local.yaml"))
    free = cp.ComputeProfile("free", "test", {k: cp.KindFit(0.0, 0.0) for k in kn.KINDS})
    one = st.estimate_step(topo, GPT, (2, 2), st.StepSetting(chunks=1), free)
    assert one.step_s == pytest.approx(one.total_comm_s) and one.compute_s == 0
    fast = topo.to_dict()
    fast["levels"][0].update(p2p_GBps=1e12, group_GBps=1e12)
    quick = st.estimate_step(Topology.from_config(fast), GPT, (2, 2), st.StepSetting(chunks=1), _flat(10.0))
    assert quick.step_s == pytest.approx(quick.compute_s, rel=1e-6)
    prog, _ = sp.build_program(GPT, (2, 2), GPT.batch_size, 1)
    kernels = sum(1 for i in sp.all_items(prog) if i[0] == "k")
    assert quick.compute_s == pytest.approx(kernels * 10e-6)
    c1 = st.estimate_step(topo, GPT, (2, 2), st.StepSetting(chunks=1), _flat(200.0))
    c2 = st.estimate_step(topo, GPT, (2, 2), st.StepSetting(chunks=2), _flat(100.0))
    # block kernels at half the time each in twice the chunks, the same bytes in twice the
    # collectives: chunking hides a larger share of the communication
    assert c2.exposed_comm_s < c2.total_comm_s and c1.exposed_comm_s < c1.total_comm_s
    assert c2.exposed_comm_s / c2.total_comm_s < c1.exposed_comm_s / c1.total_comm_s


# today's selections (objective=comm = Eq. 4, the paper's), for every preset and cost model
TODAY = {
    "fig7a": {"m1": "4x4", "m2": "4x4", "m3": "4x4", "m4": "4x4"},
    "fig7b": {"m1": "8x2", "m2": "8x2", "m3": "8x2", "m4": "8x2"},
    "ic1": {m: "2x4" for m in ("m1", "m2", "m3", "m4", "tiny", "small")},
    "ic2": {m: "4x2" for m in ("m1", "m2", "m3", "m4", "tiny", "small")},
    "ic3": {m: "4x2" for m in ("m1", "m2", "m3", "m4", "tiny", "small")},
    "ic4": {"m1": "4x4", "m2": "4x4", "m3": "4x4", "m4": "4x4"},
    "ic5": {"m1": "32x8", "m4": "32x8"},  # 256 devices: planned past the head count
    "ic6": {"m1": "32x8", "m4": "32x8"},
    "local": {m: "4x1" for m in ("m1", "m2", "m3", "m4", "tiny", "small")},
}


def _shape(name: str) -> ModelShape:
    return ModelShape.of(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                         OmegaConf.load(CONF / "model" / f"{name}.yaml")))


def test_objective_comm_reproduces_todays_selections_on_every_preset():
    presets = sorted(p.stem for p in (CONF / "topology").glob("*.yaml"))
    assert presets == sorted(TODAY)
    for name in presets:
        topo = Topology.from_config(OmegaConf.load(CONF / "topology" / f"{name}.yaml"))
        for model, want in TODAY[name].items():
            for cost in ("eq2", "runtime"):
                planner = PlannerConfig(cost_model=cost, objective="comm",
                                        require_divisible=name not in ("ic5", "ic6"))
                plan = make_plan(topo, _shape(model), MeshConfig(), planner)
                assert plan.label == want, (name, model, cost)
                assert plan.objective.value == "comm"


def _calibrated_topology(tmp_path: Path) -> Path:
    from atp_pipeline.planning.alphabeta_fit import write_topology
    from atp_pipeline.planning.profile_fit import make_profile
    from atp_pipeline.run.compute_measure import sweep_kernels

    kernels = sweep_kernels()
    # a made-up device: 1 us per call plus 1 ns per unit of work (optimizer: 3 us per tensor)
    seconds = [3e-6 * k.dims[0] + 1e-9 * k.work if k.kind == kn.OPTIMIZER else 1e-6 + 1e-9 * k.work
               for k in kernels]
    profile = make_profile("fake4", kernels, seconds, 4)
    cfg = {"name": "fake4", "levels": [{"name": "process", "count": 4, "p2p_GBps": 1.0, "group_GBps": 1.0}],
           "device": {"name": "cpu", "compute": profile.to_config()}}
    path = tmp_path / "topology" / "fake4.yaml"
    write_topology(cfg, path)
    return path


def test_compute_calibration_round_trip_is_named_in_predictions(tmp_path):
    path = _calibrated_topology(tmp_path)
    topo = Topology.from_config(OmegaConf.load(path))
    prof = cp.profile_of(topo)
    assert prof is not None and prof.name == "fake4" and prof.processes == 4
    gemm = prof.fits[kn.GEMM]
    assert gemm.alpha_s == pytest.approx(1e-6, rel=1e-3) and gemm.per_unit_s == pytest.approx(1e-9, rel=1e-3)
    assert prof.fits[kn.OPTIMIZER].per_tensor_s == pytest.approx(3e-6, rel=1e-3)
    k = kn.Kernel(kn.GEMM, (128, 64, 256))  # a measured point: its own time
    assert prof.seconds(k) == pytest.approx(1e-6 + 1e-9 * k.work, rel=1e-5)
    unseen = kn.Kernel(kn.GEMM, (7, 7, 7))  # below the sweep: the fit
    assert prof.seconds(unseen) == pytest.approx(1e-6 + 1e-9 * 686, rel=1e-3)
    between = kn.Kernel(kn.GEMM, (GPT.tokens_per_step, 32, 96))  # inside the sweep: log-log interpolation
    lo, hi = [max(p for p in prof._curves()[kn.GEMM] if p[0] <= between.work),
              min(p for p in prof._curves()[kn.GEMM] if p[0] >= between.work)]
    assert lo[1] <= prof.seconds(between) <= hi[1] and lo[0] < between.work < hi[0]
    assert prof.seconds(between) == pytest.approx(1e-6 + 1e-9 * between.work, rel=0.05)
    plan = make_plan(topo, GPT, MeshConfig(), PlannerConfig())
    assert plan.objective.value == "step"
    assert all(c.step is not None and c.step.profile == "fake4" for c in plan.candidates)
    best = min(plan.candidates, key=lambda c: c.step.step_s)
    assert plan.selected == best.mesh
    data = plan.to_dict()
    assert data["compute_profile"]["name"] == "fake4" and "4 processes" in data["compute_profile"]["source"]
    assert plan.summary_row()["compute_profile"] == "fake4"


def test_an_attention_core_is_priced_on_the_grid_of_cores_head_size_included():
    """The calibration's cores lie on a full grid of ``(b·a, s, d)`` (:attr:`Kernel.grid`): a core
    is priced multilinear in the logs between the grid's nearest values, beyond it along the outermost
    cell. On a CPU the head size changes the time per score element both ways (one process: ``d`` 8
    ran 1.4x ``d`` 16, ``d`` 64 2.6x): a made-up device with such a per-score price is
    priced within 2 % off the grid, and two cores of the same score count apart by their head sizes."""
    from atp_pipeline.run.compute_measure import sweep_kernels

    per_score = {8: 6e-9, 16: 4e-9, 32: 5e-9, 64: 8e-9, 128: 15e-9}

    def took(c):  # 2 us + a per-score price of the head size (log-linear between the listed ones)
        b, a, s, d = c
        return 2e-6 + math.exp(np.interp(math.log(d), [math.log(x) for x in per_score],
                                          [math.log(x) for x in per_score.values()])) * b * a * s * s
    sweep = [k.dims for k in sweep_kernels() if k.kind == kn.ATTN_BWD]
    prof = cp.ComputeProfile("p", "test", {k: cp.KindFit(1e-6, 1e-9) for k in kn.KINDS},
                             points={(kn.ATTN_BWD, c): took(c) for c in sweep})
    assert set(prof.kernel_grids()) == {kn.ATTN_BWD}
    for off in [(12, 4, 140, 16), (4, 4, 228, 8), (6, 2, 92, 12), (16, 8, 200, 48)]:
        assert prof.seconds(kn.Kernel(kn.ATTN_BWD, off)) == pytest.approx(took(off), rel=0.02), off
    beyond = (2, 8, 512, 96)  # past the sequences the sweep ran: along the grid's outermost cell
    assert prof.seconds(kn.Kernel(kn.ATTN_BWD, beyond)) == pytest.approx(took(beyond), rel=0.02)
    same_scores = [prof.seconds(kn.Kernel(kn.ATTN_BWD, (12, 4, 140, d))) for d in (8, 16)]
    assert same_scores[0] / same_scores[1] == pytest.approx(1.5, rel=0.02)
    back = cp.ComputeProfile.from_config(prof.to_config())
    assert back.seconds(kn.Kernel(kn.ATTN_BWD, beyond)) == pytest.approx(prof.seconds(kn.Kernel(kn.ATTN_BWD, beyond)),
                                                                         rel=1e-4)


def test_a_models_own_loss_is_its_own_kernel_and_committed_rows_are_predicted_as_they_were():
    """A head whose logits the model's own loss reads whole (tied, gathered, run whole) runs that
    loss as one forward and one backward kernel over ``[tokens, vocab]`` (kinds ``loss_fwd`` /
    ``loss_bwd``); a profile without those kinds is of an older format, refused in one line naming
    ``stage=calibrate``; rows a validation grid predicted from a calibration (``tests/data``) are
    predicted from it again exactly as they were."""
    from benchmarks import step_validation as sv

    for shape, mesh in ((LLAMA, (2, 1)), (TIED_OPT, (1, 2))):
        prog, _ = sp.build_program(shape, mesh, shape.batch_size, 1)
        T, V = shape.batch_size * shape.seq_len, shape.vocab_size
        assert ([it[1] for it in prog.post_fwd if it[0] == "k" and it[1].kind.startswith("loss")]
                == [kn.Kernel(kn.LOSS_FWD, (T, V))])
        assert ([it[1] for it in prog.post_bwd if it[0] == "k" and it[1].kind.startswith("loss")]
                == [kn.Kernel(kn.LOSS_BWD, (T, V))])
    prog, _ = sp.build_program(GPT, (2, 1), GPT.batch_size, 1)  # vocab-parallel: its own split loss, pointwise
    assert not [it for it in sp.all_items(prog) if it[0] == "k" and it[1].kind.startswith("loss")]
    cal = DATA / "step_calibration.yaml"
    data = yaml.safe_load(cal.read_text())
    for kind in (kn.LOSS_FWD, kn.LOSS_BWD):
        del data["device"]["compute"]["fits"][kind]
    with pytest.raises(ConfigError, match=r"^topology 'local': device\.compute: a compute profile of an older format "
                                          r"\(no fit for kernel kind\(s\) loss_fwd, loss_bwd\) \(calibrate again: "
                                          r"python train\.py stage=calibrate\)$"):
        cp.profile_of(Topology.from_config(data))
    rows = json.loads((DATA / "step_rows.json").read_text())["rows"]
    out, _ = sv.repredict(rows, {}, str(cal), "unused", CONF)
    assert len(out) == 8
    assert [r["predicted_s"] for r in out] == pytest.approx([r["predicted_at_calibration_speed_s"] for r in rows],
                                                            rel=1e-9)


def test_an_attention_core_off_a_grid_is_priced_by_its_score_elements_not_its_flops():
    """Where a profile's cores are no grid of three values an axis (quick sweeps), a core is priced
    by its score elements (calibrations' cores with head size 32 ran
    0.51-1.65x those with head size 8 of the same ``b, a, s``, their FLOPs 4x): the cores are fitted per
    score element ``b·a·s²`` (:attr:`Kernel.size`, ``per_size`` in the YAML) and interpolated in them,
    whatever the head size; an older profile's fit per FLOP keeps its unit."""
    from atp_pipeline.planning.profile_fit import fit_kind

    def took(c):  # a made-up device: 20 us + 4 ns per score element, whatever the head size
        b, a, s, _ = c
        return 20e-6 + 4e-9 * b * a * s * s
    sweep = [(b, a, s, d) for b in (2, 8) for a in (1, 4) for s in (32, 128) for d in (8, 32)]
    fit = fit_kind([kn.Kernel(kn.ATTN_FWD, c) for c in sweep], [took(c) for c in sweep])
    assert (fit.per_size and fit.alpha_s == pytest.approx(20e-6, rel=1e-6)
            and fit.per_unit_s == pytest.approx(4e-9, rel=1e-6))
    assert not fit_kind([kn.Kernel(kn.GEMM, (m, 8, 8)) for m in (8, 64)], [1e-6, 2e-6]).per_size
    prof = cp.ComputeProfile("p", "test", {**{k: cp.KindFit(1e-6, 1e-9) for k in kn.KINDS}, kn.ATTN_FWD: fit},
                             points={(kn.ATTN_FWD, c): took(c) for c in sweep})
    assert prof.kernel_grids() == {}
    inside = (4, 4, 64, 16)  # a head size the sweep never ran, between two of its score counts
    assert prof.seconds(kn.Kernel(kn.ATTN_FWD, inside)) == pytest.approx(took(inside), rel=0.03)
    beyond = (16, 4, 120, 8)  # past the sweep: the fit per score element
    assert prof.seconds(kn.Kernel(kn.ATTN_FWD, beyond)) == pytest.approx(took(beyond), rel=1e-9)
    back = cp.ComputeProfile.from_config(prof.to_config())
    assert (back.fits[kn.ATTN_FWD].per_size
            and back.seconds(kn.Kernel(kn.ATTN_FWD, beyond)) == pytest.approx(took(beyond)))
    older = prof.to_config()
    del older["fits"][kn.ATTN_FWD]["per_size"]  # a fit without per_size: its ns_per_unit is per FLOP
    k = kn.Kernel(kn.ATTN_FWD, beyond)
    assert cp.ComputeProfile.from_config(older).seconds(k) == pytest.approx(20e-6 + 4e-9 * k.work, rel=1e-6)


def test_report_shows_step_time_tokens_and_mfu(compose_cfg, tmp_path):
    from atp_pipeline.run.resolve import plan_from_config

    plan = plan_from_config(compose_cfg("topology=ic4", "model=m3"))
    console = Console(record=True, width=220, file=open(tmp_path / "plan.txt", "w"))
    plan.print(console)
    text = console.export_text()
    for column in ("step", "compute", "exposed", "tokens/s", "MFU", "objective=step"):
        assert column in text
    assert "compute profile 'spec:A100-80GB'" in text
    sel = plan.candidate(plan.selected)
    assert sel.step.step_s == pytest.approx(sel.step.compute_s + sel.step.exposed_comm_s)
    assert 0 < sel.step.exposed_comm_s <= sel.step.total_comm_s
    assert sel.step.tokens_per_s == pytest.approx(4 * 2048 / sel.step.step_s)
    assert sel.step.mfu == pytest.approx(plan.model.flops_per_step / (sel.step.step_s * 16 * 312e12))
    row = plan.summary_row()
    assert row["predicted_step_s"] == sel.step.step_s and row["objective"] == "step"
    cand = json.loads(json.dumps(plan.to_dict()))["candidates"][0]
    assert set(cand["step"]) >= {"step_s", "compute_s", "exposed_comm_s", "tokens_per_s", "mfu", "profile"}
    plan.plot(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_no_compute_profile_falls_back_to_communication_with_a_note(compose_cfg, tmp_path):
    from atp_pipeline.run.resolve import plan_from_config

    plan = plan_from_config(compose_cfg("topology=local", "model=tiny", f"calibration.dir={tmp_path}", "mesh.dp=1"))
    assert plan.objective.value == "comm" and plan.label == "4x1"
    assert any("no compute profile" in n for n in plan.notes)
    # the whole layout alike: tensor-parallel communication plus the gradient sync
    whole = plan_from_config(compose_cfg("topology=local", "model=tiny", f"calibration.dir={tmp_path}"))
    assert whole.objective.value == "comm" and any("no compute profile" in n for n in whole.notes)
    best = min((c for c in whole.layouts if c.lost in ("chosen", "slower")), key=lambda c: c.comm_s)
    assert whole.layouts[0].lost == "chosen" and whole.layouts[0].comm_s == best.comm_s


def test_bad_values_are_one_clear_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^topology 't': device.compute.fits.gemm: alpha_us, ns_per_unit"):
        cp.profile_of(Topology.from_config({
            "name": "t", "levels": [{"name": "p", "count": 2, "p2p_GBps": 1, "group_GBps": 1}],
            "device": {"compute": {"name": "x", "fits": {k: {"alpha_us": -1 if k == "gemm" else 1,
                                                             "ns_per_unit": 1} for k in kn.KINDS}}}}))
    with pytest.raises(ConfigError, match=r"older format \(no fit for kernel kind\(s\) attention_fwd, "):
        cp.ComputeProfile.from_config({"name": "x", "fits": {"gemm": {"alpha_us": 1, "ns_per_unit": 1}}})
    out = run_train(["stage=plan", "planner.objective=fast", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: planner.objective: Invalid value 'fast', expected one of [step, comm]"]


# ----------------------------------------------------------------------------- runtime terms
def _two() -> Topology:
    return Topology.from_config({"name": "t", "levels": [{"name": "p", "count": 2, "p2p_GBps": 1,
                                                         "group_GBps": 1}]})


def test_framework_cost_is_added_around_each_kernel_and_collective_but_the_optimizer():
    """A kernel costs seconds·(1 + kernel_factor) + per_kernel_s in the step, a collective call
    per_collective_s + bytes·per_collective_byte_s of the rank's CPU before it launches."""
    fw = cp.Framework(4e-6, 0.5, 7e-6, 1e-12)
    prof = cp.ComputeProfile("p", "test", _flat(10.0).fits, framework=fw)
    gemm, opt = kn.Kernel(kn.GEMM, (8, 8, 8)), kn.Kernel(kn.OPTIMIZER, (3, 100))
    assert prof.step_kernel_seconds(gemm) == pytest.approx(10e-6 * 1.5 + 4e-6)
    assert prof.step_kernel_seconds(opt) == pytest.approx(10e-6)  # timed as the runtime runs it
    assert cp.ComputeProfile("q", "test", _flat(10.0).fits).step_kernel_seconds(gemm) == pytest.approx(10e-6)
    free = Topology.from_config({"name": "f", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1e12,
                                                         "group_GBps": 1e12}]})
    est = st.estimate_step(free, GPT, (2, 2), st.StepSetting(chunks=2), prof)
    prog, _ = sp.build_program(GPT, (2, 2), GPT.batch_size, 2)
    items = list(sp.all_items(prog))
    n = sum(1 for i in items if i[0] == "k" and i[1].kind != kn.OPTIMIZER)
    colls = [i[1] for i in items if i[0] in ("sync", "async", "linear")]
    nbytes = float(sum(c.elements for c in colls)) * GPT.bytes_per_element
    coll_fw = len(colls) * 7e-6 + nbytes * 1e-12
    assert est.dispatch_s == pytest.approx(n * (5e-6 + 4e-6) + coll_fw)
    assert est.optimizer_s == pytest.approx(10e-6)
    assert est.compute_s == pytest.approx(n * 19e-6 + 10e-6 + coll_fw)
    assert "framework 4.0 us/kernel + 50.0%, 7.0 us + 0.001 ns/B per collective" in est.calibration


def test_contention_scales_every_calibrated_time_by_the_runs_processes():
    """The profile measured at 4 processes; a 2-process run on the host takes the measured
    factor of every calibrated time (kernels, framework, the fitted alpha-beta); counts
    between are interpolated, beyond the largest proportional."""
    prof = cp.ComputeProfile("p", "test", _flat(10.0).fits, processes=4, framework=cp.Framework(2e-6),
                             contention={1: 0.45, 2: 0.5, 4: 1.0})
    assert [prof.contention_factor(p) for p in (1, 2, 3, 4, 8)] == pytest.approx([0.45, 0.5, 0.75, 1.0, 2.0])
    ab = {"name": "t", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1, "group_GBps": 1}],
          "alpha_beta": [{"level": "p", "alpha_us": 50.0, "GBps": 1.0}]}
    four = Topology.from_config(ab)
    at4 = st.estimate_step(four, GPT, (2, 2), st.StepSetting(), prof)
    at2 = st.estimate_step(four.restrict(2), GPT, (2, 1), st.StepSetting(), prof)
    bare = st.estimate_step(four.restrict(2), GPT, (2, 1), st.StepSetting(),
                            cp.ComputeProfile("p", "test", prof.fits, processes=4, framework=prof.framework))
    assert at2.step_s == pytest.approx(0.5 * bare.step_s) and at2.compute_s == pytest.approx(0.5 * bare.compute_s)
    assert "contention x0.500 at 2 processes (calibrated at 4)" in at2.calibration
    assert "contention x1.000 at 4 processes" in at4.calibration


def test_sync_cost_grows_with_the_compute_before_a_collective_and_hides_under_emulation():
    """extra = alpha + per_compute x (compute since the rank's previous collective), added to
    the real transfer; the emulated link's time bounds it from below."""
    prof = cp.ComputeProfile("p", "test", _flat(5.0).fits, sync=cp.SyncFit(3e-6, 0.2))
    term = CommTerm("f1", "x", ALL_REDUCE, 1, Fraction(1), 1, "fwd")
    gemm = kn.Kernel(kn.GEMM, (10, 10, 10))
    coll = sp.Coll(term, Fraction(1), 1000)  # 4000 B at 1 GB/s: 4 us
    tl = st._Timeline(cc.CommClock(_two(), (2, 1), 4), prof, 4)
    tl.run([("k", gemm), ("k", gemm), ("sync", coll), ("k", gemm), ("sync", coll)], [])
    # 10 us compute, 4 + 3 + 2 us; 5 us compute, 4 + 3 + 1 us
    assert tl.now == pytest.approx(10e-6 + 9e-6 + 5e-6 + 8e-6)
    assert tl.sync == pytest.approx(5e-6 + 4e-6) and tl.comm_total == pytest.approx(17e-6)
    slow = cc.CommClock(_two(), (2, 1), 4, emulated=(_two(), 5.0))  # 20 us emulated
    tl = st._Timeline(slow, prof, 4)
    tl.run([("k", gemm), ("k", gemm), ("sync", coll)], [])
    assert tl.now == pytest.approx(10e-6 + 20e-6) and tl.sync == 0
    none = st._Timeline(cc.CommClock(_two(), (1, 2), 4), prof, 4)  # size-1 dimension: no collective, no sync
    none.run([("k", gemm), ("sync", coll)], [])
    assert none.now == pytest.approx(5e-6)


def test_a_collective_in_flight_takes_the_unhidden_share_of_its_overlap_from_compute():
    """hidden = 0.25: the compute that overlapped a collective's real transfer is late by 75 %
    of that overlap; an emulated link's sleep takes nothing from it."""
    prof = cp.ComputeProfile("p", "test", _flat(5.0).fits, sync=cp.SyncFit(0.0, 0.0, 0.25))
    term = CommTerm("f1", "x", ALL_REDUCE, 1, Fraction(1), 1, "bwd")
    gemm = kn.Kernel(kn.GEMM, (10, 10, 10))
    for elements, want in ((1000, 10e-6 + 0.75 * 4e-6),  # 4 us hidden behind the 5-us wgrad: 3 us back
                           (8000, 5e-6 + 32e-6)):  # 32 us, its 5-us overlap (+3.75 us) still inside
        tl = st._Timeline(cc.CommClock(_two(), (2, 1), 4), prof, 4)
        tl.run([("k", gemm), ("linear", sp.Coll(term, Fraction(1), elements)), ("k", gemm), ("join",)], [])
        assert tl.now == pytest.approx(want)
        assert tl.compute == pytest.approx(10e-6)
    emu = cc.CommClock(_two(), (2, 1), 4, emulated=(_two(), 10.0))  # 4 us real, 40 us emulated
    tl = st._Timeline(emu, prof, 4)
    tl.run([("k", gemm), ("linear", sp.Coll(term, Fraction(1), 1000)), ("k", gemm), ("k", gemm), ("join",)], [])
    assert tl.now == pytest.approx(5e-6 + 40e-6) and tl.sync == 0
    tl = st._Timeline(emu, prof, 4)
    tl.run([("k", gemm), ("linear", sp.Coll(term, Fraction(1), 1000))] + [("k", gemm)] * 9 + [("join",)], [])
    assert tl.now == pytest.approx(50e-6 + 0.75 * 4e-6)  # only the 4-us transfer took CPU


def test_more_ranks_than_cores_run_at_a_cores_speed_bounded_by_every_ranks_cpu():
    """4 processes on 2 cores: a rank's timeline computes at the factor of a rank alone on a
    core (contention at 2), while it waits in a collective its backend keeps ``busy`` of a core;
    the step is no less than that CPU over the cores (compute x shared / alone). 2 processes on
    2 cores: the timeline alone."""
    ab = {"name": "t", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1, "group_GBps": 1}],
          "alpha_beta": [{"level": "p", "alpha_us": 400.0, "GBps": 1.0}]}
    four = Topology.from_config(ab)
    base = cp.ComputeProfile("p", "test", _flat(50.0).fits, processes=4, cores=2,
                             contention={1: 0.5, 2: 0.5, 4: 1.0})
    for busy in (0.0, 0.25, 1.0):
        prof = dataclasses.replace(base, collective_cpu=cp.CollectiveCPU({2: busy, 4: busy}))
        est = st.estimate_step(four, GPT, (2, 2), st.StepSetting(), prof)
        alone = st.estimate_step(four, GPT, (2, 2), st.StepSetting(),  # kernels at half the time, collectives not
                                 dataclasses.replace(prof, fits=_flat(25.0).fits, cores=0, contention={}))
        assert est.timeline_s == pytest.approx(alone.step_s)  # the rank's own timeline at a core's speed
        waits = est.timeline_s - alone.compute_s
        assert est.cpu_s == pytest.approx(alone.compute_s + busy * waits)
        assert est.step_s == pytest.approx(max(est.timeline_s, 2.0 * est.cpu_s))
        assert est.host_bound == (2.0 * est.cpu_s > est.timeline_s)
    assert est.host_bound and est.compute_s == pytest.approx(2.0 * alone.compute_s)
    assert "4 processes on 2 cores: a rank alone on a core x0.500" in est.calibration
    two = st.estimate_step(four.restrict(2), GPT, (2, 1), st.StepSetting(), prof)
    assert not two.host_bound and two.step_s == pytest.approx(two.timeline_s)
    assert cp.CollectiveCPU({2: 0.2, 4: 0.6}).share(3) == pytest.approx(0.4)
    assert cp.CollectiveCPU({2: 0.2, 4: 0.6}).share(8) == pytest.approx(0.6)


def test_the_terms_form_runs_on_where_the_hosts_cpu_bound_takes_over():
    """The step residual's terms form scales the step's compute and exposed parts by
    its two factors; where every rank's CPU over the cores overtook the timeline, the compute was
    the kernels at the shared speed (x processes / cores) and a step jumped (x1.58 for `small` at
    batch 12, sequence 148 on 2x2, host speed 1.10 -> 1.16). The host-bound compute is the timeline's
    plus the kernels' share of the CPU beyond it: the step runs on through the boundary."""
    ab = {"name": "t", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1, "group_GBps": 1}],
          "alpha_beta": [{"level": "p", "alpha_us": 40.0, "GBps": 1.0}]}
    four = Topology.from_config(ab)
    sr = cp.StepResidual({4: {1: 2.5}}, {4: {1: 0.8}})
    steps, bound = [], []
    for us in np.geomspace(20.0, 2000.0, 241):  # the kernels from collective-bound to CPU-bound
        prof = cp.ComputeProfile("p", "test", _flat(us).fits, processes=4, cores=2, kernel_time="cpu",
                                 contention={1: 0.5, 2: 0.5, 4: 1.0},
                                 collective_cpu=cp.CollectiveCPU({2: 0.25, 4: 0.25}), step_residual=sr)
        est = st.estimate_step(four, GPT, (2, 2), st.StepSetting(), prof)
        fc, fe = prof.residual_factors(4, 1)
        assert est.step_s == pytest.approx(fc * est.compute_s + fe * est.exposed_comm_s)
        assert 0 < est.compute_s <= est.cpu_s * 2.0 + 1e-12
        steps.append(est.step_s)
        bound.append(est.host_bound)
    assert not bound[0] and bound[-1]  # the boundary is inside the sweep
    ratios = [b / a for a, b in zip(steps, steps[1:])]
    assert max(ratios) < 1.025 and min(ratios) > 1.0  # a step of x1.02 in the kernels: no jump, monotone


def test_a_cpu_priced_profile_runs_kernels_at_their_cpu_time_and_shares_the_cores_evenly():
    """Kernels priced at a rank's CPU time (``kernel_time: cpu``): on the rank's timeline at that
    time whatever the process count (no contention factor), the step no less than every rank's
    CPU x processes / cores; the collectives and their sync term at the contention of the run's
    processes (2 processes: x0.5)."""
    ab = {"name": "t", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1, "group_GBps": 1}],
          "alpha_beta": [{"level": "p", "alpha_us": 40.0, "GBps": 1.0}]}
    four = Topology.from_config(ab)
    prof = cp.ComputeProfile("p", "test", _flat(500.0).fits, processes=4, cores=2, kernel_time="cpu",
                             contention={1: 0.5, 2: 0.5, 4: 1.0}, collective_cpu=cp.CollectiveCPU({2: 0.25, 4: 0.25}),
                             sync=cp.SyncFit(100e-6))
    bare = dataclasses.replace(prof, cores=0, contention={})  # one process per core, no factors
    est = st.estimate_step(four, GPT, (2, 2), st.StepSetting(), prof)
    ref = st.estimate_step(four, GPT, (2, 2), st.StepSetting(), bare)
    assert est.timeline_s == pytest.approx(ref.step_s) and ref.compute_s == pytest.approx(est.cpu_s - 0.25 * (
        est.timeline_s - ref.compute_s))
    assert est.host_bound and est.step_s == pytest.approx(2.0 * est.cpu_s) and est.compute_s == pytest.approx(
        # + its share beyond the timeline
        ref.compute_s + (2.0 * est.cpu_s - est.timeline_s) * ref.compute_s / est.cpu_s)
    assert prof.host_factor(4) == 2.0 and prof.host_factor(2) == 1.0 and prof.timeline_factor(4) == 1.0
    assert "at a rank's CPU time" in est.calibration and "a rank's kernels at their CPU time" in est.calibration
    two = st.estimate_step(four.restrict(2), GPT, (2, 1), st.StepSetting(), prof)
    halved = st.estimate_step(four.restrict(2), GPT, (2, 1), st.StepSetting(),
                              dataclasses.replace(bare, sync=cp.SyncFit(50e-6)))
    assert not two.host_bound and two.compute_s == pytest.approx(halved.compute_s)
    assert prof.sync_factor(2) == 0.5 and prof.sync_factor(4) == 1.0 and two.total_comm_s < halved.total_comm_s
    skew = dataclasses.replace(prof, sync=cp.SyncFit(100e-6, 0.5))  # per_compute: only where ranks share cores
    assert st.estimate_step(four.restrict(2), GPT, (2, 1), st.StepSetting(), skew).step_s == pytest.approx(two.step_s)
    assert st.estimate_step(four, GPT, (2, 2), st.StepSetting(), skew).timeline_s > est.timeline_s
    assert not prof.skewed(2) and prof.skewed(4) and dataclasses.replace(prof, kernel_time="wall").skewed(2)
    own = dataclasses.replace(prof, comm_contention={2: 0.25, 4: 1.0})  # the collectives' own factor
    assert own.comm_factor(2) == 0.25 and own.sync_factor(2) == 0.25 and own.contention_factor(2) == 0.5
    assert cp.ComputeProfile.from_config(own.to_config()).comm_contention == {2: 0.25, 4: 1.0}
    assert "collectives x0.250" in st.estimate_step(four.restrict(2), GPT, (2, 1), st.StepSetting(), own).calibration
    assert cp.ComputeProfile.from_config(prof.to_config()).kernel_time == "cpu"
    with pytest.raises(ConfigError, match="kernel_time 'gpu' \\(one of cpu, wall\\)"):
        cp.ComputeProfile.from_config({**prof.to_config(), "kernel_time": "gpu"})


def test_the_step_residual_scales_the_terms_compute_and_exposed_and_is_fitted_from_the_probes_own_steps():
    """The profile's StepResidual (fitted over the probes' own training steps
    against their prediction, per process count and chunk count) scales the compute and the exposed
    communication the terms add up to, at the run's counts (the nearest calibrated ones elsewhere);
    compute and exposed stay the terms', the difference is ``residual_s``. A residual of an older
    format (one factor for both parts, or one pair per process count) is refused in one line."""

    from atp_pipeline.planning import profile_fit as pf

    four = Topology.from_config({"name": "t", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1, "group_GBps": 1}],
                                 "alpha_beta": [{"level": "p", "alpha_us": 40.0, "GBps": 1.0}]})
    prof = cp.ComputeProfile("p", "test", _flat(20.0).fits, processes=4, cores=2, kernel_time="cpu",
                             sync=cp.SyncFit(100e-6))
    sr = cp.StepResidual({2: {1: 1.25, 2: 1.0}, 4: {1: 1.5, 2: 2.0}}, {2: {1: 0.75, 2: 1.0}, 4: {1: 1.125, 2: 0.5}},
                         {2: 12, 4: 36})
    res = dataclasses.replace(prof, step_residual=sr)
    for topo, mesh, c, (fc, fe) in ((four, (2, 2), 2, (2.0, 0.5)), (four, (2, 2), 1, (1.5, 1.125)),
                                    (four.restrict(2), (2, 1), 1, (1.25, 0.75))):
        base = st.estimate_step(topo, GPT, mesh, st.StepSetting(chunks=c), prof)
        est = st.estimate_step(topo, GPT, mesh, st.StepSetting(chunks=c), res)
        assert base.exposed_comm_s > 0 and base.residual_s == 0.0
        assert est.step_s == pytest.approx(fc * base.compute_s + fe * base.exposed_comm_s)
        assert est.residual_s == pytest.approx(est.step_s - base.step_s)
        assert (est.compute_s, est.exposed_comm_s, est.cpu_s, est.timeline_s) == pytest.approx(
            (base.compute_s, base.exposed_comm_s, base.cpu_s, base.timeline_s))
        assert est.host_bound == base.host_bound
        assert est.tokens_per_s == pytest.approx(GPT.tokens_per_step / est.step_s)
    assert est.to_dict()["residual_s"] == est.residual_s
    assert ([sr.at(n, k) for n, k in ((1, 1), (2, 2), (3, 1), (8, 4))]
            == [(1.25, 0.75), (1.0, 1.0), (1.5, 1.125), (2.0, 0.5)])
    assert ("step residual compute x1.250, exposed x0.750 (chunks 1), compute x1.000, exposed x1.000 (chunks 2) at 2 "
            "processes (12 probe steps); compute x1.500, exposed x1.125 (chunks 1), compute x2.000, exposed x0.500 "
            "(chunks 2) at 4 processes (36 probe steps)" in est.calibration)
    assert "3 processes not calibrated: the nearest count's (x1.500, x1.125)" in res.describe(3)
    cfg = json.loads(json.dumps(res.to_config()))
    assert cfg["step_residual"]["exposed"] == {"2": {"1": 0.75, "2": 1.0}, "4": {"1": 1.125, "2": 0.5}}
    assert cp.ComputeProfile.from_config(cfg).step_residual == sr
    # residuals of an older format (one factor for both parts; one per process count): refused in one line
    for older in ({"factor": {4: 1.354, 2: 1.339}}, {"compute": {4: 1.7}, "exposed": {4: 1.0}}):
        with pytest.raises(ConfigError, match=r"^device\.compute: a compute profile of an older format \(step_residual "
                                              r"without factors per chunk count\) \(calibrate again: python train\.py "
                                              r"stage=calibrate\)$"):
            cp.ComputeProfile.from_config({**cfg, "step_residual": older})
    with pytest.raises(ConfigError, match=r"step_residual: compute and exposed: the same processes >= 1"):
        cp.ComputeProfile.from_config({**cfg, "step_residual": {"compute": {4: {1: 1.0}}, "exposed": {2: {1: 1.0}}}})
    with pytest.raises(ConfigError, match=r"step_residual: compute and exposed"):
        cp.ComputeProfile.from_config({**cfg, "step_residual": {"compute": {4: {1: float("nan")}},
                                                                "exposed": {4: {1: 1.0}}}})
    with pytest.raises(ConfigError, match=r"step_residual: unknown key\(s\) offset"):
        cp.ComputeProfile.from_config({**cfg, "step_residual": {**cfg["step_residual"], "offset": 1}})
    assert res.at_speed(cp.HostSpeed(2.0, 2.0)).step_residual == sr  # ratios: the host's speed leaves them
    # a profile of an older format (no loss kinds swept): refused in one line naming stage=calibrate
    lossless = {**cfg, "fits": {k: v for k, v in cfg["fits"].items() if not k.startswith("loss")}}
    with pytest.raises(ConfigError, match=r"^device\.compute: a compute profile of an older format \(no fit for kernel "
                                          r"kind\(s\) loss_fwd, loss_bwd\) \(calibrate again: python train\.py "
                                          r"stage=calibrate\)$"):
        cp.ComputeProfile.from_config(lossless)
    assert res.residual_factors(4, 2) == (2.0, 0.5) and _flat(1.0).residual_factors(4, 2) == (1.0, 1.0)
    assert "step residual" not in _flat(1.0).describe()  # no note for a profile that is not a calibration's
    # the fit recovers planted factors per process and chunk count (exactly: the probes' steps are T = a·C + b·E)
    parts = [(0.010, 0.030), (0.020, 0.010), (0.050, 0.050), (0.030, 0.090), (0.040, 0.004), (0.080, 0.030),
             (0.060, 0.020)]
    counts = [4, 4, 4, 2, 2, 2, 4]
    chunks = [1, 1, 1, 2, 2, 2, 2]
    planted = {(4, 1): (1.3, 0.8), (2, 2): (1.2, 1.4), (4, 2): (1.1, 1.1)}
    measured = [planted[n, k][0] * c + planted[n, k][1] * e for (c, e), n, k in zip(parts, counts, chunks)]
    fit = pf.fit_step_residual(parts, measured, counts, chunks)
    assert [fit.at(n, k) for n, k in planted] == [pytest.approx(ab) for ab in planted.values()]
    assert {n: sorted(v) for n, v in fit.compute.items()} == {2: [2], 4: [1, 2]} and fit.steps == {2: 3, 4: 4}
    two = pf.fit_step_residual(parts[:2], [0.05, 0.0375], [4, 4])  # too few steps to tell the parts apart: one factor
    assert two.at(4, 1) == pytest.approx((1.25, 1.25))
    assert pf.fit_step_residual([], [], []) is None and pf.residual_counts(4) == [2, 4] and pf.residual_counts(2) == [2]


def test_the_step_from_a_ranks_cpu_is_fitted_from_the_probes_and_chosen_on_probe_models_left_out():
    """The residual's CPU form (CpuStep) — the step as the probes' measured step
    against their measured rank CPU per (mesh, chunks) cell (``T = ratio·U + wait``), of the
    predicted rank CPU as the probes' measured CPU was to it (``U = a·Û + b`` per cell) — recovers planted
    values exactly; the calibration keeps whichever form
    predicts better the probe models left out in turn; a profile with it predicts
    ``ratio × (a·cpu + b) + wait`` (the medians of the cells of its chunk count where a cell is not
    calibrated), writes and reads it back (without waits: none), and re-times its
    CPU offset and its waits with the host."""
    import math

    from atp_pipeline.planning import profile_fit as pf

    ratio = {(2, (2, 1), 1): 1.2, (2, (1, 2), 1): 1.4, (2, (2, 1), 2): 1.3, (2, (1, 2), 2): 1.5,
             (4, (2, 2), 1): 2.4, (4, (4, 1), 1): 2.6}
    wait = {(2, (1, 2), 2): 0.003, (4, (2, 2), 1): 0.002, (4, (4, 1), 1): 0.006}  # the other cells none
    ab = {(2, 1): (1.1, 0.002), (2, 2): (1.05, 0.004), (4, 1): (1.2, 0.001)}
    own = {(4, (4, 1), 1): (1.3, 0.0)}  # a cell's own line: its mesh's rank CPU apart from the others'
    steps = [(n, mesh, c, m, 0.010 * (1 + m) + 0.004 * (mesh[0] + c)) for (n, mesh, c) in ratio for m in range(4)]
    u_hat = [x[4] for x in steps]
    u = [own.get((n, mesh, c), ab[n, c])[0] * uh + own.get((n, mesh, c), ab[n, c])[1] for (n, mesh, c, _, uh) in steps]
    wall = [ratio[n, mesh, c] * uu + wait.get((n, mesh, c), 0.0) for (n, mesh, c, _, _), uu in zip(steps, u)]
    args = ([x[0] for x in steps], [x[1] for x in steps], [x[2] for x in steps])
    fit = pf.fit_cpu_step(u_hat, u, wall, *args)
    assert fit.ratio == {2: {"1x2/c1": pytest.approx(1.4), "1x2/c2": pytest.approx(1.5), "2x1/c1": pytest.approx(1.2),
                             "2x1/c2": pytest.approx(1.3)},
                         4: {"2x2/c1": pytest.approx(2.4), "4x1/c1": pytest.approx(2.6)}}
    assert fit.wait == {2: {"1x2/c1": pytest.approx(0, abs=1e-9), "1x2/c2": pytest.approx(0.003),
                            "2x1/c1": pytest.approx(0, abs=1e-9), "2x1/c2": pytest.approx(0, abs=1e-9)},
                        4: {"2x2/c1": pytest.approx(0.002), "4x1/c1": pytest.approx(0.006)}}
    assert {n: {k: pytest.approx(v, rel=1e-6, abs=1e-9) for k, v in per.items()} for n, per in fit.cpu.items()} == {
        n: {cp.cell_key(mesh, c): own.get((n, mesh, c), ab[n, c]) for (nn, mesh, c) in ratio if nn == n}
        for n in (2, 4)}
    assert fit.step(2, (1, 2), 2, 0.05) == pytest.approx(1.5 * (1.05 * 0.05 + 0.004) + 0.003)
    assert fit.step(4, (4, 1), 1, 0.05) == pytest.approx(2.6 * 1.3 * 0.05 + 0.006)  # its own line
    # a cell not calibrated: the medians of 4's chunks-1 cells (ratio 2.5, wait 4 ms, the CPU x1.25 + 0.5 ms)
    assert fit.step(4, (1, 4), 1, 0.05) == pytest.approx(2.5 * (1.25 * 0.05 + 0.0005) + 0.004)
    # the nearest count, chunks
    assert fit.step(8, (2, 2), 2, 0.05) == pytest.approx(2.5 * (1.25 * 0.05 + 0.0005) + 0.004)
    # two steps of a cell: no line through them, the median ratio and no wait
    two = pf.fit_cpu_step(u_hat[:2], u[:2], wall[:2], *(a[:2] for a in args))
    assert two.wait[2]["2x1/c1"] == 0.0 and two.ratio[2]["2x1/c1"] == pytest.approx(1.2)
    # the form: planted as the CPU form, the CPU form predicts the left-out models exactly
    parts = [(0.6 * uh, 0.3 * uh * (1 + m)) for (_, _, _, m, uh) in steps]
    models = [x[3] for x in steps]
    res = pf.fit_residual(parts, u_hat, u, wall, *args, models)
    assert res.form == "cpu" and res.cv["cpu"] == (pytest.approx(0.0, abs=1e-9), pytest.approx(0.0, abs=1e-9))
    assert res.cv["terms"][1] > 0.01
    # planted as the terms' form (the step is 1.3 x compute + 0.9 x exposed, its rank CPU is noise): terms
    terms_wall = [1.3 * c + 0.9 * e for c, e in parts]
    noisy = [uu * (1.0 + 0.3 * math.sin(7 * i)) for i, uu in enumerate(u)]
    res_t = pf.fit_residual(parts, u_hat, noisy, terms_wall, *args, models)
    assert res_t.form == "terms" and res_t.anchored is not None and res_t.cv["terms"][1] < 1e-6
    # one model: nothing left out
    assert pf.fit_residual(parts, u_hat, u, wall, *args, [0] * len(steps)).anchored is None
    # in a profile
    four = Topology.from_config({"name": "t", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1, "group_GBps": 1}],
                                 "alpha_beta": [{"level": "p", "alpha_us": 40.0, "GBps": 1.0}]})
    prof = cp.ComputeProfile("p", "test", _flat(20.0).fits, processes=4, cores=2, kernel_time="cpu",
                             sync=cp.SyncFit(100e-6), step_residual=res)
    base = st.estimate_step(four, GPT, (2, 2), st.StepSetting(), dataclasses.replace(prof, step_residual=None))
    est = st.estimate_step(four, GPT, (2, 2), st.StepSetting(), prof)
    assert est.step_s == pytest.approx(2.4 * (1.2 * base.cpu_s + 0.001) + 0.002)
    assert est.residual_s == pytest.approx(est.step_s - base.step_s) and est.cpu_s == base.cpu_s
    assert "step / rank CPU" in est.calibration and "form 'cpu' chosen on the probe models left out" in est.calibration
    from atp_pipeline.planning.mesh_plan import residual_origin

    assert residual_origin(prof, est).startswith("the step from a rank's CPU")  # the plan's step line says which form
    assert residual_origin(dataclasses.replace(prof, step_residual=res_t), est).startswith(
        "the calibration's probe steps")
    cfg = json.loads(json.dumps(prof.to_config()))
    assert (cfg["step_residual"]["form"] == "cpu"
            and cfg["step_residual"]["cpu_ratio"]["4"]["2x2/c1"] == pytest.approx(2.4))
    assert cfg["step_residual"]["cpu_wait"]["4"]["4x1/c1"] == pytest.approx(6000.0)  # microseconds
    back = cp.ComputeProfile.from_config(cfg).step_residual
    assert back.form == "cpu" and back.anchored.cpu[4]["2x2/c1"] == pytest.approx(ab[4, 1], rel=1e-5)
    assert cfg["step_residual"]["cpu_fit"]["4"]["4x1/c1"] == pytest.approx([1.3, 0.0], abs=1e-9)  # microseconds
    old_fit = {p: {c.split("/c")[1]: v for c, v in per.items() if c.startswith("2x")}
               for p, per in cfg["step_residual"]["cpu_fit"].items()}
    with pytest.raises(ConfigError, match=r"older format \(step_residual\.cpu_fit per chunk count, not per cell\)"):
        cp.ComputeProfile.from_config({**cfg, "step_residual": {**cfg["step_residual"], "cpu_fit": old_fit}})
    assert back.cpu_step(4, (2, 2), 1, 0.05) == pytest.approx(res.cpu_step(4, (2, 2), 1, 0.05), rel=1e-5)
    assert "4x1/c1 x2.60 + 6.00 ms" in back.describe()
    older = {k: v for k, v in cfg["step_residual"].items() if k != "cpu_wait"}  # no waits: 0
    assert cp.ComputeProfile.from_config({**cfg, "step_residual": older}).step_residual.cpu_step(4, (2, 2), 1, 0.05) \
        == pytest.approx(2.4 * (1.2 * 0.05 + 0.001), rel=1e-5)
    slow = prof.at_speed(cp.HostSpeed(1.0, 2.0)).step_residual
    assert slow.cpu_step(4, (2, 2), 1, 0.05) == pytest.approx(2.4 * (1.2 * 0.05 + 0.002) + 0.004)
    with pytest.raises(ConfigError, match=r"step_residual: cpu_ratio"):
        cp.ComputeProfile.from_config({**cfg, "step_residual": {**cfg["step_residual"],
                                                                "cpu_ratio": {4: {"2x2/c1": -1}}}})
    for bad in ({4: {"2x2/c1": -1.0}}, {4: {"1x4/c1": 10.0}}):  # a negative wait, a cell without a ratio
        with pytest.raises(ConfigError, match=r"cpu_wait: cpu_ratio's cells"):
            cp.ComputeProfile.from_config({**cfg, "step_residual": {**cfg["step_residual"], "cpu_wait": bad}})
    with pytest.raises(ConfigError, match=r"step residual: form 'x'"):
        cp.ComputeProfile.from_config({**cfg, "step_residual": {**cfg["step_residual"], "form": "x"}})


def test_a_collective_in_flight_takes_the_loops_unhidden_share_of_the_overlap():
    """The compute overlapping a collective in flight is late by ``1 - hidden`` of that overlap
    (the collective-during-compute loops' share) wherever the profile has those loops, whatever
    its collectives' backend CPU; a profile without them (older ones) takes the backend's busy
    share, plus its CPU per call spread over the transfer."""
    term = CommTerm("f1", "x", ALL_REDUCE, 1, Fraction(1), 1, "bwd")
    gemm = kn.Kernel(kn.GEMM, (10, 10, 10))
    busy = dataclasses.replace(_flat(5.0), collective_cpu=cp.CollectiveCPU({2: 0.75}))
    hid = dataclasses.replace(_flat(5.0), sync=cp.SyncFit(0.0, 0.0, 0.25))
    both = dataclasses.replace(hid, collective_cpu=cp.CollectiveCPU({}, {2: 3e-6}, {2: 1e-9}))
    got = []
    for prof in (busy, hid, both):
        tl = st._Timeline(cc.CommClock(_two(), (2, 1), 4), prof, 4)
        tl.run([("k", gemm), ("linear", sp.Coll(term, Fraction(1), 1000)), ("k", gemm), ("join",)], [])
        got.append(tl.now)
    assert got[0] == pytest.approx(got[1]) == pytest.approx(got[2]) == pytest.approx(10e-6 + 0.75 * 4e-6)
    # without the loops: the backend's CPU per call (2 us over the 4 us transfer: half a core) adds to its busy share
    per_call = dataclasses.replace(busy, collective_cpu=cp.CollectiveCPU({2: 0.25}, {2: 2e-6}))
    tl = st._Timeline(cc.CommClock(_two(), (2, 1), 4), per_call, 4)
    tl.run([("k", gemm), ("linear", sp.Coll(term, Fraction(1), 1000)), ("k", gemm), ("join",)], [])
    assert tl.now == pytest.approx(got[0]) and tl.coll_cpu == pytest.approx(2e-6 + 0.25 * 3e-6)  # and its 3 us wait


def test_the_pure_collective_loops_cover_small_messages_with_more_calls():
    """The pure collective loops run on every group layout at 1 KiB to 1 MiB (small models'
    activations are a few KiB: eight calibrations fitted from 16 KiB up gave 345-535 us a
    2-rank call), each a pass LOOP_BATCH x the calls of the other measurements."""
    from atp_pipeline.planning import profile_fit as pf
    from atp_pipeline.run import compute_measure as cm
    from atp_pipeline.run import compute_timing as ct

    pure = [p for p in cm.sync_patterns(4) + cm.cpu_loops(4) if p[5] == 0 and p[6] == pf.SYNC]
    layouts = {(d1, d2, dim) for d1, d2, dim, *_ in pure}
    assert layouts == {(4, 1, 1), (2, 2, 1), (2, 2, 2)}
    for layout in layouts:
        for coll in cm.SYNC_COLLECTIVES:
            assert sorted(p[4] for p in pure if p[:3] == layout and p[3] == coll) == [
                1024, 4096, 16384, 65536, 262144, 1048576]
    assert {ct.loop_batch(p) for p in pure} == {cm.LOOP_BATCH} == {4}
    assert {ct.loop_batch(p) for p in cm.sync_patterns(4) if p[5] > 0 or p[6] != pf.SYNC} == {1}
    assert ct.calls_per_batch(10.0, 1e-3) == 10 and ct.calls_per_batch(10.0, 1e-3, cm.LOOP_BATCH) == 40
    assert ct.calls_per_batch(10.0, 0.05) == 1 and ct.calls_per_batch(10.0, 0.0, 4) == 200


def test_collective_cpu_per_call_and_byte_from_the_pure_collective_loops():
    """The pure collective loops (no GEMMs, every rank in them at once) give per group size a
    CPU per call and per byte; waiting costs nothing (no busy share); on the timeline a call of
    ``size`` ranks moving B bytes adds ``c + b·B`` to the rank's CPU; the terms round-trip."""
    from atp_pipeline.planning import profile_fit as pf
    from atp_pipeline.run import compute_measure as cm

    c, b = {2: 150e-6, 4: 400e-6}, {2: 0.5e-9, 4: 2e-9}
    pats, timed = [], []
    for d1, d2, dim in ((4, 1, 1), (2, 2, 1), (2, 2, 2)):
        size = d1 if dim == 1 else d2
        for coll in cm.SYNC_COLLECTIVES:
            for nbytes in (16384, 262144, 1048576):
                pats.append((d1, d2, dim, coll, nbytes, 0, pf.SYNC))
                timed.append(pf.Timed(1e-3, c[size] + b[size] * nbytes, {}))
            pats.append((d1, d2, dim, coll, 16384, 4, pf.SYNC))  # loops with compute: not this fit's
            timed.append(pf.Timed(1e-3, 1.0, {}))
    fit = pf.fit_collective_cpu_loops(pats, timed)
    assert fit.busy == {} and fit.per_call == pytest.approx(c, rel=1e-6) and fit.per_byte == pytest.approx(b, rel=1e-6)
    assert fit.call_seconds(4, 1e6) == pytest.approx(400e-6 + 2e-3) and fit.share(4) == 0.0
    assert pf.fit_collective_cpu_loops(pats[3:4], timed[3:4]) is None
    prof = dataclasses.replace(_flat(5.0), collective_cpu=fit)
    back = cp.ComputeProfile.from_config(json.loads(json.dumps(prof.to_config())))
    assert back.collective_cpu.per_byte == pytest.approx(b) and back.collective_cpu.busy == {}
    assert "backend CPU per call 150 us + 0.500 ns/B (2 ranks), 400 us + 2.000 ns/B (4 ranks)" in back.describe()
    with pytest.raises(ConfigError, match=r"collective_cpu.per_byte_ns: group size >= 2 -> finite ns >= 0"):
        cp.ComputeProfile.from_config({**prof.to_config(), "collective_cpu": {"per_byte_ns": {2: -1.0}}})
    term = CommTerm("f1", "x", ALL_REDUCE, 1, Fraction(1), 1, "fwd")
    tl = st._Timeline(cc.CommClock(_two(), (2, 1), 4), prof, 4)
    tl.run([("sync", sp.Coll(term, Fraction(1), 1000)), ("sync", sp.Coll(term, Fraction(1), 1000))], [])
    assert tl.coll_cpu == pytest.approx(2 * (150e-6 + 0.5e-9 * 4000))  # 1000 float32 elements a call


def test_an_earlier_calibrations_busy_shares_are_read_and_named():
    """A profile with busy shares (a share of a core kept busy per second waited): read, named, checked."""
    fit = cp.CollectiveCPU({2: 0.2, 4: 0.5})
    prof = dataclasses.replace(_flat(2.0), collective_cpu=fit)
    back = cp.ComputeProfile.from_config(json.loads(json.dumps(prof.to_config())))
    assert back.collective_cpu.busy == pytest.approx(fit.busy)
    assert "waiting in a collective keeps 20% of a core busy (2 ranks), 50% of a core busy (4 ranks)" in back.describe()
    with pytest.raises(ConfigError, match=r"collective_cpu.busy: group size >= 2 -> share of a core in \[0, 1\]"):
        cp.ComputeProfile.from_config({**prof.to_config(), "collective_cpu": {"busy": {2: 1.5}}})


def test_profile_with_runtime_terms_round_trips_and_names_them():
    probe = cp.Probe("probe_gpt_s", cp.shape_key(GPT), (2, 2), 6, 48)
    prof = cp.ComputeProfile("cal", "measured", _flat(2.0).fits, points={(kn.GEMM, (2, 3, 4)): 7e-6},
                             framework=cp.Framework(30e-6, 0.25, 400e-6, 2e-9),
                             sync=cp.SyncFit(150e-6, 0.125, 0.75), optimizer="AdamW foreach=True",
                             contention={1: 0.5, 4: 1.0}, date="2026-11-26T13:00:00Z", probes=(probe,))
    back = cp.ComputeProfile.from_config(json.loads(json.dumps(prof.to_config())))
    assert back.to_config() == prof.to_config()
    assert dataclasses.astuple(back.framework) == pytest.approx(dataclasses.astuple(prof.framework))
    assert back.probes == (probe,) and back.contention == {1: 0.5, 4: 1.0}
    assert (back.sync.alpha_s, back.sync.per_compute, back.sync.hidden) == pytest.approx((150e-6, 0.125, 0.75))
    line = back.describe(1)
    assert line == ("kernels 'cal' (2026-11-26T13:00:00Z); framework 30.0 us/kernel + 25.0%, 400.0 us + 2.000 ns/B "
                    "per collective; sync 150 us + 0.125 x compute per collective, 75% of overlap hidden; "
                    "optimizer AdamW foreach=True; contention x0.500 at 1 processes (calibrated at 1)")
    reads = dataclasses.replace(prof, framework=cp.Framework(30e-6, 0.25, 400e-6, 2e-9, 120e-6))
    back = cp.ComputeProfile.from_config(json.loads(json.dumps(reads.to_config())))
    assert reads.to_config()["framework"]["per_read_us"] == 120.0 and back.framework.per_read_s == pytest.approx(120e-6)
    assert "400.0 us + 2.000 ns/B per collective, 120.0 us per parameter read;" in back.describe(1)
    with pytest.raises(ConfigError, match=r"framework: .*per_read_us must be finite >= 0"):
        cp.ComputeProfile.from_config({**prof.to_config(), "framework": {"per_kernel_us": 1, "per_read_us": -1}})
    with pytest.raises(ConfigError, match=r"device.compute.sync: alpha_us, per_compute must be finite >= 0"):
        cp.ComputeProfile.from_config({**prof.to_config(), "sync": {"alpha_us": -1}})
    with pytest.raises(ConfigError, match=r"hidden in \[0, 1\]"):
        cp.ComputeProfile.from_config({**prof.to_config(), "sync": {"alpha_us": 1, "hidden": 1.5}})
    with pytest.raises(ConfigError, match=r"framework: per_kernel_us, per_collective_us, .* kernel_factor > -1"):
        cp.ComputeProfile.from_config({**prof.to_config(), "framework": {"per_kernel_us": 1, "kernel_factor": -1}})
    with pytest.raises(ConfigError, match=r"device.compute: unknown key\(s\) dispatch \(a profile of an older schema"):
        cp.ComputeProfile.from_config({**prof.to_config(), "dispatch": {"styles": {"per_kernel_us": 1}}})
    with pytest.raises(ConfigError, match=r"contention: processes >= 1 -> finite factor > 0"):
        cp.ComputeProfile.from_config({**prof.to_config(), "contention": {0: 1.0}})


def test_calibration_fits_recover_the_runtime_terms_exactly():
    """From a sweep of kernel shapes (none a plan's own), probe plans' collective-free steps
    and compute-then-collective loops made by known terms, the fits give those terms back."""
    from atp_pipeline.planning import profile_fit as pf
    from atp_pipeline.run import compute_measure as cm

    kernels = cm.sweep_kernels()
    # optimizer: 40 us + 3 us per tensor + 1 ns per element (foreach: a per-step constant)
    seconds = [40e-6 + 3e-6 * k.dims[0] + 1e-9 * k.work if k.kind == kn.OPTIMIZER else 1e-6 + 1e-9 * k.work
               for k in kernels]
    base = pf.make_profile("x", kernels, seconds, 4)
    opt = base.fits[kn.OPTIMIZER]
    assert (opt.alpha_s, opt.per_tensor_s, opt.per_unit_s) == pytest.approx((40e-6, 3e-6, 1e-9), rel=1e-6)
    plans = cm.plan_points([GPT, LLAMA], 4, [1, 2])
    assert len(plans) == 2 * 3 * 2  # each probe: 3 meshes x 2 chunk counts (one runtime chunks every model)
    want = cp.Framework(20e-6, 0.25, 300e-6, 1e-9, 15e-6)
    plan_s = [pf.framework_seconds(want, pf.plan_features(base, (GPT, LLAMA)[mi], (d1, d2), c))
              for mi, d1, d2, c in plans]
    topo = Topology.from_config({"name": "t4", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1,
                                                          "group_GBps": 1}]})
    patterns = cm.sync_patterns(4)
    assert {(p[0], p[1], p[2]) for p in patterns} == {(4, 1, 1), (2, 2, 1), (2, 2, 2)}  # 1x4's d2 = 4x1's d1
    assert {p[6] for p in patterns} == {pf.SYNC, pf.ASYNC}
    pat_s = []
    for p in patterns:  # 100 us + 0.3 x compute per collective; 40 % of an overlap hidden
        comp, coll = pf.pattern_prediction(base, topo, p)
        d = coll + 100e-6 + 0.3 * comp
        pat_s.append(comp + d if p[6] == pf.SYNC else max(comp + 0.6 * min(comp, d), d))
    prof = pf.make_profile("x", kernels, seconds, 4, [GPT, LLAMA], plans, plan_s, topo, patterns, pat_s,
                           {1: 0.5, 2: 0.5, 4: 1.0}, ["gpt", "llama"])
    assert prof.sync.hidden == pytest.approx(0.4, rel=1e-6)
    fw = prof.framework
    assert dataclasses.astuple(fw) == pytest.approx((20e-6, 0.25, 300e-6, 1e-9, 15e-6), rel=1e-5)
    assert (prof.sync.alpha_s, prof.sync.per_compute) == pytest.approx((100e-6, 0.3), rel=1e-6)
    assert "12 collective-free probe steps of 2 probe models" in prof.source and prof.optimizer.startswith("AdamW")
    assert {p.name for p in prof.probes} == {"gpt", "llama"} and prof.contention[2] == 0.5
    assert {(p.mesh, p.batch, p.seq_len) for p in prof.probes if p.name == "gpt"} == {
        (m, GPT.batch_size, GPT.seq_len) for m in ((4, 1), (2, 2), (1, 4))}


def test_each_collective_call_adds_its_backend_cpu_on_the_timeline():
    """An earlier calibration's per-call cost (no per-byte term) is read back; on the timeline each
    call adds c[size] to the rank's CPU; plan_calls counts a plan's calls by group size."""
    from atp_pipeline.planning import profile_fit as pf

    prof = dataclasses.replace(_flat(5.0), collective_cpu=cp.CollectiveCPU({2: 0.0}, {2: 400e-6}))
    assert cp.ComputeProfile.from_config(prof.to_config()).collective_cpu.per_call == pytest.approx({2: 400e-6})
    term = CommTerm("f1", "x", ALL_REDUCE, 1, Fraction(1), 1, "fwd")
    tl = st._Timeline(cc.CommClock(_two(), (2, 1), 4), prof, 4)
    tl.run([("sync", sp.Coll(term, Fraction(1), 1000)), ("sync", sp.Coll(term, Fraction(1), 1000))], [])
    assert tl.coll_cpu == pytest.approx(2 * 400e-6)
    items = sp.all_items(sp.build_program(GPT, (2, 2), GPT.batch_size, 1)[0])
    assert pf.plan_calls(GPT, (2, 2), 1) == {2: len([i for i in items if i[0] in ("sync", "async", "linear")])}
    # the estimate reports that part of the rank's CPU apart (coll_cpu_s, the validation's predicted_coll_cpu_s)
    est = st.estimate_step(_two(), GPT, (2, 1), st.StepSetting(), prof)
    assert est.coll_cpu_s == pytest.approx(pf.plan_calls(GPT, (2, 1), 1)[2] * 400e-6) and est.cpu_s > est.coll_cpu_s
    assert est.to_dict()["coll_cpu_s"] == est.coll_cpu_s


def test_training_and_its_calibration_and_validation_step_one_optimizer():
    """foreach AdamW on DTensor parameters' local shards in training, in the optimizer the
    calibration times and in the validation's steps."""
    import torch

    from atp_pipeline.lightning.module import LMModuleMixin, adamw

    opt = adamw([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    assert opt.defaults["foreach"] is True and type(opt).__name__ == "LocalShardAdamW"
    root = Path(__file__).resolve().parents[1]
    for src in (root / "benchmarks" / "step_validation.py", root / "atp_pipeline" / "run" / "compute_timing.py"):
        text = src.read_text()
        assert "adamw(" in text and "torch.optim.AdamW(" not in text, src
    assert "adamw(" in Path(LMModuleMixin.configure_optimizers.__code__.co_filename).read_text()


def _count_reads(rank: int, world: int, entries: list) -> list:
    """Each entry's DTensor ``to_local`` calls in one training forward and backward of the runtime's
    model, and its collective calls by ``"collective/axis"`` (the runtime's own counter)."""
    import copy

    import torch
    from torch.distributed.tensor import DTensor

    from atp_pipeline.models.adapter import get_adapter
    from atp_pipeline.parallel import comm_for
    from atp_pipeline.parallel.apply import apply_plan
    from atp_pipeline.run.compute_timing import _mesh

    calls, to_local = [0], DTensor.to_local

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls[0] += 1
        return to_local(self, *args, **kwargs)
    DTensor.to_local = counted
    out = []
    for spec, mesh, chunks in entries:
        adapter = get_adapter(spec["family"])
        torch.manual_seed(0)
        model = copy.deepcopy(adapter.build(spec["model_config"]))
        idx = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq_len"]))
        on = _mesh(*mesh)
        apply_plan(model, adapter.parallel_plan(model), on, chunks)
        calls[0] = 0
        comm_for(on).stats.reset()
        adapter.lm_loss(model, idx, idx).backward()
        out.append((calls[0], {f"{k}/{a}": c.calls for (k, a), c in comm_for(on).stats.totals.items() if c.calls}))
    return out


def _program_calls(shape: Any, mesh: Tuple[int, int], chunks: int) -> Dict[str, int]:
    """The step program's collective calls in the forward and backward by ``"collective/axis"``."""
    out: Dict[str, int] = {}
    for item in sp.all_items(sp.build_program(shape, mesh, shape.batch_size, chunks)[0]):
        if item[0] in ("sync", "async", "linear"):
            key = f"{item[1].term.collective}/d{item[1].term.dim}"
            out[key] = out.get(key, 0) + 1
    return out


def test_the_programs_parameter_reads_are_the_runtimes():
    """``param_reads``: the sharded parameters a step reads (DTensor ``to_local``, each chunk's
    own) are what the runtime reads for the built-in GPT (biases, norm statistics split over d2),
    the transformers Llama (no biases, gathered norms) and GPT-2 (tied head) layouts, at 1 and 2
    chunks, on 2 real processes; the timeline charges the framework's price for each."""
    from atp_pipeline.launch import spawn
    from atp_pipeline.run import compute_measure as cm

    built = cm.compose_models(cm.probe_entries(["probe_gpt_s", "probe_llama", "probe_gpt2"]), CONF)
    entries = [(spec, mesh, c) for _, spec in built for mesh in ((2, 1), (1, 2)) for c in (1, 2)]
    got = spawn(_count_reads, 2, entries, timeout=300)[0]
    want = [sp.param_reads(shape, c) for shape, _ in built for _ in ((2, 1), (1, 2)) for c in (1, 2)]
    assert [reads for reads, _ in got] == want == [17, 29, 17, 29, 9, 16, 9, 16, 11, 19, 11, 19]
    # and the program's collective calls are the runtime's (multi-head and grouped-query heads scattered)
    assert [calls for _, calls in got] == [_program_calls(shape, mesh, c) for shape, _ in built
                                           for mesh in ((2, 1), (1, 2)) for c in (1, 2)]
    prog = sp.build_program(GPT, (2, 1), GPT.batch_size, 2)[0]
    assert prog.reads == sp.param_reads(GPT, 2) == 2 * 2 * 12 + 5
    base = dataclasses.replace(_flat(5.0), framework=cp.Framework(0.0))
    read = dataclasses.replace(base, framework=cp.Framework(0.0, per_read_s=10e-6))
    two = cc.CommClock(_two(), (2, 1), 4)
    assert (st._run(prog, two, read, 4).compute - st._run(prog, two, base, 4).compute) == pytest.approx(53 * 10e-6)


def test_the_programs_collective_calls_are_the_runtimes_on_four_processes():
    """The step program lists the collective calls the runtime sends, not only
    their bytes (a collective's backend CPU and α are per call): key/value heads picked per rank
    (grouped-query ``probe_llama`` on 2x2: their gradients summed over d2, keys and values in a call
    each), gathered over d1 (on 4x1: keys and values each gathered, each gradient summed), and a
    multi-head core on 2x2 (q, k and v scattered in one call); 4 real processes, chunks 1 and 2.
    One call per cost-model term would be wrong (gpt2 2x2: 33 calls against the runtime's 31, a
    grouped-query Llama 41 against 43)."""
    from atp_pipeline.launch import spawn
    from atp_pipeline.planning.shape import KV_GATHERED, KV_PICK, KV_SCATTER, kv_placement
    from atp_pipeline.run import compute_measure as cm

    (llama, llama_spec), (gpt2, gpt2_spec) = cm.compose_models(cm.probe_entries(["probe_llama", "probe_gpt2"]), CONF)
    points = [(llama, llama_spec, (2, 2), 2), (llama, llama_spec, (4, 1), 2), (gpt2, gpt2_spec, (2, 2), 2),
              (llama, llama_spec, (1, 4), 1)]
    assert [kv_placement(sh, *m) for sh, _, m, _ in points] == [KV_PICK, KV_GATHERED, KV_SCATTER, KV_PICK]
    got = spawn(_count_reads, 4, [(spec, m, c) for _, spec, m, c in points], timeout=300)[0]
    assert [calls for _, calls in got] == [_program_calls(sh, m, c) for sh, _, m, c in points]
    assert [sum(calls.values()) for _, calls in got] == [43, 18, 31, 18]
    assert [reads for reads, _ in got] == [sp.param_reads(sh, c) for sh, _, _, c in points]
    with pytest.raises(ValueError, match="one call of different collectives"):
        sp.one_call(*(sp.Coll(CommTerm(op, "x", kind, dim, Fraction(1), 1, "bwd"), Fraction(1), 8)
                      for op, kind, dim in (("a", ALL_REDUCE, 2), ("b", "all_gather", 2))))


def test_calibration_times_the_runtime_terms_on_processes():
    """The measuring half on 2 real processes: foreach AdamW on DTensors' shards on a mesh, the
    runtime's collective-free forward and backward of a plan, a compute-then-collective loop."""
    from atp_pipeline.run import compute_measure as cm
    from atp_pipeline.run import compute_timing as ct

    (tiny, spec), = cm.compose_models(cm.probe_entries(["probe_gpt_s"]), CONF)
    assert (tiny.hidden, tiny.layers, tiny.batch_size, tiny.seq_len) == (48, 1, 6, 48)
    plans = [p for p in cm.plan_points([tiny], 2, [2]) if p[1:3] == (2, 1)]
    patterns = [p for p in cm.sync_patterns(2) if p[3] == "all_gather" and p[5] == 1][:2]
    kernels = [kn.Kernel(kn.OPTIMIZER, (4, 1000))]
    got, timed, foreign = ct.measure_all(kernels, 2, passes=1, batch_ms=1.0, timeout=120, plans=plans,
                                         models=[spec], patterns=patterns, live=plans)
    assert len(got) == 5 and all(0 < t < 5 for t in got)
    assert all(t.cpu > 0 for t in timed) and set(timed[-1].waits) == {2} and not timed[1].waits  # the live step waited
    assert len(foreign) == 1 and foreign[0] >= 0  # other jobs' load in the kept pass, in cores


def test_bounded_least_squares_is_the_constrained_optimum():
    """One fit routine (planning.lstsq.bounded_lstsq) for every calibration: free
    coefficients where the data put them inside their bounds, at the bound otherwise."""
    import numpy as np

    from atp_pipeline.planning.lstsq import bounded_lstsq, nnls

    rng = np.random.default_rng(0)
    A = rng.uniform(0.5, 2.0, (40, 2))
    y = A @ np.array([-0.4, 3.0])
    assert bounded_lstsq(A, y, [-0.95, 0.0]) == pytest.approx([-0.4, 3.0], rel=1e-9)
    clamped = bounded_lstsq(A, y, [0.0, 0.0])  # the non-negative fit: first at its bound, second refitted
    assert clamped[0] == 0.0 and clamped == pytest.approx(nnls(A, y))
    x2, *_ = np.linalg.lstsq(A[:, 1:], y, rcond=None)
    assert clamped[1] == pytest.approx(x2[0], rel=1e-12)
    with pytest.raises(ValueError, match="2 columns but 1 lower bounds"):
        bounded_lstsq(A, y, [0.0])




def test_a_calibration_is_priced_at_the_host_speed_timed_now(tmp_path):
    """A host speed scales the kernel prices by its ``compute`` ratio and the per-call prices
    (framework, collectives' backend CPU, sync extra) by its ``overhead`` ratio, ratios unchanged;
    the plan's notes say it. A profile without a reference is used at its calibration's speed,
    flagged; one whose reference lacks the probes' steps, or still has the kernel groups of an
    older calibration beside them, is refused in one line naming stage=calibrate; a re-timed profile
    is never written."""
    from types import SimpleNamespace

    from atp_pipeline.planning.alphabeta_fit import write_topology
    from atp_pipeline.run.calibration import with_calibration

    recorded = {"steps": {"p 2x1/c1 on 2": 0.01}}  # the probes' steps at calibration
    speed = cp.HostSpeed(1.2, 1.5, "2026-11-27T11:00:00Z", 4)  # a compute and a per-call ratio apart
    ab = [{"level": "p", "alpha_us": 40.0, "GBps": 1.0}]
    prof = cp.ComputeProfile("cal", "measured", _flat(100.0).fits, points={(kn.GEMM, (8, 8, 8)): 50e-6},
                             processes=4, cores=2, kernel_time="cpu", peak_flops=6e9,
                             framework=cp.Framework(30e-6, 0.25, 400e-6, 2e-9, 10e-6),
                             sync=cp.SyncFit(150e-6, 0.125, 0.75),
                             collective_cpu=cp.CollectiveCPU({}, {2: 100e-6, 4: 200e-6}, {2: 1e-9}),
                             contention={1: 0.5, 4: 1.0}, reference=recorded)
    fast = prof.at_speed(speed)
    gemm, big = kn.Kernel(kn.GEMM, (8, 8, 8)), kn.Kernel(kn.NORM_FWD, (4096,))
    assert fast.seconds(gemm) == pytest.approx(60e-6) and fast.seconds(big) == pytest.approx(120e-6)
    assert fast.peak_flops == pytest.approx(5e9) and fast.contention == prof.contention
    assert dataclasses.astuple(fast.framework) == pytest.approx((45e-6, 0.25, 600e-6, 3e-9, 15e-6))
    assert fast.read_seconds(4) == pytest.approx(60e-6) and prof.read_seconds(4) == pytest.approx(40e-6)
    assert (fast.sync.alpha_s, fast.sync.per_compute, fast.sync.hidden) == pytest.approx((225e-6, 0.125, 0.75))
    assert fast.collective_cpu.call_seconds(4, 1000.0) == pytest.approx(300e-6 + 1.5e-6)
    assert fast.step_kernel_seconds(gemm) == pytest.approx(60e-6 * 1.25 + 45e-6)
    # both ratios 2: a rank's compute, its CPU and its collectives' CPU exactly twice; the alpha-beta not
    four = Topology.from_config({"name": "t", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1, "group_GBps": 1}],
                                 "alpha_beta": ab})
    base = st.estimate_step(four, GPT, (2, 2), st.StepSetting(), prof)
    twice = st.estimate_step(four, GPT, (2, 2), st.StepSetting(), prof.at_speed(cp.HostSpeed(2.0, 2.0, "now", 4)))
    assert twice.cpu_s == pytest.approx(2 * base.cpu_s)
    two = [st.estimate_step(four.restrict(2), GPT, (2, 1), st.StepSetting(), p)  # a core each: the compute itself
           for p in (prof, prof.at_speed(cp.HostSpeed(2.0, 2.0, "now")))]
    assert not two[0].host_bound and two[1].compute_s == pytest.approx(2 * two[0].compute_s)
    assert ("host speed re-timed now: the probes' whole steps on 4 processes ran x2.000 the calibrated model's "
            "time for them") in twice.calibration
    back = cp.ComputeProfile.from_config(json.loads(json.dumps(prof.to_config()))).reference
    assert {g: dict(v) for g, v in back.items()} == {g: pytest.approx(v) for g, v in recorded.items()}
    with pytest.raises(ConfigError, match="is re-timed .*write the calibration's own profile"):
        fast.to_config()
    with pytest.raises(ConfigError, match="already at a re-timed speed"):
        fast.at_speed(speed)
    # a calibration file whose reference has no probe steps (what stage=plan times again), or has the
    # kernel groups an older calibration recorded beside them, is of an older format: refused in one
    # line naming stage=calibrate
    path = tmp_path / "t.yaml"
    bare = Topology.from_config({"name": "t", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1, "group_GBps": 1}]})
    kernels = {"compute": {"gemm 512x256x256": 1e-3}, "overhead": {"gemm 32x16x16": 1e-5}}
    for reference, why in ((kernels, "reference without the probes' steps"),
                           ({**kernels, **recorded}, "reference with group(s) compute, overhead beside the "
                                                     "probes' steps")):
        older = dataclasses.replace(prof, reference=reference).to_config()
        write_topology({"name": "t", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1, "group_GBps": 1}],
                        "alpha_beta": ab, "device": {"name": "cpu", "compute": older}}, path)
        says = f"a compute profile of an older format ({why}) (calibrate again: python train.py stage=calibrate)"
        with pytest.raises(ConfigError) as err:
            with_calibration(bare, SimpleNamespace(use=True, dir=str(tmp_path), retime=False, retime_s=60.0))
        assert str(err.value) == f"calibration file {path}: device.compute: {says}"
        with pytest.raises(ConfigError) as err:
            cp.ComputeProfile.from_config(json.loads(json.dumps(older)))
        assert str(err.value) == f"device.compute: {says}"
    old = {**prof.to_config()}
    del old["reference"]
    write_topology({"name": "t", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1, "group_GBps": 1}],
                    "alpha_beta": ab, "device": {"name": "cpu", "compute": old}}, path)
    off = with_calibration(bare, SimpleNamespace(use=True, dir=str(tmp_path), retime=False, retime_s=60.0))
    assert "host_speed" not in off.device and "calibration.retime=true times the host again" in off.note
    with pytest.raises(ConfigError, match=r"^calibration.retime: calibration .* recorded no probe steps"):
        with_calibration(bare, SimpleNamespace(use=True, dir=str(tmp_path), retime=True, retime_s=60.0))


def test_the_host_speed_on_the_steps_basis_is_the_probes_whole_steps_now_over_at_calibration(tmp_path, monkeypatch):
    """the profile's reference records the probes' whole steps (label ->
    seconds, ``"<probe> <d1>x<d2>/c<chunks> on <processes>"``); timed again on a process count, the
    geometric mean of now / then over that count's labels is one ratio for every price, so a
    CPU-form step scales by it exactly; two speeds on different process counts never make a span;
    a plan's re-timing is reused only on the same process count."""
    from types import SimpleNamespace

    from atp_pipeline.planning.alphabeta_fit import write_topology
    from atp_pipeline.run.calibration import file_digest, with_calibration

    then = {"p 2x1/c1 on 2": 0.01, "p 1x2/c1 on 2": 0.02, "p 4x1/c1 on 4": 0.04, "q 2x2/c2 on 4": 0.05}
    now = {"p 2x1/c1 on 2": 0.012, "p 1x2/c1 on 2": 0.03, "p 4x1/c1 on 4": 0.02, "other 2x1/c1 on 2": 1.0}
    two = cp.steps_speed(then, now, 2, "t")
    assert (two.compute, two.overhead) == pytest.approx((math.sqrt(1.2 * 1.5),) * 2)
    assert (two.processes, two.measured) == (2, "t") and two.to_dict()["basis"] == "steps"
    assert cp.steps_speed(then, now, 4).compute == pytest.approx(0.5)  # q not timed again: p's alone
    assert two.describe() == f"host speed re-timed t: the probes' whole steps on 2 processes ran x{two.compute:.3f} " \
                             "the calibrated model's time for them"
    assert cp.HostSpeed.from_dict(two.to_dict()) == two
    assert cp.HostSpeed.from_dict({"compute": 1.2, "overhead": 1.5}) == cp.HostSpeed(1.2, 1.5)  # on no count
    assert cp.parse_step_label("probe_gpt_s 2x1/c2 on 2") == ("probe_gpt_s", (2, 1), 2, 2)
    assert cp.step_label("probe_gpt_s", (2, 1), 2, 2) == "probe_gpt_s 2x1/c2 on 2"
    assert cp.step_processes(then) == [2, 4]
    assert [cp.steps_count(then, n) for n in (1, 2, 3, 4, 8)] == [2, 2, 4, 4, 4]  # the nearest (ties: the larger)
    with pytest.raises(ConfigError, match=r"^host speed: no probe step on 8 processes timed both at calibration "
                                          r"and now \(calibrated on \[2, 4\]"):
        cp.steps_speed(then, now, 8)
    with pytest.raises(ConfigError, match="probe step label 'p 2x1 on 2'"):
        cp.step_processes({"p 2x1 on 2": 1.0})
    with pytest.raises(ConfigError, match="a span between two probes on different process counts"):
        cp.HostSpeed.over([two, cp.HostSpeed(1.0, 1.0, "t2")])
    with pytest.raises(ConfigError, match=r"host speed: ratios > 0 \(got 1.0, 0.0\)"):
        cp.HostSpeed(1.0, 0.0)
    span = cp.HostSpeed.over([two, cp.steps_speed(then, {"p 2x1/c1 on 2": 0.01, "p 1x2/c1 on 2": 0.02}, 2, "t2")])
    assert span.compute == pytest.approx(math.sqrt(two.compute)) and span.processes == 2
    # a point measured in several launches: the launches' speeds' geometric mean, first start to last end
    spans = [cp.HostSpeed(r, r, f"t{2 * i} .. t{2 * i + 1}", 2) for i, r in enumerate((0.8, 1.25, 1.0))]
    over = cp.HostSpeed.over(spans)
    assert over.compute == pytest.approx(1.0) and over.measured == "t0 .. t5" and over.processes == 2
    with pytest.raises(ConfigError, match="a span between two probes on different process counts"):
        cp.HostSpeed.over([*spans, cp.HostSpeed(1.0, 1.0, "t6", 4)])
    # the step of the CPU form x the ratio, exactly
    ab = [{"level": "p", "alpha_us": 40.0, "GBps": 1.0}]
    anchored = cp.CpuStep({4: {"2x2/c1": 2.0}}, {4: {"2x2/c1": (1.1, 1e-3)}}, {4: {"2x2/c1": 2e-3}})
    prof = cp.ComputeProfile("cal", "measured", _flat(100.0).fits, processes=4, cores=2, kernel_time="cpu",
                             framework=cp.Framework(30e-6, 0.25, 400e-6, 2e-9, 10e-6),
                             collective_cpu=cp.CollectiveCPU({}, {2: 100e-6, 4: 200e-6}, {2: 1e-9}),
                             reference={"steps": then},
                             step_residual=cp.StepResidual({4: {1: 1.0}}, {4: {1: 1.0}}, anchored=anchored, form="cpu"))
    four = Topology.from_config({"name": "t", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1, "group_GBps": 1}],
                                 "alpha_beta": ab})
    base = st.estimate_step(four, GPT, (2, 2), st.StepSetting(), prof)
    fast = st.estimate_step(four, GPT, (2, 2), st.StepSetting(), prof.at_speed(cp.steps_speed(then, now, 4, "n")))
    assert fast.step_s == pytest.approx(0.5 * base.step_s, rel=1e-12)
    back = cp.ComputeProfile.from_config(json.loads(json.dumps(prof.to_config()))).reference
    assert dict(back["steps"]) == pytest.approx(then)
    # stage=plan's path: a cached re-timing is reused on its process count only
    path = tmp_path / "t.yaml"
    write_topology({"name": "t", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1, "group_GBps": 1}],
                    "alpha_beta": ab, "device": {"name": "cpu", "compute": prof.to_config()}}, path)
    bare = Topology.from_config({"name": "t", "levels": [{"name": "p", "count": 4, "p2p_GBps": 1, "group_GBps": 1}]})
    cal = SimpleNamespace(use=True, dir=str(tmp_path), retime=True, retime_s=60.0)
    cached = {"sha256": file_digest(path), "epoch": __import__("time").time()}
    (tmp_path / "t_speed.json").write_text(json.dumps({**cached, **cp.HostSpeed(0.5, 0.5, "c", 4).to_dict()}))
    topo = with_calibration(bare, cal)
    assert cp.HostSpeed.from_dict(topo.device["host_speed"]) == cp.HostSpeed(0.5, 0.5, "c", 4)
    assert "the probes' whole steps on 4 processes ran x0.500" in topo.note and "reused" in topo.note
    from atp_pipeline.run import retime as hs

    timed = []
    monkeypatch.setattr(hs, "retime_steps",
                        lambda profile, processes, topo: (timed.append(processes)
                                                          or cp.HostSpeed(0.7, 0.7, "d", 4)))
    # another count; an older re-timing of a calibration's kernels (on no process count)
    for other in (cp.HostSpeed(0.5, 0.5, "c", 2).to_dict(), {"compute": 0.5, "overhead": 0.6, "measured": "c"}):
        (tmp_path / "t_speed.json").write_text(json.dumps({**cached, **other}))
        assert with_calibration(bare, cal).device["host_speed"]["compute"] == 0.7
    assert timed == [4, 4]


def test_an_mlp_activation_is_priced_by_the_kernels_its_code_runs():
    """GPT-2's tanh GELU is written in Python (transformers' ``NewGELUActivation``): 8 kernels
    forward and 11 backward over the MLP's whole intermediate, where ``nn.GELU``/``nn.SiLU`` run one
    each (counted with a dispatch mode, :func:`atp_pipeline.models.op_count.pointwise_kernels`). The
    HF layout reads the count off the MLP's own activation module (any family: no name is asked), the
    shape carries it (``act_kernels``) and the step program prices that many elementwise kernels:
    a GPT-2 MLP 7 more forward and 10 more backward per layer and chunk than a fused one."""
    import torch
    from transformers.activations import ACT2FN

    from atp_pipeline.models.op_count import pointwise_kernels
    from atp_pipeline.run.compute_measure import compose_models
    from benchmarks.step_validation import variant_overrides

    assert pointwise_kernels(ACT2FN["gelu_new"]) == (8, 11)
    assert pointwise_kernels(torch.nn.GELU()) == pointwise_kernels(torch.nn.SiLU()) == (1, 1)
    assert pointwise_kernels(torch.nn.Dropout(0.0)) == (0, 0)  # returns its input: no kernel
    assert pointwise_kernels(torch.nn.LayerNorm(8)) is None  # parameters: not an activation
    shapes = {m: compose_models([(m, variant_overrides(m, 4, 16, CONF))], CONF)[0][0]
              for m in ("gpt2_tiny", "llama_tiny", "small")}
    assert {m: s.act_kernels for m, s in shapes.items()} == {"gpt2_tiny": (8, 11), "llama_tiny": (1, 1),
                                                             "small": (1, 1)}
    gpt2 = shapes["gpt2_tiny"]
    fused = dataclasses.replace(gpt2, act_kernels=(1, 1))
    for mesh, chunks in (((2, 1), 1), ((1, 2), 2), ((2, 2), 2)):
        size = gpt2.batch_size * gpt2.seq_len // chunks * gpt2.ffn // mesh[0]

        def count(shape: ModelShape, blocks: str) -> int:
            prog = sp.build_program(shape, mesh, shape.batch_size, chunks)[0]
            return sum(1 for layer in getattr(prog, blocks) for chunk in layer for i in chunk
                       if i[0] == "k" and i[1].kind == kn.POINTWISE and i[1].dims == (size,))
        assert count(gpt2, "blocks_fwd") - count(fused, "blocks_fwd") == 7 * gpt2.layers * chunks
        assert count(gpt2, "blocks_bwd") - count(fused, "blocks_bwd") == 10 * gpt2.layers * chunks
    with pytest.raises(ValueError, match="act_kernels must be two counts >= 0"):
        dataclasses.replace(gpt2, act_kernels=(1, -1))


def test_plan_times_the_host_only_when_asked_or_when_the_calibration_is_stale(tmp_path, monkeypatch, capsys):
    """``stage=plan``/``stage=fit`` price at the calibration's own speed and start no process unless
    ``calibration.retime`` asks, or the calibration is stale (measured on another host, or more than
    ``calibration.stale_days`` days ago; 0: never), which one printed line says."""
    from types import SimpleNamespace

    from atp_pipeline.run import calibration
    from atp_pipeline.run import retime as hs

    data = yaml.safe_load((DATA / "step_calibration.yaml").read_text())
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(data))
    bare = Topology.from_config({k: data[k] for k in ("name", "levels")})
    calls = []
    monkeypatch.setattr(hs, "retime_steps",
                        lambda profile, n, topo: calls.append(n) or cp.HostSpeed(1.25, 1.25, "now", n))

    def plan(host: str, stale_days: float, retime: bool = False) -> Topology:
        monkeypatch.setattr(calibration, "_host", lambda: host)
        return calibration.with_calibration(bare, SimpleNamespace(use=True, dir=str(tmp_path), retime=retime,
                                                                  retime_s=0.0, stale_days=stale_days))

    fresh = plan("vm", 1e6)  # measured on this host, recently
    assert calls == [] and "host_speed" not in fresh.device and capsys.readouterr().out == ""
    assert "calibration.retime=true times the host again" in fresh.note
    assert plan("elsewhere", 0.0).device.get("host_speed") is None and calls == []  # 0: never stale
    moved = plan("elsewhere", 1e6)
    out = capsys.readouterr().out.strip().splitlines()
    assert calls == [4] and cp.profile_of(moved).speed.compute == 1.25
    assert out == ["note: the calibration is stale (measured on host 'vm', not 'elsewhere'): timing the host's speed "
                   "now; `python train.py stage=calibrate` measures it again"]
    old = plan("vm", 1.0)  # measured more than a day ago
    assert calls == [4, 4] and "stale calibration (measured" in old.note and "calibration.stale_days=1" in old.note
    asked = plan("vm", 1e6, retime=True)
    assert calls == [4, 4, 4] and cp.profile_of(asked).speed is not None
