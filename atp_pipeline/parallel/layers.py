"""ATP's parallel non-linear layers on DeviceMesh(d1, d2) (§3.2, Figure 6).

Activations between transformer blocks have their hidden features split over d2 and
replicated over d1 (the input and output layout of ATP's layer). These layers keep that
layout; at a boundary with code that needs the whole tensor, ``input``/``output`` =
``"full"`` slices the input / gathers the output over d2.

* :class:`ParallelLayerNorm` — LayerNorm over a hidden dimension split across d2: the
  sums of x and x² are all-reduced over d2 (and their gradient, whose consumers are
  sharded, likewise);
* :class:`ParallelEmbedding` — an embedding table split by hidden feature over d2 (no
  communication);
* :func:`run_gathered` — any module run whole, on its input gathered over d2 (the user's
  own ``forward`` runs, so it is exact whatever the module computes: an RMSNorm that
  upcasts to float32, a norm with ``(1 + w)``); its output is sliced back over d2 where the
  next module reads the split layout. It costs an all-gather of the hidden per token in
  each direction, against the two statistics of :class:`ParallelLayerNorm`;
* :class:`TiedHead` — an LM head sharing a :class:`ParallelEmbedding`'s table (tied input
  and output embeddings): partial logits of each rank's hidden block over the whole
  vocabulary, all-reduced over d2;
* :class:`VocabParallelLoss` — mean cross-entropy of logits whose vocabulary is split over
  d1 (replaces a cross-entropy module).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from atp_pipeline.parallel import mappings
from atp_pipeline.parallel.comm import comm_for
from atp_pipeline.parallel.linear import sharded_parameter
from atp_pipeline.parallel.mappings import (
    all_reduce_sum,
    copy_to_axis,
    grad_contiguous,
    reduce_from_axis,
    vocab_parallel_cross_entropy,
)
from atp_pipeline.parallel.mesh import Axis, shard_seed, tp_coordinate

FULL, SPLIT = "full", "split"


def split_last(x: torch.Tensor, comm, axis: str) -> torch.Tensor:
    """This rank's block of the last dimension of a replicated ``x`` (gradient: all-gather),
    contiguous: a user's module reducing over it (a float32 norm) sums in the same order as
    on one process."""
    return mappings.split_last(grad_contiguous(x), comm, axis).contiguous()


def gather_last(x: torch.Tensor, comm, axis: str) -> torch.Tensor:
    """All-gather the blocks of the last dimension over ``axis`` (gradient: keep own block),
    contiguous like the tensor one process would hold."""
    return mappings.gather_last(grad_contiguous(x), comm, axis).contiguous()


class ParallelLayerNorm(nn.Module):
    """LayerNorm over a hidden dimension split across d2 (statistics all-reduced over d2)."""

    def __init__(self, ln: nn.LayerNorm, mesh: DeviceMesh, input: str = SPLIT, output: str = SPLIT) -> None:
        super().__init__()
        self.comm = comm_for(mesh)
        self.hidden, self.eps = ln.normalized_shape[0], ln.eps
        self.input, self.output = input, output
        place = [Replicate(), Shard(0)]
        self.weight = sharded_parameter(ln.weight, mesh, place)
        self.bias = sharded_parameter(ln.bias, mesh, place)

    def reset_shards(self, seed: int, name: str) -> None:
        with torch.no_grad():
            self.weight.to_local().fill_(1.0)
            self.bias.to_local().zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d2 = Axis.d2.value
        if self.input == FULL:
            x = split_last(x, self.comm, d2)
        w, b = self.weight.to_local(), self.bias.to_local()
        if self.comm.size(d2) == 1:
            y = F.layer_norm(x, (self.hidden,), w, b, self.eps)
        else:
            stats = all_reduce_sum(torch.stack([x.sum(-1), (x * x).sum(-1)], dim=-1), self.comm, d2)
            mean = stats[..., 0] / self.hidden
            var = stats[..., 1] / self.hidden - mean * mean
            y = (x - mean.unsqueeze(-1)) * torch.rsqrt(var + self.eps).unsqueeze(-1) * w + b
        return gather_last(y, self.comm, d2) if self.output == FULL else y


def run_gathered(module: nn.Module, mesh: DeviceMesh, input: str = SPLIT, output: str = SPLIT,
                 partial_grad: bool = False, inputs: Tuple[str, ...] = ("0",),
                 outputs: Tuple[int, ...] = (0,), stream: Tuple[int, int] = (1, 0)) -> nn.Module:
    """Make ``module`` run on the whole hidden, in place: a forward pre-hook gathers its
    ``inputs`` over d2 (``input="split"``; positional indices as digits, keyword names
    otherwise — by default its first input), a forward hook slices its output over d2
    (``output="split"``; of a tuple, its elements ``outputs``, by default the first). The
    module, its parameter names and its ``forward`` stay the user's; its parameters stay whole on every rank, and their
    gradients are identical across the tensor-parallel ranks and complete: computed from the
    same full tensors, the output's gradient all-gathered whole before the module's backward
    (the slice's backward). ``partial_grad`` (``output="full"``): the output's gradient is
    all-reduced over d2 on its way back, for code that combines the whole output with
    hidden-split tensors. ``stream`` = (k, hidden): the inputs gathered and outputs sliced that
    are k hidden states side by side (a residual stream of hyper-connections, width k*hidden)
    are split as k parts, each over d2 as the hidden is."""
    comm, d2 = comm_for(mesh), Axis.d2.value
    positions = {int(k) for k in inputs if k.isdigit()}
    keywords = {k for k in inputs if not k.isdigit()}
    parts, hidden = stream

    def gather(x):  # noqa: ANN001, ANN202
        if not isinstance(x, torch.Tensor):
            return x
        if parts > 1 and x.shape[-1] * comm.size(d2) == parts * hidden:  # the stream: part by part
            return gather_last(x.unflatten(-1, (parts, -1)), comm, d2).flatten(-2)
        return gather_last(x, comm, d2)

    def split(o):  # noqa: ANN001, ANN202
        if parts > 1 and o.shape[-1] == parts * hidden:
            return split_last(o.unflatten(-1, (parts, hidden)), comm, d2).flatten(-2)
        return split_last(o, comm, d2)

    def before(mod: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        if input != SPLIT:
            return args, kwargs
        args = tuple(gather(a) if i in positions else a for i, a in enumerate(args))
        return args, {k: gather(v) if k in keywords else v for k, v in kwargs.items()}

    def after(mod: nn.Module, args: tuple, out):  # noqa: ANN001, ANN202
        if output == SPLIT:
            if isinstance(out, tuple):
                return tuple(split(o) if i in outputs and isinstance(o, torch.Tensor) else o
                             for i, o in enumerate(out))
            return split(out)
        if partial_grad:  # its consumers' gradients are partial over d2 (``partial_grad``): sum them
            return copy_to_axis(out, comm, d2) if isinstance(out, torch.Tensor) and out.is_floating_point() else out
        return out

    if comm.size(d2) > 1:
        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after)
    module.atp_layout = (input, output)  # what was applied (read by reports and tests)
    return module


class ParallelEmbedding(nn.Module):
    """An embedding table split by hidden feature over d2, replicated over d1."""

    def __init__(self, emb: nn.Embedding, mesh: DeviceMesh, output: str = SPLIT) -> None:
        super().__init__()
        self.comm = comm_for(mesh)
        self.output = output
        self.padding_idx = emb.padding_idx
        self.source_id = id(emb.weight)  # which dense table it replaced (a tied head finds it by this)
        self.weight = sharded_parameter(emb.weight, mesh, [Replicate(), Shard(1)])

    def reset_shards(self, seed: int, name: str) -> None:
        g = torch.Generator().manual_seed(shard_seed(seed, name, tp_coordinate(self.comm.mesh)))
        with torch.no_grad():
            local = self.weight.to_local()
            local.copy_(torch.randn(local.shape, generator=g, dtype=local.dtype))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        y = F.embedding(idx, self.weight.to_local(), self.padding_idx)
        return gather_last(y, self.comm, Axis.d2.value) if self.output == FULL else y


class TiedHead(nn.Module):
    """``logits = x E^T`` with ``E`` the table of a :class:`ParallelEmbedding` (tied
    embeddings). ``E`` is split by hidden over d2 and replicated over d1, so each rank
    multiplies its hidden block of ``x`` by its block of ``E`` over the whole vocabulary and
    the partial logits are all-reduced over d2 (backward: no communication — the gradient of
    the logits is replicated, and ``E``'s gradient from the head adds to the embedding's on
    the same shard). The logits are whole on every rank (the model's own loss runs on them);
    d1 ranks compute the same head, so its FLOPs are not divided by d1. A head's ``bias`` (over
    the vocabulary) is kept whole on every rank and added to the whole logits (its gradient is
    the same on every rank)."""

    def __init__(self, table: ParallelEmbedding, mesh: DeviceMesh, input: str = FULL,
                 bias: Optional[nn.Parameter] = None) -> None:
        super().__init__()
        self.comm, self.input = comm_for(mesh), input
        object.__setattr__(self, "table", table)  # not a submodule: the embedding owns the weight
        self.bias = bias

    @property
    def weight(self) -> nn.Parameter:
        return self.table.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d2 = Axis.d2.value
        if self.input == FULL:
            x = split_last(x, self.comm, d2)
        logits = reduce_from_axis(F.linear(x, self.table.weight.to_local()), self.comm, d2)
        return logits if self.bias is None else logits + self.bias


class VocabParallelLoss(nn.Module):
    """Mean cross-entropy of vocabulary-sharded logits ``[..., V/d1]`` (replaces a CE module)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.comm = comm_for(mesh)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.comm, Axis.d1.value)
