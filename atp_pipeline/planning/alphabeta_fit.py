"""Fit the alpha-beta model to measured collective times and write a topology (AutoDDL §3.2).

The fitting half of calibration: pure (numpy; no torch, no processes). The measuring half —
the sweep of collectives on gloo processes and the command — is
:mod:`atp_pipeline.run.calibrate`::

    python -m atp_pipeline.run.calibrate --world 4 --name calib_local
    python train.py 'hydra.searchpath=[atpmesh://,file://'$PWD'/outputs/conf]' topology=calib_local stage=plan

**Points.** A :class:`Sample` is one measured point: a collective of Table 2 — all-reduce,
all-gather, reduce-scatter or all-to-all — over concurrent groups of ``size`` ranks
``stride`` apart moving ``nbytes``, with the median time of its passes.

**Fit.** Per topology level (a group runs on the innermost level whose unit covers its
span, :meth:`~atp_pipeline.planning.alphabeta.AlphaBeta.level`), the points form the
linear system of §3.2, ``t = α·steps(c, p) + β·volume(c, p, N)`` with Table 2's
``steps``/``volume`` (:mod:`atp_pipeline.planning.alphabeta`, the one implementation
of the model), solved by least squares on *relative* residuals (each row divided by its
measured time, so 4 KiB and 8 MiB points count alike), with α, β ≥ 0. Besides the
paper's one pair per level, every collective kind gets its own pair on the level (gloo
does not run all four as rings: its reduce-scatter costs about twice its all-gather);
the written topology carries both, and the planners use the per-collective pairs.

**Fit quality.** A seeded random 25 % of the points is held out, the model is fitted on
the rest, and the median relative error ``|predicted − measured| / measured`` on the
held-out points is reported (criterion: ≤ 25 %), for the per-collective model and for the
paper's single pair. The written parameters are then refitted on all points
(:func:`fit_calibration`).

**Output.** A topology config (:func:`topology_config`, :func:`write_topology`): the
levels with ``p2p_GBps`` = ``group_GBps`` = the fitted all-reduce bus bandwidth ``1/β`` of
the level (what ATP's Eq. 3–4 mesh planner reads: Eq. 4's algorithm bandwidth
``d/(2(d−1))·B′`` is Table 2's all-reduce with ``β = 1/B′``), and ``alpha_beta:`` with the
fitted α/β per level and collective (what the SBP planner reads through
:meth:`~atp_pipeline.planning.alphabeta.AlphaBeta.from_topology`). Also a JSON report
(every point, both fits, the errors) and a plot of predicted vs measured time
(:func:`write_report`).
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.alphabeta import AlphaBeta, Collective, LinkLevel, steps, volume
from atp_pipeline.planning.lstsq import nnls

COLLECTIVES: Tuple[Collective, ...] = (Collective.all_reduce, Collective.all_gather,
                                       Collective.reduce_scatter, Collective.all_to_all)


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
    a, b = nnls(A / t[:, None], np.ones_like(t))
    return float(a), float(b)


def fit_alpha(samples: Sequence[Sample], beta: float) -> float:
    """``α >= 0`` of ``t = α·steps + β·volume`` with ``β`` given, on relative residuals (as
    :func:`fit_pair`): for a collective whose own fit finds no per-byte cost."""
    A = np.array([design_row(s) for s in samples], dtype=np.float64)
    t = np.array([s.seconds for s in samples], dtype=np.float64)
    x, r = A[:, 0] / t, 1.0 - beta * A[:, 1] / t
    return max(0.0, float(x @ r / (x @ x))) if float(x @ x) > 0 else 0.0


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
    # level -> the collectives whose own fit found no per-byte cost (β = 0: their time did not
    # grow with the message over the measured sizes, e.g. on a loaded loopback) and which take
    # the level's β instead, their α refitted (:func:`fit_model`)
    level_beta: Dict[str, List[str]] = field(default_factory=dict)

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
                a, b = fit_pair(cp)
                if b <= 0 < fit.pairs[name][1]:  # no per-byte cost identified: an infinite
                    b = fit.pairs[name][1]  # bandwidth (Eq. 3's B' = 1/β) would price any
                    a = fit_alpha(cp, b)  # message alike; the level's shared β is the §3.2 fit
                    fit.level_beta.setdefault(name, []).append(c.value)
                per[c.value] = (a, b)
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
    from atp_pipeline.figures import axes

    with axes(path, (5.6, 4.8)) as ax:
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
        path.parent.mkdir(parents=True, exist_ok=True)


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
                    "points": self.fit.points,
                    **({"beta_from_level": self.fit.level_beta} if self.fit.level_beta else {})},
            "written_model": "per_collective" if self.fit.use_per_collective else "single_pair",
            "holdout": {k: v for k, v in self.holdout.items() if k != "fit"},
            "criterion_heldout_median_le_25pct": self.heldout_median_error <= 0.25,
            "topology": self.topology,
            "seconds": self.seconds,
        }


def fit_calibration(samples: Sequence[Sample], name: str, levels: Sequence[LevelSpec], seed: int = 0
                    ) -> CalibrationResult:
    """Fit measured ``samples``, evaluate on held-out points, build the topology config
    ``name``. ``seconds`` of the result is the fit's own time (the measuring driver,
    :func:`atp_pipeline.run.calibrate.calibrate`, sets it to measuring + fitting)."""
    t0 = time.perf_counter()
    samples = list(samples)
    holdout = evaluate_holdout(samples, levels, 0.25, seed)
    fit = fit_model(samples, levels)
    fit.use_per_collective, _ = select_per_collective(samples, levels, seed=seed)
    world = max(lv.unit for lv in levels)
    note = (f"fitted {_dt.date.today().isoformat()} on {platform.node() or 'this host'} "
            f"({platform.machine()}, {world} gloo processes, {len(samples)} points); held-out "
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
                  f"{1e-9 / pb if pb else float('inf'):.3f} GB/s"
                  + (" (no per-byte cost of its own: the level's)" if c in res.fit.level_beta.get(lv.name, ()) else ""))
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
