"""The hierarchical communication matrix (ATP §3.4) and its validation.

A topology is a list of levels, outermost first. Level ``l`` has ``R_l`` units inside each
unit of level ``l-1``; the world is the product of the counts, and device ``r`` (0-based)
sits in level-``l`` unit ``r // S_l`` where ``S_l`` (:attr:`Topology.unit_sizes`) is the
number of devices per level-``l`` unit. Each level carries a P2P matrix between sibling
units and a group bandwidth (one unit's aggregate bandwidth to its siblings).

Everything a user can get wrong is checked in :meth:`Topology.from_config` and reported as
one :class:`~atp_pipeline.errors.ConfigError` line naming the topology, level and field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from atp_pipeline.config.schema import Routing, TopologyConfig
from atp_pipeline.errors import ConfigError, describe_omegaconf

Mesh = Tuple[int, int]


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _positive(x: Any) -> bool:
    return _is_number(x) and math.isfinite(x) and x > 0


@dataclass(frozen=True)
class Level:
    """One level: ``count`` sibling units, their P2P bandwidths and group bandwidth (GB/s)."""

    name: str
    count: int
    p2p: Union[float, np.ndarray]  # scalar: every pair alike; else count x count, zero diagonal
    group_GBps: float
    routing: Routing = Routing.direct
    aggregates: bool = False  # its switches aggregate gradients in the network (ATP, SwitchML)

    @property
    def uniform(self) -> bool:
        return not isinstance(self.p2p, np.ndarray)

    def p2p_matrix(self) -> np.ndarray:
        if isinstance(self.p2p, np.ndarray):
            return self.p2p
        m = np.full((self.count, self.count), float(self.p2p))
        np.fill_diagonal(m, 0.0)
        return m

    def to_dict(self) -> Dict[str, Any]:
        p2p = self.p2p.tolist() if isinstance(self.p2p, np.ndarray) else self.p2p
        return {"name": self.name, "count": self.count, "p2p_GBps": p2p,
                "group_GBps": self.group_GBps, "routing": self.routing.value,
                **({"aggregates": True} if self.aggregates else {})}


# The collectives of AutoDDL's Table 2 (the names of planning.alphabeta.Collective).
COLLECTIVE_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class LevelAlphaBeta:
    """Fitted alpha-beta parameters of one level (AutoDDL §3.2), in seconds and s/byte;
    ``collectives`` holds per-collective ``(name, alpha_s, beta_s_per_byte)`` pairs."""

    level: str
    alpha_s: float
    beta_s_per_byte: float
    collectives: Tuple[Tuple[str, float, float], ...] = ()

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"level": self.level, "alpha_us": self.alpha_s * 1e6,
                               "GBps": 1e-9 / self.beta_s_per_byte}
        if self.collectives:
            out["collectives"] = {n: {"alpha_us": a * 1e6, "GBps": 1e-9 / b}
                                  for n, a, b in self.collectives}
        return out


@dataclass(frozen=True)
class Topology:
    name: str
    levels: Tuple[Level, ...]
    description: str = ""
    calibrated: Mapping[Mesh, Tuple[Optional[float], Optional[float]]] = field(default_factory=dict)
    device: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""  # e.g. how a sub-topology was derived
    alpha_beta: Tuple[LevelAlphaBeta, ...] = ()  # fitted per level (planning.alphabeta_fit)

    @property
    def world_size(self) -> int:
        return int(np.prod([lv.count for lv in self.levels], dtype=np.int64))

    @property
    def aggregation_modes(self) -> Tuple[str, ...]:
        """The gradient-sync modes the interconnect supports: ``ring`` always; with a level whose
        switches aggregate (``levels[*].aggregates``) also ``atp``, ``ps`` and ``switchml``."""
        return ("ring", "atp", "ps", "switchml") if any(lv.aggregates for lv in self.levels) else ("ring",)

    @property
    def unit_sizes(self) -> Tuple[int, ...]:
        """``S_0..S_L``: devices per unit of each level; ``S_0`` is the world, ``S_L`` = 1."""
        sizes = [1]
        for lv in reversed(self.levels):
            sizes.append(sizes[-1] * lv.count)
        return tuple(reversed(sizes))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg: Union[DictConfig, Mapping[str, Any], TopologyConfig]) -> "Topology":
        """Validate a topology config (typed or plain) and build the topology."""
        data = _typed_container(cfg)
        name = data.get("name") or "<unnamed>"
        where = f"topology '{name}'"
        levels_cfg = data.get("levels") or []
        if not levels_cfg:
            raise ConfigError(f"{where}: 'levels' is empty; list at least one level")
        levels = tuple(_level(where, i, lv) for i, lv in enumerate(levels_cfg))
        topo = cls(name=name, levels=levels, description=data.get("description") or "",
                   device=dict(data.get("device") or {}))
        declared = data.get("world_size")
        if declared is not None and declared != topo.world_size:
            counts = " x ".join(str(lv.count) for lv in levels)
            raise ConfigError(f"{where}: world_size is {declared} but the level counts give "
                              f"{counts} = {topo.world_size}")
        calibrated = _calibrated(where, data.get("calibrated") or [], topo.world_size)
        alpha_beta = _alpha_beta(where, data.get("alpha_beta") or [], levels)
        return cls(name=name, levels=levels, description=topo.description,
                   calibrated=calibrated, device=topo.device, note=data.get("note") or "",
                   alpha_beta=alpha_beta)

    def alpha_beta_by_unit(self) -> Dict[int, LevelAlphaBeta]:
        """Fitted parameters keyed by the span (devices) of groups that cross each level:
        level ``l`` (with ``count > 1``) covers groups of up to ``unit_sizes[l]`` ranks."""
        sizes = self.unit_sizes
        fitted = {f.level: f for f in self.alpha_beta}
        out: Dict[int, LevelAlphaBeta] = {}
        for li, lv in enumerate(self.levels):
            if lv.count > 1 and lv.name in fitted:
                out[sizes[li]] = fitted[lv.name]
        return out

    def restrict(self, devices: int) -> "Topology":
        """The sub-topology occupied by the first ``devices`` devices (e.g. one node).

        It must fill whole units of some level: ``devices = k * S_l`` with ``k <= R_l``.
        Calibrations measured on the full topology do not carry over.
        """
        n = self.world_size
        if devices == n:
            return self
        if not 1 <= devices < n:
            raise ConfigError(f"{devices} devices requested but topology '{self.name}' has {n}")
        sizes = self.unit_sizes
        for li, lv in enumerate(self.levels):
            unit = sizes[li + 1]
            if devices >= unit:
                k, rem = divmod(devices, unit)
                if rem or k > lv.count:
                    raise ConfigError(
                        f"{devices} devices do not fill whole '{lv.name}' units of topology "
                        f"'{self.name}' ({unit} devices each); use a multiple of {unit}")
                head: List[Level] = []
                if k > 1:
                    p2p = lv.p2p if lv.uniform else lv.p2p[:k, :k].copy()  # type: ignore[index]
                    head = [Level(lv.name, k, p2p, lv.group_GBps, lv.routing, lv.aggregates)]
                levels = tuple(head) + self.levels[li + 1:]
                if not levels:  # a single device: keep its level, with one unit
                    levels = (Level(lv.name, 1, lv.group_GBps, lv.group_GBps, lv.routing, lv.aggregates),)
                used = f"{k} of {lv.count} '{lv.name}' units" if k > 1 else f"one '{lv.name}'"
                kept = {x.name for x in levels}
                return Topology(name=self.name, levels=levels, description=self.description,
                                device=self.device,
                                alpha_beta=tuple(f for f in self.alpha_beta if f.level in kept),
                                note="; ".join(x for x in (self.note, f"sub-topology of '{self.name}': the first "
                                                           f"{devices} of {n} devices ({used})") if x))
        raise AssertionError("unreachable: the innermost unit is one device")

    def to_dict(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "world_size": self.world_size,
            "levels": [lv.to_dict() for lv in self.levels],
            "calibrated": [{"mesh": list(m), "B1_GBps": b1, "B2_GBps": b2}
                           for m, (b1, b2) in sorted(self.calibrated.items())],
            "device": dict(self.device),
            **({"note": self.note} if self.note else {}),
            **({"alpha_beta": [f.to_dict() for f in self.alpha_beta]} if self.alpha_beta else {}),
        }


# ---------------------------------------------------------------------------- validation
def _typed_container(cfg: Any) -> Dict[str, Any]:
    """Merge into the schema (so plain dicts get the same key/type checks) and unwrap."""
    try:
        typed = OmegaConf.merge(OmegaConf.structured(TopologyConfig), cfg)
        return OmegaConf.to_container(typed, resolve=True, throw_on_missing=True,
                                      enum_to_str=False)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        name = cfg.get("name", "<unnamed>") if isinstance(cfg, Mapping) else "<unnamed>"
        raise ConfigError(f"topology '{name}': {describe_omegaconf(exc)}") from None


def _level(where: str, index: int, data: Mapping[str, Any]) -> Level:
    name = data["name"]
    at = f"{where}: level '{name}' (levels[{index}])"
    count = data["count"]
    if count < 1:
        raise ConfigError(f"{at}: count must be >= 1, got {count}")
    group = data["group_GBps"]
    if not _positive(group):
        raise ConfigError(f"{at}: group_GBps must be a positive finite number, got {group!r}")
    routing = Routing(data["routing"])
    raw = data["p2p_GBps"]
    p2p: Union[float, np.ndarray]
    if isinstance(raw, (list, tuple)):
        rows = list(raw)
        if len(rows) != count or any(not isinstance(r, (list, tuple)) or len(r) != count
                                     for r in rows):
            shape = f"{len(rows)}x{len(rows[0]) if rows and isinstance(rows[0], (list, tuple)) else '?'}"
            raise ConfigError(f"{at}: p2p_GBps is a {shape} matrix but count is {count} "
                              f"(need {count}x{count})")
        for i, row in enumerate(rows):
            for j, x in enumerate(row):
                if not _is_number(x) or not math.isfinite(x) or x < 0:
                    raise ConfigError(f"{at}: p2p_GBps[{i}][{j}] must be a finite number >= 0, "
                                      f"got {x!r}")
                if i == j and x != 0:
                    raise ConfigError(f"{at}: p2p_GBps[{i}][{i}] must be 0 (a unit's bandwidth "
                                      f"to itself is not a link), got {x!r}")
                if i != j and x == 0 and routing == Routing.direct:
                    raise ConfigError(f"{at}: p2p_GBps[{i}][{j}] is 0 on a 'direct' level; "
                                      f"give a positive bandwidth or set routing: routed")
        p2p = np.asarray(rows, dtype=np.float64)
        if routing == Routing.routed and not _connected(p2p):
            raise ConfigError(f"{at}: the P2P links do not connect all {count} units")
    elif _positive(raw):
        p2p = float(raw)
    else:
        raise ConfigError(f"{at}: p2p_GBps must be a positive finite number or a {count}x{count} "
                          f"matrix, got {raw!r}")
    if count > 1:
        links = p2p.sum(axis=1) if isinstance(p2p, np.ndarray) else np.full(count, p2p * (count - 1))
        worst = int(np.argmin(links))
        if group > links[worst] * (1 + 1e-9):
            raise ConfigError(f"{at}: group_GBps {group:g} exceeds the {links[worst]:g} GB/s of unit "
                              f"{worst}'s P2P links to its siblings")
    return Level(name=name, count=count, p2p=p2p, group_GBps=float(group), routing=routing,
                 aggregates=bool(data.get("aggregates", False)))


def _connected(m: np.ndarray) -> bool:
    n = len(m)
    seen = {0}
    frontier = [0]
    while frontier:
        i = frontier.pop()
        for j in np.nonzero((m[i] > 0) | (m[:, i] > 0))[0]:
            if int(j) not in seen:
                seen.add(int(j))
                frontier.append(int(j))
    return len(seen) == n


def _calibrated(where: str, entries: Sequence[Mapping[str, Any]], world: int
                ) -> Dict[Mesh, Tuple[Optional[float], Optional[float]]]:
    out: Dict[Mesh, Tuple[Optional[float], Optional[float]]] = {}
    for i, e in enumerate(entries):
        at = f"{where}: calibrated[{i}]"
        mesh = list(e["mesh"])
        if len(mesh) != 2 or any(not isinstance(d, int) or d < 1 for d in mesh):
            raise ConfigError(f"{at}: mesh must be [d1, d2] of positive integers, got {mesh}")
        d1, d2 = mesh
        if d1 * d2 != world:
            raise ConfigError(f"{at}: mesh {d1}x{d2} has {d1 * d2} devices but the topology has {world}")
        values = []
        for dim, size in (("B1_GBps", d1), ("B2_GBps", d2)):
            b = e.get(dim)
            if size == 1 and b is not None:
                raise ConfigError(f"{at}: {dim} given for a mesh dimension of size 1, "
                                  f"which has no collective")
            if size > 1 and not _positive(b):
                raise ConfigError(f"{at}: {dim} must be a positive finite number for mesh "
                                  f"{d1}x{d2}, got {b!r}")
            values.append(None if b is None else float(b))
        if (d1, d2) in out:
            raise ConfigError(f"{at}: mesh {d1}x{d2} is calibrated twice")
        out[(d1, d2)] = (values[0], values[1])
    return out


def _alpha_beta(where: str, entries: Sequence[Mapping[str, Any]], levels: Sequence[Level]
                ) -> Tuple[LevelAlphaBeta, ...]:
    """Check the fitted per-level parameters (``alpha_beta:``) against the levels."""
    names = [lv.name for lv in levels]
    out: List[LevelAlphaBeta] = []
    for i, e in enumerate(entries):
        at = f"{where}: alpha_beta[{i}]"
        level = e["level"]
        if level not in names:
            raise ConfigError(f"{at}: level '{level}' is not a level of the topology "
                              f"(levels: {', '.join(names)})")
        if any(f.level == level for f in out):
            raise ConfigError(f"{at}: level '{level}' is given twice")

        def pair(ctx: str, d: Mapping[str, Any]) -> Tuple[float, float]:
            a, g = d["alpha_us"], d["GBps"]
            if not (_is_number(a) and math.isfinite(a) and a >= 0):
                raise ConfigError(f"{ctx}: alpha_us must be a finite number >= 0, got {a!r}")
            if not _positive(g):
                raise ConfigError(f"{ctx}: GBps must be a positive finite number, got {g!r}")
            return float(a) * 1e-6, 1e-9 / float(g)

        alpha, beta = pair(at, e)
        colls = []
        for cname, ce in (e.get("collectives") or {}).items():
            if cname not in COLLECTIVE_NAMES:
                raise ConfigError(f"{at}: unknown collective '{cname}' (one of "
                                  f"{', '.join(COLLECTIVE_NAMES)})")
            colls.append((cname, *pair(f"{at}.collectives.{cname}", ce)))
        out.append(LevelAlphaBeta(level, alpha, beta, tuple(colls)))
    return tuple(out)
