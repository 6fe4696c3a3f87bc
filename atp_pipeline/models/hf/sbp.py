"""A transformers causal LM's SBP layer chain (AutoDDL §4.2, §4.5.1), read from the layout
the HF adapter already derives (:meth:`~atp_pipeline.models.hf.adapter.HFCausalLMAdapter.parallel_plan`:
transformers' ``base_model_tp_plan`` or the family's declared linears, and its attention
style naming the projections).

Keys (those of :func:`~atp_pipeline.planning.sbp.chain.model_chain`): the attention's
fused ``qkv`` (GPT-2's ``c_attn``, GPT-NeoX's ``query_key_value``) or ``q``/``k``/``v``,
its output ``proj``; the MLP's column-first linears ``gate_up`` (gated: gate and up, tied)
or ``fc1``, its row-first one ``down`` or ``fc2``. The
head, embeddings and norms are not in the chain (they run replicated on whole sequences,
:mod:`atp_pipeline.parallel.sbp_exec`). Every block must yield the chain's keys once.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from typing import Any, Dict, Mapping

from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.styles import parse_style
from atp_pipeline.planning.sbp.chain import chain_keys
from atp_pipeline.planning.shape import ModelShape

__all__ = ["sbp_linears"]


def sbp_linears(module: nn.Module, plan: Mapping[str, Any], shape: ModelShape) -> Dict[str, str]:
    """``{module name: layer key}`` of ``module``'s matmuls, from its ATP ``plan`` (see the
    module docstring); one-line :class:`ConfigError` when they are not the chain of ``shape``."""
    from atp_pipeline.models.hf.attention import HFAttention

    if shape.moe is not None:
        raise ConfigError(f"transformers model '{type(module).__name__}': routed experts (a mixture of experts) are "
                          f"outside the SBP layer chain (AutoDDL §4.5); use planner=atp")
    if shape.latent is not None:
        raise ConfigError(f"transformers model '{type(module).__name__}': a multi-head latent attention (latent "
                          f"projections, then per-head ones) is outside the SBP layer chain (AutoDDL §4.5); "
                          f"use planner=atp")
    names = dict(module.named_modules())
    head = next((n for n, m in names.items() if m is module.get_output_embeddings()), None)
    out: Dict[str, str] = {}
    for pattern, spec in plan.items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        style = parse_style(spec)
        if isinstance(style, HFAttention):
            for n in matched:
                projections = {style.qkv: "qkv"} if style.qkv else {style.q: "q", style.k: "k", style.v: "v"}
                projections[style.o] = "proj"
                out.update({f"{n}.{p}": key for p, key in projections.items()})
            continue
        kind = style.name
        if kind not in ("column", "row"):
            continue
        for n in matched:
            if n == head:
                continue
            if kind == "row":
                out[n] = "down" if shape.gated else "fc2"
            else:
                out[n] = "gate_up" if shape.gated else "fc1"
    counts = Counter(out.values())
    want = {k: shape.layers * (2 if k == "gate_up" else 1) for k in chain_keys(shape)}
    if dict(counts) != want:
        raise ConfigError(f"transformers model '{type(module).__name__}': its linears "
                          f"({', '.join(f'{k} x{v}' for k, v in sorted(counts.items()))}) are not the SBP chain "
                          f"{', '.join(f'{k} x{v}' for k, v in want.items())}; use planner=atp")
    return out
