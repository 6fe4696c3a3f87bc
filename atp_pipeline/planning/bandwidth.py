"""All-reduce bandwidth of each mesh dimension from the hierarchical matrix (ATP Eq. 3, 4).

Ranks are laid out on ``DeviceMesh(d1, d2)`` row-major, as ``torch.distributed``'s
``init_device_mesh`` does: rank ``r = i1*d2 + i2``. A dimension-2 group is a block of
``d2`` consecutive ranks; a dimension-1 group is the ``d1`` ranks ``c, c+d2, c+2*d2, ...``.
Ranks map onto the topology outermost level first (:class:`~atp_pipeline.topology.model.Topology`).

**Which levels a dimension crosses.** A group *crosses* level ``l`` where two of its members
sit in different level-``l`` units of one level-``(l-1)`` unit: their ring traffic then
runs over level-``l`` links. :class:`LevelCrossing` records every crossed level.

**Eq. 3, bandwidth per level.** At a crossed level, one group gets from each unit ``u`` it
spans::

    bw(u) = min(GroupBW_l, P2P-cap(u)) / sharing(u)

* ``sharing(u)`` is the number of concurrent groups of this dimension that cross level
  ``l`` through unit ``u`` and so divide its group bandwidth. The paper divides dimension
  1 by ``d2`` at every level (Eq. 3: ``min(GroupBW_{1..i} / d2)``); that is the count of
  groups a unit holds when it has at least ``d2`` devices — its worked example (Figure 7a,
  mesh 8x2: ``25/2 = 12.5`` GB/s). A single device belongs to exactly one group per
  dimension, so at the device level nothing is shared; this is what §5.4 assumes for IC5
  and IC6 (``B1' = B2' = GroupBW``) and what the literal ``/d2`` would contradict. Where
  the prose (§5.4) and Eq. 3 disagree we count the groups that really share the unit;
  both agree on every example the paper works through.
* ``P2P-cap(u)`` is the §3.5 P2P correction: on a ``direct`` level a unit reaches the
  other members of its group only over their P2P links, so it can use at most the sum of
  those P2P bandwidths (Figure 7a, mesh 8x2: two GPUs of a node get 200 GB/s, not their
  600 GB/s group bandwidth). On a ``routed`` level (a torus) traffic may cross other units
  and the group bandwidth applies.

``B'`` of a dimension is the minimum over its crossed levels, units and groups (all
groups run at once and the step waits for the slowest). **Eq. 4** turns it into the
all-reduce algorithm bandwidth of Rabenseifner's algorithm: ``B = d / (2(d-1)) * B'``.
A dimension of size 1 has no collective: ``B' = B = None``.

The computation enumerates ranks exactly, but only over one period of the layout
(``lcm(parent size, d2)`` ranks, at most the world): the group/unit pattern inside a parent
repeats with that period, so the result is exact for any sizes, aligned or not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from atp_pipeline.config.schema import Routing
from atp_pipeline.topology.model import Level, Topology


@dataclass(frozen=True)
class LevelCrossing:
    """How the groups of one mesh dimension use one topology level."""

    level: str
    index: int  # position in topology.levels (0 = outermost)
    units_per_group: int  # most units of this level one group spans inside one parent unit
    groups_sharing: int  # most groups dividing one unit's group bandwidth
    GBps: float  # bandwidth one group gets at this level (min over units and groups)
    limited_by: str  # "group" (GroupBW / sharing) or "p2p" (the P2P correction)

    def to_dict(self) -> dict:
        return {"level": self.level, "index": self.index, "units_per_group": self.units_per_group,
                "groups_sharing": self.groups_sharing, "GBps": self.GBps,
                "limited_by": self.limited_by}


@dataclass(frozen=True)
class DimBandwidth:
    """Bandwidth of one mesh dimension; ``None`` where the dimension has size 1."""

    size: int
    crossings: Tuple[LevelCrossing, ...]
    B_prime_GBps: Optional[float]  # Eq. 3
    B_GBps: Optional[float]  # Eq. 4 (or the calibrated value)
    source: str = "model"  # "model" | "calibrated" | "none" (size 1)
    model_B_GBps: Optional[float] = None  # Eq. 4 estimate, also kept when calibrated

    def to_dict(self) -> dict:
        return {"size": self.size, "B_prime_GBps": self.B_prime_GBps, "B_GBps": self.B_GBps,
                "source": self.source, "model_B_GBps": self.model_B_GBps,
                "levels": [c.to_dict() for c in self.crossings]}


def rabenseifner(d: int, b_prime: float) -> float:
    """Eq. 4: all-reduce algorithm bandwidth of ``d`` ranks over links of ``b_prime``."""
    if d < 2:
        raise ValueError("a dimension of size 1 has no all-reduce")
    return d / (2.0 * (d - 1)) * b_prime


def _group_major_ranks(window: int, d2: int, dim: int) -> np.ndarray:
    """The window's ranks ordered group by group (ascending inside a group), so that every
    key built from (group, unit, parent) below is already sorted: run-length encoding
    replaces sorting, keeping the search linear in the world size."""
    if dim == 2:
        return np.arange(window, dtype=np.int64)
    return (np.arange(d2, dtype=np.int64)[:, None]
            + d2 * np.arange(window // d2, dtype=np.int64)[None, :]).ravel()


def _runs(sorted_keys: np.ndarray) -> np.ndarray:
    """Start flags of the runs of equal values in a sorted array."""
    starts = np.empty(len(sorted_keys), dtype=bool)
    starts[0] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=starts[1:])
    return starts


def _crossing(topo: Topology, level_index: int, d2: int, dim: int) -> Optional[LevelCrossing]:
    level: Level = topo.levels[level_index]
    if level.count < 2:
        return None
    sizes = topo.unit_sizes
    unit_size, parent_size = sizes[level_index + 1], sizes[level_index]
    window = min(topo.world_size, parent_size * d2 // math.gcd(parent_size, d2))
    ranks = _group_major_ranks(window, d2, dim)
    group = ranks // d2 if dim == 2 else ranks % d2
    unit = ranks // unit_size
    # distinct (group, unit) pairs, in (group, unit) order
    first = _runs(group * (window // unit_size) + unit)
    g, u = group[first], unit[first]
    parent = u // level.count
    # distinct units per (group, parent)
    gp_start = _runs(g * (window // parent_size) + parent)
    gp_index = np.cumsum(gp_start) - 1
    gp_units = np.diff(np.append(np.flatnonzero(gp_start), len(g)))
    crossing = gp_units[gp_index] >= 2
    if not crossing.any():
        return None
    g, u, gp_index = g[crossing], u[crossing], gp_index[crossing]
    members = gp_units[gp_index]
    sharing = np.bincount(u, minlength=window // unit_size)[u]
    local = u % level.count
    if level.routing == Routing.routed:
        cap = np.full(len(u), np.inf)
    elif level.uniform:
        cap = (members - 1) * float(level.p2p)  # type: ignore[arg-type]
    else:
        matrix = level.p2p_matrix()
        rows, row_of = np.unique(gp_index, return_inverse=True)
        member_mask = np.zeros((len(rows), level.count))
        member_mask[row_of, local] = 1.0
        cap = (member_mask @ matrix.T)[row_of, local]
    usable = np.minimum(level.group_GBps, cap)
    bw = usable / sharing
    worst = int(np.argmin(bw))
    return LevelCrossing(
        level=level.name, index=level_index, units_per_group=int(members.max()),
        groups_sharing=int(sharing.max()), GBps=float(bw[worst]),
        limited_by="p2p" if cap[worst] < level.group_GBps else "group")


def dimension_bandwidth(topo: Topology, mesh: Tuple[int, int], dim: int) -> DimBandwidth:
    """Eq. 3 and Eq. 4 for dimension ``dim`` (1 or 2) of ``mesh`` on ``topo``."""
    d1, d2 = mesh
    if d1 * d2 != topo.world_size:
        raise ValueError(f"mesh {d1}x{d2} does not match world size {topo.world_size}")
    size = d1 if dim == 1 else d2
    calibrated = topo.calibrated.get((d1, d2))
    if size == 1:
        return DimBandwidth(size=1, crossings=(), B_prime_GBps=None, B_GBps=None, source="none")
    crossings: List[LevelCrossing] = []
    for li in range(len(topo.levels)):
        c = _crossing(topo, li, d2, dim)
        if c is not None:
            crossings.append(c)
    b_prime = min(c.GBps for c in crossings)
    b_model = rabenseifner(size, b_prime)
    if calibrated is not None:
        b_cal = calibrated[dim - 1]
        assert b_cal is not None  # validated: every dimension of size > 1 is calibrated
        return DimBandwidth(size=size, crossings=tuple(crossings),
                            B_prime_GBps=b_cal * 2.0 * (size - 1) / size, B_GBps=b_cal,
                            source="calibrated", model_B_GBps=b_model)
    return DimBandwidth(size=size, crossings=tuple(crossings), B_prime_GBps=b_prime,
                        B_GBps=b_model, source="model", model_B_GBps=b_model)
