"""Mixture-of-experts experts on ATP's 2-D mesh: every expert tensor-parallel, as an ATP MLP.

transformers (5.x) stores a layer's experts as one module holding 3-D parameters —
``gate_up_proj`` ``[E, 2I, H]`` (or ``up_proj`` ``[E, I, H]`` without a gate) and
``down_proj`` ``[E, H, I]``, transposed where the class says so — and declares their layout
on the class (``use_experts_implementation``: ``has_gate``, ``is_concatenated`` (gate | up,
else interleaved), ``is_transposed``, ``has_bias``, ``has_post_expert_norm``; its
``base_model_tp_plan`` names the module ``moe_tp_experts``). The router runs whole on the
gathered hidden (style ``gathered``), so every rank routes every token alike.

Style ``hf_experts`` lays each expert out as ATP lays out a gated MLP (§3.2, Figure 6): the
up projection column-first (its output, the expert's intermediate, split over d1; its input,
the hidden, over d2), the down projection row-first (intermediate over d1, hidden over d2).
Every rank holds ``1/(d1·d2)`` of every expert and computes its block for every routed
(token, expert) pair; the collectives are those of one MLP on the routed rows, batched over
the experts (Megatron-Core's tensor-parallel experts on a 2-D mesh):

* forward: the up projection's partial sums all-reduced over d2 (``[T·k, 2I/d1]``), the
  weighted, token-summed output over d1 (``[T, H/d2]``);
* backward: the intermediate's gradient over d2 (``[T·k, I/d1]``), the hidden's over d1
  (``[T, H/d2]``), and the routing weights' (``[T·k]``) over d1 and d2 — they multiply
  partial outputs — so the router's parameters get the whole gradient on every rank.

The ``gate_up_proj`` rows are grouped (:func:`~atp_pipeline.parallel.linear.group_rows`) so
that a rank's block holds its part of the gate and of the up projection, and the class's own
``_apply_gate`` runs on it unchanged. Biases and post-expert norms are refused in one line.
"""

from __future__ import annotations

import types
from typing import Dict, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import Shard

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.comm import comm_for
from atp_pipeline.parallel.linear import GROUPED, group_rows, sharded_parameter
from atp_pipeline.parallel.mappings import copy_to_axis, reduce_from_axis
from atp_pipeline.parallel.mesh import Axis
from atp_pipeline.parallel.styles import ParallelStyle, StyleContext

FLAGS = ("has_gate", "is_concatenated", "is_transposed", "has_bias", "has_post_expert_norm")


def experts_infeasibility(module: nn.Module) -> Optional[str]:
    """Why ``module`` is not a transformers experts module this style lays out (None: it is)."""
    missing = [f for f in FLAGS if not hasattr(module, f)]
    if missing:
        return "it does not declare its experts layout (transformers' use_experts_implementation)"
    if module.has_bias:
        return "its experts have biases"
    if module.has_post_expert_norm:
        return "its experts apply a norm after each expert"
    if getattr(module, "_is_expert_parallel", False):
        return "it is already expert-parallel"
    first = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(first, nn.Parameter) or not isinstance(down, nn.Parameter) or first.dim() != 3 or down.dim() != 3:
        return "its expert weights are not 3-D parameters (experts x out x in)"
    return None


def _dims(module: nn.Module) -> Tuple[int, int]:
    """(output dim, input dim) of the experts' 3-D weights (``is_transposed``: ``[E, in, out]``)."""
    return (2, 1) if module.is_transposed else (1, 2)


class HFExperts(ParallelStyle):
    """A transformers experts module -> every expert tensor-parallel (see the module docstring)."""

    name = "hf_experts"

    def __init__(self, per_rank: str = "") -> None:
        # attributes of the enclosing mixture-of-experts block holding the hidden width, which its
        # code reshapes by: made this rank's width (hidden / d2)
        self.per_rank = tuple(a for a in per_rank.split("+") if a)

    def options(self) -> Dict[str, str]:
        return {"per_rank": "+".join(self.per_rank)} if self.per_rank else {}

    def check(self, fqn: str, module: nn.Module) -> None:
        why = experts_infeasibility(module)
        if why:
            raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}): style '{self.name}' needs "
                              f"transformers' experts; {why}")

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        comm = comm_for(ctx.mesh)
        d1, d2 = comm.size(Axis.d1.value), comm.size(Axis.d2.value)
        out_dim, in_dim = _dims(module)
        first = "gate_up_proj" if module.has_gate else "up_proj"
        w1, w2 = getattr(module, first), module.down_proj
        parts = 2 if module.has_gate and module.is_concatenated else 1
        rows, hidden = w1.shape[out_dim], w1.shape[in_dim]
        inter = w2.shape[in_dim]
        per_rank = rows // d1 if rows % (parts * d1) == 0 else 0
        if not per_rank or (module.has_gate and not module.is_concatenated and per_rank % 2) or \
                inter % d1 or hidden % d2:
            raise ConfigError(f"parallel plan: '{fqn}': experts of intermediate {inter} and hidden {hidden} do not "
                              f"split over d1={d1} and d2={d2}")
        w1_grouped = group_rows(w1.detach(), parts, d1, dim=out_dim)
        # tp mesh placements (d1, d2): up projection out over d1, in over d2; down projection
        # in (the intermediate) over d1, out (the hidden) over d2
        new1 = sharded_parameter(w1_grouped, ctx.mesh, [Shard(out_dim), Shard(in_dim)])
        setattr(module, GROUPED, {first: (out_dim, parts)})  # on the module: materializing re-creates parameters
        new2 = sharded_parameter(w2.detach(), ctx.mesh, [Shard(in_dim), Shard(out_dim)])
        setattr(module, first, new1)
        module.down_proj = new2
        module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]
        module.atp_comm = comm
        if self.per_rank:
            if ctx.root is None or "." not in fqn:
                raise ConfigError(f"parallel plan: '{fqn}': style '{self.name}(per_rank=...)' "
                                  "needs the enclosing block")
            block = ctx.root.get_submodule(fqn.rpartition(".")[0])
            for attr in self.per_rank:
                if getattr(block, attr, None) != hidden:
                    raise ConfigError(f"parallel plan: '{fqn}': the enclosing block's '{attr}' is not the hidden "
                                      f"width {hidden}")
                setattr(block, attr, hidden // d2)
        return module


def _forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts on this rank's blocks: ``hidden_states`` ``[T, H/d2]`` (split over d2),
    routing replicated; returns ``[T, H/d2]`` as transformers' eager experts would, split."""
    comm = self.atp_comm
    d1, d2 = Axis.d1.value, Axis.d2.value
    w1 = (self.gate_up_proj if self.has_gate else self.up_proj).to_local()
    w2 = self.down_proj.to_local()
    tokens, k = top_k_index.shape
    x = copy_to_axis(hidden_states, comm, d1)  # its gradient: partial over the intermediate's blocks
    weights = copy_to_axis(copy_to_axis(top_k_weights, comm, d1), comm, d2).reshape(-1)  # multiply partial outputs
    experts = top_k_index.reshape(-1)
    token = torch.arange(tokens, device=hidden_states.device).repeat_interleave(k)
    count = int(getattr(self, "num_experts", w1.shape[0]))
    hit = [int(e) for e in torch.unique(experts) if int(e) < count]  # num_experts: a dropped pair (sentinel)
    rows = [torch.nonzero(experts == e).squeeze(1) for e in hit]
    if not rows:  # the same on every rank: routing is replicated
        return torch.zeros_like(hidden_states)
    t = lambda w: w if self.is_transposed else w.t()  # noqa: E731 - [in, out] for x @ w
    up = torch.cat([x[token[r]] @ t(w1[e]) for e, r in zip(hit, rows)])  # partial over d2
    up = reduce_from_axis(up, comm, d2)
    act = self._apply_gate(up) if self.has_gate else self.act_fn(up)  # this rank's block of the intermediate
    act = copy_to_axis(act, comm, d2)  # its gradient: partial over the hidden's blocks
    sizes = [len(r) for r in rows]
    out = torch.cat([a @ t(w2[e]) for e, a in zip(hit, act.split(sizes))])  # partial over d1
    pairs = torch.cat(rows)
    out = out * weights[pairs, None]
    total = torch.zeros_like(hidden_states).index_add(0, token[pairs], out.to(hidden_states.dtype))
    return reduce_from_axis(total, comm, d1)
