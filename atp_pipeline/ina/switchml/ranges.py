"""Runs of consecutive indices: where a batch's slots, slot-versions or chunks step by one, the
switch and the workers handle them as one slice of their arrays (one numpy call a run instead
of a gather or a Python loop)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np


def runs(*stepping: Sequence[int], same: Sequence[int] = ()) -> List[Tuple[int, int]]:
    """``[a, b)`` ranges over which every sequence of ``stepping`` steps by 1 and ``same`` stays
    constant: slices of the arrays they index (one numpy call a run instead of a gather)."""
    n = len(stepping[0])
    if n == 1:
        return [(0, 1)]
    brk = np.zeros(n - 1, dtype=bool)
    for seq in stepping:
        brk |= np.diff(np.asarray(seq)) != 1
    if len(same):
        brk |= np.diff(np.asarray(same)) != 0
    cut = (np.flatnonzero(brk) + 1).tolist()
    return list(zip([0, *cut], [*cut, n]))


def run_of(a: np.ndarray) -> Optional[Tuple[int, int]]:
    """``(a[0], a[-1] + 1)`` when ``a`` (int array, non-empty) is ``a[0], a[0] + 1, …``; else None."""
    if not len(a):
        return None
    lo, hi = int(a[0]), int(a[-1]) + 1
    if hi - lo != len(a) or (len(a) > 2 and not (np.diff(a) == 1).all()):
        return None
    return lo, hi
