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

    @property
    def size(self) -> float:
        """What a measured kernel's time goes with, the coordinate a calibrated profile
        interpolates its kind's points and fits its kind in: an attention core's score elements
        ``b·a·s²``, else :attr:`work`. On a CPU the core's time is its loops over the ``s × s``
        scores (softmax, mask, both products' rows), not its FLOPs: three calibrations' cores of the
        same ``b, a, s`` with head size 32 ran 0.51-1.65x (most 0.9-1.3x) those with head size 8
        where their FLOPs differ 4x, and interpolated by FLOPs a ``(16, 4, 120, 8)`` core was priced
        at a quarter of what it took in a step (docs/step-time.md "Runs 50–52", diagnosis e42)."""
        if self.kind in (ATTN_FWD, ATTN_BWD):
            b, a, s, _ = self.dims
            return float(b * a * s * s)
        return self.work
