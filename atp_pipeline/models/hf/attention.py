"""An HF attention module on ATP's (d1, d2) mesh (§3.2.1, Figure 6a), its own ``forward`` kept.

:class:`HFAttention` (style ``hf_attention``) replaces the module's q/k/v projections by
column-first and its output projection by a row-first :class:`~atp_pipeline.parallel.linear.ATPLinear`
(hidden split over d2 in and out), so the module's ``forward`` — its reshapes use ``-1``
heads — sees its d1 block of heads. The attention core is reached through transformers'
``AttentionInterface``: the module gets a copy of its config naming the implementation
``"atp"``, which scatters the heads over d2 and picks the key/value heads of grouped-query
attention (:class:`~atp_pipeline.parallel.attention.HeadSharding`), runs the module's own
implementation (eager, sdpa, ...) on the local heads and gathers the output back over d2.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Callable, Optional, Tuple

import torch
from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.attention import HeadSharding
from atp_pipeline.parallel.comm import comm_for
from atp_pipeline.parallel.linear import COLUMN, ROW, ATPLinear
from atp_pipeline.parallel.styles import ParallelStyle, StyleContext

IMPLEMENTATION = "atp"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


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
    out, weights = _inner(module)(target, q, k, v, attention_mask, **kwargs)
    return heads.gather(out, 2), weights


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, atp_attention)


class HFAttention(ParallelStyle):
    """A transformers attention module with separate ``q_proj``/``k_proj``/``v_proj``/``o_proj``
    linears on the (d1, d2) mesh; activations in and out split by hidden over d2."""

    name = "hf_attention"

    def check(self, fqn: str, module: nn.Module) -> None:
        for p in PROJECTIONS:
            sub = getattr(module, p, None)
            if type(sub) is not nn.Linear:
                raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) has no plain nn.Linear "
                                  f"'{p}'; style 'hf_attention' needs q_proj, k_proj, v_proj and o_proj")
        if not hasattr(module, "config") or not getattr(module, "head_dim", None):
            raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) is not a transformers "
                              f"attention module (no config or head_dim)")

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        _register()
        cfg = module.config
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        sharding = HeadSharding(comm_for(ctx.mesh), heads, kv)
        module.q_proj = ATPLinear.from_linear(module.q_proj, ctx.mesh, COLUMN)
        for p in ("k_proj", "v_proj"):
            setattr(module, p, ATPLinear.from_linear(getattr(module, p), ctx.mesh, COLUMN,
                                                     gather_output=sharding.kv_gathered))
        module.o_proj = ATPLinear.from_linear(module.o_proj, ctx.mesh, ROW)
        module.atp_heads = sharding
        module.atp_inner_attention = cfg._attn_implementation or "eager"
        module.config = copy.copy(cfg)
        module.config._attn_implementation_internal = IMPLEMENTATION
        return module
