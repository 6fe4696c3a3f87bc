"""The coverage sweep's subset that CI runs (the whole sweep is the benchmark
``python -m benchmarks.hf_coverage``, its table in docs/hf_coverage.md).

Tiny configs of transformers' own defaults, laid out with no plan of ours on 2x2 and 1x4 (one
4-process launch), float64, one forward and backward against the single process:

* declared plans beyond the named families: Gemma-2 (scaled embedding run whole, tied head
  run whole, logit and attention softcapping, four norms a block), OLMo-2 (q/k norms over all
  heads: attention read whole), GraniteMoE-SWA (attention sinks declared 'local_params': the core
  given its heads' values);
* no declared plan, laid out from the modules: StableLM (separate q/k/v, partial rotary), BLOOM
  (ALiBi biases for all heads sliced to the rank's, its own attention core on them), GPT-BigCode
  (a multi-query fused q|k|v read whole), DeepSeek-V3 (multi-head latent attention read off its
  modules: latent projections whole, per-head ones column-first; its routed experts declared);
* modules the layout cannot split run whole (replicated on the gathered hidden, output sliced
  back; named in the plan's notes): Jamba (a Mamba mixer and a routed block beside it), BERT as a
  decoder (an encoder-style attention with its residual and norm inside, the head's transform),
  DiffLlama (an attention with parameters of its own mixed in its code), Mamba (a state-space
  model: every mixer), Doge (a block holding parameters of its own: the whole block), MiniMax
  (an attention pattern whose lightning-attention layers have no q_proj: every layer's attention);
* refused in one line before any step: a hidden-wide buffer added to the split embeddings
  (CTRL), a cross-attention over an encoder's states (TrOCR). (Mixtures of experts that declare
  their layout are exact: qwen2_moe in tests/test_hf_models.py.)
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="pip install transformers")

from atp_pipeline.launch import spawn  # noqa: E402

EXACT = ["gemma2", "olmo2", "granitemoe_swa", "stablelm", "bloom", "gpt_bigcode", "deepseek_v3",
         "jamba", "bert", "diffllama", "mamba", "doge", "minimax", "nanochat", "dory",
         "minicpm5_moe"]  # (k/v declared 'unit_colwise', routed experts declared for expert parallelism only)
REFUSED = {"ctrl": "holds a buffer 'pos_encoding'", "trocr": "does not run in a forward on tokens alone"}


@pytest.fixture(scope="module")
def rows():
    from benchmarks.hf_coverage import worker

    per_rank = spawn(worker, 4, EXACT + list(REFUSED), timeout=600)
    # every rank reached the same verdict on every type
    assert all([x["result"] for x in r] == [x["result"] for x in per_rank[0]] for r in per_rank[1:])
    return {r["type"]: r for r in per_rank[0]}


@pytest.mark.parametrize("kind", EXACT)
def test_laid_out_with_no_plan_is_exact_on_2x2_and_1x4(rows, kind):
    r = rows[kind]
    assert r["result"] == "exact", r
    assert set(r["meshes"]) == {"2x2", "1x4"}
    for mesh, m in r["meshes"].items():
        assert m["loss_rel"] <= r["tolerance"] and m["grad_rel"] <= r["tolerance"], (kind, mesh, m)
        assert not m["missing"], (kind, mesh)
    # float64 throughout unless the family's own code computes in float32 (its norms)
    assert r["tolerance"] == 1e-9 or r.get("float32_ops"), r
    # exported from its laid-out model and read back by from_pretrained: the dense model, bit for bit
    assert r["export"] == "bit-exact", (kind, r["export"])


@pytest.mark.parametrize("kind", EXACT)
def test_the_planner_predicts_the_collectives_the_layout_sends(rows, kind):
    """The runtime cost model of the adapter's shape (ALiBi's core on the d1 heads, whole q/k/v,
    sinks, four norms a block, ...) equals the elements counted per (collective, axis) in the
    same launch's forward and backward."""
    from benchmarks.hf_coverage import predicted

    r = rows[kind]
    for mesh, m in r["meshes"].items():
        d1, d2 = map(int, mesh.split("x"))
        assert m["counted"] == predicted(r["shape"], (d1, d2)), (kind, mesh)


@pytest.mark.parametrize("kind", EXACT)
def test_the_memory_model_counts_the_parameters_a_rank_holds(rows, kind):
    """``per_device_memory(...).params`` against the elements of the parameters rank 0 holds
    after the layout (split ones: its block): modules run whole (Mamba mixers, a BERT head's
    transform, MoE routers) and latent projections count whole; within 2 % (biases and norms
    are placed by rule, not read off the model)."""
    from atp_pipeline.planning.memory import per_device_memory
    from atp_pipeline.planning.shape import ModelShape

    r = rows[kind]
    for mesh, m in r["meshes"].items():
        d1, d2 = map(int, mesh.split("x"))
        shape = ModelShape(**{k: v for k, v in r["shape"].items() if k in ModelShape.__dataclass_fields__})
        est = per_device_memory(shape, (d1, d2)).params
        assert abs(est / m["local_params"] - 1) <= 0.02, (kind, mesh, est, m["local_params"])


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_what_the_layout_cannot_cover_is_refused_in_one_line(rows, kind):
    r = rows[kind]
    assert r["result"] == "refused", r
    assert "\n" not in r["reason"] and REFUSED[kind] in r["reason"] and "plan" in r["reason"], r["reason"]
