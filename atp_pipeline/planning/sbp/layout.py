"""An SBP plan as the executor reads it (AutoDDL §4.2–§4.4), without torch.

A plan from :mod:`atp_pipeline.planning.sbp` gives every matmul layer (a tie group, §4.5.1)
a :class:`~atp_pipeline.planning.sbp.space.Strategy`: group sizes ``pb·pm·pn = p`` of the
roles ``b`` (rows split, weight replicated: data parallel), ``m`` (output columns split)
and ``n`` (input columns split, output a partial sum), laid out row-major over the ranks in
the order ``Strategy.order``. :class:`SBPLayout` is that plan as data (devices, one
strategy per layer key, the predicted cost); the DTensor executor
(:mod:`atp_pipeline.parallel.sbp_exec`) and a model family's SBP module run it.

**One mesh for the whole plan.** DTensor redistributes only within one DeviceMesh, but
consecutive layers may split the ranks differently (layer 1 ``b4·m2``, layer 2 ``b2·n4``).
:func:`plan_mesh_shape` therefore builds the coarsest row-major mesh that refines every
strategy of the plan: the cut points (rank strides where a role's group starts) of all
strategies, sorted, must form a divisibility chain, and the mesh's dimensions are the
ratios of consecutive cut points (e.g. ``(2, 2, 2)`` on 8 ranks for 3-D strategies). A role
of a strategy then owns a contiguous run of mesh dimensions (:func:`role_dims`), and its
placement is written on each of them (``b4`` on ``(2, 2, 2)``: ``[S(0), S(0), ...]``;
DTensor's default left-to-right shard order on one tensor dimension is exactly the
row-major block index). For 4 and 8 ranks (and any power of two) a refinement always
exists; plans whose strategies cut the ranks incompatibly (e.g. ``b2·m3`` and ``b3·m2`` on
6) are refused with a :class:`~atp_pipeline.errors.ConfigError` before anything runs.

**One layer** (:func:`placement_names`, the §4.2.2 matmul): ``X = (S0:pb, B:pm, S1:pn)``,
``W = (B:pb, S1:pm, S0:pn)`` (``nn.Linear``'s out×in weight: ``S(0)`` on ``m``, ``S(1)``
on ``n``), ``Y = (S0:pb, S1:pm, P:pn)`` from a purely local matmul; ``split`` is the output
made split (§4.2, ``(S0:pb, S1:pm·pn)``), ``bias`` is split like ``Y``'s columns and
``rows`` holds whole rows (``S0`` over ``b``, replicated elsewhere) for a LayerNorm. The
names are what ``str()`` of the DTensor placements prints (``S(0)``, ``S(1)``, ``R``,
``P(sum)``).

**A model** (:func:`check_chain_layout`): a strategy for every tie key of its chain
(:func:`~atp_pipeline.planning.sbp.chain.model_chain`) whose splits divide the layer's
features, token rows split over every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.sbp.space import ROLES, MatmulLayer, Strategy

# placement names (``str()`` of DTensor's Shard(0)/Shard(1)/Replicate()/Partial())
SHARD0, SHARD1, REPLICATE, PARTIAL = "S(0)", "S(1)", "R", "P(sum)"

# placements per role (b, m, n) of the tensors of one SBP matmul (§4.2.2)
PLACEMENT_TABLE: Dict[str, Dict[str, str]] = {
    "X": {"b": SHARD0, "m": REPLICATE, "n": SHARD1},
    "W": {"b": REPLICATE, "m": SHARD0, "n": SHARD1},  # nn.Linear weight (out x in)
    "bias": {"b": REPLICATE, "m": SHARD0, "n": SHARD0},
    "Y": {"b": SHARD0, "m": SHARD1, "n": PARTIAL},
    "split": {"b": SHARD0, "m": SHARD1, "n": SHARD1},
    "rows": {"b": SHARD0, "m": REPLICATE, "n": REPLICATE},
}


# ---------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class SBPLayout:
    """What the executor needs from a search result: the device count and one strategy per
    layer key (tie name, e.g. ``qkv``; layer name for untied layers such as ``fc0``)."""

    devices: int
    strategies: Mapping[str, Strategy]
    cost_s: Optional[float] = None  # the planner's predicted communication per step

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ConfigError(f"sbp plan: devices must be >= 1, got {self.devices}")
        for key, s in self.strategies.items():
            if s.pb * s.pm * s.pn != self.devices:
                raise ConfigError(f"sbp plan: layer '{key}' strategy {s.label()} uses "
                                  f"{s.pb * s.pm * s.pn} devices, the plan has {self.devices}")
            if sorted(s.order) != sorted(ROLES):
                raise ConfigError(f"sbp plan: layer '{key}' has mesh roles {s.order}, "
                                  f"expected an order of {ROLES}")

    @classmethod
    def from_search(cls, problem, result) -> "SBPLayout":
        """From a compiled :class:`~atp_pipeline.planning.sbp.space.Problem` and a
        :class:`~atp_pipeline.planning.sbp.search.SearchResult`."""
        return cls(problem.p, {v.name: v.strategies[s] for v, s in zip(problem.vars, result.assignment)},
                   cost_s=result.cost)

    def to_dict(self) -> dict:
        return {"devices": self.devices, "cost_s": self.cost_s,
                "strategies": {k: {"pb": s.pb, "pm": s.pm, "pn": s.pn, "order": list(s.order)}
                               for k, s in self.strategies.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SBPLayout":
        try:
            strat = {k: Strategy(int(v["pb"]), int(v["pm"]), int(v["pn"]),
                                 tuple(v.get("order", ROLES)))  # type: ignore[arg-type]
                     for k, v in d["strategies"].items()}
            return cls(int(d["devices"]), strat, d.get("cost_s"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"sbp plan: malformed plan ({exc!r}); expected devices and "
                              f"strategies {{key: {{pb, pm, pn, order}}}}") from None

    def mesh_shape(self) -> Tuple[int, ...]:
        return plan_mesh_shape(self.strategies.values(), self.devices)

    def label(self) -> str:
        return ", ".join(f"{k}={s.label()}" for k, s in self.strategies.items())


# ---------------------------------------------------------------------- the mesh
def _cuts(s: Strategy) -> List[int]:
    """Rank strides at which the groups of ``s``'s roles start (row-major over its order)."""
    acc, cuts = 1, [1]
    for size in reversed(s.mesh):
        acc *= size
        cuts.append(acc)
    return cuts


def plan_mesh_shape(strategies: Iterable[Strategy], devices: int) -> Tuple[int, ...]:
    """The coarsest row-major mesh refining every strategy (see the module docstring)."""
    strategies = list(strategies)
    cuts = {1, devices}
    for s in strategies:
        if s.pb * s.pm * s.pn != devices:
            raise ConfigError(f"sbp plan: strategy {s.label()} needs {s.pb * s.pm * s.pn} devices, "
                              f"not {devices}")
        cuts.update(_cuts(s))
    chain = sorted(cuts)
    for lo, hi in zip(chain, chain[1:]):
        if hi % lo:
            raise ConfigError(
                f"sbp plan: the strategies {', '.join(s.label() for s in strategies)} split the "
                f"{devices} ranks into groups that no single row-major device mesh refines (rank "
                f"strides {chain}); use a device count that is a power of two or tie the layers")
    if len(chain) == 1:  # one device
        return (1,)
    return tuple(hi // lo for lo, hi in zip(chain, chain[1:]))[::-1]


def role_dims(s: Strategy, shape: Sequence[int]) -> Dict[str, List[int]]:
    """Mesh dimensions of ``shape`` (outermost first) owned by each role of ``s``."""
    # stride of each mesh dim (row-major)
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    strides = strides[::-1]
    out: Dict[str, List[int]] = {r: [] for r in ROLES}
    for r in ROLES:
        lo, hi = s.stride(r), s.stride(r) * s.size(r)
        out[r] = [d for d in range(len(shape)) if shape[d] > 1 and lo <= strides[d]
                  and strides[d] * shape[d] <= hi]
        got = 1
        for d in out[r]:
            got *= shape[d]
        if got != s.size(r):
            raise ConfigError(f"sbp plan: mesh {tuple(shape)} does not refine strategy {s.label()} "
                              f"(role {r} of size {s.size(r)})")
    return out


def placement_names(strategy: Strategy, mesh_shape: Sequence[int]) -> Dict[str, Tuple[str, ...]]:
    """Per tensor of the layer (``X``, ``W``, ``bias``, ``Y``, ``split``, ``rows``: see
    :data:`PLACEMENT_TABLE`), its placement on each dimension of the plan's mesh
    ``mesh_shape``, named as ``str()`` of DTensor placements (``S(0)``, ``R``, ``P(sum)``);
    dimensions no role owns (size 1) are replicated."""
    dims = role_dims(strategy, mesh_shape)
    owner = {d: r for r, ds in dims.items() for d in ds}
    return {t: tuple(PLACEMENT_TABLE[t][owner[d]] if d in owner else REPLICATE for d in range(len(mesh_shape)))
            for t in PLACEMENT_TABLE}


# ---------------------------------------------------------------------- checks
def _check_div(what: str, n: int, k: int, role: str, key: str) -> None:
    if k > 1 and n % k:
        raise ConfigError(f"sbp plan: layer '{key}': {what} {n} does not split over {role}={k}")


def check_chain_layout(layout: SBPLayout, layers: Sequence[MatmulLayer], what: str = "model") -> None:
    """Clear errors (before anything runs) when the matmul chain ``layers`` (e.g.
    :func:`~atp_pipeline.planning.sbp.chain.model_chain`) cannot execute ``layout`` with
    the row layout between layers: a strategy per tie key, input features split over
    ``pn``, output features over ``pm``, token rows over every device, one mesh."""
    keys = list(dict.fromkeys(layer.key for layer in layers))
    missing = [k for k in keys if k not in layout.strategies]
    if missing:
        raise ConfigError(f"sbp plan: {what} needs strategies for {', '.join(keys)}; missing {', '.join(missing)}")
    for layer in layers:
        s = layout.strategies[layer.key]
        _check_div("input features", layer.n, s.pn, "pn", layer.key)
        _check_div("output features", layer.m, s.pm, "pm", layer.key)
        _check_div("token rows", layer.b, layout.devices, "devices", layer.key)
    layout.mesh_shape()
