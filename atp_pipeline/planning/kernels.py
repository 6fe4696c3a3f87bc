"""The local kernels a step runs, by kind, and the work each does (the step-time model's unit of compute)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

Mesh = Tuple[int, int]


GEMM, ATTN_FWD, ATTN_BWD, NORM_FWD, NORM_BWD, POINTWISE, OPTIMIZER = (
    "gemm", "attention_fwd", "attention_bwd", "norm_fwd", "norm_bwd", "pointwise", "optimizer")
KINDS = (GEMM, ATTN_FWD, ATTN_BWD, NORM_FWD, NORM_BWD, POINTWISE, OPTIMIZER)


@dataclass(frozen=True)
class Kernel:
    """One local kernel: ``gemm`` dims ``(M, K, N)`` (``[M,K] @ [K,N]``); attention
    ``(batch, heads, seq, head_dim)``; norms, pointwise ``(elements,)``; optimizer
    ``(tensors, elements)``."""

    kind: str
    dims: Tuple[int, ...]

    @property
    def work(self) -> float:
        """FLOPs (GEMM: ``2MKN``; attention forward ``4·b·a·s²·d``, backward twice that),
        else elements."""
        if self.kind == GEMM:
            m, k, n = self.dims
            return 2.0 * m * k * n
        if self.kind in (ATTN_FWD, ATTN_BWD):
            b, a, s, d = self.dims
            return (4.0 if self.kind == ATTN_FWD else 8.0) * b * a * s * s * d
        return float(self.dims[-1])
