"""Calibrate compute: kernels, probe models and loops timed on concurrent processes -> a profile.

The measuring half of the step-time model's compute (:mod:`atp_pipeline.planning.steptime`
prices, :mod:`atp_pipeline.planning.profile_fit` fits); ``python train.py stage=calibrate``
(:mod:`atp_pipeline.run.calibration`) runs it after the collectives. What is measured
(:mod:`atp_pipeline.run.compute_measure`): a sweep of kernel shapes per kind; the probe models'
forward and backward with their collectives skipped on every candidate mesh and chunk count (the
framework cost); compute-then-collective loops (sync) and pure collective loops (the collectives'
CPU); the contention factor at 1, 2, ..., ``world`` processes; the probes' whole training steps
on ``world`` and 2 processes (the step residual); and two probes' whole steps the host's speed is
timed against later (:mod:`atp_pipeline.run.retime`). How it is timed:
:mod:`atp_pipeline.run.compute_timing`. Nothing measured is a model, batch or sequence length the
step model then predicts. The profile goes into the calibration file ``stage=calibrate`` writes.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from atp_pipeline.planning.compute_profile import STEPS_GROUP, ComputeProfile
from atp_pipeline.planning.profile_fit import fit_collective_cpu_loops, fit_probe_steps, make_profile, residual_counts
from atp_pipeline.run.compute_measure import (
    CONF,
    PROBES,
    compose_models,
    cpu_loops,
    plan_points,
    probe_entries,
    sweep_kernels,
    sync_patterns,
)
from atp_pipeline.run.compute_timing import measure_all, measure_contention
from atp_pipeline.run.retime import RETIME_STEP_PROBES, time_probe_steps


@dataclass(frozen=True)
class ComputeRun:
    """What one compute calibration measures (:func:`calibrate_compute`)."""

    world: int
    probes: Tuple[str, ...] = tuple(PROBES)
    chunks: Tuple[int, ...] = (1, 2)
    passes: int = 3
    batch_ms: float = 8.0
    quick: bool = False  # a coarser kernel sweep (tests)


def calibrate_compute(run: ComputeRun, topo: Any, name: str, conf: Path = CONF,
                      progress: Optional[Any] = None, probe_steps: Optional[Path] = None) -> ComputeProfile:
    """Measure and fit a compute profile for ``topo`` (its α-β prices the loops' collectives).
    ``progress(phase, done, total)``, if given, is called as measurements finish; ``probe_steps``:
    a JSON file to write the probes' whole steps to (:func:`probe_step_rows`)."""
    import tempfile
    import threading

    from atp_pipeline.run.hostload import wait_quiet

    kernels = sweep_kernels(run.quick)
    built = compose_models(probe_entries(run.probes), conf)
    probe_names = list(run.probes)  # (name ``shapes``, in order)
    shapes = [sh for sh, _ in built]
    plans = plan_points(shapes, run.world, run.chunks)
    patterns = sync_patterns(run.world)
    nsync = len(patterns)
    patterns += cpu_loops(run.world)
    live = list(plans)  # the same probe steps with their collectives (their CPU: CollectiveCPU)
    total = (len(kernels) + len(plans) + len(patterns) + len(live)) * run.passes
    with tempfile.TemporaryDirectory() as tmp:
        tick = Path(tmp) / "progress"
        done = threading.Event()

        def poll() -> None:
            while not done.wait(0.5):
                try:
                    if progress is not None:
                        progress("kernels, probes, loops", min(total, int(tick.read_text() or 0)), total)
                except (OSError, ValueError):
                    pass
        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        try:
            if not run.quick:
                wait_quiet(20.0)  # other jobs' load: wait a while for a quiet host (then passes are checked)
            got, timed, foreign = measure_all(kernels, run.world, run.passes, run.batch_ms, plans=plans,
                                              models=[spec for _, spec in built], patterns=patterns,
                                              progress=str(tick), live=live)
        finally:
            done.set()
            watcher.join()
    if progress is not None:
        progress("kernels, probes, loops", total, total)
    contention, comm_contention = measure_contention(run.world, 2 * run.passes + 1, 4 * run.batch_ms)
    if progress is not None:
        progress("contention", 1, 1)
    # the probes' whole steps on the other process counts of the step residual (their own launch each;
    # a quick calibration: the world's only)
    live_wall = [t.wall for t in timed[len(kernels) + len(plans) + len(patterns):]]
    live_cpu = [t.cpu for t in timed[len(kernels) + len(plans) + len(patterns):]]
    live_at = [run.world] * len(live)
    for count in ([] if run.quick or not live else [c for c in residual_counts(run.world) if c != run.world]):
        extra = plan_points(shapes, count, run.chunks)
        _, timed_c, _ = measure_all([], count, run.passes, run.batch_ms, models=[spec for _, spec in built], live=extra)
        live, live_wall, live_at = ([*live, *extra], [*live_wall, *(t.wall for t in timed_c)],
                                    [*live_at, *[count] * len(extra)])
        live_cpu = [*live_cpu, *(t.cpu for t in timed_c)]
        if progress is not None:
            progress(f"probe steps on {count} processes", 1, 1)
    nk, npl, npa = len(kernels), len(plans), len(patterns)
    # the collectives' backend CPU per call and byte, from the pure collective loops (no rank waits
    # for another's compute there; the probes' live steps stay the in-sample check below)
    collective_cpu = (fit_collective_cpu_loops(patterns, timed[nk + npl:nk + npl + npa])
                      if run.world > 1 else None)
    # kernels and the probes' collective-free steps at a rank's CPU time (what the work costs a
    # core, whatever shares it); the loops at their wall time (their compute priced as the host runs it)
    cpu = [max(t.cpu, 1e-9) for t in timed]
    profile = make_profile(name, kernels, cpu[:nk], run.world, shapes, plans, cpu[nk:nk + npl], topo, patterns[:nsync],
                           got[nk + npl:nk + npl + nsync], contention, probe_names,
                           collective_cpu, kernel_time="cpu", comm_contention=comm_contention)
    # the host's speed at calibration (what calibration.retime times again): two probes' whole steps on
    # each process count of the step residual, in launches of their own as they are timed again
    steps: Dict[str, float] = {}
    steps_probes = [p for p in RETIME_STEP_PROBES if p in probe_names]
    if steps_probes and run.world >= 2:
        counts = [run.world] if run.quick else residual_counts(run.world)
        for i, count in enumerate(counts):
            steps.update(time_probe_steps(steps_probes, count, conf, *((1, 2.0) if run.quick else ())))
            if progress is not None:
                progress("probe steps (the host's speed)", i + 1, len(counts))
    profile = dataclasses.replace(profile, reference={STEPS_GROUP: steps} if steps else {})
    load = f"; other jobs' load in its kept passes {statistics.median(foreign):.2f} cores" if foreign else ""
    if live and topo is not None and getattr(topo, "alpha_beta", None):
        profile, rows, said = fit_probe_steps(profile, topo, shapes, probe_names, live, live_at, live_wall, live_cpu)
        load += said
        if probe_steps is not None:
            probe_steps.write_text(json.dumps({"profile": name, "date": profile.date, "rows": rows}, indent=1) + "\n")
    return dataclasses.replace(profile, source=profile.source + load)


def print_profile(profile: ComputeProfile) -> None:
    """The fitted terms, one line each."""
    grids = profile.kernel_grids()
    for kind, f in profile.fits.items():
        grid = grids.get(kind)
        print(f"  {kind:<14} alpha {f.alpha_s * 1e6:8.1f} us  {f.per_unit_s * 1e9:9.4f} ns/unit"
              + (f"  {f.per_tensor_s * 1e6:.1f} us/tensor" if f.per_tensor_s else "")
              + (f"  (priced on its grid of {len(grid[1])} measured cores, "
                 f"{' x '.join(str(len(a)) for a in grid[0])})" if grid else ""))
    print(f"  peak GEMM throughput {profile.peak_flops / 1e9:.2f} GFLOP/s per process")
    print(f"  {profile.describe(profile.processes)}")
    if profile.contention:
        print("  contention: " + ", ".join(f"{p} processes x{c:.2f}" for p, c in sorted(profile.contention.items())))
    if profile.comm_contention:
        print("  collectives' contention: " + ", ".join(f"{p} processes x{c:.2f}"
                                                       for p, c in sorted(profile.comm_contention.items())))
    check = profile.source.partition("; the probes' own ")[2]
    if check:
        print(f"  the probes' own {check}")

