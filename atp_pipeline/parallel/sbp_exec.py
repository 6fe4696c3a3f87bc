"""Execute an SBP layout (AutoDDL §4.2–§4.4) with PyTorch DTensor.

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

:class:`SBPMLP` runs a Linear/GeLU stack this way (the paper's chain, ``io="chain"``).

**Any model** (:func:`apply_sbp_layout`, ``io="rows"`` in
:func:`~atp_pipeline.planning.sbp.space.compile_problem`): a family's adapter names the
model's matmuls and their layer keys (:meth:`~atp_pipeline.models.adapter.ModelAdapter.sbp_linears`);
each becomes an :class:`SBPRowLinear` and everything between them — the family's own
``forward``: norms, rotary, the attention core, residuals, embeddings, head and loss — runs
unchanged on plain local tensors in the *row layout*: whole sequences split over row groups
of consecutive ranks (as many groups as divide the batch and the ranks,
:func:`~atp_pipeline.planning.sbp.space.row_split`; the ranks of a group hold the same
sequences), features whole. An :class:`SBPRowLinear` takes its rank's share of the group's
token rows, brings them to the §4.2.2 ``X`` block (all-to-all over ``n``, all-gather over ``m``), multiplies
by its weight shard locally (``W = (B:pb, S1:pm, S0:pn)``, a DTensor parameter), and
brings the ``Partial`` output back to whole rows (reduce-scatter over ``n``, all-to-all over
``m``, all-gather over the row group). Where an MLP's first matmuls reach its last through
the activation alone (:data:`~atp_pipeline.planning.sbp.chain.INTO`) and the strategies
line up (:func:`~atp_pipeline.planning.sbp.space.direct`, e.g. Megatron's column then row),
the producer's partial output is all-reduced over its ``n`` group and handed to the
consumer as its ``X`` block with no row layout in between. All of it is exactly
:func:`~atp_pipeline.planning.sbp.space.row_io_terms`, the collectives the
search charges (counted by :func:`count_collectives`, tested against
:func:`~atp_pipeline.planning.sbp.schedule.schedule`). Those collectives run on process
groups of the roles' ranks (one group per role, not DTensor's per-mesh-dimension
redistribution, whose ring of a role spanning two mesh dimensions costs more than Table 2's).
The other parameters are DTensors replicated on the plan's mesh; the model's ``forward``
sees their local values, and their gradients, ``Partial`` over all ranks, are all-reduced
like the matmul weights' over ``b`` (§4.4.1). The loss is the mean of the ranks' losses.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.alphabeta import Collective
from atp_pipeline.planning.sbp.chain import INTO
from atp_pipeline.planning.sbp.layout import (
    PARTIAL,
    REPLICATE,
    SHARD0,
    SHARD1,
    SBPLayout,
    _check_div,
    placement_names,
    plan_mesh_shape,
    role_dims,
)
from atp_pipeline.planning.sbp.space import Strategy, direct, row_split

__all__ = ["PLACEMENTS", "LayerLayout", "plan_mesh", "SBPLinear", "SBPMLP", "SBPLayout", "plan_mesh_shape",
           "role_dims", "SBPRowLinear", "SBPRoot", "RowLayout", "apply_sbp_layout", "count_collectives",
           "CountedCall"]

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


# ---------------------------------------------------------------------- any model: the row layout
@dataclass(frozen=True)
class CountedCall:
    """One collective an :class:`SBPRowLinear` ran: kind, group size and rank stride, Table 2
    size ``N`` in bytes (input of a reduce-scatter, output of the others)."""

    collective: Collective
    size: int
    stride: int
    nbytes: int


_LOG: Optional[List[CountedCall]] = None


@contextlib.contextmanager
def count_collectives() -> Iterator[List[CountedCall]]:
    """Record every collective the :class:`SBPRowLinear` layers run while the context is
    open: the activations' (forward and backward) and the weight-gradient all-reduces."""
    global _LOG
    previous, _LOG = _LOG, []
    try:
        yield _LOG
    finally:
        _LOG = previous


def _log(c: Collective, size: int, stride: int, t: torch.Tensor) -> None:
    if _LOG is not None:
        _LOG.append(CountedCall(c, size, stride, t.numel() * t.element_size()))


def _collective(new: str, old: str) -> Any:
    return getattr(dist, new, None) or getattr(dist, old)


# torch 2.13 names them *_single (the *_tensor names warn as deprecated)
_ALL_GATHER = _collective("all_gather_single", "all_gather_into_tensor")
_REDUCE_SCATTER = _collective("reduce_scatter_single", "reduce_scatter_tensor")

_GROUPS: Dict[Tuple[int, int, int], Any] = {}


def role_group(size: int, stride: int) -> Any:
    """This rank's process group of ``size`` ranks ``stride`` apart on the row-major plan
    mesh (the ranks sharing every role coordinate but one). Every rank creates all groups of
    a ``(size, stride)`` in the same order (``new_group`` is collective); cached."""
    world, rank = dist.get_world_size(), dist.get_rank()
    key = (world, size, stride)
    if key not in _GROUPS:
        mine = None
        for base in range(world):
            if (base // stride) % size:  # not the first member of its group
                continue
            ranks = [base + j * stride for j in range(size)]
            g = dist.new_group(ranks)
            if rank in ranks:
                mine = g
        _GROUPS[key] = mine
    return _GROUPS[key]


class _Group:
    """``size`` ranks ``stride`` apart: a role of a matmul's strategy, or the replicas of a
    row group; with this rank's process group (None when alone)."""

    def __init__(self, size: int, stride: int) -> None:
        self.size, self.stride = size, stride
        self.group = role_group(size, stride) if size > 1 else None

    @classmethod
    def role(cls, s: Strategy, role: str) -> "_Group":
        return cls(s.size(role), s.stride(role))


@dataclass
class RowLayout:
    """The row layout of one step (set by :class:`SBPRoot` from the batch): ``replicas``
    consecutive ranks hold the same sequences (:func:`~atp_pipeline.planning.sbp.space.row_split`)."""

    replicas: int = 1
    group: Optional[_Group] = None
    lead: Tuple[int, ...] = ()  # a direct edge's producer input shape without features, for its consumer

    def set(self, sequences: int, world: int) -> int:
        """Lay out ``sequences`` on ``world`` ranks; returns the row groups ``g``."""
        g = row_split(sequences, world)
        self.replicas = world // g
        self.group = _Group(self.replicas, 1) if self.replicas > 1 else None
        return g


def _a2a(x: torch.Tensor, g: _Group) -> torch.Tensor:
    """``x``: ``(k, ...)`` blocks, block ``j`` to peer ``j`` -> peer ``j``'s block for me at ``j``."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=g.group)
    _log(Collective.all_to_all, g.size, g.stride, out)
    return out


def _cols_to_rows(x: torch.Tensor, g: _Group) -> torch.Tensor:
    """``(t, k·c)`` whole rows -> ``(k·t, c)``: my column block of the group's rows (peer order)."""
    t, kc = x.shape
    out = _a2a(x.view(t, g.size, kc // g.size).transpose(0, 1), g)
    return out.reshape(g.size * t, kc // g.size)


def _rows_to_cols(y: torch.Tensor, g: _Group) -> torch.Tensor:
    """The inverse of :func:`_cols_to_rows`: ``(k·t, c)`` -> ``(t, k·c)``."""
    kt, c = y.shape
    out = _a2a(y.view(g.size, kt // g.size, c), g)
    return out.transpose(0, 1).reshape(kt // g.size, g.size * c)


def _gather_rows(x: torch.Tensor, g: _Group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((g.size * x.shape[0],) + tuple(x.shape[1:]))
    _ALL_GATHER(out, x, group=g.group)
    _log(Collective.all_gather, g.size, g.stride, out)
    return out


def _scatter_rows(y: torch.Tensor, g: _Group) -> torch.Tensor:
    y = y.contiguous()
    out = y.new_empty((y.shape[0] // g.size,) + tuple(y.shape[1:]))
    _log(Collective.reduce_scatter, g.size, g.stride, y)
    _REDUCE_SCATTER(out, y, group=g.group)
    return out


def _conjugate(name: str, fwd: Callable[[torch.Tensor, _Group], torch.Tensor],
               bwd: Callable[[torch.Tensor, _Group], torch.Tensor]) -> Any:
    """An autograd function running ``fwd`` on a group in the forward and its conjugate ``bwd``
    on the gradient (Megatron-Core's ``mappings.py`` pairs)."""

    def forward(ctx: Any, x: torch.Tensor, g: _Group) -> torch.Tensor:
        ctx.g = g
        return fwd(x, g)

    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return bwd(grad, ctx.g), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                    "backward": staticmethod(backward)})


_ColsToRows = _conjugate("_ColsToRows", _cols_to_rows, _rows_to_cols)
_RowsToCols = _conjugate("_RowsToCols", _rows_to_cols, _cols_to_rows)
_GatherRows = _conjugate("_GatherRows", _gather_rows, _scatter_rows)
_ScatterRows = _conjugate("_ScatterRows", _scatter_rows, _gather_rows)


def _reduce_grad(param: torch.Tensor, group: Any, counted: Optional[Tuple[int, int]] = None) -> None:
    """A DTensor parameter's ``Partial`` gradient summed over ``group`` (None: nothing to sum)
    into the parameter's own placements, by one all-reduce (DTensor's redistribution would
    run one per mesh dimension, in an order that may differ between ranks); ``counted``:
    ``(size, stride)`` to record it under :func:`count_collectives`."""
    g = param.grad
    if not isinstance(g, DTensor) or tuple(g.placements) == tuple(param.placements):  # type: ignore[attr-defined]
        return
    local = g.to_local().contiguous()
    if group is not None:
        if counted is not None:
            _log(Collective.all_reduce, counted[0], counted[1], local)
        dist.all_reduce(local, group=group)
    param.grad = DTensor.from_local(local, param.device_mesh, param.placements,  # type: ignore[attr-defined]
                                    run_check=False, shape=param.shape, stride=param.stride())


def _replicated_param(t: torch.Tensor, mesh: DeviceMesh) -> nn.Parameter:
    """``t`` as a parameter replicated on ``mesh`` whose per-rank partial gradient is summed
    over all ranks once accumulated."""
    p = nn.Parameter(distribute_tensor(t.detach(), mesh, [Replicate()] * mesh.ndim), requires_grad=t.requires_grad)
    group = dist.group.WORLD if mesh.size() > 1 else None
    p.register_post_accumulate_grad_hook(lambda q: _reduce_grad(q, group))
    return p


class _AllReduce(torch.autograd.Function):
    """A direct edge's partial output summed over the producer's ``n`` group; the backward
    sums the consumer's partial input gradients over the same ranks."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, g: _Group) -> torch.Tensor:  # type: ignore[override]
        ctx.g = g
        return _all_reduce(y, g)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:  # type: ignore[override]
        return _all_reduce(grad, ctx.g), None


def _all_reduce(y: torch.Tensor, g: _Group) -> torch.Tensor:
    out = y.contiguous().clone()
    _log(Collective.all_reduce, g.size, g.stride, out)
    dist.all_reduce(out, group=g.group)
    return out


def _partial_on_replicas(placements: Sequence[Placement]) -> Tuple[Placement, ...]:
    """A replicated parameter's gradient arrives as a per-rank partial sum."""
    return tuple(Partial() if isinstance(p, Replicate) else p for p in placements)


class SBPRowLinear(nn.Module):
    """A linear (``nn.Linear``, or a registered transposed kind such as transformers' ``Conv1D``)
    run as the §4.2.2 matmul of its strategy with input and output in the row layout (see
    the module docstring); same parameter names and values as the dense module, the weight
    a DTensor placed ``W = (B:pb, S1:pm, S0:pn)`` on the plan's mesh, the bias replicated."""

    def __init__(self, linear: nn.Module, key: str, strategy: Strategy, mesh: DeviceMesh) -> None:
        super().__init__()
        from atp_pipeline.parallel.linear import _transposed

        self.key, self.strategy, self.mesh = key, strategy, mesh
        self.transposed = _transposed(type(linear))
        n, m = (linear.weight.shape if self.transposed else linear.weight.shape[::-1])
        self.in_features, self.out_features = int(n), int(m)
        _check_div("input features", self.in_features, strategy.pn, "pn", key)
        _check_div("output features", self.out_features, strategy.pm, "pm", key)
        w = LayerLayout.of(strategy, tuple(mesh.shape))["W"]  # nn.Linear's out x in
        if self.transposed:
            w = tuple(Shard(1 - p.dim) if isinstance(p, Shard) else p for p in w)
        self.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, list(w)),
                                   requires_grad=linear.weight.requires_grad)
        self.b_group = _Group.role(strategy, "b")
        self.weight.register_post_accumulate_grad_hook(self._sync_weight_grad)
        self.bias = _replicated_param(linear.bias, mesh) if linear.bias is not None else None
        self._w_grad = _partial_on_replicas(w)
        self._b_grad = (Partial(),) * mesh.ndim
        self.n_group, self.m_group = _Group.role(strategy, "n"), _Group.role(strategy, "m")
        self.rows = RowLayout()  # shared with the other matmuls by apply_sbp_layout
        # direct edges (set by apply_sbp_layout): the output is the next matmul's X as it
        # stands / the input is the previous matmul's output as it stands
        self.direct_out, self.direct_in = False, False

    def _sync_weight_grad(self, param: torch.Tensor) -> None:
        """§4.4.1: the weight, replicated over ``b``, gets per-rank partial gradients; one
        all-reduce over the ``b`` role's ranks (Table 2's ring of ``pb``) sums them."""
        _reduce_grad(param, self.b_group.group if self.b_group.size > 1 else None,
                     (self.b_group.size, self.b_group.stride))

    def extra_repr(self) -> str:
        return f"key={self.key}, strategy={self.strategy.label()}, {self.in_features} -> {self.out_features}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(..., n)``, this rank's rows of the row layout -> ``(..., m)``, the same
        rows; on a direct edge the producer returns, and the consumer takes, the consumer's
        ``X`` block (2-D) instead."""
        gn, gm, replicas = self.n_group, self.m_group, self.rows.group
        if self.direct_in:
            h, lead = x, self.rows.lead
        else:
            lead = tuple(x.shape[:-1])
            h = self._to_x(x.reshape(-1, self.in_features))
        w = self.weight.to_local(grad_placements=self._w_grad)  # type: ignore[union-attr]
        y = h @ w if self.transposed else h @ w.t()  # Partial over n
        t = y.shape[0] // (gm.size * gn.size)
        if self.direct_out:
            if self.bias is not None:  # counted once: by the n group's first rank, before the sum
                first = dist.get_rank() // gn.stride % gn.size == 0  # (every rank uses it: same hooks)
                y = y + (1.0 if first else 0.0) * self._bias_block()
            if gn.size > 1:
                y = _AllReduce.apply(y, gn)
                # rows (m peer, n peer) -> the consumer's (its m peer = my n peer, its n peer = my m peer)
                y = y.view(gm.size, gn.size, t, -1).transpose(0, 1).reshape(-1, y.shape[-1])
            self.rows.lead = lead
            return y
        if gn.size > 1:
            y = y.view(gm.size, gn.size, t, -1).transpose(0, 1).reshape(-1, y.shape[-1])
            y = _ScatterRows.apply(y, gn)  # summed; rows (m peer, my n), my output-column block
        if gm.size > 1:
            y = _RowsToCols.apply(y, gm)  # my rows, whole
        if replicas is not None:
            y = _GatherRows.apply(y, replicas)  # the row group's rows (backward: partial sums reduce-scattered)
        if self.bias is not None:
            y = y + self.bias.to_local(grad_placements=self._b_grad)  # type: ignore[union-attr]
        return y.view(*lead, self.out_features)

    def _to_x(self, h: torch.Tensor) -> torch.Tensor:
        """Row-layout token rows -> this rank's ``X`` block: its share of the row group's
        rows (free), all-to-all over ``n``, all-gather over ``m``."""
        gn, gm, replicas = self.n_group, self.m_group, self.rows.group
        if replicas is not None:  # this rank's 1/r of its row group's token rows (free)
            t = h.shape[0] // replicas.size
            if h.shape[0] % replicas.size:
                raise ConfigError(f"sbp: layer '{self.key}': {h.shape[0]} token rows do not split over the "
                                  f"{replicas.size} ranks of a row group")
            j = dist.get_rank() % replicas.size
            h = h[j * t:(j + 1) * t]
        if gn.size > 1:
            h = _ColsToRows.apply(h, gn)  # rows of the n group, my input-column block
        if gm.size > 1:
            h = _GatherRows.apply(h, gm)  # rows of my b group, ordered (m peer, n peer)
        return h

    def _bias_block(self) -> torch.Tensor:
        """This rank's output-column block of the (replicated) bias."""
        gm = self.m_group
        block = self.out_features // gm.size
        j = dist.get_rank() // gm.stride % gm.size
        b = self.bias.to_local(grad_placements=self._b_grad)  # type: ignore[union-attr]
        return b[j * block:(j + 1) * block]


class _GlobalMean(torch.autograd.Function):
    """The mean over ranks of a per-rank scalar; the result is one value on every rank, so
    each rank's share of its gradient is ``1/world``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, world: int) -> torch.Tensor:  # type: ignore[override]
        ctx.world = world
        out = x.detach().clone()
        dist.all_reduce(out)
        return out / world

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad / ctx.world, None


class _GatherBatch(torch.autograd.Function):
    """Every row group's rows of a row-layout output (one replica's copy each), concatenated
    in order: one value on every rank, so the backward gives each of a group's ``replicas``
    ranks ``1/replicas`` of its rows' gradient (partial sums over the replicas)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, replicas: int) -> torch.Tensor:  # type: ignore[override]
        world = dist.get_world_size()
        ctx.group, ctx.rows, ctx.replicas = dist.get_rank() // replicas, x.shape[0], replicas
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        _ALL_GATHER(out, x.contiguous())
        return out.view(world // replicas, replicas, *x.shape)[:, 0].reshape(-1, *x.shape[1:])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad[ctx.group * ctx.rows:(ctx.group + 1) * ctx.rows] / ctx.replicas, None


class SBPRoot:
    """Mixed into a laid-out model's class by :func:`apply_sbp_layout`: its ``forward``
    takes the full batch, runs the family's own ``forward`` on this rank's sequences with
    the replicated parameters' local values, and returns the mean loss over all ranks (an
    output with a loss keeps this rank's logits; without a loss the logits are gathered)."""

    _sbp_world: int
    _sbp_slots: List[Tuple[nn.Module, str, nn.Parameter]]
    _sbp_rows: RowLayout

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        world, rank = self._sbp_world, dist.get_rank()
        batch = next((t.shape[0] for t in list(args) + list(kwargs.values())
                      if isinstance(t, torch.Tensor) and t.dim() >= 1), None)
        if batch is None:
            raise ConfigError(f"sbp: {type(self).__name__} was called without a batch tensor")
        groups = self._sbp_rows.set(batch, world)
        per, mine = batch // groups, rank // self._sbp_rows.replicas

        def local(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch:
                return v[mine * per:(mine + 1) * per]
            return v

        args = tuple(local(a) for a in args)
        kwargs = {k: local(v) for k, v in kwargs.items()}
        views: Dict[int, torch.Tensor] = {}
        for mod, name, p in self._sbp_slots:  # tied parameters share one local view
            if id(p) not in views:
                views[id(p)] = p.to_local(grad_placements=(Partial(),) * p.device_mesh.ndim)  # type: ignore[attr-defined]
            mod._parameters[name] = views[id(p)]  # type: ignore[assignment]
        try:
            out = super().forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            for mod, name, p in self._sbp_slots:
                mod._parameters[name] = p
        replicas = self._sbp_rows.replicas
        if isinstance(out, torch.Tensor):
            return _GlobalMean.apply(out, world) if out.dim() == 0 else _GatherBatch.apply(out, replicas)
        loss = getattr(out, "loss", None)
        if loss is not None:  # the logits stay this rank's rows (gathering them costs batch x vocab)
            out.loss = _GlobalMean.apply(loss, world)
        elif getattr(out, "logits", None) is not None:
            out.logits = _GatherBatch.apply(out.logits, replicas)
        return out


def apply_sbp_layout(module: nn.Module, linears: Mapping[str, str], layout: SBPLayout,
                     mesh: Optional[DeviceMesh] = None) -> nn.Module:
    """Lay ``module`` out by ``layout`` in place and return it: every module named in
    ``linears`` (``{module name: layer key}``, from the family's adapter) becomes an
    :class:`SBPRowLinear` with the key's strategy, every other parameter a replicated
    DTensor, and the module's class gains :class:`SBPRoot`'s ``forward`` (module docstring).
    Parameter names and values are the dense model's."""
    mesh = mesh or plan_mesh(layout)
    shape = tuple(mesh.shape)
    if shape != layout.mesh_shape():
        raise ConfigError(f"sbp plan: mesh {shape} is not the plan's mesh {layout.mesh_shape()}")
    missing = sorted({k for k in linears.values() if k not in layout.strategies})
    if missing:
        raise ConfigError(f"sbp plan: no strategy for layer key(s) {', '.join(missing)} of "
                          f"{type(module).__name__} (the plan has {', '.join(layout.strategies)})")
    if isinstance(module, SBPRoot):
        raise ConfigError(f"sbp plan: {type(module).__name__} is already laid out by an SBP plan")
    drop = sorted(n for n, m in module.named_modules() if isinstance(m, nn.Dropout) and m.p > 0)
    if drop:  # ranks holding other rows or blocks would draw the same masks (no RNG streams here yet)
        raise ConfigError(f"sbp plan: dropout in {type(module).__name__} "
                          f"('{drop[0]}' p={module.get_submodule(drop[0]).p:g}"
                          f"{f' and {len(drop) - 1} more' if len(drop) > 1 else ''}) is not supported by the SBP "
                          f"executor (no per-rank random streams); set it to 0 or use planner=atp")
    rows = RowLayout()
    for name, key in linears.items():
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        lin = SBPRowLinear(getattr(parent, attr), key, layout.strategies[key], mesh)
        lin.rows = rows
        into = INTO.get(key)  # the family's code between them is elementwise (chain.INTO)
        lin.direct_out = into is not None and into in layout.strategies and direct(lin.strategy,
                                                                                     layout.strategies[into])
        source = next((a for a, b in INTO.items() if b == key and a in layout.strategies), None)
        lin.direct_in = source is not None and direct(layout.strategies[source], lin.strategy)
        setattr(parent, attr, lin)
    made: Dict[int, nn.Parameter] = {}
    slots: List[Tuple[nn.Module, str, nn.Parameter]] = []
    for mod in module.modules():
        if isinstance(mod, SBPRowLinear):
            continue
        for name, p in list(mod._parameters.items()):
            if p is None or isinstance(p, DTensor):
                continue
            if id(p) not in made:
                made[id(p)] = _replicated_param(p, mesh)
            mod._parameters[name] = made[id(p)]
            slots.append((mod, name, made[id(p)]))
    cls = type(module)
    # the family's class name and module are kept: a family's export records them (e.g.
    # transformers' config.json "architectures"), and the laid-out model is still of that class
    module.__class__ = type(cls.__name__, (SBPRoot, cls), {"__module__": cls.__module__,
                                                          "__qualname__": cls.__qualname__})
    module._sbp_world = layout.devices  # type: ignore[attr-defined]
    module._sbp_slots = slots  # type: ignore[attr-defined]
    module._sbp_rows = rows  # type: ignore[attr-defined]
    return module
