"""Layout decisions for transformers families that declare no tensor-parallel plan, read off
their modules in process (their exactness on 2x2 and 1x4 is the coverage sweep's,
bloom and gpt_bigcode in CI's subset, tests/test_hf_coverage.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="pip install transformers")

from atp_pipeline.errors import ConfigError  # noqa: E402


def _plan(kind: str):
    from atp_pipeline.models.hf.adapter import ADAPTER
    from benchmarks.hf_coverage import build

    model = build(kind)
    return ADAPTER.parallel_plan(model)


def test_alibi_biases_are_sliced_per_rank_not_refused():
    """BLOOM and MPT are passed ALiBi biases for all heads (batch x heads, or heads, first):
    the attention style slices them to the rank's heads; the core runs on its block."""
    bloom = _plan("bloom")["transformer.h.*.self_attention"]
    assert "biases=alibi" in bloom and "fused=heads" in bloom and "whole" not in bloom, bloom
    mpt = _plan("mpt")["transformer.blocks.*.attn"]
    assert "biases=position_bias" in mpt and "fused=concat" in mpt and "per_rank=n_heads" in mpt, mpt


def test_slice_heads_takes_the_heads_of_a_batch_major_bias():
    from atp_pipeline.models.hf.probe import slice_heads

    batch, heads = 3, 4
    t = torch.arange(batch * heads * 5, dtype=torch.float64).view(batch * heads, 1, 5)
    got = slice_heads(t, heads, torch.tensor([2, 3]))
    assert torch.equal(got, t.view(batch, heads, 1, 5)[:, 2:].reshape(-1, 1, 5))
    assert torch.equal(slice_heads(t[:heads], heads, torch.tensor([1])), t[1:2])  # heads first (MPT)


def test_a_multi_query_fused_projection_is_read_whole():
    """GPT-BigCode's c_attn is q | one key head | one value head: nothing splits it by heads,
    so its output is gathered over d1 and the core (transformers' interface) takes the rank's heads."""
    att = _plan("gpt_bigcode")["transformer.h.*.attn"]
    assert "qkv=c_attn" in att and "whole=true" in att, att


def test_a_norm_over_the_whole_intermediate_runs_whole_between_gathered_linears():
    """BitNet's ffn_sub_norm normalizes the whole MLP intermediate: the MLP's column-first
    outputs are gathered, the norm runs whole and the row-first input is whole; its attention
    (a sub-norm over all heads before o_proj) is read whole."""
    plan = _plan("bitnet")
    assert plan["model.layers.*.mlp.ffn_sub_norm"] == "gathered"
    assert "output=full" in plan["model.layers.*.mlp.gate_proj"]
    assert "input=full" in plan["model.layers.*.mlp.down_proj"]
    assert "whole=true" in plan["model.layers.*.self_attn"]


@pytest.mark.parametrize("kind, why", [
    ("trocr", "does not run in a forward on tokens alone"),  # a cross-attention over an encoder's states
    ("ctrl", "holds a buffer 'pos_encoding'"),  # a sinusoidal table added to the split hidden
])
def test_what_the_modules_show_cannot_be_split_is_refused_in_one_line(kind, why):
    with pytest.raises(ConfigError) as err:
        _plan(kind)
    msg = str(err.value)
    assert "\n" not in msg and why in msg and "pass a plan" in msg, msg


def test_a_linear_subclass_is_laid_out_only_when_its_forward_is_shown_plain():
    from atp_pipeline.models.hf.linears import register_plain_linears
    from atp_pipeline.parallel.linear import linear_kinds

    class Plain(nn.Linear):  # Falcon's FalconLinear: x @ W^T + b written out
        def forward(self, x):
            return x @ self.weight.T + self.bias

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    register_plain_linears(nn.Sequential(Plain(4, 3), Scaled(3, 2)))
    assert Plain in linear_kinds() and Scaled not in linear_kinds()


def test_attention_sinks_are_cut_to_the_rank_heads_for_the_core():
    """Granite-SWA declares its attention 'local_params': sinks, one value per head, read by
    the attention core alone (shown by a spy implementation); the style hands the core its
    heads' values and sums their gradients over the mesh."""
    att = _plan("granite_swa")["model.layers.*.self_attn"]
    assert "head_params=sinks" in att, att


def test_an_attention_with_own_parameters_read_outside_the_core_runs_whole():
    """DiffLlama's lambda_q1 ... (one value per head_dim, mixed in its own code): the layout
    cannot split the attention, so it runs whole on the gathered hidden (its keyword input
    gathered), and the layout says so, naming why."""
    from atp_pipeline.models.hf.layout import derive
    from benchmarks.hf_coverage import build

    layout = derive(build("diffllama"))
    assert layout.plan["model.layers.*.self_attn"] == "gathered(input=split, output=split, inputs=hidden_states)"
    note = layout.whole["model.layers.*.self_attn"]
    assert note.startswith("DiffLlamaAttention run whole") and "lambda_q1" in note, note


def test_a_mixer_the_layout_cannot_split_runs_whole_and_the_plan_says_so():
    """Jamba's Mamba mixer (x_proj reads neither the hidden nor writes it) and its routed
    feed-forward block run whole, replicated; the shape counts their gathers, drops the
    attention and dense MLP terms of the layers without them, and the plan's notes name them."""
    from atp_pipeline.config.schema import MeshConfig, PlannerConfig
    from atp_pipeline.models.hf.adapter import ADAPTER
    from atp_pipeline.planning.search import make_plan
    from benchmarks.hf_coverage import build
    from tests.test_planner import _ic6

    model = build("jamba")
    plan = ADAPTER.parallel_plan(model)
    assert plan["model.layers.*.mamba"].startswith("gathered(input=split, output=split")
    shape = ADAPTER.shape(model)
    assert shape.whole_modules == 2 * shape.layers and shape.attention_layers == 0, shape
    assert "JambaMambaMixer run whole" in shape.whole_note and not shape.unmodelled, shape.unmodelled
    notes = make_plan(_ic6(4), shape, MeshConfig(), PlannerConfig()).notes
    assert any("runs modules whole" in n and "JambaMambaMixer" in n for n in notes), notes


def test_an_encoder_style_decoder_runs_its_attention_and_head_module_whole():
    """BERT as a decoder: its attention (residual and norm inside) runs whole; the MLP, split
    between sibling modules, is column-first and row-first; the head's transform and bias run
    whole with the head, its tied table whole too."""
    plan = _plan("bert")
    assert plan["bert.encoder.layer.*.attention"] == "gathered(input=split, output=split)"
    assert plan["bert.encoder.layer.*.intermediate.dense"].startswith("column(")
    assert plan["bert.encoder.layer.*.output.dense"].startswith("row(")
    assert plan["cls"] == "gathered(input=split, output=full)" and "cls.predictions.decoder" not in plan
    assert plan["bert.embeddings.word_embeddings"] == "gathered(input=full, output=split)"


def test_the_fallback_finds_the_block_child_a_refusal_names():
    from atp_pipeline.models.hf.declared import pattern
    from atp_pipeline.models.hf.whole import uncovered_units, unit_of

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
            self.scale = nn.Module()
            self.scale.w = nn.Parameter(torch.ones(4))

    root = nn.Module()
    root.layers = nn.ModuleList([Block(), Block()])
    names = dict(root.named_modules())
    blocks, lists = ["layers.0", "layers.1"], ("layers",)
    assert unit_of("linear 'layers.0.mixer.1' (8 -> 4) ...; pass a plan", names, blocks, lists, pattern) == \
        "layers.*.mixer"
    assert unit_of("transformers model_type 'x': 'layers' ...", names, blocks, lists, pattern) is None
    assert uncovered_units(root, names, {"layers.*.mixer": "gathered"}, blocks, lists, pattern) == \
        [("layers.*.scale", "layers.0.scale")]


def test_the_cost_of_modules_run_whole():
    """Each module run whole gathers its hidden input over d2 and its output's gradient; layers
    without a split attention send none of its collectives."""
    from atp_pipeline.planning.cost import predicted_elements, runtime_terms
    from atp_pipeline.planning.shape import ModelShape

    base = dict(name="m", hidden=64, heads=8, layers=2, seq_len=8, vocab_size=128, ffn=96, norm_layout="gathered",
                head_layout="gathered", bias=False)
    split = predicted_elements(runtime_terms(ModelShape(**base), (1, 4)), 16, 2)
    whole = predicted_elements(runtime_terms(ModelShape(**base, whole_modules=2, whole_inputs=2, attention_layers=0),
                                             (1, 4)), 16, 2)
    attention = [t for t in runtime_terms(ModelShape(**base), (1, 4)) if t.op in ("f1", "f2", "scatter", "gather")]
    removed = sum(t.elements_per_token for t in attention if t.collective == "all_gather") * 16 * 2
    assert whole[("all_gather", "d2")] == split[("all_gather", "d2")] - removed + 2 * 2 * 64 * 16


def test_an_activation_with_learned_scalars_runs_on_the_split_intermediate():
    """Apertus's xIELU (alpha_p, alpha_n): elementwise, shown on a tensor; its gradients summed over d1."""
    from atp_pipeline.models.hf.attention import HFScalars

    assert _plan("apertus")["model.layers.*.mlp.act_fn"] == "hf_scalars(axis=d1)"
    with pytest.raises(ConfigError, match="scalars"):
        HFScalars().check("x", nn.LayerNorm(4))


def test_a_per_head_output_gate_is_split_like_the_queries():
    """AFMoE's attention gates its output per head feature (gate_proj, heads x head dim): a
    fourth projection of the hidden, column-first like q (shown to run on blocks of heads)."""
    from atp_pipeline.models.hf.layout import derive
    from benchmarks.hf_coverage import build

    att = derive(build("afmoe")).plan["model.layers.*.self_attn"]
    assert "extra=gate_proj" in att and "whole" not in att, att


def test_an_attention_the_declaration_leaves_out_is_read_off_its_modules():
    """Flint declares its MLP and experts only: its attention (per-head q/k norms) is read off
    the modules, as for a family that declares nothing."""
    att = _plan("flint")["model.layers.*.self_attn"]
    assert att.startswith("hf_attention(q=q_proj, k=k_proj, v=v_proj, o=o_proj"), att


def _probed_shape(kind: str):
    """The shape read off ``kind``'s tiny model with the layout its forward shows (as laid out)."""
    from atp_pipeline.models.hf.adapter import family_of, shape_of_model
    from atp_pipeline.models.hf.layout import derive
    from benchmarks.hf_coverage import build

    model = build(kind)
    return shape_of_model(model, layout=derive(model, family_of(model.config)))


def test_a_parallel_block_sends_one_input_gradient_for_attention_and_mlp():
    """Cohere runs attention and a gated MLP on one normed input: q/k/v and gate/up sum their
    partial input gradients and all-reduce them once over d1 a layer (GPT-J's single MLP input
    linear does not share: two). The cost model drops the MLP's: h/d2 a token and layer."""
    from atp_pipeline.planning.cost import predicted_counts
    from atp_pipeline.planning.shape import ModelShape

    assert _probed_shape("cohere").shared_mlp_input and not _probed_shape("gptj").shared_mlp_input
    base = dict(name="m", hidden=64, heads=8, layers=2, seq_len=8, vocab_size=128, ffn=96, norm_layout="gathered",
                head_layout="gathered", bias=False, gated=True, qkv_fused=False, layer_norms=1)
    two = predicted_counts(ModelShape(**base).to_dict(), (2, 2), 16)
    one = predicted_counts(ModelShape(**base, shared_mlp_input=True).to_dict(), (2, 2), 16)
    assert two["all_reduce/d1"] - one["all_reduce/d1"] == 64 // 2 * 16 * 2
    assert {k: v for k, v in one.items() if k != "all_reduce/d1"} == \
        {k: v for k, v in two.items() if k != "all_reduce/d1"}


def test_norms_and_layers_are_counted_as_called_and_as_nested():
    """NanoChat applies its final norm before the layers too (two calls: one extra norm); BioGPT's
    learned positions, looked up once for the batch, are noted as unmodelled; AXK1's norm inside
    the routed block is the experts' (2 norms a layer, not 3)."""
    assert _probed_shape("nanochat").extra_norms == 1
    assert "biogpt.embed_positions" in _probed_shape("biogpt").unmodelled
    assert _probed_shape("axk1").layer_norms == 2
