"""Multi-head latent attention (``models/hf/mla.py``), single process: what the layout reads off
the modules, what its probe refuses, and the cost model's terms. (Exactness on 2x2 and 1x4 and
counted = predicted: DeepSeek-V3 in tests/test_hf_coverage.py's launch.)"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers", reason="pip install transformers")

from torch import nn  # noqa: E402

from atp_pipeline.errors import ConfigError  # noqa: E402
from atp_pipeline.planning.shape import LatentShape, ModelShape  # noqa: E402

ATT = "model.layers.*.self_attn"


@pytest.fixture(scope="module")
def deepseek():
    from benchmarks.hf_coverage import build

    return build("deepseek_v3")


def test_the_latent_attention_is_read_off_the_modules(deepseek):
    from atp_pipeline.models.hf.layout import derive

    c = deepseek.config
    layout = derive(deepseek)
    assert layout.plan[ATT] == ("hf_mla(q=q_b_proj, kv=kv_b_proj, o=o_proj, latent=kv_a_proj_with_mqa+q_a_proj, "
                                "shared=kv_a_proj_with_mqa, shared_width=4, q_latent=true, heads=8)")
    assert layout.latent == LatentShape(q_latent=c.q_lora_rank, kv_latent=c.kv_lora_rank, shared=c.qk_rope_head_dim,
                                        qk_head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim,
                                        v_head_dim=c.v_head_dim, projections=2)
    # the planners' weights (memory, FLOPs): the attention's linears, counted
    linears = [m for m in deepseek.model.layers[0].self_attn.modules() if isinstance(m, nn.Linear)]
    assert layout.latent.weights(64, 8) == sum(m.weight.numel() for m in linears)
    # the shape carries it through its dict (as the sweep's rows do)
    shape = ModelShape(name="m", hidden=64, heads=8, layers=2, seq_len=8, vocab_size=128, ffn=96, head_dim=8,
                       latent=layout.latent)
    assert ModelShape(**{k: v for k, v in shape.to_dict().items() if k in ModelShape.__dataclass_fields__}) == shape
    # the SBP planner's layer chain has no latent attention: one line
    from atp_pipeline.models.hf.sbp import sbp_linears

    with pytest.raises(ConfigError, match="latent attention .* use planner=atp"):
        sbp_linears(deepseek, layout.plan, shape)


def test_what_the_latent_layout_cannot_place_is_refused_in_one_line(deepseek):
    from atp_pipeline.models.hf import mla
    from atp_pipeline.models.hf.linears import cut_features
    from atp_pipeline.models.hf.probe import calls_interface, capture, run_eval

    att = deepseek.model.layers[0].self_attn
    rows = ["o_proj"]
    spec = mla.read_latent(att, 64, 8, rows, "attention")
    got = capture(deepseek, ATT)
    assert mla.latent_infeasibility(*got, spec, run_eval, cut_features, calls_interface) is None
    # features every head shares that are not the trailing ones the layout sums: the probe sees it
    wrong = dataclasses.replace(spec, shared_width=2)
    assert "trailing" in mla.latent_infeasibility(*got, wrong, run_eval, cut_features, calls_interface)
    # a further per-head projection (a gate) beside queries, keys/values and the output
    gated = nn.Module()
    for n, m in att.named_children():
        gated.add_module(n, m)
    gated.add_module("gate_proj", nn.Linear(64, 8, bias=False))  # one gate a head, from the hidden
    with pytest.raises(ConfigError, match="further projections") as err:
        mla.read_latent(gated, 64, 8, rows, "attention")
    assert "\n" not in str(err.value)
    # an attention whose linears all read the hidden is not a latent one
    plain = nn.Module()
    plain.q_proj, plain.o_proj = nn.Linear(64, 64), nn.Linear(64, 64)
    assert mla.read_latent(plain, 64, 8, ["o_proj"], "attention") is None


@pytest.mark.parametrize("mesh", [(2, 2), (1, 4), (4, 1)])
def test_the_cost_model_counts_the_latent_attention_term_by_term(mesh):
    """Per token and layer (hidden 64, 8 heads of 12 query/key and 8 value features, latents of 32
    and 16 features, 4 shared): the latents' gathers over d2, the per-head projections' collectives,
    the shared features' gradient over d1, the heads' scatter and gather over d2, in place of
    q/k/v's; what the MLP and the rest send is unchanged."""
    from atp_pipeline.planning.cost import predicted_elements, runtime_terms

    d1, d2 = mesh
    lat = LatentShape(q_latent=32, kv_latent=16, shared=4, qk_head_dim=12, v_head_dim=8)
    base = ModelShape(name="m", hidden=64, heads=8, layers=1, seq_len=8, vocab_size=128, ffn=96, head_dim=8)
    attention = ("f1", "f2", "scatter", "gather", "pick", "kv", "whole")
    rest = predicted_elements([t for t in runtime_terms(base, mesh) if t.op not in attention], 1, 1)
    q, kv, o = 8 * 12, 8 * 16, 8 * 8
    latent = {("all_gather", "d2"): 2 * 64 + 48 + (2 * q + o) // d1 + o // d1 if d2 > 1 else 0,
              ("all_reduce", "d2"): (q + kv) // d1 + o // d1 if d2 > 1 else 0,
              ("all_reduce", "d1"): 48 // d2 + 4 + 64 // d2 if d1 > 1 else 0}
    want = {k: rest.get(k, 0) + latent.get(k, 0) for k in set(rest) | set(latent)}
    got = predicted_elements(runtime_terms(dataclasses.replace(base, latent=lat), mesh), 1, 1)
    assert got == {k: v for k, v in want.items() if v}
    # queries projected from the hidden (no query latent): one latent gathered, the hidden's gradient
    direct = dataclasses.replace(lat, q_latent=0, projections=1)
    got = predicted_elements(runtime_terms(dataclasses.replace(base, latent=direct), mesh), 1, 1)
    if d1 > 1:
        assert got[("all_reduce", "d1")] == rest.get(("all_reduce", "d1"), 0) + (64 + 16) // d2 + 4 + 64 // d2
    if d2 > 1:
        assert got[("all_gather", "d2")] == rest.get(("all_gather", "d2"), 0) + 64 + 16 + (2 * q + o) // d1 + o // d1
