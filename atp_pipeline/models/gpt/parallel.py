"""ATP's parallel transformer layer for the built-in GPT, on DeviceMesh(d1, d2) (Figure 6).

Activation layout between blocks: hidden features split over d2, replicated over d1 — the
input and output layout of ATP's parallel transformer layer (Figure 6).

* **Attention** (Figure 6a): QKV column-first (heads split over d1, since the dense
  model orders QKV outputs head by head); the local heads are *scattered* over d2 so the
  attention core is fully sharded (``heads / (d1*d2)`` per rank) and *gathered* back over
  d2 before the row-first output projection.
* **MLP** (Figure 6b): column-first, GeLU, row-first.
* **LayerNorm** over a hidden dimension split across d2: the sums of x and x² are
  all-reduced over d2 (and their gradient, whose consumers are sharded, likewise).
* **Embeddings** are split by hidden feature over d2 (no communication); the **LM head**
  is column-first (vocabulary over d1) and the loss is vocabulary-parallel cross-entropy
  (the adapter's plan, :mod:`atp_pipeline.models.gpt.adapter`).
* **Chunk-based overlap** (§4.1): with ``chunks = k`` each block splits its batch into k
  pieces and runs them as a wavefront over its stages; every stage ends by launching its
  collective, which stays in flight while the other chunks compute. ``k = 1`` is the
  plain path. In the backward pass the overlap is §4.2's: each input-gradient all-reduce
  runs while the weight gradient computes.

Residual adds and biases are local. Every collective goes through the model's
:class:`~atp_pipeline.parallel.comm.Comm`; :func:`atp_pipeline.planning.cost.runtime_terms`
lists exactly what this module sends.

The style ``block`` (:class:`BlockStyle`, registered by the GPT adapter) replaces a
:class:`~atp_pipeline.models.gpt.model.Block` by :class:`ParallelBlock`, whose math is
that block's. A module that is not exactly that block — another class, an overridden
``forward``, other submodules — is accepted only if, run on a random input, it computes
what the GPT block computes with its weights; otherwise it is refused with one line.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from atp_pipeline.errors import ConfigError
from atp_pipeline.models.gpt.model import GPT, MLP, Attention, Block, attention_core
from atp_pipeline.parallel.apply import apply_plan
from atp_pipeline.parallel.comm import Comm, Handle, comm_for
from atp_pipeline.parallel.layers import ParallelLayerNorm
from atp_pipeline.parallel.linear import COLUMN, ROW, ATPLinear
from atp_pipeline.parallel.mappings import gather_dim0, scatter_dim0
from atp_pipeline.parallel.styles import (ColumnFirst, EmbeddingStyle, LayerNormStyle, ParallelStyle, StyleContext,
                                          VocabLoss)


def check_mesh_fits(heads: int, hidden: int, vocab: int, ffn_mult: int, d1: int, d2: int, what: str = "model") -> None:
    """Clear errors when the mesh does not divide the model (heads over d1*d2, etc.)."""
    if heads % (d1 * d2):
        raise ConfigError(f"{what}: {heads} heads do not split over d1*d2 = {d1}x{d2} = {d1 * d2} devices")
    if hidden % d2 or (ffn_mult * hidden) % d1 or hidden % d1:
        raise ConfigError(f"{what}: hidden {hidden} does not split over d1={d1} and d2={d2}")
    if vocab % d1:
        raise ConfigError(f"{what}: vocabulary {vocab} is not divisible by d1={d1} (vocab-parallel head)")


Stage = Callable[[Dict[str, torch.Tensor], List[Handle]], None]


class _Part(nn.Module):
    """A named holder, so parameter names match the dense model's (``blocks.0.attn.qkv``)."""

    def __init__(self, **modules: nn.Module) -> None:
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)


class ParallelBlock(nn.Module):
    def __init__(self, block: Block, mesh: DeviceMesh, chunks: int = 1) -> None:
        super().__init__()
        self.comm: Comm = comm_for(mesh)
        self.chunks = chunks
        attn = block.attn
        self.head_dim = attn.head_dim
        self.ln1 = ParallelLayerNorm(block.ln1, mesh)
        self.attn = _Part(qkv=ATPLinear.from_linear(attn.qkv, mesh, COLUMN),
                          proj=ATPLinear.from_linear(attn.proj, mesh, ROW))
        self.ln2 = ParallelLayerNorm(block.ln2, mesh)
        self.mlp = _Part(fc1=ATPLinear.from_linear(block.mlp.fc1, mesh, COLUMN),
                         fc2=ATPLinear.from_linear(block.mlp.fc2, mesh, ROW))
        self.stages: List[Stage] = [self._qkv, self._attention, self._proj, self._attn_out,
                                    self._fc1, self._fc2, self._mlp_out]

    qkv = property(lambda self: self.attn.qkv)
    proj = property(lambda self: self.attn.proj)
    fc1 = property(lambda self: self.mlp.fc1)
    fc2 = property(lambda self: self.mlp.fc2)

    # Each stage reads chunk state ``st``, may wait for the previous stage's collective,
    # and leaves its own collective in flight in ``pending``.
    def _qkv(self, st: Dict[str, torch.Tensor], pending: List[Handle]) -> None:
        st["y"] = self.qkv.start(self.ln1(st["x"]), pending)

    def _attention(self, st: Dict[str, torch.Tensor], pending: List[Handle]) -> None:
        qkv = self.qkv.finish(st.pop("y"))  # [b, s, heads/d1 * 3 * hd], replicated over d2
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, -1, 3, self.head_dim).permute(2, 0, 1, 3, 4)  # [heads/d1, b, s, 3, hd]
        qkv = scatter_dim0(qkv.contiguous(), self.comm, "d2")  # [heads/(d1 d2), ...]
        q, k, v = (qkv[..., i, :].transpose(0, 1) for i in range(3))  # [b, h_local, s, hd]
        out = attention_core(q, k, v).transpose(0, 1).contiguous()  # [h_local, b, s, hd]
        st["a"] = gather_dim0(out, self.comm, "d2", pending)  # [heads/d1, b, s, hd]

    def _proj(self, st: Dict[str, torch.Tensor], pending: List[Handle]) -> None:
        a = st.pop("a")
        _, b, s, _ = a.shape
        st["y"] = self.proj.start(a.permute(1, 2, 0, 3).reshape(b, s, -1), pending)

    def _attn_out(self, st: Dict[str, torch.Tensor], pending: List[Handle]) -> None:
        st["x"] = st["x"] + self.proj.finish(st.pop("y"))

    def _fc1(self, st: Dict[str, torch.Tensor], pending: List[Handle]) -> None:
        st["y"] = self.fc1.start(self.ln2(st["x"]), pending)

    def _fc2(self, st: Dict[str, torch.Tensor], pending: List[Handle]) -> None:
        st["y"] = self.fc2.start(F.gelu(self.fc1.finish(st.pop("y"))), pending)

    def _mlp_out(self, st: Dict[str, torch.Tensor], pending: List[Handle]) -> None:
        st["x"] = st["x"] + self.fc2.finish(st.pop("y"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Wavefront over (chunk, stage): at step t chunk c runs stage t - c, so chunk c's
        collective from stage s is in flight while chunk c+1 computes stage s and chunk
        c-1 computes stage s+1 (Figure 8); a chunk waits for its own collective only when
        it starts its next stage. With one chunk this is the plain sequential path."""
        if x.shape[0] % self.chunks:
            raise ConfigError(f"chunks={self.chunks} does not divide the local batch {x.shape[0]}")
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


BLOCK_PARTS = ("ln1", "attn", "attn.qkv", "attn.proj", "ln2", "mlp", "mlp.fc1", "mlp.fc2")
_EXACT = {"": Block, "ln1": nn.LayerNorm, "attn": Attention, "attn.qkv": nn.Linear, "attn.proj": nn.Linear,
          "ln2": nn.LayerNorm, "mlp": MLP, "mlp.fc1": nn.Linear, "mlp.fc2": nn.Linear}


def _differs_from_gpt_block(module: nn.Module) -> Optional[str]:
    """None if ``module`` computes the GPT block's function of its own weights, else why not."""
    missing = [p for p in BLOCK_PARTS if not _has(module, p)]
    if missing:
        return f"lacks {', '.join(missing)}"
    exact = all(type(module.get_submodule(p) if p else module) is t for p, t in _EXACT.items())
    if exact:
        return None
    heads = getattr(module.get_submodule("attn"), "heads", None)
    hidden = module.get_submodule("ln1").normalized_shape[0] if isinstance(module.get_submodule("ln1"), nn.LayerNorm) \
        else None
    if not heads or not hidden or any(p.is_meta for p in module.parameters()):
        return "is not the GPT block class and cannot be compared (no attn.heads, or on the meta device)"
    ref = Block(_Shape(hidden, heads, module.get_submodule("mlp.fc1").out_features // hidden))
    try:
        ref.load_state_dict({k: v.detach() for k, v in module.state_dict().items()})
    except (RuntimeError, KeyError) as exc:
        return f"has other parameters than the GPT block ({str(exc).splitlines()[0]})"
    x = torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    candidate = copy.deepcopy(module).double()
    try:
        with torch.no_grad():
            got, want = candidate(x), ref.double()(x)
    except Exception as exc:  # noqa: BLE001 - a block with another signature is not ours
        return f"cannot run as the GPT block ({type(exc).__name__}: {exc})"
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    return None if err <= 1e-9 else f"computes something else than the GPT block (max relative difference {err:.2e})"


class _Shape:
    """The fields of a GPTConfig that :class:`Block` reads."""

    def __init__(self, hidden: int, heads: int, ffn_mult: int) -> None:
        self.hidden, self.heads, self.ffn_mult = hidden, heads, ffn_mult


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


class BlockStyle(ParallelStyle):
    """The GPT block -> :class:`ParallelBlock` (ATP's fused layer with chunk overlap);
    activations in and out split by hidden over d2."""

    name = "block"
    chunked = True

    def check(self, fqn: str, module: nn.Module) -> None:
        why = _differs_from_gpt_block(module)
        if why:
            raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) {why}: style 'block' would "
                              f"substitute the GPT block's math, so it is refused (give its linears "
                              f"column/row styles instead)")

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        return ParallelBlock(module, ctx.mesh, ctx.chunks)  # type: ignore[arg-type]


def parallelize_gpt(model: GPT, mesh: DeviceMesh, chunks: int = 1) -> GPT:
    """A copy of a dense GPT (identical on every rank, e.g. same seed) sharded on ``mesh``
    by the GPT adapter's plan; same loss and gradients, same parameter names."""
    cfg = model.cfg
    comm = comm_for(mesh)
    check_mesh_fits(cfg.heads, cfg.hidden, cfg.vocab_size, cfg.ffn_mult, comm.size("d1"), comm.size("d2"))
    if chunks < 1:
        raise ConfigError(f"chunks must be >= 1, got {chunks}")
    parallel = copy.deepcopy(model)
    apply_plan(parallel, PARALLEL_PLAN, mesh, chunks)
    return parallel


# The built-in GPT's plan (module names of :class:`~atp_pipeline.models.gpt.model.GPT`):
# ATP's layer per block, hidden-sharded embeddings and final LayerNorm, a column-first LM
# head and the vocabulary-parallel loss; activations stay split between them.
PARALLEL_PLAN: Dict[str, ParallelStyle] = {
    "wte": EmbeddingStyle(output="split"),
    "wpe": EmbeddingStyle(output="split"),
    "blocks.*": BlockStyle(),
    "ln_f": LayerNormStyle(input="split", output="split"),
    "head": ColumnFirst(input="split", output="split"),
    "loss_fn": VocabLoss(),
}
