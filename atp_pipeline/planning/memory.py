"""Per-device memory of the parallel GPT under a mesh, to refuse runs that cannot fit.

Parameters per device follow the built-in plan's placements (linears over d1*d2, biases,
LayerNorms and embeddings over one of the dimensions); weights and gradients in the
model's dtype, AdamW's two moments in fp32 (plus fp32 master weights for fp16/bf16).
Activations use Korthikanti et al. (2022)'s per-layer estimate without recomputation,
``s*b*h*(34 + 5*a*s/h)`` bytes for half precision, scaled to the dtype and divided over
the tensor-parallel group, for the local batch ``b/dp``. An estimate, reported as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from atp_pipeline.planning.flops import ModelSummary


@dataclass(frozen=True)
class MemoryEstimate:
    params: float  # elements per device
    weights_grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_grads_bytes + self.optimizer_bytes + self.activation_bytes


def per_device_memory(m: ModelSummary, mesh: Tuple[int, int], dp: int = 1) -> MemoryEstimate:
    d1, d2 = mesh
    tp = d1 * d2
    h, f, L, V, s = m.hidden, m.ffn_mult, m.layers, m.vocab_size, m.seq_len
    per_layer = (4 + 2 * f) * h * h / tp + 3 * h / d1 + h / d2 + f * h / d1 + h / d2 + 4 * h / d2
    params = L * per_layer + (V + s) * h / d2 + 2 * h / d2 + V * h / tp
    q = m.bytes_per_element
    optimizer = params * (8 + (4 if q == 2 else 0))
    b = m.batch_size / dp
    activations = L * s * b * h * (34 + 5 * m.heads * s / h) * (q / 2) / tp
    return MemoryEstimate(params, params * 2 * q, optimizer, activations)
