"""Tensor-parallel communication time of a transformer step (ATP Eq. 2), term by term.

On ``DeviceMesh(d1, d2)`` a layer has four conjugate operators (Figure 6): ``f1`` around the
column-first QKV linear, ``f2`` around the row-first output projection, ``f3``/``f4`` around
the column- and row-first MLP linears. Eq. 2 charges them::

    T_comm = 2*L*b*s * (3h/(d1*B2) + h/(d2*B1) + 4h/(d1*B2) + h/(d2*B1))
           = 2*L*b*s * (7h/(d1*B2) + 2h/(d2*B1))

(times the bytes per element, with B in bytes/s). The ``2`` counts a forward and a backward
all-reduce per operator, each charged the operator's forward size. So a column-first
operator (f1, f3) all-reduces its output, partial over dimension 2, with bandwidth ``B2``;
a row-first one (f2, f4) all-reduces its output, partial over dimension 1, with ``B1``.
The paper's prose (§3.2.1) says f1/f3 reduce over the *first* dimension in the forward
pass; its equations, which we follow, put them on the second.

A dimension of size 1 has no collective, so its terms vanish: on ``(N, 1)`` this is
Megatron-LM's ``4*L*b*s*h / B1`` (§2.3).

Each term is a :class:`CommTerm`; the runtime's counted collectives are compared with them
term by term, and a runtime that sends more (around the attention core or LayerNorm) adds
terms here rather than a second cost model.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import List, Optional, Tuple

from atp_pipeline.config.schema import DTYPE_BYTES, CostModel, DType


@dataclass(frozen=True)
class CommTerm:
    """One collective per layer: ``elements_per_token`` elements, ``passes`` times a step."""

    op: str  # "f1".."f4"
    where: str  # the layer part it sits in
    collective: str  # "all_reduce"
    dim: int  # mesh dimension (1 or 2) the collective runs on
    elements_per_token: Fraction  # per token of the local batch, exact
    passes: int  # times per training step (forward and backward)


def eq2_terms(hidden: int, mesh: Tuple[int, int]) -> List[CommTerm]:
    """The four conjugate operators of Eq. 2; terms on a size-1 dimension are dropped."""
    d1, d2 = mesh
    h = hidden
    terms = [
        CommTerm("f1", "attention QKV linear (column-first)", "all_reduce", 2, Fraction(3 * h, d1), 2),
        CommTerm("f2", "attention output linear (row-first)", "all_reduce", 1, Fraction(h, d2), 2),
        CommTerm("f3", "MLP first linear (column-first)", "all_reduce", 2, Fraction(4 * h, d1), 2),
        CommTerm("f4", "MLP second linear (row-first)", "all_reduce", 1, Fraction(h, d2), 2),
    ]
    return [t for t in terms if (d1 if t.dim == 1 else d2) > 1]


def comm_terms(cost_model: CostModel, hidden: int, mesh: Tuple[int, int]) -> List[CommTerm]:
    if cost_model == CostModel.eq2:
        return eq2_terms(hidden, mesh)
    raise ValueError(f"unknown cost model {cost_model}")


@dataclass(frozen=True)
class TermCost:
    term: CommTerm
    bytes_per_step: float  # per rank, all layers
    seconds: float

    def to_dict(self) -> dict:
        t = self.term
        return {"op": t.op, "where": t.where, "collective": t.collective, "dim": t.dim,
                "elements_per_token": float(t.elements_per_token), "passes": t.passes,
                "bytes_per_step": self.bytes_per_step, "seconds": self.seconds}


def step_comm_time(terms: List[CommTerm], layers: int, batch: int, seq: int, dtype: DType,
                   B1_GBps: Optional[float], B2_GBps: Optional[float]) -> Tuple[float, List[TermCost]]:
    """Eq. 2: seconds of tensor-parallel all-reduce per step, and each term's share."""
    nbytes = DTYPE_BYTES[dtype]
    costs = []
    for t in terms:
        bw = B1_GBps if t.dim == 1 else B2_GBps
        if bw is None:
            raise ValueError(f"term {t.op} on mesh dimension {t.dim} has no bandwidth")
        volume = float(layers * batch * seq * t.passes * t.elements_per_token * nbytes)
        costs.append(TermCost(t, volume, volume / (bw * 1e9)))
    return sum(c.seconds for c in costs), costs
