"""Per-device memory of a model under ATP's placements, to refuse runs that cannot fit.

Parameters per device follow ATP's layout (§3.2): matrices over d1*d2, the column-first
biases over d1, the row-first biases, norms and embeddings over d2 (norms whole on every
rank where a family is laid out module by module), the LM head over d1*d2 (none when tied
to the embedding; a tied ``vocab_split`` head's embedding over d1*d2 too); modules run whole
(``whole_params``: a whole head's module around it, not its weight) on every rank, in place of
the split weights of the layers they stand for; weights and gradients in the model's dtype, AdamW's two
moments in fp32 (plus fp32 master weights for fp16/bf16). Activations use Korthikanti et
al. (2022)'s per-layer estimate without recomputation, ``s*b*h*(34 + 5*a*s/h)`` bytes for
half precision, scaled to the dtype and divided over the tensor-parallel group, for the
local batch ``b/dp``; the logits (:func:`logits_bytes`) are estimated beside them (not yet
in ``total_bytes``, so the feasibility of existing plans is unchanged). With ``fsdp``
(sharded data parallelism, FSDP2 on the ``dp`` axis) weights, gradients and optimizer state
are further divided over the ``dp`` replicas (activations are not), plus one block's
gathered weights, which FSDP holds whole while that block runs. An estimate, reported as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from atp_pipeline.planning.shape import ModelShape


@dataclass(frozen=True)
class MemoryEstimate:
    params: float  # elements per device
    weights_grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    logits_bytes: float = 0.0  # the LM head's logits and the loss's saved probabilities (reported beside the total)

    @property
    def total_bytes(self) -> float:
        return self.weights_grads_bytes + self.optimizer_bytes + self.activation_bytes

    def to_dict(self) -> Dict[str, float]:
        return {"params": self.params, "weights_grads_bytes": self.weights_grads_bytes,
                "optimizer_bytes": self.optimizer_bytes, "activation_bytes": self.activation_bytes,
                "logits_bytes": self.logits_bytes, "total_bytes": self.total_bytes}


def logits_bytes(m: ModelShape, mesh: Tuple[int, int], dp: int = 1) -> float:
    """Bytes per device of the logits of the local batch, held from the forward to the backward:
    the head's output in the model's dtype and the loss's softmax (or log-softmax) in float32 or
    wider. ``gathered``/``tied``/``whole``: the whole ``[tokens, V]`` on every rank (the model's own loss);
    ``vocab_parallel``: ``[tokens, V/d1]``; ``vocab_split``: ``[tokens/d2, V/d1]``
    (:mod:`atp_pipeline.parallel.vocab`)."""
    d1, d2 = mesh
    q = m.bytes_per_element
    share = {"gathered": 1, "tied": 1, "whole": 1, "vocab_parallel": d1, "vocab_split": d1 * d2}[m.head_layout]
    return m.batch_size / dp * m.seq_len * m.vocab_size / share * (q + max(q, 4))


def per_device_memory(m: ModelShape, mesh: Tuple[int, int], dp: int = 1, fsdp: bool = False) -> MemoryEstimate:
    d1, d2 = mesh
    tp = d1 * d2
    h, L, V, s = m.hidden, m.layers, m.vocab_size, m.seq_len
    norm_split = d2 if m.norm_layout == "stats" else 1  # gathered: the norms' weights stay whole
    vectors = m.column_bias_per_layer / d1 + m.row_bias_per_layer / d2 + m.norm_params_per_layer / norm_split
    per_layer = m.weights_per_layer / tp + vectors  # a block's (FSDP gathers one at a time)
    positions = s if m.position == "learned" else 0
    final_norm = m.norm_params_per_layer / 2 if m.final_norm else 0
    whole = m.head_layout == "whole"  # a head (tied: and its table) run whole on every rank
    head = 0 if m.tied_embeddings else V * h / (1 if whole else tp)
    table = V * h / (tp if m.tied_embeddings and m.head_layout == "vocab_split" else
                     1 if m.tied_embeddings and whole else d2)
    # matrices: the split ones over d1*d2; modules run whole (models/hf/whole.py) and latent
    # projections whole on every rank
    weights = m.split_weights / tp + m.whole_params + m.latent_whole_weights
    params = weights + L * vectors + table + positions * h / d2 + final_norm / norm_split + head
    q = m.bytes_per_element
    gathered = 0.0
    if fsdp and dp > 1:  # every state is split over the replicas; one block is gathered at a time
        gathered = per_layer * q
        params /= dp
    optimizer = params * (8 + (4 if q == 2 else 0))
    b = m.batch_size / dp
    activations = L * s * b * h * (34 + 5 * m.heads * s / h) * (q / 2) / tp
    return MemoryEstimate(params, params * 2 * q + gathered, optimizer, activations, logits_bytes(m, mesh, dp))


def memory_infeasibility(m: ModelShape, mesh: Tuple[int, int], dp: int, fsdp: bool,
                         capacity_GB: Optional[float], where: str = "the devices") -> Optional[str]:
    """Why ``m`` does not fit ``capacity_GB`` per device on ``mesh`` x ``dp`` (None if it
    does, or if the capacity is unknown): the planner's feasibility and the run's check."""
    if not capacity_GB:
        return None
    mem = per_device_memory(m, mesh, dp, fsdp)
    if mem.total_bytes <= capacity_GB * 1e9:
        return None
    return (f"model '{m.name}' needs ~{mem.total_bytes / 1e9:.1f} GB per device on mesh {mesh[0]}x{mesh[1]} "
            f"(dp={dp}{', fsdp' if fsdp and dp > 1 else ''}): weights+grads {mem.weights_grads_bytes / 1e9:.1f}, "
            f"optimizer {mem.optimizer_bytes / 1e9:.1f}, activations {mem.activation_bytes / 1e9:.1f} "
            f"(and logits {mem.logits_bytes / 1e9:.1f}); "
            f"{where} have {capacity_GB:g} GB")
