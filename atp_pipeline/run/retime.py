"""The host's speed now against a calibration's: probe steps and reference kernels timed again.

``stage=plan`` and ``stage=fit`` do this only when asked (``calibration.retime=true``) or when
the calibration is stale (:func:`atp_pipeline.run.calibration.with_calibration`); the step
validation does it around its launches (``--retime``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.compute_profile import (
    STEPS_GROUP,
    ComputeProfile,
    HostSpeed,
    parse_step_label,
    step_label,
    steps_count,
    steps_speed,
)
from atp_pipeline.planning.kernels import GEMM, NORM_BWD, NORM_FWD, POINTWISE, Kernel
from atp_pipeline.planning.profile_fit import Plan, probe_step_predictions, utc_now
from atp_pipeline.run.compute_measure import CONF, compose_models, plan_points, probe_entries
from atp_pipeline.run.compute_timing import measure_all

# The kernel reference probe: a fixed synthetic set of the calibration's own measurements, timed in
# a launch of its own at calibration (recorded in the profile, ``reference``) and again by the step
# validation's ``--retime bracket|group|once``, so a prediction is priced at the host's speed now
# (:class:`~atp_pipeline.planning.compute_profile.HostSpeed`, basis "kernels"; ``stage=plan`` times
# the probes' whole steps instead, :func:`retime_steps`). Never a model, batch or sequence length a user
# plans: kernels at sweep shapes and the smallest probe model's step.
REFERENCE: Dict[str, Tuple[Kernel, ...]] = {
    "compute": (Kernel(GEMM, (512, 256, 256)), Kernel(GEMM, (2048, 64, 256)), Kernel(NORM_FWD, (65536,)),
                Kernel(NORM_BWD, (65536,)), Kernel(POINTWISE, (65536,))),  # rate-bound
    "overhead": (Kernel(GEMM, (32, 16, 16)), Kernel(POINTWISE, (1024,)), Kernel(NORM_FWD, (1024,))),  # per call
}
REFERENCE_STEP = "probe_gpt_s"  # its collective-free step on (world, 1), chunks 1: the framework's per-kernel work
REFERENCE_PASSES, REFERENCE_BATCH_MS = 9, 20.0


def reference_label(k: Kernel) -> str:
    return f"{k.kind} {'x'.join(str(d) for d in k.dims)}"


def reference_probe(world: int, conf: Path = CONF, passes: int = REFERENCE_PASSES,
                    batch_ms: float = REFERENCE_BATCH_MS) -> Dict[str, Dict[str, float]]:
    """Time the reference probe on ``world`` processes at once, as the calibration times its
    kernels (:func:`measure_all`: the same runners, one thread per process, a rank's CPU per
    call, median over interleaved passes, passes under other jobs' load measured again):
    group -> label -> seconds. Its own launch, at calibration and wherever it is timed again."""
    built = compose_models(probe_entries([REFERENCE_STEP]), conf)
    kernels = [k for ks in REFERENCE.values() for k in ks]
    plan: Plan = (0, world, 1, 1)
    _, timed, _ = measure_all(kernels, world, passes, batch_ms, plans=[plan], models=[built[0][1]])
    out: Dict[str, Dict[str, float]] = {g: {} for g in REFERENCE}
    i = 0
    for g, ks in REFERENCE.items():
        for k in ks:
            out[g][reference_label(k)] = max(timed[i].cpu, 1e-9)
            i += 1
    out["overhead"][f"step {REFERENCE_STEP} {world}x1/c1"] = max(timed[i].cpu, 1e-9)
    return out


def retime(profile: ComputeProfile, conf: Path = CONF) -> Any:
    """The host's speed now against the calibration's (:class:`HostSpeed`): the reference probe
    timed again on the calibration's process count; None for a profile without a reference
    (calibrated before it had one: predicted at its calibration's speed, and said so)."""
    from atp_pipeline.planning.host_speed import host_speed

    if not profile.reference:
        return None
    now = reference_probe(profile.processes, conf)
    return host_speed(profile.reference, now, utc_now())


# The probe models whose whole steps are the host's speed on the steps' basis (recorded at
# calibration, timed again before a prediction: ``stage=plan``, the step validation's ``--retime
# steps``): two of the calibration's probes, every mesh and chunk count of the process count, as
# the calibration timed them for the step residual (:func:`_live_runner`).
RETIME_STEP_PROBES = ("probe_gpt_s", "probe_llama")


def time_probe_steps(probes: Sequence[str], processes: int, conf: Path = CONF, passes: int = 3,
                     batch_ms: float = 8.0,
                     built: Optional[List[Tuple[Any, Dict[str, Any]]]] = None) -> Dict[str, float]:
    """``probes``' whole training steps (forward, backward with collectives, optimizer, a closing
    barrier: :func:`_live_runner`, what the step residual is fitted over) on every candidate mesh
    of ``processes`` and chunk count 1 and 2, in a launch of their own (:func:`measure_all`: the
    slowest rank's wall per step, median over interleaved passes): label
    (:func:`~atp_pipeline.planning.compute_profile.step_label`) -> seconds: recorded at calibration,
    and timed again for the host's speed on the steps' basis (:func:`retime_steps`). ``built``: the
    probes as :func:`compose_models` composed them (composed here if None). Probe models only:
    never a model, batch or sequence length a user plans."""
    if processes < 2:
        raise ConfigError(f"probe steps: {processes} processes (the probes' steps need >= 2 to run collectives)")
    built = built or compose_models(probe_entries(probes), conf)
    live = plan_points([sh for sh, _ in built], processes, (1, 2))
    _, timed, _ = measure_all([], processes, passes, batch_ms, models=[spec for _, spec in built], live=live)
    return {step_label(probes[mi], (d1, d2), c, processes): t.wall for (mi, d1, d2, c), t in zip(live, timed)}


@dataclass(frozen=True)
class ProbeSteps:
    """The probe steps the host's speed on ``processes`` processes is timed over (the steps'
    basis): the labels the calibration recorded on the recorded count nearest them
    (:func:`~atp_pipeline.planning.compute_profile.steps_count`), the probes as
    :func:`compose_models` composed them, each label's plan (probe index, mesh, chunks), and the
    calibrated step model's own time for each label (:func:`probe_step_predictions` on the
    calibration's topology, at the calibration's speed)."""

    processes: int
    probes: Tuple[str, ...]
    built: Tuple[Tuple[Any, Dict[str, Any]], ...]
    labels: Tuple[str, ...]
    plans: Tuple[Plan, ...]
    model_s: Dict[str, float]

    def speed(self, now: Mapping[str, float], measured: str) -> HostSpeed:
        """The host's speed from the labels' steps ``now`` over the model's time for them."""
        return steps_speed(self.model_s, now, self.processes, measured)


def probe_steps(profile: ComputeProfile, processes: int, topo: Any, conf: Path = CONF) -> ProbeSteps:
    """The :class:`ProbeSteps` of ``profile`` (its reference's ``steps``) for ``processes``."""
    recorded = dict(profile.reference.get(STEPS_GROUP) or {})
    if not recorded:
        raise ConfigError(f"compute profile '{profile.name}': no probe steps in its reference "
                          f"(calibrate again: python train.py stage=calibrate)")
    n = steps_count(recorded, processes)
    cells = [(label, *parse_step_label(label)) for label in sorted(recorded)]
    cells = [c for c in cells if c[4] == n]
    probes = sorted({probe for _, probe, _, _, _ in cells})
    built = compose_models(probe_entries(probes), conf)
    plans = [(probes.index(probe), mesh[0], mesh[1], c) for _, probe, mesh, c, _ in cells]
    model = probe_step_predictions(profile, topo, [shape for shape, _ in built], plans)
    return ProbeSteps(n, tuple(probes), tuple(built), tuple(c[0] for c in cells), tuple(plans),
                      {label: est.step_s for (label, *_), est in zip(cells, model)})


def retime_steps(profile: ComputeProfile, processes: int, topo: Any, conf: Path = CONF) -> HostSpeed:
    """The host's speed now on the steps' basis (:func:`~atp_pipeline.planning.compute_profile.steps_speed`):
    the probe steps the calibration recorded (its reference's ``steps``) on the recorded process
    count nearest ``processes`` (ties: the larger) timed again (:func:`time_probe_steps`), over the
    calibrated step model's own time for them (:func:`probe_steps`). The model was fitted to these probes'
    steps interleaved through the calibration's main launch, so the ratio carries the host's speed
    now against the calibration's whole launch, not against the one short launch that recorded the
    steps, whose own level can read x0.78-1.39 the model's."""
    ps = probe_steps(profile, processes, topo, conf)
    now = time_probe_steps(list(ps.probes), ps.processes, conf, built=list(ps.built))
    return ps.speed(now, utc_now())
