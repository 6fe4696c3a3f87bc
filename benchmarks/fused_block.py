"""A hand-scheduled fused GPT block, a comparator for ``benchmarks.tp_step --fused``: the same
math and collectives as the GPT's style plan, scheduled as a wavefront over seven stages per
chunk with the collectives left in flight through explicit handles (ATP paper §4.1). Not part
of the package: the package lays out every model through its style plan."""

from __future__ import annotations

import copy
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from atp_pipeline.models.gpt.model import GPT, Block, attention_core
from atp_pipeline.parallel.apply import apply_plan
from atp_pipeline.parallel.comm import Comm, Handle, comm_for
from atp_pipeline.parallel.layers import ParallelLayerNorm
from atp_pipeline.parallel.linear import COLUMN, ROW, ATPLinear
from atp_pipeline.parallel.mappings import scatter_dim0
from atp_pipeline.parallel.styles import (
    ColumnFirst,
    EmbeddingStyle,
    LayerNormStyle,
    ParallelStyle,
    StyleContext,
    VocabLoss,
)


class _AsyncLinear(torch.autograd.Function):
    """The old ``LinearAllReduce``: the forward all-reduce left in flight in ``pending``."""

    @staticmethod
    def forward(ctx, x, w, comm: Comm, fwd_axis: str, bwd_axis: str, pending: List[Handle]):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.comm, ctx.bwd_axis = comm, bwd_axis
        y = F.linear(x, w)
        pending.append(comm.all_reduce(y, fwd_axis, async_op=True))
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, w = ctx.saved_tensors
        gx = g.matmul(w)
        handle = ctx.comm.all_reduce(gx, ctx.bwd_axis, async_op=True)
        gw = g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        handle.wait()
        return gx, gw, None, None, None, None


class _AsyncGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, axis: str, pending: List[Handle]):  # type: ignore[override]
        ctx.comm, ctx.axis = comm, axis
        out, handle = comm.all_gather(x, axis, async_op=True)
        pending.append(handle)
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g.chunk(ctx.comm.size(ctx.axis), dim=0)[ctx.comm.rank(ctx.axis)].contiguous(), None, None, None


def _start(layer: ATPLinear, x: torch.Tensor, pending: List[Handle]) -> torch.Tensor:
    return _AsyncLinear.apply(x, layer.weight.to_local(), layer.comm, layer.in_axis, layer.out_axis, pending)


def _finish(layer: ATPLinear, y: torch.Tensor) -> torch.Tensor:
    return y if layer.bias is None else y + layer.bias.to_local()


class _Part(nn.Module):
    def __init__(self, **modules: nn.Module) -> None:
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)


Stage = Callable[[Dict[str, torch.Tensor], List[Handle]], None]


class FusedBlock(nn.Module):
    """ATP's fused layer on (d1, d2): seven stages per chunk, run as a diagonal wavefront."""

    def __init__(self, block: Block, mesh: DeviceMesh, chunks: int = 1) -> None:
        super().__init__()
        self.comm = comm_for(mesh)
        self.chunks = chunks
        self.head_dim = block.attn.head_dim
        self.ln1 = ParallelLayerNorm(block.ln1, mesh)
        self.attn = _Part(qkv=ATPLinear.from_linear(block.attn.qkv, mesh, COLUMN),
                          proj=ATPLinear.from_linear(block.attn.proj, mesh, ROW))
        self.ln2 = ParallelLayerNorm(block.ln2, mesh)
        self.mlp = _Part(fc1=ATPLinear.from_linear(block.mlp.fc1, mesh, COLUMN),
                         fc2=ATPLinear.from_linear(block.mlp.fc2, mesh, ROW))
        self.stages: List[Stage] = [self._qkv, self._attention, self._proj, self._attn_out, self._fc1, self._fc2,
                                    self._mlp_out]

    def _qkv(self, st, pending):
        st["y"] = _start(self.attn.qkv, self.ln1(st["x"]), pending)

    def _attention(self, st, pending):
        qkv = _finish(self.attn.qkv, st.pop("y"))
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, -1, 3, self.head_dim).permute(2, 0, 1, 3, 4)
        qkv = scatter_dim0(qkv.contiguous(), self.comm, "d2")
        q, k, v = (qkv[..., i, :].transpose(0, 1) for i in range(3))
        out = attention_core(q, k, v).transpose(0, 1).contiguous()
        st["a"] = _AsyncGather.apply(out, self.comm, "d2", pending) if self.comm.size("d2") > 1 else out

    def _proj(self, st, pending):
        a = st.pop("a")
        _, b, s, _ = a.shape
        st["y"] = _start(self.attn.proj, a.permute(1, 2, 0, 3).reshape(b, s, -1), pending)

    def _attn_out(self, st, pending):
        st["x"] = st["x"] + _finish(self.attn.proj, st.pop("y"))

    def _fc1(self, st, pending):
        st["y"] = _start(self.mlp.fc1, self.ln2(st["x"]), pending)

    def _fc2(self, st, pending):
        st["y"] = _start(self.mlp.fc2, F.gelu(_finish(self.mlp.fc1, st.pop("y"))), pending)

    def _mlp_out(self, st, pending):
        st["x"] = st["x"] + _finish(self.mlp.fc2, st.pop("y"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        states = [{"x": c} for c in x.chunk(self.chunks, dim=0)]
        in_flight: List[List[Handle]] = [[] for _ in states]
        n = len(self.stages)
        for t in range(n + len(states) - 1):
            for c, (st, pending) in enumerate(zip(states, in_flight)):
                if 0 <= t - c < n:
                    for h in pending:
                        h.wait()
                    pending.clear()
                    self.stages[t - c](st, pending)
        for pending in in_flight:
            for h in pending:
                h.wait()
        return states[0]["x"] if len(states) == 1 else torch.cat([st["x"] for st in states], dim=0)


class _FusedStyle(ParallelStyle):
    name = "fused_block_comparator"

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks

    def check(self, fqn: str, module: nn.Module) -> None:
        pass

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        return FusedBlock(module, ctx.mesh, self.chunks)  # type: ignore[arg-type]


def fused_gpt(model: GPT, mesh: DeviceMesh, chunks: int = 1) -> GPT:
    """A copy of ``model`` laid out with the hand-scheduled fused blocks (same embeddings, final norm,
    head and loss as the style plan)."""
    plan: Dict[str, ParallelStyle] = {
        "wte": EmbeddingStyle(output="split"), "wpe": EmbeddingStyle(output="split"), "blocks.*": _FusedStyle(chunks),
        "ln_f": LayerNormStyle(input="split", output="split"), "head": ColumnFirst(input="split", output="split"),
        "loss_fn": VocabLoss()}
    parallel = copy.deepcopy(model)
    apply_plan(parallel, plan, mesh)
    return parallel
