"""Alpha-beta cost of ring collectives (AutoDDL §3.1, Table 2).

A collective over a group of ``p`` ranks moving ``N`` bytes costs ``α·steps + β·N·factor``
(Table 2; ``N`` is the *input* size of ReduceScatter and the *output* size of the others):

=============  ===========  ================
collective     steps        bandwidth factor
=============  ===========  ================
all-reduce     ``2(p-1)``   ``2(p-1)/p``
all-gather     ``p-1``      ``(p-1)/p``
reduce-scatter ``p-1``      ``(p-1)/p``
all-to-all     ``p-1``      ``(p-1)/p``
=============  ===========  ================

``β·N·factor`` is the time of the bytes one device sends; ``N·factor`` is its
*communication volume* (:func:`volume`), the quantity of the §4.4.2 asymptotics.

**Where the parameters come from.** Ranks sit on a device mesh laid out row-major (the last
mesh dimension varies fastest, as ``init_device_mesh`` does). A group of ``size`` ranks with
rank ``stride`` spans ``stride·(size-1)+1`` consecutive ranks. :class:`AlphaBeta` holds
levels ``(unit, α, β)`` sorted by ``unit`` (devices per unit, innermost first, the last one
covers the world); a group uses the innermost level whose ``unit`` covers its span — the
slowest link it crosses, as in §4.2.3 (intra-node NVLink vs inter-node network). One level
gives one α/β for every mesh dimension (:meth:`AlphaBeta.uniform`);
:meth:`AlphaBeta.from_topology` derives β per level from the topology model's Eq. 3 B′;
:meth:`AlphaBeta.dimension` gives the parameters of one dimension of a concrete mesh.

**Calibrated parameters (§3.2).** :mod:`atp_pipeline.planning.alphabeta_fit` fits α and β per
level by least squares from collectives measured on the user's machine and writes them
into the topology config (``alpha_beta:``); :meth:`AlphaBeta.from_topology` then uses the
fitted values instead of Eq. 3. A level may also carry per-collective ``(α, β)``
(:attr:`LinkLevel.collectives`): the paper fits one pair per network, but a library's
collectives need not all be rings (gloo's reduce-scatter on CPU costs about twice its
all-gather), so the calibration fits each collective kind too and the cost of collective
``c`` uses its own pair where the level has one — the same Table 2 formulas either way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Tuple

from atp_pipeline.errors import ConfigError

if TYPE_CHECKING:
    from atp_pipeline.topology.model import Topology


class Collective(str, enum.Enum):
    all_reduce = "all_reduce"
    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"
    all_to_all = "all_to_all"


def steps(c: Collective, p: int) -> int:
    """Latency terms of Table 2 for ``p`` ranks."""
    if p <= 1:
        return 0
    return 2 * (p - 1) if c is Collective.all_reduce else p - 1


def factor(c: Collective, p: int) -> float:
    """Bandwidth factor of Table 2: bytes sent per device per byte of ``N``."""
    if p <= 1:
        return 0.0
    f = (p - 1) / p
    return 2.0 * f if c is Collective.all_reduce else f


def volume(c: Collective, p: int, nbytes: float) -> float:
    """Bytes one device sends in collective ``c`` over ``p`` ranks (``N·factor``)."""
    return factor(c, p) * nbytes


@dataclass(frozen=True)
class LinkLevel:
    """Groups spanning at most ``unit`` consecutive ranks use latency ``alpha`` (s) and
    inverse bandwidth ``beta`` (s/byte); ``collectives`` optionally overrides them per
    collective kind: ``((name, alpha, beta), ...)`` with names of :class:`Collective`."""

    unit: int
    alpha: float
    beta: float
    collectives: Tuple[Tuple[str, float, float], ...] = ()

    def pair(self, c: Optional["Collective"] = None) -> Tuple[float, float]:
        """(α, β) of collective ``c`` on this level (the level's own pair if ``c`` has none)."""
        if c is not None:
            for name, a, b in self.collectives:
                if name == c.value:
                    return a, b
        return self.alpha, self.beta


@dataclass(frozen=True)
class AlphaBeta:
    """Per-level α/β (innermost first); see the module docstring."""

    levels: Tuple[LinkLevel, ...]

    def __post_init__(self) -> None:
        if not self.levels:
            raise ConfigError("alpha-beta model: 'levels' is empty; give at least one level")
        names = {c.value for c in Collective}
        for lv in self.levels:
            if lv.unit < 1 or any(not x >= 0 for x in (lv.alpha, lv.beta)) or any(
                    n not in names or not (a >= 0 and b >= 0) for n, a, b in lv.collectives):
                raise ConfigError(f"alpha-beta model: bad level {lv} (unit >= 1, alpha >= 0, "
                                  f"beta >= 0, collectives among {sorted(names)} required)")
        units = [lv.unit for lv in self.levels]
        if units != sorted(units) or len(set(units)) != len(units):
            raise ConfigError(f"alpha-beta model: level units {units} must be strictly increasing")

    @classmethod
    def uniform(cls, alpha: float, beta: float) -> "AlphaBeta":
        """Every group alike (one flat network, e.g. the paper's Piz Daint model)."""
        return cls((LinkLevel(unit=1 << 62, alpha=alpha, beta=beta),))

    @classmethod
    def from_topology(cls, topo: "Topology", alpha: float | Sequence[float] = 5e-6) -> "AlphaBeta":
        """β per topology level from the ATP bandwidth model (Eq. 3 B′, GB/s).

        For every unit size ``u`` of ``topo`` (a level's unit, then the world) a group of
        ``u`` consecutive ranks is dimension 2 of the 2D mesh ``(W/u, u)``; its B′ from
        :func:`~atp_pipeline.planning.bandwidth.dimension_bandwidth` gives ``β = 1/B′``
        (all such groups run at once, so B′ already counts link sharing). ``alpha`` is one
        latency for all levels or one per level, innermost first (datasheet values).

        A calibrated topology (``topo.alpha_beta``, written by
        :mod:`atp_pipeline.planning.alphabeta_fit`) gives each level its fitted α and β (and
        per-collective pairs) instead; ``alpha`` is then ignored for those levels.
        """
        from atp_pipeline.planning.bandwidth import dimension_bandwidth

        world = topo.world_size
        units = sorted({u for u in topo.unit_sizes if u > 1})
        if not units:
            raise ConfigError(f"topology '{topo.name}': a single device has no collectives")
        fitted = topo.alpha_beta_by_unit() if getattr(topo, "alpha_beta", None) else {}
        alphas = [float(alpha)] * len(units) if isinstance(alpha, (int, float)) else list(alpha)
        if len(alphas) != len(units):
            raise ConfigError(f"alpha-beta model: {len(alphas)} alphas for {len(units)} levels "
                              f"(units {units})")
        levels = []
        for u, a in zip(units, alphas):
            unit = u if u < world else 1 << 62
            if u in fitted:
                f = fitted[u]
                levels.append(LinkLevel(unit=unit, alpha=f.alpha_s, beta=f.beta_s_per_byte,
                                        collectives=f.collectives))
                continue
            bw = dimension_bandwidth(topo, (world // u, u), 2)
            assert bw.B_prime_GBps is not None
            levels.append(LinkLevel(unit=unit, alpha=a, beta=1.0 / (bw.B_prime_GBps * 1e9)))
        return cls(tuple(levels))

    def level(self, size: int, stride: int) -> LinkLevel:
        """The level a group of ``size`` ranks ``stride`` apart runs on (its span)."""
        span = stride * (size - 1) + 1
        for lv in self.levels:
            if span <= lv.unit:
                return lv
        return self.levels[-1]

    def params(self, size: int, stride: int, c: Optional[Collective] = None
               ) -> Tuple[float, float]:
        """(α, β) of a group of ``size`` ranks ``stride`` apart (for collective ``c``)."""
        return self.level(size, stride).pair(c)

    def dimension(self, mesh: Sequence[int], dim: int) -> Tuple[float, float]:
        """(α, β) of dimension ``dim`` of a row-major ``mesh``."""
        stride = 1
        for d in mesh[dim + 1:]:
            stride *= d
        return self.params(mesh[dim], stride)

    def cost(self, c: Collective, size: int, nbytes: float, stride: int = 1) -> float:
        """Seconds of collective ``c`` over ``size`` ranks ``stride`` apart (Table 2)."""
        if size <= 1:
            return 0.0
        a, b = self.params(size, stride, c)
        return a * steps(c, size) + b * volume(c, size, nbytes)
