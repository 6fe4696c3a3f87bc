"""Strategy search over a compiled :class:`~atp_pipeline.planning.sbp.space.Problem` (§4.6).

One interface, :func:`search` ``(problem, method, budget_s, seed)``, four methods:

* ``exhaustive`` — every assignment, vectorized over the last two variables; stops at
  the budget (``complete=False`` in the result then);
* ``random`` — uniform random assignments in batches until the budget or ``samples``;
* ``metropolis`` — Metropolis-Hastings: one variable changes at random per proposal,
  accepted with ``min(1, exp(-temp·(C_new - C_old)/C_ref))`` (``P(S) ∝ exp(-β·Cost(S))``
  with β = ``temp/C_ref``, ``C_ref`` the starting cost, so ``temp`` is scale-free);
* ``coordinate`` — coordinate descent: each variable in turn takes the argmin of the
  total cost with the others fixed, until a fixed point (plus two-variable moves where the
  memory limit blocks single ones, see :func:`_coordinate`); then a restart from a random
  feasible start, until ``restarts`` (default 2) or the budget.

The memory limit is a hard constraint everywhere (infeasible cost = inf). Evaluations
count complete assignments (exhaustive, random, Metropolis) or candidate strategies
scored in a line search (coordinate descent).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.sbp.space import Problem

METHODS = ("exhaustive", "random", "metropolis", "coordinate")


@dataclass
class SearchResult:
    method: str
    assignment: List[int]
    cost: float
    evaluations: int
    seconds: float
    complete: bool  # exhaustive covered the whole space / the method ran to its own end

    def plan(self, problem: Problem) -> dict:
        """The plan report: per-variable strategy with DTensor placements, the predicted
        communication per collective, memory per device and search statistics."""
        return {
            "method": self.method, "devices": problem.p, "cost_s": self.cost,
            "evaluations": self.evaluations, "search_s": self.seconds, "complete": self.complete,
            "memory_bytes_per_device": problem.memory(self.assignment),
            "memory_limit": problem.memory_limit,
            "communication": problem.breakdown(self.assignment),
            "layers": [{"tie": v.name, "instances": v.count,
                        "shape": {"b": v.layer.b, "n": v.layer.n, "m": v.layer.m},
                        "strategy": v.strategies[s].to_dict()}
                       for v, s in zip(problem.vars, self.assignment)],
        }


def _better(x: float, cur: float) -> bool:
    """``x`` improves on ``cur`` by more than rounding (any finite ``x`` beats inf)."""
    return x < cur if not math.isfinite(cur) else x < cur - 1e-12 * abs(cur)


def _delta(problem: Problem, assign: Sequence[int], v: int) -> np.ndarray:
    """The terms of the cost that depend on variable ``v`` (unary and its all-to-alls)."""
    c = problem.unary[v]
    for pr in problem.touching[v]:
        if pr.a == v and pr.b == v:
            c = c + np.diag(pr.cost)
        elif pr.a == v:
            c = c + pr.cost[:, assign[pr.b]]
        else:
            c = c + pr.cost[assign[pr.a], :]
    return c


def _local2(problem: Problem, assign: Sequence[int], u: int, v: int,
            memory: float) -> np.ndarray:
    """Total cost as a function of the strategies of ``u`` (rows) and ``v`` (columns)."""
    c = (problem.unary[u][:, None] + problem.unary[v][None, :]
         + sum(float(problem.unary[w][assign[w]]) for w in range(len(assign)) if w not in (u, v)))
    for pr in problem.pairs:
        a, b = pr.a, pr.b
        if a not in (u, v) and b not in (u, v):
            c = c + float(pr.cost[assign[a], assign[b]])
        elif (a, b) == (u, v):
            c = c + pr.cost
        elif (a, b) == (v, u):
            c = c + pr.cost.T
        elif a == b:
            d = np.diag(pr.cost)
            c = c + (d[:, None] if a == u else d[None, :])
        else:
            vec = pr.cost[:, assign[b]] if a in (u, v) else pr.cost[assign[a], :]
            c = c + (vec[:, None] if u in (a, b) else vec[None, :])
    if problem.memory_limit is not None:
        mu, mv = problem.vars[u].memory, problem.vars[v].memory
        rest = memory - float(mu[assign[u]]) - float(mv[assign[v]])
        c = np.where(rest + mu[:, None] + mv[None, :] > problem.memory_limit, np.inf, c)
    return c


def _batch_cost(problem: Problem, A: np.ndarray) -> np.ndarray:
    """Costs of assignments ``A`` (k × V)."""
    c = np.zeros(len(A))
    mem = np.zeros(len(A))
    for v in range(len(problem.vars)):
        c += problem.unary[v][A[:, v]]
        mem += problem.vars[v].memory[A[:, v]]
    for pr in problem.pairs:
        c += pr.cost[A[:, pr.a], A[:, pr.b]]
    if problem.memory_limit is not None:
        c[mem > problem.memory_limit] = np.inf
    return c


def _exhaustive(problem: Problem, budget_s: float, t0: float, **_: object) -> SearchResult:
    V = len(problem.vars)
    sizes = problem.sizes
    free = list(range(max(0, V - 2), V))
    fixed = list(range(0, max(0, V - 2)))
    shape = tuple(sizes[v] for v in free)
    best, best_a, evals, complete = math.inf, [0] * V, 0, True
    limit = problem.memory_limit
    for prefix in itertools.product(*(range(sizes[v]) for v in fixed)):
        if time.perf_counter() - t0 > budget_s:
            complete = False
            break
        base = sum(float(problem.unary[v][s]) for v, s in zip(fixed, prefix))
        tot = np.full(shape, base)
        mem = np.full(shape, sum(float(problem.vars[v].memory[s]) for v, s in zip(fixed, prefix)))
        for k, v in enumerate(free):
            sh = [1] * len(free)
            sh[k] = sizes[v]
            tot = tot + problem.unary[v].reshape(sh)
            mem = mem + problem.vars[v].memory.reshape(sh)
        for pr in problem.pairs:
            a_fixed, b_fixed = pr.a in fixed, pr.b in fixed
            if a_fixed and b_fixed:
                tot = tot + pr.cost[prefix[pr.a], prefix[pr.b]]
                continue
            m = pr.cost
            m = m[prefix[pr.a]] if a_fixed else m
            m = m[..., prefix[pr.b]] if b_fixed else m
            if a_fixed or b_fixed:
                w = pr.b if a_fixed else pr.a
                sh = [1] * len(free)
                sh[free.index(w)] = sizes[w]
                tot = tot + m.reshape(sh)
            elif pr.a == pr.b:
                sh = [1] * len(free)
                sh[free.index(pr.a)] = sizes[pr.a]
                tot = tot + np.diag(m).reshape(sh)
            else:
                tot = tot + (m if free.index(pr.a) < free.index(pr.b) else m.T)
        if limit is not None:
            tot = np.where(mem > limit, np.inf, tot)
        evals += tot.size
        i = int(np.argmin(tot))
        if tot.flat[i] < best:
            best = float(tot.flat[i])
            best_a = list(prefix) + [int(x) for x in np.unravel_index(i, shape)]
    return SearchResult("exhaustive", best_a, best, evals, 0.0, complete)


def _random_feasible(problem: Problem, rng: np.random.Generator, tries: int = 1000) -> List[int]:
    for _ in range(tries):
        a = [int(rng.integers(n)) for n in problem.sizes]
        if problem.feasible(a):
            return a
    # fall back to the least-memory assignment (may still be infeasible: cost inf)
    return [int(np.argmin(v.memory)) for v in problem.vars]


def _random(problem: Problem, budget_s: float, t0: float, rng: np.random.Generator,
            samples: int = 10_000, batch: int = 512, **_: object) -> SearchResult:
    best_a = _random_feasible(problem, rng)
    best, evals = problem.cost(best_a), 1
    while evals < samples and time.perf_counter() - t0 < budget_s:
        k = min(batch, samples - evals)
        A = np.stack([rng.integers(n, size=k) for n in problem.sizes], axis=1)
        c = _batch_cost(problem, A)
        evals += k
        i = int(np.argmin(c))
        if c[i] < best:
            best, best_a = float(c[i]), [int(x) for x in A[i]]
    return SearchResult("random", best_a, best, evals, 0.0, evals >= samples)


def _metropolis(problem: Problem, budget_s: float, t0: float, rng: np.random.Generator,
                iterations: int = 5_000, temp: float = 100.0, init_samples: int = 256,
                **_: object) -> SearchResult:
    # start from the best of a few random draws: C_ref (the temperature's scale) is then
    # of the order of good costs, not of a random plan's
    A = np.stack([rng.integers(n, size=init_samples) for n in problem.sizes], axis=1)
    costs = _batch_cost(problem, A)
    i = int(np.argmin(costs))
    cur = [int(x) for x in A[i]] if math.isfinite(costs[i]) else _random_feasible(problem, rng)
    cur_c = problem.cost(cur)
    ref = cur_c if math.isfinite(cur_c) and cur_c > 0 else 1.0
    best, best_a, evals = cur_c, list(cur), 0
    V = len(cur)
    raw = problem.raw_cost(cur)
    mem = problem.memory(cur)
    limit = problem.memory_limit
    sizes = np.asarray(problem.sizes)
    block = 1024  # random numbers drawn in blocks (a numpy call per proposal is slow)
    while evals < iterations and time.perf_counter() - t0 < budget_s:
        if evals % block == 0:
            vs = rng.integers(V, size=block)
            ss = (rng.random(block) * sizes[vs]).astype(int)
            us = rng.random(block)
        k = evals % block
        v, s, u = int(vs[k]), int(ss[k]), float(us[k])
        old = cur[v]
        evals += 1
        if s == old:
            continue
        # the cost change of moving v: its unary term and the all-to-alls touching it
        d = float(problem.unary[v][s] - problem.unary[v][old])
        for pr in problem.touching[v]:
            a_old = old if pr.a == v else cur[pr.a]
            b_old = old if pr.b == v else cur[pr.b]
            a_new = s if pr.a == v else cur[pr.a]
            b_new = s if pr.b == v else cur[pr.b]
            d += float(pr.cost[a_new, b_new] - pr.cost[a_old, b_old])
        new_mem = mem + float(problem.vars[v].memory[s] - problem.vars[v].memory[old])
        c = math.inf if limit is not None and new_mem > limit else raw + d
        if c <= cur_c or (math.isfinite(c) and u < math.exp(-temp * (c - cur_c) / ref)):
            cur[v], raw, mem, cur_c = s, raw + d, new_mem, c
            if c < best:
                best, best_a = c, list(cur)
    best = problem.cost(best_a)  # exact (the running sum accumulates rounding)
    return SearchResult("metropolis", best_a, best, evals, 0.0, evals >= iterations)


def _coordinate(problem: Problem, budget_s: float, t0: float, rng: np.random.Generator,
                restarts: int = 2, pair_moves: object = "auto", **_: object) -> SearchResult:
    """Coordinate descent (§4.6). The first start takes each variable's cheapest strategy
    on its own (unary cost; a random feasible one if that is over the memory limit), later
    starts are random feasible assignments. With ``pair_moves`` a fixed point of single
    moves is also tested against moves of two variables at once (block coordinate
    descent). ``"auto"`` does so only where the memory limit blocked a cheaper single
    move in the last sweep; the paper's algorithm is ``pair_moves=False``."""
    best, best_a, evals, runs = math.inf, [0] * len(problem.sizes), 0, 0
    while runs < restarts and time.perf_counter() - t0 < budget_s:
        if runs == 0:
            cur = [int(np.argmin(u)) for u in problem.unary]
            if not problem.feasible(cur):
                cur = _random_feasible(problem, rng)
        else:
            cur = _random_feasible(problem, rng)
        cur_c = problem.cost(cur)
        raw_c = problem.raw_cost(cur)
        mem = problem.memory(cur)
        changed = True
        while changed and time.perf_counter() - t0 < budget_s:
            changed, blocked = False, False
            for v in range(len(cur)):
                d = _delta(problem, cur, v)
                c = raw_c - float(d[cur[v]]) + d
                evals += len(c)
                if problem.memory_limit is not None:
                    raw = c
                    rest = mem - float(problem.vars[v].memory[cur[v]])
                    c = np.where(rest + problem.vars[v].memory > problem.memory_limit, np.inf, raw)
                    blocked = blocked or float(raw.min()) < float(c.min())
                s = int(np.argmin(c))
                if s != cur[v] and _better(float(c[s]), cur_c):
                    mem += float(problem.vars[v].memory[s] - problem.vars[v].memory[cur[v]])
                    cur[v], changed = s, True
                    cur_c = raw_c = problem.raw_cost(cur)
            if changed or not (pair_moves is True or (pair_moves == "auto" and blocked)):
                continue
            # fixed point of single moves: try moving two variables at once (a memory
            # limit can block every single move that would trade memory between layers)
            for u, v in itertools.combinations(range(len(cur)), 2):
                c2 = _local2(problem, cur, u, v, mem)
                evals += c2.size
                i, j = np.unravel_index(int(np.argmin(c2)), c2.shape)
                if _better(float(c2[i, j]), cur_c):
                    mem += float(problem.vars[u].memory[i] - problem.vars[u].memory[cur[u]]
                                 + problem.vars[v].memory[j] - problem.vars[v].memory[cur[v]])
                    cur[u], cur[v], changed = int(i), int(j), True
                    cur_c = raw_c = problem.raw_cost(cur)
                    break
        runs += 1
        if cur_c < best:
            best, best_a = cur_c, list(cur)
    return SearchResult("coordinate", best_a, best, evals, 0.0, runs >= restarts)


def search(problem: Problem, method: str = "coordinate", budget_s: float = 10.0,
           seed: Optional[int] = 0, **options: object) -> SearchResult:
    """Run ``method`` on ``problem`` for at most ``budget_s`` seconds (see the module)."""
    if method not in METHODS:
        raise ConfigError(f"sbp: unknown search method '{method}'; choose one of {list(METHODS)}")
    if budget_s <= 0:
        raise ConfigError(f"sbp: budget_s must be > 0, got {budget_s}")
    rng = np.random.default_rng(seed)
    fn = {"exhaustive": _exhaustive, "random": _random, "metropolis": _metropolis,
          "coordinate": _coordinate}[method]
    t0 = time.perf_counter()
    res = fn(problem, budget_s=budget_s, t0=t0, rng=rng, **options)  # type: ignore[operator]
    res.seconds = time.perf_counter() - t0
    return res


def search_all(problem: Problem, budget_s: float = 10.0, seed: int = 0,
               options: Optional[Dict[str, dict]] = None) -> Dict[str, SearchResult]:
    """All four methods on one problem (the Figure 8 comparison)."""
    options = options or {}
    return {m: search(problem, m, budget_s, seed, **options.get(m, {})) for m in METHODS}
