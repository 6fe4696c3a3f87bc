"""SBP plans executed with DTensor (issue 8 items 5 and 6).

* Item 5: the plans the SBP search chooses for an MLP stack, a GPT layer and a 2-layer GPT
  on 4 and 8 processes — plus hand-picked strategies (3-D ones, Partial outputs, other mesh
  orders, row splits changing between layers) — give the dense model's loss and every
  gradient to 1e-9 relative in float64. One launch per process count.
* Item 6: ``stage=plan planner=sbp`` writes the SBP plan report; ``planner=sbp`` trains through
  the Lightning strategy and reproduces the single-process losses; bad input is one line.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.launch import spawn
from atp_pipeline.models.gpt import GPT, GPTConfig
from atp_pipeline.planning.sbp import AlphaBeta, Strategy, compile_problem, mlp, search, transformer
from atp_pipeline.planning.sbp.layout import SBPLayout, check_transformer_layout, plan_mesh_shape

from .conftest import run_train

AB = AlphaBeta.uniform(alpha=5e-6, beta=1e-10)
GCFG = GPTConfig(vocab_size=64, seq_len=8, hidden=16, heads=8, layers=2)
BATCH = 4
MLP_DIMS = ([16, 64, 64, 16], 8)
Case = Tuple[str, str, Any, SBPLayout]  # name, kind (mlp/gpt), dims or layers, plan


def _chosen(layers, p: int) -> Tuple[SBPLayout, float]:
    """The exhaustive search's optimum (tiny spaces) and the search time."""
    pr = compile_problem(layers, p, AB)
    t0 = time.perf_counter()
    res = search(pr, "exhaustive", 10)
    assert res.complete
    return SBPLayout.from_search(pr, res), time.perf_counter() - t0


def _s(pb: int, pm: int, pn: int, order: str = "bmn") -> Strategy:
    return Strategy(pb, pm, pn, tuple(order))  # type: ignore[arg-type]


def cases(p: int) -> List[Case]:
    """The search's choices for the MLP stack and for the (tied) GPT layer, then
    hand-picked strategies: Partial outputs, 3-D ones, other mesh orders, row splits that
    change between layers (all-to-all)."""
    dims, batch = MLP_DIMS
    mlp_plan, _ = _chosen(mlp(dims, batch), p)
    layers = GCFG.layers if p == 4 else 1  # 8 ranks on 2 cores: one layer (DTensor's dispatch is per op)
    gpt_plan, _ = _chosen(transformer(layers, GCFG.hidden, GCFG.heads, GCFG.seq_len, BATCH), p)
    out: List[Case] = [("mlp chosen", "mlp", (dims, batch), mlp_plan),
                       ("gpt chosen", "gpt", layers, gpt_plan)]
    if p == 4:
        mlp_forced = [
            ("row-only (Partial outputs)", [_s(1, 1, 4)] * 3),
            ("mixed 2-D, other orders", [_s(2, 1, 2), _s(1, 2, 2, "nbm"), _s(4, 1, 1)]),
        ]
        gpt_forced = ("data+row, n outer", {"qkv": _s(2, 1, 2, "nbm"), "proj": _s(4, 1, 1),
                                            "fc1": _s(2, 2, 1), "fc2": _s(1, 2, 2, "nmb")})
    else:
        mlp_forced = [
            ("3-D (2,2,2) everywhere", [_s(2, 2, 2)] * 3),
            ("3-D mixed orders, row splits", [_s(2, 2, 2, "nmb"), _s(4, 1, 2), _s(1, 1, 8)]),
        ]
        gpt_forced = ("3-D attention, 2-D MLP", {"qkv": _s(2, 2, 2, "nbm"), "proj": _s(1, 1, 8),
                                                 "fc1": _s(4, 2, 1), "fc2": _s(2, 1, 4, "bnm")})
    for name, strat in mlp_forced:
        out.append((f"mlp {name}", "mlp", (dims, batch),
                    SBPLayout(p, {f"fc{i}": s for i, s in enumerate(strat)})))
    # one layer: the forced strategies are per layer (what changes between layers is the MLP cases')
    out.append((f"gpt {gpt_forced[0]}", "gpt", 1 if p == 8 else GCFG.layers, SBPLayout(p, gpt_forced[1])))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def run_cases(rank: int, world: int, todo: List[Case]) -> List[Dict[str, Any]]:
    """Worker: every case against the dense model (float64), same seeds on every rank."""
    from atp_pipeline.models.gpt.sbp import SBPGPT
    from atp_pipeline.parallel.sbp_exec import SBPMLP

    torch.set_default_dtype(torch.float64)
    results = []
    for name, kind, spec, plan in todo:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        if kind == "mlp":
            dims, batch = spec
            dense = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
            x, t = torch.randn(batch, dims[0]), torch.randn(batch, dims[-1])
            h = x
            for i, lin in enumerate(dense):
                h = lin(h) if i + 1 == len(dense) else F.gelu(lin(h))
            ref = ((h - t) ** 2).sum() / t.numel()
            ref.backward()
            ref_grads = {f"layers.{n}": p.grad for n, p in dense.named_parameters()}
            model = SBPMLP(list(dense), plan)
            y = model(x)
            from torch.distributed.tensor import DTensor, Replicate

            t_dt = DTensor.from_local(t, y.device_mesh, [Replicate()] * y.device_mesh.ndim)
            # (F.mse_loss's mean on sharded DTensors scales gradients by the shard count in
            # torch 2.13; a sum is exact)
            loss = (((y - t_dt.redistribute(y.device_mesh, y.placements)) ** 2).sum() / t.numel()).full_tensor()
        else:
            cfg = GPTConfig(GCFG.vocab_size, GCFG.seq_len, GCFG.hidden, GCFG.heads, spec)
            dense = GPT(cfg)
            g = torch.Generator().manual_seed(1)
            idx = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=g)
            tgt = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=g)
            ref = dense(idx, tgt)
            ref.backward()
            ref_grads = {n: p.grad for n, p in dense.named_parameters()}
            model = SBPGPT(dense, plan)
            loss = model(idx, tgt)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        errs = {n: _rel(grads[n].full_tensor(), ref_grads[n]) for n in grads}
        results.append({
            "name": name, "seconds": time.perf_counter() - t0, "mesh": tuple(model.mesh.shape), "names_match": sorted(grads) == sorted(ref_grads),
            "loss_rel": abs(loss.item() - ref.item()) / abs(ref.item()),
            "grad_rel": max(errs.values()), "worst": max(errs, key=errs.get),
            "grad_placements_ok": all(tuple(p.grad.placements) == tuple(p.placements)
                                      for p in model.parameters()),
            "placements": {n: str(tuple(p.placements)) for n, p in model.named_parameters()},
        })
    return results


@pytest.fixture(scope="module", params=[4, 8], ids=["4 processes", "8 processes"])
def executed(request) -> Tuple[List[Case], List[List[Dict[str, Any]]]]:
    todo = cases(request.param)
    return todo, spawn(run_cases, request.param, todo, timeout=900)


def test_sbp_plans_match_the_dense_model(executed) -> None:
    todo, runs = executed
    world = len(runs)
    for (name, kind, _, plan), r in zip(todo, runs[0]):
        print(f"\n[sbp exec p={world}] {name}: mesh {r['mesh']}, {plan.label()}: loss rel "
              f"{r['loss_rel']:.2e}, max grad rel {r['grad_rel']:.2e} ({r['worst']})", end="")
    for rank_runs in runs:
        assert [r["name"] for r in rank_runs] == [c[0] for c in todo]
        for r in rank_runs:
            assert r["names_match"], r["name"]
            assert r["loss_rel"] <= 1e-9, r
            assert r["grad_rel"] <= 1e-9, (r["name"], r["worst"], r["grad_rel"])
            assert r["grad_placements_ok"], r["name"]
            assert 1 <= len(r["mesh"]) <= 3 and torch.Size(r["mesh"]).numel() == world


def test_placements_follow_the_strategy(executed) -> None:
    todo, runs = executed
    if len(runs) != 8:
        pytest.skip("checked on the 8-process 3-D case")
    r = next(r for r in runs[0] if r["name"] == "mlp 3-D (2,2,2) everywhere")
    assert r["mesh"] == (2, 2, 2)
    # §4.2.2: W = (B:pb, S1:pm, S0:pn) as nn.Linear's out x in weight
    assert r["placements"]["layers.0.weight"] == "(Replicate(), Shard(dim=0), Shard(dim=1))"


def test_plan_mesh_and_bad_plans() -> None:
    assert plan_mesh_shape([_s(8, 1, 1)], 8) == (8,)
    assert plan_mesh_shape([_s(4, 2, 1), _s(2, 4, 1)], 8) == (2, 2, 2)
    assert plan_mesh_shape([_s(1, 1, 1)], 1) == (1,)
    with pytest.raises(ConfigError, match="no single row-major device mesh refines"):
        plan_mesh_shape([_s(2, 3, 1), _s(3, 2, 1)], 6)
    with pytest.raises(ConfigError, match="uses 4 devices, the plan has 8"):
        SBPLayout(8, {"fc0": _s(2, 2, 1)})
    good = {k: _s(1, 2, 2) for k in ("qkv", "proj", "fc1", "fc2")}
    with pytest.raises(ConfigError, match="6 heads do not split over the QKV layer's pm\\*pn"):
        check_transformer_layout(SBPLayout(4, good), hidden=24, heads=6, ffn_mult=4)
    with pytest.raises(ConfigError, match="missing fc2"):
        check_transformer_layout(SBPLayout(4, {k: good[k] for k in ("qkv", "proj", "fc1")}), 16, 8, 4)
    plan = SBPLayout(4, good)
    assert SBPLayout.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


# ---------------------------------------------------------------------- item 6: planner=sbp
FAST = ["model.seq_len=32", "trainer.progress_bar=false", "planner.plot=false"]


def test_stage_plan_mesh_sbp_reports_layers_and_collectives(tmp_path) -> None:
    out = run_train(["stage=plan", "planner=sbp", *FAST, f"hydra.run.dir={tmp_path}"], cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SBP plan: topology 'local' (4 devices)" in out.stdout and "predicted communication" in out.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["strategy"] == "sbp" and plan["world_size"] == 4
    assert [lay["tie"] for lay in plan["layers"]] == ["qkv", "proj", "fc1", "fc2"]
    for lay in plan["layers"]:
        s = lay["strategy"]
        assert s["pb"] * s["pm"] * s["pn"] == 4 and set(lay["communication"]) == {
            "all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
        assert len(lay["device_mesh_placements"]["W"]) == len(plan["device_mesh"])
    assert set(plan["communication"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    total = sum(c["seconds"] for c in plan["communication"].values())
    assert total == pytest.approx(plan["cost_s"])
    assert SBPLayout.from_dict(plan["execution_plan"]).devices == 4
    text = (tmp_path / "plan.txt").read_text()
    assert "SBP plan" in text and "all_reduce" in text
    assert json.loads((tmp_path / "summary.json").read_text())["strategy"] == "sbp"


def test_paper_size_sbp_plan_is_fast(compose_cfg, tmp_path) -> None:
    from atp_pipeline.run import run

    cfg = compose_cfg("stage=plan", "planner=sbp", "topology=ic4", "model=m3", "planner.plot=false")
    t0 = time.perf_counter()
    row = run(cfg, tmp_path)
    elapsed = time.perf_counter() - t0
    print(f"\n[sbp plan] m3 on ic4 (16 devices): {row['selected']}, {row['t_comm_s'] * 1e3:.2f} ms "
          f"comm/step, planned in {elapsed:.2f} s (search {row['search_s'] * 1e3:.1f} ms)")
    assert row["world_size"] == 16 and row["t_comm_s"] > 0 and elapsed < 30


@pytest.mark.parametrize("overrides, message", [
    (["trainer.devices=3"], "planner=sbp: model 'tiny' on 3 devices: sbp: layer 'block0.qkv'"),
    (["mesh.dp=2"], "planner=sbp plans data parallelism per layer itself: it needs mesh.dp=1"),
    (["overlap=chunk2"], "overlap=chunk1 (got chunks=2)"),
    (["topology.device.memory_GB=0.000001"], "no SBP plan of model 'tiny' on 4 devices fits"),
])
def test_bad_sbp_input_is_one_config_error(compose_cfg, overrides, message) -> None:
    from atp_pipeline.run.resolve import resolve

    cfg = compose_cfg("planner=sbp", *overrides)
    with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace(")", "\\)")):
        resolve(cfg)


def test_bad_sbp_input_exits_2_before_any_process(tmp_path) -> None:
    out = run_train(["planner=sbp", "trainer.devices=3", *FAST], cwd=tmp_path, timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: planner=sbp: model 'tiny' on 3 devices"), out.stderr
    assert "has no legal strategy on 3 devices" in lines[0]
    assert not list(tmp_path.rglob("metrics.csv"))


def test_fit_mesh_sbp_equals_the_dense_run(compose_cfg, tmp_path) -> None:
    """4 processes under the SBP plan vs the single-process dense GPT (float32: Lightning's
    ModelParallelStrategy has no 64-true precision; AdamW, 8 steps)."""
    from atp_pipeline.run.fit import fit
    from atp_pipeline.run.report import read_metrics
    from atp_pipeline.run.resolve import resolve

    runs = {}
    for name, extra in (("dense", ["trainer.devices=1"]), ("sbp", ["planner=sbp"])):
        out = tmp_path / name
        cfg = compose_cfg(*FAST, "trainer.max_steps=8", *extra, f"paths.output_dir={out}")
        runs[name] = fit(resolve(cfg), out)
        runs[name]["losses"] = [r["loss"] for r in read_metrics(out / "metrics.csv") if "loss" in r]
    dense, sbp = runs["dense"]["losses"], runs["sbp"]["losses"]
    assert len(dense) == len(sbp) == 8 and sbp[-1] < sbp[0]
    worst = max(abs(a - b) / abs(b) for a, b in zip(sbp, dense))
    print(f"\n[sbp fit] plan {runs['sbp']['selected']}: losses {sbp[0]:.4f} -> {sbp[-1]:.4f}, "
          f"max rel diff to dense {worst:.2e}")
    assert worst <= 1e-5  # float32 sums in another order
    assert runs["sbp"]["world_size"] == 4 and "qkv=" in runs["sbp"]["selected"]
    assert {r["applied_plan"].get("model") for r in runs["sbp"]["_results"]} == {"sbp"}
