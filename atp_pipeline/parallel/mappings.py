"""Conjugate communication operators as autograd functions (ATP Figure 6, §4.1–4.2).

Each operator pairs a forward collective with its backward conjugate on a named mesh
dimension; all of them go through :class:`~atp_pipeline.parallel.comm.Comm`, which counts
them. A dimension of size 1 makes an operator a no-op.

* :class:`LinearAllReduce` — ``f1..f4`` fused with the GEMM they wrap: ``y = x W^T`` is
  all-reduced over ``fwd_axis`` in the forward (partial sums of a sharded inner dimension);
  in the backward ``dL/dx = g W`` is all-reduced over ``bwd_axis`` *asynchronously while*
  ``dL/dW = g^T x`` computes (§4.2). Column-first: ``fwd_axis = d2``, ``bwd_axis = d1``;
  row-first the reverse — this is Eq. 2's assignment (the prose of §3.2.1 names the other
  dimension). Chunk-based overlap (§4.1) keeps the forward all-reduce in flight while
  another chunk computes (:mod:`~atp_pipeline.parallel.overlap`). Layers reading one input
  (q, k, v) sum their partial input gradients and the last of them reduces the sum once
  (:class:`FanIn`).
* :class:`AllReduceSum` — all-reduce in both directions, for a sum whose consumers are
  sharded (LayerNorm statistics over a hidden dimension split across d2).
* :class:`ReduceFromAxis` — all-reduce in the forward, identity in the backward: partial
  sums whose consumer is replicated (Megatron-Core's ``reduce_from_tensor_model_parallel_region``),
  e.g. the logits of an LM head tied to an embedding split by hidden over d2.
* :class:`CopyToAxis` — identity in the forward, all-reduce of the gradient in the backward:
  a replicated tensor that each rank consumes only in part (Megatron-Core's
  ``copy_to_tensor_model_parallel_region``), e.g. the key/value heads a rank's query heads read.
* :class:`ScatterDim0` / :class:`GatherDim0` — the scatter before and the gather after the
  attention core (§3.2.1): split / all-gather along dim 0, conjugate in backward.
* :class:`SplitLast` / :class:`GatherLast` — the same along the last dimension (features: a
  gathered head's logits, a family's norm on the gathered hidden), without transposing it.
* :class:`VocabParallelCrossEntropy` — cross-entropy over logits whose vocabulary is split
  across d1: max and sum-exp reduced over d1, no communication in backward.
* :class:`VocabSplitLinear` — an LM head whose logits stay split over d1 (vocabulary) and d2
  (tokens): its partial sums over d2 reduce-scattered along the tokens, not all-reduced.
"""

from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from atp_pipeline.parallel import amp
from atp_pipeline.parallel.comm import Comm, wait


class FanIn:
    """The readers of one input whose input gradients are partial over ``axis`` (q, k and v;
    gate and up): in the backward each stashes its partial gradient, and the last one to run
    all-reduces their sum once, while its own weight gradient computes (§4.2).
    :class:`FanInGuard` below the readers reduces whatever a reader that never ran left."""

    def __init__(self, comm: Comm, axis: str) -> None:
        self.comm, self.axis = comm, axis
        self.readers = 0  # registered in the forward
        self.seen = 0  # run in this backward
        self.stash: Optional[torch.Tensor] = None

    def add(self, gx: torch.Tensor) -> None:
        self.seen += 1
        self.stash = gx if self.stash is None else self.stash + gx

    def take(self) -> Optional[torch.Tensor]:
        out, self.stash, self.seen = self.stash, None, 0
        return out


class FanInGuard(torch.autograd.Function):
    """Forward: identity. Backward (after every reader that ran): the gradient, plus the
    all-reduced partial gradients a reader left stashed (none when the last reader ran)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fan: FanIn) -> torch.Tensor:  # type: ignore[override]
        ctx.fan = fan
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        fan: FanIn = ctx.fan
        left = fan.take()
        if left is not None:
            fan.comm.all_reduce(left, fan.axis)
            g = g + left
        return g, None


class LinearAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, comm: Comm, fwd_axis: str, bwd_axis: str,
                fan: Optional[FanIn]) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.comm, ctx.bwd_axis, ctx.fan = comm, bwd_axis, fan
        amp.record(ctx, x)
        y = F.linear(x, w)
        comm.all_reduce(y, fwd_axis)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, w, g = amp.cast(ctx, *ctx.saved_tensors, g)  # as the forward's autocast computed
        comm: Comm = ctx.comm
        fan: Optional[FanIn] = ctx.fan
        gx = handle = None
        if ctx.needs_input_grad[0]:
            gx = g.matmul(w)  # partial over bwd_axis
            if fan is not None:  # summed with the other readers' partial gradients, reduced once
                fan.add(gx)
                gx = fan.take() if fan.seen == fan.readers else None
            if gx is not None:
                handle = comm.all_reduce(gx, ctx.bwd_axis, async_op=True)
        gw = None
        if ctx.needs_input_grad[1]:
            gw = g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        if handle is not None:
            wait(handle)  # a chunk's backward (§4.1) lets another compute first
        return gx, gw, None, None, None, None


class AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.axis = comm, axis
        y = x.clone()
        comm.all_reduce(y, axis)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        g = g.clone()
        ctx.comm.all_reduce(g, ctx.axis)
        return g, None, None


class GradContiguous(torch.autograd.Function):
    """Forward: identity. Backward: the gradient made contiguous — so a user's module that
    reduces over its output's gradient in float32 sums in the order one process would."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g.contiguous()


class ReduceFromAxis(torch.autograd.Function):
    """Forward: all-reduce over ``axis``. Backward: identity (the gradient is replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:  # type: ignore[override]
        y = x.clone()
        comm.all_reduce(y, axis)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g, None, None


class CopyToAxis(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient over ``axis``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.axis = comm, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        g = g.clone()
        ctx.comm.all_reduce(g, ctx.axis)
        return g, None, None


class ScatterDim0(torch.autograd.Function):
    """Forward: keep this rank's block of dim 0. Backward: all-gather the blocks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.axis = comm, axis
        return x.chunk(comm.size(axis), dim=0)[comm.rank(axis)].contiguous()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        full, _ = ctx.comm.all_gather(g, ctx.axis)
        return full, None, None


class GatherDim0(torch.autograd.Function):
    """Forward: all-gather along dim 0. Backward: keep this rank's block."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.axis = comm, axis
        out, _ = comm.all_gather(x, axis)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        comm: Comm = ctx.comm
        return g.chunk(comm.size(ctx.axis), dim=0)[comm.rank(ctx.axis)].contiguous(), None, None


def _blocks_joined(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dimension (rank order): each block sent as
    one contiguous buffer, the gathered ``[n, ..., f]`` interleaved into ``[..., n·f]`` by one copy
    of rows."""
    blocks, _ = comm.all_gather(x.unsqueeze(0), axis)
    return blocks.movedim(0, -2).flatten(-2)


def _own_block(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """This rank's block of the last dimension of ``x``, contiguous."""
    return x.unflatten(-1, (comm.size(axis), -1)).select(-2, comm.rank(axis)).contiguous()


class GatherLast(torch.autograd.Function):
    """Forward: all-gather the blocks of the last dimension. Backward: keep this rank's block.

    Along dim 0 after ``movedim(-1, 0)`` (:class:`GatherDim0`) the tensor is transposed into a
    contiguous ``[f, ...]`` before the gather and read back transposed after it: a gathered
    head's ``[tokens, vocab]`` logits took 2.7 ms of copies forward and 0.5 backward of a 21 ms
    rank CPU step (2304 tokens x 256 on mesh 2x1); rows of ``f`` move here."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.axis = comm, axis
        return _blocks_joined(x, comm, axis)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return _own_block(g, ctx.comm, ctx.axis), None, None


class SplitLast(torch.autograd.Function):
    """Forward: keep this rank's block of the last dimension. Backward: all-gather the blocks
    (:class:`GatherLast`'s conjugate)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.axis = comm, axis
        return _own_block(x, comm, axis)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return _blocks_joined(g, ctx.comm, ctx.axis), None, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of ``logits [N, V/d]`` (this rank's vocab block ``[lo, hi)``)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, comm: Comm,
                axis: str) -> torch.Tensor:  # type: ignore[override]
        n_local = logits.shape[-1]
        lo = comm.rank(axis) * n_local
        peak = logits.max(dim=-1).values
        comm.all_reduce(peak, axis, op="max")
        probs = logits - peak.unsqueeze(-1)  # one logits-sized buffer: shifted, exp, then softmax in place
        local_t = targets - lo
        mine = (local_t >= 0) & (local_t < n_local)  # a target elsewhere (or ignored, -100) picks nothing here
        safe_t = torch.where(mine, local_t, torch.zeros_like(local_t))
        picked = probs.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1) * mine
        probs.exp_()
        sums = torch.stack([probs.sum(dim=-1), picked], dim=-1)
        comm.all_reduce(sums, axis)
        sum_exp, target_logit = sums.unbind(-1)
        probs.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, safe_t, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        softmax, safe_t, mine = ctx.saved_tensors
        grad = softmax * g.unsqueeze(-1)  # (softmax - one-hot) * g, one logits-sized buffer
        grad.scatter_add_(-1, safe_t.unsqueeze(-1), -(mine.to(grad.dtype) * g).unsqueeze(-1))
        return grad, None, None, None


def token_rows(tokens: int, d2: int) -> int:
    """Rows of logits each rank of d2 holds under :class:`VocabSplitLinear`: the tokens padded to
    a multiple of ``d2 * d2`` (``d2`` reduce-scatter rounds of ``d2`` blocks), split over d2."""
    return -(-tokens // (d2 * d2)) * d2 if d2 > 1 else tokens


class VocabSplitLinear(torch.autograd.Function):
    """An LM head whose logits stay split over both mesh dimensions: ``x [T, h/d2]`` (ATP's
    layout: hidden over d2, replicated over d1) times this rank's weight block ``[V/d1, h/d2]``
    (column-first, §3.2) gives logits partial over d2; instead of all-reducing them over d2
    (:class:`LinearAllReduce`), they are *reduce-scattered over d2 along the tokens*, so rank
    ``(i, j)`` keeps the logits ``[T/d2, V/d1]`` of token block ``j`` and vocabulary block
    ``i`` — ``1/(d1*d2)`` of the whole (Megatron-LM's vocabulary-parallel head on d1, with
    sequence-parallel-style token sharding (Korthikanti et al. 2022) on d2).

    The tokens are padded with zero rows to :func:`token_rows` ``* d2``; the reduce-scatter
    runs in ``d2`` rounds, round ``r`` computing sub-block ``r`` of every rank's token block,
    so no rank ever holds more than one block of partial logits besides its output.
    Backward: the conjugate, round by round — all-gather the logit gradients over d2, the
    input gradient ``g W`` (partial over d1, all-reduced over d1 as for any column-first
    linear) and the weight gradient ``g^T x``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, comm: Comm) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.comm = comm
        amp.record(ctx, x)
        d2 = comm.size("d2")
        if d2 == 1:
            return F.linear(x, w)
        rows = token_rows(x.shape[0], d2)
        m = rows // d2
        xr = _padded(x, rows * d2).reshape(d2, d2, m, x.shape[1])  # [owner, round, row, h/d2]
        out: Optional[torch.Tensor] = None
        for r in range(d2):
            y = F.linear(xr[:, r].reshape(d2 * m, x.shape[1]), w)  # partial logits, owner-major
            if out is None:  # in the linear's dtype (under autocast: not x's)
                out = y.new_empty(d2, m, w.shape[0])
            comm.reduce_scatter(out[r], y, "d2")
            del y
        assert out is not None
        return out.view(rows, w.shape[0])

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, w, g = amp.cast(ctx, *ctx.saved_tensors, g)  # as the forward's autocast computed
        comm: Comm = ctx.comm
        d2, n, hl = comm.size("d2"), x.shape[0], x.shape[1]
        gx = gw = None
        if d2 == 1:
            if ctx.needs_input_grad[0]:
                gx = g.matmul(w)
            if ctx.needs_input_grad[1]:
                gw = g.t().matmul(x)
        else:
            m = g.shape[0] // d2
            xr = _padded(x, g.shape[0] * d2).reshape(d2, d2, m, hl)
            gxr = x.new_empty(d2, d2, m, hl) if ctx.needs_input_grad[0] else None
            gw = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
            for r in range(d2):
                full, _ = comm.all_gather(g[r * m:(r + 1) * m], "d2")  # round r of every owner's block
                if gxr is not None:
                    gxr[:, r] = full.matmul(w).view(d2, m, hl)
                if gw is not None:
                    gw.addmm_(full.t(), xr[:, r].reshape(d2 * m, hl))
                del full
            gx = gxr.view(-1, hl)[:n] if gxr is not None else None
        if gx is not None:
            gx = gx.contiguous()
            comm.all_reduce(gx, "d1")  # partial over the vocabulary blocks
        return gx, gw, None


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))


def vocab_split_linear(x: torch.Tensor, w: torch.Tensor, comm: Comm) -> torch.Tensor:
    """:class:`VocabSplitLinear` of ``x [..., h/d2]`` flattened over its tokens: ``[T/d2 (padded), V/d1]``."""
    return VocabSplitLinear.apply(x.reshape(-1, x.shape[-1]), w, comm)


def linear_all_reduce(x: torch.Tensor, w: torch.Tensor, comm: Comm, fwd_axis: str, bwd_axis: str,
                      shared: bool = False) -> torch.Tensor:
    """``F.linear(x, w)`` all-reduced over ``fwd_axis``; its input gradient all-reduced over
    ``bwd_axis`` while the weight gradient computes (§4.2). ``shared``: ``x`` is read by other
    such layers too (q, k and v), whose partial input gradients are summed and all-reduced
    once, by the last of them to run (:class:`FanIn`; Megatron-Core reduces at the fan-out,
    ``copy_to_tensor_model_parallel_region``)."""
    fan = None
    if shared and comm.size(bwd_axis) > 1:
        x, fan = _fan_in(x, comm, bwd_axis)
        fan.readers += 1
    return LinearAllReduce.apply(x, w, comm, fwd_axis, bwd_axis, fan)


def _fan_in(x: torch.Tensor, comm: Comm, axis: str) -> Tuple[torch.Tensor, FanIn]:
    """The guarded alias of ``x`` its readers share and their :class:`FanIn` (made by the first
    reader, found by the others; held weakly by ``x``, so no reference cycle keeps it)."""
    cache = x.__dict__.setdefault("_atp_fan_in", {})
    key = (id(comm), axis)
    ref = cache.get(key)
    found = ref() if ref is not None else None
    if found is not None:
        return found, found._atp_fan
    fan = FanIn(comm, axis)
    alias = FanInGuard.apply(x, fan)
    alias._atp_fan = fan
    cache[key] = weakref.ref(alias)  # the readers' saved tensors keep the alias alive
    return alias, fan


def all_reduce_sum(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    return x if comm.size(axis) == 1 else AllReduceSum.apply(x, comm, axis)


def grad_contiguous(x: torch.Tensor) -> torch.Tensor:
    return GradContiguous.apply(x)


def reduce_from_axis(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    return x if comm.size(axis) == 1 else ReduceFromAxis.apply(x, comm, axis)


def copy_to_axis(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    return x if comm.size(axis) == 1 else CopyToAxis.apply(x, comm, axis)


def scatter_dim0(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    return x if comm.size(axis) == 1 else ScatterDim0.apply(x, comm, axis)


def gather_dim0(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    return x if comm.size(axis) == 1 else GatherDim0.apply(x, comm, axis)


def gather_last(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    return x if comm.size(axis) == 1 else GatherLast.apply(x, comm, axis)


def split_last(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    return x if comm.size(axis) == 1 else SplitLast.apply(x, comm, axis)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm: Comm,
                                 axis: str) -> torch.Tensor:
    """Mean cross-entropy; equals ``F.cross_entropy`` on the gathered logits (under autocast in
    float32, as autocast runs ``F.cross_entropy``)."""
    flat = amp.autocast_fp32(logits.reshape(-1, logits.shape[-1]))
    if comm.size(axis) == 1:
        return F.cross_entropy(flat, targets.reshape(-1))
    return VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), comm, axis).mean()
