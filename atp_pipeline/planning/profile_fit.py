"""Fitting a compute profile from a calibration's measurements (pure: numpy, no torch).

What :mod:`atp_pipeline.run.calibrate_compute` measured becomes a
:class:`~atp_pipeline.planning.compute_profile.ComputeProfile`:

* per kernel kind, ``t = α + size·γ`` over the measured sweep (:func:`fit_kind`), the points kept;
* the framework cost ``T = K·(1 + f) + n·o + m·a + B·b + r·p`` over the probe models'
  collective-free forward and backward (:func:`fit_framework`);
* the sync term ``α + r·compute`` and the hidden share of an overlapped collective from the
  compute-then-collective loops (:func:`fit_sync`);
* the collectives' backend CPU per call and byte from the pure collective loops
  (:func:`fit_collective_cpu_loops`);
* the step residual over the probes' whole training steps in two forms, the one that predicts
  the probe models left out in turn better kept (:func:`fit_residual`, :func:`fit_probe_steps`).

Only probe models enter a fit: never a model, batch or sequence length a user plans.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import platform
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.comm_clock import CommClock
from atp_pipeline.planning.compute_profile import (
    CollectiveCPU,
    ComputeProfile,
    CpuStep,
    Framework,
    KindFit,
    Mesh,
    Probe,
    StepResidual,
    SyncFit,
    cell_key,
    shape_key,
)
from atp_pipeline.planning.kernels import GEMM, KINDS, OPTIMIZER, Kernel
from atp_pipeline.planning.lstsq import bounded_lstsq, nnls
from atp_pipeline.planning.step_program import all_items, build_program

OPTIMIZER_DESC = "AdamW foreach=True on DTensor parameters' local shards (lightning.module.adamw)"
SYNC_GEMM = Kernel(GEMM, (64, 256, 256))  # the compute of the compute-then-collective loop
SYNC, ASYNC = "sync", "async"  # collective after the GEMMs / launched before them, waited after
MIN_FACTOR = -0.5  # the least the framework's kernel_factor may be: a kernel never takes 0 s

Plan = Tuple[int, int, int, int]  # (model index, d1, d2, chunks)
Pattern = Tuple[int, int, int, str, int, int, str]  # (d1, d2, dim, collective, bytes, SYNC_GEMMs, SYNC|ASYNC)


@dataclass(frozen=True)
class Timed:
    """One measurement's medians over the passes: wall seconds per call (the slowest rank),
    CPU seconds per call (the ranks' mean, all threads), seconds waited in collectives per
    call by group size (rank 0; live probe steps only)."""

    wall: float
    cpu: float
    waits: Dict[int, float]



def fit_kind(kernels: Sequence[Kernel], seconds: Sequence[float]) -> KindFit:
    """``t = α + size·γ`` (:attr:`Kernel.size`: the work, an attention core's score elements;
    optimizer: ``t = α + tensors·τ + work·γ``), least squares on relative residuals, non-negative."""
    t = np.asarray(seconds, dtype=np.float64)
    per_size = any(k.size != k.work for k in kernels)
    size = np.array([k.size for k in kernels], dtype=np.float64)
    opt = bool(kernels) and kernels[0].kind == OPTIMIZER
    cols = [np.ones_like(t)] + ([np.array([k.dims[0] for k in kernels], dtype=np.float64)] if opt else []) + [size]
    x = nnls(np.stack(cols, axis=1) / t[:, None], np.ones_like(t))
    if opt:
        return KindFit(float(x[0]), float(x[2]), float(x[1]))
    return KindFit(float(x[0]), float(x[1]), per_size=per_size)


def plan_features(profile: ComputeProfile, shape: Any, mesh: Tuple[int, int], chunks: int,
                  batch: Optional[int] = None) -> Tuple[float, int, int, float, int]:
    """What the framework cost of a plan's forward and backward is fitted over: the
    profile's seconds ``K`` of its ``n`` kernels (but the optimizer), its ``m`` collective
    calls, the bytes ``B`` they move and its ``r`` sharded parameter reads
    (:func:`~atp_pipeline.planning.step_program.build_program`)."""
    prog, _ = build_program(shape, mesh, shape.batch_size if batch is None else batch, chunks)
    items = list(all_items(prog))
    ks = [it[1] for it in items if it[0] == "k" and it[1].kind != OPTIMIZER]
    colls = [it[1] for it in items if it[0] in ("sync", "async", "linear")]
    nbytes = float(sum(c.elements for c in colls)) * shape.bytes_per_element
    return sum(profile.seconds(k) for k in ks), len(ks), len(colls), nbytes, prog.reads


def plan_calls(shape: Any, mesh: Tuple[int, int], chunks: int) -> Dict[int, int]:
    """A plan's collective calls in its forward and backward by group size."""
    prog, _ = build_program(shape, mesh, shape.batch_size, chunks)
    colls = [it[1] for it in all_items(prog) if it[0] in ("sync", "async", "linear")]
    calls: Dict[int, int] = {}
    for c in colls:
        size = mesh[0] if c.term.dim == 1 else mesh[1]
        calls[size] = calls.get(size, 0) + 1
    return calls


def framework_seconds(fw: Framework, features: Tuple[float, int, int, float, int]) -> float:
    """A plan's collective-free forward and backward under ``fw``: ``K·(1 + f) + n·o + m·a + B·b + r·p``."""
    k, n, m, nbytes, reads = features
    return (k * (1 + fw.kernel_factor) + n * fw.per_kernel_s + m * fw.per_collective_s
            + nbytes * fw.per_collective_byte_s + reads * fw.per_read_s)


def fit_framework(profile: ComputeProfile, shapes: Sequence[Any], plans: Sequence[Plan],
                  seconds: Sequence[float]) -> Framework:
    """``T = K·(1 + f) + n·o + m·a + B·b + r·p`` over every probe plan (T its measured
    collective-free forward and backward; :func:`plan_features`), one set for all models and
    meshes, relative least squares with ``f >= -0.5`` (kernels can run faster in a plan's
    sequence than each timed alone: warm caches) and ``o, a, b, p >= 0``
    (:func:`~atp_pipeline.planning.lstsq.bounded_lstsq`). The probes' layouts read 0.14-0.44
    sharded parameters a kernel (``r`` against ``n``), so ``p`` and ``o`` are told apart."""
    feats = [plan_features(profile, shapes[mi], (d1, d2), c) for mi, d1, d2, c in plans]
    A = np.array([[k / t, n / t, m / t, b / t, r / t] for (k, n, m, b, r), t in zip(feats, seconds)])
    y = np.array([(t - ft[0]) / t for ft, t in zip(feats, seconds)])
    f, o, a, b, p = bounded_lstsq(A, y, [MIN_FACTOR, 0.0, 0.0, 0.0, 0.0])
    return Framework(float(o), float(f), float(a), float(b), float(p))


def pattern_prediction(profile: ComputeProfile, topo: Any, pat: Pattern) -> Tuple[float, float]:
    """(compute, collective) seconds the model gives a pattern without the sync term: its GEMMs
    as every rank runs them at once on the host (:meth:`ComputeProfile.host_factor`)."""
    d1, d2, dim, coll, nbytes, m, _ = pat
    return (m * profile.seconds(SYNC_GEMM) * profile.host_factor(d1 * d2),
            CommClock(topo, (d1, d2), 4).seconds(coll, dim, float(nbytes)))


def fit_sync(profile: ComputeProfile, topo: Any, patterns: Sequence[Pattern], seconds: Sequence[float]) -> SyncFit:
    """From the compute-then-collective loops, ``extra = α + r·compute`` (extra: a loop's
    measured time over the profile's compute plus the topology's collective time); then from
    the collective-during-compute loops, the hidden share ``h`` of the step model's
    ``max(c + (1 - h)·min(c, d), d)`` (``d`` the collective with its extra, the compute since
    the previous launch being the previous iteration's). Relative least squares, α, r >= 0,
    h in [0, 1] (to 0.001)."""
    rows, ys = [], []
    for pat, t in zip(patterns, seconds):
        if pat[6] != SYNC:
            continue
        comp, coll = pattern_prediction(profile, topo, pat)
        rows.append([1.0 / t, comp / t])
        ys.append((t - comp - coll) / t)
    a, r = nnls(np.array(rows), np.array(ys))
    pts = []
    for pat, t in zip(patterns, seconds):
        if pat[6] == ASYNC:
            comp, coll = pattern_prediction(profile, topo, pat)
            d = coll + a + r * comp
            pts.append((comp, d, t))
    hidden = 1.0
    if pts:
        grid = np.linspace(0.0, 1.0, 1001)
        err = [sum(((max(c + (1 - h) * min(c, d), d) - t) / t) ** 2 for c, d, t in pts) for h in grid]
        hidden = float(grid[int(np.argmin(err))])
    return SyncFit(float(a), float(r), hidden)


def fit_collective_cpu_loops(patterns: Sequence[Pattern], timed: Sequence[Timed]) -> Optional[CollectiveCPU]:
    """The collectives' backend CPU from the pure collective loops (the patterns with no GEMMs,
    ``SYNC``: every rank in the same back-to-back collectives after a barrier, so no rank waits
    for a slower one's compute): per group size, a rank's CPU per call ``c + b·bytes`` (relative
    non-negative least squares over the loops of that size, every collective and message size
    alike). Waiting costs nothing (no busy share): a rank blocked in a gloo collective sleeps.
    None without such loops (a world of one process)."""
    by_size: Dict[int, List[Tuple[float, float]]] = {}
    for pat, t in zip(patterns, timed):
        d1, d2, dim, _, nbytes, m, mode = pat
        if m == 0 and mode == SYNC and t.cpu > 0:
            by_size.setdefault(d1 if dim == 1 else d2, []).append((float(nbytes), t.cpu))
    if not by_size:
        return None
    per_call, per_byte = {}, {}
    for size, pts in sorted(by_size.items()):
        a = np.array([[1.0 / c, b / c] for b, c in pts])
        x = nnls(a, np.ones(len(pts))) if len({b for b, _ in pts}) > 1 else np.array(
            [statistics.median(c for _, c in pts), 0.0])
        per_call[size], per_byte[size] = float(x[0]), float(x[1])
    return CollectiveCPU({}, per_call, per_byte)


def probe_step_predictions(profile: ComputeProfile, topo: Any, shapes: Sequence[Any],
                           plans: Sequence[Plan]) -> List[Any]:
    """The step model's prediction (:class:`~atp_pipeline.planning.steptime.StepEstimate`) of each
    probe's whole training step (:func:`_live_runner`) on its mesh's process count (``topo``
    restricted to it, as the validation predicts)."""
    from atp_pipeline.planning.steptime import StepSetting, estimate_step

    return [estimate_step(topo.restrict(d1 * d2), shapes[mi], (d1, d2), StepSetting(chunks=c), profile)
            for mi, d1, d2, c in plans]


def probe_step_errors(predicted: Sequence[Any], measured: Sequence[float]) -> List[float]:
    """The step model's relative error on the probes' own training steps with their collectives
    (``predicted``: :func:`probe_step_predictions`; in sample: a check of the calibration, not a validation)."""
    return [abs(e.step_s - t) / t for e, t in zip(predicted, measured)]


def fit_step_residual(parts: Sequence[Tuple[float, float]], measured: Sequence[float],
                      processes: Sequence[int], chunks: Optional[Sequence[int]] = None) -> Optional[StepResidual]:
    """:class:`StepResidual` from the probes' own training steps: per process count and chunk count,
    ``T = a·C + b·E`` (``parts``: each step's predicted compute ``C`` and exposed communication ``E``;
    ``T`` measured), relative non-negative least squares over the steps at those counts; with fewer
    than 3 steps, or no exposed communication to tell the two apart, one factor for both (the median
    of T / (C + E)). ``chunks`` None: every step's 1. None without a step measured."""
    by: Dict[int, Dict[int, List[Tuple[float, float, float]]]] = {}
    for (c, e), t, n, k in zip(parts, measured, processes, chunks or [1] * len(parts)):
        if c + e > 0 and t > 0:
            by.setdefault(int(n), {}).setdefault(int(k), []).append((c, e, t))
    if not by:
        return None
    comp: Dict[int, Dict[int, float]] = {}
    expo: Dict[int, Dict[int, float]] = {}
    for n, per in sorted(by.items()):
        for k, pts in sorted(per.items()):
            if len(pts) >= 3 and any(e > 0 for _, e, _ in pts):
                a, b = nnls(np.array([[c / t, e / t] for c, e, t in pts]), np.ones(len(pts)))
            else:
                a = b = statistics.median(t / (c + e) for c, e, t in pts)
            comp.setdefault(n, {})[k], expo.setdefault(n, {})[k] = float(a), float(b)
    return StepResidual(comp, expo, {n: sum(len(p) for p in per.values()) for n, per in sorted(by.items())})


def fit_cpu_step(cpu_pred: Sequence[float], cpu_meas: Sequence[float], measured: Sequence[float],
                 processes: Sequence[int], meshes: Sequence[Mesh], chunks: Sequence[int]) -> Optional[CpuStep]:
    """:class:`CpuStep` from the probes' own training steps: per process count and (mesh, chunk
    count) cell the measured step ``T`` against the measured rank CPU ``U`` as ``T = ratio·U + wait``,
    and the measured rank CPU against the predicted ``Û`` as ``U = a·Û + b`` (both :func:`_line`;
    the CPU's line per cell). None without a step whose three times are
    all measured."""
    steps: Dict[int, Dict[str, List[Tuple[float, float]]]] = {}
    cpu: Dict[int, Dict[str, List[Tuple[float, float]]]] = {}
    for u_hat, u, t, n, mesh, k in zip(cpu_pred, cpu_meas, measured, processes, meshes, chunks):
        if u_hat > 0 and u > 0 and t > 0:
            steps.setdefault(int(n), {}).setdefault(cell_key(mesh, k), []).append((u, t))
            cpu.setdefault(int(n), {}).setdefault(cell_key(mesh, k), []).append((u_hat, u))
    if not steps:
        return None
    cells = {n: {c: _line(pts) for c, pts in sorted(per.items())} for n, per in sorted(steps.items())}
    return CpuStep({n: {c: g for c, (g, _) in per.items()} for n, per in cells.items()},
                   {n: {k: _line(pts) for k, pts in sorted(per.items())} for n, per in sorted(cpu.items())},
                   {n: {c: w for c, (_, w) in per.items()} for n, per in cells.items()})


def _line(pts: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """``y = s·x + c`` over ``(x, y)`` points: relative non-negative least squares; with fewer than
    3 points, or no fit with ``s > 0``, ``s`` the median of ``y / x`` and ``c = 0``."""
    s = c = 0.0
    if len(pts) >= 3:
        s, c = nnls(np.array([[x / y, 1.0 / y] for x, y in pts]), np.ones(len(pts)))
    if not s > 0:
        s, c = statistics.median(y / x for x, y in pts), 0.0
    return float(s), float(c)


def fit_residual(parts: Sequence[Tuple[float, float]], cpu_pred: Sequence[float], cpu_meas: Sequence[float],
                 measured: Sequence[float], processes: Sequence[int], meshes: Sequence[Mesh], chunks: Sequence[int],
                 models: Sequence[int]) -> Optional[StepResidual]:
    """The :class:`StepResidual` of the probes' own steps in both forms — the terms' two factors
    (:func:`fit_step_residual`) and the step from a rank's CPU (:func:`fit_cpu_step`) — and the form
    that predicts better the probe *models* left out of the fit, one at a time (``models``: each
    step's probe model; the root mean square of the relative errors over every left-out step; the
    terms' form where there are fewer than two models or no CPU measured). Both forms' left-out
    errors (median, worst) are kept in ``cv``."""
    terms = fit_step_residual(parts, measured, processes, chunks)
    anchored = fit_cpu_step(cpu_pred, cpu_meas, measured, processes, meshes, chunks)
    if terms is None or anchored is None or len(set(models)) < 2:
        return terms
    errs: Dict[str, List[float]] = {"terms": [], "cpu": []}
    idx = range(len(measured))
    for m in sorted(set(models)):
        keep = [i for i in idx if models[i] != m]
        sub = lambda xs: [xs[i] for i in keep]  # noqa: E731
        t_fit = fit_step_residual(sub(parts), sub(measured), sub(processes), sub(chunks))
        c_fit = fit_cpu_step(sub(cpu_pred), sub(cpu_meas), sub(measured), sub(processes), sub(meshes), sub(chunks))
        for i in idx:
            if models[i] != m or not measured[i] > 0 or t_fit is None or c_fit is None:
                continue
            fc, fe = t_fit.at(processes[i], chunks[i])
            errs["terms"].append((fc * parts[i][0] + fe * parts[i][1]) / measured[i] - 1.0)
            errs["cpu"].append(c_fit.step(processes[i], meshes[i], chunks[i], cpu_pred[i]) / measured[i] - 1.0)
    if not errs["cpu"]:
        return terms
    rms = {f: math.sqrt(statistics.fmean(e * e for e in v)) for f, v in errs.items()}
    cv = {f: (statistics.median(abs(e) for e in v), max(abs(e) for e in v)) for f, v in errs.items()}
    return dataclasses.replace(terms, anchored=anchored, form=min(rms, key=lambda f: (rms[f], f != "terms")), cv=cv)


def probe_step_rows(probe_names: Sequence[str], plans: Sequence[Plan], processes: Sequence[int],
                    wall: Sequence[float], cpu: Sequence[float], terms: Sequence[Any], final: Sequence[Any]
                    ) -> List[Dict[str, Any]]:
    """One row per probe step the step residual was fitted over: its probe, process count, mesh and
    chunks, its measured wall and rank CPU, the terms' prediction (``terms``: compute, exposed, the
    rank's CPU, the step) and the profile's with the residual (``final``) — what a later look
    of the residual's forms needs (the calibration's ``<topology>_probe_steps.json``)."""
    return [{"probe": probe_names[mi], "processes": n,
             "mesh": f"{d1}x{d2}", "chunks": c, "measured_s": t, "measured_cpu_s": u,
             "compute_s": e.compute_s, "exposed_s": e.exposed_comm_s, "cpu_s": e.cpu_s, "coll_cpu_s": e.coll_cpu_s,
             "terms_s": e.step_s,
             "predicted_s": f.step_s}
            for (mi, d1, d2, c), n, t, u, e, f in zip(plans, processes, wall, cpu, terms, final)]


def residual_counts(world: int) -> List[int]:
    """The process counts the probes' whole steps are timed at for :class:`StepResidual`: the
    calibration's ``world`` and 2 (the smallest run with collectives)."""
    return sorted({world, 2}) if world >= 2 else []


def probe_records(probe_names: Sequence[str], shapes: Sequence[Any], plans: Sequence[Plan],
                  with_processes: bool = False) -> Tuple[Probe, ...]:
    """The :class:`Probe` record of each plan a calibration ran (``probe_names`` name ``shapes``;
    empty: the shapes' own names); ``with_processes``: each records its mesh's process count (the
    step residual's probe steps on counts other than the profile's ``processes``)."""
    names = list(probe_names) or [getattr(sh, "name", f"probe{i}") for i, sh in enumerate(shapes)]
    return tuple(Probe(names[mi], shape_key(shapes[mi]), (d1, d2), shapes[mi].batch_size, shapes[mi].seq_len,
                       d1 * d2 if with_processes else 0) for mi, d1, d2, _ in plans)


def utc_now() -> str:
    """Now (UTC) as a profile's ``date`` and a re-timing's ``measured`` spell it."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_profile(name: str, kernels: Sequence[Kernel], seconds: Sequence[float], world: int,
                 shapes: Sequence[Any] = (), plans: Sequence[Plan] = (), plan_seconds: Sequence[float] = (),
                 topo: Any = None, patterns: Sequence[Pattern] = (), pattern_seconds: Sequence[float] = (),
                 contention: Optional[Mapping[int, float]] = None, probe_names: Sequence[str] = (),
                 collective_cpu: Optional[CollectiveCPU] = None, kernel_time: str = "wall",
                 comm_contention: Optional[Mapping[int, float]] = None) -> ComputeProfile:
    """The profile of a calibration's measurements: kernel points and per-kind fits, the
    framework cost fitted over the probe plans, the sync fit over the loops, the contention
    factors, the collectives' CPU (:func:`fit_collective_cpu_loops`), and the probes it ran
    (``probe_names`` name ``shapes``). ``kernel_time``: what ``seconds`` and ``plan_seconds``
    are — ``"cpu"``, a rank's CPU per call (``process_time``; :attr:`Timed.cpu`), or ``"wall"``
    (the loops' ``pattern_seconds`` are wall times either way)."""
    fits: Dict[str, KindFit] = {}
    for kind in KINDS:
        idx = [i for i, k in enumerate(kernels) if k.kind == kind]
        if not idx:
            raise ConfigError(f"compute calibration: no kernel of kind '{kind}' was measured")
        fits[kind] = fit_kind([kernels[i] for i in idx], [seconds[i] for i in idx])
    gemm = [(k.work / s) for k, s in zip(kernels, seconds) if k.kind == GEMM]
    source = (f"measured on {platform.node() or 'this host'} "
              f"({platform.machine()}, {world} processes at once, 1 thread each, a sweep of {len(kernels)} kernels"
              + (f", {len(plans)} collective-free probe steps of {len(shapes)} probe models" if plans else "")
              + (f", {len(patterns)} compute-then-collective loops" if patterns else "")
              + (f", contention at {'/'.join(str(p) for p in sorted(contention))} processes" if contention else "")
              + (", the collectives' CPU per call and byte from the pure collective loops"
                 if collective_cpu is not None else "")
              + ")")
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
    base = ComputeProfile(name=name, source=source, fits=fits,
                          points={(k.kind, k.dims): s for k, s in zip(kernels, seconds)},
                          processes=world, peak_flops=max(gemm), optimizer=OPTIMIZER_DESC, cores=cores,
                          kernel_time=kernel_time)
    framework = fit_framework(base, shapes, plans, plan_seconds) if plans else None
    sync = fit_sync(base, topo, patterns, pattern_seconds) if patterns else None
    probes = probe_records(probe_names, shapes, plans)
    return ComputeProfile(name=name, source=source, fits=fits, points=base.points, processes=world, cores=cores,
                          peak_flops=base.peak_flops, framework=framework, sync=sync, optimizer=OPTIMIZER_DESC,
                          contention=dict(contention or {}), date=utc_now(), probes=probes,
                          collective_cpu=collective_cpu, kernel_time=kernel_time,
                          comm_contention=dict(comm_contention or {}))


def fit_probe_steps(profile: ComputeProfile, topo: Any, shapes: Sequence[Any], probe_names: Sequence[str],
                    live: Sequence[Plan], live_at: Sequence[int], live_wall: Sequence[float], live_cpu: Sequence[float]
                    ) -> Tuple[ComputeProfile, List[Dict[str, Any]], str]:
    """The step residual (:func:`fit_residual`): the probes' whole steps ``live`` (on ``live_at``
    processes; measured wall and rank CPU) against ``profile``'s prediction of them on ``topo`` —
    an end-to-end check of the terms, and what they miss of a step, fitted from probes only. The
    profile with it, one row per probe step (:func:`probe_step_rows`) and a summary for its source."""
    predicted = probe_step_predictions(profile, topo, shapes, live)
    residual = fit_residual([(e.compute_s, e.exposed_comm_s) for e in predicted], [e.cpu_s for e in predicted],
                            live_cpu, live_wall, live_at, [(d1, d2) for _, d1, d2, _ in live],
                            [c for _, _, _, c in live], [mi for mi, _, _, _ in live])
    world = profile.processes
    extra_probes = probe_records(probe_names, shapes, [pl for pl, n in zip(live, live_at) if n != world],
                                 with_processes=True)
    profile = dataclasses.replace(profile, step_residual=residual, probes=profile.probes + extra_probes)
    final = probe_step_predictions(profile, topo, shapes, live)  # with the residual
    errs = probe_step_errors(final, live_wall)
    rows = probe_step_rows(probe_names, live, live_at, live_wall, live_cpu, predicted, final)
    if residual is None:
        return profile, rows, ""
    raw = probe_step_errors(predicted, live_wall)
    ratio = {n: statistics.median(t / p.step_s for p, t, m in zip(predicted, live_wall, live_at) if m == n)
             for n in sorted(set(live_at))}
    said = (f"; the probes' own training steps (collectives, optimizer, a closing barrier; in sample) measured "
            f"{'/'.join(f'x{f:.3f} ({n} processes)' for n, f in ratio.items())} the terms' sum (median; "
            f"error median {statistics.median(raw):.1%}, worst {max(raw):.1%}): the "
            + residual.describe(source=False)
            + f"; with it median error {statistics.median(errs):.1%}, worst {max(errs):.1%}")
    return profile, rows, said
