"""The built-in GPT laid out by styles, like every other model (ATP Figure 6 on DeviceMesh(d1, d2)).

Activations between modules keep ATP's layout: hidden features split over d2, replicated
over d1 (the input and output of ATP's parallel transformer layer, Figure 6), so the
GPT's own code between them (residual adds, GeLU, the head reshapes) is elementwise on
its block of the hidden and runs unchanged:

* **Attention** (Figure 6a): the QKV projection column-first (its outputs are ordered head
  by head, so each rank of d1 holds whole heads with their q, k and v), the core on this
  rank's heads (style ``heads``: scattered over d2, gathered back), the output projection
  row-first.
* **MLP** (Figure 6b): column-first, GeLU, row-first.
* **LayerNorm** over a hidden dimension split across d2 (style ``layernorm``: the sums of
  x and x² all-reduced over d2).
* **Embeddings** split by hidden feature over d2; the **LM head** column-first (vocabulary
  over d1) and the **loss** vocabulary-parallel cross-entropy.

Chunk-based overlap (§4.1) and backward overlap (§4.2) are the runtime's, for this plan as
for any other (:mod:`atp_pipeline.parallel.overlap`). The plan is for the GPT's own classes:
:func:`gpt_plan` refuses, in one line, a GPT with a module whose class or ``forward`` is not
the built-in one (its code between the styled modules might not be elementwise).
"""

from __future__ import annotations

import copy
from typing import Dict

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from atp_pipeline.errors import ConfigError
from atp_pipeline.models.gpt.model import GPT, MLP, Attention, AttentionCore, Block
from atp_pipeline.parallel.apply import apply_plan
from atp_pipeline.parallel.comm import comm_for
from atp_pipeline.parallel.styles import (
    AttentionHeads,
    ColumnFirst,
    EmbeddingStyle,
    LayerNormStyle,
    ParallelStyle,
    RowFirst,
    VocabLoss,
)


def check_mesh_fits(heads: int, hidden: int, vocab: int, ffn_mult: int, d1: int, d2: int, what: str = "model") -> None:
    """Clear errors when the mesh does not divide the model (heads over d1*d2, etc.)."""
    if heads % (d1 * d2):
        raise ConfigError(f"{what}: {heads} heads do not split over d1*d2 = {d1}x{d2} = {d1 * d2} devices")
    if hidden % d2 or (ffn_mult * hidden) % d1 or hidden % d1:
        raise ConfigError(f"{what}: hidden {hidden} does not split over d1={d1} and d2={d2}")
    if vocab % d1:
        raise ConfigError(f"{what}: vocabulary {vocab} is not divisible by d1={d1} (vocab-parallel head)")


_SPLIT = dict(input="split", output="split")

# The built-in GPT's plan (module names of :class:`~atp_pipeline.models.gpt.model.GPT`).
PARALLEL_PLAN: Dict[str, ParallelStyle] = {
    "wte": EmbeddingStyle(output="split"),
    "wpe": EmbeddingStyle(output="split"),
    "blocks.*.ln1": LayerNormStyle(**_SPLIT),
    "blocks.*.attn.qkv": ColumnFirst(**_SPLIT),
    "blocks.*.attn.core": AttentionHeads(),
    "blocks.*.attn.proj": RowFirst(**_SPLIT),
    "blocks.*.ln2": LayerNormStyle(**_SPLIT),
    "blocks.*.mlp.fc1": ColumnFirst(**_SPLIT),
    "blocks.*.mlp.fc2": RowFirst(**_SPLIT),
    "ln_f": LayerNormStyle(**_SPLIT),
    "head": ColumnFirst(**_SPLIT),
    "loss_fn": VocabLoss(),
}

# Every class a GPT the plan lays out may hold, by module name pattern (its own forward kept).
_CLASSES = (GPT, Block, Attention, AttentionCore, MLP, nn.ModuleList, nn.Linear, nn.LayerNorm, nn.Embedding,
            nn.CrossEntropyLoss)


def gpt_plan(model: nn.Module) -> Dict[str, ParallelStyle]:
    """:data:`PARALLEL_PLAN` for ``model``, after checking that it is the built-in GPT: every
    module of one of the GPT's classes, none overriding its ``forward``."""
    for name, m in model.named_modules():
        if type(m) not in _CLASSES:
            base = next((c for c in _CLASSES if isinstance(m, c)), None)
            what = f"a {type(m).__name__}" + (f" (a {base.__name__} subclass)" if base else "")
            raise ConfigError(f"GPT layout: '{name or type(model).__name__}' is {what}, not the built-in GPT's; "
                              f"its code between split activations may not be elementwise, so the GPT's plan is "
                              f"refused (give a parallel plan of your own)")
    return dict(PARALLEL_PLAN)


def parallelize_gpt(model: GPT, mesh: DeviceMesh, chunks: int = 1) -> GPT:
    """A copy of a dense GPT (identical on every rank, e.g. same seed) laid out on ``mesh`` by
    the GPT adapter's plan, its blocks run in ``chunks`` (§4.1); same loss and gradients,
    same parameter names."""
    cfg = model.cfg
    comm = comm_for(mesh)
    check_mesh_fits(cfg.heads, cfg.hidden, cfg.vocab_size, cfg.ffn_mult, comm.size("d1"), comm.size("d2"))
    parallel = copy.deepcopy(model)
    apply_plan(parallel, gpt_plan(parallel), mesh, chunks)
    return parallel
