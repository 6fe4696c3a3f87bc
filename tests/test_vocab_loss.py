"""Vocabulary-parallel cross-entropy for transformers LM heads: the head's
logits stay split, ``[tokens/d2, vocab/d1]`` on every rank, and transformers' causal-LM loss
runs on the blocks (:mod:`atp_pipeline.parallel.vocab`).

One launch of 4 gloo processes: a tiny Llama (untied head) and GPT-2 (head tied to the token
embedding), float64, marked with ``vocab_parallel_loss`` (``model.vocab_parallel_loss=true``) and
laid out on 2x2 and 1x4 by the HF adapter's own plan, which places the head (and the tied table)
with ``vocab_head`` / ``vocab_tied`` + ``vocab_embedding`` and installs the vocabulary-parallel
loss. Against the single-process model under
transformers' own ``ForCausalLMLoss`` (its source minus the float64->float32 ``.float()``): the
loss and every full gradient within 1e-9, with ``labels`` (some -100), with ``shift_labels``,
with ``num_items_in_batch``, with the logits softcapped between head and loss, and with a
token count the mesh does not divide (padded blocks); each rank's logits are ``1/(d1*d2)`` of
the whole; the counted collectives equal the planner's cost model (``head_layout="vocab_split"``).
The memory figure is measured by ``benchmarks/vocab_loss_memory.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="pip install transformers")

from atp_pipeline.errors import ConfigError  # noqa: E402
from atp_pipeline.launch import spawn  # noqa: E402

from .hf_workers import VOCAB, predicted  # noqa: E402
from .vocab_workers import FAMILIES, exactness  # noqa: E402

MESHES = [(2, 2), (1, 4)]  # (4x1, the head's d2 = 1 path, adds ~20 s: run by hand when touching it)
CASES = {("even", c) for c in ("labels", "shift_labels", "num_items", "softcap")} | {("padded", "labels")}


@pytest.fixture(scope="module")
def runs():
    return spawn(exactness, 4, MESHES)


def test_loss_and_every_gradient_equal_transformers_loss(runs):
    rows = runs[0]["rows"]
    assert {(r["family"], r["mesh"], r["batch"], r["case"]) for r in rows} == {
        (f, m, b, c) for f in FAMILIES for m in MESHES for b, c in CASES}
    for r in rows:
        where = f"{r['family']} ({r['tied']}) on {r['mesh']}, {r['batch']} batch, {r['case']}"
        assert r["same_params"], where
        # the adapter itself split the head (the tied table too) and installed the loss
        assert r["plan_as_expected"] and r["loss_installed"] and r["shape"]["head_layout"] == "vocab_split", where
        assert r["loss_err"] <= 1e-9, (where, r["loss"], r["ref"])
        assert r["grad_err"] <= 1e-9, (where, r["worst"], r["grad_err"])
        # transformers' own path (its loss upcasts to float32, rounding float64 logits down) agrees to float32
        assert abs(r["own"] - r["ref"]) <= 1e-6 * abs(r["ref"]), where
    # every rank computed the same loss
    for other in runs[1:]:
        assert [r["loss"] for r in other["rows"]] == [r["loss"] for r in rows]


def test_logits_on_a_rank_are_one_over_d1_d2_of_the_whole(runs):
    for r in runs[0]["rows"]:
        d1, d2 = r["mesh"]
        rows = -(-r["tokens"] // (d2 * d2)) * d2  # the tokens padded to a multiple of d2*d2, split over d2
        assert r["logits_shape"] == (rows, VOCAB // d1), r
        if r["batch"] == "even":  # 32 tokens: no padding on any of the meshes
            assert r["logits_shape"][0] * r["logits_shape"][1] * d1 * d2 == r["logits_numel"], r


def test_counted_collectives_equal_the_cost_model(runs):
    for r in runs[0]["rows"]:
        if r["batch"] == "even" and r["case"] == "labels":
            assert predicted(r["shape"], r["mesh"]) == r["counted"], (r["family"], r["mesh"])


def test_whole_logits_are_refused_in_one_line(runs):
    msg = runs[0]["refusal"]
    assert msg and "\n" not in msg and "vocab_head" in msg


def test_install_refuses_a_head_that_is_not_split():
    from atp_pipeline.parallel.vocab import install_vocab_parallel_loss

    from .hf_workers import build

    with pytest.raises(ConfigError) as err:
        install_vocab_parallel_loss(build("llama"), None)  # type: ignore[arg-type]
    assert "\n" not in str(err.value) and "'vocab_head'" in str(err.value)


def test_planning_models_of_the_split_head():
    """The memory model's logits shrink by d1*d2 (and a tied table by d1); the shape accepts the
    layout tied or not and still refuses a vocabulary that d1 does not divide."""
    from dataclasses import replace

    from atp_pipeline.planning.memory import logits_bytes, per_device_memory
    from atp_pipeline.planning.shape import ModelShape, layout_infeasibility

    base = ModelShape(name="llama3-8b", hidden=4096, heads=32, layers=32, seq_len=2048, vocab_size=128256,
                      ffn=14336, kv_heads=8, gated=True, norm="rmsnorm", bias=False, position="rotary",
                      batch_size=8, dtype="bf16", head_layout="gathered")
    split = replace(base, head_layout="vocab_split")
    whole = logits_bytes(base, (2, 2))
    assert whole == 8 * 2048 * 128256 * (2 + 4)  # bf16 logits + float32 log-probabilities, ~12.6 GB
    assert logits_bytes(split, (2, 2)) * 4 == whole
    tied = replace(base, tied_embeddings=True, head_layout="tied")
    assert per_device_memory(tied, (2, 2)).params - per_device_memory(replace(tied, head_layout="vocab_split"),
                                                                      (2, 2)).params == 128256 * 4096 / 2 / 2
    assert layout_infeasibility(replace(split, vocab_size=128257), 2, 2)
    with pytest.raises(ValueError):
        replace(base, head_layout="tied")


def test_vocab_parallel_loss_is_a_model_option_refused_where_it_cannot_hold(compose_cfg):
    """``model.vocab_parallel_loss=true`` is the user's switch: the plan's shape then splits the
    logits by d1*d2 (and the planner's memory shrinks the logits by as much); a family whose head
    is not split by vocabulary, or a transformers head with a bias, is refused in one line before
    any process starts."""
    from atp_pipeline.models.hf.adapter import vocab_parallel_loss
    from atp_pipeline.run.resolve import resolve

    from .hf_workers import build

    on = resolve(compose_cfg("model=llama_tiny", "mesh=2x2", "model.vocab_parallel_loss=true"))
    off = resolve(compose_cfg("model=llama_tiny", "mesh=2x2"))
    assert (on.shape.head_layout, off.shape.head_layout) == ("vocab_split", "gathered")
    assert on.memory.logits_bytes * 4 == off.memory.logits_bytes
    with pytest.raises(ConfigError) as err:
        resolve(compose_cfg("model=tiny", "model.vocab_parallel_loss=true"))
    assert "\n" not in str(err.value) and "family 'gpt'" in str(err.value)
    from atp_pipeline.models.hf.adapter import ADAPTER

    model = vocab_parallel_loss(build("llama"))
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features, dtype=torch.float64))
    with pytest.raises(ConfigError) as err:
        ADAPTER.parallel_plan(model)
    assert "\n" not in str(err.value) and "with a bias" in str(err.value)
