"""An HF attention module on ATP's (d1, d2) mesh (§3.2.1, Figure 6a), its own ``forward`` kept.

:class:`HFAttention` (style ``hf_attention``) replaces the module's q/k/v projections (or
its fused qkv projection) by column-first and its output projection by a row-first
:class:`~atp_pipeline.parallel.linear.ATPLinear` (hidden split over d2 in and out), so the
module's ``forward`` — reshaping by ``-1`` heads or by attributes made per-rank — sees
its d1 block of heads. The attention core is reached through transformers'
``AttentionInterface``: the module gets a copy of its config naming the implementation
``"atp"``, which scatters the heads over d2 and picks the key/value heads of grouped-query
attention (:class:`~atp_pipeline.parallel.attention.HeadSharding`), runs the module's own
implementation (eager, sdpa, ...) on the local heads and gathers the output back over d2.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.attention import HeadSharding
from atp_pipeline.parallel.comm import comm_for
from atp_pipeline.parallel.linear import COLUMN, ROW, ATPLinear, linear_kinds
from atp_pipeline.parallel.rng import LOCAL, region
from atp_pipeline.parallel.styles import ParallelStyle, StyleContext

IMPLEMENTATION = "atp"


class _Groups:
    """The attention module as the core sees it, with another key/value group size."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _inner(module: nn.Module) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(module.atp_inner_attention, eager)


def atp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], **kwargs: Any) -> Tuple[torch.Tensor, Any]:
    """transformers' attention-function signature: ``query`` ``[b, heads/d1, s, hd]`` ->
    output ``[b, s, heads/d1, hd]`` (the module's own implementation on this rank's heads)."""
    heads: HeadSharding = module.atp_heads
    q, k, v, groups = heads.localize(query, key, value)
    target = module if groups is None else _Groups(module, groups)
    with region(LOCAL):  # attention dropout: this rank's own heads draw their own masks
        out, weights = _inner(module)(target, q, k, v, attention_mask, **kwargs)
    return heads.gather(out, 2), weights


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, atp_attention)


FUSED = ("concat", "heads")


class HFAttention(ParallelStyle):
    """A transformers attention module on the (d1, d2) mesh; activations in and out split by
    hidden over d2. Options name its projections: separate ``q``/``k``/``v`` (defaults
    ``q_proj``/``k_proj``/``v_proj``) or one fused ``qkv`` whose output is the queries, keys
    and values either concatenated (``fused=concat``, GPT-2's ``c_attn``) or interleaved
    per head (``fused=heads``, GPT-NeoX's ``query_key_value``), and the output ``o``.
    ``per_rank`` names module attributes counting the whole layer's heads or features that
    the module's ``forward`` reshapes by (OPT's ``num_heads``, GPT-2's ``split_size``): they
    become this rank's (divided by d1), so the family's own ``forward`` runs unchanged."""

    name = "hf_attention"

    def __init__(self, q: str = "q_proj", k: str = "k_proj", v: str = "v_proj", o: str = "o_proj",
                 qkv: str = "", fused: str = "concat", per_rank: str = "") -> None:
        if fused not in FUSED:
            raise ConfigError(f"style 'hf_attention': fused={fused!r} must be one of {', '.join(FUSED)}")
        self.q, self.k, self.v, self.o, self.qkv, self.fused = q, k, v, o, qkv, fused
        self.per_rank = tuple(a for a in per_rank.split("+") if a)

    def options(self) -> Dict[str, str]:
        opts = {"qkv": self.qkv, "fused": self.fused} if self.qkv else \
            {k: v for k, v in (("q", self.q), ("k", self.k), ("v", self.v)) if v != f"{k}_proj"}
        if self.o != "o_proj":
            opts["o"] = self.o
        if self.per_rank:
            opts["per_rank"] = "+".join(self.per_rank)
        return opts

    def projections(self) -> Tuple[str, ...]:
        return ((self.qkv,) if self.qkv else (self.q, self.k, self.v)) + (self.o,)

    def check(self, fqn: str, module: nn.Module) -> None:
        for p in self.projections():
            sub = getattr(module, p, None)
            if type(sub) not in linear_kinds():
                raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) has no linear '{p}' "
                                  f"(style '{self.describe()}')")
        if not hasattr(module, "config"):
            raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) is not a transformers "
                              f"attention module (no config)")
        for a in self.per_rank:
            if not isinstance(getattr(module, a, None), int):
                raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) has no integer attribute "
                                  f"'{a}' (style '{self.describe()}', per_rank)")

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        _register()
        cfg = module.config
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        sharding = HeadSharding(comm_for(ctx.mesh), heads, kv)
        if self.qkv:
            setattr(module, self.qkv, ATPLinear.from_linear(getattr(module, self.qkv), ctx.mesh, COLUMN,
                                                            parts=3 if self.fused == "concat" else 1))
        else:
            # q, k and v read the same hidden states: their input gradients are summed, then
            # all-reduced once (mappings.FanIn)
            setattr(module, self.q, ATPLinear.from_linear(getattr(module, self.q), ctx.mesh, COLUMN,
                                                          shared_input=True))
            for p in (self.k, self.v):
                setattr(module, p, ATPLinear.from_linear(getattr(module, p), ctx.mesh, COLUMN,
                                                         gather_output=sharding.kv_gathered, shared_input=True))
        setattr(module, self.o, ATPLinear.from_linear(getattr(module, self.o), ctx.mesh, ROW))
        d1 = sharding.comm.size("d1")
        for a in self.per_rank:
            setattr(module, a, getattr(module, a) // d1)
        module.atp_heads = sharding
        module.atp_inner_attention = cfg._attn_implementation or "eager"
        module.config = copy.copy(cfg)
        module.config._attn_implementation_internal = IMPLEMENTATION
        return module
