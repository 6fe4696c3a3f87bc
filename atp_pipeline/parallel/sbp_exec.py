"""Execute an SBP layout (AutoDDL §4.2–§4.4) with PyTorch DTensor: issue 8, item 5.

The layout (:class:`~atp_pipeline.planning.sbp.layout.SBPLayout`: one
:class:`~atp_pipeline.planning.sbp.space.Strategy` per layer key), the one device mesh that
refines all its strategies (:func:`~atp_pipeline.planning.sbp.layout.plan_mesh_shape`) and
the per-layer placements (:func:`~atp_pipeline.planning.sbp.layout.placement_names`) are
planned without torch in :mod:`atp_pipeline.planning.sbp.layout`; this module runs them.
DTensor's ``Shard``/``Replicate``/``Partial`` are SBP's Split/Broadcast/Partial (§4.1), so
each layer's layouts are DTensor placements (:class:`LayerLayout`).

**One layer** (:class:`SBPLinear`, the §4.2.2 matmul): ``X = (S0:pb, B:pm, S1:pn)``,
``W = (B:pb, S1:pm, S0:pn)`` (``nn.Linear``'s out×in weight: ``Shard(0)`` on ``m``,
``Shard(1)`` on ``n``), ``Y = (S0:pb, S1:pm, P:pn)`` from a purely local matmul. Every
output is then made split (§4.2): ``Y.redistribute(S0:pb, S1:pm·pn)`` — a reduce-scatter
over ``n`` — and the bias (split like ``Y``'s columns) is added locally.

**Between layers** (§4.3) the next layer's input layout is reached with
``DTensor.redistribute``: DTensor issues the all-gather over the consumer's ``m``, the
all-to-all when the row split changes, and in the backward pass the dual collectives.
Where the paper relabels columns for free (the ``pm = pn'`` path and the gather of an
outer shard), DTensor's standard placements keep the dense column order and may move more
data than the planner's count; the values are exact either way.

**Weight gradients** (§4.4.1): a weight replicated over ``b`` gets a ``Partial`` gradient;
a post-accumulate-grad hook redistributes every gradient to its parameter's placements
(the all-reduce over ``b``), so an optimizer sees gradients laid out like the weights.

:class:`SBPMLP` runs a Linear/GeLU stack; a model family runs whole models through its
adapter's ``apply_sbp`` with these pieces (the built-in model's lives beside it in
:mod:`atp_pipeline.models`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.sbp.layout import (PARTIAL, REPLICATE, SHARD0, SHARD1, SBPLayout, _check_div,
                                              placement_names, plan_mesh_shape, role_dims)
from atp_pipeline.planning.sbp.space import Strategy

__all__ = ["PLACEMENTS", "LayerLayout", "plan_mesh", "SBPLinear", "SBPMLP", "SBPLayout", "plan_mesh_shape",
           "role_dims", "_check_div", "_distribute", "_replicated", "_rows_all", "_sync_grad"]

# the DTensor placement of each placement name of the layout module
PLACEMENTS: Dict[str, Placement] = {SHARD0: Shard(0), SHARD1: Shard(1), REPLICATE: Replicate(), PARTIAL: Partial()}


# ---------------------------------------------------------------------- layer and mesh
@dataclass(frozen=True)
class LayerLayout:
    """DTensor placements of one SBP matmul on the plan's mesh (the tensors of
    :data:`~atp_pipeline.planning.sbp.layout.PLACEMENT_TABLE`)."""

    strategy: Strategy
    dims: Dict[str, List[int]]
    placements: Dict[str, Tuple[Placement, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, s: Strategy, shape: Sequence[int]) -> "LayerLayout":
        places = {t: tuple(PLACEMENTS[n] for n in names) for t, names in placement_names(s, shape).items()}
        return cls(s, role_dims(s, shape), places)

    def __getitem__(self, tensor: str) -> Tuple[Placement, ...]:
        return self.placements[tensor]


_MESHES: Dict[Tuple[str, Tuple[int, ...]], DeviceMesh] = {}


def plan_mesh(layout: SBPLayout, device_type: str = "cpu") -> DeviceMesh:
    """The layout's DeviceMesh (cached per shape: creating one is a collective on all ranks)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("sbp: call torch.distributed.init_process_group first")
    if dist.get_world_size() != layout.devices:
        raise ConfigError(f"sbp plan for {layout.devices} devices cannot run on {dist.get_world_size()} "
                          f"processes")
    shape = layout.mesh_shape()
    key = (device_type, shape)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, shape,
                                        mesh_dim_names=tuple(f"sbp{i}" for i in range(len(shape))))
    return _MESHES[key]


# ---------------------------------------------------------------------- helpers
def _sync_grad(param: torch.Tensor) -> None:
    """§4.4.1: a replicated weight's gradient arrives ``Partial``; all-reduce it into the
    parameter's own placements (a no-op when they already agree)."""
    g = param.grad
    if isinstance(g, DTensor) and isinstance(param, DTensor) and tuple(g.placements) != tuple(param.placements):
        param.grad = g.redistribute(param.device_mesh, param.placements)


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placements: Sequence[Placement]) -> None:
    """Replace ``module.<name>`` by a DTensor parameter of the same values and name."""
    t = getattr(module, name)
    if t is None:
        return
    p = nn.Parameter(distribute_tensor(t.detach(), mesh, list(placements)), requires_grad=t.requires_grad)
    p.register_post_accumulate_grad_hook(_sync_grad)
    setattr(module, name, p)


def _replicated(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A tensor identical on every rank as a replicated DTensor (no communication)."""
    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)


class SBPLinear(nn.Module):
    """An ``nn.Linear`` run as the SBP matmul of §4.2.2 with its output made split (§4.2)."""

    def __init__(self, linear: nn.Linear, key: str, layout: LayerLayout, mesh: DeviceMesh) -> None:
        super().__init__()
        s = layout.strategy
        _check_div("input features", linear.in_features, s.pn, "pn", key)
        _check_div("output features", linear.out_features, s.pm * s.pn, "pm*pn", key)
        self.key, self.layout, self.mesh = key, layout, mesh
        self.weight = linear.weight
        self.bias = linear.bias
        _distribute(self, "weight", mesh, layout["W"])
        _distribute(self, "bias", mesh, layout["bias"])

    def forward(self, x: DTensor) -> DTensor:
        """``x``: a 2-D DTensor (tokens × features) in any layout -> ``Y`` split."""
        rows = x.shape[0]
        _check_div("token rows", rows, self.layout.strategy.pb, "pb", self.key)
        x = x.redistribute(self.mesh, self.layout["X"])  # §4.3 redistribution
        y = F.linear(x, self.weight)  # local: (S0:pb, S1:pm, P:pn)
        y = y.redistribute(self.mesh, self.layout["split"])  # reduce-scatter over n
        return y + self.bias if self.bias is not None else y


def _rows_all(mesh: DeviceMesh, rows: int) -> Tuple[Placement, ...]:
    """Token rows split over every mesh dimension when they divide, else over a prefix."""
    out: List[Placement] = []
    k = 1
    for d in range(mesh.ndim):
        if rows % (k * mesh.size(d)) == 0:
            k *= mesh.size(d)
            out.append(Shard(0))
        else:
            out.append(Replicate())
    return tuple(out)


# ---------------------------------------------------------------------- MLP stack
class SBPMLP(nn.Module):
    """A stack of ``nn.Linear`` layers (GeLU between them) run by an SBP layout whose keys
    are the layer names ``fc0``, ``fc1``, ... (:func:`atp_pipeline.planning.sbp.space.mlp`)."""

    def __init__(self, linears: Sequence[nn.Linear], layout: SBPLayout, mesh: Optional[DeviceMesh] = None) -> None:
        super().__init__()
        keys = [f"fc{i}" for i in range(len(linears))]
        missing = [k for k in keys if k not in layout.strategies]
        if missing:
            raise ConfigError(f"sbp plan: no strategy for MLP layer(s) {', '.join(missing)}")
        self.mesh = mesh or plan_mesh(layout)
        shape = tuple(self.mesh.shape)
        self.layers = nn.ModuleList(
            SBPLinear(copy.deepcopy(lin), k, LayerLayout.of(layout.strategies[k], shape), self.mesh)
            for k, lin in zip(keys, linears))

    def forward(self, x: torch.Tensor) -> DTensor:
        """``x``: the full input (identical on every rank) -> the output, split as the last
        layer's output (§4.2)."""
        h: DTensor = _replicated(x, self.mesh)
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i + 1 < len(self.layers):
                h = F.gelu(h)
        return h
