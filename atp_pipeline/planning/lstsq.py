"""General fitting routines on numpy alone: least squares with lower bounds (:func:`bounded_lstsq`,
:func:`nnls`) and Spearman's rank correlation. Every calibration fits with these (the α-β fit,
:mod:`atp_pipeline.planning.alphabeta_fit`; the compute profile, :mod:`atp_pipeline.run.calibrate_compute`)."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from atp_pipeline.errors import ConfigError


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (ties get their average rank), with numpy only."""
    def ranks(v: Sequence[float]) -> np.ndarray:
        a = np.asarray(v, dtype=np.float64)
        order = np.argsort(a, kind="mergesort")
        r = np.empty(len(a))
        r[order] = np.arange(len(a), dtype=np.float64)
        for val in np.unique(a):
            tie = a == val
            r[tie] = r[tie].mean()
        return r

    if len(x) != len(y) or len(x) < 2:
        raise ConfigError(f"spearman: need two sequences of equal length >= 2, got {len(x)} and {len(y)}")
    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float(rx @ rx) * float(ry @ ry))
    return float(rx @ ry) / den if den > 0 else 0.0


def bounded_lstsq(A: Any, y: Any, lower: Sequence[float]) -> Any:
    """``x >= lower`` (elementwise) minimizing ``|A x - y|``. Few columns: every active set
    (each coefficient free or at its bound) is solved exactly and the best feasible one kept,
    so the result is the constrained optimum, not an approximation."""
    A, y = np.asarray(A, dtype=np.float64), np.asarray(y, dtype=np.float64)
    lo = np.asarray(lower, dtype=np.float64)
    p = A.shape[1]
    if lo.shape != (p,):
        raise ValueError(f"bounded_lstsq: {p} columns but {lo.size} lower bounds")
    best: Optional[Tuple[Any, float]] = None
    for mask in range(2 ** p):
        cols = [j for j in range(p) if mask >> j & 1]  # free; the others sit at their bound
        x = lo.copy()
        if cols:
            sub = A[:, cols]
            if np.linalg.matrix_rank(sub) < len(cols):
                continue
            rest = y - A @ np.where([j in cols for j in range(p)], 0.0, lo)
            coef, *_ = np.linalg.lstsq(sub, rest, rcond=None)
            if (coef < lo[cols]).any():
                continue
            x[cols] = coef
        r = float(np.sum((A @ x - y) ** 2))
        if best is None or r < best[1]:
            best = (x, r)
    assert best is not None  # the all-at-bound set is always feasible
    return best[0]


def nnls(A: Any, y: Any) -> Any:
    """``x >= 0`` minimizing ``|A x - y|`` (:func:`bounded_lstsq` with zero bounds)."""
    return bounded_lstsq(A, y, np.zeros(np.asarray(A).shape[1]))
