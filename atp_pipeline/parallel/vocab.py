"""An LM head whose logits never hold the whole vocabulary, and the causal-LM loss on them.

ATP lays out the blocks (§3.2); the head and the loss are ours, after Megatron-LM's
vocabulary-parallel embedding, head and cross-entropy (Shoeybi et al. 2019, §3; Megatron-Core
``tensor_parallel/layers.py::VocabParallelEmbedding`` and
``tensor_parallel/cross_entropy.py::vocab_parallel_cross_entropy``) extended to the 2D mesh as
Optimus / Colossal-AI's 2D layers do (Xu et al. 2021, arXiv:2104.05343;
``VocabParallelEmbedding2D``, ``VocabParallelClassifier2D``, ``VocabParallelCrossEntropyLoss2D``),
here with ATP's activation layout (hidden over d2, replicated over d1):

* :class:`VocabSplitHead` — the head's weight ``[V, h]`` placed vocabulary over d1, hidden over
  d2 (column-first); the d2 partial sums of the logits are reduce-scattered over the tokens
  (:class:`~atp_pipeline.parallel.mappings.VocabSplitLinear`), so rank ``(i, j)`` holds the
  logits of token block ``j`` and vocabulary block ``i``: ``[T/d2, V/d1]``, ``1/(d1*d2)`` of
  the whole. Tied to the token embedding it reads the table of a :class:`VocabSplitEmbedding`
  (the same placement), untied it holds its own block.
* :class:`VocabSplitEmbedding` — the token embedding with that placement: each rank looks up
  the tokens of its vocabulary block (others masked to zero) in its hidden block, and the
  partial rows are all-reduced over d1 (Megatron's masked lookup + all-reduce, backward
  identity); the output is ATP's layout, hidden over d2.
* :func:`causal_lm_loss` / :func:`install_vocab_parallel_loss` — transformers' causal-LM loss
  (``ForCausalLMLoss``) on those blocks: the same label shift (or ``shift_labels``),
  ``ignore_index``, mean or sum / ``num_items_in_batch``, float32 upcast of half logits; the
  per-token log-sum-exp reduced over d1, the token sum over d2. Anything a model does to its
  logits between the head and the loss (final logit softcapping, a logit scale) is
  elementwise and runs on the block unchanged.

The model's ``outputs.logits`` is then this rank's block, ``[T/d2, V/d1]`` with the tokens of
the batch flattened (batch-major, the last block padded with rows of zero hidden); generation
needs the whole logits and so a gathered head (``column(output=full)`` or ``tied``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.comm import Comm, comm_for
from atp_pipeline.parallel.layers import FULL, SPLIT, ParallelEmbedding, gather_last, split_last
from atp_pipeline.parallel.linear import as_linear, sharded_parameter
from atp_pipeline.parallel.mappings import VocabParallelCrossEntropy, reduce_from_axis, token_rows, vocab_split_linear
from atp_pipeline.parallel.mesh import Axis, shard_seed, tp_coordinate

VOCAB_SPLIT = [Shard(0), Shard(1)]  # a [V, h] table: vocabulary over d1, hidden over d2


def _vocab_block(comm: Comm, vocab: int, what: str) -> int:
    d1 = comm.size(Axis.d1.value)
    if vocab % d1:
        raise ConfigError(f"{what}: vocabulary {vocab} does not split over d1={d1}")
    return vocab // d1


class VocabSplitEmbedding(nn.Module):
    """A token embedding ``[V, h]`` split by vocabulary over d1 and hidden over d2: the rows of
    this rank's vocabulary block are looked up (others are zero) and all-reduced over d1."""

    def __init__(self, emb: nn.Embedding, mesh: DeviceMesh, output: str = SPLIT) -> None:
        super().__init__()
        self.comm, self.output = comm_for(mesh), output
        self.num_embeddings, self.embedding_dim = int(emb.num_embeddings), int(emb.embedding_dim)
        self.block = _vocab_block(self.comm, self.num_embeddings, "style 'vocab_embedding'")
        self.lo = self.comm.rank(Axis.d1.value) * self.block
        pad = emb.padding_idx
        self.padding_idx = pad - self.lo if pad is not None and self.lo <= pad < self.lo + self.block else None
        self.source_id = id(emb.weight)  # which dense table it replaced (a tied head finds it by this)
        self.weight = sharded_parameter(emb.weight, mesh, VOCAB_SPLIT)

    def reset_shards(self, seed: int, name: str) -> None:
        """Normal init of this rank's block, as :class:`~.layers.ParallelEmbedding`'s."""
        ParallelEmbedding.reset_shards(self, seed, name)  # type: ignore[arg-type]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.lo
        outside = (local < 0) | (local >= self.block)
        y = F.embedding(local.masked_fill(outside, 0), self.weight.to_local(), self.padding_idx)
        y = reduce_from_axis(y.masked_fill(outside.unsqueeze(-1), 0.0), self.comm, Axis.d1.value)
        return gather_last(y, self.comm, Axis.d2.value) if self.output == FULL else y


class VocabSplitHead(nn.Module):
    """An LM head (no bias) whose logits stay split: ``[T/d2, V/d1]`` on rank ``(i, j)``
    (:class:`~atp_pipeline.parallel.mappings.VocabSplitLinear`). ``linear``: the untied head,
    whose weight this module shards; ``table``: the :class:`VocabSplitEmbedding` it is tied to
    (it holds no parameter then: the embedding owns the weight, and the head's gradient adds to
    the embedding's on the same block). ``input="full"``: the input is the whole hidden."""

    def __init__(self, mesh: DeviceMesh, linear: Optional[nn.Module] = None,
                 table: Optional[VocabSplitEmbedding] = None, input: str = FULL) -> None:
        super().__init__()
        self.comm, self.input = comm_for(mesh), input
        if table is not None:
            object.__setattr__(self, "table", table)  # not a submodule: the embedding owns the weight
            self.in_features, self.out_features = table.embedding_dim, table.num_embeddings
        else:
            assert linear is not None
            self.table = None
            self.in_features, self.out_features, w, _ = as_linear(linear)
            _vocab_block(self.comm, self.out_features, "style 'vocab_head'")
            self.weight = sharded_parameter(w, mesh, VOCAB_SPLIT)

    def __getattr__(self, name: str) -> Any:
        if name == "weight" and self.__dict__.get("table") is not None:
            return self.__dict__["table"].weight
        return super().__getattr__(name)

    def reset_shards(self, seed: int, name: str) -> None:
        """Like ``nn.Linear``'s init (uniform in ``±1/sqrt(in_features)``), per shard."""
        if self.table is not None:
            return
        g = torch.Generator().manual_seed(shard_seed(seed, name, tp_coordinate(self.comm.mesh)))
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            local = self.weight.to_local()
            local.copy_(torch.rand(local.shape, generator=g, dtype=local.dtype) * 2 * bound - bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., h/d2]`` (``[..., h]`` with ``input="full"``) -> this rank's logits
        ``[token_rows(T, d2), V/d1]``, ``T`` the tokens of ``x``."""
        if self.input == FULL:
            x = split_last(x, self.comm, Axis.d2.value)
        return vocab_split_linear(x, self.weight.to_local(), self.comm)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tied={self.table is not None}, logits=[tokens/d2, vocab/d1]")


def causal_lm_loss(logits: torch.Tensor, labels: Optional[torch.Tensor], vocab_size: int, comm: Comm,
                   num_items_in_batch: Optional[Any] = None, ignore_index: int = -100,
                   shift_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on this rank's block ``[token_rows(T, d2), V/d1]`` of
    the logits of a :class:`VocabSplitHead` (``labels``/``shift_labels`` whole, as the user
    gives them): token ``t`` predicts ``labels[t+1]`` (or ``shift_labels[t]``), targets equal to
    ``ignore_index`` count nothing, and the loss is the mean over the counted tokens or, with
    ``num_items_in_batch``, their sum divided by it. Half-precision logits are computed in
    float32 (transformers' upcast); float32 and float64 in their own precision (transformers'
    ``.float()`` would round float64 down to float32). Every rank returns the same loss."""
    d1, d2 = comm.size(Axis.d1.value), comm.size(Axis.d2.value)
    block = logits.shape[-1]
    if block * d1 != vocab_size:
        raise ConfigError(f"vocabulary-parallel loss: logits of {block} classes are not a block of the vocabulary "
                          f"{vocab_size} over d1={d1}; lay the head out with style 'vocab_head' or 'vocab_tied'")
    if shift_labels is None:
        if labels is None:
            raise ConfigError("vocabulary-parallel loss: give labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    tokens = targets.numel()
    rows = token_rows(tokens, d2)
    flat = logits.reshape(-1, block)
    if flat.shape[0] != rows:
        raise ConfigError(f"vocabulary-parallel loss: {flat.shape[0]} rows of logits on this rank, but {tokens} "
                          f"tokens split over d2={d2} give {rows}; lay the head out with style 'vocab_head' or "
                          f"'vocab_tied'")
    counted = targets != ignore_index
    padded = F.pad(targets.masked_fill(~counted, -1), (0, rows * d2 - tokens), value=-1)
    mine = padded[comm.rank(Axis.d2.value) * rows:][:rows]  # -1: in no rank's vocabulary block
    compute = torch.promote_types(flat.dtype, torch.float32)
    per_token = VocabParallelCrossEntropy.apply(flat.to(compute), mine, comm, Axis.d1.value)
    total = reduce_from_axis((per_token * (mine >= 0)).sum(), comm, Axis.d2.value)
    if num_items_in_batch is None:
        return total / counted.sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class VocabParallelCausalLMLoss:
    """:func:`causal_lm_loss` on the mesh, called as transformers calls a model's
    ``loss_function``: ``(logits, labels, vocab_size, num_items_in_batch=None,
    ignore_index=-100, shift_labels=None, **kwargs)``. A plain callable, not a module: assigned
    to ``model.loss_function`` it adds no submodule and no parameter. Given ``model`` instead of
    ``mesh`` (installed before the layout, which then places the head), it runs on the mesh of
    the model's split head, found at the first call."""

    def __init__(self, mesh: Optional[DeviceMesh] = None, model: Optional[nn.Module] = None) -> None:
        assert (mesh is None) != (model is None), "the loss's mesh, or the model whose head has it"
        self.comm: Optional[Comm] = comm_for(mesh) if mesh is not None else None
        self.model = model

    def __call__(self, logits: torch.Tensor, labels: Optional[torch.Tensor] = None, vocab_size: int = 0,
                 num_items_in_batch: Optional[Any] = None, ignore_index: int = -100,
                 shift_labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        if self.comm is None:
            self.comm = _split_head(self.model).comm
        return causal_lm_loss(logits, labels, vocab_size, self.comm, num_items_in_batch, ignore_index, shift_labels)

    def __repr__(self) -> str:
        if self.comm is None:
            return "VocabParallelCausalLMLoss(on the model's split head, once laid out)"
        return f"VocabParallelCausalLMLoss(d1={self.comm.size('d1')}, d2={self.comm.size('d2')})"


def _split_head(model: Any) -> "VocabSplitHead":
    """The model's output embeddings, which the vocabulary-parallel loss needs split (one line if not)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, VocabSplitHead):
        raise ConfigError(f"vocabulary-parallel loss: the output embeddings of {type(model).__name__} are "
                          f"{type(head).__name__}, not a head styled 'vocab_head' or 'vocab_tied'; "
                          f"apply the plan first")
    return head


def install_vocab_parallel_loss(model: nn.Module, mesh: DeviceMesh) -> VocabParallelCausalLMLoss:
    """Replace a transformers causal LM's ``loss_function`` (its setter) with the
    vocabulary-parallel one; the model's output embeddings must be a :class:`VocabSplitHead`
    (styles ``vocab_head`` / ``vocab_tied`` applied first). Returns the installed loss."""
    _split_head(model)
    if not isinstance(getattr(type(model), "loss_function", None), property):
        raise ConfigError(f"vocabulary-parallel loss: {type(model).__name__} has no loss_function to replace")
    loss = VocabParallelCausalLMLoss(mesh)
    model.loss_function = loss
    return loss
