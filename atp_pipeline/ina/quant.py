"""Float → int32 gradient conversion for switch aggregation (§5.4, §2.2 "Floating point").

Switches add 32-bit integers only, so workers convert gradients with a scaling factor
``s`` (the released code uses a fixed ×1e6; SwitchML a per-packet shared exponent).

Choice: **headroom fixed point — an aggregate provably cannot overflow.** Each worker's
lane is rounded to nearest and clamped to ``±Q(W)``, ``Q(W) = ⌊(2³¹−1)/W⌋`` for a job of
``W`` workers. Any partial or complete sum of at most ``W`` contributions — whatever subset
a switch, the second-level switch or the parameter server holds — then satisfies
``|Σ q| ≤ W·Q(W) ≤ 2³¹−1``: no int32 register ever wraps, in any order of aggregation.

Clamping is never silent: :func:`quantize` returns the number of saturated lanes, the
worker sets the packet's ``overflow`` flag, switches OR it into the aggregator, the PS
ORs it into the parameter packet, and every worker reports the affected sequences
(:attr:`atp_pipeline.ina.worker.Worker.overflow_seqs`). Choosing ``s`` with
:func:`safe_scale` from a bound ``M ≥ max|x|`` (e.g. the gradient-clipping value) makes
saturation impossible, so the flag is then an assertion, not a fallback path.

Error bound (no saturated lane): per element ``|x − q/s| ≤ 1/(2s)``; for the aggregate of
``W`` workers ``|Σx − (Σq)/s| ≤ W/(2s)``. With :func:`safe_scale` (a power of two ``s``
with ``M·s ≤ Q(W)``, so ``s > Q(W)/(2M)``) this is ``< W·M/Q(W) ≈ W²·M/2³¹`` — for 8 workers
and ``M = 1`` about 3·10⁻⁸ absolute per element. Why not the released code's flag-and-send-
floats fallback: a float packet cannot be aggregated in the switch, so its sequence mixes
int and float partial sums at the PS and the integer exactness of the result is lost; the
headroom scheme keeps every aggregation path exact at the cost of ``log2(W)`` bits.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import numpy as np

INT32_MAX = 2**31 - 1


def lane_limit(n_workers: int) -> int:
    """``Q(W)``: the largest magnitude one worker may put in a lane."""
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers}")
    return INT32_MAX // n_workers


def safe_scale(max_abs: float, n_workers: int) -> float:
    """The largest power of two ``s`` with ``max_abs · s ≤ Q(W)`` (no lane can saturate)."""
    return float(safe_scales(np.asarray([max_abs], dtype=np.float64), n_workers)[0])


def safe_scales(max_abs: np.ndarray, n_workers: int) -> np.ndarray:
    """:func:`safe_scale` of every bound in ``max_abs`` (1 where a bound is not a positive
    finite number), e.g. one scale per packet."""
    b = np.asarray(max_abs, dtype=np.float64)
    ok = (b > 0) & np.isfinite(b)
    lim = lane_limit(n_workers)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(ok, np.exp2(np.floor(np.log2(lim / np.where(ok, b, 1.0)))), 1.0)
    s = np.where(ok & (b * s > lim), s / 2, s)  # guard against log2 rounding
    return s

def quantize(x: np.ndarray, scale: float, n_workers: int) -> Tuple[np.ndarray, int]:
    """``round(x·scale)`` clamped to ``±Q(W)`` as int32, and the number of clamped lanes.

    Non-finite inputs (NaN, ±inf) count as saturated (NaN becomes 0, ±inf ±Q(W)).
    """
    q, sat = quantize_mask(x, scale, n_workers)
    return q, int(np.count_nonzero(sat))


def quantize_mask(x: np.ndarray, scale: Union[float, np.ndarray], n_workers: int, dtype: Any = np.int32,
                  scratch: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """As :func:`quantize`, returning the boolean mask of saturated lanes; ``scale`` is one
    number, or an array broadcast against ``x`` (the live engine's per-packet scales). A
    float32 ``x`` is computed in float32: exact when the scale is a power of two.

    ``dtype``: the integer type returned (int32 in any byte order: the live worker asks for
    the wire's, so converting and byte-swapping are one pass); ``scratch``: a float
    array of ``x``'s shape and type to compute in instead of a new one."""
    lim = lane_limit(n_workers)
    x = np.asarray(x)
    if x.dtype != np.float32:  # float32 stays: exact with a power-of-two scale (the engine's)
        x = x.astype(np.float64, copy=False)
    sc = np.asarray(scale, dtype=x.dtype)
    if scratch is not None and scratch.shape == x.shape and scratch.dtype == x.dtype:
        r = np.multiply(x, sc, out=scratch)  # scalar, per lane, or broadcast (one per packet)
    else:
        r = x * sc
    np.rint(r, out=r)
    if r.size and np.abs(r.min()) <= lim and np.abs(r.max()) <= lim:  # fast path: nothing saturates
        return r.astype(dtype), np.zeros(r.shape, dtype=bool)
    sat = ~(np.abs(r) <= lim)  # also true for NaN and ±inf
    if sat.any():  # slow path: clamp; NaN -> 0, ±inf -> ±Q(W)
        r = np.clip(np.where(np.isnan(r), 0.0, r), -lim, lim)
    return r.astype(dtype), sat


def dequantize(q: np.ndarray, scale: float) -> np.ndarray:
    """Float value of an (aggregated) integer tensor."""
    return np.asarray(q, dtype=np.float64) / float(scale)


def aggregate_error_bound(n_workers: int, scale: float) -> float:
    """``W/(2s)``: bound on ``|Σx − Σq/s|`` per element when no lane saturated."""
    return n_workers / (2.0 * scale)
