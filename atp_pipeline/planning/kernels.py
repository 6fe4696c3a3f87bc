"""The local kernels a step runs, by kind, and the work each does (the step-time model's unit of compute)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

Mesh = Tuple[int, int]


GEMM, ATTN_FWD, ATTN_BWD, NORM_FWD, NORM_BWD, POINTWISE, OPTIMIZER = (
    "gemm", "attention_fwd", "attention_bwd", "norm_fwd", "norm_bwd", "pointwise", "optimizer")
LOSS_FWD, LOSS_BWD = "loss_fwd", "loss_bwd"
KINDS = (GEMM, ATTN_FWD, ATTN_BWD, NORM_FWD, NORM_BWD, POINTWISE, OPTIMIZER, LOSS_FWD, LOSS_BWD)
# What a profile derived from a datasheet (no calibration) prices a loss kind as: ``(kind,
# passes)`` pointwise passes over ``[tokens, vocab]``. A calibration measures the loss kinds
# themselves: a model's own cross-entropy runs ~5 passes forward and ~7 backward (its
# exponentials and a fresh gradient buffer), not the 3 and 2 an estimate from passes gives.
COMPOSED: Dict[str, Tuple[str, int]] = {LOSS_FWD: (POINTWISE, 3), LOSS_BWD: (POINTWISE, 2)}


@dataclass(frozen=True)
class Kernel:
    """One local kernel: ``gemm`` dims ``(M, K, N)`` (``[M,K] @ [K,N]``); attention
    ``(batch, heads, seq, head_dim)``; norms, pointwise ``(elements,)``; optimizer
    ``(tensors, elements)``; a model's own loss over its whole logits ``(tokens, vocab)``."""

    kind: str
    dims: Tuple[int, ...]

    @property
    def work(self) -> float:
        """FLOPs (GEMM: ``2MKN``; attention forward ``4·b·a·s²·d``, backward twice that),
        else elements (a loss: its logits, ``tokens·vocab``)."""
        if self.kind == GEMM:
            m, k, n = self.dims
            return 2.0 * m * k * n
        if self.kind in (ATTN_FWD, ATTN_BWD):
            b, a, s, d = self.dims
            return (4.0 if self.kind == ATTN_FWD else 8.0) * b * a * s * s * d
        if self.kind in (LOSS_FWD, LOSS_BWD):
            return float(self.dims[0] * self.dims[1])
        return float(self.dims[-1])

    @property
    def size(self) -> float:
        """What a measured kernel's time goes with, the coordinate a calibrated profile
        interpolates its kind's points and fits its kind in: an attention core's score elements
        ``b·a·s²``, else :attr:`work`. On a CPU the core's time is its loops over the ``s × s``
        scores (softmax, mask, both products' rows), not its FLOPs: three calibrations' cores of the
        same ``b, a, s`` with head size 32 ran 0.51-1.65x (most 0.9-1.3x) those with head size 8
        where their FLOPs differ 4x, and interpolated by FLOPs a ``(16, 4, 120, 8)`` core was priced
        at a quarter of what it took in a step."""
        if self.kind in (ATTN_FWD, ATTN_BWD):
            b, a, s, _ = self.dims
            return float(b * a * s * s)
        return self.work

    @property
    def grid(self) -> Optional[Tuple[int, int, int]]:
        """Where an attention core sits on the calibration's grid of cores: ``(b·a, s, d)``, the
        independent cores, the sequence and the head size (None for the other kinds, priced by
        :attr:`size` alone). The head size is a coordinate of its own: on a CPU the core's loops
        over the scores cost per score what the head size makes them, not in proportion to it —
        one process, ``b·a`` 16: ``d`` 8 ran 1.4x the time of ``d`` 16 at every sequence 64-256
        and ``d`` 64 2.6x, where :attr:`size`
        prices them alike."""
        if self.kind in (ATTN_FWD, ATTN_BWD):
            b, a, s, d = self.dims
            return (b * a, s, d)
        return None
