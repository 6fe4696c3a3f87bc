"""``ATPLinear``: row-first / column-first tensor parallelism on DeviceMesh(d1, d2) (§3.2).

For ``Y = X W`` with ``W`` of shape in x out, ATP places ``W`` over (d1, d2) as
``[Shard(1), Shard(0)]`` (column-first: output features split over d1, input features
over d2) or ``[Shard(0), Shard(1)]`` (row-first: input over d1, output over d2). The
weight here is stored ``nn.Linear``-style, out x in, so it carries the placements
transposed: column-first ``[Shard(0), Shard(1)]``, row-first ``[Shard(1), Shard(0)]``.

Activations: a column-first layer takes ``X`` with its features split over d2 (replicated
over d1) and returns ``Y`` split over d1 (replicated over d2) after an all-reduce over d2;
row-first the reverse. So column-first then row-first (MLP, attention) returns to the
input's layout (Figure 6). On ``DeviceMesh(N, 1)`` these are Megatron-LM's column- and
row-parallel linears. Weights and biases are DTensors on the (d1, d2) submesh, so
optimizers, checkpointing and ``full_tensor()`` see the global parameter.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.comm import Comm, comm_for
from atp_pipeline.parallel.mappings import gather_last, linear_all_reduce, split_last
from atp_pipeline.parallel.mesh import device_of, full_tensor, shard_seed, tp_coordinate, tp_mesh

COLUMN, ROW = "column", "row"

# Modules computing ``y = x W^T + b``, by type -> whether they store ``W`` transposed (in x out).
_LINEAR_KINDS: Dict[type, bool] = {nn.Linear: False}
LinearView = Tuple[int, int, torch.Tensor, Optional[torch.Tensor]]


def register_linear_kind(cls: type, transposed: bool = False) -> None:
    """Let the ``column``/``row`` styles replace modules of type ``cls`` that hold ``weight``
    (out x in, or in x out if ``transposed``: transformers' ``Conv1D``) and ``bias``."""
    _LINEAR_KINDS[cls] = transposed


def linear_kinds() -> Tuple[type, ...]:
    return tuple(_LINEAR_KINDS)


def _transposed(cls: type) -> bool:
    for base in cls.__mro__:
        if base in _LINEAR_KINDS:
            return _LINEAR_KINDS[base]
    raise ConfigError(f"{cls.__name__} is not a linear kind ({', '.join(t.__name__ for t in _LINEAR_KINDS)})")


def as_linear(module: nn.Module) -> LinearView:
    """``(in, out, W out x in, b)`` of a module of a registered linear kind."""
    w = module.weight.t() if _transposed(type(module)) else module.weight
    return int(w.shape[1]), int(w.shape[0]), w, module.bias


GROUPED = "atp_grouped"  # attribute of a module: {parameter name: (dim, parts)} stored with grouped rows


def group_rows(w: torch.Tensor, parts: int, n: int, dim: int = 0) -> torch.Tensor:
    """Rows of ``w`` (along ``dim``) that are ``parts`` concatenated segments (a fused q|k|v),
    reordered so that block ``i`` of ``n`` equal blocks holds block ``i`` of every segment:
    sharding the result over ``n`` ranks gives each rank its part of each segment, in segment order."""
    if parts == 1:
        return w
    v = w.movedim(dim, 0)
    return v.reshape(parts, n, v.shape[0] // (parts * n), *v.shape[1:]).transpose(0, 1).reshape(v.shape).movedim(0, dim)


def ungroup_rows(w: torch.Tensor, parts: int, n: int, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`group_rows`."""
    if parts == 1:
        return w
    v = w.movedim(dim, 0)
    return v.reshape(n, parts, v.shape[0] // (parts * n), *v.shape[1:]).transpose(0, 1).reshape(v.shape).movedim(0, dim)


def shard_index(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> Tuple[slice, ...]:
    """The index of this rank's block of a tensor of ``shape`` under ``placements`` on the
    (d1, d2) ``mesh`` (usable on a tensor or on a lazily read one, e.g. a safetensors slice)."""
    sub = tp_mesh(mesh)
    coord = tp_coordinate(mesh)
    index = [slice(0, int(n)) for n in shape]
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            n, size = sub.size(i), index[p.dim].stop - index[p.dim].start
            if size % n:
                raise ConfigError(f"dimension {p.dim} of size {size} does not split "
                                  f"over mesh dimension d{i + 1} of size {n}")
            start = index[p.dim].start + coord[i] * (size // n)
            index[p.dim] = slice(start, start + size // n)
    return tuple(index)


def local_shard(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's block of ``full`` under ``placements`` on the (d1, d2) ``mesh``, in storage of
    its own (a contiguous block would otherwise stay a view keeping the whole tensor alive)."""
    return full[shard_index(full.shape, mesh, placements)].clone(memory_format=torch.contiguous_format)


def sharded_parameter(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> nn.Parameter:
    """A DTensor parameter holding this rank's block of ``full`` (identical on all ranks)."""
    local = local_shard(full.detach(), mesh, placements)
    if not local.is_meta:
        local = local.to(device_of(tp_mesh(mesh)))
    return nn.Parameter(DTensor.from_local(local, tp_mesh(mesh), list(placements), run_check=False))


class ATPLinear(nn.Module):
    """A drop-in for ``nn.Linear(in_features, out_features)`` on a (dp, d1, d2) mesh.

    ``first="column"`` or ``"row"`` picks the sharding (§3.2). ``weight``/``bias`` may be
    given as full tensors (e.g. copied from a dense layer); otherwise they are initialized
    like ``nn.Linear`` from the same seed on every rank.

    Inside a parallel model the input arrives already split (``input_is_parallel``) and the
    output stays split for the next layer. Used alone as a drop-in for ``nn.Linear``, set
    ``input_is_parallel=False`` (the layer takes the full input, replicated on all ranks,
    and keeps its own block) and ``gather_output=True`` (it returns the full output).
    """

    def __init__(self, in_features: int, out_features: int, mesh: DeviceMesh, first: str = COLUMN,
                 bias: bool = True, weight: Optional[torch.Tensor] = None,
                 bias_tensor: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None,
                 input_is_parallel: bool = True, gather_output: bool = False, parts: int = 1,
                 shared_input: bool = False) -> None:
        super().__init__()
        self.input_is_parallel, self.gather_output = input_is_parallel, gather_output
        self.shared_input = shared_input and input_is_parallel  # a full input is scattered: read by this layer only
        if first not in (COLUMN, ROW):
            raise ConfigError(f"ATPLinear first must be 'column' or 'row', got {first!r}")
        self.in_features, self.out_features, self.first = in_features, out_features, first
        self.parts = parts
        self.source_kind: type = nn.Linear  # the dense module it replaced (from_linear)
        self.mesh = mesh
        self.comm: Comm = comm_for(mesh)
        d1, d2 = self.comm.size("d1"), self.comm.size("d2")
        # column-first: out over d1, in over d2; row-first: in over d1, out over d2
        out_axis, in_axis = ("d1", "d2") if first == COLUMN else ("d2", "d1")
        self.out_axis, self.in_axis = out_axis, in_axis
        for name, size, axis in (("out_features", out_features, out_axis), ("in_features", in_features, in_axis)):
            n = d1 if axis == "d1" else d2
            if size % n:
                raise ConfigError(f"ATPLinear({in_features}, {out_features}, first={first!r}): "
                                  f"{name}={size} is not divisible by {axis}={n}")
        if parts > 1 and (first != COLUMN or out_features % (parts * d1)):
            raise ConfigError(f"ATPLinear({in_features}, {out_features}, first={first!r}): {parts} fused output "
                              f"segments need a column-first layer whose out_features divide by {parts}*d1")
        w_place: List[Placement] = [Shard(0), Shard(1)] if first == COLUMN else [Shard(1), Shard(0)]
        if weight is None:
            dense = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
            weight = dense.weight
            bias_tensor = dense.bias if bias else None
        if tuple(weight.shape) != (out_features, in_features):
            raise ConfigError(f"ATPLinear weight must be {out_features}x{in_features} (out x in), "
                              f"got {tuple(weight.shape)}")
        self.weight = sharded_parameter(group_rows(weight, parts, d1), mesh, w_place)
        if bias:
            if bias_tensor is None:
                bound = 1 / math.sqrt(in_features)
                bias_tensor = torch.empty(out_features, dtype=weight.dtype, device=weight.device)
                if not bias_tensor.is_meta:
                    bias_tensor.uniform_(-bound, bound)
            b_place: List[Placement] = [Shard(0), Replicate()] if first == COLUMN else [Replicate(), Shard(0)]
            self.bias = sharded_parameter(group_rows(bias_tensor, parts, d1), mesh, b_place)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Module, mesh: DeviceMesh, first: str, input_is_parallel: bool = True,
                    gather_output: bool = False, parts: int = 1, shared_input: bool = False) -> "ATPLinear":
        """Shard a dense ``nn.Linear`` (or a module of a registered linear kind; same values on
        every rank) into an ATPLinear. A linear on the meta device gives meta shards (no rank
        ever holds the whole weight); :meth:`reset_shards` initializes them once materialized.
        ``parts``: the output features are that many concatenated segments (a fused q|k|v),
        each split over d1 (:func:`group_rows`). ``shared_input``: other layers read the same
        input tensor; their partial input gradients are summed and all-reduced once
        (:class:`~atp_pipeline.parallel.mappings.FanIn`)."""
        n_in, n_out, weight, bias = as_linear(linear)
        layer = cls(n_in, n_out, mesh, first, bias=bias is not None, weight=weight, bias_tensor=bias,
                    input_is_parallel=input_is_parallel, gather_output=gather_output, parts=parts,
                    shared_input=shared_input)
        layer.source_kind = type(linear)
        return layer

    def dense(self, grad: bool = False) -> Dict[str, Optional[torch.Tensor]]:
        """The replaced module's ``weight`` and ``bias`` (or their gradients), whole and in its
        own layout (a ``Conv1D``'s ``W`` transposed; a fused q|k|v in segment order).
        Collective: every rank of the tensor-parallel mesh must call it."""
        n = self.comm.size("d1")

        def whole(p: Optional[nn.Parameter]) -> Optional[torch.Tensor]:
            t = None if p is None else (p.grad if grad else p.data)
            return None if t is None else ungroup_rows(full_tensor(t), self.parts, n)

        w = whole(self.weight)
        if w is not None and _transposed(self.source_kind):
            w = w.t().contiguous()
        return {"weight": w, "bias": whole(self.bias)}

    def local_ranges(self) -> Tuple[List[Tuple[int, int]], Tuple[int, int]]:
        """This rank's block of ``W`` (out x in) in the dense layer's indices: the output
        feature ranges (one per fused segment) and the input feature range."""
        c1, c2 = tp_coordinate(self.mesh)
        (ro, no), (ri, ni) = ((c1, self.comm.size("d1")), (c2, self.comm.size("d2"))) if self.first == COLUMN \
            else ((c2, self.comm.size("d2")), (c1, self.comm.size("d1")))
        seg = self.out_features // self.parts
        block = seg // no
        rows = [(p * seg + ro * block, p * seg + (ro + 1) * block) for p in range(self.parts)]
        width = self.in_features // ni
        return rows, (ri * width, (ri + 1) * width)

    def load_dense(self, weight: Any, bias: Any) -> None:
        """Fill this rank's blocks from the dense layer's ``weight``/``bias`` as stored (sliceable
        like a tensor, e.g. a safetensors slice: only this rank's block is read)."""
        rows, (i0, i1) = self.local_ranges()
        t = _transposed(self.source_kind)
        with torch.no_grad():
            w = torch.cat([weight[i0:i1, r0:r1].t() if t else weight[r0:r1, i0:i1] for r0, r1 in rows], 0)
            self.weight.to_local().copy_(w)
            if self.bias is not None:
                local = self.bias.to_local()
                if self.first == COLUMN:
                    local.copy_(torch.cat([bias[r0:r1] for r0, r1 in rows], 0))
                else:
                    local.copy_(bias[rows[0][0]:rows[0][1]])

    def reset_shards(self, seed: int, name: str) -> None:
        """Initialize this rank's blocks like ``nn.Linear.reset_parameters`` (uniform in
        ``±1/sqrt(in_features)``), from a generator seeded by ``seed``, the layer's name and
        the (d1, d2) coordinate: data-parallel replicas of a shard get the same values."""
        g = torch.Generator().manual_seed(shard_seed(seed, name, tp_coordinate(self.mesh)))
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            for p in (self.weight, self.bias):
                if p is not None:
                    local = p.to_local()
                    local.copy_(torch.rand(local.shape, generator=g, dtype=local.dtype) * 2 * bound - bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: features split over the input axis (or full, unless ``input_is_parallel``);
        returns features split over the output axis (or full, with ``gather_output``)."""
        if not self.input_is_parallel:
            x = split_last(x, self.comm, self.in_axis)
        y = linear_all_reduce(x, self.weight.to_local(), self.comm, self.in_axis, self.out_axis,
                              shared=self.shared_input)
        if self.bias is not None:
            y = y + self.bias.to_local()
        if self.gather_output:
            y = gather_last(y, self.comm, self.out_axis)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, first={self.first}, "
                f"mesh=(d1={self.comm.size('d1')}, d2={self.comm.size('d2')}), bias={self.bias is not None}"
                + (f", parts={self.parts}" if self.parts > 1 else "")
                + (", shared_input=True" if self.shared_input else ""))
