"""The SBP search space of AutoDDL (§4.2.2–§4.5) and its communication/memory tables.

**One layer.** A matmul ``Y = X·W`` (``X``: b×n, ``W``: n×m, ``Y``: b×m) on ``p`` devices.
Per mesh dimension a matmul has three legal SBP signatures whose output is not replicated:

* role ``b`` — ``X:S(0), W:B, Y:S(0)`` (data parallel; ``W`` replicated),
* role ``m`` — ``X:B, W:S(1), Y:S(1)`` (Megatron column),
* role ``n`` — ``X:S(1), W:S(0), Y:P`` (Megatron row; partial sums).

A strategy (:class:`Strategy`) gives the three roles group sizes ``pb·pm·pn = p`` and an
order on a 3-D mesh: with order ``(b, m, n)`` it is exactly the paper's §4.2.2 matmul,
``X = (S0:p0, B:p1, S1:p2)``, ``W = (B:p0, S1:p1, S0:p2)``, ``Y = (S0:p0, S1:p1, P:p2)``.
Data parallelism (``pm = pn = 1``), Megatron column/row (``pb = pn = 1`` / ``pb = pm = 1``),
the 2-D strategies (one size 1) and the 3-D ones are special cases. ``orders="paper"``
keeps the paper's mesh order; ``orders="all"`` also tries the other five (only matters
when α/β differ between topology levels). :meth:`Strategy.placements` writes the
layouts as DTensor placements (``Shard(d)``/``Replicate()``/``Partial()``) per mesh dim.

**Communication (§4.3, §4.4.1)** — every term has a forward and a dual backward
collective of the same cost, so each is counted twice:

* every layer's output is made split (§4.2: outputs are S): reduce-scatter over the
  ``n`` group, ``(S0:pb, S1:pm, P:pn) -> (S0:pb, S1:pm·pn)`` (backward: all-gather);
* a layer with a predecessor gathers its input: all-gather over its ``m`` group,
  ``(S0:pb, S1:pm·pn) -> (S0:pb, B:pm, S1:pn)`` (backward: reduce-scatter);
* between them an all-to-all when the split layouts differ: unless ``pb = pb'`` (same
  rows, same ranks), or ``pm = pn'`` where the §4.3 row path applies (not through
  attention). Its group has ``max/min(pb, pb')`` ranks when one divides the other, all
  ``p`` otherwise (a conservative bound; the column-shard relabelling of the paper's
  path is taken as free, as in §4.3);
* the weight gradient of ``W`` replicated over ``pb`` is all-reduced (§4.4.1), once per
  step (not doubled).

**Row layout between layers** (``io="rows"``, what
:mod:`atp_pipeline.parallel.sbp_exec` executes for any model): every matmul reads its input
from and writes its output to the *row layout* — whole sequences split over ``g`` row
groups of ``r = p/g`` consecutive ranks (:func:`row_split`: ``g`` the largest divisor of
``p`` dividing the sequences; the ``r`` ranks of a group hold the same sequences), every
feature whole — so the family's own code between the matmuls (norms, rotary, the attention
core, residuals) runs unchanged on local tensors. A matmul takes its rank's ``1/r`` of the
group's token rows (free), so its rows ``b`` are split over all ``p`` ranks, and pays,
forward and backward dual alike (:func:`row_io_terms`, the one implementation of this cost,
also read by :mod:`~atp_pipeline.planning.sbp.schedule` and performed call for call by the
executor): an all-to-all over its ``n`` group (rows -> input-column blocks), an all-gather
over its ``m`` group (the rows of its ``b`` group), the local matmul, a reduce-scatter over
``n`` (the partial sums, §4.2's output made split), an all-to-all over ``m``
(output-column blocks -> whole rows) and, when ``r > 1``, an all-gather of the rows over
the row group; plus §4.4.1's weight all-reduce over ``b``. Where a layer's output reaches
the next layer through elementwise code only (an MLP's activation: ``MatmulLayer.into``)
and the two strategies line up (:func:`direct`: e.g. Megatron's column-then-row), the
output skips the row layout: the producer's partial ``Y`` is all-reduced over its ``n``
group and is the consumer's ``X`` as it stands — a pair table per such edge.

**Memory** per device: ``n·m/(pm·pn)`` parameters × ``param_bytes`` (weights, gradients,
optimizer state) plus the stored activations ``X`` and ``Y`` local blocks; the total over
layers must stay under ``memory_limit`` (§4.5.2).

**Repeated layers (§4.5.1).** Layers with the same ``tie`` share one strategy; a model
compiles into one decision variable per tie with aggregated tables (:class:`Problem`),
so a 96-block transformer has four variables, not 384.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.alphabeta import AlphaBeta, Collective, factor, steps

ROLES = ("b", "m", "n")
COLLECTIVES = tuple(c.value for c in Collective)


@dataclass(frozen=True)
class MatmulLayer:
    """``Y = X·W`` with ``X`` b×n, ``W`` n×m. ``heads``: the output columns hold this many
    attention heads that must split evenly over the devices holding them (QKV);
    ``batch_units``: rows come in this many indivisible units (sequences), default ``b``;
    ``into_attention``: the output feeds attention (no §4.3 row path to the next layer);
    ``into`` (``io="rows"``): the key of the next layer that reads this output through
    elementwise code only (an MLP's activation), so it may skip the row layout
    (:func:`direct`)."""

    name: str
    b: int
    n: int
    m: int
    tie: Optional[str] = None
    heads: Optional[int] = None
    batch_units: Optional[int] = None
    into_attention: bool = False
    into: Optional[str] = None  # io="rows": key of the layer its output may feed directly (elementwise code between)

    @property
    def key(self) -> str:
        return self.tie or self.name


@dataclass(frozen=True)
class MemoryModel:
    """Bytes per parameter of weights+gradients+optimizer state, bytes per activation
    element (also the communicated element size), and the per-device limit (None: none)."""

    param_bytes: float = 16.0
    act_bytes: float = 4.0
    limit: Optional[float] = None


@dataclass(frozen=True)
class Strategy:
    """Group sizes of the roles and their order on the mesh (see the module docstring)."""

    pb: int
    pm: int
    pn: int
    order: Tuple[str, str, str] = ROLES

    @property
    def mesh(self) -> Tuple[int, int, int]:
        return tuple(self.size(r) for r in self.order)  # type: ignore[return-value]

    def size(self, role: str) -> int:
        return {"b": self.pb, "m": self.pm, "n": self.pn}[role]

    def stride(self, role: str) -> int:
        i = self.order.index(role)
        return int(np.prod([self.size(r) for r in self.order[i + 1:]], dtype=np.int64))

    def placements(self) -> Dict[str, List[str]]:
        """DTensor placements per mesh dim (order :attr:`mesh`) of X, W (n×m, math
        orientation), ``linear_weight`` (``nn.Linear.weight``, m×n) and Y."""
        table = {"b": ("Shard(0)", "Replicate()", "Replicate()", "Shard(0)"),
                 "m": ("Replicate()", "Shard(1)", "Shard(0)", "Shard(1)"),
                 "n": ("Shard(1)", "Shard(0)", "Shard(1)", "Partial()")}
        cols = [table[r] for r in self.order]
        return {name: [c[i] for c in cols]
                for i, name in enumerate(("X", "W", "linear_weight", "Y"))}

    def label(self) -> str:
        return "x".join(f"{r}{self.size(r)}" for r in self.order)

    def to_dict(self) -> dict:
        return {"pb": self.pb, "pm": self.pm, "pn": self.pn, "mesh": list(self.mesh),
                "mesh_roles": list(self.order), "label": self.label(),
                "placements": self.placements()}


def factorizations(p: int) -> List[Tuple[int, int, int]]:
    """All ordered ``(pb, pm, pn)`` with ``pb·pm·pn = p``."""
    divs = [d for d in range(1, p + 1) if p % d == 0]
    return [(a, c, p // (a * c)) for a in divs for c in divs if (p // a) % c == 0]


def strategies(layer: MatmulLayer, p: int, orders: str = "paper",
               max_split_dims: int = 3, token_rows: bool = False) -> List[Strategy]:
    """Legal strategies of ``layer`` on ``p`` devices (divisibility, heads, batch units;
    ``token_rows``: rows split by tokens, not by the layer's sequences)."""
    if orders not in ("paper", "all"):
        raise ConfigError(f"sbp: orders must be 'paper' or 'all', got '{orders}'")
    units = layer.b if token_rows else (layer.batch_units or layer.b)
    out: List[Strategy] = []
    seen = set()
    for pb, pm, pn in factorizations(p):
        if units % pb or layer.m % pm or layer.n % pn:
            continue
        if layer.heads is not None and layer.heads % (pm * pn):
            continue
        if sum(1 for s in (pb, pm, pn) if s > 1) > max_split_dims:
            continue
        perms = [ROLES] if orders == "paper" else list(itertools.permutations(ROLES))
        for order in perms:
            s = Strategy(pb, pm, pn, order)  # type: ignore[arg-type]
            key = tuple((r, s.size(r)) for r in order if s.size(r) > 1)
            if key in seen:
                continue
            seen.add(key)
            out.append(s)
    return out


@dataclass
class Var:
    """One decision variable: a tie group of identical layers."""

    name: str
    layer: MatmulLayer
    count: int
    strategies: List[Strategy]
    cost: Dict[str, np.ndarray] = field(default_factory=dict)  # per collective, seconds
    volume: Dict[str, np.ndarray] = field(default_factory=dict)  # per collective, bytes/device
    memory: np.ndarray = field(default_factory=lambda: np.zeros(0))


@dataclass
class Pair:
    """Communication between layers of variables ``a`` then ``b``, ``count`` times: the
    all-to-all between consecutive layers (``io="chain"``), or a direct edge's collectives
    (``io="rows"``, per collective in ``by``)."""

    a: int
    b: int
    count: int
    cost: np.ndarray  # |S_a| x |S_b| seconds (forward + backward)
    volume: np.ndarray  # bytes per device
    by: Dict[str, Tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # collective -> (cost, volume)


@dataclass
class Problem:
    """A compiled model: additive unary tables per variable plus pairwise all-to-all."""

    p: int
    vars: List[Var]
    pairs: List[Pair]
    memory_limit: Optional[float]

    def __post_init__(self) -> None:
        self.unary = [sum(v.cost.values()) for v in self.vars]
        self.sizes = [len(v.strategies) for v in self.vars]
        self.touching = [[pr for pr in self.pairs if v in (pr.a, pr.b)]
                         for v in range(len(self.vars))]

    def feasible(self, assign: Sequence[int]) -> bool:
        if self.memory_limit is None:
            return True
        return sum(float(v.memory[s]) for v, s in zip(self.vars, assign)) <= self.memory_limit

    def cost(self, assign: Sequence[int]) -> float:
        """Predicted communication seconds per step (inf when over the memory limit)."""
        if not self.feasible(assign):
            return math.inf
        return self.raw_cost(assign)

    def raw_cost(self, assign: Sequence[int]) -> float:
        """Predicted communication seconds per step, memory limit ignored."""
        c = sum(float(u[s]) for u, s in zip(self.unary, assign))
        return c + sum(float(pr.cost[assign[pr.a], assign[pr.b]]) for pr in self.pairs)

    def breakdown(self, assign: Sequence[int]) -> Dict[str, Dict[str, float]]:
        """Seconds and bytes per device for each collective kind."""
        out = {c: {"seconds": 0.0, "bytes_per_device": 0.0} for c in COLLECTIVES}
        for v, s in zip(self.vars, assign):
            for c in COLLECTIVES:
                out[c]["seconds"] += float(v.cost[c][s])
                out[c]["bytes_per_device"] += float(v.volume[c][s])
        for pr in self.pairs:
            for c, (cost, vol) in (pr.by or {"all_to_all": (pr.cost, pr.volume)}).items():
                out[c]["seconds"] += float(cost[assign[pr.a], assign[pr.b]])
                out[c]["bytes_per_device"] += float(vol[assign[pr.a], assign[pr.b]])
        return out

    def volume(self, assign: Sequence[int]) -> float:
        return sum(d["bytes_per_device"] for d in self.breakdown(assign).values())

    def memory(self, assign: Sequence[int]) -> float:
        return sum(float(v.memory[s]) for v, s in zip(self.vars, assign))


def _coll(ab: AlphaBeta, c: Collective, size: int, stride: int, nbytes: float,
          times: float, leading_order: bool = False) -> Tuple[float, float]:
    if size <= 1:
        return 0.0, 0.0
    a, b = ab.params(size, stride, c)
    f = (2.0 if c is Collective.all_reduce else 1.0) if leading_order else factor(c, size)
    return times * (a * steps(c, size) + b * f * nbytes), times * f * nbytes


IO_MODES = ("chain", "rows")


def row_split(sequences: int, p: int) -> int:
    """Row groups ``g`` of the row layout: the largest divisor of ``p`` that divides the
    step's ``sequences`` (each group of ``p/g`` consecutive ranks holds ``sequences/g``)."""
    return max(d for d in range(1, p + 1) if p % d == 0 and sequences % d == 0)


Term = Tuple[Collective, int, int, float, int, str]


def row_in_terms(layer: MatmulLayer, s: Strategy, p: int, e: float) -> List[Term]:
    """The input side of one instance of ``layer`` under ``s`` (module docstring): the
    row layout's token rows to ``X`` — ``(collective, group size, rank stride, Table 2 N in
    bytes, times per step, what)``; forward and backward dual have the same Table 2 cost
    (``times`` 2); groups of size 1 are left out."""
    L = layer
    terms = [
        (Collective.all_to_all, s.pn, s.stride("n"), L.b / p * L.n * e, 2,
         "input rows -> column blocks over n (backward: the inverse all-to-all)"),
        (Collective.all_gather, s.pm, s.stride("m"), L.b / s.pb * L.n / s.pn * e, 2,
         "input rows of the b group over m (backward: reduce-scatter)"),
    ]
    return [t for t in terms if t[1] > 1]


def row_out_terms(layer: MatmulLayer, s: Strategy, p: int, e: float) -> List[Term]:
    """The output side: the partial ``Y`` back to the row layout's whole rows."""
    L = layer
    r = p // row_split(L.batch_units or L.b, p)
    terms = [
        (Collective.reduce_scatter, s.pn, s.stride("n"), L.b / s.pb * L.m / s.pm * e, 2,
         "partial output summed and scattered by rows over n (backward: all-gather)"),
        (Collective.all_to_all, s.pm, s.stride("m"), L.b / p * L.m * e, 2,
         "output column blocks -> whole rows over m (backward: the inverse all-to-all)"),
        (Collective.all_gather, r, 1, L.b / p * r * L.m * e, 2,
         "output rows gathered over the row group's replicas (backward: reduce-scatter)"),
    ]
    return [t for t in terms if t[1] > 1]


def weight_terms(layer: MatmulLayer, s: Strategy, e: float) -> List[Term]:
    """§4.4.1: the weight-gradient all-reduce over ``b``, once per step."""
    L = layer
    t = (Collective.all_reduce, s.pb, s.stride("b"), L.n * L.m / (s.pm * s.pn) * e, 1,
         "weight-gradient all-reduce over b (§4.4.1)")
    return [t] if s.pb > 1 else []


def row_io_terms(layer: MatmulLayer, s: Strategy, p: int, e: float) -> List[Term]:
    """Every collective of one instance of ``layer`` under ``s`` with its input and output
    in the row layout: :func:`row_in_terms`, :func:`row_out_terms`, :func:`weight_terms`.
    The rows ``b`` are the layer's tokens; the matmul takes ``b/p`` of them on each device."""
    return row_in_terms(layer, s, p, e) + row_out_terms(layer, s, p, e) + weight_terms(layer, s, e)


def _same_group(s: Strategy, role_s: str, t: Strategy, role_t: str) -> bool:
    size = s.size(role_s)
    return size == t.size(role_t) and (size == 1 or s.stride(role_s) == t.stride(role_t))


def direct(s: Strategy, t: Strategy) -> bool:
    """Whether a producer under ``s`` feeds a consumer under ``t`` without the row layout
    (a direct edge, §4.3's row path): same ``b`` groups, and the producer's ``m`` group is
    the consumer's ``n`` group and its ``n`` group the consumer's ``m`` group. The
    producer's ``Y`` block (its ``b`` group's rows, output-column block of its ``m`` rank,
    partial over ``n``) is then, once summed over ``n`` (an all-reduce), exactly the
    consumer's ``X`` block (input-column block of its ``n`` rank, replicated over its
    ``m``): Megatron's column-then-row MLP is the case ``pn = 1`` (no communication)."""
    return _same_group(s, "b", t, "b") and _same_group(s, "m", t, "n") and _same_group(s, "n", t, "m")


def direct_terms(layer: MatmulLayer, s: Strategy, e: float) -> List[Term]:
    """A direct edge's producer side: its partial ``Y`` all-reduced over ``n`` (backward:
    the consumer's partial input gradients all-reduced over the same ranks)."""
    L = layer
    t = (Collective.all_reduce, s.pn, s.stride("n"), L.b / s.pb * L.m / s.pm * e, 2,
         "direct edge: partial output all-reduced over n (backward: all-reduce)")
    return [t] if s.pn > 1 else []


def edges(layers: Sequence[MatmulLayer]) -> List[Tuple[List[MatmulLayer], MatmulLayer]]:
    """``(producers, consumer)`` of every place where layers' outputs feed the next layer
    through elementwise code only (``MatmulLayer.into``): the producers directly before the
    consumer, all tied to one variable (so they share a strategy)."""
    out: List[Tuple[List[MatmulLayer], MatmulLayer]] = []
    pending: List[MatmulLayer] = []
    for layer in layers:
        if pending and layer.key == pending[0].into:
            out.append((pending, layer))
            pending = []
        if layer.into is not None:
            if pending and (pending[0].into != layer.into or pending[0].key != layer.key):
                raise ConfigError(f"sbp: layers '{pending[0].name}' and '{layer.name}' feed '{layer.into}' "
                                  f"together but are not tied to one strategy")
            pending.append(layer)
    if pending:
        raise ConfigError(f"sbp: layer '{pending[0].name}' feeds '{pending[0].into}', which does not follow it")
    return out


def compile_problem(layers: Sequence[MatmulLayer], p: int, ab: AlphaBeta,
                    mem: MemoryModel = MemoryModel(), orders: str = "paper",
                    max_split_dims: int = 3, leading_order: bool = False,
                    io: str = "chain") -> Problem:
    """Build the tables of a chain of matmuls (layer ``i`` feeds layer ``i+1``).

    ``io="chain"`` is the paper's model (§4.3: each layer's split output redistributed
    straight into the next layer's input); ``io="rows"`` puts every layer's input and
    output in the row layout (module docstring; :func:`row_io_terms`), the model of what
    :mod:`atp_pipeline.parallel.sbp_exec` executes for any model family.

    ``max_split_dims=2`` keeps the 2-D (Megatron-like) strategies only.
    ``leading_order=True`` counts every collective's bandwidth term as ``N`` (2N for
    all-reduce) instead of Table 2's ``(g-1)/g·N``: the words-moved count of the §4.4.2
    asymptotics. The ``(g-1)/g`` factor is a lower-order correction that is 1/2 for the
    2-rank groups of small meshes and near 1 for large ones, so it flattens log-log
    fits over small ``p``.
    """
    if p < 1:
        raise ConfigError(f"sbp: device count must be >= 1, got {p}")
    if not layers:
        raise ConfigError("sbp: the model has no layers")
    if io not in IO_MODES:
        raise ConfigError(f"sbp: io must be one of {IO_MODES}, got '{io}'")
    if io == "rows":
        return _compile_rows(layers, p, ab, mem, orders, max_split_dims, leading_order)
    for a, b in zip(layers, layers[1:]):
        if a.m != b.n or a.b != b.b:
            if not a.into_attention or a.b != b.b:
                raise ConfigError(f"sbp: layer '{a.name}' (b={a.b}, m={a.m}) does not feed "
                                  f"'{b.name}' (b={b.b}, n={b.n})")
    index, vars_ = _tie(layers, p, orders, max_split_dims)
    e = mem.act_bytes
    first = layers[0].key
    # unary tables: per layer instance (weight all-reduce, output reduce-scatter, input gather)
    for v in vars_:
        n_inst = v.count
        n_with_pred = n_inst - (1 if v.name == first else 0)
        L = v.layer
        cost = {c: np.zeros(len(v.strategies)) for c in COLLECTIVES}
        vol = {c: np.zeros(len(v.strategies)) for c in COLLECTIVES}
        memory = np.zeros(len(v.strategies))
        for i, s in enumerate(v.strategies):
            terms = [
                (Collective.all_reduce, s.pb, s.stride("b"), L.n * L.m / (s.pm * s.pn) * e, n_inst),
                # forward reduce-scatter + backward all-gather of the output
                (Collective.reduce_scatter, s.pn, s.stride("n"), L.b * L.m / (s.pb * s.pm) * e,
                 2 * n_inst),
                # forward all-gather + backward reduce-scatter of the input
                (Collective.all_gather, s.pm, s.stride("m"), L.b * L.n / (s.pb * s.pn) * e,
                 2 * n_with_pred),
            ]
            for c, size, stride, nbytes, times in terms:
                ct, vt = _coll(ab, c, size, stride, nbytes, times, leading_order)
                cost[c.value][i] += ct
                vol[c.value][i] += vt
            memory[i] = n_inst * (L.n * L.m / (s.pm * s.pn) * mem.param_bytes
                                  + (L.b * L.n / (s.pb * s.pn) + L.b * L.m / (s.pb * s.pm)) * e)
        v.cost, v.volume, v.memory = cost, vol, memory
    # pairwise all-to-all, deduplicated by (producer var, consumer var, kind)
    counts: Dict[Tuple[int, int, bool, int], int] = {}
    for a, b in zip(layers, layers[1:]):
        k = (index[a.key], index[b.key], a.into_attention, b.b * b.n)
        counts[k] = counts.get(k, 0) + 1
    pairs = [_pair(vars_[ia], vars_[ib], ia, ib, attn, elems * e, p, ab, cnt, leading_order)
             for (ia, ib, attn, elems), cnt in counts.items()]
    return Problem(p=p, vars=vars_, pairs=pairs, memory_limit=mem.limit)


def _tie(layers: Sequence[MatmulLayer], p: int, orders: str, max_split_dims: int, token_rows: bool = False
         ) -> Tuple[Dict[str, int], List[Var]]:
    """One variable per tie group (§4.5.1) with its legal strategies."""
    index: Dict[str, int] = {}
    vars_: List[Var] = []
    for layer in layers:
        if layer.key in index:
            v = vars_[index[layer.key]]
            if (v.layer.b, v.layer.n, v.layer.m, v.layer.heads) != (layer.b, layer.n, layer.m, layer.heads):
                raise ConfigError(f"sbp: tied layers '{v.layer.name}' and '{layer.name}' differ in shape")
            v.count += 1
            continue
        strat = strategies(layer, p, orders, max_split_dims, token_rows)
        if not strat:
            raise ConfigError(f"sbp: layer '{layer.name}' (b={layer.b}, n={layer.n}, m={layer.m}, "
                              f"heads={layer.heads}) has no legal strategy on {p} devices")
        index[layer.key] = len(vars_)
        vars_.append(Var(layer.key, layer, 1, strat))
    return index, vars_


def row_counts(layers: Sequence[MatmulLayer]
               ) -> Tuple[Dict[str, int], Dict[str, int], Dict[Tuple[str, str, int], int]]:
    """Per tie key, the instances whose input / output go through the row layout whatever
    the strategies (not a direct-edge candidate), and per edge kind ``(producer key,
    consumer key, producers per consumer)`` how many times it occurs (:func:`edges`)."""
    groups = edges(layers)
    produced = {id(x) for prods, _ in groups for x in prods}
    consumed = {id(c) for _, c in groups}
    n_in: Dict[str, int] = {}
    n_out: Dict[str, int] = {}
    for layer in layers:
        n_in[layer.key] = n_in.get(layer.key, 0) + (id(layer) not in consumed)
        n_out[layer.key] = n_out.get(layer.key, 0) + (id(layer) not in produced)
    counts: Dict[Tuple[str, str, int], int] = {}
    for prods, cons in groups:
        k = (prods[0].key, cons.key, len(prods))
        counts[k] = counts.get(k, 0) + 1
    return n_in, n_out, counts


def _terms_cost(ab: AlphaBeta, terms: Sequence[Term], times: float, leading_order: bool
                ) -> Dict[str, Tuple[float, float]]:
    out: Dict[str, Tuple[float, float]] = {}
    for c, size, stride, nbytes, n, _ in terms:
        ct, vt = _coll(ab, c, size, stride, nbytes, n * times, leading_order)
        a, b = out.get(c.value, (0.0, 0.0))
        out[c.value] = (a + ct, b + vt)
    return out


def _compile_rows(layers: Sequence[MatmulLayer], p: int, ab: AlphaBeta, mem: MemoryModel, orders: str,
                  max_split_dims: int, leading_order: bool) -> Problem:
    """:func:`compile_problem` with ``io="rows"``: per variable its weight all-reduce and the
    row layout's input/output collectives of the instances outside direct-edge candidates;
    per edge (:func:`edges`) a pair table holding, for each strategy pair, the direct
    edge's all-reduce (:func:`direct`) or else the producers' output and the consumer's
    input through the row layout."""
    for layer in layers:
        if layer.b % p:
            raise ConfigError(f"sbp: layer '{layer.name}': its {layer.b} token rows do not split over the {p} "
                              f"devices")
    index, vars_ = _tie(layers, p, orders, max_split_dims, token_rows=True)
    e = mem.act_bytes
    n_in, n_out, counts = row_counts(layers)
    for v in vars_:
        L = v.layer
        cost = {c: np.zeros(len(v.strategies)) for c in COLLECTIVES}
        vol = {c: np.zeros(len(v.strategies)) for c in COLLECTIVES}
        memory = np.zeros(len(v.strategies))
        for i, s in enumerate(v.strategies):
            for terms, times in ((weight_terms(L, s, e), v.count), (row_in_terms(L, s, p, e), n_in[v.name]),
                                 (row_out_terms(L, s, p, e), n_out[v.name])):
                for c, (ct, vt) in _terms_cost(ab, terms, times, leading_order).items():
                    cost[c][i] += ct
                    vol[c][i] += vt
            memory[i] = v.count * (L.n * L.m / (s.pm * s.pn) * mem.param_bytes
                                   + (L.b * L.n / (s.pb * s.pn) + L.b * L.m / (s.pb * s.pm)) * e)
        v.cost, v.volume, v.memory = cost, vol, memory
    pairs = []
    for (ka, kb, n_prod), cnt in counts.items():
        va, vb = vars_[index[ka]], vars_[index[kb]]
        by = {c: (np.zeros((len(va.strategies), len(vb.strategies))), np.zeros((len(va.strategies),
                                                                                len(vb.strategies))))
              for c in COLLECTIVES}
        for i, s in enumerate(va.strategies):
            for j, t in enumerate(vb.strategies):
                parts = ([(direct_terms(va.layer, s, e), n_prod * cnt)] if direct(s, t) else
                         [(row_out_terms(va.layer, s, p, e), n_prod * cnt), (row_in_terms(vb.layer, t, p, e), cnt)])
                for terms, times in parts:
                    for c, (ct, vt) in _terms_cost(ab, terms, times, leading_order).items():
                        by[c][0][i, j] += ct
                        by[c][1][i, j] += vt
        pairs.append(Pair(index[ka], index[kb], cnt, sum(x[0] for x in by.values()), sum(x[1] for x in by.values()),
                          by))
    return Problem(p=p, vars=vars_, pairs=pairs, memory_limit=mem.limit)


def _pair(va: Var, vb: Var, ia: int, ib: int, attention: bool, nbytes: float, p: int,
          ab: AlphaBeta, count: int, leading_order: bool = False) -> Pair:
    cost = np.zeros((len(va.strategies), len(vb.strategies)))
    vol = np.zeros_like(cost)
    for i, s in enumerate(va.strategies):
        for j, t in enumerate(vb.strategies):
            same_rows = s.pb == t.pb and (s.pb == 1 or s.stride("b") == t.stride("b"))
            row_path = (not attention) and s.pm == t.pn and (s.pm == 1 or s.order == t.order)
            if same_rows or row_path:
                continue
            hi, lo = max(s.pb, t.pb), min(s.pb, t.pb)
            g = hi // lo if hi % lo == 0 and hi != lo else p
            ct, vt = _coll(ab, Collective.all_to_all, g, p // g, nbytes / p, 2 * count,
                           leading_order)
            cost[i, j], vol[i, j] = ct, vt
    return Pair(ia, ib, count, cost, vol)


# ---------------------------------------------------------------------- model builders
def mlp(dims: Sequence[int], batch: int) -> List[MatmulLayer]:
    """Dense layers ``dims[0] -> dims[1] -> ...`` (the paper's Figure 8 MLP)."""
    if len(dims) < 2:
        raise ConfigError(f"sbp: an MLP needs at least two dimensions, got {list(dims)}")
    return [MatmulLayer(f"fc{i}", batch, dims[i], dims[i + 1]) for i in range(len(dims) - 1)]


def transformer(layers: int, hidden: int, heads: int, seq: int, micro_batch: int,
                ffn_mult: float = 4) -> List[MatmulLayer]:
    """A decoder-only transformer stack as matmuls: per block QKV (into attention, heads
    split evenly), attention output projection, FC1 (``ffn_mult``·h) and FC2; blocks tied
    (§4.5.1). Tokens ``b = micro_batch·seq`` split only on sequence boundaries."""
    if hidden % heads:
        raise ConfigError(f"sbp: hidden {hidden} is not divisible by heads {heads}")
    ffn = ffn_width(hidden, ffn_mult)
    b = micro_batch * seq
    out: List[MatmulLayer] = []
    for i in range(layers):
        u = micro_batch
        out += [MatmulLayer(f"block{i}.qkv", b, hidden, 3 * hidden, tie="qkv", heads=heads,
                            batch_units=u, into_attention=True),
                MatmulLayer(f"block{i}.proj", b, hidden, hidden, tie="proj", batch_units=u),
                MatmulLayer(f"block{i}.fc1", b, hidden, ffn, tie="fc1", batch_units=u),
                MatmulLayer(f"block{i}.fc2", b, ffn, hidden, tie="fc2", batch_units=u)]
    return out


def ffn_width(hidden: int, ffn_mult: float) -> int:
    """The MLP width ``ffn_mult·hidden``, which must be a whole number of features."""
    width = ffn_mult * hidden
    if width != int(width) or width < 1:
        raise ConfigError(f"sbp: FFN width {ffn_mult} x hidden {hidden} is not a positive whole number")
    return int(width)
