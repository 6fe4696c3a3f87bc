"""transformers causal LMs on ATP's 2D meshes (issue 14): Llama, Mistral (one key/value head:
fewer than the ranks), Qwen2 (biased q/k/v), built from tiny configs, laid out by the HF
adapter's plan (no plan written by hand) against the single-process model, float64, one
forward and backward: the loss and the full tensor of every gradient within 1e-9 relative,
on 2 processes (2x1, 1x2) and 4 processes (4x1, 2x2, 1x4) — one launch each; the counted
collectives equal the planner's runtime cost model (``module_styles`` layout) exactly."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="pip install transformers")

from atp_pipeline.errors import ConfigError  # noqa: E402
from atp_pipeline.launch import spawn  # noqa: E402

from .hf_workers import TINY, build, exactness, predicted  # noqa: E402

FAMILIES = sorted(TINY)
MESHES = {2: [(2, 1), (1, 2)], 4: [(4, 1), (2, 2), (1, 4)]}


@pytest.fixture(scope="module", params=sorted(MESHES), ids=lambda w: f"{w}proc")
def results(request):
    world = request.param
    return world, spawn(exactness, world, FAMILIES, MESHES[world])


def test_every_family_and_mesh_matches_single_process(results):
    world, per_rank = results
    rows = per_rank[0]
    assert {(r["family"], r["mesh"]) for r in rows} == {(f, m) for f in FAMILIES for m in MESHES[world]}
    for r in rows:
        where = f"{r['family']} on {r['mesh']}"
        assert r["same_params"], where
        assert r["loss_rel"] <= 1e-9, (where, r["loss_rel"])
        assert r["grad_rel"] <= 1e-9, (where, r["worst"], r["grad_rel"])
        # the planner's runtime cost model predicts exactly the collectives the run sent
        assert predicted(r["shape"], r["mesh"]) == r["counted"], where
    # every rank computed the same loss and the same full gradients
    for other in per_rank[1:]:
        assert [(r["loss_rel"], r["grad_rel"]) for r in other] == [(r["loss_rel"], r["grad_rel"]) for r in rows]


def test_shape_is_read_from_the_model():
    from atp_pipeline.models.adapter import find_adapters

    (name, adapter, sub), = find_adapters(build("mistral"))
    shape = adapter.shape(sub)
    assert (name, adapter.family) == ("", "hf")
    assert (shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn, shape.layers) == (32, 8, 1, 4, 48, 2)
    assert (shape.gated, shape.norm, shape.position, shape.tied_embeddings) == (True, "rmsnorm", "rotary", False)


def test_unsupported_family_is_one_line():
    from transformers import AutoConfig, AutoModelForCausalLM

    from atp_pipeline.models.adapter import find_adapters

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "phi", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    (_, adapter, sub), = find_adapters(model)
    with pytest.raises(ConfigError) as err:
        adapter.parallel_plan(sub)
    msg = str(err.value)
    assert "\n" not in msg and "model_type 'phi'" in msg and "llama" in msg and "plan" in msg


def test_tied_embeddings_are_refused_in_one_line():
    from atp_pipeline.models.adapter import find_adapters

    (_, adapter, sub), = find_adapters(build("llama", tie_word_embeddings=True))
    with pytest.raises(ConfigError, match="tie_word_embeddings=True"):
        adapter.parallel_plan(sub)


def test_lightning_trains_an_hf_llama_with_the_planned_mesh():
    """``Trainer(strategy="atp", devices=4)`` on a plain LightningModule holding
    ``LlamaForCausalLM``: no plan, ``mesh="auto"``; 20 float32 steps reproduce the
    single-process losses within 1e-5, under both Lightning packages."""
    from atp_pipeline.planning.search import make_plan
    from atp_pipeline.config.schema import MeshConfig, MeshStrategy, PlannerConfig

    from .hf_workers import BATCH, lightning_case, reference_losses

    packages = ["pytorch_lightning"]
    try:
        import lightning.pytorch  # noqa: F401
        packages.append("lightning.pytorch")
    except ImportError:
        pass
    ref = reference_losses()
    runs = spawn(lightning_case, 4, packages, init=False)[0]
    for package in packages:
        r = runs[package]
        assert len(r["losses"]) == len(ref) == 20, package
        assert max(abs(a - b) for a, b in zip(r["losses"], ref)) <= 1e-5, (package, r["losses"], ref)
        assert r["applied"] and any(s == "hf_attention" for s in r["applied"].values()), r["applied"]
    # the mesh is the planner's choice for the model's shape on this host's topology
    from atp_pipeline.models.adapter import find_adapters
    from atp_pipeline.topology.builders import switched
    from atp_pipeline.topology.model import Topology

    (_, adapter, sub), = find_adapters(build("llama"))
    local = Topology.from_config(switched(4, 1.0, name="local", unit="process"))
    plan = make_plan(local, adapter.shape(sub).with_step(batch_size=BATCH),
                     MeshConfig(strategy=MeshStrategy.auto), PlannerConfig())
    assert tuple(runs[packages[0]]["dims"]) == (1, *plan.selected)


def test_stage_plan_of_a_real_size_llama_on_the_meta_device(tmp_path):
    """``python train.py stage=plan model=llama3_8b topology=ic4``: the shape read from the
    HF config (GQA, gated MLP), the candidate table and a per-device memory estimate."""
    import json

    from .conftest import run_train

    out = run_train(["stage=plan", "model=llama3_8b", "topology=ic4", f"hydra.run.dir={tmp_path / 'run'}"],
                    cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "heads=32 (kv 8, head dim 128), FFN 14336 gated, rmsnorm" in out.stdout
    assert "memory per device on " in out.stdout
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert (plan["model"]["kv_heads"], plan["model"]["comm_layout"]) == (8, "module_styles")
    assert plan["memory_per_device"]["total_bytes"] < 80e9


def test_infeasible_hf_mesh_is_one_line(tmp_path):
    from .conftest import run_train

    out = run_train(["stage=plan", "model=qwen2_7b", "topology=ic4", "mesh=8x2",
                     f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "28 heads" in lines[0] and "8x2 = 16" in lines[0], out.stderr


def test_train_py_fits_a_tiny_hf_llama(tmp_path):
    """``python train.py model=llama_tiny mesh=2x2`` trains and writes the usual run directory."""
    import json

    from .conftest import run_train

    run = tmp_path / "run"
    out = run_train(["model=llama_tiny", "mesh=2x2", "trainer.max_steps=8", f"hydra.run.dir={run}"],
                    cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["model"], summary["selected"], summary["steps"]) == ("llama_tiny", "2x2", 8)
    assert summary["final_loss"] < summary["first_loss"]
    for name in ("plan.json", "metrics.csv", "loss.png", "summary.txt"):
        assert (run / name).exists(), name
