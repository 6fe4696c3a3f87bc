"""What a transformers release declares moves under us: the layout reads experts and head-unit
styles whatever the config's ``base_model_tp_plan`` says of them (exactness on processes: the
qwen2_moe family in tests/test_hf_models.py, minicpm5_moe in tests/test_hf_coverage.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="pip install transformers")

from atp_pipeline.models.hf.declared import COLUMN_KINDS, ROW_KINDS, declared_plan  # noqa: E402
from atp_pipeline.models.hf.layout import derive  # noqa: E402

from .hf_workers import build  # noqa: E402


def test_experts_are_read_off_the_modules_when_the_plan_names_none():
    model = build("qwen2_moe")
    declared = declared_plan(model.config)
    layout = derive(model)
    experts = [p for p, s in layout.plan.items() if s.startswith("hf_experts")]
    assert experts == ["model.layers.*.mlp.experts"] or experts == ["model.layers.1.mlp.experts"], layout.plan
    if not any(s == "moe_tp_experts" for s in declared.values()):  # transformers >= 5.25 names none
        assert layout.moe is not None and layout.moe.experts == 4 and layout.moe.top_k == 2


def test_head_unit_styles_map_to_column_and_row_first():
    # transformers' unit_colwise / unit_rowwise: q/k/v split by whole heads (repeated where fewer
    # heads than ranks), which is what ATP's attention layout does with every head count
    assert "unit_colwise" in COLUMN_KINDS and "unit_rowwise" in ROW_KINDS


def test_a_block_using_its_routing_weights_beside_the_experts_runs_whole():
    """LongCat-Flash's block adds its "zero" experts' share (hidden x routing weight) beside the
    experts module: laid out expert by expert, that share's gradient to the router would be
    partial over d2 (silently wrong), so the block runs whole; Qwen2-MoE's routes only through
    its experts and is laid out expert by expert."""
    from atp_pipeline.models.hf.routing import routing_only_to_experts
    from benchmarks.hf_coverage import build as build_type

    longcat = build_type("longcat_flash")
    assert routing_only_to_experts(longcat, "model.layers.1.mlp.experts") is False
    plan = derive(longcat).plan
    assert not any(s.startswith("hf_experts") for s in plan.values()), plan
    assert plan["model.layers.*.mlp"].startswith("gathered"), plan
    assert routing_only_to_experts(build("qwen2_moe"), "model.layers.1.mlp.experts") is True
