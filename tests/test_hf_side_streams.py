"""Layout decisions, in process, for what a causal LM computes beside its hidden state (
exactness on 2x2 and 1x4 is the coverage sweep's, docs/hf_coverage.md):

* modules no forward on tokens reaches (Phi-4-multimodal's image and audio encoders) are kept
  whole, refusing in one line should they run;
* per-layer inputs over another width (Gemma 4's table, projection and norm outside the blocks,
  each block's gate and projection) run whole, whole on every rank;
* a parameter over the hidden held outside the blocks is split as the hidden only where a
  forward shows it used elementwise with the hidden state;
* the sweep's tiny configs are ones transformers reads back (the export round trip of every
  exact type through ``AutoModelForCausalLM`` is the sweep's).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="pip install transformers")


def _plan(kind: str):
    from atp_pipeline.models.hf.adapter import ADAPTER
    from benchmarks.hf_coverage import build

    return ADAPTER.parallel_plan(build(kind))


def test_modules_no_forward_on_tokens_reaches_are_kept_whole():
    plan = _plan("phi4_multimodal")
    assert plan["model.embed_tokens_extend.image_embed"] == "replicated(idle=true)", plan
    assert plan["model.embed_tokens_extend.audio_embed"] == "replicated(idle=true)", plan
    assert not any(p.startswith("model.embed_tokens_extend.audio_embed.") for p in plan), plan  # its blocks: whole


def test_a_per_layer_input_beside_the_hidden_runs_whole():
    plan = _plan("gemma4_text")
    assert plan["model.embed_tokens_per_layer"] == "gathered"  # a table over another width: whole
    assert plan["model.per_layer_model_projection"] == "gathered(input=split, output=full)"
    assert plan["model.per_layer_projection_norm"] == "gathered"
    assert plan["model.layers.*.per_layer_input_gate"] == "gathered(input=split, output=full)"
    assert plan["model.layers.*.per_layer_projection"] == "gathered(input=full, output=split)"
    assert plan["model.layers.*.mlp.down_proj"] == "row(input=split, output=split)"  # the rest still split


class _Vector(nn.Module):
    """A base model holding a parameter over the hidden (``use``: how its code uses it)."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8)
        self.z = nn.Parameter(torch.randn(8))
        self.use = use

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if self.use == "initial state":
            return self.mix(self.z.to(h.dtype).expand_as(h).contiguous() + h)
        return self.mix(h) * (h @ self.z).unsqueeze(-1)  # a dot product over the hidden: partial per rank


def test_a_parameter_over_the_hidden_is_split_only_where_used_elementwise():
    from atp_pipeline.models.hf.whole import hidden_vector_use

    root = nn.Module()
    root.model = _Vector("initial state")
    root.forward = lambda input_ids: root.model(input_ids)  # type: ignore[method-assign]
    assert hidden_vector_use(root, "model", ["z"], 8) == ""
    root.model.use = "dot product"
    why = hidden_vector_use(root, "model", ["z"], 8)
    assert "'model.z' meets" in why and "not only elementwise with the hidden state" in why, why


def test_tiny_configs_are_ones_transformers_reads_back():
    """The first layers alone lack a kind OLMo-Hybrid requires (an attention layer): the first
    layer of each kind is kept; per-layer overrides of the layers dropped go with them."""
    from benchmarks.hf_coverage import tiny_config

    olmo = tiny_config("olmo_hybrid")
    assert olmo.layer_types == ["linear_attention", "full_attention"]
    type(olmo).from_dict(olmo.to_dict())  # transformers' validation: no error
    dots = tiny_config("dots3_note_text")
    assert dots._heterogeneity_spec.per_layer_overrides == {}  # layers 2.. of the full model: dropped
    type(dots).from_dict(dots.to_dict())
