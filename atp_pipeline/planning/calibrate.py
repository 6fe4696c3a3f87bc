"""Calibrate the alpha-beta model on this machine and write a topology (AutoDDL §3.2).

    python -m atp_pipeline.planning.calibrate --world 4 --name calib_local
    python train.py 'hydra.searchpath=[atpmesh://,file://'$PWD'/outputs/conf]' topology=calib_local stage=plan

**Measure.** One launch of ``--world`` processes (:func:`atp_pipeline.parallel.launch.spawn`,
gloo) runs the four collectives of Table 2 — all-reduce, all-gather, reduce-scatter and
all-to-all — for every message size of ``--sizes`` and every group layout ``(size,
stride)`` that tiles the world (group sizes 2 … world, consecutive and strided ranks).
All groups of a layout run at once, as the groups of one mesh dimension do in a training
step, so the measurement includes their sharing of the links. Each measurement is
preceded by ``--warmup`` untimed calls; then ``--passes`` timed batches, interleaved over
all measurements (so a burst of load on a shared machine hits every point alike), each
batch ``k`` back-to-back calls (``k`` chosen from the warm-up so a batch lasts about
``--batch-ms``). A batch's time is the median over ranks of each rank's elapsed time / k,
and a point's time the median over passes.

**Fit.** Per topology level (a group runs on the innermost level whose unit covers its
span, :meth:`~atp_pipeline.planning.sbp.alphabeta.AlphaBeta.level`), the points form the
linear system of §3.2, ``t = α·steps(c, p) + β·volume(c, p, N)`` with Table 2's
``steps``/``volume`` (:mod:`atp_pipeline.planning.sbp.alphabeta`, the one implementation
of the model), solved by least squares on *relative* residuals (each row divided by its
measured time, so 4 KiB and 8 MiB points count alike), with α, β ≥ 0. Besides the
paper's one pair per level, every collective kind gets its own pair on the level (gloo
does not run all four as rings: its reduce-scatter costs about twice its all-gather);
the written topology carries both, and the planners use the per-collective pairs.

**Fit quality.** A seeded random 25 % of the points is held out, the model is fitted on
the rest, and the median relative error ``|predicted − measured| / measured`` on the
held-out points is reported (criterion: ≤ 25 %), for the per-collective model and for the
paper's single pair. The written parameters are then refitted on all points.

**Output.** A topology config (default ``outputs/conf/topology/<name>.yaml``; ``--out``
anywhere, e.g. ``conf/topology/<name>.yaml``): the levels with ``p2p_GBps`` =
``group_GBps`` = the fitted all-reduce bus bandwidth ``1/β`` of the level (what ATP's
Eq. 3–4 mesh planner reads: Eq. 4's algorithm bandwidth ``d/(2(d−1))·B′`` is Table 2's
all-reduce with ``β = 1/B′``), and ``alpha_beta:`` with the fitted α/β per level and
collective (what the SBP planner reads through
:meth:`~atp_pipeline.planning.sbp.alphabeta.AlphaBeta.from_topology`). Also a JSON report
(every point, both fits, the errors) and a plot of predicted vs measured time.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.sbp.alphabeta import AlphaBeta, Collective, LinkLevel, steps, volume

COLLECTIVES: Tuple[Collective, ...] = (Collective.all_reduce, Collective.all_gather,
                                       Collective.reduce_scatter, Collective.all_to_all)
DEFAULT_SIZES = tuple(4**k * 4096 for k in range(6))  # 4 KiB ... 4 MiB
ELEMENT_BYTES = 4  # float32 buffers


# ------------------------------------------------------------------------ data types
@dataclass(frozen=True)
class Sample:
    """One measured point: collective ``c`` over groups of ``size`` ranks ``stride`` apart
    moving ``nbytes`` (Table 2's N: the input of reduce-scatter, the output otherwise)."""

    collective: Collective
    size: int
    stride: int
    nbytes: int
    seconds: float
    runs: Tuple[float, ...] = ()  # seconds of each timed pass (median over ranks)

    @property
    def spread(self) -> float:
        """``(max - min) / median`` over the passes: how noisy the point was."""
        return (max(self.runs) - min(self.runs)) / self.seconds if self.runs else 0.0

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["collective"] = self.collective.value
        d["runs"] = list(self.runs)
        return d


@dataclass(frozen=True)
class SweepSpec:
    """What one calibration launch measures (see the module docstring)."""

    world: int
    sizes: Tuple[int, ...] = DEFAULT_SIZES
    layouts: Tuple[Tuple[int, int], ...] = ()  # (size, stride); default: all that tile the world
    collectives: Tuple[Collective, ...] = COLLECTIVES
    warmup: int = 2
    passes: int = 7
    batch_ms: float = 25.0
    max_batch: int = 16

    def __post_init__(self) -> None:
        if self.world < 2:
            raise ConfigError(f"calibrate: --world must be >= 2 processes, got {self.world}")
        if not self.sizes or any(s < ELEMENT_BYTES for s in self.sizes):
            raise ConfigError(f"calibrate: --sizes must be byte counts >= {ELEMENT_BYTES}, "
                              f"got {list(self.sizes)}")
        if self.passes < 1 or self.warmup < 0 or self.max_batch < 1:
            raise ConfigError("calibrate: --passes and --max-batch must be >= 1, --warmup >= 0")
        for size, stride in self.layouts:
            if size < 2 or stride < 1 or self.world % (size * stride):
                raise ConfigError(f"calibrate: group layout {size}x{stride} (size x stride) does not "
                                  f"tile {self.world} processes")

    def group_layouts(self) -> Tuple[Tuple[int, int], ...]:
        return self.layouts or default_layouts(self.world)


def default_layouts(world: int) -> Tuple[Tuple[int, int], ...]:
    """Every ``(size, stride)`` with ``size >= 2`` whose groups tile ``world`` ranks."""
    return tuple((g, s) for g in range(2, world + 1) for s in range(1, world // g + 1)
                 if world % (g * s) == 0)


def layout_groups(world: int, size: int, stride: int) -> List[List[int]]:
    """The concurrent groups of a layout: blocks of ``size·stride`` consecutive ranks, in
    each block the ``stride`` groups ``{o, o+stride, …}`` (row-major mesh dimension)."""
    span = size * stride
    return [[b + o + k * stride for k in range(size)]
            for b in range(0, world, span) for o in range(stride)]


def elements(size: int, nbytes: int) -> int:
    """Float32 elements of Table 2's N (``nbytes``), rounded to a multiple of the group size."""
    return max(size, (nbytes // ELEMENT_BYTES) // size * size)


# ------------------------------------------------------------------------ measurement
def make_groups(world: int, rank: int, layouts: Sequence[Tuple[int, int]]) -> Dict[Tuple[int, int], Any]:
    """Create the process groups of every layout (collectively, same order on every rank);
    returns this rank's group per layout."""
    import torch.distributed as dist

    mine: Dict[Tuple[int, int], Any] = {}
    for size, stride in layouts:
        for ranks in layout_groups(world, size, stride):
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[(size, stride)] = g
    return mine


def collective_call(c: Collective, size: int, n: int, group: Any):
    """A closure running collective ``c`` on ``group`` with Table 2's ``N = n`` elements."""
    import torch
    import torch.distributed as dist

    full = torch.ones(n)
    part = torch.ones(n // size)
    if c is Collective.all_reduce:
        return lambda: dist.all_reduce(full, group=group)
    if c is Collective.all_gather:
        return lambda: dist.all_gather_single(full, part, group=group)
    if c is Collective.reduce_scatter:
        return lambda: dist.reduce_scatter_single(part, full, group=group)
    if c is Collective.all_to_all:
        out = torch.empty(n)
        return lambda: dist.all_to_all_single(out, full, group=group)
    raise ConfigError(f"calibrate: unknown collective {c}")


def timed_batches(rank: int, jobs: Sequence[Any], warmup: int, passes: int, batch_ms: float,
                  max_batch: int) -> List[List[float]]:
    """Run every job (a list of zero-argument calls run back to back) ``passes`` times,
    interleaved, after ``warmup`` untimed runs; returns per job this rank's seconds per run.

    All ranks call this with the same jobs. Before each timed batch the whole world passes
    a barrier; the batch repeats the job ``k`` times (``k`` from the slowest rank's
    warm-up time, the same on every rank).
    """
    import torch
    import torch.distributed as dist

    reps: List[int] = []
    for job in jobs:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(max(1, warmup)):
            for call in job:
                call()
        t = torch.tensor([(time.perf_counter() - t0) / max(1, warmup)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        reps.append(int(min(max_batch, max(1, round(batch_ms * 1e-3 / max(float(t), 1e-9))))))
    out: List[List[float]] = [[] for _ in jobs]
    order = list(range(len(jobs)))
    for p in range(passes):
        shift = (p * 7919) % len(jobs)  # a different interleaving each pass
        for j in order[shift:] + order[:shift]:
            job, k = jobs[j], reps[j]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                for call in job:
                    call()
            out[j].append((time.perf_counter() - t0) / k)
    return out


def _sweep_worker(rank: int, world: int, spec: SweepSpec) -> List[List[float]]:
    groups = make_groups(world, rank, spec.group_layouts())
    jobs = []
    for size, stride in spec.group_layouts():
        for c in spec.collectives:
            for nbytes in spec.sizes:
                jobs.append([collective_call(c, size, elements(size, nbytes), groups[(size, stride)])])
    return timed_batches(rank, jobs, spec.warmup, spec.passes, spec.batch_ms, spec.max_batch)


def combine(per_rank: Sequence[Sequence[Sequence[float]]]) -> List[Tuple[float, ...]]:
    """Per job and pass: the median over ranks of their seconds per call."""
    return [tuple(statistics.median(r[j][p] for r in per_rank) for p in range(len(per_rank[0][j])))
            for j in range(len(per_rank[0]))]


def measure(spec: SweepSpec, timeout: float = 900.0) -> List[Sample]:
    """Run the sweep on ``spec.world`` gloo processes (one launch) and return its points."""
    from atp_pipeline.parallel.launch import spawn

    per_rank = spawn(_sweep_worker, spec.world, spec, timeout=timeout)
    stats = combine(per_rank)
    samples, i = [], 0
    for size, stride in spec.group_layouts():
        for c in spec.collectives:
            for nbytes in spec.sizes:
                n = elements(size, nbytes)
                samples.append(Sample(c, size, stride, n * ELEMENT_BYTES,
                                      statistics.median(stats[i]), stats[i]))
                i += 1
    return samples


def _schedule_worker(rank: int, world: int, layouts: Sequence[Tuple[int, int]],
                     jobs: Sequence[Sequence[Tuple[str, int, int, int]]], warmup: int, passes: int,
                     batch_ms: float, max_batch: int) -> List[List[float]]:
    groups = make_groups(world, rank, layouts)
    built = [[collective_call(Collective(c), size, n, groups[(size, stride)])
              for c, size, stride, n in job] for job in jobs]
    return timed_batches(rank, built, warmup, passes, batch_ms, max_batch)


def measure_schedules(world: int, schedules: Sequence[Sequence[Any]], warmup: int = 1,
                      passes: int = 7, batch_ms: float = 0.0, max_batch: int = 1,
                      timeout: float = 900.0) -> List[Tuple[float, Tuple[float, ...]]]:
    """Seconds of each schedule — a list of
    :class:`~atp_pipeline.planning.sbp.schedule.CollectiveCall` run back to back, each call
    ``times`` times on all groups of its layout at once — on ``world`` gloo processes (one
    launch): (median over passes of the median over ranks, the passes)."""
    from atp_pipeline.parallel.launch import spawn

    layouts = sorted({(c.size, c.stride) for sch in schedules for c in sch})
    jobs = [[(c.collective.value, c.size, c.stride, elements(c.size, int(c.nbytes)))
             for c in sch for _ in range(c.times)] for sch in schedules]
    per_rank = spawn(_schedule_worker, world, layouts, jobs, warmup, passes, batch_ms, max_batch,
                     timeout=timeout)
    return [(statistics.median(runs), runs) for runs in combine(per_rank)]


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (ties get their average rank), with numpy only."""
    def ranks(v: Sequence[float]) -> np.ndarray:
        a = np.asarray(v, dtype=np.float64)
        order = np.argsort(a, kind="mergesort")
        r = np.empty(len(a))
        r[order] = np.arange(len(a), dtype=np.float64)
        for val in np.unique(a):
            tie = a == val
            r[tie] = r[tie].mean()
        return r

    if len(x) != len(y) or len(x) < 2:
        raise ConfigError(f"spearman: need two sequences of equal length >= 2, got {len(x)} and {len(y)}")
    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float(rx @ rx) * float(ry @ ry))
    return float(rx @ ry) / den if den > 0 else 0.0


# ------------------------------------------------------------------------ fitting
def design_row(s: Sample) -> Tuple[float, float]:
    """The row of the §3.2 linear system: ``(steps(c, p), volume(c, p, N))`` of Table 2."""
    return float(steps(s.collective, s.size)), float(volume(s.collective, s.size, s.nbytes))


def fit_pair(samples: Sequence[Sample]) -> Tuple[float, float]:
    """Least-squares ``(α, β) >= 0`` of ``t = α·steps + β·volume`` on relative residuals."""
    if not samples:
        raise ConfigError("calibrate: no measured points to fit")
    A = np.array([design_row(s) for s in samples], dtype=np.float64)
    t = np.array([s.seconds for s in samples], dtype=np.float64)
    if np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise ConfigError("calibrate: measured times must be positive and finite")
    Aw, tw = A / t[:, None], np.ones_like(t)
    best: Optional[Tuple[float, float, float]] = None
    # unconstrained, then the two one-parameter fits: the best feasible of the three is
    # the non-negative least-squares solution of a 2-variable problem
    cands = []
    if np.linalg.matrix_rank(Aw) == 2:
        coef, *_ = np.linalg.lstsq(Aw, tw, rcond=None)
        cands.append((float(coef[0]), float(coef[1])))
    for j in (0, 1):
        col = Aw[:, j]
        den = float(col @ col)
        x = float(col @ tw) / den if den > 0 else 0.0
        cands.append((x, 0.0) if j == 0 else (0.0, x))
    for a, b in cands:
        if a < 0 or b < 0:
            continue
        r = float(np.sum((Aw @ np.array([a, b]) - tw) ** 2))
        if best is None or r < best[2] - 1e-15:
            best = (a, b, r)
    assert best is not None
    return best[0], best[1]


@dataclass(frozen=True)
class LevelSpec:
    """A level of the calibrated topology: ``count`` units per parent unit; its groups span
    at most ``unit`` consecutive ranks (innermost level first in :func:`fit_model`)."""

    name: str
    count: int
    unit: int


def level_specs(world: int, counts: Sequence[int], names: Optional[Sequence[str]] = None
                ) -> List[LevelSpec]:
    """Levels outermost first: ``counts`` multiply to ``world``."""
    counts = list(counts)
    if not counts or any(c < 1 for c in counts) or math.prod(counts) != world:
        raise ConfigError(f"calibrate: --levels {','.join(map(str, counts))} must be positive "
                          f"counts (outermost first) whose product is --world {world}")
    if names is None:
        names = ["process"] if len(counts) == 1 else [f"level{i}" for i in range(len(counts) - 1)] + ["process"]
    if len(names) != len(counts) or len(set(names)) != len(names):
        raise ConfigError(f"calibrate: --level-names {','.join(names)} must be {len(counts)} "
                          f"distinct names")
    out, unit = [], 1
    for name, count in reversed(list(zip(names, counts))):
        unit *= count
        out.append(LevelSpec(name, count, unit))
    return list(reversed(out))


@dataclass
class Fit:
    """Fitted parameters of every level (innermost first) with per-collective pairs."""

    levels: List[LevelSpec]
    pairs: Dict[str, Tuple[float, float]] = field(default_factory=dict)  # level -> (α, β)
    per_collective: Dict[str, Dict[str, Tuple[float, float]]] = field(default_factory=dict)
    points: Dict[str, int] = field(default_factory=dict)
    use_per_collective: bool = True  # chosen by cross-validation (:func:`select_per_collective`)

    def model(self, per_collective: Optional[bool] = None) -> AlphaBeta:
        """The fitted :class:`AlphaBeta` (the world's outermost level covers any span), with
        the per-collective pairs unless ``per_collective`` is False (default: the selection)."""
        if per_collective is None:
            per_collective = self.use_per_collective
        lvls = []
        crossed = [lv for lv in sorted(self.levels, key=lambda x: x.unit) if lv.count > 1]
        for i, lv in enumerate(crossed):
            if lv.name not in self.pairs:
                continue
            a, b = self.pairs[lv.name]
            colls = tuple((c, *p) for c, p in sorted(self.per_collective.get(lv.name, {}).items())
                          ) if per_collective else ()
            unit = lv.unit if i < len(crossed) - 1 else 1 << 62
            lvls.append(LinkLevel(unit=unit, alpha=a, beta=b, collectives=colls))
        if not lvls:
            raise ConfigError("calibrate: no level has measured points")
        return AlphaBeta(tuple(lvls))


def level_of(levels: Sequence[LevelSpec], size: int, stride: int) -> LevelSpec:
    """The innermost crossed level whose unit covers the group's span (as AlphaBeta.level)."""
    span = stride * (size - 1) + 1
    crossed = sorted((lv for lv in levels if lv.count > 1), key=lambda x: x.unit)
    for lv in crossed:
        if span <= lv.unit:
            return lv
    return crossed[-1]


def fit_model(samples: Sequence[Sample], levels: Sequence[LevelSpec]) -> Fit:
    """Least squares per level: one (α, β) over all collectives (the paper's §3.2) and one
    per collective kind with at least two distinct message sizes on that level."""
    fit = Fit(levels=list(levels))
    by_level: Dict[str, List[Sample]] = {}
    for s in samples:
        by_level.setdefault(level_of(levels, s.size, s.stride).name, []).append(s)
    for name, pts in by_level.items():
        fit.pairs[name] = fit_pair(pts)
        fit.points[name] = len(pts)
        per: Dict[str, Tuple[float, float]] = {}
        for c in COLLECTIVES:
            cp = [s for s in pts if s.collective is c]
            if len({design_row(s) for s in cp}) >= 2:
                per[c.value] = fit_pair(cp)
        fit.per_collective[name] = per
    return fit


def predict(ab: AlphaBeta, s: Sample) -> float:
    """Table 2's time of a measured point under model ``ab``."""
    return ab.cost(s.collective, s.size, s.nbytes, s.stride)


def relative_errors(ab: AlphaBeta, samples: Sequence[Sample]) -> np.ndarray:
    return np.array([abs(predict(ab, s) - s.seconds) / s.seconds for s in samples])


def holdout_split(n: int, fraction: float = 0.25, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Indices (train, held out): a seeded random ``fraction`` of ``n`` points held out."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    k = max(1, int(round(fraction * n)))
    return np.sort(perm[k:]), np.sort(perm[:k])


def select_per_collective(samples: Sequence[Sample], levels: Sequence[LevelSpec], folds: int = 4,
                          seed: int = 0) -> Tuple[bool, Dict[str, float]]:
    """Whether per-collective pairs predict better than one pair per level: ``folds``-fold
    cross-validation on ``samples`` (median relative error over all folds' left-out points).
    Per-collective pairs have four times the parameters; on a noisy machine they can
    generalize worse than the paper's single pair."""
    n = len(samples)
    order = np.random.default_rng(seed + 1).permutation(n)
    errs: Dict[bool, List[float]] = {True: [], False: []}
    for f in range(folds):
        left = set(order[f::folds].tolist())
        train = [s for i, s in enumerate(samples) if i not in left]
        test = [s for i, s in enumerate(samples) if i in left]
        if not test or len(train) < 2:
            continue
        fit = fit_model(train, levels)
        for per in (True, False):
            errs[per].extend(relative_errors(fit.model(per), test).tolist())
    med = {("per_collective" if k else "single_pair"): float(np.median(v)) if v else math.inf
           for k, v in errs.items()}
    return med["per_collective"] <= med["single_pair"], med


def evaluate_holdout(samples: Sequence[Sample], levels: Sequence[LevelSpec], fraction: float = 0.25,
                     seed: int = 0) -> Dict[str, Any]:
    """Fit on ``1 - fraction`` of the points (choosing per-collective or single pairs by
    cross-validation on those points only), report errors on the held-out rest."""
    train_i, test_i = holdout_split(len(samples), fraction, seed)
    train = [samples[i] for i in train_i]
    test = [samples[i] for i in test_i]
    fit = fit_model(train, levels)
    per, cv = select_per_collective(train, levels, seed=seed)
    fit.use_per_collective = per
    out: Dict[str, Any] = {"fraction": fraction, "seed": seed, "train_points": len(train),
                           "heldout_points": len(test), "heldout_index": [int(i) for i in test_i],
                           "selected": "per_collective" if per else "single_pair",
                           "cv_median_rel_error": cv}
    for key, per in (("per_collective", True), ("single_pair", False)):
        err = relative_errors(fit.model(per), test)
        out[key] = {"median_rel_error": float(np.median(err)),
                    "mean_rel_error": float(np.mean(err)),
                    "p90_rel_error": float(np.quantile(err, 0.9)),
                    "by_collective": {c.value: float(np.median([e for e, s in zip(err, test)
                                                                if s.collective is c]))
                                      for c in COLLECTIVES if any(s.collective is c for s in test)}}
    out["selected_median_rel_error"] = out[out["selected"]]["median_rel_error"]
    out["fit"] = fit  # the model fitted on the training points (not serialized)
    return out


# ------------------------------------------------------------------------ output
def _g(x: float) -> float:
    return float(f"{x:.6g}")


def topology_config(name: str, fit: Fit, note: str = "", description: str = "") -> Dict[str, Any]:
    """The topology config of a fit: levels outermost first with the all-reduce bus
    bandwidth ``1/β`` as ``p2p_GBps`` = ``group_GBps`` (ATP's Eq. 3 input), and the
    fitted ``alpha_beta`` per level (the SBP planner's input)."""
    levels, ab_entries = [], []
    for lv in fit.levels:  # outermost first
        pair = fit.pairs.get(lv.name)
        per = fit.per_collective.get(lv.name, {}) if fit.use_per_collective else {}
        if pair is None:  # a level of count 1, or no point landed there: inherit the inner one
            inner = [x for x in fit.levels if x.unit < lv.unit and x.name in fit.pairs]
            pair = fit.pairs[inner[-1].name] if inner else next(iter(fit.pairs.values()))
            per = {}
        beta_ar = per.get(Collective.all_reduce.value, pair)[1]
        gbps = _g(1e-9 / beta_ar) if beta_ar > 0 else 1e6
        levels.append({"name": lv.name, "count": lv.count, "p2p_GBps": gbps, "group_GBps": gbps})
        if lv.name in fit.pairs and lv.count > 1:
            a, b = fit.pairs[lv.name]
            entry: Dict[str, Any] = {"level": lv.name, "alpha_us": _g(a * 1e6),
                                     "GBps": _g(1e-9 / b) if b > 0 else 1e6}
            if per:
                entry["collectives"] = {c: {"alpha_us": _g(pa * 1e6),
                                            "GBps": _g(1e-9 / pb) if pb > 0 else 1e6}
                                        for c, (pa, pb) in sorted(per.items())}
            ab_entries.append(entry)
    return {"name": name,
            "description": description or "calibrated on this machine: gloo processes (AutoDDL §3.2 fit)",
            "levels": levels, "alpha_beta": ab_entries, "device": {"name": "cpu"},
            **({"note": note} if note else {})}


def write_topology(cfg: Dict[str, Any], path: Path, header: str = "") -> None:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None, width=100,
                          allow_unicode=True)
    path.write_text(header + text)


def plot_fit(samples: Sequence[Sample], ab: AlphaBeta, heldout: Sequence[int], path: Path,
             title: str) -> None:
    """Predicted vs measured time per point (log-log), held-out points ringed, ±25 % band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 4.8))
    marks = {"all_reduce": "o", "all_gather": "s", "reduce_scatter": "^", "all_to_all": "D"}
    ho = set(heldout)
    for c in COLLECTIVES:
        idx = [i for i, s in enumerate(samples) if s.collective is c]
        if not idx:
            continue
        m = np.array([samples[i].seconds for i in idx]) * 1e3
        p = np.array([predict(ab, samples[i]) for i in idx]) * 1e3
        ax.scatter(m, p, marker=marks[c.value], s=22, label=c.value, alpha=0.8)
        h = [k for k, i in enumerate(idx) if i in ho]
        if h:
            ax.scatter(m[h], p[h], marker="o", s=90, facecolors="none", edgecolors="k", lw=0.8)
    lo = min(s.seconds for s in samples) * 1e3 / 2
    hi = max(s.seconds for s in samples) * 1e3 * 2
    xs = np.array([lo, hi])
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, xs * 0.75, xs * 1.25, color="gray", alpha=0.15, label="±25 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (ms)")
    ax.set_ylabel("predicted, fitted alpha-beta model (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass
class CalibrationResult:
    samples: List[Sample]
    fit: Fit
    holdout: Dict[str, Any]
    topology: Dict[str, Any]
    seconds: float

    @property
    def heldout_median_error(self) -> float:
        """Held-out median relative error of the selected model (the §3.2 criterion)."""
        return float(self.holdout["selected_median_rel_error"])

    def to_dict(self) -> Dict[str, Any]:
        ab = self.fit.model()
        return {
            "samples": [{**s.to_dict(), "predicted": predict(ab, s)} for s in self.samples],
            "fit": {"levels": [asdict(lv) for lv in self.fit.levels],
                    "pairs": {k: {"alpha_s": a, "beta_s_per_byte": b, "GBps": 1e-9 / b if b else None}
                              for k, (a, b) in self.fit.pairs.items()},
                    "per_collective": {k: {c: {"alpha_s": a, "beta_s_per_byte": b} for c, (a, b) in v.items()}
                                       for k, v in self.fit.per_collective.items()},
                    "points": self.fit.points},
            "written_model": "per_collective" if self.fit.use_per_collective else "single_pair",
            "holdout": {k: v for k, v in self.holdout.items() if k != "fit"},
            "criterion_heldout_median_le_25pct": self.heldout_median_error <= 0.25,
            "topology": self.topology,
            "seconds": self.seconds,
        }


def calibrate(spec: SweepSpec, name: str, levels: Sequence[LevelSpec], seed: int = 0,
              samples: Optional[List[Sample]] = None) -> CalibrationResult:
    """Measure (unless ``samples`` are given), fit, evaluate on held-out points."""
    t0 = time.perf_counter()
    if samples is None:
        samples = measure(spec)
    holdout = evaluate_holdout(samples, levels, 0.25, seed)
    fit = fit_model(samples, levels)
    fit.use_per_collective, _ = select_per_collective(samples, levels, seed=seed)
    note = (f"fitted {_dt.date.today().isoformat()} on {platform.node() or 'this host'} "
            f"({platform.machine()}, {spec.world} gloo processes, {len(samples)} points); held-out "
            f"median relative error {holdout['selected_median_rel_error']:.1%} "
            f"({holdout['selected'].replace('_', ' ')} model; per-collective "
            f"{holdout['per_collective']['median_rel_error']:.1%}, one pair per level "
            f"{holdout['single_pair']['median_rel_error']:.1%})")
    topo = topology_config(name, fit, note=note)
    return CalibrationResult(samples, fit, holdout, topo, time.perf_counter() - t0)


def write_report(res: CalibrationResult, out_dir: Path, name: str) -> Dict[str, Path]:
    """``<name>.json`` (everything), ``<name>_points.csv`` and ``<name>_fit.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "csv": out_dir / f"{name}_points.csv",
             "plot": out_dir / f"{name}_fit.png"}
    paths["json"].write_text(json.dumps(res.to_dict(), indent=2) + "\n")
    ab = res.fit.model()
    ab75 = res.holdout["fit"].model()
    held = set(res.holdout["heldout_index"])
    with paths["csv"].open("w", newline="") as f:
        w = csv.writer(f)
        # predicted_75_s: by the fit on the 75 % training points (held-out column: 1 = not
        # used by it); predicted_s: by the written fit on all points; spread: (max - min) /
        # median over the passes
        w.writerow(["collective", "group_size", "stride", "bytes", "measured_s", "predicted_75_s",
                    "rel_error_75", "heldout", "predicted_s", "spread"])
        for i, s in enumerate(res.samples):
            p75, p = predict(ab75, s), predict(ab, s)
            w.writerow([s.collective.value, s.size, s.stride, s.nbytes, f"{s.seconds:.6e}",
                        f"{p75:.6e}", f"{abs(p75 - s.seconds) / s.seconds:.4f}", int(i in held),
                        f"{p:.6e}", f"{s.spread:.3f}"])
    plot_fit(res.samples, ab75, sorted(held), paths["plot"],
             f"{name}: fit on 75 % of the points; held out (ringed):\n"
             f"median relative error {res.heldout_median_error:.1%}")
    return paths


def print_summary(res: CalibrationResult) -> None:
    for lv in res.fit.levels:
        if lv.name not in res.fit.pairs:
            continue
        a, b = res.fit.pairs[lv.name]
        print(f"level '{lv.name}' ({res.fit.points[lv.name]} points): alpha {a * 1e6:.1f} us, "
              f"bandwidth {1e-9 / b if b else float('inf'):.3f} GB/s (one pair, §3.2)")
        for c, (pa, pb) in res.fit.per_collective.get(lv.name, {}).items():
            print(f"    {c:<15} alpha {pa * 1e6:8.1f} us  bandwidth "
                  f"{1e-9 / pb if pb else float('inf'):.3f} GB/s")
    h = res.holdout
    crit = "PASS" if res.heldout_median_error <= 0.25 else "FAIL"
    sel = h[h["selected"]]
    print(f"held-out {h['heldout_points']} of {h['heldout_points'] + h['train_points']} points: median "
          f"relative error {res.heldout_median_error:.1%} [{crit}: <= 25%] with the "
          f"{h['selected'].replace('_', ' ')} model chosen by cross-validation (per-collective "
          f"{h['per_collective']['median_rel_error']:.1%}, one pair per level "
          f"{h['single_pair']['median_rel_error']:.1%}); by collective: "
          + ", ".join(f"{c} {e:.0%}" for c, e in sel["by_collective"].items()))
    print(f"written model: {'per-collective pairs' if res.fit.use_per_collective else 'one pair per level'}")


def load_samples(path: Path) -> List[Sample]:
    """The measured points of a report written by :func:`write_report`."""
    try:
        rows = json.loads(path.read_text())["samples"]
        return [Sample(Collective(r["collective"]), int(r["size"]), int(r["stride"]), int(r["nbytes"]),
                       float(r["seconds"]), tuple(float(x) for x in r.get("runs", ())))
                for r in rows]
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ConfigError(f"calibrate: --samples {path}: not a calibration report ({exc})") from None


def parse_sizes(text: str) -> Tuple[int, ...]:
    """``4096,65536`` or ``4K:4M`` (powers of 4 between); suffixes K, M (2^10, 2^20)."""
    def one(x: str) -> int:
        x = x.strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20}.get(x[-1:], 1)
        return int(float(x[:-1] if mult > 1 else x) * mult)

    try:
        if ":" in text:
            lo, hi = (one(x) for x in text.split(":"))
            out, s = [], lo
            while s <= hi:
                out.append(s)
                s *= 4
            return tuple(out)
        return tuple(one(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"calibrate: --sizes '{text}' is not a list of byte counts "
                          f"(e.g. 4K:4M or 4096,65536)") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m atp_pipeline.planning.calibrate",
        description="Measure all-reduce/all-gather/reduce-scatter/all-to-all on gloo processes, "
                    "fit alpha and beta per level (AutoDDL §3.2) and write a topology config.")
    parser.add_argument("--world", type=int, default=4, help="processes (default 4)")
    parser.add_argument("--name", default="calib_local", help="topology name (default calib_local)")
    parser.add_argument("--out", default=None,
                        help="topology YAML (default outputs/conf/topology/<name>.yaml)")
    parser.add_argument("--report-dir", default="outputs/calibration",
                        help="JSON/CSV/plot directory (default outputs/calibration)")
    parser.add_argument("--levels", default=None,
                        help="level counts outermost first, product = world (default: one level)")
    parser.add_argument("--level-names", default=None, help="names of the levels (comma-separated)")
    parser.add_argument("--sizes", default="4K:4M", help="message bytes: 4K:4M (powers of 4) or a list")
    parser.add_argument("--passes", type=int, default=7, help="timed passes per point (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per point")
    parser.add_argument("--batch-ms", type=float, default=25.0, help="target length of a timed batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the 25%% held-out split")
    parser.add_argument("--samples", default=None,
                        help="refit the points of an earlier report (<name>.json) instead of measuring")
    args = parser.parse_args(argv)
    from atp_pipeline.cli import EXIT_BAD_INPUT

    try:
        counts = [int(x) for x in args.levels.split(",")] if args.levels else [args.world]
        names = args.level_names.split(",") if args.level_names else None
        levels = level_specs(args.world, counts, names)
        spec = SweepSpec(world=args.world, sizes=parse_sizes(args.sizes), passes=args.passes,
                         warmup=args.warmup, batch_ms=args.batch_ms)
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_BAD_INPUT
    try:
        samples = load_samples(Path(args.samples)) if args.samples else None
    except ConfigError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_BAD_INPUT
    if samples is None:
        print(f"calibrating: {args.world} gloo processes, {len(spec.group_layouts())} group layouts "
              f"(size x stride: {', '.join(f'{g}x{s}' for g, s in spec.group_layouts())}), "
              f"{len(spec.sizes)} sizes {spec.sizes[0]}..{spec.sizes[-1]} B, 4 collectives, "
              f"{spec.passes} passes")
    else:
        print(f"refitting {len(samples)} measured points from {args.samples}")
    res = calibrate(spec, args.name, levels, seed=args.seed, samples=samples)
    print_summary(res)
    out = Path(args.out) if args.out else Path("outputs/conf/topology") / f"{args.name}.yaml"
    header = (f"# Calibrated by `python -m atp_pipeline.planning.calibrate "
              f"{' '.join(sys.argv[1:] if argv is None else argv)}` (AutoDDL §3.2).\n"
              f"# levels: p2p/group GB/s = the fitted all-reduce bus bandwidth 1/beta (ATP Eq. 3);\n"
              f"# alpha_beta: fitted alpha (us) and 1/beta (GB/s) per level and collective (Table 2).\n")
    write_topology(res.topology, out, header)
    paths = write_report(res, Path(args.report_dir), args.name)
    search_dir = out.parent.parent.resolve()
    print(f"wrote {out} ({res.seconds:.1f} s); report {', '.join(str(p) for p in paths.values())}")
    print(f"use it: python train.py 'hydra.searchpath=[atpmesh://,file://{search_dir}]' "
          f"topology={args.name} stage=plan")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
