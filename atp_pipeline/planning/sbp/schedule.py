"""The collectives one SBP strategy runs per training step (AutoDDL §4.3–§4.4.1).

:func:`schedule` lists, for an assignment of a compiled
:class:`~atp_pipeline.planning.sbp.space.Problem`, every collective the cost model charges
— the weight-gradient all-reduce of replicated weights (§4.4.1), the output
reduce-scatter and input all-gather of every layer with their backward duals, and the
all-to-all between consecutive layers whose split layouts differ (§4.3) — each with its
group (size and rank stride on the row-major mesh), its Table 2 size ``N`` in bytes and how
many times a step runs it. It follows :func:`~atp_pipeline.planning.sbp.space.compile_problem`
term by term; ``sum(call.seconds(ab))`` equals ``problem.raw_cost(assign)`` exactly (tested),
so running the schedule on real process groups measures exactly what the model predicts
(:mod:`benchmarks.sbp_calibration`, the paper's Figure 4). With ``io="rows"`` (the row
layout between layers that :mod:`atp_pipeline.parallel.sbp_exec` executes) the calls are
:func:`~atp_pipeline.planning.sbp.space.row_io_terms` per layer instance, and the executor
runs exactly these collectives (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.alphabeta import AlphaBeta, Collective
from atp_pipeline.planning.sbp.space import (
    MatmulLayer,
    Problem,
    Strategy,
    direct,
    direct_terms,
    row_counts,
    row_in_terms,
    row_out_terms,
    weight_terms,
)


@dataclass(frozen=True)
class CollectiveCall:
    """``times`` runs of ``collective`` over the groups of ``size`` ranks ``stride`` apart
    (all groups of that mesh dimension at once), Table 2 size ``nbytes`` per run."""

    collective: Collective
    size: int
    stride: int
    nbytes: float
    times: int
    what: str = ""

    def seconds(self, ab: AlphaBeta) -> float:
        """Predicted seconds of all ``times`` runs (Table 2 via :meth:`AlphaBeta.cost`)."""
        return self.times * ab.cost(self.collective, self.size, self.nbytes, self.stride)

    def to_dict(self) -> dict:
        return {"collective": self.collective.value, "size": self.size, "stride": self.stride,
                "nbytes": self.nbytes, "times": self.times, "what": self.what}


def _layer_calls(layer: MatmulLayer, s: Strategy, n_inst: int, n_with_pred: int, e: float
                 ) -> List[CollectiveCall]:
    L = layer
    terms = [
        (Collective.all_reduce, s.pb, s.stride("b"), L.n * L.m / (s.pm * s.pn) * e, n_inst,
         "weight-gradient all-reduce (§4.4.1)"),
        (Collective.reduce_scatter, s.pn, s.stride("n"), L.b * L.m / (s.pb * s.pm) * e, 2 * n_inst,
         "output reduce-scatter + backward all-gather (§4.3)"),
        (Collective.all_gather, s.pm, s.stride("m"), L.b * L.n / (s.pb * s.pn) * e, 2 * n_with_pred,
         "input all-gather + backward reduce-scatter (§4.3)"),
    ]
    out = []
    for c, size, stride, nbytes, times, what in terms:
        if size > 1 and times > 0:
            # the backward dual has the same Table 2 cost; run the forward kind twice
            out.append(CollectiveCall(c, size, stride, nbytes, times, f"{L.key}: {what}"))
    return out


def _a2a_call(s: Strategy, t: Strategy, attention: bool, nbytes: float, p: int, count: int,
              what: str) -> List[CollectiveCall]:
    same_rows = s.pb == t.pb and (s.pb == 1 or s.stride("b") == t.stride("b"))
    row_path = (not attention) and s.pm == t.pn and (s.pm == 1 or s.order == t.order)
    if same_rows or row_path:
        return []
    hi, lo = max(s.pb, t.pb), min(s.pb, t.pb)
    g = hi // lo if hi % lo == 0 and hi != lo else p
    if g <= 1:
        return []
    return [CollectiveCall(Collective.all_to_all, g, p // g, nbytes / p, 2 * count,
                           f"{what}: redistribution all-to-all (§4.3)")]


def schedule(problem: Problem, assign: Sequence[int], layers: Sequence[MatmulLayer],
             act_bytes: float, io: str = "chain") -> List[CollectiveCall]:
    """Every collective of one training step of ``layers`` (the list ``problem`` was
    compiled from, with ``MemoryModel.act_bytes = act_bytes`` and this ``io``) under ``assign``."""
    if len(assign) != len(problem.vars):
        raise ConfigError(f"sbp schedule: {len(assign)} choices for {len(problem.vars)} variables")
    index: Dict[str, int] = {v.name: i for i, v in enumerate(problem.vars)}
    if any(layer.key not in index for layer in layers):
        raise ConfigError("sbp schedule: the layers are not the ones the problem was compiled from")
    strat = {v.name: v.strategies[a] for v, a in zip(problem.vars, assign)}
    if io == "rows":
        return _row_calls(problem, strat, layers, act_bytes)
    first = layers[0].key
    calls: List[CollectiveCall] = []
    for v in problem.vars:
        calls += _layer_calls(v.layer, strat[v.name], v.count, v.count - (1 if v.name == first else 0),
                              act_bytes)
    counts: Dict[Tuple[str, str, bool, int], int] = {}
    for a, b in zip(layers, layers[1:]):
        k = (a.key, b.key, a.into_attention, b.b * b.n)
        counts[k] = counts.get(k, 0) + 1
    for (ka, kb, attn, elems), cnt in counts.items():
        calls += _a2a_call(strat[ka], strat[kb], attn, elems * act_bytes, problem.p, cnt,
                           f"{ka} -> {kb}")
    return calls


def _row_calls(problem: Problem, strat: Dict[str, Strategy], layers: Sequence[MatmulLayer], e: float
               ) -> List[CollectiveCall]:
    """``io="rows"``: the terms :func:`~atp_pipeline.planning.sbp.space.compile_problem`
    charges, as calls (weight all-reduces, the row layout's input/output, direct edges)."""
    p = problem.p
    n_in, n_out, counts = row_counts(layers)
    by_key = {v.name: v for v in problem.vars}
    parts = []
    for v in problem.vars:
        s = strat[v.name]
        parts += [(v.name, weight_terms(v.layer, s, e), v.count),
                  (v.name, row_in_terms(v.layer, s, p, e), n_in[v.name]),
                  (v.name, row_out_terms(v.layer, s, p, e), n_out[v.name])]
    for (ka, kb, n_prod), cnt in counts.items():
        a, b = by_key[ka].layer, by_key[kb].layer
        s, t = strat[ka], strat[kb]
        if direct(s, t):
            parts.append((f"{ka} -> {kb}", direct_terms(a, s, e), n_prod * cnt))
        else:
            parts += [(ka, row_out_terms(a, s, p, e), n_prod * cnt), (kb, row_in_terms(b, t, p, e), cnt)]
    return [CollectiveCall(c, size, stride, nbytes, n * times, f"{name}: {what}")
            for name, terms, times in parts for c, size, stride, nbytes, n, what in terms if times > 0]
