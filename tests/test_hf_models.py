"""transformers causal LMs on ATP's 2D meshes (issues 14, 26): Llama, Mistral (one key/value
head: fewer than the ranks), Qwen2 (biased q/k/v, tied head), GPT-2 (Conv1D, fused
concatenated q|k|v, learned positions, tied head), OPT (per-rank head count, derived
positions, tied head) and GPT-NeoX (per-head interleaved q|k|v, partial rotary, parallel
residual), and — laid out from transformers' declaration alone, no table entry — Qwen3
(per-head q/k norms), Phi-3 (fused q|k|v read whole, packed gate|up) and Granite
(multipliers), built from tiny configs, laid out by the HF adapter's plan (no plan written
by hand) against the single-process model, float64, one forward and backward: the loss and
the full tensor of every gradient within 1e-9 relative, on 4 processes (4x1, 2x2, 1x4) in
one launch; the counted
collectives equal the planner's runtime cost model exactly; the same with the blocks run in
chunks (§4.1 overlap, the runtime's wavefront): 2 on 2x2, 4 (one sample a chunk) on 1x4; the
HF checkpoint round trip on 2x2 (both axes split)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="pip install transformers")

from atp_pipeline.errors import ConfigError  # noqa: E402
from atp_pipeline.launch import spawn  # noqa: E402

from .hf_workers import TINY, build, exactness, predicted  # noqa: E402

FAMILIES = sorted(TINY)
# one launch of 4 processes: 4x1 (d2 = 1), 2x2 and 1x4 (d1 = 1) reach every code path of the
# layout (2 processes, 2x1 and 1x2, add none: tests/test_parallel.py runs them for the GPT)
PER_WORLD = {4: FAMILIES}
MESHES = {4: [(4, 1), (2, 2), (1, 4)]}


# the blocks in chunks (§4.1) on both 2D meshes: 2 chunks, and 4 (one sample a chunk)
CHUNKED = {4: (((2, 2), 2), ((1, 4), 4))}


@pytest.fixture(scope="module", params=sorted(MESHES), ids=lambda w: f"{w}proc")
def results(request, tmp_path_factory):
    world = request.param
    return world, spawn(exactness, world, PER_WORLD[world], MESHES[world], str(tmp_path_factory.mktemp("hf")), "cpu",
                        CHUNKED.get(world, ()))


def test_every_family_and_mesh_matches_single_process(results):
    world, per_rank = results
    rows = per_rank[0]
    chunked = set(CHUNKED.get(world, ()))
    assert {(r["family"], r["mesh"], r["chunks"]) for r in rows} == {
        (f, m, c) for f in PER_WORLD[world] for m, c in {(m, 1) for m in MESHES[world]} | chunked}
    for r in rows:
        where = f"{r['family']} on {r['mesh']}, {r['chunks']} chunks (§4.1)"
        assert r["same_params"], where
        assert r["loss_rel"] <= 1e-9, (where, r["loss_rel"])
        assert r["grad_rel"] <= 1e-9, (where, r["worst"], r["grad_rel"])
        # the planner's runtime cost model predicts exactly the collectives the run sent
        assert predicted(r["shape"], r["mesh"], r["chunks"]) == r["counted"], where
    # every rank computed the same loss and the same full gradients
    for other in per_rank[1:]:
        assert [(r["loss_rel"], r["grad_rel"]) for r in other] == [(r["loss_rel"], r["grad_rel"]) for r in rows]


def test_hf_checkpoints_load_shard_by_shard_and_export_exactly(results):
    """The dense model saved with ``save_pretrained``, loaded into the layout from the meta
    device: the same loss bit for bit, and each rank reads exactly the elements it holds
    (its blocks, not the whole tensors); the laid-out model exported is the dense model
    again, bit for bit, through ``AutoModelForCausalLM.from_pretrained``."""
    world, per_rank = results
    tripped = set()
    for rank_rows in zip(*per_rank):
        r = rank_rows[0]
        if "export_diff" not in r:
            continue
        tripped.add(r["family"])
        where = f"{r['family']} on {r['mesh']}"
        assert r["export_diff"] == 0.0, where
        for x in rank_rows:
            assert x["loaded_loss"] == x["loss"], where
            assert x["read"] == x["held"], (where, x["read"], x["held"])
    assert tripped == set(PER_WORLD[world])


def test_shape_is_read_from_the_model():
    from atp_pipeline.models.adapter import find_adapters

    (name, adapter, sub), = find_adapters(build("mistral"))
    shape = adapter.shape(sub)
    assert (name, adapter.family) == ("", "hf")
    assert (shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn, shape.layers) == (32, 8, 1, 4, 48, 2)
    assert (shape.gated, shape.norm, shape.position, shape.tied_embeddings) == (True, "rmsnorm", "rotary", False)


def test_unsupported_family_is_one_line():
    """A family whose layout ATP does not cover (RemBERT's embeddings: a norm outside the blocks
    over the split token table's width, other than the hidden) is refused in one line that
    names the model type, the module and what to do."""
    from transformers import AutoModelForCausalLM

    from atp_pipeline.models.adapter import find_adapters
    from benchmarks.hf_coverage import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("rembert"))
    (_, adapter, sub), = find_adapters(model)
    with pytest.raises(ConfigError) as err:
        adapter.parallel_plan(sub)
    msg = str(err.value)
    assert "\n" not in msg and "model_type 'rembert'" in msg and "'rembert.embeddings.LayerNorm'" in msg \
        and "other than the hidden state" in msg and "plan" in msg


@pytest.mark.parametrize("family, over, message", [
    ("gpt2", dict(add_cross_attention=True), "model_type 'gpt2': cross-attention"),
    ("opt", dict(word_embed_proj_dim=16), "module 'model.decoder.project_out' (Linear) holds parameters"),
    ("opt", dict(layerdrop=0.1), "model_type 'opt': random layer skipping (layerdrop=0.1"),
])
def test_what_the_layout_cannot_reproduce_is_refused_in_one_line(family, over, message):
    from atp_pipeline.models.adapter import find_adapters

    (_, adapter, sub), = find_adapters(build(family, **over))
    with pytest.raises(ConfigError) as err:
        adapter.parallel_plan(sub)
    assert "\n" not in str(err.value) and message in str(err.value), str(err.value)


def test_tied_head_shares_the_embedding_table():
    """Qwen2 (tied): the head's style is ``tied`` and it holds no parameter of its own."""
    from atp_pipeline.models.adapter import find_adapters

    (_, adapter, sub), = find_adapters(build("qwen2"))
    assert adapter.parallel_plan(sub)["lm_head"] == "tied(table=model.embed_tokens, input=split)"
    assert adapter.shape(sub).tied_embeddings


def test_lightning_trains_hf_models_with_no_plan():
    """``Trainer(strategy="atp", devices=4)`` on a plain LightningModule holding a transformers
    causal LM, no plan and ``mesh="auto"``: ``LlamaForCausalLM`` (10 steps) and three
    families outside the named ones, laid out from what transformers declares (Qwen3, Phi-3,
    Granite; 5 steps) reproduce the single-process float32 losses within 1e-5, under both
    Lightning packages."""
    from atp_pipeline.config.schema import MeshConfig, MeshStrategy, PlannerConfig
    from atp_pipeline.planning.search import make_plan

    from .hf_workers import BATCH, lightning_case, reference_losses

    packages = ["pytorch_lightning"]
    try:
        import lightning.pytorch  # noqa: F401
        packages.append("lightning.pytorch")
    except ImportError:
        pass
    steps = {"llama": 10, "qwen3": 5, "phi3": 5, "granite": 5}
    runs = spawn(lightning_case, 4, packages, steps, init=False)[0]
    for family, n in steps.items():
        ref = reference_losses(family, n)
        for package in packages:
            r = runs[f"{package}/{family}"]
            assert len(r["losses"]) == len(ref) == n, (package, family)
            assert max(abs(a - b) for a, b in zip(r["losses"], ref)) <= 1e-5, (package, family, r["losses"], ref)
            assert r["applied"] and any(s.startswith("hf_attention") for s in r["applied"].values()), r["applied"]
    # the mesh is the planner's choice for the model's shape on this host's topology
    from atp_pipeline.models.adapter import find_adapters
    from atp_pipeline.topology.builders import switched
    from atp_pipeline.topology.model import Topology

    (_, adapter, sub), = find_adapters(build("llama"))
    local = Topology.from_config(switched(4, 1.0, name="local", unit="process"))
    plan = make_plan(local, adapter.shape(sub).with_step(batch_size=BATCH),
                     MeshConfig(strategy=MeshStrategy.auto), PlannerConfig())
    assert tuple(runs[f"{packages[0]}/llama"]["dims"]) == (1, *plan.selected)


_PLAN_RUN = r"""
import runpy, sys
sys.argv = ["train.py", *sys.argv[1:]]
try:
    runpy.run_path(TRAIN, run_name="__main__")
finally:
    print("TRANSFORMERS=" + str("transformers" in sys.modules))
"""


def test_stage_plan_of_a_real_size_llama_on_the_meta_device(tmp_path):
    """``python train.py stage=plan model=llama3_8b topology=ic4``: the shape read from the
    HF config (GQA, gated MLP), the candidate table and a per-device memory estimate; the
    preset spells out every field the shape reads, so transformers is never imported (most
    of the run's CPU time otherwise)."""
    import json
    import subprocess
    import sys

    from .conftest import ROOT

    code = _PLAN_RUN.replace("TRAIN", repr(str(ROOT / "train.py")))
    out = subprocess.run([sys.executable, "-c", code, "stage=plan", "model=llama3_8b", "topology=ic4",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "heads=32 (kv 8, head dim 128), FFN 14336 gated, rmsnorm" in out.stdout
    assert "memory per device on " in out.stdout
    assert "TRANSFORMERS=False" in out.stdout.splitlines()
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert (plan["model"]["kv_heads"], plan["model"]["norm_layout"]) == (8, "gathered")
    assert plan["memory_per_device"]["total_bytes"] < 80e9


def test_presets_read_without_transformers_agree_with_its_config():
    """Every HF model option's shape: read from its ``hf`` fields alone (the real-size presets,
    which give every field) equals the shape of transformers' config of the same fields."""
    from omegaconf import OmegaConf

    from atp_pipeline.models.hf.adapter import GivenFields, HFCausalLMAdapter, NotGiven, shape_of_config

    from .conftest import ROOT

    complete = set()
    for path in sorted((ROOT / "conf" / "model").glob("*.yaml")):
        cfg = OmegaConf.load(path)
        if cfg.get("family") != "hf" or not cfg.get("hf"):
            continue
        fields = OmegaConf.to_container(cfg.hf)
        try:
            fast = shape_of_config(GivenFields(fields), cfg.name)
        except NotGiven:
            continue
        complete.add(cfg.name)
        assert fast == shape_of_config(HFCausalLMAdapter.hf_config(cfg), cfg.name), cfg.name
    assert {"llama3_8b", "mistral_7b", "qwen2_7b"} <= complete, complete


def test_infeasible_hf_mesh_is_one_line(tmp_path):
    from .conftest import run_train

    out = run_train(["stage=plan", "model=qwen2_7b", "topology=ic4", "mesh=8x2",
                     f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "28 heads" in lines[0] and "8x2 = 16" in lines[0], out.stderr


def _corpus_batch(step: int, seq_len: int = 64, batch: int = 8, seed: int = 0):
    """The ``(idx, targets)`` a dp=1 run of ``train.py`` trains on at ``step`` (0-based)."""
    from atp_pipeline.data import CORPUS
    from atp_pipeline.lightning.data import CorpusWindows

    ds = CorpusWindows(CORPUS, seq_len, seed)
    x, y = zip(*(ds[i] for i in range(step * batch, (step + 1) * batch)))
    return torch.stack(x), torch.stack(y)


def _hf_loss(model, step: int) -> float:
    idx, targets = _corpus_batch(step)
    with torch.no_grad():
        return model(input_ids=idx, labels=targets, shift_labels=targets).loss.item()


def test_train_py_hf_fit_resume_export_and_pretrained(tmp_path):
    """``python train.py model=llama_tiny mesh=2x2`` trains, writes the usual run directory and
    exports the model in HF format (``<run>/hf``); resuming from its sharded DCP checkpoint at
    step 3 reproduces steps 4-6 exactly, and its step 7 — the loss of the model trained for 6
    steps — equals the exported checkpoint's loss under ``from_pretrained`` on that batch.
    ``model=hf_pretrained``: a GPT-2 checkpoint written by ``save_pretrained`` (Conv1D, fused
    q|k|v, tied head) loads into a 2x2 run shard by shard; its first-step loss is the
    single-process model's on the same batch, and with lr=0 it is exported back bit for bit."""
    import json

    from transformers import AutoModelForCausalLM

    from atp_pipeline.run.report import read_metrics

    from .conftest import finish_train, start_train

    def start(run, *args):
        return run, start_train([*args, "trainer.progress_bar=false", "planner.plot=false", f"hydra.run.dir={run}"],
                                cwd=tmp_path)

    def train(run, p=None):
        out = finish_train(p, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.csv") if "loss" in r}

    a, c, b = tmp_path / "a", tmp_path / "c", tmp_path / "b"
    ckpt = tmp_path / "gpt2"
    dense = build("gpt2", torch.float32, vocab_size=256)
    dense.save_pretrained(str(ckpt))
    pretrained = start(b, "model=hf_pretrained", f"model.pretrained={ckpt}", "mesh=2x2", "trainer.max_steps=1",
                       "trainer.lr=0")  # side by side with the llama_tiny fit
    full = train(*start(a, "model=llama_tiny", "mesh=2x2", "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=3"))
    summary = json.loads((a / "summary.json").read_text())
    assert (summary["model"], summary["selected"], summary["steps"]) == ("llama_tiny", "2x2", 6)
    assert summary["final_loss"] < summary["first_loss"]
    for name in ("plan.json", "metrics.csv", "loss.png", "summary.txt", "hf/config.json", "hf/model.safetensors"):
        assert (a / name).exists(), name

    resumed = train(*start(c, "model=llama_tiny", "mesh=2x2", "trainer.max_steps=7",
                           f"resume={a / 'checkpoints' / 'step3.ckpt'}"))
    assert sorted(resumed) == [3, 4, 5, 6]
    assert all(resumed[k] == pytest.approx(full[k], abs=1e-6) for k in (3, 4, 5)), (resumed, sorted(full.items()))
    exported = AutoModelForCausalLM.from_pretrained(str(a / "hf"))
    assert _hf_loss(exported, 6) == pytest.approx(resumed[6], rel=1e-5)

    first = train(*pretrained)
    assert first[0] == pytest.approx(_hf_loss(dense, 0), rel=1e-5)
    back, ref = AutoModelForCausalLM.from_pretrained(str(b / "hf")).state_dict(), dense.state_dict()
    assert sorted(back) == sorted(ref) and all(torch.equal(back[k], ref[k]) for k in ref)
