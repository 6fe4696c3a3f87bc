"""The host's speed now against a calibration's: the probe models' whole steps it recorded timed again.

``stage=plan`` and ``stage=fit`` do this only when asked (``calibration.retime=true``) or when
the calibration is stale (:func:`atp_pipeline.run.calibration.with_calibration`); the step
validation times the same steps inside its launches (:func:`probe_steps`, ``--retime launch``).
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
from atp_pipeline.planning.profile_fit import Plan, probe_step_predictions, utc_now
from atp_pipeline.run.compute_measure import CONF, compose_models, plan_points, probe_entries
from atp_pipeline.run.compute_timing import measure_all

# The probe models whose whole steps are the host's speed (recorded at calibration, timed again
# before a prediction: ``stage=plan``): two of the calibration's probes, every mesh and chunk count
# of the process count, as the calibration timed them for the step residual (:func:`_live_runner`).
RETIME_STEP_PROBES = ("probe_gpt_s", "probe_llama")


def time_probe_steps(probes: Sequence[str], processes: int, conf: Path = CONF, passes: int = 3,
                     batch_ms: float = 8.0,
                     built: Optional[List[Tuple[Any, Dict[str, Any]]]] = None) -> Dict[str, float]:
    """``probes``' whole training steps (forward, backward with collectives, optimizer, a closing
    barrier: :func:`_live_runner`, what the step residual is fitted over) on every candidate mesh
    of ``processes`` and chunk count 1 and 2, in a launch of their own (:func:`measure_all`: the
    slowest rank's wall per step, median over interleaved passes): label
    (:func:`~atp_pipeline.planning.compute_profile.step_label`) -> seconds: recorded at calibration,
    and timed again for the host's speed (:func:`retime_steps`). ``built``: the
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
    """The probe steps the host's speed on ``processes`` processes is timed over: the labels the
    calibration recorded on the recorded count nearest them
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
    """The host's speed now (:func:`~atp_pipeline.planning.compute_profile.steps_speed`):
    the probe steps the calibration recorded (its reference's ``steps``) on the recorded process
    count nearest ``processes`` (ties: the larger) timed again (:func:`time_probe_steps`), over the
    calibrated step model's own time for them (:func:`probe_steps`). The model was fitted to these probes'
    steps interleaved through the calibration's main launch, so the ratio carries the host's speed
    now against the calibration's whole launch, not against the one short launch that recorded the
    steps, whose own level can read x0.78-1.39 the model's."""
    ps = probe_steps(profile, processes, topo, conf)
    now = time_probe_steps(list(ps.probes), ps.processes, conf, built=list(ps.built))
    return ps.speed(now, utc_now())
